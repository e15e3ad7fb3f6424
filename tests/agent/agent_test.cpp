// Unit tests of the Agent's supervision logic with the process seam swapped for a fake: no real
// processes, every exit is an event the fake posts on the io_context.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iterator>
#include <functional>
#include <optional>
#include <map>
#include <string>
#include <vector>

#include "agent/agent.h"
#include "rendezvous/error.h"
#include "agent/local_rendezvous.h"
#include "agent/logs.h"
#include "agent/progress.h"

#include <fcntl.h>
#include <sys/mman.h>

using namespace ddp::agent;
namespace asio = boost::asio;

namespace {

// Each spawned "process" runs `behaviour(env)`: an exit status to post at once, or none (it
// runs until signalled; SIGTERM/SIGKILL end it).
class FakeProcesses final : public Processes {
 public:
  using Behaviour = std::function<std::optional<ExitStatus>(const std::map<std::string, std::string>& env)>;
  FakeProcesses(asio::io_context& io, Behaviour behaviour) : io_(io), behaviour_(std::move(behaviour)) {}

  struct Record {
    std::map<std::string, std::string> env;
    bool alive = true;
  };
  std::map<int, Record>* records = nullptr;  // owned by the test
  std::vector<std::pair<int, int>>* signals_sent = nullptr;
  // Workers for which this is true ignore every signal, SIGKILL included (stuck in the kernel).
  std::function<bool(const std::map<std::string, std::string>& env)> unkillable;

  void set_exit_handler(ExitHandler on_exit) override { on_exit_ = std::move(on_exit); }
  int spawn(const SpawnRequest& req) override {
    int pid = next_pid_++;
    (*records)[pid] = Record{req.env, true};
    if (auto st = behaviour_(req.env)) exit_later(pid, *st);
    return pid;
  }
  void signal_group(int pgid, int signo) override {
    signals_sent->push_back({pgid, signo});
    auto it = records->find(pgid);
    if (it != records->end() && unkillable && unkillable(it->second.env)) return;
    if (it != records->end() && it->second.alive) {
      ExitStatus st;
      st.signal = signo;
      exit_later(pgid, st);
    }
  }
  void signal_process(int pid, int signo) override {
    signals_sent->push_back({pid, signo});
    auto it = records->find(pid);
    if (it != records->end() && it->second.alive) {
      ExitStatus st;
      st.signal = signo;
      exit_later(pid, st);
    }
  }
  void close() override {}

 private:
  void exit_later(int pid, ExitStatus st) {
    (*records)[pid].alive = false;
    asio::post(io_, [this, pid, st] { on_exit_(pid, st); });
  }
  asio::io_context& io_;
  Behaviour behaviour_;
  ExitHandler on_exit_;
  int next_pid_ = 1000;
};

struct Fixture {
  asio::io_context io;
  std::map<int, FakeProcesses::Record> records;
  std::vector<std::pair<int, int>> signals_sent;
  std::string log_dir;

  Fixture() {
    char templ[] = "/tmp/ddplaunch_agent_test_XXXXXX";
    log_dir = ::mkdtemp(templ);
  }
  ~Fixture() { std::system(("rm -rf '" + log_dir + "'").c_str()); }

  std::function<bool(const std::map<std::string, std::string>& env)> unkillable;
  std::function<void(AgentOptions&)> tweak;

  int run(int nproc, int max_restarts, FakeProcesses::Behaviour behaviour) {
    AgentOptions o;
    o.node.local_world_size = nproc;
    o.node.host = "testhost";
    o.command.no_python = true;
    o.command.program = "/bin/true";
    o.log_dir = log_dir;
    o.signals = {};
    o.shutdown_timeout = 5;
    if (tweak) tweak(o);
    LocalRendezvousOptions ro;
    ro.max_restarts = max_restarts;
    auto procs = std::make_unique<FakeProcesses>(io, std::move(behaviour));
    procs->records = &records;
    procs->signals_sent = &signals_sent;
    procs->unkillable = unkillable;
    Agent agent(io, o, std::make_unique<LocalRendezvous>(io, ro), std::move(procs));
    return agent.run();
  }

  std::vector<std::string> values_of(const std::string& var) const {
    std::vector<std::string> out;
    for (const auto& [pid, r] : records) out.push_back(r.env.at(var));
    return out;
  }
};

// Runs `body` with this process's stderr sent to a file; returns what was written to it.
std::string capture_stderr(const std::function<void()>& body) {
  char templ[] = "/tmp/ddplaunch_agent_stderr_XXXXXX";
  const int capture = ::mkstemp(templ);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(capture, STDERR_FILENO);
  body();
  OutputQueue::console().flush(std::chrono::seconds(10));
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(capture);
  std::ifstream in(templ);
  std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::unlink(templ);
  return err;
}

ExitStatus exited(int code) {
  ExitStatus s;
  s.exit_code = code;
  return s;
}

}  // namespace

TEST_SUITE("the agent supervises its worker group") {
  TEST_CASE("workers that all exit 0 end the job with exit 0") {
    Fixture f;
    int code = f.run(3, 0, [](const auto&) { return exited(0); });
    CHECK(code == 0);
    CHECK(f.records.size() == 3);
    CHECK(f.values_of("RANK") == std::vector<std::string>{"0", "1", "2"});
    CHECK(f.values_of("WORLD_SIZE") == std::vector<std::string>{"3", "3", "3"});
  }

  TEST_CASE("a failing worker stops the group and every worker restarts with a higher restart count") {
    Fixture f;
    // Local rank 1 fails until the second restart; the others run until they are stopped, then
    // (in the last round) succeed.
    int code = f.run(2, 3, [](const auto& env) -> std::optional<ExitStatus> {
      int restart = std::stoi(env.at("TORCHELASTIC_RESTART_COUNT"));
      if (restart < 2) {
        if (env.at("LOCAL_RANK") == "1") return exited(1);
        return std::nullopt;
      }
      return exited(0);
    });
    CHECK(code == 0);
    REQUIRE(f.records.size() == 6);  // 3 rounds of 2 workers
    CHECK(f.values_of("TORCHELASTIC_RESTART_COUNT") == std::vector<std::string>{"0", "0", "1", "1", "2", "2"});
    CHECK(f.values_of("DDPLAUNCH_GENERATION") == std::vector<std::string>{"1", "1", "2", "2", "3", "3"});
    // The surviving rank 0 of each failed round got SIGTERM to its process group.
    CHECK(std::count(f.signals_sent.begin(), f.signals_sent.end(), std::make_pair(1000, SIGTERM)) == 1);
    CHECK(std::count(f.signals_sent.begin(), f.signals_sent.end(), std::make_pair(1002, SIGTERM)) == 1);
  }

  TEST_CASE("a worker failing past the restart budget fails the job with exit 1") {
    Fixture f;
    int code = f.run(2, 1, [](const auto& env) -> std::optional<ExitStatus> {
      if (env.at("LOCAL_RANK") == "0") return exited(7);
      return std::nullopt;
    });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    CHECK(f.records.size() == 4);  // the first round and one restart
  }

  TEST_CASE("each round gets a fresh master port when none was given") {
    // The first round's worker keeps its MASTER_PORT bound (like a store that has not let go yet):
    // a fresh pick for the second round cannot return it, a reused port would.
    Fixture f;
    std::vector<int> held;
    int code = f.run(1, 1, [&held](const auto& env) -> std::optional<ExitStatus> {
      const int port = std::stoi(env.at("MASTER_PORT"));
      if (env.at("TORCHELASTIC_RESTART_COUNT") == "0") {
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<std::uint16_t>(port));
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);  // it was free when given
        held.push_back(fd);
        return exited(1);
      }
      return exited(0);
    });
    for (int fd : held) ::close(fd);
    CHECK(code == 0);
    const auto ports = f.values_of("MASTER_PORT");
    REQUIRE(ports.size() == 2);
    CHECK(ports[0] != ports[1]);
    for (const auto& port : ports) CHECK((std::stoi(port) > 0 && std::stoi(port) < 65536));
  }

  TEST_CASE("a worker that survives SIGKILL is given up on after the kill timeout, naming its pid") {
    Fixture f;
    // Local rank 0 fails; local rank 1 cannot be killed. The agent must still end the job.
    f.unkillable = [](const auto& env) { return env.at("LOCAL_RANK") == "1"; };
    f.tweak = [](AgentOptions& o) {
      o.shutdown_timeout = 0.01;
      o.kill_timeout = 0.01;
    };
    int code = -1;
    const std::string err = capture_stderr([&] {
      code = f.run(2, 0, [](const auto& env) -> std::optional<ExitStatus> {
        if (env.at("LOCAL_RANK") == "0") return exited(1);
        return std::nullopt;
      });
    });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    CHECK(std::count(f.signals_sent.begin(), f.signals_sent.end(), std::make_pair(1001, SIGTERM)) == 1);
    CHECK(std::count(f.signals_sent.begin(), f.signals_sent.end(), std::make_pair(1001, SIGKILL)) >= 1);
    CHECK(err.find("worker 1 (pid 1001) has not exited") != std::string::npos);
    CHECK(err.find("giving up on it") != std::string::npos);
  }

  TEST_CASE("a worker killed by a signal is the root cause over a peer reaped with it that exited 1") {
    Fixture f;
    // Both exits are reaped in one batch, the peer's first: the signal is still the cause.
    int code = -1;
    const std::string err = capture_stderr([&] {
      code = f.run(2, 0, [](const auto& env) -> std::optional<ExitStatus> {
        if (env.at("LOCAL_RANK") == "0") return exited(1);
        ExitStatus killed;
        killed.signal = SIGKILL;
        return killed;
      });
    });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    const auto root = err.find("Root Cause");
    REQUIRE(root != std::string::npos);
    CHECK(err.find("rank      : 1 (local_rank: 1)", root) != std::string::npos);
    CHECK(err.find("signal    : 9 (SIGKILL)", root) != std::string::npos);
    // The peer is listed among the other failures.
    CHECK(err.substr(0, root).find("rank      : 0 (local_rank: 0)") != std::string::npos);
    CHECK(err.find("worker 1 (local rank 1, pid 1001) was killed by SIGKILL") != std::string::npos);
  }
}

namespace {

// Writes a worker's progress slot as the SDK would, through the path the agent gave it.
void report_step(const std::map<std::string, std::string>& env, uint64_t beats, int64_t step) {
  const int fd = ::open(env.at("DDPLAUNCH_PROGRESS_FILE").c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const int slot = std::stoi(env.at("DDPLAUNCH_PROGRESS_SLOT"));
  const std::size_t size = ProgressBoard::kSlotSize * static_cast<std::size_t>(slot + 1);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  REQUIRE(p != MAP_FAILED);
  auto* words = reinterpret_cast<uint64_t*>(static_cast<unsigned char*>(p) + ProgressBoard::kSlotSize * slot);
  words[1] = static_cast<uint64_t>(step);
  words[0] = beats;
  ::munmap(p, size);
}

}  // namespace

TEST_SUITE("the agent ends hangs and crash loops") {
  TEST_CASE("a worker exiting with a code of --no_restart_exit_codes ends the job at once") {
    Fixture f;
    f.tweak = [](AgentOptions& o) { o.no_restart_exit_codes = {3, 42}; };
    std::string err;
    int code = 0;
    err = capture_stderr([&] {
      code = f.run(2, 5, [](const auto& env) -> std::optional<ExitStatus> {
        if (env.at("LOCAL_RANK") == "1") return exited(42);
        return std::nullopt;
      });
    });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    CHECK(f.records.size() == 2);  // no restart despite --max_restarts=5
    CHECK(err.find("exited with code 42, which --no_restart_exit_codes lists") != std::string::npos);
  }

  TEST_CASE("a code not listed restarts as usual") {
    Fixture f;
    f.tweak = [](AgentOptions& o) { o.no_restart_exit_codes = {3}; };
    int code = f.run(1, 2, [](const auto&) -> std::optional<ExitStatus> { return exited(1); });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    CHECK(f.records.size() == 3);
  }

  TEST_CASE("restarts that report no progress end the job after --crash_loop_limit") {
    Fixture f;
    f.tweak = [](AgentOptions& o) { o.max_restarts_without_progress = 2; };
    int code = 0;
    std::string err = capture_stderr([&] {
      code = f.run(1, 10, [](const auto&) -> std::optional<ExitStatus> { return exited(1); });
    });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    CHECK(f.records.size() == 3);  // the first attempt and 2 restarts that got nowhere
    CHECK(err.find("2 restart(s) in a row made no progress") != std::string::npos);
  }

  TEST_CASE("a restart that reports a step beyond the best seen resets the count") {
    Fixture f;
    f.tweak = [](AgentOptions& o) { o.max_restarts_without_progress = 2; };
    // Attempts 0..3 each get one step further, then every attempt is stuck at step 3.
    int code = f.run(1, 10, [](const auto& env) -> std::optional<ExitStatus> {
      const int restart = std::stoi(env.at("TORCHELASTIC_RESTART_COUNT"));
      report_step(env, 1, std::min(restart, 3));
      return exited(1);
    });
    CHECK(code == static_cast<int>(ddp::ExitCode::kJobFailed));
    CHECK(f.records.size() == 6);  // 0..3 progress (step 0,1,2,3), 4 and 5 do not
  }

  TEST_CASE("a rank that beat and then stopped is declared hung, killed, reported and restarted") {
    Fixture f;
    f.tweak = [](AgentOptions& o) { o.hang.timeout = 0.2; };
    int code = 0;
    std::string err = capture_stderr([&] {
      code = f.run(2, 1, [](const auto& env) -> std::optional<ExitStatus> {
        const int restart = std::stoi(env.at("TORCHELASTIC_RESTART_COUNT"));
        if (restart == 1) return exited(0);
        if (env.at("LOCAL_RANK") == "1") report_step(env, 4, 17);  // then nothing: it hangs
        return std::nullopt;  // rank 0 never beats: not watched
      });
    });
    CHECK(code == 0);
    REQUIRE(f.records.size() == 4);
    // The hung rank (pid 1001, no Python: SIGKILL) was killed alone, then rank 0 stopped.
    CHECK(std::count(f.signals_sent.begin(), f.signals_sent.end(), std::make_pair(1001, SIGKILL)) >= 1);
    CHECK(std::count(f.signals_sent.begin(), f.signals_sent.end(), std::make_pair(1000, SIGTERM)) == 1);
    CHECK(err.find("rank 1 made no progress for") != std::string::npos);
    CHECK(err.find("(last step 17;") != std::string::npos);
  }
}

TEST_SUITE("the in-process rendezvous") {
  TEST_CASE("a fatal report fails the job at once with its reason, budget or not, and no round follows") {
    asio::io_context io;
    LocalRendezvousOptions ro;
    ro.max_restarts = 5;
    LocalRendezvous rendezvous(io, ro);
    int rounds = 0, restarts = 0;
    std::vector<std::string> verdicts;
    RendezvousEvents events;
    events.on_round = [&](const ddp::rdzv::Assignment&) { ++rounds; };
    events.on_restart = [&](const std::string&, bool, bool, bool) { ++restarts; };
    events.on_job_failed = [&](const ddp::rdzv::WorkerFailure& f, const std::string& summary) {
      CHECK(f.rank == 1);
      verdicts.push_back(summary);
    };
    rendezvous.set_events(std::move(events));
    ddp::rdzv::NodeSpec spec;
    rendezvous.join(spec);
    io.run();
    REQUIRE(rounds == 1);
    ddp::rdzv::WorkerFailure failure;
    failure.rank = 1;
    failure.exit_code = 3;
    failure.fatal = "worker 1 exited with code 3, which --no_restart_exit_codes lists: not restarting";
    rendezvous.report_failure(failure);
    io.restart();
    io.run();
    CHECK(restarts == 0);
    CHECK(verdicts == std::vector<std::string>{failure.fatal});
    // The agent joins once more after stopping its workers: no round, no second verdict.
    rendezvous.join(spec);
    rendezvous.report_failure(failure);
    io.restart();
    io.run();
    CHECK(rounds == 1);
    CHECK(verdicts.size() == 1);
  }
}
