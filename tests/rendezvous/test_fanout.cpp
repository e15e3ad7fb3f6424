// write_to_all (rendezvous/fanout.h): one frame to many sockets over several threads, on real
// socket pairs: every socket gets the whole frame once, a full socket reports what it took, a
// socket whose peer is gone reports its errno, and no helper thread is started for a few.
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "rendezvous/fanout.h"

using ddp::rdzv::kFanOutPerThread;
using ddp::rdzv::write_to_all;

namespace {

struct Pairs {
  explicit Pairs(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      int sv[2];
      REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
      ours.push_back(sv[0]);
      theirs.push_back(sv[1]);
    }
  }
  ~Pairs() {
    for (int fd : ours) ::close(fd);
    for (int fd : theirs) {
      if (fd >= 0) ::close(fd);
    }
  }
  std::string received(std::size_t i, std::size_t max) const {
    std::string got(max, '\0');
    const ssize_t n = ::recv(theirs[i], got.data(), max, MSG_DONTWAIT);
    got.resize(n < 0 ? 0 : static_cast<std::size_t>(n));
    return got;
  }
  std::vector<int> ours, theirs;
};

}  // namespace

TEST_CASE("every socket of a broadcast over several threads gets the whole frame, once") {
  const std::size_t n = 4 * kFanOutPerThread + 7;  // four parts, the last one uneven
  Pairs pairs(n);
  const std::string frame = "restart: node 17 lost";
  const std::vector<long> written = write_to_all(pairs.ours, frame.data(), frame.size(), 4);
  REQUIRE(written.size() == n);
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(written[i] == static_cast<long>(frame.size()));
    CHECK(pairs.received(i, 2 * frame.size()) == frame);  // exactly one copy
  }
}

TEST_CASE("a full socket takes part of the frame or none, and says so; the others get all of it") {
  const std::size_t n = 3 * kFanOutPerThread;
  Pairs pairs(n);
  const std::string filler(1 << 16, 'x');
  while (::send(pairs.ours[5], filler.data(), filler.size(), MSG_DONTWAIT) > 0) {
  }
  const std::string frame(4096, 'f');
  const std::vector<long> written = write_to_all(pairs.ours, frame.data(), frame.size(), 3);
  CHECK((written[5] == -EAGAIN || (written[5] >= 0 && written[5] < static_cast<long>(frame.size()))));
  CHECK(written[4] == static_cast<long>(frame.size()));
  CHECK(written[n - 1] == static_cast<long>(frame.size()));
}

TEST_CASE("a socket whose peer is gone reports the error, without a SIGPIPE") {
  Pairs pairs(2 * kFanOutPerThread);
  ::close(pairs.theirs[3]);
  pairs.theirs[3] = -1;
  const std::string frame = "restart";
  const std::vector<long> written = write_to_all(pairs.ours, frame.data(), frame.size(), 2);
  CHECK(written[3] == -EPIPE);
  CHECK(written[2] == static_cast<long>(frame.size()));
}

TEST_CASE("a few recipients, or one thread asked for, are written by the caller alone, all of them") {
  for (unsigned threads : {1u, 8u}) {
    Pairs pairs(kFanOutPerThread - 1);
    const std::string frame = "waiting";
    const std::vector<long> written = write_to_all(pairs.ours, frame.data(), frame.size(), threads);
    for (std::size_t i = 0; i < pairs.ours.size(); ++i) {
      CHECK(written[i] == static_cast<long>(frame.size()));
      CHECK(pairs.received(i, 64) == frame);
    }
  }
  CHECK(write_to_all({}, "x", 1, 4).empty());
}
