// One frame written to many sockets at once, over several threads: the server's broadcast of a
// restart to every node of a job (10,000 sends of one frame). Each send on loopback or a real NIC
// runs most of the TCP stack in the caller, so the sends of one broadcast spread over threads
// finish sooner; the state machine stays on its one thread, which waits here while the helpers
// write and takes a share of the sockets itself. No Boost.Asio here; tested with socket pairs.
#pragma once

#include <cstddef>
#include <vector>

namespace ddp::rdzv {

// Fewer recipients than this are written from the calling thread alone: starting a thread costs
// more than the sends it would take over.
inline constexpr std::size_t kFanOutPerThread = 512;

// Writes `size` bytes at `data` to every descriptor of `fds` without blocking (MSG_DONTWAIT,
// MSG_NOSIGNAL), on up to `threads` threads (the caller's included). Returns, per descriptor, the
// bytes written (maybe fewer than `size`) or -errno (-EAGAIN: the socket's buffer is full).
// The caller must keep every descriptor open and unused by others until this returns.
std::vector<long> write_to_all(const std::vector<int>& fds, const char* data, std::size_t size, unsigned threads);

}  // namespace ddp::rdzv
