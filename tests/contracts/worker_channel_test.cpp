// The worker channel (contracts/worker_channel.h): its frames, with hostile inputs, fed to the
// incremental decoder whole, together and byte by byte.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "contracts/frame_header.h"
#include "contracts/worker_channel.h"

using namespace ddp::contracts;

namespace {

std::string header(const char* magic, std::uint32_t version, std::uint32_t length) {
  return frame_header(magic, version, length);
}

std::string frame(const std::string& payload) { return header("DDPW", 1, static_cast<std::uint32_t>(payload.size())) + payload; }

// The decoder's error for `bytes` fed at once; checks that it failed.
std::string error_of(const std::string& bytes) {
  WorkerChannelDecoder d;
  std::vector<WorkerMessage> out;
  CHECK_FALSE(d.feed(bytes, out));
  CHECK(out.empty());
  CHECK(d.failed());
  return d.error();
}

}  // namespace

TEST_SUITE("worker channel frames are validated before they touch the agent") {
  TEST_CASE("every message comes back from its encoding unchanged") {
    for (const WorkerMessage& m : {WorkerMessage::make_restartable(true), WorkerMessage::make_restartable(false),
                                   WorkerMessage::make_parked(-1), WorkerMessage::make_parked(0),
                                   WorkerMessage::make_parked(kMaxParkedStep - 1),
                                   WorkerMessage::make_standby_ready()}) {
      const std::string bytes = encode_worker_message(m);
      WorkerChannelDecoder d;
      std::vector<WorkerMessage> out;
      REQUIRE_MESSAGE(d.feed(bytes, out), d.error());
      REQUIRE(out.size() == 1);
      CHECK(out[0] == m);
      CHECK(d.pending() == 0);
    }
  }

  TEST_CASE("the frame is magic, version 1, little-endian length, then the JSON object") {
    const std::string bytes = encode_worker_message(WorkerMessage::make_parked(7));
    const std::string payload = R"({"step":7,"type":"parked"})";
    CHECK(bytes == header("DDPW", 1, static_cast<std::uint32_t>(payload.size())) + payload);
    CHECK(encode_worker_message(WorkerMessage::make_restartable(true)) == frame(R"({"type":"restartable","value":true})"));
    CHECK(encode_worker_message(WorkerMessage::make_standby_ready()) == frame(R"({"type":"standby_ready"})"));
  }

  TEST_CASE("a step outside -1..2^53-1 cannot be encoded") {
    CHECK_THROWS_AS(encode_worker_message(WorkerMessage::make_parked(-2)), std::invalid_argument);
    CHECK_THROWS_AS(encode_worker_message(WorkerMessage::make_parked(kMaxParkedStep)), std::invalid_argument);
  }

  TEST_CASE("two messages in one read are both delivered, in order") {
    const std::string bytes =
        encode_worker_message(WorkerMessage::make_restartable(true)) + encode_worker_message(WorkerMessage::make_parked(12));
    WorkerChannelDecoder d;
    std::vector<WorkerMessage> out;
    REQUIRE(d.feed(bytes, out));
    REQUIRE(out.size() == 2);
    CHECK(out[0] == WorkerMessage::make_restartable(true));
    CHECK(out[1] == WorkerMessage::make_parked(12));
  }

  TEST_CASE("a message split byte by byte is delivered once, with its last byte") {
    const std::string bytes =
        encode_worker_message(WorkerMessage::make_parked(42)) + encode_worker_message(WorkerMessage::make_restartable(false));
    const std::size_t first = encode_worker_message(WorkerMessage::make_parked(42)).size();
    WorkerChannelDecoder d;
    std::vector<WorkerMessage> out;
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      REQUIRE(d.feed(bytes.substr(i, 1), out));
      CHECK(out.size() == (i + 1 < first ? 0u : i + 1 < bytes.size() ? 1u : 2u));
    }
    CHECK(out[0] == WorkerMessage::make_parked(42));
    CHECK(out[1] == WorkerMessage::make_restartable(false));
    CHECK(d.pending() == 0);
  }

  TEST_CASE("a truncated frame is held, not delivered, and is not an error") {
    const std::string bytes = encode_worker_message(WorkerMessage::make_parked(3));
    for (std::size_t n : {std::size_t{0}, std::size_t{5}, kWorkerHeaderSize, bytes.size() - 1}) {
      WorkerChannelDecoder d;
      std::vector<WorkerMessage> out;
      CHECK(d.feed(bytes.substr(0, n), out));
      CHECK(out.empty());
      CHECK(d.pending() == n);
    }
  }

  TEST_CASE("a bad magic or version is refused as soon as the header is complete") {
    CHECK(error_of(header("DDPS", 1, 20)).find("bad magic") != std::string::npos);
    CHECK(error_of("GET / HTTP/1.1\r\n\r\n").find("bad magic") != std::string::npos);
    CHECK(error_of(header("DDPW", 2, 20)).find("version 2") != std::string::npos);
    CHECK(error_of(header("DDPW", 0, 20)).find("version 0") != std::string::npos);
  }

  TEST_CASE("a length of 0, 1 or over 4096 is refused before any payload is read") {
    for (std::uint32_t n : {0u, 1u, 4097u, 0xffffffffu}) {
      CHECK(error_of(header("DDPW", 1, n)).find("payload length " + std::to_string(n)) != std::string::npos);
    }
    // 4096 bytes is allowed as a length (the payload then fails as JSON, not as a size).
    CHECK(error_of(frame(std::string(4096, ' '))).find("not a JSON object") != std::string::npos);
  }

  TEST_CASE("a payload that is not a flat JSON object is refused") {
    CHECK(error_of(frame("[]")).find("not a JSON object") != std::string::npos);
    CHECK(error_of(frame("{\"type\":")).find("not a JSON object") != std::string::npos);
    CHECK(error_of(frame("\"parked\"")).find("not a JSON object") != std::string::npos);
    CHECK(error_of(frame(std::string(2000, '[') + std::string(2000, ']'))).find("nested") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":{"a":1}})")).find("nested") != std::string::npos);
  }

  TEST_CASE("wrong types, unknown types and extra or missing keys are refused") {
    CHECK(error_of(frame(R"({"value":true})")).find("no string \"type\"") != std::string::npos);
    CHECK(error_of(frame(R"({"type":1,"value":true})")).find("no string \"type\"") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"stop"})")).find("unknown message type 'stop'") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"restartable","value":1})")).find("not true or false") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"restartable","value":"true"})")).find("not true or false") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"restartable"})")).find("exactly the keys type and value") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"restartable","value":true,"x":0})")).find("exactly") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":5,"value":true})")).find("exactly the keys type and step") !=
          std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","value":5})")).find("exactly the keys type and step") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":"5"})")).find("not an integer") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"standby_ready","step":1})")).find("exactly the key type") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"standby_ready","value":true})")).find("exactly the key type") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":5.5})")).find("not an integer") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":null})")).find("not an integer") != std::string::npos);
  }

  TEST_CASE("a parked step outside -1..2^53-1 is refused") {
    CHECK(error_of(frame(R"({"type":"parked","step":-2})")).find("step -2 outside") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":9007199254740992})")).find("outside") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":18446744073709551615})")).find("outside") != std::string::npos);
    CHECK(error_of(frame(R"({"type":"parked","step":-9223372036854775808})")).find("outside") != std::string::npos);
    WorkerChannelDecoder d;
    std::vector<WorkerMessage> out;
    CHECK(d.feed(frame(R"({"type":"parked","step":9007199254740991})"), out));
    REQUIRE(out.size() == 1);
    CHECK(out[0].step == kMaxParkedStep - 1);
  }

  TEST_CASE("after an error the decoder stays failed; messages before the bad frame are kept") {
    WorkerChannelDecoder d;
    std::vector<WorkerMessage> out;
    CHECK_FALSE(d.feed(encode_worker_message(WorkerMessage::make_restartable(true)) + header("XXXX", 1, 2), out));
    CHECK(out.size() == 1);
    const std::string error = d.error();
    CHECK_FALSE(d.feed(encode_worker_message(WorkerMessage::make_parked(1)), out));
    CHECK(out.size() == 1);
    CHECK(d.error() == error);
    CHECK(d.pending() == 0);
  }
}
