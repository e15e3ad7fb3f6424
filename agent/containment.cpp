#include "agent/containment.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>


namespace ddp::agent {

namespace {

// One message from the agent to the sentinel: op '+' watches `pgid`, 'c' forgets every group.
// 8 bytes, so every write is atomic (< PIPE_BUF) and reads see whole messages.
struct Message {
  char op;
  char pad[3];
  int pgid;
};
static_assert(sizeof(Message) == 8);

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

// Calls f(dir_fd, entry) for every entry of the directory `path`. Raw syscalls and the static
// buffer only (the sentinel may call nothing that allocates).
template <class F>
void for_each_entry(const char* path, F f) {
  const int dir = ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, g_dents, sizeof g_dents);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      const auto* d = reinterpret_cast<const Dirent64*>(g_dents + off);
      off += d->d_reclen;
      f(dir, *d);
    }
  }
  ::close(dir);
}

// The pid a name spells in decimal, with nothing else; 0 otherwise.
pid_t pid_of_name(const char* name) {
  long pid = 0;
  const char* c = name;
  for (; *c >= '0' && *c <= '9' && pid < (1L << 30); ++c) pid = pid * 10 + (*c - '0');
  return *c == '\0' && c != name ? static_cast<pid_t>(pid) : 0;
}

// Kills every process but this one whose environment holds the entry `entry` ("NAME=value").
// Raw syscalls and static buffers only. Returns how many it signalled.
int kill_marked(const char* entry) {
  const std::size_t entry_len = std::strlen(entry);
  const pid_t self = ::getpid();
  int killed = 0;
  for_each_entry("/proc", [&](int, const Dirent64& d) {
    const pid_t pid = pid_of_name(d.d_name);
    if (pid <= 0 || pid == self) return;
    char path[64] = "/proc/";
    std::size_t len = 6;
    for (const char* q = d.d_name; *q != '\0' && len < 40; ++q) path[len++] = *q;
    std::memcpy(path + len, "/environ", 9);
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
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
  });
  return killed;
}

// Kills the marked processes; again while some were found (one may have forked meanwhile).
void kill_all_marked(const char* entry) {
  for (int round = 0; round < 5 && kill_marked(entry) > 0; ++round) {
  }
}

// ---- the sentinel: runs in the forked child; async-signal-safe calls only, no allocation ----

constexpr int kMaxGroups = 8192;
int g_groups[kMaxGroups];
int g_group_count = 0;
bool g_cgroup_failed = false;  // the agent found a worker outside the cgroup: use the marker

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

// Removes the empty cgroups that agents which are gone left beside ours: `ddplaunch-PID` with no
// process PID. They are left when an agent and its sentinel were both SIGKILLed (nobody removed
// them). Only an empty cgroup can be removed (rmdir fails with EBUSY otherwise), so a cgroup whose
// workers still run, or that a sentinel is emptying, stays. A PID that was reused keeps its
// leftover; that costs a directory, never a process. Runs in the sentinel, off the launch's path;
// raw syscalls and static buffers only.
void sweep_dead_cgroups(const char* cgroup_dir) {
  static char parent[4096];
  const std::size_t len = std::strlen(cgroup_dir);
  if (len == 0 || len >= sizeof parent) return;
  std::memcpy(parent, cgroup_dir, len + 1);
  char* slash = std::strrchr(parent, '/');
  if (slash == nullptr || slash == parent) return;
  *slash = '\0';
  constexpr char kPrefix[] = "ddplaunch-";
  constexpr std::size_t kPrefixLen = sizeof kPrefix - 1;
  for_each_entry(parent, [&](int dir, const Dirent64& d) {
    if (d.d_type != DT_DIR || std::strncmp(d.d_name, kPrefix, kPrefixLen) != 0) return;
    const pid_t pid = pid_of_name(d.d_name + kPrefixLen);
    if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) return;  // its agent lives
    ::unlinkat(dir, d.d_name, AT_REMOVEDIR);
  });
}

// What the sentinel is given, prepared before the fork: the child must not allocate.
struct SentinelArgs {
  int read_fd;
  const char* cgroup_kill;
  const char* cgroup_events;
  const char* cgroup_dir;
  const char* marker;
};

// The sentinel's body. The spawner has already detached it from the agent (agent/spawn.h): its
// own process group (a kill of the agent's group must not take it along), the agent's terminal
// and stop signals ignored, /dev/null as 0, 1 and 2, none of the agent's descriptors but the
// pipe's read end (its sockets, its console pipes: a reader waiting for end of file must not
// wait for us; the pipe's write end: end of file would never come).
[[noreturn]] void sentinel_main(void* p) {
  const auto& a = *static_cast<const SentinelArgs*>(p);
  const int read_fd = a.read_fd;
  ::prctl(PR_SET_NAME, "ddp-sentinel", 0, 0, 0);
  if (a.cgroup_dir[0] != '\0') sweep_dead_cgroups(a.cgroup_dir);
  char buf[512];
  std::size_t have = 0;
  for (;;) {
    const ssize_t n = ::read(read_fd, buf + have, sizeof buf - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the agent is gone (or closed the pipe on its way out)
    have += static_cast<std::size_t>(n);
    std::size_t off = 0;
    for (; have - off >= sizeof(Message); off += sizeof(Message)) {
      Message m;
      std::memcpy(&m, buf + off, sizeof m);
      if (m.op == '+' && m.pgid > 0 && g_group_count < kMaxGroups) g_groups[g_group_count++] = m.pgid;
      if (m.op == 'c') g_group_count = 0;
      if (m.op == 'n') g_cgroup_failed = true;
    }
    std::memmove(buf, buf + off, have - off);
    have -= off;
  }
  sentinel_kill_everything(a.cgroup_kill, a.cgroup_events, a.cgroup_dir, a.marker);
  ::_exit(0);
}

std::string read_file(const char* path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string own_cgroup_dir(std::string& problem) {
  // /proc/self/mountinfo: "36 25 0:31 / /sys/fs/cgroup rw,... - cgroup2 cgroup2 rw"
  std::string mount_root, mount_point;
  std::istringstream mounts(read_file("/proc/self/mountinfo"));
  for (std::string line; std::getline(mounts, line);) {
    const auto dash = line.find(" - ");
    if (dash == std::string::npos || line.compare(dash + 3, 8, "cgroup2 ") != 0) continue;
    std::istringstream fields(line.substr(0, dash));
    std::string id, parent, dev;
    fields >> id >> parent >> dev >> mount_root >> mount_point;
    break;
  }
  if (mount_point.empty()) {
    problem = "no cgroup2 file system is mounted";
    return {};
  }
  // /proc/self/cgroup: "0::/user.slice/..." is our place in the unified hierarchy.
  std::string path;
  std::istringstream groups(read_file("/proc/self/cgroup"));
  for (std::string line; std::getline(groups, line);) {
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  }
  if (path.empty()) {
    problem = "this process has no cgroup v2 (no \"0::\" line in /proc/self/cgroup)";
    return {};
  }
  if (mount_root != "/" && path.rfind(mount_root, 0) == 0) path = path.substr(mount_root.size());
  if (path == "/") path.clear();
  return mount_point + path;
}

Containment::Containment() {
  std::random_device random;
  marker_value_ = std::to_string(::getpid()) + "." + std::to_string(random()) + std::to_string(random());
  marker_entry_ = std::string(kMarkerVariable) + "=" + marker_value_;
  create_cgroup();
  start_sentinel();
}

Containment::~Containment() {
  if (pipe_fd_ >= 0) ::close(pipe_fd_);  // the sentinel wakes up, cleans up, and exits
  if (sentinel_pid_ > 0) {
    // Bounded: the sentinel waits at most 5 s for the cgroup to empty. Waiting here means
    // nothing of the job is left when ddplaunch exits. ECHILD: the SIGCHLD reaper got it.
    while (::waitpid(sentinel_pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  if (procs_fd_ >= 0) ::close(procs_fd_);
  if (kill_fd_ >= 0) ::close(kill_fd_);
  if (dir_fd_ >= 0) ::close(dir_fd_);
}

void Containment::create_cgroup() {
  const char* off = std::getenv("DDPLAUNCH_NO_CGROUP");
  if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) {
    cgroup_problem_ = "DDPLAUNCH_NO_CGROUP is set";
    return;
  }
  std::string problem;
  const std::string parent = own_cgroup_dir(problem);
  if (parent.empty()) {
    cgroup_problem_ = problem;
    return;
  }
  const std::string dir = parent + "/ddplaunch-" + std::to_string(::getpid());
  if (::mkdir(dir.c_str(), 0755) != 0) {
    // A leftover of an earlier agent with our pid (it and its sentinel were both killed).
    if (errno != EEXIST || ::rmdir(dir.c_str()) != 0 || ::mkdir(dir.c_str(), 0755) != 0) {
      cgroup_problem_ = "cannot create cgroup " + dir + ": " + std::strerror(errno);
      return;
    }
  }
  kill_fd_ = ::open((dir + "/cgroup.kill").c_str(), O_WRONLY | O_CLOEXEC);
  if (kill_fd_ < 0) {
    cgroup_problem_ = "cgroup " + dir + " has no cgroup.kill (it needs Linux 5.14 or later): " + std::strerror(errno);
    ::rmdir(dir.c_str());
    return;
  }
  procs_fd_ = ::open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
  if (procs_fd_ < 0) {
    cgroup_problem_ = "cannot open " + dir + "/cgroup.procs: " + std::strerror(errno);
    ::close(kill_fd_);
    kill_fd_ = -1;
    ::rmdir(dir.c_str());
    return;
  }
  dir_fd_ = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  cgroup_dir_ = dir;
}

void Containment::place_worker(SpawnOptions& options) const {
  options.cgroup(born_inside_ ? dir_fd_ : -1, procs_fd_);
}

void Containment::start_sentinel() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;
  const std::string kill_path = cgroup_dir_.empty() ? "" : cgroup_dir_ + "/cgroup.kill";
  const std::string events_path = cgroup_dir_.empty() ? "" : cgroup_dir_ + "/cgroup.events";
  SentinelArgs args{fds[0], kill_path.c_str(), events_path.c_str(), cgroup_dir_.c_str(), marker_entry_.c_str()};
  const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  SpawnOptions options;
  options.stdin_from(null_fd)
      .stdout_to(null_fd)
      .stderr_to(null_fd)
      .keep_fd(fds[0])
      .process_group_leader()
      .ignore_signals({SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU})
      .run_instead_of_exec(&sentinel_main, &args);
  pid_t pid = -1;
  try {
    pid = spawn_process({}, {}, options).pid;
  } catch (const SpawnError&) {
    // No sentinel: workers still die with the agent by their parent-death signal.
  }
  if (null_fd >= 0) ::close(null_fd);
  ::close(fds[0]);
  if (pid < 0) {
    ::close(fds[1]);
    return;
  }
  sentinel_pid_ = pid;
  pipe_fd_ = fds[1];
}

void Containment::send(char op, int pgid) {
  if (pipe_fd_ < 0) return;
  Message m{};
  m.op = op;
  m.pgid = pgid;
  while (::write(pipe_fd_, &m, sizeof m) < 0 && errno == EINTR) {
  }
}

void Containment::watch_group(int pgid) {
  if (std::find(standby_groups_.begin(), standby_groups_.end(), pgid) == standby_groups_.end()) {
    groups_.push_back(pgid);
  }
  send('+', pgid);
}

void Containment::add_standby(int pid) { standby_groups_.push_back(pid); }

bool Containment::adopt_standby(int pid) {
  const auto it = std::find(standby_groups_.begin(), standby_groups_.end(), pid);
  if (it == standby_groups_.end()) return false;
  standby_groups_.erase(it);
  groups_.push_back(pid);
  if (procs_fd_ >= 0) {
    // Best effort: a standby left outside is still killed by its group and its parent-death signal.
    const std::string text = std::to_string(pid);
    (void)!::write(procs_fd_, text.data(), text.size());
  }
  return true;
}

void Containment::forget_standby(int pgid) {
  const auto it = std::find(standby_groups_.begin(), standby_groups_.end(), pgid);
  if (it == standby_groups_.end()) return;
  standby_groups_.erase(it);
  // The sentinel knows no removal: it forgets everything and hears the rest again.
  send('c', 0);
  for (int g : groups_) send('+', g);
  for (int g : standby_groups_) send('+', g);
}

char process_state(int pid) {
  // /proc/PID/stat: "PID (COMM) S ..."; COMM may hold spaces and parentheses: the last ')' ends it.
  const std::string stat = read_file(("/proc/" + std::to_string(pid) + "/stat").c_str());
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return '\0';
  return stat[close + 2];
}

void Containment::check_member(int pid) {
  if (cgroup_dir_.empty() || checked_) return;
  // A standby is outside the cgroup by design: it proves nothing.
  if (std::find(standby_groups_.begin(), standby_groups_.end(), pid) != standby_groups_.end()) return;
  // Read before the state: a process seen alive afterwards was alive when its cgroup was read.
  const std::string cgroups = read_file(("/proc/" + std::to_string(pid) + "/cgroup").c_str());
  const char state = process_state(pid);
  if (state == '\0' || state == 'Z' || state == 'X') {
    // Exited already (a zombie's cgroup file reads "0::/"): it proves nothing either way, so the
    // next worker is checked instead.
    return;
  }
  checked_ = true;
  std::istringstream in(cgroups);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("0::", 0) == 0 && line.size() > 3 &&
        cgroup_dir_.size() >= line.size() - 3 &&
        cgroup_dir_.compare(cgroup_dir_.size() - (line.size() - 3), std::string::npos, line.substr(3)) == 0) {
      return;  // our cgroup's path ends with the worker's: it joined
    }
  }
  // The worker could not join (its write to cgroup.procs failed): fall back to the marker.
  cgroup_problem_ = "worker " + std::to_string(pid) + " did not join cgroup " + cgroup_dir_;
  send('n', 0);
  ::close(procs_fd_);
  ::close(kill_fd_);
  if (dir_fd_ >= 0) ::close(dir_fd_);
  procs_fd_ = kill_fd_ = dir_fd_ = -1;
}

void Containment::kill_all() {
  for (int pgid : groups_) ::kill(-pgid, SIGKILL);
  groups_.clear();
  send('c', 0);
  for (int g : standby_groups_) send('+', g);
  if (kill_fd_ >= 0) {
    (void)!::write(kill_fd_, "1", 1);
    // Linux (seen on 6.18) compares a CLONE_INTO_CGROUP child's cgroup kill count with its
    // parent's cgroup's: once cgroup.kill has been written, every child created inside is
    // SIGKILLed at birth. Later workers are forked and moved in instead (slower, still correct).
    born_inside_ = false;
  } else {
    kill_all_marked(marker_entry_.c_str());
  }
}

}  // namespace ddp::agent
