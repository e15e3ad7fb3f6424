#include "agent/process.h"

#include "agent/containment.h"
#include "agent/fds.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <set>

#include <boost/asio/signal_set.hpp>

namespace ddp::agent {

namespace {

// Reaps children on SIGCHLD: the exit of a worker is an event, never polled.
class PosixProcesses final : public Processes {
 public:
  explicit PosixProcesses(boost::asio::io_context& io) : sigchld_(io, SIGCHLD) { wait_for_sigchld(); }

  void set_exit_handler(ExitHandler on_exit) override { on_exit_ = std::move(on_exit); }

  int spawn(const SpawnRequest& request) override {
    // Whatever was opened since the last spawn (a rendezvous socket) becomes close-on-exec.
    mark_open_fds_cloexec();
    // A standby carries no marker: kill_all() (a restart) must not find it. It gets the marker
    // in the environment it applies when it becomes a worker (adopt()).
    std::vector<std::string> env;
    env.reserve(request.env.size() + 1);
    for (const auto& [k, v] : request.env) {
      if (k != Containment::kMarkerVariable) env.push_back(k + "=" + v);
    }
    if (!request.standby) env.push_back(std::string(Containment::kMarkerVariable) + "=" + containment_.marker_value());
    SpawnOptions options;
    options.stdout_to(request.stdout_fd)
        .stderr_to(request.stderr_fd)
        .keep_fd(request.pass_fd)
        .parent_death_signal(SIGKILL)
        .process_group_leader()
        .numa(request.numa);
    // A worker starts in the worker group's cgroup; a standby outside it, until adopt().
    if (!request.standby) containment_.place_worker(options);
    Spawned child = spawn_process(request.argv, env, options);
    if (request.standby) containment_.add_standby(child.pid);
    containment_.watch_group(child.pid);
    containment_.check_member(child.pid);
    live_.insert(child.pid);
    pending_.push_back({child, request.argv.at(0)});
    if (!request.check_exec_later) confirm_spawned();
    return child.pid;
  }

  void confirm_spawned() override {
    std::vector<PendingExec> pending;
    pending.swap(pending_);
    int first_error = 0;
    std::string first_program;
    std::vector<int> failed;
    for (PendingExec& p : pending) {
      const int error = await_exec(p.child);
      if (error == 0) continue;
      if (failed.empty()) {
        first_error = error;
        first_program = p.program;
      }
      failed.push_back(p.child.pid);
      live_.erase(p.child.pid);
    }
    if (!failed.empty()) throw SpawnError::exec_failed(first_program, first_error, std::move(failed));
  }

  void signal_group(int pgid, int signo) override {
    if (pgid > 0) ::kill(-pgid, signo);
  }

  void signal_process(int pid, int signo) override {
    if (pid > 0) ::kill(pid, signo);
  }

  void adopt(int pid, std::map<std::string, std::string>& env) override {
    if (!containment_.adopt_standby(pid)) return;
    env[Containment::kMarkerVariable] = containment_.marker_value();
  }

  void kill_leftovers() override { containment_.kill_all(); }

  void reap_exited() override {
    if (!closed_) reap();
  }

  void close() override {
    containment_.kill_all();
    closed_ = true;
    boost::system::error_code ignored;
    sigchld_.cancel(ignored);
    reap_the_killed();
  }

 private:
  void wait_for_sigchld() {
    sigchld_.async_wait([this](const boost::system::error_code& ec, int) {
      if (ec || closed_) return;
      reap();
      wait_for_sigchld();
    });
  }

  void reap() {
    for (;;) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;  // 0: others still run; -1/ECHILD: none left
      if (!WIFSIGNALED(status) && !WIFEXITED(status)) continue;
      const ExitStatus st = ExitStatus::from_wait_status(status);
      live_.erase(pid);
      containment_.forget_standby(pid);
      if (on_exit_) on_exit_(pid, st);
    }
  }

  // The agent is done: whatever it started and has not reaped (a standby, a health check) is
  // SIGKILLed and reaped before it exits, so that a caller who sees the agent gone finds none of
  // its processes either. Bounded: a process the kernel cannot kill (stuck in a device driver)
  // is left to the sentinel and to init.
  void reap_the_killed() {
    for (int pid : live_) ::kill(-pid, SIGKILL);
    constexpr int kTries = 500;  // 5 s in steps of 10 ms
    for (int i = 0; i < kTries && !live_.empty(); ++i) {
      for (auto it = live_.begin(); it != live_.end();) {
        int status = 0;
        const pid_t r = ::waitpid(*it, &status, WNOHANG);
        if (r == 0) {
          ++it;
          continue;
        }
        containment_.forget_standby(*it);
        it = live_.erase(it);
      }
      if (!live_.empty()) ::usleep(10'000);
    }
  }

  // A spawned process whose exec is not yet confirmed: its end of the close-on-exec pipe.
  struct PendingExec {
    Spawned child;
    std::string program;
  };

  boost::asio::signal_set sigchld_;
  std::vector<PendingExec> pending_;
  std::set<int> live_;  // spawned, not yet reaped
  ExitHandler on_exit_;
  bool closed_ = false;
  Containment containment_;  // its destructor ends the sentinel, which removes the cgroup
};

}  // namespace

std::unique_ptr<Processes> make_posix_processes(boost::asio::io_context& io) {
  return std::make_unique<PosixProcesses>(io);
}

}  // namespace ddp::agent
