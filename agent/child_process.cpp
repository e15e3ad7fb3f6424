#include "agent/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

extern char** environ;

namespace ddp::agent {

ChildResult run_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                      std::chrono::milliseconds timeout) {
  ChildResult r;
  int out_pipe[2], err_pipe[2], exec_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) { r.error = std::strerror(errno); return r; }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    r.error = std::strerror(errno);
    close(out_pipe[0]); close(out_pipe[1]);
    return r;
  }
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) {
    r.error = std::strerror(errno);
    close(out_pipe[0]); close(out_pipe[1]); close(err_pipe[0]); close(err_pipe[1]);
    return r;
  }
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> cenv;
  for (auto& e : env_strings) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec. The agent may block signals for its own
    // handling; the probe must not inherit that.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    setpgid(0, 0);
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    execvpe(cargv[0], cargv.data(), cenv.data());
    int e = errno;
    ssize_t ignored = write(exec_pipe[1], &e, sizeof e);
    (void)ignored;
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  close(exec_pipe[1]);
  if (pid < 0) {
    r.error = std::string("fork: ") + std::strerror(errno);
    close(out_pipe[0]); close(err_pipe[0]); close(exec_pipe[0]);
    return r;
  }
  setpgid(pid, pid);  // also from the parent: no race with the kill below
  int exec_errno = 0;
  bool exec_failed = read(exec_pipe[0], &exec_errno, sizeof exec_errno) == sizeof exec_errno;
  close(exec_pipe[0]);
  r.started = !exec_failed;
  if (exec_failed) r.error = std::string("cannot run ") + argv[0] + ": " + std::strerror(exec_errno);

  const std::size_t limit = 16u << 20;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      kill(-pid, SIGKILL);
      break;
    }
    int n = poll(fds, 2, static_cast<int>(std::min<long long>(left.count() + 1, 1000)));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2 && n > 0; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        if (sinks[i]->size() < limit) sinks[i]->append(buf, static_cast<std::size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds) if (f.fd >= 0) close(f.fd);
  int status = 0;
  if (r.timed_out) kill(-pid, SIGKILL);
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) r.exit_code = 128 + WTERMSIG(status);
  return r;
}

std::string describe_failure(const std::string& what, const ChildResult& r,
                             std::chrono::milliseconds timeout) {
  if (!r.started) return what + ": " + r.error;
  if (r.timed_out) {
    return what + ": no answer within " + std::to_string(timeout.count() / 1000.0).substr(0, 5) +
           " s (killed)";
  }
  std::string tail = r.err.size() > 400 ? r.err.substr(r.err.size() - 400) : r.err;
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) tail.pop_back();
  return what + ": exit code " + std::to_string(r.exit_code) + (tail.empty() ? "" : ": " + tail);
}

}  // namespace ddp::agent
