// ddp-rdzv-restart-bench: K real agent-side rendezvous clients (agent/remote_rendezvous,
// the code every ddplaunch runs) form one job on a real ddp-rendezvous daemon; the daemon is
// SIGKILLed, stays away for --gap seconds, and is started again on the same port. Measures the
// time from the new daemon listening to every agent resumed (no restart), and checks that no
// agent was told to restart. Loopback only; bounded in time (--deadline).
//
//   ddp-rdzv-restart-bench --daemon build/bin/ddp-rendezvous --agents 100 --gap 2
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>

#include "agent/remote_rendezvous.h"
#include "rendezvous/types.h"

namespace asio = boost::asio;
using steady = std::chrono::steady_clock;

namespace {

pid_t start_daemon(const std::string& path, int port, const std::string& log = "/dev/null") {
  pid_t pid = fork();
  if (pid == 0) {
    int devnull = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (devnull >= 0) dup2(devnull, STDOUT_FILENO);
    std::string p = std::to_string(port);
    execl(path.c_str(), path.c_str(), "--host", "127.0.0.1", "--port", p.c_str(), "--quiet-joins",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

bool listening(int port) {
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  boost::system::error_code ec;
  s.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)}, ec);
  return !ec;
}

int free_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

double ms(steady::time_point a, steady::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Seconds of the day of the first daemon log line containing `what` ("...THH:MM:SS.mmmZ ..."), or -1.
double log_time(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(what) == std::string::npos) continue;
    auto t = line.find('T');
    if (t == std::string::npos || line.size() < t + 13) return -1;
    int h = 0, m = 0;
    double sec = 0;
    if (std::sscanf(line.c_str() + t + 1, "%d:%d:%lf", &h, &m, &sec) != 3) return -1;
    return h * 3600 + m * 60 + sec;
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddp-rendezvous restart benchmark"};
  std::string daemon;
  int agents = 100;
  double gap = 2.0;
  double deadline_s = 120;
  app.add_option("--daemon", daemon, "path of ddp-rendezvous")->required();
  app.add_option("--agents", agents, "simulated agents (one connection each)");
  app.add_option("--gap", gap, "seconds without a daemon");
  app.add_option("--deadline", deadline_s, "give up after this many seconds");
  CLI11_PARSE(app, argc, argv);

  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);

  const int port = free_port();
  pid_t pid = start_daemon(daemon, port);
  const auto t0 = steady::now();
  while (!listening(port)) {
    if (ms(t0, steady::now()) > 10000) {
      std::fprintf(stderr, "daemon did not listen\n");
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  asio::io_context io{1};
  std::atomic<int> rounds{0}, resumed{0}, restarts{0}, errors{0};
  std::vector<steady::time_point> resumed_at(static_cast<std::size_t>(agents));
  std::vector<std::unique_ptr<ddp::agent::RemoteRendezvous>> rs;
  auto guard = asio::make_work_guard(io);
  std::thread io_thread([&] { io.run(); });
  std::atomic<bool> created{false};
  asio::post(io, [&] {
    for (int i = 0; i < agents; ++i) {
      ddp::agent::RemoteRendezvousOptions o;
      o.endpoints = {ddp::rdzv::Endpoint{"127.0.0.1", port}};
      o.job_id = "restart-bench";
      o.host_if_local = false;
      o.connect_timeout = deadline_s;
      o.reconnect_timeout = deadline_s;
      o.log = [&, i](const std::string& line) {
        if (line.rfind("resumed generation", 0) == 0) {
          resumed_at[static_cast<std::size_t>(i)] = steady::now();
          ++resumed;
        }
      };
      auto r = std::make_unique<ddp::agent::RemoteRendezvous>(io, o);
      ddp::agent::RendezvousEvents ev;
      ev.on_round = [&](const ddp::rdzv::Assignment&) { ++rounds; };
      ev.on_restart = [&](const std::string&, bool, bool, bool) { ++restarts; };
      ev.on_rendezvous_error = [&](const std::string& m) {
        if (errors++ < 3) std::fprintf(stderr, "agent error: %s\n", m.c_str());
      };
      r->set_events(std::move(ev));
      ddp::rdzv::NodeSpec spec;
      spec.job_id = "restart-bench";
      spec.host = "agent" + std::to_string(i);
      spec.addr = "127.0.0.1";
      spec.min_nodes = spec.max_nodes = agents;
      spec.master_port = 20000;
      spec.env_check = "off";
      spec.timeouts.join_timeout = deadline_s;
      spec.timeouts.heartbeat_interval = 1;
      spec.timeouts.heartbeat_timeout = 10;  // also the restore grace period
      r->join(spec);
      rs.push_back(std::move(r));
    }
    created = true;
  });
  auto wait_until = [&](auto cond, const char* what) {
    const auto start = steady::now();
    while (!cond()) {
      if (ms(start, steady::now()) > deadline_s * 1000 || errors > 0) {
        std::fprintf(stderr, "timed out or failed waiting for %s (rounds %d, resumed %d, errors %d)\n", what,
                     rounds.load(), resumed.load(), errors.load());
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  };
  bool ok = wait_until([&] { return rounds.load() == agents; }, "the first round");
  if (ok) {
    const auto formed = steady::now();
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    const auto down = steady::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(gap));
    const std::string log = "/tmp/ddp-rdzv-restart-bench-" + std::to_string(getpid()) + ".log";
    pid = start_daemon(daemon, port, log);
    const auto spawned = steady::now();
    while (!listening(port) && ms(spawned, steady::now()) < 10000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    const auto back = steady::now();
    ok = wait_until([&] { return resumed.load() == agents; }, "every agent to resume");
    if (ok) {
      auto last = *std::max_element(resumed_at.begin(), resumed_at.end());
      auto first = *std::min_element(resumed_at.begin(), resumed_at.end());
      std::printf("agents %d  gap %.1f s  round formed in %.1f ms\n", agents, gap, ms(t0, formed));
      std::printf("time with no rendezvous (kill -> listening again): %.1f ms\n", ms(down, back));
      std::printf("daemon listening -> first agent resumed: %.1f ms\n", ms(back, first));
      std::printf("daemon listening -> every agent resumed: %.1f ms\n", ms(back, last));
      std::printf("first resume -> every agent resumed:     %.1f ms\n", ms(first, last));
      const double first_resume = log_time(log, "rebuilt from the resume");
      const double restored = log_time(log, ": restored: every one");
      if (first_resume >= 0 && restored >= 0) {
        std::printf("daemon: first resume received -> every node restored: %.0f ms (log timestamps)\n",
                    (restored - first_resume) * 1000);
      }
      std::printf("restarts told to agents: %d (goal 0), errors: %d\n", restarts.load(), errors.load());
      ok = restarts.load() == 0;
    }
  }
  asio::post(io, [&] {
    rs.clear();
    guard.reset();
    io.stop();
  });
  io_thread.join();
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  if (ok) ::unlink(("/tmp/ddp-rdzv-restart-bench-" + std::to_string(getpid()) + ".log").c_str());
  return ok ? 0 : 1;
}
