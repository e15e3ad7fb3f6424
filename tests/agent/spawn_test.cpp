// The spawner (agent/spawn.h) with real processes: the child's rules (signals, descriptors,
// process group, parent-death signal, working directory), exec failures, and the exit status.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/containment.h"
#include "agent/spawn.h"
#include "tests/agent/wait_until.h"

using namespace ddp::agent;

namespace {

using ddp::agent::testing::wait_until;

// Runs `argv` under `options` with its stdout on a pipe; returns what it printed and sets
// `status` to how it ended.
std::string output_of(const std::vector<std::string>& argv, SpawnOptions options, ExitStatus& status,
                      const std::vector<std::string>& env = {}) {
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  options.stdout_to(fds[1]);
  Spawned child = spawn_process(argv, env, options);
  ::close(fds[1]);
  REQUIRE(await_exec(child) == 0);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int raw = 0;
  REQUIRE(::waitpid(child.pid, &raw, 0) == child.pid);
  status = ExitStatus::from_wait_status(raw);
  return text;
}

// The value of `field` ("SigBlk") in /proc/PID/status text.
std::string status_field(const std::string& text, const std::string& field) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      const auto value = line.find_first_not_of(" \t", field.size() + 1);
      return value == std::string::npos ? "" : line.substr(value);
    }
  }
  return "";
}

// A handler of the test process's: run in a child, it would set the child's copy of this flag
// (or, in a child sharing the parent's memory, the parent's).
volatile sig_atomic_t g_handler_ran = 0;
void on_usr1(int) { g_handler_ran = 1; }

// Raises SIGUSR1, which must meet the default action (death), not the test's handler.
void raise_usr1(void*) {
  ::raise(SIGUSR1);
  ::_exit(g_handler_ran ? 4 : 3);  // not reached when SIGUSR1 kills
}

// Reports, as its exit code, which of the descriptors {3..63} are open besides `keep`: 0 when
// only `keep` is, 1 otherwise.
void only_kept_is_open(void* p) {
  const int keep = *static_cast<const int*>(p);
  bool others = false;
  for (int fd = 3; fd < 64; ++fd) {
    if (fd != keep && ::fcntl(fd, F_GETFD) != -1) others = true;
  }
  ::_exit(::fcntl(keep, F_GETFD) != -1 && !others ? 0 : 1);
}

}  // namespace

TEST_SUITE("processes start by one set of rules") {
  TEST_CASE("a child that raises a signal the parent handles dies of it: the parent's handlers are reset") {
    struct sigaction sa {}, previous {};
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    REQUIRE(::sigaction(SIGUSR1, &sa, &previous) == 0);
    g_handler_ran = 0;
    SpawnOptions options;
    options.run_instead_of_exec(&raise_usr1, nullptr);
    const Spawned child = spawn_process({}, {}, options);
    REQUIRE(child.pid > 0);
    int raw = 0;
    REQUIRE(::waitpid(child.pid, &raw, 0) == child.pid);
    const ExitStatus status = ExitStatus::from_wait_status(raw);
    CHECK(status.state() == ExitStatus::State::kKilled);
    CHECK(status.signal == SIGUSR1);
    CHECK(g_handler_ran == 0);
    ::sigaction(SIGUSR1, &previous, nullptr);
  }

  TEST_CASE("a child starts with no signal blocked and SIGPIPE at its default, whatever its parent blocks and ignores") {
    Containment c;  // a worker's route: inside the cgroup, sharing the agent's memory where it can
    sigset_t usr2, old_mask;
    sigemptyset(&usr2);
    sigaddset(&usr2, SIGUSR2);
    REQUIRE(::pthread_sigmask(SIG_BLOCK, &usr2, &old_mask) == 0);
    struct sigaction ign {}, previous {};
    ign.sa_handler = SIG_IGN;
    REQUIRE(::sigaction(SIGPIPE, &ign, &previous) == 0);
    SpawnOptions options;
    c.place_worker(options);
    ExitStatus status;
    const std::string text = output_of({"/bin/cat", "/proc/self/status"}, options, status);
    ::sigaction(SIGPIPE, &previous, nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    INFO(text);
    CHECK(status.success());
    CHECK(status_field(text, "SigBlk") == "0000000000000000");
    const unsigned long long ignored = std::stoull(status_field(text, "SigIgn"), nullptr, 16);
    CHECK((ignored & (1ULL << (SIGPIPE - 1))) == 0);
  }

  TEST_CASE("an exec that fails is reported with its errno and the executable's name") {
    Spawned missing = spawn_process({"/nonexistent/ddplaunch-test-program"}, {}, SpawnOptions{});
    const int error = await_exec(missing);
    CHECK(error == ENOENT);
    CHECK(::waitpid(missing.pid, nullptr, WNOHANG) == -1);  // reaped by await_exec
    const SpawnError e = SpawnError::exec_failed("/nonexistent/ddplaunch-test-program", error);
    CHECK(e.executable() == "/nonexistent/ddplaunch-test-program");
    CHECK(e.error() == ENOENT);
    CHECK(std::string(e.what()) == "cannot start /nonexistent/ddplaunch-test-program: " + std::string(std::strerror(ENOENT)));

    // A file that is not executable: EACCES.
    char templ[] = "/tmp/ddplaunch_spawn_test_XXXXXX";
    const int fd = ::mkstemp(templ);
    REQUIRE(fd >= 0);
    ::close(fd);
    Spawned denied = spawn_process({templ}, {}, SpawnOptions{});
    CHECK(await_exec(denied) == EACCES);
    ::unlink(templ);

    // A #! line naming a missing interpreter: ENOENT for a program that exists, said so.
    char script[] = "/tmp/ddplaunch_spawn_script_XXXXXX";
    const int sfd = ::mkstemp(script);
    REQUIRE(sfd >= 0);
    const std::string text = "#!/nonexistent/interpreter\n";
    REQUIRE(::write(sfd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    ::close(sfd);
    ::chmod(script, 0755);
    Spawned bad_interpreter = spawn_process({script}, {}, SpawnOptions{});
    const int interpreter_error = await_exec(bad_interpreter);
    CHECK(interpreter_error == ENOENT);
    CHECK(std::string(SpawnError::exec_failed(script, interpreter_error).what()).find("#! line") != std::string::npos);
    ::unlink(script);

    // A bare name not on PATH: refused before any process exists.
    try {
      spawn_process({"surely-not-a-program-ddplaunch"}, {}, SpawnOptions{});
      FAIL("spawned a program that does not exist");
    } catch (const SpawnError& not_found) {
      CHECK(not_found.executable() == "surely-not-a-program-ddplaunch");
      CHECK(not_found.error() == ENOENT);
      CHECK(std::string(not_found.what()) == "cannot start surely-not-a-program-ddplaunch: not found in PATH");
    }
  }

  TEST_CASE("a bare name is found on PATH and runs with exactly the environment it was given") {
    ExitStatus status;
    const std::string text = output_of({"env"}, SpawnOptions{}, status, {"ONLY=this"});
    CHECK(status.success());
    CHECK(text == "ONLY=this\n");
  }

  TEST_CASE("descriptors not passed are closed in the child; the kept one keeps its number") {
    int leak[2], kept[2];
    REQUIRE(::pipe(leak) == 0);  // not close-on-exec: the child must not get it anyway
    REQUIRE(::pipe(kept) == 0);
    const std::string script = "for fd in " + std::to_string(leak[0]) + " " + std::to_string(leak[1]) + " " +
                               std::to_string(kept[1]) + "; do [ -e /proc/self/fd/$fd ] && echo $fd; done; true";
    SpawnOptions options;
    options.keep_fd(kept[1]);
    ExitStatus status;
    const std::string text = output_of({"/bin/sh", "-c", script}, options, status);
    CHECK(status.success());
    CHECK(text == std::to_string(kept[1]) + "\n");

    // The same without an exec: the sentinel's route closes them outright.
    int keep = kept[0];
    SpawnOptions no_exec;
    no_exec.keep_fd(keep).run_instead_of_exec(&only_kept_is_open, &keep);
    const Spawned child = spawn_process({}, {}, no_exec);
    int raw = 0;
    REQUIRE(::waitpid(child.pid, &raw, 0) == child.pid);
    CHECK(ExitStatus::from_wait_status(raw).str() == "exited with code 0");
    for (int fd : {leak[0], leak[1], kept[0], kept[1]}) ::close(fd);
  }

  TEST_CASE("the child leads its own process group and runs in the directory it was given") {
    SpawnOptions options;
    options.process_group_leader().chdir("/proc");
    ExitStatus status;
    // /proc/self/stat: "PID (COMM) STATE PPID PGRP ..."; then the working directory.
    const std::string text = output_of({"/bin/sh", "-c", "cat /proc/self/stat; echo; pwd"}, options, status);
    CHECK(status.success());
    std::istringstream in(text.substr(text.rfind(')') + 2));
    std::string state;
    long ppid = 0, pgrp = 0;
    in >> state >> ppid >> pgrp;
    CHECK(pgrp == ppid);  // cat's parent is the shell, which leads the group
    CHECK(text.substr(text.size() - 6) == "/proc\n");
  }

  TEST_CASE("a child started with a parent-death signal dies with the process that started it") {
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    const pid_t parent = ::fork();
    if (parent == 0) {
      ::close(pipe_fds[0]);
      SpawnOptions options;
      options.parent_death_signal(SIGKILL);
      pid_t pid = -1;
      try {
        Spawned child = spawn_process({"/bin/sleep", "1000"}, {}, options);
        if (await_exec(child) == 0) pid = child.pid;
      } catch (...) {
      }
      (void)!::write(pipe_fds[1], &pid, sizeof pid);
      ::_exit(0);  // the parent dies: its child gets SIGKILL
    }
    ::close(pipe_fds[1]);
    pid_t child = -1;
    REQUIRE(::read(pipe_fds[0], &child, sizeof child) == static_cast<ssize_t>(sizeof child));
    ::close(pipe_fds[0]);
    REQUIRE(child > 0);
    ::waitpid(parent, nullptr, 0);
    const bool died = wait_until([&] { const char s = process_state(child); return s == 'Z' || s == '\0'; },
                                 std::chrono::seconds(10));
    if (!died) ::kill(child, SIGKILL);
    CHECK(died);
  }

  TEST_CASE("an exit status says whether the process exited, was killed or dumped core") {
    CHECK(ExitStatus::exited(3).str() == "exited with code 3");
    CHECK(ExitStatus::exited(0).success());
    CHECK_FALSE(ExitStatus::exited(3).success());
    CHECK(ExitStatus::killed(SIGKILL).str() == "killed by SIGKILL");
    CHECK(ExitStatus::killed(SIGKILL).state() == ExitStatus::State::kKilled);
    CHECK(ExitStatus::killed(SIGSEGV, true).str() == "killed by SIGSEGV (core dumped)");
    CHECK(ExitStatus::killed(SIGSEGV, true).state() == ExitStatus::State::kDumpedCore);
    CHECK(ExitStatus::killed(SIGTERM).shell_code() == 128 + SIGTERM);
    CHECK(ExitStatus::still_running().str() == "running");
    CHECK_FALSE(ExitStatus::still_running().success());
    // From real wait statuses: an exit code, a kill, and a core dump's flag.
    ExitStatus status;
    output_of({"/bin/sh", "-c", "exit 7"}, SpawnOptions{}, status);
    CHECK(status.str() == "exited with code 7");
    output_of({"/bin/sh", "-c", "kill -TERM $$"}, SpawnOptions{}, status);
    CHECK(status.str() == "killed by SIGTERM");
    CHECK(ExitStatus::from_wait_status(SIGABRT | WCOREFLAG).str() == "killed by SIGABRT (core dumped)");
  }
}
