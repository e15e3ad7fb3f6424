#include "rendezvous/fanout.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <thread>

namespace ddp::rdzv {

std::vector<long> write_to_all(const std::vector<int>& fds, const char* data, std::size_t size, unsigned threads) {
  std::vector<long> written(fds.size());
  auto write_part = [&](std::size_t from, std::size_t to) {
    for (std::size_t i = from; i < to; ++i) {
      ssize_t n;
      do {
        n = ::send(fds[i], data, size, MSG_DONTWAIT | MSG_NOSIGNAL);
      } while (n < 0 && errno == EINTR);
      written[i] = n < 0 ? -errno : static_cast<long>(n);
    }
  };
  const std::size_t n = fds.size();
  const std::size_t parts = std::max<std::size_t>(1, std::min<std::size_t>(threads, n / kFanOutPerThread));
  std::vector<std::thread> helpers;
  helpers.reserve(parts);  // no reallocation (and no bad_alloc) while threads run
  std::size_t started = 1;  // parts being written: the caller's own, then one per helper
  for (; started < parts; ++started) {
    try {
      helpers.emplace_back(write_part, n * started / parts, n * (started + 1) / parts);
    } catch (const std::system_error&) {  // no thread to be had: the caller writes the rest
      break;
    }
  }
  write_part(0, n / parts);
  write_part(n * started / parts, n);  // what a helper that could not start would have written
  for (std::thread& h : helpers) h.join();
  return written;
}

}  // namespace ddp::rdzv
