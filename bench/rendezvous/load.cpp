// ddp-rdzv-load: simulates K agents (K connections from one process) against a ddp-rendezvous
// and measures round formation, death notice and silent-node detection. Loopback only.
//
//   ddp-rdzv-load --endpoint 127.0.0.1:29400 --agents 10000 --mode round
//   ddp-rdzv-load --endpoint 127.0.0.1:29400 --agents 1000 --mode death
//   ddp-rdzv-load --endpoint 127.0.0.1:29400 --agents 10 --mode silent --heartbeat-timeout 1
//   ddp-rdzv-load --endpoint 127.0.0.1:29400 --agents 10000 --mode probe --daemon-pid PID
//   ddp-rdzv-load --endpoint 127.0.0.1:29400 --agents 10000 --mode beat --daemon-pid PID
#include <sys/resource.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>

#include "rendezvous/auth.h"
#include "rendezvous/client.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/protocol.h"

namespace asio = boost::asio;
using asio::ip::tcp;
using steady = std::chrono::steady_clock;
using namespace ddp::rdzv;
using ddp::Expected;

namespace {

double ms_since(steady::time_point t0, steady::time_point t1) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

struct Load;

// One simulated agent: a socket, a read loop, the times it heard things.
struct Agent : std::enable_shared_from_this<Agent> {
  Agent(asio::io_context& io, Load& load, int index) : socket(io), load(load), index(index) {}
  tcp::socket socket;
  Load& load;
  int index;
  unsigned char header[kFrameHeaderBytes];
  std::string body;
  bool welcomed = false, rounded = false, restarted = false, alive = true;
  steady::time_point last_sent;
  void start_read();
  void send(const Frame& f) {
    last_sent = steady::now();
    asio::async_write(socket, asio::buffer(*f), [self = shared_from_this(), f](boost::system::error_code, std::size_t) {});
  }
};

struct Load {
  asio::io_context io{1};
  std::vector<std::shared_ptr<Agent>> agents;
  int welcomed = 0, rounded = 0, restarted = 0, errors = 0, probed = 0;
  steady::time_point last_round, last_restart, last_probe;
  Frame answer = encode(make_heartbeat());
  std::string first_error;
  std::string job, secret;
};

void Agent::start_read() {
  asio::async_read(socket, asio::buffer(header), [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
    if (ec || !self->alive) return;
    self->body.resize(read_frame_header(self->header));
    asio::async_read(self->socket, asio::buffer(self->body), [self](boost::system::error_code ec2, std::size_t) {
      if (ec2 || !self->alive) return;
      // The tool only needs the type; a full parse per message would slow the measuring side.
      std::string type;
      auto at = self->body.find("\"type\":\"");
      if (at != std::string::npos) {
        auto start = at + 8;
        type = self->body.substr(start, self->body.find('"', start) - start);
      }
      Load& l = self->load;
      if (type == "challenge") {  // protocol 2: the server speaks first; prove the secret if any
        Hello h;
        h.job_id = l.job;
        h.client_nonce = random_hex(16);
        if (!l.secret.empty()) {
          h.proof = auth_proof(l.secret, "hello", nlohmann::json::parse(self->body).value("nonce", ""), h.client_nonce,
                               h.job_id);
        }
        self->send(encode(make_hello(h)));
      } else if (type == "welcome") {
        self->welcomed = true;
        ++l.welcomed;
      } else if (type == "round") {
        self->rounded = true;
        ++l.rounded;
        l.last_round = steady::now();
      } else if (type == "probe") {  // a live agent answers at once
        ++l.probed;
        l.last_probe = steady::now();
        self->send(l.answer);
      } else if (type == "restart") {
        self->restarted = true;
        ++l.restarted;
        l.last_restart = steady::now();
      } else if (type == "error") {
        if (l.first_error.empty()) l.first_error = nlohmann::json::parse(self->body).value("message", "");
        ++l.errors;
      }
      self->start_read();
    });
  });
}

// CPU seconds (user + system) the process has used so far, from /proc/PID/stat; -1 if unknown.
double cpu_seconds(int pid) {
  if (pid <= 0) return -1;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {  // fields 14 and 15: utime, stime (clock ticks)
    if (i == 14) utime = std::stod(field);
    if (i == 15) stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

bool run_until(Load& l, const std::function<bool()>& done, double seconds) {
  auto deadline = steady::now() + std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(seconds));
  while (!done()) {
    if (steady::now() > deadline) return false;
    l.io.restart();
    l.io.run_for(std::chrono::milliseconds(1));
  }
  return true;
}

void raise_nofile(std::size_t want) {
  rlimit r{};
  getrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur < want + 64) {
    r.rlim_cur = std::min<rlim_t>(r.rlim_max, want + 64);
    setrlimit(RLIMIT_NOFILE, &r);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddp-rdzv-load: K simulated agents against a rendezvous server"};
  std::string endpoint = "127.0.0.1:29400", mode = "round", job = "load";
  int k = 100;
  double heartbeat_timeout = 1.0, heartbeat_interval = 0.1, deadline = 60;
  app.add_option("--endpoint", endpoint)->capture_default_str();
  app.add_option("--agents", k)->capture_default_str();
  app.add_option("--mode", mode, "round | death | silent | probe | beat")
      ->check(CLI::IsMember({"round", "death", "silent", "probe", "beat"}));
  int daemon_pid = 0;
  double beat_seconds = 5;
  app.add_option("--daemon-pid", daemon_pid, "the daemon's pid, to report its CPU time in probe and beat modes");
  app.add_option("--beat-seconds", beat_seconds, "beat mode: how long every agent heartbeats")->capture_default_str();
  app.add_option("--job", job)->capture_default_str();
  app.add_option("--heartbeat-timeout", heartbeat_timeout)->capture_default_str();
  app.add_option("--heartbeat-interval", heartbeat_interval)->capture_default_str();
  std::string token_file;
  app.add_option("--token-file", token_file, "prove this secret (HMAC) like an agent with token_file");
  app.add_option("--deadline", deadline, "give up after this many seconds per phase")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  raise_nofile(static_cast<std::size_t>(k) + 16);

  const Expected<Endpoint> given = parse_endpoint(endpoint);
  if (!given) {
    std::fprintf(stderr, "ddp-rdzv-load: --endpoint %s: %s\n", endpoint.c_str(), given.error().c_str());
    return 2;
  }
  const Endpoint& parsed = *given;
  tcp::endpoint ep(asio::ip::make_address(parsed.host), static_cast<unsigned short>(parsed.port));
  Load l;
  l.job = job;
  if (!token_file.empty()) {
    Expected<std::string> secret = read_secret_file(token_file);
    if (!secret) {
      std::fprintf(stderr, "ddp-rdzv-load: --token_file: %s\n", secret.error().c_str());
      return 2;
    }
    l.secret = std::move(*secret);
  }
  const auto t_connect = steady::now();
  for (int i = 0; i < k; ++i) {
    auto a = std::make_shared<Agent>(l.io, l, i);
    l.agents.push_back(a);
    a->socket.async_connect(ep, [a](boost::system::error_code ec) {
      if (ec) {
        ++a->load.errors;
        if (a->load.first_error.empty()) a->load.first_error = "connect: " + ec.message();
        return;
      }
      a->socket.set_option(tcp::no_delay(true));
      a->start_read();
    });
    if (i % 256 == 255) l.io.poll();
  }
  if (!run_until(l, [&] { return l.welcomed + l.errors >= k; }, deadline) || l.errors) {
    std::fprintf(stderr, "connect phase: %d of %d welcomed, %d errors (%s)\n", l.welcomed, k, l.errors, l.first_error.c_str());
    return 1;
  }
  const double connect_ms = ms_since(t_connect, steady::now());

  NodeSpec spec;
  spec.job_id = job;
  spec.host = "load";
  spec.addr = "127.0.0.1";
  spec.min_nodes = spec.max_nodes = k;
  spec.master_port = 29500;
  spec.timeouts.heartbeat_timeout = mode == "silent" ? heartbeat_timeout : 120;
  spec.timeouts.heartbeat_interval = mode == "beat" ? 1.0 : heartbeat_interval;
  spec.timeouts.last_call_timeout = 0;
  spec.timeouts.probe_timeout = Timeouts{}.probe_timeout;
  // Agents differ only in their host name; serialize each join (as real agents would).
  const auto t_join = steady::now();
  for (int i = 0; i < k; ++i) {
    spec.host = "load" + std::to_string(i);
    l.agents[i]->send(encode(make_join(spec)));
    if (i % 256 == 255) l.io.poll();
  }
  if (!run_until(l, [&] { return l.rounded + l.errors >= k; }, deadline) || l.errors) {
    std::fprintf(stderr, "join phase: %d of %d got a round, %d errors (%s)\n", l.rounded, k, l.errors, l.first_error.c_str());
    return 1;
  }
  const double round_ms = ms_since(t_join, l.last_round);
  std::printf("{\"mode\":\"%s\",\"agents\":%d,\"connect_ms\":%.1f,\"round_ms\":%.1f", mode.c_str(), k, connect_ms, round_ms);

  if (mode == "death") {
    auto victim = l.agents[k / 2];
    const auto t_death = steady::now();
    victim->alive = false;
    victim->socket.close();
    if (!run_until(l, [&] { return l.restarted >= k - 1; }, deadline)) {
      std::fprintf(stderr, "\ndeath: only %d of %d survivors told\n", l.restarted, k - 1);
      return 1;
    }
    std::printf(",\"death_to_last_survivor_ms\":%.2f", ms_since(t_death, l.last_restart));
  } else if (mode == "silent") {
    // Everyone heartbeats every interval except the victim, which falls silent now.
    auto victim = l.agents[k / 2];
    victim->alive = false;  // stops reading and sending, socket stays open
    const auto t_last = victim->last_sent;
    const Frame hb = encode(make_heartbeat());
    asio::steady_timer timer(l.io);
    std::function<void()> beat = [&] {
      for (auto& a : l.agents) {
        if (a->alive) a->send(hb);
      }
      timer.expires_after(std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(heartbeat_interval)));
      timer.async_wait([&](boost::system::error_code ec) {
        if (!ec) beat();
      });
    };
    beat();
    if (!run_until(l, [&] { return l.restarted >= k - 1; }, heartbeat_timeout * 3 + 5)) {
      std::fprintf(stderr, "\nsilent: only %d of %d survivors told\n", l.restarted, k - 1);
      return 1;
    }
    timer.cancel();
    const double detect_ms = ms_since(t_last, l.last_restart);
    std::printf(",\"heartbeat_timeout_ms\":%.0f,\"silence_to_last_survivor_ms\":%.1f,\"over_timeout_pct\":%.1f",
                heartbeat_timeout * 1000, detect_ms, (detect_ms / (heartbeat_timeout * 1000) - 1) * 100);
  }
  if (mode == "probe") {
    // The worst probe round: nobody heartbeats (heartbeat_timeout 120 s), so when one agent says
    // its workers stalled, every other node of the job is probed, and all answer. (A lost node's
    // verdict is then a broadcast like --mode death's; on loopback every host acknowledges its
    // probe, so none is lost here.) The daemon's CPU time over the round, to its verdict.
    run_until(l, [] { return false; }, 0.2);  // silence since the round formed
    const double cpu0 = cpu_seconds(daemon_pid);
    const auto t_stall = steady::now();
    l.agents[0]->send(encode(make_stall(0.15)));
    if (!run_until(l, [&] { return l.probed >= k - 1; }, deadline)) {
      std::fprintf(stderr, "\nprobe: only %d of %d probed\n", l.probed, k - 1);
      return 1;
    }
    const double fan_out_ms = ms_since(t_stall, l.last_probe);
    run_until(l, [] { return false; }, Timeouts{}.probe_timeout + 0.1);  // past the verdict
    std::printf(",\"probe_timeout_ms\":%.0f,\"probes_answered\":%d,\"stall_to_last_probe_ms\":%.1f,\"restarts\":%d",
                Timeouts{}.probe_timeout * 1000, l.probed, fan_out_ms, l.restarted);
    if (cpu0 >= 0) std::printf(",\"daemon_cpu_ms\":%.1f", (cpu_seconds(daemon_pid) - cpu0) * 1000);
  } else if (mode == "beat") {
    // The steady state: every agent heartbeats once a second, spread evenly over the second (as
    // agents that started at different moments do); the daemon's CPU share over the window.
    const Frame hb = encode(make_heartbeat());
    asio::steady_timer timer(l.io);
    const auto start = steady::now();
    std::size_t next = 0;
    std::function<void()> tick = [&] {
      const double due = std::chrono::duration<double>(steady::now() - start).count() * k;  // beats due so far
      for (; next < static_cast<std::size_t>(due); ++next) l.agents[next % k]->send(hb);
      timer.expires_after(std::chrono::milliseconds(1));
      timer.async_wait([&](boost::system::error_code ec) {
        if (!ec) tick();
      });
    };
    const double cpu0 = cpu_seconds(daemon_pid);
    tick();
    run_until(l, [] { return false; }, beat_seconds);
    timer.cancel();
    const double window = std::chrono::duration<double>(steady::now() - start).count();
    std::printf(",\"heartbeats_per_s\":%.0f", static_cast<double>(next) / window);
    if (cpu0 >= 0) std::printf(",\"daemon_cpu_pct\":%.1f", (cpu_seconds(daemon_pid) - cpu0) / window * 100);
  }
  std::printf("}\n");
  return 0;
}
