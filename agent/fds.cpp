#include "agent/fds.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace ddp::agent {

namespace {

// The highest descriptor number to visit when close_range is not available (Linux < 5.9 /
// 5.11): the soft limit, capped so that a huge limit does not cost a second per spawn.
int fallback_limit() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 65536;
  return rl.rlim_cur > 65536 ? 65536 : static_cast<int>(rl.rlim_cur);
}

bool close_range_call(unsigned first, unsigned last, unsigned flags) {
#ifdef SYS_close_range
  return ::syscall(SYS_close_range, first, last, flags) == 0;
#else
  (void)first, (void)last, (void)flags;
  return false;
#endif
}

}  // namespace

void cloexec_fds_from(int first) {
  if (close_range_call(static_cast<unsigned>(first), UINT_MAX, CLOSE_RANGE_CLOEXEC)) return;
  const int limit = fallback_limit();
  for (int fd = first; fd < limit; ++fd) {
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }
}

void mark_open_fds_cloexec() {
  // One system call (Linux >= 5.11) instead of a directory listing and two fcntl per descriptor.
  if (close_range_call(3, UINT_MAX, CLOSE_RANGE_CLOEXEC)) return;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) {
    cloexec_fds_from(3);
    return;
  }
  const int own = ::dirfd(dir);
  while (const dirent* e = ::readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    if (fd < 3 || fd == own) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }
  ::closedir(dir);
}

void close_fds_from(int first, int keep) {
  if (keep >= first) {
    if (keep > first && !close_range_call(static_cast<unsigned>(first), static_cast<unsigned>(keep - 1), 0)) {
      for (int fd = first; fd < keep; ++fd) ::close(fd);
    }
    first = keep + 1;
  }
  if (close_range_call(static_cast<unsigned>(first), UINT_MAX, 0)) return;
  const int limit = fallback_limit();
  for (int fd = first; fd < limit; ++fd) ::close(fd);
}

}  // namespace ddp::agent
