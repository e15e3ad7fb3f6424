// The standby assignment's codec (contracts/standby_assignment.h), with hostile inputs. Its send
// with the two descriptors is tested in tests/agent/standby_test.cpp; the Python reader of the
// same format in tests/agent/test_standby.py and, on the golden fixtures, tests/contracts/.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>

#include "contracts/frame_header.h"
#include "contracts/standby_assignment.h"

using namespace ddp::contracts;

namespace {

std::string header(const char* magic, std::uint32_t version, std::uint32_t length) {
  return frame_header(magic, version, length);
}

std::string decode_error(const std::string& message) {
  std::string error;
  const auto a = decode_assignment(message, error);
  CHECK_FALSE(a.has_value());
  return error;
}

std::string with_payload(const std::string& payload) { return header("DDPS", 1, payload.size()) + payload; }

}  // namespace

TEST_SUITE("standby assignments are validated before they touch a worker") {
  TEST_CASE("an assignment comes back from its encoding unchanged") {
    StandbyAssignment a;
    a.env = {{"RANK", "3"}, {"PATH", "/usr/bin:/bin"}, {"EMPTY", ""}, {"SPACES", "a b=c"}, {"UNICODE", "\xc3\xa9t\xc3\xa9"}};
    a.cwd = "/tmp/job dir";
    const std::string message = encode_assignment(a);
    CHECK(message.compare(0, 4, "DDPS") == 0);
    CHECK(message.size() > kStandbyHeaderSize);
    std::string error;
    const auto back = decode_assignment(message, error);
    REQUIRE_MESSAGE(back.has_value(), error);
    CHECK(back->env == a.env);
    CHECK(back->cwd == a.cwd);
  }

  TEST_CASE("the header is little endian: magic, version 1, payload length") {
    StandbyAssignment a;
    a.cwd = "/";
    const std::string message = encode_assignment(a);
    CHECK(message.substr(0, 8) == header("DDPS", 1, 0).substr(0, 8));
    const std::uint32_t length = static_cast<unsigned char>(message[8]) | static_cast<unsigned char>(message[9]) << 8 |
                                 static_cast<unsigned char>(message[10]) << 16 |
                                 static_cast<unsigned char>(message[11]) << 24;
    CHECK(length == message.size() - kStandbyHeaderSize);
  }

  TEST_CASE("what execve could not take is refused when encoding") {
    StandbyAssignment a;
    a.cwd = "/";
    a.env = {{"A=B", "x"}};
    CHECK_THROWS_AS(encode_assignment(a), std::invalid_argument);
    a.env = {{"", "x"}};
    CHECK_THROWS_AS(encode_assignment(a), std::invalid_argument);
    a.env = {{"A", std::string("x\0y", 3)}};
    CHECK_THROWS_AS(encode_assignment(a), std::invalid_argument);
    a.env = {{"A", "\xff\xfe not UTF-8"}};
    CHECK_THROWS_AS(encode_assignment(a), std::invalid_argument);
    a.env = {};
    a.cwd = "relative/dir";
    CHECK_THROWS_AS(encode_assignment(a), std::invalid_argument);
    a.cwd = "/";
    a.env = {{"BIG", std::string(kMaxStandbyPayload, 'x')}};
    CHECK_THROWS_AS(encode_assignment(a), std::invalid_argument);
  }

  TEST_CASE("short, foreign, future and lying headers are refused with what was wrong") {
    CHECK(decode_error("") .find("short header") != std::string::npos);
    CHECK(decode_error("DDPS\x01") .find("short header") != std::string::npos);
    CHECK(decode_error(header("HTTP", 1, 2) + "{}").find("bad magic") != std::string::npos);
    CHECK(decode_error(header("DDPS", 2, 2) + "{}").find("version 2") != std::string::npos);
    CHECK(decode_error(header("DDPS", 1, 0)).find("payload length 0") != std::string::npos);
    CHECK(decode_error(header("DDPS", 1, 0xffffffffu)).find("outside") != std::string::npos);
    CHECK(decode_error(header("DDPS", 1, 100) + "{}").find("header says 100") != std::string::npos);
    CHECK(decode_error(header("DDPS", 1, 2) + "{}{}").find("header says 2") != std::string::npos);
  }

  TEST_CASE("payloads of the wrong shape are refused") {
    CHECK(decode_error(with_payload("not json")).find("not a JSON object") != std::string::npos);
    CHECK(decode_error(with_payload("[1, 2]")).find("not a JSON object") != std::string::npos);
    CHECK(decode_error(with_payload(std::string(100000, '[') + std::string(100000, ']')))
              .find("nested deeper") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {}})")).find("exactly the keys") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {}, "cwd": "/", "argv": []})")).find("exactly the keys") !=
          std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": [], "cwd": "/"})")).find("env is not an object") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {}, "cwd": "tmp"})")).find("absolute") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {}, "cwd": 7})")).find("absolute") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {"RANK": 3}, "cwd": "/"})")).find("RANK is not a string") !=
          std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {"A=B": "x"}, "cwd": "/"})")).find("'='") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {"A": "x\u0000y"}, "cwd": "/"})")).find("NUL") != std::string::npos);
    CHECK(decode_error(with_payload(R"({"env": {"": "x"}, "cwd": "/"})")).find("empty variable name") !=
          std::string::npos);
  }
}
