// The seam between the agent and the operating system's processes: start a worker, signal its
// process group, hear when it exits. PosixProcesses is the real one (agent/spawn.h to start, a
// SIGCHLD signal_set plus waitpid to reap, agent/containment.h so that nothing outlives the
// agent); tests swap in a fake.
//
// Owned by the Agent; lives as long as the agent run; every call and callback happens on the
// agent's io_context thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "agent/numa.h"
#include "agent/spawn.h"  // ExitStatus, SpawnError

namespace ddp::agent {

struct SpawnRequest {
  std::vector<std::string> argv;              // argv[0] is searched in PATH when it has no '/'
  std::map<std::string, std::string> env;     // the complete environment
  // A descriptor the process inherits under its own number (a standby's socket,
  // DDPLAUNCH_STANDBY_FD), besides 0, 1 and 2. -1 (default): none.
  int pass_fd = -1;
  // A standby (agent/standby.h): it dies with the agent like a worker, but stays outside the
  // worker group's containment (kill_leftovers() spares it) until adopt() makes it a worker.
  // Default false.
  bool standby = false;
  int stdout_fd = -1;                         // -1: inherit the agent's stdout
  int stderr_fd = -1;                         // -1: inherit the agent's stderr
  PreparedBinding numa;                       // --numa_binding; default: not bound
  // The exec's outcome is checked by the next confirm_spawned() instead of before spawn()
  // returns: a worker group forks each worker while the ones before it exec.
  bool check_exec_later = false;
};

class Processes {
 public:
  using ExitHandler = std::function<void(int pid, ExitStatus status)>;
  virtual ~Processes() = default;
  // REQUIRES: called once, before spawn(). `on_exit` fires once per spawned process.
  virtual void set_exit_handler(ExitHandler on_exit) = 0;
  // Starts a process in a new process group (its pid is the group id) that dies with the agent,
  // and so does everything it starts (a sentinel process and a cgroup: agent/containment.h).
  // The process inherits descriptors 0, 1 and 2 only.
  // Returns its pid. Throws SpawnError.
  virtual int spawn(const SpawnRequest& request) = 0;
  // Waits until every process spawned with check_exec_later has exec'd. Throws SpawnError
  // naming the first that could not; those that could not are reaped here (SpawnError::pids),
  // and no exit is delivered for them.
  // REQUIRES: called before control returns to the event loop after such a spawn().
  virtual void confirm_spawned() {}
  // Sends `signo` to the process group `pgid`; a group that is gone is not an error.
  virtual void signal_group(int pgid, int signo) = 0;
  // Sends `signo` to the process `pid` alone (a hung worker asked for its stacks, a worker whose
  // torch file timer expired); a process that is gone is not an error. The fake records nothing.
  virtual void signal_process(int pid, int signo) { (void)pid, (void)signo; }
  // A standby (spawned with `standby`) becomes a worker: from now on it is contained like one
  // (its cgroup, kill_leftovers()), and `env`, the environment it will apply, gets what the
  // containment needs its descendants to inherit. The fake has nothing to do.
  virtual void adopt(int pid, std::map<std::string, std::string>& env) { (void)pid, (void)env; }
  // SIGKILLs whatever is left of the worker group after its workers were reaped: the members of
  // their process groups and, where the machine has a cgroup for them, everything in it
  // (processes that called setsid). The fake of the tests has nothing to clean up.
  virtual void kill_leftovers() {}
  // Delivers now, through the exit handler, the exits of processes that have already ended,
  // whose SIGCHLD may still wait behind other events (an agent that was descheduled or stopped
  // sees a socket message and a SIGCHLD at once, in no defined order). The fake delivers its
  // exits itself.
  virtual void reap_exited() {}
  // Kills what is left (kill_leftovers(), and every spawned process not yet reaped, standbys
  // among them), stops listening for exits (the agent is done), and reaps the killed, waiting
  // at most 5 s: when the agent is gone, so is everything it started.
  virtual void close() = 0;
};

std::unique_ptr<Processes> make_posix_processes(boost::asio::io_context& io);

}  // namespace ddp::agent
