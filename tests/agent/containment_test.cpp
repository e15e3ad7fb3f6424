// The worker group's containment (agent/containment.*) with real processes, started by the
// spawner (agent/spawn.h) as the agent starts them: which workers prove that the group's cgroup
// works, what a restart kills and what it spares. Skipped, with the reason printed, where no cgroup can be made.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "agent/containment.h"
#include "agent/spawn.h"
#include "tests/agent/wait_until.h"

using namespace ddp::agent;

namespace {

using ddp::agent::testing::wait_until;

// Forks a child that joins the cgroup (as a worker does between fork and exec) when `join`,
// then exits at once when `exit_now`, else waits to be killed. Async-signal-safe calls only.
pid_t fork_member(const Containment& c, bool join, bool exit_now) {
  const int procs = c.cgroup_procs_fd();
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (join) (void)!::write(procs, "0", 1);
    if (exit_now) ::_exit(0);
    for (;;) ::pause();
  }
  return pid;
}

// Starts `argv` as the agent starts a worker (agent/process.cpp): inside the cgroup, leading its
// own process group, and waits for its exec.
pid_t start_worker(const Containment& c, const std::vector<std::string>& argv, int stdout_fd = -1) {
  SpawnOptions options;
  options.process_group_leader().stdout_to(stdout_fd);
  c.place_worker(options);
  Spawned child = spawn_process(argv, {}, options);
  REQUIRE(await_exec(child) == 0);
  return child.pid;
}

// Starts a standby as the agent does: outside the cgroup, its own process group.
pid_t start_standby(Containment& c) {
  SpawnOptions options;
  options.process_group_leader();
  Spawned child = spawn_process({"/bin/sleep", "1000"}, {}, options);
  REQUIRE(await_exec(child) == 0);
  c.add_standby(child.pid);
  c.watch_group(child.pid);
  return child.pid;
}

void end(pid_t pid) {
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

}  // namespace

TEST_SUITE("the worker group is contained") {
  TEST_CASE("a first worker that has already exited does not make the agent give up its cgroup") {
    Containment c;
    if (c.cgroup_dir().empty()) {
      MESSAGE("skipped: no cgroup for the worker group here: " << c.cgroup_problem());
      return;
    }
    const pid_t quick = fork_member(c, true, true);
    REQUIRE(quick > 0);
    // A zombie's /proc/PID/cgroup reads "0::/", as if it had never joined.
    REQUIRE(wait_until([&] { return process_state(quick) == 'Z'; }, std::chrono::seconds(10)));
    c.check_member(quick);
    CHECK(c.cgroup_problem().empty());
    CHECK(c.cgroup_procs_fd() >= 0);
    ::waitpid(quick, nullptr, 0);
    // The next worker, running, decides: it joined, so the cgroup is kept.
    const pid_t running = fork_member(c, true, false);
    REQUIRE(running > 0);
    REQUIRE(wait_until([&] { return process_state(running) == 'S'; }, std::chrono::seconds(10)));
    c.check_member(running);
    CHECK(c.cgroup_problem().empty());
    CHECK(c.cgroup_procs_fd() >= 0);
    end(running);
  }

  TEST_CASE("a running first worker outside the cgroup makes the agent fall back to the marker") {
    Containment c;
    if (c.cgroup_dir().empty()) {
      MESSAGE("skipped: no cgroup for the worker group here: " << c.cgroup_problem());
      return;
    }
    const pid_t outside = fork_member(c, false, false);
    REQUIRE(outside > 0);
    REQUIRE(wait_until([&] { return process_state(outside) == 'S'; }, std::chrono::seconds(10)));
    c.check_member(outside);
    CHECK(c.cgroup_problem().find("did not join cgroup") != std::string::npos);
    CHECK(c.cgroup_procs_fd() == -1);
    end(outside);
  }

  TEST_CASE("workers started after the cgroup was killed (a restart) start and run inside it") {
    Containment c;
    if (c.cgroup_dir().empty()) {
      MESSAGE("skipped: no cgroup for the worker group here: " << c.cgroup_problem());
      return;
    }
    for (int round = 0; round < 3; ++round) {
      INFO("round " << round);
      const pid_t pid = start_worker(c, {"/bin/sleep", "1000"});
      REQUIRE(pid > 0);
      c.watch_group(pid);
      // Alive and waiting (not killed at birth), and inside the worker group's cgroup.
      REQUIRE(wait_until([&] { return process_state(pid) == 'S'; }, std::chrono::seconds(10)));
      c.check_member(pid);
      CHECK(c.cgroup_problem().empty());
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      c.kill_all();  // what the agent does after each round: cgroup.kill
    }
  }

  TEST_CASE("a worker starts inside the cgroup") {
    Containment c;
    if (c.cgroup_dir().empty()) {
      MESSAGE("skipped: no cgroup for the worker group here: " << c.cgroup_problem());
      return;
    }
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    const pid_t pid = start_worker(c, {"/bin/cat", "/proc/self/cgroup"}, fds[1]);
    ::close(fds[1]);
    std::string text;
    char buf[512];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
    ::close(fds[0]);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    // "0::/<path>": the cgroup directory ends with that path.
    const auto line = text.find("0::");
    REQUIRE(line != std::string::npos);
    const std::string path = text.substr(line + 3, text.find('\n', line) - line - 3);
    INFO("cat /proc/self/cgroup: " << text);
    CHECK(path.size() > 1);
    CHECK(c.cgroup_dir().size() >= path.size());
    CHECK(c.cgroup_dir().compare(c.cgroup_dir().size() - path.size(), path.size(), path) == 0);
  }

  TEST_CASE("a standby outlives the kills of a restart until it is adopted, then dies with the group") {
    Containment c;
    // As PosixProcesses starts a standby: outside the cgroup.
    const pid_t standby = start_standby(c);
    REQUIRE(standby > 0);
    c.check_member(standby);  // judges nothing by a standby
    CHECK(c.cgroup_problem() == (c.cgroup_dir().empty() ? c.cgroup_problem() : std::string()));
    REQUIRE(wait_until([&] { return process_state(standby) == 'S'; }, std::chrono::seconds(10)));
    c.kill_all();  // a restart: the workers' groups and the cgroup (or the marked processes)
    // Given time to die, it does not: poll a while for a state that would say it was killed.
    CHECK_FALSE(wait_until([&] { const char s = process_state(standby); return s == 'Z' || s == '\0'; },
                           std::chrono::seconds(1)));
    CHECK(c.adopt_standby(standby));
    CHECK_FALSE(c.adopt_standby(standby));  // a worker now
    c.kill_all();
    REQUIRE(wait_until([&] { return process_state(standby) == 'Z'; }, std::chrono::seconds(10)));
    int status = 0;
    REQUIRE(::waitpid(standby, &status, 0) == standby);
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGKILL);
  }

  TEST_CASE("the sentinel kills a waiting standby when the agent is gone") {
    // The "agent" is a child that owns the containment; it forks a standby, tells us its pid, and
    // is SIGKILLed: its sentinel must kill the standby (here nothing else would: no parent-death
    // signal is set, unlike a real standby).
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    const pid_t agent = ::fork();
    if (agent == 0) {
      ::close(pipe_fds[0]);
      Containment c;
      const pid_t standby = start_standby(c);
      c.kill_all();  // a restart before the agent dies: the standby stays watched
      (void)!::write(pipe_fds[1], &standby, sizeof standby);
      for (;;) ::pause();
    }
    ::close(pipe_fds[1]);
    pid_t standby = 0;
    REQUIRE(::read(pipe_fds[0], &standby, sizeof standby) == static_cast<ssize_t>(sizeof standby));
    ::close(pipe_fds[0]);
    ::kill(agent, SIGKILL);
    ::waitpid(agent, nullptr, 0);
    // The standby was the dead agent's child: it is reparented (to init or a subreaper) and reaped
    // there, so it is gone or a zombie.
    CHECK(wait_until([&] { const char s = process_state(standby); return s == 'Z' || s == '\0'; },
                     std::chrono::seconds(10)));
  }

  TEST_CASE("the state of a process that does not exist is unknown") {
    const pid_t gone = ::fork();
    if (gone == 0) ::_exit(0);
    ::waitpid(gone, nullptr, 0);
    CHECK(process_state(gone) == '\0');
    CHECK(process_state(::getpid()) == 'R');
  }
}
