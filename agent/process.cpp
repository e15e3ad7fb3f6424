#include "agent/process.h"

#include "agent/containment.h"
#include "agent/fds.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <boost/asio/signal_set.hpp>
#include <boost/process/search_path.hpp>

namespace bp = boost::process;

namespace ddp::agent {

namespace {

// What a new worker does between fork and exec, prepared by the agent before it forks.
struct ChildSetup {
  pid_t parent;
  int out_fd, err_fd, pass_fd, exec_error_fd;
  const PreparedBinding* numa;
  char* const* argv;
  char* const* envp;
};

// The child, between fork and exec: only async-signal-safe calls, no allocation (it may share
// the agent's memory: Containment::spawn_worker). Never returns.
void run_child(void* p) {
  const auto& c = *static_cast<const ChildSetup*>(p);
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != c.parent) ::_exit(137);  // the agent died before prctl took effect
  if (c.out_fd >= 0) ::dup2(c.out_fd, STDOUT_FILENO);
  if (c.err_fd >= 0) ::dup2(c.err_fd, STDERR_FILENO);
  // A worker gets 0, 1 and 2 and nothing else of the agent's (torchrun's close_fds=True),
  // whether or not each descriptor was opened close-on-exec.
  cloexec_fds_from(3);
  if (c.pass_fd >= 0) ::fcntl(c.pass_fd, F_SETFD, 0);
  // The agent's signal handlers are reset by exec; its ignored (SIGPIPE) and blocked signals
  // would not be.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGPIPE, &dfl, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  apply_numa_binding(*c.numa);
  ::execve(c.argv[0], c.argv, c.envp);
  const int error = errno;
  (void)!::write(c.exec_error_fd, &error, sizeof error);
  ::_exit(127);
}

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
    // A standby carries no marker: kill_all() (a restart) must not find it. It gets the marker
    // in the environment it applies when it becomes a worker (adopt()).
    if (!request.standby) {
      env_strings.push_back(std::string(Containment::kMarkerVariable) + "=" + containment_.marker_value());
    }
    std::vector<char*> envp;
    envp.reserve(env_strings.size() + 1);
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    char** const env_block = envp.data();
    const pid_t parent = ::getpid();
    const int out_fd = request.stdout_fd, err_fd = request.stderr_fd, pass_fd = request.pass_fd;
    const PreparedBinding numa = request.numa;
    std::vector<std::string> arg_strings = request.argv;
    arg_strings.at(0) = exe;
    std::vector<char*> argv;
    argv.reserve(arg_strings.size() + 1);
    for (auto& a : arg_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    // exec's failure travels back through this pipe (closed by a successful exec).
    int exec_error[2];
    if (::pipe2(exec_error, O_CLOEXEC) != 0) {
      throw SpawnError("cannot start " + request.argv.at(0) + ": pipe: " + std::strerror(errno));
    }
    // A worker starts in the worker group's cgroup (without a copy of the agent's memory where
    // it can: Containment::spawn_worker); a standby outside it, until adopt().
    ChildSetup setup{parent, out_fd, err_fd, pass_fd, exec_error[1], &numa, argv.data(), env_block};
    pid_t pid;
    if (request.standby) {
      pid = containment_.spawn_standby(&run_child, &setup);
    } else {
      pid = containment_.spawn_worker(&run_child, &setup);
    }
    const int fork_errno = errno;
    ::close(exec_error[1]);
    if (pid < 0) {
      ::close(exec_error[0]);
      throw SpawnError("cannot start " + request.argv.at(0) + ": fork: " + std::strerror(fork_errno));
    }
    // Close the window where the parent signals the group before the child ran setpgid.
    ::setpgid(pid, pid);
    containment_.watch_group(pid);
    containment_.check_member(pid);
    pending_.push_back({pid, exec_error[0], request.argv.at(0)});
    if (!request.check_exec_later) confirm_spawned();
    return pid;
  }

  void confirm_spawned() override {
    std::vector<PendingExec> pending;
    pending.swap(pending_);
    std::string failure;
    std::vector<int> failed;
    for (const PendingExec& p : pending) {
      int child_errno = 0;
      ssize_t n;
      while ((n = ::read(p.exec_error_fd, &child_errno, sizeof child_errno)) < 0 && errno == EINTR) {
      }
      ::close(p.exec_error_fd);
      if (n != static_cast<ssize_t>(sizeof child_errno)) continue;  // exec closed the pipe: it ran
      while (::waitpid(p.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      if (failed.empty()) {
        failure = "cannot start " + p.program + ": " + std::strerror(child_errno);
        if (child_errno == ENOENT && ::access(p.program.c_str(), F_OK) == 0) {
          failure += " (the program exists: the interpreter its #! line names does not)";
        }
      }
      failed.push_back(p.pid);
    }
    if (!failed.empty()) throw SpawnError(failure, std::move(failed));
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
      containment_.forget_standby(pid);
      if (on_exit_) on_exit_(pid, st);
    }
  }

  // A spawned process whose exec is not yet confirmed: its end of the close-on-exec pipe.
  struct PendingExec {
    int pid;
    int exec_error_fd;
    std::string program;
  };

  boost::asio::signal_set sigchld_;
  std::vector<PendingExec> pending_;
  ExitHandler on_exit_;
  bool closed_ = false;
  Containment containment_;  // its destructor ends the sentinel, which removes the cgroup
};

}  // namespace

std::unique_ptr<Processes> make_posix_processes(boost::asio::io_context& io) {
  return std::make_unique<PosixProcesses>(io);
}

}  // namespace ddp::agent
