// Close-on-exec for sockets that Boost.Asio opens: its socket() and accept() (Boost 1.74) do not
// ask for SOCK_CLOEXEC, so a server's or client's descriptor would be inheritable until marked.
// Every child the agent starts marks its descriptors close-on-exec before its exec anyway
// (agent/spawn.cpp); this keeps the process's own table right at every moment, for whatever else
// may start a program.
#pragma once

#include <fcntl.h>

namespace ddp::rdzv {

inline void close_on_exec(int fd) {
  if (fd < 0) return;
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0 && !(flags & FD_CLOEXEC)) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

}  // namespace ddp::rdzv
