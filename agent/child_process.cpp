#include "agent/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "agent/spawn.h"

namespace ddp::agent {

namespace {

void close_both(int fds[2]) {
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace

ChildResult run_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                      std::chrono::milliseconds timeout) {
  ChildResult r;
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    r.error = std::strerror(errno);
    return r;
  }
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    r.error = std::strerror(errno);
    close_both(out_pipe);
    return r;
  }
  std::vector<std::string> env_strings;
  env_strings.reserve(env.size());
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  SpawnOptions options;
  options.stdin_from(devnull).stdout_to(out_pipe[1]).stderr_to(err_pipe[1]).process_group_leader();
  Spawned child;
  int exec_errno = 0;
  try {
    child = spawn_process(argv, env_strings, options);
    exec_errno = await_exec(child);
  } catch (const SpawnError& e) {
    exec_errno = e.error();
  }
  if (devnull >= 0) ::close(devnull);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (child.pid < 0 || exec_errno != 0) {
    // Not started: not found, no process, or an exec that failed (that child is reaped).
    r.error = std::string("cannot run ") + argv.at(0) + ": " + std::strerror(exec_errno);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    return r;
  }
  const pid_t pid = child.pid;
  r.started = true;

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
  r.exit_code = ExitStatus::from_wait_status(status).shell_code();
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
