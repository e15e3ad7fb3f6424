// Unit tests of the Agent's supervision logic with the process seam swapped for a fake: no real
// processes, every exit is an event the fake posts on the io_context.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <signal.h>
#include <stdlib.h>

#include <boost/asio/post.hpp>
#include <algorithm>
#include <functional>
#include <optional>
#include <map>
#include <string>
#include <vector>

#include "agent/agent.h"
#include "agent/exit_codes.h"
#include "agent/local_rendezvous.h"

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
    if (it != records->end() && it->second.alive) {
      ExitStatus st;
      st.signal = signo;
      exit_later(pgid, st);
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

  int run(int nproc, int max_restarts, FakeProcesses::Behaviour behaviour) {
    AgentOptions o;
    o.node.local_world_size = nproc;
    o.node.host = "testhost";
    o.command.no_python = true;
    o.command.program = "/bin/true";
    o.log_dir = log_dir;
    o.signals = {};
    o.shutdown_timeout = 5;
    LocalRendezvousOptions ro;
    ro.max_restarts = max_restarts;
    auto procs = std::make_unique<FakeProcesses>(io, std::move(behaviour));
    procs->records = &records;
    procs->signals_sent = &signals_sent;
    Agent agent(io, o, std::make_unique<LocalRendezvous>(io, ro), std::move(procs));
    return agent.run();
  }

  std::vector<std::string> values_of(const std::string& var) const {
    std::vector<std::string> out;
    for (const auto& [pid, r] : records) out.push_back(r.env.at(var));
    return out;
  }
};

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
}
