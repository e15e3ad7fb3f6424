// The agent's output and failure reporting, with real worker processes (/bin/sh) under the real
// process seam and the embedded rendezvous: the bounded output queue, torchrun 2.x's duplicate
// filters, the stderr tail of the failure summary, the ${hostname} prefix.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "agent/agent.h"
#include "rendezvous/error.h"
#include "agent/local_rendezvous.h"
#include "agent/logs.h"

using namespace ddp::agent;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> sorted_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  std::sort(out.begin(), out.end());
  return out;
}

// Sends this process's stderr to a file while alive; text() has what was written.
class StderrCapture {
 public:
  StderrCapture() {
    char templ[] = "/tmp/ddplaunch_stderr_XXXXXX";
    fd_ = ::mkstemp(templ);
    path_ = templ;
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(fd_, STDERR_FILENO);
  }
  ~StderrCapture() {
    restore();
    ::unlink(path_.c_str());
  }
  std::string text() {
    restore();
    return read_file(path_);
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    OutputQueue::console().flush(std::chrono::seconds(10));
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
    ::close(fd_);
    saved_ = -1;
  }
  int fd_ = -1, saved_ = -1;
  std::string path_;
};

// One node, real processes: `/bin/sh -c script` as each worker.
struct ShellJob {
  std::string log_dir;
  AgentOptions options;

  explicit ShellJob(const std::string& script, int nproc = 1) {
    char templ[] = "/tmp/ddplaunch_supervision_test_XXXXXX";
    log_dir = ::mkdtemp(templ);
    options.node.local_world_size = nproc;
    options.node.host = "testhost";
    options.command.no_python = true;
    options.command.program = "/bin/sh";
    options.command.args = {"-c", script};
    options.log_dir = log_dir;
    options.signals = {};
    options.shutdown_timeout = 5;
  }
  ~ShellJob() { std::system(("rm -rf '" + log_dir + "'").c_str()); }

  int run() {
    boost::asio::io_context io;
    Agent agent(io, options, std::make_unique<LocalRendezvous>(io, LocalRendezvousOptions{}));
    return agent.run();
  }
  std::string attempt_dir(int attempt = 0) const {
    return log_dir + "/none/attempt_" + std::to_string(attempt);
  }
};

// Reads `fd` (non-blocking) until `want` appears or 10 s pass; returns what was read.
std::string read_until(int fd, const std::string& want) {
  std::string got;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  char buf[65536];
  while (got.find(want) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    struct pollfd p {fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) got.append(buf, static_cast<std::size_t>(n));
  }
  return got;
}

}  // namespace

TEST_SUITE("worker output never blocks the agent") {
  TEST_CASE("a queue whose destination nobody reads drops what does not fit, counts it, and reports it later") {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    // Fill the pipe first, so that the queue's writer blocks at its first write.
    ::fcntl(fds[1], F_SETFL, O_NONBLOCK);
    const std::string filler(4096, 'p');
    while (::write(fds[1], filler.data(), filler.size()) > 0) {
    }
    ::fcntl(fds[1], F_SETFL, 0);
    OutputQueue queue("the test pipe", 4096);
    const std::string line(99, 'x');
    // Far more than the pipe (64 KiB) and the queue (4 KiB) hold: every write returns at once.
    int accepted = 0;
    for (int i = 0; i < 2000; ++i) accepted += queue.write(fds[1], line + "\n") ? 1 : 0;
    CHECK(accepted < 2000);
    CHECK(queue.dropped() == static_cast<std::uint64_t>(2000 - accepted));
    CHECK_FALSE(queue.flush(std::chrono::milliseconds(50)));  // the pipe is full: bounded wait
    // A reader appears: everything queued arrives, then the next line brings the count.
    std::string got;
    auto drain = [&] {
      char buf[65536];
      for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<std::size_t>(n));
    };
    for (const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
         std::chrono::steady_clock::now() < deadline;) {
      drain();
      if (queue.flush(std::chrono::milliseconds(10))) break;
    }
    CHECK(queue.flush(std::chrono::seconds(5)));
    drain();
    REQUIRE(queue.write(fds[1], "after\n"));
    got += read_until(fds[0], "after\n");
    const std::string notice = "ddplaunch: dropped " + std::to_string(2000 - accepted) +
                               " line(s) of output because the test pipe did not keep up\n";
    CHECK(got.find(notice + "after\n") != std::string::npos);
    CHECK(std::count(got.begin(), got.end(), 'x') == static_cast<long>(accepted) * 99);
    ::close(fds[0]);
    ::close(fds[1]);
  }

  TEST_CASE("closing a descriptor waits for the writes queued before it") {
    char templ[] = "/tmp/ddplaunch_queue_XXXXXX";
    const int fd = ::mkstemp(templ);
    OutputQueue queue("a file", 1 << 20);
    for (int i = 0; i < 100; ++i) REQUIRE(queue.write(fd, std::to_string(i) + "\n"));
    queue.close_after(fd);
    REQUIRE(queue.flush(std::chrono::seconds(10)));
    CHECK(sorted_lines(read_file(templ)).size() == 100);
    CHECK(::fcntl(fd, F_GETFD) == -1);  // closed by the queue
    ::unlink(templ);
  }
}

TEST_SUITE("worker logs are laid out and prefixed as documented") {
  TEST_CASE("${hostname} in the prefix template names the node") {
    CHECK(line_prefix("${hostname}/${rank}:", "default", 3, 1, "node7") == "node7/3:");
    CHECK(line_prefix("", "trainer", 3, 1, "node7") == "[trainer1]:");
  }

  TEST_CASE("a duplicate filter matches a line containing any of its strings") {
    CHECK(matches_any("loss=0.1 step 5\n", {"acc", "loss"}));
    CHECK_FALSE(matches_any("step 5\n", {"acc", "loss"}));
    CHECK_FALSE(matches_any("anything\n", {}));
  }

  TEST_CASE("a stderr tail keeps the last lines within its line and byte bounds") {
    LineTail tail(3, 1000);
    for (int i = 1; i <= 5; ++i) tail.add("line " + std::to_string(i) + "\n");
    tail.add("no newline");
    CHECK(tail.text() == "line 4\nline 5\nno newline\n");
    LineTail small(10, 12);
    small.add("aaaaa\n");
    small.add("bbbbb\n");
    small.add("ccccc\n");
    CHECK(small.text() == "bbbbb\nccccc\n");
  }

  TEST_CASE("the tail of a file drops a partial first line") {
    char templ[] = "/tmp/ddplaunch_tail_XXXXXX";
    const int fd = ::mkstemp(templ);
    std::string text;
    for (int i = 0; i < 1000; ++i) text += "line " + std::to_string(i) + "\n";
    REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    ::close(fd);
    const std::string tail = tail_of_file(templ, 3, 100);
    CHECK(tail == "line 997\nline 998\nline 999\n");
    CHECK(tail_of_file("/nonexistent/ddplaunch/file").empty());
    ::unlink(templ);
  }

  TEST_CASE("tee'd lines matching a duplicate filter are copied, prefixed, into the attempt's filtered files") {
    ShellJob job("echo keep out $LOCAL_RANK; echo plain; echo keep err >&2; echo other >&2", 2);
    job.options.tee = {kStdAll, kStdAll};
    job.options.duplicate_stdout_filters = {"keep", "nothing"};
    job.options.duplicate_stderr_filters = {"err"};
    REQUIRE(job.run() == 0);
    CHECK(sorted_lines(read_file(job.attempt_dir() + "/filtered_stdout.log")) ==
          std::vector<std::string>{"[default0]:keep out 0", "[default1]:keep out 1"});
    CHECK(sorted_lines(read_file(job.attempt_dir() + "/filtered_stderr.log")) ==
          std::vector<std::string>{"[default0]:keep err", "[default1]:keep err"});
    // The workers' own logs still hold everything.
    CHECK(read_file(job.attempt_dir() + "/0/stdout.log") == "keep out 0\nplain\n");
  }

  TEST_CASE("without filters there is no filtered file") {
    ShellJob job("echo hello");
    job.options.tee = {kStdAll};
    REQUIRE(job.run() == 0);
    CHECK(::access((job.attempt_dir() + "/filtered_stdout.log").c_str(), F_OK) != 0);
  }
}

TEST_SUITE("failures are explained like torchrun") {
  const char* kNoisyFailure =
      "i=1; while [ $i -le 25 ]; do echo \"err line $i\" >&2; i=$((i+1)); done; exit 3";

  TEST_CASE("a failed worker that wrote no error file is summarised with the last lines of its tee'd stderr") {
    ShellJob job(kNoisyFailure);
    job.options.tee = {kStdErr};
    StderrCapture capture;
    CHECK(job.run() == static_cast<int>(ddp::ExitCode::kJobFailed));
    const std::string summary = capture.text();
    CHECK(summary.find("exitcode  : 3") != std::string::npos);
    CHECK(summary.find("the worker wrote no error file; the last lines of its stderr:") != std::string::npos);
    CHECK(summary.find("    err line 25") != std::string::npos);
    CHECK(summary.find("    err line 6\n") != std::string::npos);
    CHECK(summary.find("    err line 5\n") == std::string::npos);  // 20 lines kept
  }

  TEST_CASE("under --redirects the summary takes the tail from stderr.log and names the log files") {
    ShellJob job(kNoisyFailure);
    job.options.redirects = {kStdAll};
    StderrCapture capture;
    CHECK(job.run() == static_cast<int>(ddp::ExitCode::kJobFailed));
    const std::string summary = capture.text();
    const std::string dir = job.attempt_dir() + "/0";
    CHECK(summary.find("the last lines of its stderr (" + dir + "/stderr.log):") != std::string::npos);
    CHECK(summary.find("    err line 25") != std::string::npos);
    CHECK(summary.find("  log_file  : " + dir + "/stdout.log\n") != std::string::npos);
    CHECK(summary.find("  log_file  : " + dir + "/stderr.log\n") != std::string::npos);
  }

  TEST_CASE("a worker killed by a signal is reported as killed by it, with its last stderr lines") {
    ShellJob job("echo about to die >&2; kill -9 $$");
    job.options.tee = {kStdErr};
    StderrCapture capture;
    CHECK(job.run() == static_cast<int>(ddp::ExitCode::kJobFailed));
    const std::string summary = capture.text();
    CHECK(summary.find("signal    : 9 (SIGKILL)") != std::string::npos);
    CHECK(summary.find("Signal 9 (SIGKILL) received by PID") != std::string::npos);
    CHECK(summary.find("    about to die") != std::string::npos);
    CHECK(summary.find("was killed by SIGKILL") != std::string::npos);
  }
}
