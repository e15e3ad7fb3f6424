// The standby assignment (agent/standby.h): its codec, with hostile inputs, and its send with
// the two descriptors over a real socket pair. The Python side of the same format is tested
// in tests/agent/test_standby.py.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "agent/standby.h"

#include "agent/frame_header.h"

using namespace ddp::agent;

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

  TEST_CASE("the assignment travels with the worker's stdout and stderr") {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    int out[2], err[2];
    REQUIRE(::pipe(out) == 0);
    REQUIRE(::pipe(err) == 0);
    StandbyAssignment a;
    a.env = {{"RANK", "0"}};
    a.cwd = "/";
    const std::string message = encode_assignment(a);
    REQUIRE(send_assignment(sv[0], message, out[1], err[1]) == static_cast<long>(message.size()));

    char buf[4096];
    iovec iov{buf, sizeof buf};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(sv[1], &msg, 0);
    REQUIRE(n == static_cast<ssize_t>(message.size()));
    CHECK(std::string(buf, static_cast<std::size_t>(n)) == message);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    REQUIRE(c != nullptr);
    CHECK(c->cmsg_type == SCM_RIGHTS);
    REQUIRE(c->cmsg_len == CMSG_LEN(2 * sizeof(int)));
    int got[2];
    std::memcpy(got, CMSG_DATA(c), sizeof got);
    // The received descriptors are the pipes' write ends: what goes in comes out of the read ends.
    REQUIRE(::write(got[0], "o", 1) == 1);
    REQUIRE(::write(got[1], "e", 1) == 1);
    char o = 0, e = 0;
    REQUIRE(::read(out[0], &o, 1) == 1);
    REQUIRE(::read(err[0], &e, 1) == 1);
    CHECK(o == 'o');
    CHECK(e == 'e');
    for (int fd : {sv[0], sv[1], out[0], out[1], err[0], err[1], got[0], got[1]}) ::close(fd);
  }

  TEST_CASE("sending to a standby that is gone fails instead of killing the agent with SIGPIPE") {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    ::close(sv[1]);
    StandbyAssignment a;
    a.cwd = "/";
    CHECK(send_assignment(sv[0], encode_assignment(a), 1, 2) == -1);
    CHECK(errno == EPIPE);
    ::close(sv[0]);
  }
}
