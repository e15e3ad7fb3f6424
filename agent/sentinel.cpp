#include "agent/sentinel.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "agent/fds.h"

namespace ddp::agent {

namespace {

// ---- async-signal-safe helpers: they run in the sentinel (a child of a threaded process) ----

struct Dirent64 {  // the kernel's struct linux_dirent64
  unsigned long long d_ino;
  long long d_off;
  unsigned short d_reclen;
  unsigned char d_type;
  char d_name[];
};

char g_dents[32768];
char g_environ[1 << 20];  // a process's environment is at most ARG_MAX-ish; bigger ones are cut

// Kills every process but this one whose environment holds the entry `entry` ("NAME=value").
// Returns how many it signalled.
int kill_marked(const char* entry) {
  const std::size_t entry_len = std::strlen(entry);
  const int dir = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return 0;
  const pid_t self = ::getpid();
  int killed = 0;
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, g_dents, sizeof g_dents);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      const auto* d = reinterpret_cast<const Dirent64*>(g_dents + off);
      off += d->d_reclen;
      pid_t pid = 0;
      const char* c = d->d_name;
      for (; *c >= '0' && *c <= '9'; ++c) pid = pid * 10 + (*c - '0');
      if (*c != '\0' || pid <= 0 || pid == self) continue;
      char path[64] = "/proc/";
      std::size_t len = 6;
      for (const char* q = d->d_name; *q != '\0' && len < 40; ++q) path[len++] = *q;
      std::memcpy(path + len, "/environ", 9);
      const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      std::size_t have = 0;
      for (ssize_t r; have < sizeof g_environ && (r = ::read(fd, g_environ + have, sizeof g_environ - have)) > 0;) {
        have += static_cast<std::size_t>(r);
      }
      ::close(fd);
      for (std::size_t pos = 0; pos + entry_len <= have;) {
        if (std::memcmp(g_environ + pos, entry, entry_len) == 0 &&
            (pos + entry_len == have || g_environ[pos + entry_len] == '\0')) {
          ::kill(pid, SIGKILL);
          ++killed;
          break;
        }
        const void* next = std::memchr(g_environ + pos, '\0', have - pos);
        if (next == nullptr) break;
        pos = static_cast<std::size_t>(static_cast<const char*>(next) - g_environ) + 1;
      }
    }
  }
  ::close(dir);
  return killed;
}


// ---- the sentinel: runs in the forked child; async-signal-safe calls only, no allocation ----

constexpr int kMaxGroups = 8192;
int g_groups[kMaxGroups];
int g_group_count = 0;
bool g_cgroup_failed = false;  // the agent found a worker outside the cgroup: use the marker

void sentinel_detach_from_agent(int keep_fd) {
  ::setpgid(0, 0);  // a kill of the agent's process group must not take the sentinel with it
  struct sigaction sa {};
  for (int s = 1; s < NSIG; ++s) {
    const bool ignore = s == SIGINT || s == SIGTERM || s == SIGHUP || s == SIGQUIT || s == SIGPIPE ||
                        s == SIGTSTP || s == SIGTTIN || s == SIGTTOU;
    sa.sa_handler = ignore ? SIG_IGN : SIG_DFL;
    ::sigaction(s, &sa, nullptr);  // fails harmlessly for SIGKILL, SIGSTOP
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::prctl(PR_SET_NAME, "ddp-sentinel", 0, 0, 0);
  const int null_fd = ::open("/dev/null", O_RDWR);
  if (null_fd >= 0) {
    ::dup2(null_fd, 0);
    ::dup2(null_fd, 1);
    ::dup2(null_fd, 2);
  }
  // Hold nothing of the agent's: its sockets, its console pipes (a reader waiting for end of
  // file must not wait for us), the pipe's write end (or end of file would never come).
  close_fds_from(3, keep_fd);
}

void sentinel_kill_everything(const char* cgroup_kill, const char* cgroup_events, const char* cgroup_dir,
                              const char* marker) {
  for (int i = 0; i < g_group_count; ++i) ::kill(-g_groups[i], SIGKILL);
  g_group_count = 0;
  if (cgroup_kill[0] == '\0' || g_cgroup_failed) {
    kill_all_marked(marker);  // no cgroup: what left its group is found by its environment
    return;
  }
  const int kfd = ::open(cgroup_kill, O_WRONLY | O_CLOEXEC);
  if (kfd >= 0) {
    (void)!::write(kfd, "1", 1);
    ::close(kfd);
  }
  // Wait (at most 5 s) until the cgroup is empty, so that it can be removed.
  const int efd = ::open(cgroup_events, O_RDONLY | O_CLOEXEC);
  if (efd >= 0) {
    for (int waited_ms = 0; waited_ms < 5000;) {
      char buf[256];
      const ssize_t n = ::pread(efd, buf, sizeof buf - 1, 0);
      if (n <= 0) break;
      buf[n] = '\0';
      if (std::strstr(buf, "populated 0") != nullptr) break;
      struct pollfd p {efd, POLLPRI, 0};
      ::poll(&p, 1, 100);  // cgroup.events signals a change with POLLPRI
      waited_ms += 100;
    }
    ::close(efd);
  }
  ::rmdir(cgroup_dir);
}

// `dir` + `name` into `out` (empty when it does not fit).
void join_path(char* out, std::size_t size, const char* dir, const char* name) {
  const std::size_t dl = std::strlen(dir), nl = std::strlen(name);
  out[0] = '\0';
  if (dl == 0 || dl + nl + 1 > size) return;
  std::memcpy(out, dir, dl);
  std::memcpy(out + dl, name, nl + 1);
}

char g_kill_path[4096];
char g_events_path[4096];

}  // namespace

void kill_all_marked(const char* entry) {
  for (int round = 0; round < 5 && kill_marked(entry) > 0; ++round) {
  }
}

[[noreturn]] void sentinel_main(int read_fd, const char* cgroup_dir, const char* marker) {
  join_path(g_kill_path, sizeof g_kill_path, cgroup_dir, "/cgroup.kill");
  join_path(g_events_path, sizeof g_events_path, cgroup_dir, "/cgroup.events");
  const char* cgroup_kill = g_kill_path;
  const char* cgroup_events = g_events_path;
  sentinel_detach_from_agent(read_fd);
  char buf[512];
  std::size_t have = 0;
  for (;;) {
    const ssize_t n = ::read(read_fd, buf + have, sizeof buf - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the agent is gone (or closed the pipe on its way out)
    have += static_cast<std::size_t>(n);
    std::size_t off = 0;
    for (; have - off >= sizeof(SentinelMessage); off += sizeof(SentinelMessage)) {
      SentinelMessage m;
      std::memcpy(&m, buf + off, sizeof m);
      if (m.op == '+' && m.pgid > 0 && g_group_count < kMaxGroups) g_groups[g_group_count++] = m.pgid;
      if (m.op == 'c') g_group_count = 0;
      if (m.op == 'n') g_cgroup_failed = true;
    }
    std::memmove(buf, buf + off, have - off);
    have -= off;
  }
  sentinel_kill_everything(cgroup_kill, cgroup_events, cgroup_dir, marker);
  ::_exit(0);
}

}  // namespace ddp::agent
