// Sending the standby assignment (agent/standby.h) with the two descriptors over a real socket
// pair. Its codec is tested in tests/contracts/standby_assignment_test.cpp.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "agent/standby.h"

using namespace ddp::agent;

TEST_SUITE("standby assignments are sent with the worker's descriptors") {
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
