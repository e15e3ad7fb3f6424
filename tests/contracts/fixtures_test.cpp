// The golden fixtures (contracts/fixtures/, README.md there): the C++ side decodes each with its
// codec and asserts the fields, and encodes the same values into the same bytes.
// tests/contracts/test_fixtures.py holds the Python side to the same files, so a change of format
// on either side fails the other's test.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "contracts/progress_slot.h"
#include "contracts/standby_assignment.h"
#include "contracts/worker_channel.h"

using namespace ddp::contracts;

namespace {

std::string fixture(const std::string& name) {
  const std::string path = std::string(DDP_CONTRACTS_FIXTURES) + "/" + name;
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct WorkerFixture {
  const char* file;
  WorkerMessage message;
};

const WorkerFixture kWorkerFixtures[] = {
    {"worker_restartable.bin", WorkerMessage::make_restartable(true)},
    {"worker_parked.bin", WorkerMessage::make_parked(1234)},
    {"worker_standby_ready.bin", WorkerMessage::make_standby_ready()},
};

std::uint64_t u64_at(const std::string& bytes, std::size_t offset) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t{static_cast<unsigned char>(bytes[offset + i])} << (8 * i);
  return v;
}

void put_u64_at(std::string& bytes, std::size_t offset, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) bytes[offset + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

TEST_SUITE("the golden fixtures are what both sides read and write") {
  TEST_CASE("each worker channel fixture decodes to its message, and the message encodes to it") {
    for (const auto& f : kWorkerFixtures) {
      CAPTURE(f.file);
      const std::string bytes = fixture(f.file);
      WorkerChannelDecoder decoder;
      std::vector<WorkerMessage> out;
      REQUIRE_MESSAGE(decoder.feed(bytes, out), decoder.error());
      REQUIRE(out.size() == 1);
      CHECK(out[0] == f.message);
      CHECK(decoder.pending() == 0);
      CHECK(encode_worker_message(f.message) == bytes);
    }
  }

  TEST_CASE("the worker channel fixtures back to back, fed byte by byte, decode in order") {
    std::string stream;
    for (const auto& f : kWorkerFixtures) stream += fixture(f.file);
    WorkerChannelDecoder decoder;
    std::vector<WorkerMessage> out;
    for (char c : stream) REQUIRE(decoder.feed(std::string_view(&c, 1), out));
    REQUIRE(out.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) CHECK(out[i] == kWorkerFixtures[i].message);
  }

  TEST_CASE("the assignment fixture decodes to its environment and directory, and encodes back to it") {
    const std::string bytes = fixture("assignment.bin");
    REQUIRE(announced_length(bytes) == bytes.size() - kStandbyHeaderSize);
    std::string error;
    const auto a = decode_assignment(bytes, error);
    REQUIRE_MESSAGE(a.has_value(), error);
    CHECK(a->cwd == "/work/job");
    const std::map<std::string, std::string> env = {{"LANG", "C.UTF-8"},
                                                    {"MASTER_ADDR", "10.0.0.1"},
                                                    {"NOTE", "gr\xc3\xbc\xc3\x9f"},
                                                    {"PATH", "/usr/bin:/bin"},
                                                    {"RANK", "3"}};
    CHECK(a->env == env);
    CHECK(encode_assignment(StandbyAssignment{env, "/work/job"}) == bytes);
  }

  TEST_CASE("the assignment nested one level too deep is refused by the depth limit") {
    std::string error;
    CHECK_FALSE(decode_assignment(fixture("assignment_too_deep.bin"), error).has_value());
    CHECK(error.find("nested deeper") != std::string::npos);
  }

  TEST_CASE("the progress slot fixture holds its fields at the contract's offsets") {
    const std::string bytes = fixture("progress_slot.bin");
    REQUIRE(bytes.size() == kSlotSize);
    CHECK(u64_at(bytes, kBeatsOffset) == 7);
    CHECK(static_cast<std::int64_t>(u64_at(bytes, kStepOffset)) == 1234);
    CHECK(static_cast<std::int64_t>(u64_at(bytes, kCheckpointOffset)) == 1200);
    CHECK(std::string(bytes.c_str() + kPhaseOffset) == "forward/backward");
    CHECK(u64_at(bytes, kAbandonedOffset) == 1);
    CHECK(static_cast<std::int64_t>(u64_at(bytes, kIntervalOffset)) == 90500);
    CHECK(u64_at(bytes, kFinalOffset) == 1);
    CHECK(u64_at(bytes, kBusyOffset) == 412000);
    CHECK(u64_at(bytes, kCheckpointStallOffset) == 2500000);
    CHECK(u64_at(bytes, kFirstStepOffset) == 1229);

    std::string slot(kSlotSize, '\0');
    put_u64_at(slot, kBeatsOffset, 7);
    put_u64_at(slot, kStepOffset, 1234);
    put_u64_at(slot, kCheckpointOffset, 1200);
    std::memcpy(&slot[kPhaseOffset], "forward/backward", 16);
    put_u64_at(slot, kAbandonedOffset, 1);
    put_u64_at(slot, kIntervalOffset, 90500);
    put_u64_at(slot, kFinalOffset, 1);
    put_u64_at(slot, kBusyOffset, 412000);
    put_u64_at(slot, kCheckpointStallOffset, 2500000);
    put_u64_at(slot, kFirstStepOffset, 1229);
    CHECK(slot == bytes);
  }
}
