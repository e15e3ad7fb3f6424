// Fingerprint interning (rendezvous/fingerprint_table.h): identical fingerprints are kept once,
// every holder still reads exactly what was sent, and an entry goes with its last holder. The
// state machine's use of it is tested in test_state.cpp ("env check: ... interned ...").
#include <doctest/doctest.h>

#include <memory>

#include "rendezvous/fingerprint_table.h"

using namespace ddp::rdzv;
using nlohmann::json;

namespace {

json gpu_fingerprint(const std::string& torch) {
  return {
      {"machine", {{"arch", "x86_64"}, {"os", "Debian GNU/Linux 12 (bookworm)"}, {"glibc", "2.36"}}},
      {"gpu", {{"count", 8}, {"models", std::vector<std::string>(8, "NVIDIA H100 80GB HBM3")}}},
      {"python", {{"version", "3.11.2"}, {"torch", torch}, {"nccl", "2.18.1"}}},
      {"env", {{"NCCL_SOCKET_IFNAME", "eth0"}}},
  };
}

}  // namespace

TEST_CASE("identical fingerprints are interned once; distinct ones stay apart") {
  FingerprintTable table;
  FingerprintTable::Ref a = table.intern(gpu_fingerprint("2.1.0"));
  FingerprintTable::Ref b = table.intern(gpu_fingerprint("2.1.0"));
  FingerprintTable::Ref c = table.intern(gpu_fingerprint("2.2.0"));
  CHECK(a.get() == b.get());
  CHECK(a.get() != c.get());
  CHECK(table.size() == 2);
  CHECK(*c == gpu_fingerprint("2.2.0"));
  b.reset();
  CHECK(table.size() == 2);
  a.reset();
  CHECK(table.size() == 1);  // the last holder took its entry with it
  c.reset();
  CHECK(table.size() == 0);
}

TEST_CASE("values equal to nlohmann but printed differently are not shared") {
  FingerprintTable table;
  auto one = table.intern({{"v", 1}});
  auto one_float = table.intern({{"v", 1.0}});
  auto zero = table.intern({{"v", 0.0}});
  auto minus_zero = table.intern({{"v", -0.0}});
  CHECK(one.get() != one_float.get());
  CHECK(zero.get() != minus_zero.get());
  CHECK(one->dump() == R"({"v":1})");
  CHECK(one_float->dump() == R"({"v":1.0})");
  CHECK(minus_zero->dump() == R"({"v":-0.0})");
  CHECK(table.size() == 4);
  CHECK(identical_json(json::parse(R"({"a":[1,"x",{"b":null}]})"), json::parse(R"({"a":[1,"x",{"b":null}]})")));
  CHECK_FALSE(identical_json(json::parse(R"({"a":[1,"x"]})"), json::parse(R"({"a":[1,"y"]})")));
  CHECK_FALSE(identical_json(json::parse(R"({"a":1})"), json::parse(R"({"b":1})")));
}

TEST_CASE("an empty fingerprint costs no entry, and a copy may outlive its table") {
  FingerprintTable::Ref kept;
  {
    FingerprintTable table;
    CHECK(table.intern(json::object()) == nullptr);
    CHECK(FingerprintTable::read(nullptr) == json::object());
    kept = table.intern(gpu_fingerprint("2.1.0"));
    CHECK(table.size() == 1);
  }
  CHECK((*kept)["python"]["torch"] == "2.1.0");
  kept.reset();  // its deleter finds no table: nothing to take out
}

TEST_CASE("past a few fingerprints of one hash, a further one keeps its own copy") {
  // Values that share a hash, as an attacker would craft: nlohmann hashes a float by its value, so
  // 0.0 and -0.0 collide; nested in arrays of several lengths they make distinct fingerprints.
  FingerprintTable table;
  std::vector<FingerprintTable::Ref> held;
  for (std::size_t i = 0; i <= FingerprintTable::kMaxSameHash; ++i) {
    json fp = {{"v", json::array()}};
    for (std::size_t bit = 0; bit < 4; ++bit) fp["v"].push_back((i >> bit) & 1 ? -0.0 : 0.0);
    held.push_back(table.intern(fp));
    CHECK(*held.back() == fp);
    CHECK(held.back()->dump() == fp.dump());
  }
  CHECK(table.size() == FingerprintTable::kMaxSameHash);
  held.clear();
  CHECK(table.size() == 0);
}
