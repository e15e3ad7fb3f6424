#include "agent/containment.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <spawn.h>
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

#include "agent/fds.h"
#include "agent/sentinel.h"

namespace ddp::agent {

namespace {

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

pid_t Containment::fork_worker() {
  if (dir_fd_ >= 0 && procs_fd_ >= 0 && !clone3_refused_) {
    // struct clone_args of linux/sched.h (version 2, with `cgroup`), spelled out: that header
    // clashes with glibc's <sched.h>.
    struct {
      std::uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size,
          cgroup;
    } args{};
    constexpr std::uint64_t kCloneIntoCgroup = 0x200000000ULL;
    args.flags = kCloneIntoCgroup;
    args.exit_signal = SIGCHLD;
    args.cgroup = static_cast<std::uint64_t>(dir_fd_);
    const long pid = ::syscall(SYS_clone3, &args, sizeof args);
    if (pid >= 0) return static_cast<pid_t>(pid);
    if (errno != ENOSYS && errno != EPERM && errno != EINVAL && errno != E2BIG) return -1;
    clone3_refused_ = true;  // a seccomp filter or an old kernel: fork, then move the child
  }
  const int procs = procs_fd_;
  const pid_t pid = ::fork();
  if (pid == 0 && procs >= 0) (void)!::write(procs, "0", 1);
  return pid;
}

namespace {

// The `ddp-sentinel` program: beside the running executable (the build tree's bin/, or an
// installed bin/ next to it), or in <prefix>/libexec/ddplaunch when installed. Empty when
// there is none.
std::string sentinel_program() {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return {};
  std::string dir(exe, static_cast<std::size_t>(n));
  dir.erase(dir.rfind('/') + 1);
  for (const char* candidate : {"ddp-sentinel", "../libexec/ddplaunch/ddp-sentinel"}) {
    std::string path = dir + candidate;
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return {};
}

}  // namespace

void Containment::start_sentinel() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;
  // Spawned (vfork and exec, posix_spawn), not forked: a forked sentinel would share every
  // page of the agent's memory until it exits, so that each page the agent writes afterwards
  // is copied first. That copying was most of what containment added to a launch
  // (docs/agent.md, "What a launch costs"). Without the program, fork as before.
  const std::string program = sentinel_program();
  if (!program.empty()) {
    // Its end of the pipe becomes descriptor 3 (4 if it is 3 already): dup2 onto another number
    // clears close-on-exec, whatever the C library's version.
    const int child_fd = fds[0] == 3 ? 4 : 3;
    const std::string fd_text = std::to_string(child_fd);
    char* const argv[] = {const_cast<char*>("ddp-sentinel"), const_cast<char*>(fd_text.c_str()),
                          const_cast<char*>(cgroup_dir_.c_str()), const_cast<char*>(marker_entry_.c_str()), nullptr};
    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[0], child_fd);
    posix_spawnattr_init(&attr);
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    char* const envp[] = {nullptr};  // it needs none
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, program.c_str(), &actions, &attr, argv, envp);
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&actions);
    if (rc == 0) {
      ::close(fds[0]);
      sentinel_pid_ = pid;
      pipe_fd_ = fds[1];
      return;
    }
  }
  const pid_t pid = ::fork();
  if (pid == 0) sentinel_main(fds[0], cgroup_dir_.c_str(), marker_entry_.c_str());
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
  SentinelMessage m{};
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

pid_t Containment::fork_standby() {
  const pid_t pid = ::fork();
  if (pid > 0) standby_groups_.push_back(pid);
  return pid;
}

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
    clone3_refused_ = true;
  } else {
    kill_all_marked(marker_entry_.c_str());
  }
}

}  // namespace ddp::agent
