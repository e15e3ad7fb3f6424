// The one way the agent starts a process: workers, standbys, health checks, the short helper
// programs of the fingerprint (run_child) and the containment's sentinel all start here. Modelled
// on folly's Subprocess: an options builder, plain data prepared in the parent so that the child
// touches nothing else, one child-side function that applies every rule, an exit-status value
// type, and one error type carrying the executable and errno.
//
// The child's rules, in this order (spawn.cpp, `child_main`), with every signal blocked from
// before the fork or clone until the last step before exec:
//   1. every signal the parent handles goes back to its default action (a handler of the agent's
//      run in the child would act on the agent's state, or on a copy of it), SIGPIPE too (the
//      agent ignores it for its sockets; programs expect the default), and the signals named by
//      ignore_signals() are ignored;
//   2. a process group of its own (process_group_leader());
//   3. the cgroup through its cgroup.procs, where it was not created inside it (cgroup());
//   4. the parent-death signal, then a check that the parent is still the one that started it;
//   5. descriptors: 0, 1, 2 from the options, keep_fd() under its own number, nothing else;
//   6. the working directory, the NUMA binding;
//   7. an empty signal mask (the child never inherits what the agent blocked);
//   8. exec (or the one sanctioned function, run_instead_of_exec()); an exec that fails writes
//      its errno to the parent through a close-on-exec pipe, and the child exits 127.
//
// Functions, no state shared between calls except whether clone3 was refused (process-wide, an
// atomic). Any thread; spawn_process() takes a mutex around the shared-memory clone (one child stack).
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "agent/numa.h"
#include "rendezvous/error.h"

namespace ddp::agent {

// How a process ended, or that it has not yet: a value. Exactly one of exit_code (exited) or
// signal (killed, core dumped) is meaningful. The fields are plain so that tests and fakes build
// statuses directly (`ExitStatus st; st.signal = SIGKILL;`); the default is "exited with code 0".
struct ExitStatus {
  enum class State { kRunning, kExited, kKilled, kDumpedCore };

  int exit_code = 0;         // the code of a process that exited
  int signal = 0;            // > 0: the signal that killed it
  bool core_dumped = false;  // killed, and the kernel wrote a core
  bool running = false;      // not ended yet (a wait that found it alive)

  static ExitStatus exited(int code);
  static ExitStatus killed(int signo, bool core_dumped = false);
  static ExitStatus still_running();
  // From waitpid's status word. REQUIRES: WIFEXITED or WIFSIGNALED (no WUNTRACED wait).
  static ExitStatus from_wait_status(int status);

  State state() const;
  bool success() const { return !running && signal == 0 && exit_code == 0; }
  // The shell's convention: the exit code, or 128 + the signal.
  int shell_code() const { return signal != 0 ? 128 + signal : exit_code; }
  // "exited with code 3", "killed by SIGKILL", "killed by SIGSEGV (core dumped)", "running".
  std::string str() const;
};

// A program could not be started: not found, not executable, no process (fork failed), no pipe.
// `executable` is what was to run (argv[0] as given), `error` the errno that said why (0 when
// none applies). `pids`: from a confirmation of several execs (Processes::confirm_spawned()),
// the processes that could not exec, already reaped. A LaunchError of exit code 2: a worker
// program that cannot start is a usage error.
class SpawnError : public LaunchError {
 public:
  SpawnError(std::string executable, int error, const std::string& what, std::vector<int> pids = {});
  // "cannot start X: <strerror>", with a hint when a #! line names a missing interpreter.
  static SpawnError exec_failed(const std::string& executable, int error, std::vector<int> pids = {});

  const std::string& executable() const { return executable_; }
  int error() const { return error_; }
  std::vector<int> pids;

 private:
  std::string executable_;
  int error_ = 0;
};

// What the child applies before its exec; a builder. Every descriptor and pointer it names must
// stay valid until spawn_process() returns. Plain data: spawn_process() turns it into the block the child reads.
class SpawnOptions {
 public:
  using ChildMain = void (*)(void*);

  // The child's descriptor 0, 1 or 2 (dup2'd there). Default -1: the parent's.
  SpawnOptions& stdin_from(int fd) { stdio_[0] = fd; return *this; }
  SpawnOptions& stdout_to(int fd) { stdio_[1] = fd; return *this; }
  SpawnOptions& stderr_to(int fd) { stdio_[2] = fd; return *this; }
  // One descriptor the child keeps under its own number (a standby's socket, a worker's channel,
  // the sentinel's pipe). Default -1: none. Every other descriptor above 2 is gone in the child,
  // whether or not it was opened close-on-exec (torchrun's close_fds=True).
  SpawnOptions& keep_fd(int fd) { keep_fd_ = fd; return *this; }
  // The child's working directory. Default: the parent's.
  SpawnOptions& chdir(std::string dir) { chdir_ = std::move(dir); return *this; }
  // PR_SET_PDEATHSIG: the child gets `signo` when the thread that started it dies; a child whose
  // parent is already gone exits 137 before its exec. Default 0: none.
  SpawnOptions& parent_death_signal(int signo) { parent_death_signal_ = signo; return *this; }
  // The child leads a new process group (its pid is the group id; the parent calls setpgid too,
  // so that a signal to the group cannot race the child). Default: the parent's group.
  SpawnOptions& process_group_leader() { process_group_leader_ = true; return *this; }
  // The cgroup the child runs in: created inside `dir_fd` (an O_PATH descriptor of the cgroup's
  // directory; clone3's CLONE_INTO_CGROUP) where the kernel allows it, else it writes itself into
  // `procs_fd` (its cgroup.procs) before exec. Either may be -1. Default: the parent's cgroup.
  SpawnOptions& cgroup(int dir_fd, int procs_fd) { cgroup_dir_fd_ = dir_fd; cgroup_procs_fd_ = procs_fd; return *this; }
  // --numa_binding for this child. Default: not bound.
  SpawnOptions& numa(const PreparedBinding& binding) { numa_ = binding; return *this; }
  // Signals the child ignores (SIG_IGN) from its start. Default: none beyond what it inherits.
  SpawnOptions& ignore_signals(std::initializer_list<int> signals);
  // DANGEROUS: instead of an exec, the forked child runs `main(arg)`, which must never return and
  // may make async-signal-safe calls only (the agent runs threads; the child has a copy of their
  // locks, in any state). For the containment's sentinel; the child is always forked, never
  // started sharing the parent's memory. Default: exec argv.
  SpawnOptions& run_instead_of_exec(ChildMain main, void* arg) { main_ = main; main_arg_ = arg; return *this; }

 private:
  friend struct SpawnAccess;
  int stdio_[3] = {-1, -1, -1};
  int keep_fd_ = -1;
  std::string chdir_;
  int parent_death_signal_ = 0;
  bool process_group_leader_ = false;
  int cgroup_dir_fd_ = -1, cgroup_procs_fd_ = -1;
  PreparedBinding numa_;
  sigset_t ignored_{};
  bool any_ignored_ = false;
  ChildMain main_ = nullptr;
  void* main_arg_ = nullptr;
};

// A started child. Until await_exec(), its exec may still fail: `exec_error_fd` is the read end
// of the pipe its errno would come on (close-on-exec in the child: end of file means it exec'd).
struct Spawned {
  pid_t pid = -1;
  int exec_error_fd = -1;
};

// Starts `argv` with exactly the environment `env` ("NAME=value" each) under `options`. argv[0]
// without a '/' is looked up on the parent's PATH, here, before the child exists; the child runs
// argv with argv[0] replaced by the path found. Returns at once after the fork, or once the child
// has exec'd (or failed to) when it shared the parent's memory; confirm with await_exec().
// With run_instead_of_exec(), argv and env may be empty and exec_error_fd is -1.
// Throws SpawnError (not found in PATH, no pipe, no process).
Spawned spawn_process(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                      const SpawnOptions& options);

// Waits until `child` has exec'd: 0, or the errno of the failed exec, in which case the child
// (which exited 127) is reaped here. Closes the pipe. REQUIRES: `child` came from spawn_process() with an
// exec and was not awaited yet.
int await_exec(Spawned& child);

// The signals this process handles (a handler, neither SIG_DFL nor SIG_IGN) now. spawn_process() resets
// them in every child.
sigset_t handled_signals();

}  // namespace ddp::agent
