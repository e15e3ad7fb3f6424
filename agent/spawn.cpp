#include "agent/spawn.h"

#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

#include <boost/process/search_path.hpp>

#include "agent/fds.h"

namespace ddp::agent {

// ---- the exit status ----------------------------------------------------------------------

ExitStatus ExitStatus::exited(int code) {
  ExitStatus s;
  s.exit_code = code;
  return s;
}

ExitStatus ExitStatus::killed(int signo, bool core_dumped) {
  ExitStatus s;
  s.signal = signo;
  s.core_dumped = core_dumped;
  return s;
}

ExitStatus ExitStatus::still_running() {
  ExitStatus s;
  s.running = true;
  return s;
}

ExitStatus ExitStatus::from_wait_status(int status) {
  if (WIFSIGNALED(status)) return killed(WTERMSIG(status), WCOREDUMP(status));
  return exited(WEXITSTATUS(status));
}

ExitStatus::State ExitStatus::state() const {
  if (running) return State::kRunning;
  if (signal == 0) return State::kExited;
  return core_dumped ? State::kDumpedCore : State::kKilled;
}

std::string ExitStatus::str() const {
  switch (state()) {
    case State::kRunning:
      return "running";
    case State::kExited:
      return "exited with code " + std::to_string(exit_code);
    case State::kKilled:
    case State::kDumpedCore:
      break;
  }
  const char* abbrev = sigabbrev_np(signal);
  std::string text = "killed by " + (abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signal));
  return core_dumped ? text + " (core dumped)" : text;
}

// ---- the error ----------------------------------------------------------------------------

SpawnError::SpawnError(std::string executable, int error, const std::string& what, std::vector<int> pids)
    : LaunchError(ExitCode::kUsage, what), pids(std::move(pids)), executable_(std::move(executable)), error_(error) {}

SpawnError SpawnError::exec_failed(const std::string& executable, int error, std::vector<int> pids) {
  std::string what = "cannot start " + executable + ": " + std::strerror(error);
  if (error == ENOENT && ::access(executable.c_str(), F_OK) == 0) {
    what += " (the program exists: the interpreter its #! line names does not)";
  }
  return SpawnError(executable, error, what, std::move(pids));
}

SpawnOptions& SpawnOptions::ignore_signals(std::initializer_list<int> signals) {
  if (!any_ignored_) sigemptyset(&ignored_);
  for (int s : signals) sigaddset(&ignored_, s);
  any_ignored_ = true;
  return *this;
}

sigset_t handled_signals() {
  sigset_t handled;
  sigemptyset(&handled);
  for (int s = 1; s < NSIG; ++s) {
    struct sigaction sa {};
    if (::sigaction(s, nullptr, &sa) != 0) continue;  // glibc's reserved signals, 32 and 33
    if (sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN) sigaddset(&handled, s);
  }
  return handled;
}

// ---- the child ----------------------------------------------------------------------------

// Everything the child reads, prepared by the parent: the child allocates nothing and reads
// nothing else (it may share the parent's memory, and the parent runs threads whose locks the
// child's copy holds in any state).
struct StartBlock {
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  int stdio[3] = {-1, -1, -1};
  int keep_fd = -1;
  const char* chdir = nullptr;
  int procs_fd = -1;  // -1 when the child was created inside its cgroup
  int parent_death_signal = 0;
  pid_t parent = 0;
  bool process_group_leader = false;
  const PreparedBinding* numa = nullptr;
  sigset_t reset;    // back to SIG_DFL
  sigset_t ignored;  // to SIG_IGN
  SpawnOptions::ChildMain main = nullptr;
  void* main_arg = nullptr;
  int exec_error_fd = -1;
};

struct SpawnAccess {
  static void fill(const SpawnOptions& o, StartBlock& b) {
    for (int i = 0; i < 3; ++i) b.stdio[i] = o.stdio_[i];
    b.keep_fd = o.keep_fd_;
    b.chdir = o.chdir_.empty() ? nullptr : o.chdir_.c_str();
    b.parent_death_signal = o.parent_death_signal_;
    b.process_group_leader = o.process_group_leader_;
    b.numa = o.numa_.enabled ? &o.numa_ : nullptr;
    if (o.any_ignored_) {
      b.ignored = o.ignored_;
    } else {
      sigemptyset(&b.ignored);
    }
    b.main = o.main_;
    b.main_arg = o.main_arg_;
  }
  static int cgroup_dir_fd(const SpawnOptions& o) { return o.cgroup_dir_fd_; }
  static int cgroup_procs_fd(const SpawnOptions& o) { return o.cgroup_procs_fd_; }
};

namespace {

[[noreturn]] void report_and_exit(int exec_error_fd) {
  const int error = errno;
  if (exec_error_fd >= 0) (void)!::write(exec_error_fd, &error, sizeof error);
  ::_exit(127);
}

// The child's rules (agent/spawn.h), in one place for every process the agent starts. Runs
// between the fork or clone and the exec: async-signal-safe calls on the block only. Every
// signal is blocked on entry (the parent blocked them all before it forked).
[[noreturn]] void child_main(void* p) {
  const StartBlock& b = *static_cast<const StartBlock*>(p);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  for (int s = 1; s < NSIG; ++s) {
    if (sigismember(&b.ignored, s) == 1) {
      ::sigaction(s, &ign, nullptr);
    } else if (sigismember(&b.reset, s) == 1) {
      ::sigaction(s, &dfl, nullptr);
    }
  }
  if (b.process_group_leader) ::setpgid(0, 0);
  if (b.procs_fd >= 0) (void)!::write(b.procs_fd, "0", 1);
  if (b.parent_death_signal != 0) {
    ::prctl(PR_SET_PDEATHSIG, b.parent_death_signal);
    if (::getppid() != b.parent) ::_exit(137);  // the parent died before prctl took effect
  }
  for (int i = 0; i < 3; ++i) {
    if (b.stdio[i] >= 0 && b.stdio[i] != i) ::dup2(b.stdio[i], i);
  }
  if (b.main != nullptr) {
    close_fds_from(3, b.keep_fd);  // no exec will close them
  } else {
    cloexec_fds_from(3);  // the exec closes them; the exec error pipe stays usable until then
    if (b.keep_fd >= 0) ::fcntl(b.keep_fd, F_SETFD, 0);
  }
  if (b.chdir != nullptr && ::chdir(b.chdir) != 0) report_and_exit(b.exec_error_fd);
  if (b.numa != nullptr) apply_numa_binding(*b.numa);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (b.main != nullptr) {
    b.main(b.main_arg);
    ::_exit(127);
  }
  ::execve(b.argv[0], b.argv, b.envp);
  report_and_exit(b.exec_error_fd);
}

// Blocks every signal in the calling thread while it lives: no handler of the parent's may run
// in the child before child_main has reset it.
class AllSignalsBlocked {
 public:
  AllSignalsBlocked() {
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old_);
  }
  ~AllSignalsBlocked() { ::pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  AllSignalsBlocked(const AllSignalsBlocked&) = delete;
  AllSignalsBlocked& operator=(const AllSignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

// struct clone_args of linux/sched.h (version 2, with `cgroup`), spelled out: that header
// clashes with glibc's <sched.h>.
struct CloneArgs {
  std::uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size,
      cgroup;
};
constexpr std::uint64_t kCloneVm = 0x100, kCloneVfork = 0x4000, kCloneIntoCgroup = 0x200000000ULL;

// A seccomp filter or an old kernel refuses clone3: from then on every child is forked and moves
// itself into its cgroup. Process-wide, like the filter.
std::atomic<bool> g_clone3_refused{false};

bool is_refusal(int error) { return error == ENOSYS || error == EPERM || error == EINVAL || error == E2BIG; }

}  // namespace

// ---- starting a child without copying the parent ------------------------------------------
//
// A worker is created the way posix_spawn creates a program: clone3(CLONE_VM | CLONE_VFORK |
// CLONE_INTO_CGROUP). No page table is copied, nothing is copied on write in the agent
// afterwards, the exec tears nothing down, and the child is born inside the worker group's
// cgroup (moving a running process costs the kernel an RCU grace period: 10-30 ms for the first
// worker of a run, bench/RESULTS.md). glibc offers no route: posix_spawn cannot name a cgroup
// before glibc 2.39 (Debian 12 has 2.36) nor set a parent-death signal or a NUMA binding at all,
// and clone(), which does switch stacks, takes no CLONE_INTO_CGROUP.
//
// A child that shares the parent's memory must run on a stack of its own: on the parent's it
// would overwrite the frames the parent returns through once it resumes (the return address of
// syscall() first). syscall(SYS_clone3, ...) with a new stack cannot be used either: the child
// would return from syscall() with an empty stack. Hence one small function in assembly, the
// only one: the system call, then, in the child, a call of fn(arg) on the new stack. Sanitizers
// keep state per stack and thread that a child on a foreign stack sharing the agent's memory
// would confuse: sanitized builds, and other architectures, take the fork routes below.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define DDP_SANITIZED 1
#endif
#endif
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && !defined(DDP_SANITIZED)
#define DDP_SHARED_VM_SPAWN 1
// long ddp_clone3_run(clone_args*, size, fn, arg): clone3 (435) in the calling thread; returns
// the child's pid or -errno there. The child starts on the stack clone_args names (the kernel
// sets its stack pointer to the stack's top) and calls fn(arg), which never returns. Registers
// r8 and r9 survive the system call in both; nothing of the caller's frame is touched in the
// child.
extern "C" long ddp_clone3_run(void* args, std::size_t size, void (*fn)(void*), void* arg);
asm(R"(
    .text
    .globl ddp_clone3_run
    .hidden ddp_clone3_run
    .type ddp_clone3_run, @function
ddp_clone3_run:
    movq %rdx, %r8
    movq %rcx, %r9
    movl $435, %eax
    syscall
    testq %rax, %rax
    jz 1f
    ret
1:
    xorl %ebp, %ebp
    movq %r9, %rdi
    callq *%r8
    ud2
    .size ddp_clone3_run, .-ddp_clone3_run
)");

namespace {

// The child's stack. One suffices: the spawning thread waits (CLONE_VFORK) until the child has
// exec'd or exited, and the mutex keeps two threads from using it at once.
alignas(64) char g_child_stack[256 * 1024];
std::mutex g_child_stack_mutex;

// The shared-memory start; -1 with errno when clone3 failed.
pid_t clone_sharing_memory(StartBlock& block, int cgroup_dir_fd) {
  const std::lock_guard<std::mutex> lock(g_child_stack_mutex);
  CloneArgs args{};
  args.flags = kCloneVm | kCloneVfork | kCloneIntoCgroup;
  args.exit_signal = SIGCHLD;
  args.stack = reinterpret_cast<std::uint64_t>(g_child_stack);
  args.stack_size = sizeof g_child_stack;
  args.cgroup = static_cast<std::uint64_t>(cgroup_dir_fd);
  const long r = ddp_clone3_run(&args, sizeof args, &child_main, &block);
  if (r >= 0) return static_cast<pid_t>(r);
  errno = static_cast<int>(-r);
  return -1;
}

}  // namespace
#endif

namespace {

// Creates the child by the cheapest route the block and the machine allow; the child runs
// child_main. Returns its pid, or -1 with errno. REQUIRES: every signal blocked.
pid_t start_child(StartBlock& block, int cgroup_dir_fd, int cgroup_procs_fd) {
  if (cgroup_dir_fd >= 0 && !g_clone3_refused.load(std::memory_order_relaxed)) {
#ifdef DDP_SHARED_VM_SPAWN
    if (block.main == nullptr) {  // an exec follows: the child may share the parent's memory
      const pid_t pid = clone_sharing_memory(block, cgroup_dir_fd);
      if (pid >= 0 || !is_refusal(errno)) return pid;
      g_clone3_refused = true;
    }
#endif
    if (!g_clone3_refused.load(std::memory_order_relaxed)) {
      // Born inside, with a copy of the parent's memory (fork's semantics: the child continues
      // here, on its own copy of this stack).
      CloneArgs args{};
      args.flags = kCloneIntoCgroup;
      args.exit_signal = SIGCHLD;
      args.cgroup = static_cast<std::uint64_t>(cgroup_dir_fd);
      const long pid = ::syscall(SYS_clone3, &args, sizeof args);
      if (pid == 0) child_main(&block);
      if (pid > 0 || !is_refusal(errno)) return static_cast<pid_t>(pid);
      g_clone3_refused = true;
    }
  }
  block.procs_fd = cgroup_procs_fd;  // forked outside: the child moves itself in
  const pid_t pid = ::fork();
  if (pid == 0) child_main(&block);
  return pid;
}

}  // namespace

Spawned spawn_process(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                      const SpawnOptions& options) {
  StartBlock block;
  SpawnAccess::fill(options, block);
  const bool exec = block.main == nullptr;
  const std::string shown = argv.empty() ? std::string("a child process") : argv.front();
  std::string path;
  std::vector<char*> cargv, cenv;
  if (exec) {
    if (argv.empty()) throw SpawnError("", EINVAL, "cannot start a process with no argv");
    path = argv.front();
    if (path.find('/') == std::string::npos) {
      path = boost::process::search_path(path).string();
      if (path.empty()) throw SpawnError(shown, ENOENT, "cannot start " + shown + ": not found in PATH");
    }
    // execve takes char* const[] for history's sake; it writes none of them.
    cargv.reserve(argv.size() + 1);
    cargv.push_back(path.data());
    for (std::size_t i = 1; i < argv.size(); ++i) cargv.push_back(const_cast<char*>(argv[i].c_str()));
    cargv.push_back(nullptr);
    cenv.reserve(env.size() + 1);
    for (const auto& e : env) cenv.push_back(const_cast<char*>(e.c_str()));
    cenv.push_back(nullptr);
    block.argv = cargv.data();
    block.envp = cenv.data();
  }
  // An exec's failure travels back through this pipe (closed by a successful exec).
  int exec_error[2] = {-1, -1};
  if (exec && ::pipe2(exec_error, O_CLOEXEC) != 0) {
    const int error = errno;
    throw SpawnError(shown, error, "cannot start " + shown + ": pipe: " + std::strerror(error));
  }
  block.exec_error_fd = exec_error[1];
  block.parent = ::getpid();
  pid_t pid;
  int start_errno;
  {
    const AllSignalsBlocked blocked;
    // Read here, not once: handlers come and go (Asio installs one per signal_set). The agent
    // installs its handlers on the thread that spawns, so none appears between this read and the
    // clone.
    block.reset = handled_signals();
    sigaddset(&block.reset, SIGPIPE);
    pid = start_child(block, exec ? SpawnAccess::cgroup_dir_fd(options) : -1, SpawnAccess::cgroup_procs_fd(options));
    start_errno = errno;
  }
  if (exec_error[1] >= 0) ::close(exec_error[1]);
  if (pid < 0) {
    if (exec_error[0] >= 0) ::close(exec_error[0]);
    throw SpawnError(shown, start_errno, "cannot start " + shown + ": fork: " + std::strerror(start_errno));
  }
  // Also from the parent: a signal to the group cannot race the child's own setpgid.
  if (block.process_group_leader) ::setpgid(pid, pid);
  return Spawned{pid, exec_error[0]};
}

int await_exec(Spawned& child) {
  if (child.exec_error_fd < 0) return 0;
  int child_errno = 0;
  ssize_t n;
  while ((n = ::read(child.exec_error_fd, &child_errno, sizeof child_errno)) < 0 && errno == EINTR) {
  }
  ::close(child.exec_error_fd);
  child.exec_error_fd = -1;
  if (n != static_cast<ssize_t>(sizeof child_errno)) return 0;  // the exec closed the pipe: it ran
  while (::waitpid(child.pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  return child_errno;
}

}  // namespace ddp::agent
