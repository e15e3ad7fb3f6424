#include "agent/process.h"

#include "agent/containment.h"
#include "agent/fds.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <boost/asio/signal_set.hpp>
#include <boost/process/args.hpp>
#include <boost/process/child.hpp>
#include <boost/process/env.hpp>
#include <boost/process/environment.hpp>
#include <boost/process/exe.hpp>
#include <boost/process/extend.hpp>
#include <boost/process/search_path.hpp>

namespace bp = boost::process;

namespace ddp::agent {

namespace {

// Reaps children on SIGCHLD: the exit of a worker is an event, never polled.
class PosixProcesses final : public Processes {
 public:
  explicit PosixProcesses(boost::asio::io_context& io) : sigchld_(io, SIGCHLD) { wait_for_sigchld(); }

  void set_exit_handler(ExitHandler on_exit) override { on_exit_ = std::move(on_exit); }

  int spawn(const SpawnRequest& request) override {
    std::string exe = request.argv.at(0);
    if (exe.find('/') == std::string::npos) {
      auto found = bp::search_path(exe);
      if (found.empty()) throw SpawnError("cannot start " + exe + ": not found in PATH");
      exe = found.string();
    }
    // Whatever was opened since the last spawn (a rendezvous socket) becomes close-on-exec.
    mark_open_fds_cloexec();
    // The environment block execve gets, built here: Boost.Process 1.74's bp::environment reads
    // past the end of shorter keys on every lookup (boostorg/process#246, found by ASan).
    std::vector<std::string> env_strings;
    env_strings.reserve(request.env.size() + 1);
    for (const auto& [k, v] : request.env) {
      if (k != Containment::kMarkerVariable) env_strings.push_back(k + "=" + v);
    }
    env_strings.push_back(std::string(Containment::kMarkerVariable) + "=" + containment_.marker_value());
    std::vector<char*> envp;
    envp.reserve(env_strings.size() + 1);
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    char** const env_block = envp.data();
    const pid_t parent = ::getpid();
    const int out_fd = request.stdout_fd, err_fd = request.stderr_fd;
    const int cgroup_procs = containment_.cgroup_procs_fd();
    const PreparedBinding numa = request.numa;
    auto setup = [parent, out_fd, err_fd, cgroup_procs, numa, env_block](auto& executor) {
      // Runs in the child between fork and exec: only async-signal-safe calls.
      executor.env = env_block;  // the block above, alive in the parent's frame until exec
      ::setpgid(0, 0);
      // Into the worker group's cgroup, which cgroup.kill ends whole (docs/agent.md).
      if (cgroup_procs >= 0) (void)!::write(cgroup_procs, "0", 1);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(137);  // the agent died before prctl took effect
      if (out_fd >= 0) ::dup2(out_fd, STDOUT_FILENO);
      if (err_fd >= 0) ::dup2(err_fd, STDERR_FILENO);
      // A worker gets 0, 1 and 2 and nothing else of the agent's (torchrun's close_fds=True),
      // whether or not each descriptor was opened close-on-exec.
      cloexec_fds_from(3);
      // The agent's signal handlers are reset by exec; its ignored (SIGPIPE) and blocked
      // signals would not be.
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      ::sigaction(SIGPIPE, &dfl, nullptr);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      apply_numa_binding(numa);
    };
    std::vector<std::string> args(request.argv.begin() + 1, request.argv.end());
    std::error_code ec;
    bp::child child(bp::exe = exe, bp::args = args, bp::extend::on_exec_setup = setup, ec);
    if (ec) throw SpawnError("cannot start " + request.argv.at(0) + ": " + ec.message());
    const int pid = child.id();
    child.detach();  // reaped by the SIGCHLD loop below
    // Close the window where the parent signals the group before the child ran setpgid.
    ::setpgid(pid, pid);
    containment_.watch_group(pid);
    containment_.check_member(pid);
    return pid;
  }

  void signal_group(int pgid, int signo) override {
    if (pgid > 0) ::kill(-pgid, signo);
  }

  void signal_process(int pid, int signo) override {
    if (pid > 0) ::kill(pid, signo);
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
      ExitStatus st;
      if (WIFSIGNALED(status)) {
        st.signal = WTERMSIG(status);
      } else if (WIFEXITED(status)) {
        st.exit_code = WEXITSTATUS(status);
      } else {
        continue;
      }
      if (on_exit_) on_exit_(pid, st);
    }
  }

  boost::asio::signal_set sigchld_;
  ExitHandler on_exit_;
  bool closed_ = false;
  Containment containment_;  // its destructor ends the sentinel, which removes the cgroup
};

}  // namespace

std::unique_ptr<Processes> make_posix_processes(boost::asio::io_context& io) {
  return std::make_unique<PosixProcesses>(io);
}

}  // namespace ddp::agent
