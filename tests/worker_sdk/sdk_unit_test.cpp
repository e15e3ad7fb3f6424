// Unit tests of the worker SDK's pure parts: environment rules, sampler arithmetic,
// checkpoint file format and directory handling. One TU on purpose (torch headers are slow).
// Torch pulls in glog, whose CHECK* macros would shadow doctest's: include torch first, drop
// glog's, then include doctest.
#include "ddp/worker_sdk.h"
#include "sha256.h"  // the SDK's own (worker_sdk/src), not part of its installed headers
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <set>
#include <thread>

namespace fs = std::filesystem;

namespace {

ddp::WorkerEnv env_of(const std::map<std::string, std::string>& vars) {
  return ddp::WorkerEnv::from_lookup([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string env_error(const std::map<std::string, std::string>& vars) {
  try {
    env_of(vars);
  } catch (const ddp::EnvError& e) {
    return e.what();
  }
  return "";
}

const std::map<std::string, std::string> kTwoWorkers = {
    {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
    {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/ddp-sdk-test-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE("no launcher variables means a single process of world size 1") {
  auto env = env_of({});
  CHECK_FALSE(env.launched);
  CHECK(env.rank == 0);
  CHECK(env.world_size == 1);
  CHECK_FALSE(env.distributed());
}

TEST_CASE("a full torchrun environment is read") {
  auto vars = kTwoWorkers;
  vars["TORCHELASTIC_RESTART_COUNT"] = "3";
  vars["DDPLAUNCH_GENERATION"] = "7";
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  auto env = env_of(vars);
  CHECK(env.launched);
  CHECK(env.rank == 1);
  CHECK(env.world_size == 2);
  CHECK(env.local_rank == 1);
  CHECK(env.master_addr == "127.0.0.1");
  CHECK(env.master_port == 29500);
  CHECK(env.restart_count == 3);
  CHECK(env.generation == 7);
  CHECK(env.use_agent_store);
}

TEST_CASE("a partial environment names the missing variables") {
  const auto msg = env_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  CHECK(msg.find("MASTER_ADDR") != std::string::npos);
  CHECK(msg.find("MASTER_PORT") != std::string::npos);
  CHECK(env_error({{"RANK", "0"}}).find("WORLD_SIZE is missing") != std::string::npos);
}

TEST_CASE("inconsistent or non-numeric values are rejected with the variable named") {
  auto vars = kTwoWorkers;
  vars["RANK"] = "2";
  CHECK(env_error(vars).find("RANK=2 is outside [0, WORLD_SIZE=2)") != std::string::npos);
  vars = kTwoWorkers;
  vars["WORLD_SIZE"] = "two";
  CHECK(env_error(vars).find("WORLD_SIZE='two' is not an integer") != std::string::npos);
  vars = kTwoWorkers;
  vars["RANK"] = "1 ";
  CHECK(env_error(vars).find("RANK='1 ' is not an integer") != std::string::npos);
  vars = kTwoWorkers;
  vars["MASTER_PORT"] = "70000";
  CHECK(env_error(vars).find("MASTER_PORT=70000") != std::string::npos);
  vars = kTwoWorkers;
  vars["LOCAL_RANK"] = "2";
  CHECK(env_error(vars).find("LOCAL_RANK=2") != std::string::npos);
  vars = kTwoWorkers;
  vars["WORLD_SIZE"] = "0";
  CHECK(env_error(vars).find("WORLD_SIZE=0") != std::string::npos);
}

TEST_CASE("LOCAL_RANK and LOCAL_WORLD_SIZE default to RANK and WORLD_SIZE") {
  auto env = env_of({{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 3);
  auto single = env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  CHECK(single.launched);
  CHECK_FALSE(single.distributed());
}

TEST_CASE("crc32c matches the standard check value and continues across chunks") {
  const std::string text = "123456789";
  CHECK(ddp::crc32c(text.data(), text.size()) == 0xE3069283u);
  const std::string big(100003, 'x');
  const uint32_t whole = ddp::crc32c(big.data(), big.size());
  const uint32_t split = ddp::crc32c(big.data() + 777, big.size() - 777, ddp::crc32c(big.data(), 777));
  CHECK(whole == split);
}

TEST_CASE("the portable crc32c (slicing-by-8) agrees with the dispatched one at any length and alignment") {
  CHECK(ddp::crc32c_portable("123456789", 9) == 0xE3069283u);
  std::string data(4099, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  for (size_t start : {0, 1, 3, 7}) {
    for (size_t length : {0, 1, 7, 8, 9, 63, 64, 4000}) {
      CHECK(ddp::crc32c_portable(data.data() + start, length, 0x1234u) ==
            ddp::crc32c(data.data() + start, length, 0x1234u));
    }
  }
}

TEST_CASE("sha256 matches the FIPS 180-4 test vectors, fed whole or in pieces") {
  CHECK(ddp::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(ddp::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  CHECK(ddp::sha256_hex(two_blocks) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  CHECK(ddp::sha256_hex(million) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  for (size_t piece : {1, 3, 55, 56, 63, 64, 65, 1000}) {  // every block-boundary case of update()
    ddp::Sha256 hash;
    for (size_t at = 0; at < 5000; at += piece) hash.update(million.data() + at, std::min(piece, 5000 - at));
    CHECK(hash.hex_digest() == ddp::sha256_hex(million.data(), 5000));
  }
  TempDir dir;
  const std::string path = (dir.path / "f").string();
  { std::ofstream(path, std::ios::binary) << million; }
  CHECK(ddp::sha256_file(path) == ddp::sha256_hex(million));
  CHECK_THROWS_WITH_AS(ddp::sha256_file(path + ".missing"), doctest::Contains("f.missing: No such file"), ddp::Error);
  CHECK(ddp::program_sha256() == ddp::sha256_file("/proc/self/exe"));
}

namespace {

ddp::Lineage lineage_of(std::string env, std::string program, std::string version, int64_t world) {
  return ddp::Lineage{std::move(env), std::move(program), std::move(version), world};
}

ddp::CheckpointState recorded(const ddp::Lineage& lineage) {
  ddp::CheckpointState state;
  ddp::record_lineage(state, lineage);
  return state;
}

}  // namespace

TEST_CASE("a checkpoint's lineage is compared field by field with the resuming process") {
  const std::string a(64, 'a'), b(64, 'b'), p(64, '1'), q(64, '2');
  const auto now = lineage_of(a, p, "0.1.0", 2);
  SUBCASE("the same lineage says nothing") {
    const auto check = ddp::check_lineage(recorded(now), now, true, "C");
    CHECK(check.notices.empty());
    CHECK(check.refusal.empty());
  }
  SUBCASE("each differing field is one line naming the field, its value then and now") {
    const auto check = ddp::check_lineage(recorded(lineage_of(a, q, "0.0.9", 3)), now, true, "C");
    CHECK(check.refusal.empty());
    REQUIRE(check.notices.size() == 3);
    CHECK(check.notices[0] == "lineage of checkpoint C: world_size was 3, now 2: resuming; the sampler splits the rest "
                              "of the epoch over 2 ranks, every sample once");
    CHECK(check.notices[1] == "lineage of checkpoint C: program_sha256 was 2222222222222222, now 1111111111111111: "
                              "another build of the program wrote it; resuming");
    CHECK(check.notices[2] == "lineage of checkpoint C: version was ddplaunch 0.0.9, now ddplaunch 0.1.0; resuming");
  }
  SUBCASE("another environment is a warning, or under strict a refusal with the ways out") {
    const auto warned = ddp::check_lineage(recorded(lineage_of(b, p, "0.1.0", 2)), now, false, "C");
    CHECK(warned.refusal.empty());
    REQUIRE(warned.notices.size() == 1);
    CHECK(warned.notices[0].find("env_fingerprint was bbbbbbbbbbbbbbbb, now aaaaaaaaaaaaaaaa: it was written in another "
                                 "environment") != std::string::npos);
    const auto refused = ddp::check_lineage(recorded(lineage_of(b, p, "0.1.0", 2)), now, true, "C");
    CHECK(refused.notices.empty());
    CHECK(refused.refusal.find("refusing to resume from checkpoint C: it was written in another environment "
                               "(env_fingerprint was bbbbbbbbbbbbbbbb, now aaaaaaaaaaaaaaaa") == 0);
    CHECK(refused.refusal.find("pass --env_check=warn to resume anyway") != std::string::npos);
    CHECK(refused.refusal.find('\n') == std::string::npos);
  }
  SUBCASE("a fingerprint or program hash unknown on one side is named, not compared, never refused") {
    for (const auto& [then, current] : {std::pair{lineage_of("", "", "0.1.0", 2), now},
                                        std::pair{now, lineage_of("", "", "0.1.0", 2)}}) {
      const auto check = ddp::check_lineage(recorded(then), current, true, "C");
      CHECK(check.refusal.empty());
      REQUIRE(check.notices.size() == 2);
      CHECK(check.notices[0].find("not compared") != std::string::npos);
      CHECK(check.notices[1].find("program_sha256") != std::string::npos);
      CHECK(check.notices[1].find("not compared") != std::string::npos);
    }
  }
  SUBCASE("a checkpoint from before lineage says so once, and still names a world-size change") {
    ddp::CheckpointState old;
    old.put_int("ddp.world_size", 3);
    const auto check = ddp::check_lineage(old, now, true, "C");
    CHECK(check.refusal.empty());
    REQUIRE(check.notices.size() == 2);
    CHECK(check.notices[0].find("world_size was 3, now 2") != std::string::npos);
    CHECK(check.notices[1] == "checkpoint C carries no lineage (written before checkpoints recorded one): its "
                              "environment, program and ddplaunch version are not compared");
  }
}

TEST_CASE("the current lineage is this process's environment, executable and version") {
  ::setenv("DDPLAUNCH_ENV_FINGERPRINT", "f00d", 1);
  ::setenv("DDPLAUNCH_ENV_CHECK", "warn", 1);
  auto lineage = ddp::current_lineage(4);
  CHECK(lineage.env_fingerprint == "f00d");
  CHECK(lineage.program_sha256.size() == 64);
  CHECK(lineage.version == std::string(DDPLAUNCH_EXPECTED_VERSION));
  CHECK(lineage.world_size == 4);
  CHECK_FALSE(ddp::env_check_strict());
  ::setenv("DDPLAUNCH_ENV_CHECK", "strict", 1);
  CHECK(ddp::env_check_strict());
  ::unsetenv("DDPLAUNCH_ENV_FINGERPRINT");
  ::unsetenv("DDPLAUNCH_ENV_CHECK");
  CHECK(ddp::current_lineage(1).env_fingerprint.empty());
  CHECK_FALSE(ddp::env_check_strict());
}

TEST_CASE("sampler shards match torch.utils.data.DistributedSampler") {
  // Reference values printed by PyTorch 1.13's DistributedSampler (10 samples, 3 replicas).
  ddp::DistributedSampler unshuffled(10, 1, 3, {false, 0, false});
  using V = std::vector<int64_t>;
  CHECK(unshuffled.shard() == V({1, 4, 7, 0}));
  ddp::DistributedSampler shuffled(10, 1, 3, {true, 7, false});
  CHECK(shuffled.shard() == V({0, 1, 6, 5}));
  shuffled.set_epoch(3);
  CHECK(shuffled.shard() == V({4, 3, 8, 7}));
  ddp::DistributedSampler dropping(10, 2, 3, {true, 7, true});
  CHECK(dropping.shard() == V({3, 7, 8}));
  CHECK(ddp::DistributedSampler::permutation(10, true, 7, 0) == V({5, 0, 3, 4, 1, 7, 9, 6, 8, 2}));
}

TEST_CASE("sampler batches advance the global position by world size times batch") {
  ddp::DistributedSampler s(100, 0, 4, {true, 1, false});
  CHECK(s.batches_remaining(8) == 4);  // 25 per rank
  CHECK(s.next_batch(8).size() == 8);
  CHECK(s.position().consumed == 32);
  s.next_batch(8);
  s.next_batch(8);
  CHECK(s.next_batch(8).size() == 1);
  CHECK(s.epoch_done());
  CHECK(s.position().consumed == 100);
  CHECK(s.next_batch(8).empty());
}

TEST_CASE("resuming at another world size uses every remaining sample exactly once") {
  for (int64_t n : {60, 61, 97}) {
    for (int w1 : {1, 2, 3, 4}) {
      for (int w2 : {1, 2, 3, 5}) {
        for (int64_t steps : {0, 1, 3}) {
          const int64_t batch = 4;
          std::multiset<int64_t> used;
          ddp::SamplerPosition pos;
          for (int r = 0; r < w1; ++r) {
            ddp::DistributedSampler s(n, r, w1, {true, 11, false});
            s.set_epoch(2);
            for (int64_t k = 0; k < steps; ++k) {
              for (auto i : s.next_batch(batch)) used.insert(i);
            }
            pos = s.position();
          }
          CHECK(pos.epoch == 2);
          std::multiset<int64_t> rest;
          for (int r = 0; r < w2; ++r) {
            ddp::DistributedSampler s(n, r, w2, {true, 11, false});
            s.restore(pos);
            while (!s.epoch_done()) {
              for (auto i : s.next_batch(batch)) rest.insert(i);
            }
          }
          // Padding repeats only samples of the resumed part, and only to fill the shards.
          std::set<int64_t> all(used.begin(), used.end());
          all.insert(rest.begin(), rest.end());
          CAPTURE(n); CAPTURE(w1); CAPTURE(w2); CAPTURE(steps);
          CHECK(static_cast<int64_t>(all.size()) == n);
          const int64_t remaining = n - pos.consumed;
          const int64_t padded = (remaining + w2 - 1) / w2 * w2;
          CHECK(static_cast<int64_t>(rest.size()) == padded);
          for (auto i : used) CHECK(rest.count(i) == 0);
        }
      }
    }
  }
}

TEST_CASE("a saved position outside the data set is rejected") {
  ddp::DistributedSampler s(10, 0, 1, {});
  CHECK_THROWS_AS(s.restore({0, 11}), ddp::UsageError);
}

TEST_CASE("a checkpoint file round-trips and detects corruption and truncation") {
  TempDir dir;
  const std::string path = (dir.path / "x.ddpckpt").string();
  std::string payload(5000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 31);
  ddp::write_checkpoint_file(path, payload);
  CHECK(fs::file_size(path) == payload.size() + ddp::kCheckpointHeaderSize);
  CHECK(ddp::read_checkpoint_file(path) == payload);
  for (const auto& entry : fs::directory_iterator(dir.path)) {
    CHECK(entry.path().filename().string().find(".tmp") == std::string::npos);
  }

  {  // flip one payload byte
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  CHECK_THROWS_WITH_AS(ddp::read_checkpoint_file(path), doctest::Contains("checksum mismatch"),
                       ddp::CheckpointError);
  ddp::write_checkpoint_file(path, payload);
  fs::resize_file(path, 3000);
  CHECK_THROWS_WITH_AS(ddp::read_checkpoint_file(path), doctest::Contains("truncated"),
                       ddp::CheckpointError);
  fs::resize_file(path, 10);
  CHECK_THROWS_WITH_AS(ddp::read_checkpoint_file(path), doctest::Contains("truncated"),
                       ddp::CheckpointError);
  { std::ofstream(path) << "not a checkpoint at all, just text"; }
  CHECK_THROWS_WITH_AS(ddp::read_checkpoint_file(path), doctest::Contains("bad magic"),
                       ddp::CheckpointError);
}

TEST_CASE("a checkpoint state round-trips tensors of every dtype, shape and layout, and scalars") {
  TempDir dir;
  const std::string path = (dir.path / "s.ddpckpt").string();
  ddp::CheckpointState state;
  auto f32 = torch::randn({3, 5});
  auto f64 = torch::randn({7}, torch::kDouble);
  auto strided = torch::arange(24, torch::kLong).view({4, 6}).t();  // not contiguous
  auto bytes = torch::randint(0, 255, {13}, torch::kUInt8);          // odd length: padding
  auto flags = torch::tensor({true, false, true});
  auto half = torch::randn({2, 2}).to(torch::kHalf);
  auto scalar = torch::tensor(3.5);
  auto empty = torch::zeros({0, 4});
  state.put("f32", f32);
  state.put("f64", f64);
  state.put("strided", strided);
  state.put("bytes", bytes);
  state.put("flags", flags);
  state.put("half", half);
  state.put("scalar", scalar);
  state.put("empty", empty);
  state.put_int("step", -42);
  state.put_double("lr", 0.125);
  state.put_bytes("name", std::string("a\0b", 3));
  ddp::write_checkpoint(path, state);
  for (const auto& entry : fs::directory_iterator(dir.path)) {
    CHECK(entry.path().filename().string().find(".tmp") == std::string::npos);
  }
  const ddp::CheckpointState loaded = ddp::read_checkpoint(path);
  CHECK((loaded.keys() == state.keys()));
  for (const char* key : {"f32", "f64", "strided", "bytes", "flags", "half", "scalar", "empty"}) {
    CAPTURE(key);
    const auto& t = loaded.tensor(key);
    CHECK((t.scalar_type() == state.tensor(key).scalar_type()));
    CHECK((t.sizes() == state.tensor(key).sizes()));
    CHECK(torch::equal(t, state.tensor(key)));
    if (t.numel() > 0) CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0);
  }
  CHECK(loaded.get_int("step") == -42);
  CHECK(loaded.get_double("lr") == 0.125);
  CHECK(loaded.get_bytes("name") == std::string("a\0b", 3));
  CHECK_THROWS_WITH_AS(loaded.tensor("missing"), doctest::Contains("'missing'"),
                       ddp::CheckpointError);
  CHECK_THROWS_WITH_AS(loaded.get_int("lr"), doctest::Contains("expected an integer"),
                       ddp::CheckpointError);

  const auto size = fs::file_size(path);
  {  // flip one byte of tensor data near the end
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 20));
    f.put('\x5a');
  }
  CHECK_THROWS_WITH_AS(ddp::read_checkpoint(path), doctest::Contains("checksum mismatch"),
                       ddp::CheckpointError);
  ddp::write_checkpoint(path, state);
  fs::resize_file(path, size - 1);
  CHECK_THROWS_WITH_AS(ddp::read_checkpoint(path), doctest::Contains("truncated"),
                       ddp::CheckpointError);
}

TEST_CASE("a state encoded in memory is the bytes of its file and decodes to the same entries") {
  TempDir dir;
  const std::string path = (dir.path / "m.ddpckpt").string();
  ddp::CheckpointState state;
  state.put("weights", torch::randn({4, 3}));
  state.put("strided", torch::arange(12, torch::kLong).view({3, 4}).t());
  state.put_int("ddp.step", 17);
  state.put_double("lr", 0.5);
  state.put_bytes("archive", std::string("x\0y", 3));
  const torch::Tensor bytes = ddp::encode_checkpoint(state);
  REQUIRE((bytes.scalar_type() == torch::kUInt8));
  ddp::write_checkpoint(path, state);
  REQUIRE(static_cast<uintmax_t>(bytes.numel()) == fs::file_size(path));
  std::ifstream f(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(std::memcmp(file.data(), bytes.data_ptr(), file.size()) == 0);

  const ddp::CheckpointState decoded = ddp::decode_checkpoint(bytes, "the state rank 0 sent");
  CHECK((decoded.keys() == state.keys()));
  CHECK(torch::equal(decoded.tensor("weights"), state.tensor("weights")));
  CHECK(torch::equal(decoded.tensor("strided"), state.tensor("strided")));
  CHECK(decoded.get_int("ddp.step") == 17);
  CHECK(decoded.get_double("lr") == 0.5);
  CHECK(decoded.get_bytes("archive") == std::string("x\0y", 3));

  torch::Tensor damaged = bytes.clone();
  damaged[damaged.numel() - 3] = static_cast<uint8_t>(damaged[damaged.numel() - 3].item<uint8_t>() ^ 0x40);
  CHECK_THROWS_WITH_AS(ddp::decode_checkpoint(damaged, "the state rank 0 sent"),
                       doctest::Contains("the state rank 0 sent: checksum mismatch"), ddp::CheckpointError);
  CHECK_THROWS_WITH_AS(ddp::decode_checkpoint(bytes.narrow(0, 0, 10), "the state rank 0 sent"),
                       doctest::Contains("truncated"), ddp::CheckpointError);
  CHECK_THROWS_WITH_AS(ddp::decode_checkpoint(torch::zeros({8}), "x"), doctest::Contains("byte tensor"),
                       ddp::CheckpointError);
}

TEST_CASE("the manager keeps the last K and falls back past a corrupt newest checkpoint") {
  TempDir dir;
  std::vector<std::string> messages;
  ddp::CheckpointManager manager({dir.path.string(), 2}, 0,
                                 [&](const std::string& m) { messages.push_back(m); });
  for (int64_t step : {10, 20, 30}) {
    torch::serialize::OutputArchive archive;
    archive.write("value", torch::full({3}, static_cast<float>(step)));
    manager.save(step, archive);
  }
  auto files = manager.list();
  REQUIRE(files.size() == 2);
  CHECK(files[0].first == 30);
  CHECK(files[1].first == 20);

  {  // corrupt the newest
    std::fstream f(files[0].second, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(ddp::kCheckpointHeaderSize + 40);
    f.put('\x01');
    f.put('\x02');
  }
  auto loaded = manager.load_latest();
  REQUIRE(loaded.has_value());
  CHECK(loaded->step == 20);
  torch::Tensor value;
  loaded->archive->read("value", value);
  CHECK(value[0].item<float>() == 20.0f);
  REQUIRE(messages.size() == 1);
  CHECK(messages[0].find(files[0].second) != std::string::npos);
  CHECK(messages[0].find("warning") != std::string::npos);

  fs::resize_file(files[1].second, 50);
  messages.clear();
  CHECK_FALSE(manager.load_latest().has_value());
  REQUIRE(messages.size() == 3);
  CHECK(messages[2].find("no valid checkpoint") != std::string::npos);
  CHECK(messages[2].find("starting fresh") != std::string::npos);
}

TEST_CASE("a host copy owns its tensors and reuses the memory of a recycled copy") {
  auto weight = torch::arange(12, torch::kFloat32).reshape({3, 4});
  ddp::CheckpointState live;
  live.put("model/weight", weight);
  live.put("model/transposed", weight.t());  // not contiguous
  live.put_int("ddp.step", 7);
  live.put_double("lr", 0.5);
  live.put_bytes("blob", "abc");
  ddp::CheckpointState copy = ddp::host_copy(live);
  weight.add_(100);  // training goes on
  CHECK(copy.tensor("model/weight").equal(torch::arange(12, torch::kFloat32).reshape({3, 4})));
  CHECK(copy.tensor("model/transposed").equal(torch::arange(12, torch::kFloat32).reshape({3, 4}).t()));
  CHECK(copy.tensor("model/transposed").is_contiguous());
  CHECK(copy.get_int("ddp.step") == 7);
  CHECK(copy.get_double("lr") == 0.5);
  CHECK(copy.get_bytes("blob") == "abc");

  const void* memory = copy.tensor("model/weight").data_ptr();
  ddp::CheckpointState again = ddp::host_copy(live, std::move(copy));
  CHECK(again.tensor("model/weight").data_ptr() == memory);
  CHECK(again.tensor("model/weight").equal(weight));

  ddp::CheckpointState grown;
  grown.put("model/weight", torch::zeros({5}));
  ddp::CheckpointState fresh = ddp::host_copy(grown, std::move(again));  // another shape: new memory
  CHECK(fresh.tensor("model/weight").sizes() == torch::IntArrayRef{5});
}

TEST_CASE("the async writer runs one write at a time and reports each result or error once") {
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::vector<int64_t> written;
  ddp::AsyncCheckpointWriter writer(
      [&](int64_t step, const ddp::CheckpointState& state, const std::function<void(const std::string&)>& log) {
        if (step == 1) gate.wait();
        if (step == 2) throw ddp::CheckpointError("write checkpoint step 2: No space left on device");
        log("notice of step " + std::to_string(step));
        written.push_back(state.get_int("ddp.step"));
        return "path-" + std::to_string(step);
      });
  auto state_of = [](int64_t step) {
    ddp::CheckpointState state;
    state.put_int("ddp.step", step);
    return state;
  };
  CHECK_FALSE(writer.busy());
  CHECK_FALSE(writer.poll().has_value());
  writer.start(1, state_of(1));
  CHECK(writer.busy());
  CHECK_THROWS_WITH_AS(writer.start(2, state_of(2)), doctest::Contains("at most one at a time"), ddp::UsageError);
  CHECK_FALSE(writer.poll().has_value());  // in flight
  release.set_value();
  auto done = writer.wait();
  REQUIRE(done.has_value());
  CHECK(done->step == 1);
  CHECK(done->path == "path-1");
  CHECK(done->notices == std::vector<std::string>{"notice of step 1"});
  CHECK(done->snapshot.get_int("ddp.step") == 1);
  CHECK_FALSE(writer.busy());
  CHECK_FALSE(writer.wait().has_value());  // reported once

  writer.start(2, state_of(2));
  CHECK_THROWS_WITH_AS(writer.wait(), doctest::Contains("No space left on device"), ddp::CheckpointError);
  CHECK_FALSE(writer.poll().has_value());  // the error is reported once

  writer.start(3, state_of(3));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (writer.busy() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  REQUIRE_FALSE(writer.busy());
  CHECK_THROWS_WITH_AS(writer.start(4, state_of(4)), doctest::Contains("not collected"), ddp::UsageError);
  auto third = writer.poll();
  REQUIRE(third.has_value());
  CHECK(third->step == 3);
  CHECK(written == std::vector<int64_t>{1, 3});
}

TEST_CASE("a background write of a host copy is the same file as a synchronous write of the live state") {
  TempDir dir;
  auto weight = torch::randn({64, 32});
  ddp::CheckpointState live;
  live.put_int("ddp.step", 10);
  live.put("model/weight", weight);
  ddp::CheckpointManager sync_manager({(dir.path / "sync").string(), 3}, 0, [](const std::string&) {});
  const std::string sync_path = sync_manager.save(10, live);
  ddp::AsyncCheckpointWriter writer([&](int64_t step, const ddp::CheckpointState& state,
                                        const std::function<void(const std::string&)>& log) {
    ddp::CheckpointManager manager({(dir.path / "async").string(), 3}, 0, log);
    return manager.save(step, state);
  });
  writer.start(10, ddp::host_copy(live));
  weight.zero_();  // the live state changes while the copy is written
  auto done = writer.wait();
  REQUIRE(done.has_value());
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  CHECK(fs::path(done->path).filename() == fs::path(sync_path).filename());
  CHECK(read(done->path) == read(sync_path));
}

TEST_CASE("a background save's copy can finish on the writer thread, and wait_copied waits for it") {
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::vector<float> written;
  ddp::AsyncCheckpointWriter writer([&](int64_t, const ddp::CheckpointState& state, const std::function<void(const std::string&)>&) {
    written.push_back(state.tensor("model/weight")[0].item<float>());
    return std::string("path");
  });
  auto weight = torch::full({4}, 1.0f);
  auto buffer = torch::full({2}, 7.0f);
  ddp::CheckpointState live;
  live.put("model/weight", weight);
  live.put("model/running_mean", buffer);
  auto later = [](const ddp::CheckpointState::Entry& e) { return e.key == "model/weight"; };
  // The part copied now: the buffer is a copy, the weight still the live tensor.
  ddp::CheckpointState partial = ddp::host_copy(live, {}, [&](const ddp::CheckpointState::Entry& e) { return !later(e); });
  CHECK(partial.tensor("model/weight").data_ptr() == weight.data_ptr());
  CHECK(partial.tensor("model/running_mean").data_ptr() != buffer.data_ptr());
  buffer.fill_(8.0f);  // the next forward changes a buffer at once
  writer.start(3, std::move(partial), [&](ddp::CheckpointState rest) {
    gate.wait();
    return ddp::host_copy(rest, {}, later);
  });
  auto copied = std::async(std::launch::async, [&] { writer.wait_copied(); });
  CHECK(copied.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout);
  release.set_value();
  REQUIRE(copied.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  weight.fill_(2.0f);  // the update after the copy does not reach the checkpoint
  auto done = writer.wait();
  REQUIRE(done.has_value());
  CHECK(written == std::vector<float>{1.0f});
  CHECK(done->snapshot.tensor("model/weight").data_ptr() != weight.data_ptr());
  CHECK(done->snapshot.tensor("model/running_mean")[0].item<float>() == 7.0f);
  writer.wait_copied();  // nothing in flight: returns at once

  writer.start(4, ddp::CheckpointState(), [](ddp::CheckpointState) -> ddp::CheckpointState {
    throw ddp::CheckpointError("copy failed: out of memory");
  });
  writer.wait_copied();  // a failed copy ends the wait too
  CHECK_THROWS_WITH_AS(writer.wait(), doctest::Contains("out of memory"), ddp::CheckpointError);
  CHECK(written.size() == 1);  // nothing written after a failed copy
}

TEST_CASE("only rank 0 writes checkpoints") {
  TempDir dir;
  ddp::CheckpointManager manager({dir.path.string(), 3}, 1, [](const std::string&) {});
  torch::serialize::OutputArchive archive;
  archive.write("value", torch::ones({1}));
  CHECK(manager.save(5, archive).empty());
  CHECK(manager.list().empty());
}

TEST_CASE("a single-process group trains without a store and averages nothing") {
  auto group = ddp::ProcessGroup::create(env_of({}));
  CHECK(group->world_size() == 1);
  CHECK(group->backend_name() == "none");
  auto t = torch::ones({4});
  group->allreduce_sum(t);
  CHECK(t.sum().item<float>() == 4.0f);

  auto model = torch::nn::Linear(3, 2);
  ddp::DistributedDataParallel ddp(model.ptr(), group);
  auto x = torch::randn({5, 3});
  {
    auto guard = ddp.no_sync();
    model->forward(x).sum().backward();
  }
  auto accumulated = model->weight.grad().clone();
  ddp.backward(model->forward(x).sum());
  CHECK(torch::allclose(model->weight.grad(), accumulated * 2));
}

// A port nothing listens on now, for a store on loopback (as the Python tests' free_port()).
int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

TEST_CASE("NCCL: a CUDA build reduces on the GPUs, and says why when it cannot") {
  ddp::ProcessGroupOptions options;
  options.backend = ddp::Backend::kNccl;
#ifdef DDP_WITH_NCCL
  const int gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (gpus == 0) {
    MESSAGE("skipped NCCL collectives: libtorch has CUDA and NCCL, but no GPU is visible here "
            "(scripts/gpu-check runs them on a GPU machine); checking the refusal instead");
    CHECK_THROWS_WITH_AS(ddp::ProcessGroup::create(env_of({}), options),
                         doctest::Contains("no GPU for LOCAL_RANK 0"), ddp::UsageError);
    options.backend = ddp::Backend::kAuto;
    CHECK(ddp::ProcessGroup::create(env_of({}), options)->device() == torch::Device(torch::kCPU));
    return;
  }
  auto single = ddp::ProcessGroup::create(env_of({}), options);
  CHECK(single->device() == torch::Device(torch::kCUDA, 0));
  options.backend = ddp::Backend::kAuto;
  CHECK(ddp::ProcessGroup::create(env_of({}), options)->device() == torch::Device(torch::kCUDA, 0));
  if (gpus < 2) {
    MESSAGE("skipped the 2-rank NCCL allreduce: it needs 2 GPUs, 1 is visible");
    return;
  }
  // Two ranks as two threads of this process, one GPU each, meeting over a store on loopback.
  const std::string port = std::to_string(free_loopback_port());
  std::vector<float> sums(2, -1.0f);
  std::vector<std::string> names(2), errors(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        auto group = ddp::ProcessGroup::create(
            env_of({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"},
                    {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}}),
            {ddp::Backend::kNccl, std::chrono::seconds(60), std::chrono::seconds(60)});
        names[rank] = group->backend_name();
        auto t = torch::full({1024}, static_cast<float>(rank + 1), group->device());
        group->allreduce_sum(t);
        sums[rank] = t.sum().item<float>();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    CHECK(errors[rank] == "");
    CHECK(names[rank] == "nccl");
    CHECK(sums[rank] == 3.0f * 1024);
  }
#else
  MESSAGE("skipped: this libtorch was built without CUDA, so the NCCL path is not compiled");
  CHECK_THROWS_WITH_AS(ddp::ProcessGroup::create(env_of({}), options),
                       doctest::Contains("without CUDA"), ddp::UsageError);
#endif
}
