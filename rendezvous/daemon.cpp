// The ddp-rendezvous daemon's wiring (rendezvous/daemon.h).
#include "rendezvous/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include <boost/asio.hpp>

#include "metrics/dashboard.h"
#include "metrics/event.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "rendezvous/auth.h"
#include "rendezvous/election.h"
#include "rendezvous/metrics.h"
#include "rendezvous/notify.h"
#include "rendezvous/server.h"
#include "rendezvous/status.h"

namespace ddp::rdzv {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

LaunchError usage_error(const std::string& message) { return LaunchError(DaemonExit::usage, "ddp-rendezvous: " + message); }
LaunchError connect_error_exit(const std::string& message) {
  return LaunchError(DaemonExit::connect, "ddp-rendezvous: " + message);
}

std::string timestamp() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  std::tm tm{};
  gmtime_r(&ts.tv_sec, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  char out[80];
  std::snprintf(out, sizeof out, "%s.%03ldZ", buf, ts.tv_nsec / 1000000);
  return out;
}

// A flag's value, else the environment variable's, else "" (the token file:
// $DDPLAUNCH_RDZV_TOKEN_FILE; status's TLS files: $DDPLAUNCH_RDZV_TLS_*).
std::string flag_or_env(const std::string& flag, const char* variable) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv(variable);
  return env ? env : "";
}

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string read_password(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw usage_error("cannot read --etcd_password_file " + path + ": " + std::strerror(errno));
  std::string password;
  std::getline(in, password);
  if (password.empty()) throw usage_error("--etcd_password_file " + path + " is empty");
  return password;
}

// --etcd and its companions, checked together. REQUIRES: rep.etcd is not empty.
ElectionOptions election_options(const Replication& rep) {
  ElectionOptions e;
  e.etcd.endpoints = split_list(rep.etcd);
  if (e.etcd.endpoints.empty()) throw usage_error("--etcd: no endpoint given");
  e.etcd.ca_file = rep.cacert;
  e.etcd.cert_file = rep.cert;
  e.etcd.key_file = rep.key;
  if (const std::string error = EtcdClient(e.etcd).config_error(); !error.empty()) {
    throw usage_error("--etcd: " + error + " (--etcd_cacert, --etcd_cert, --etcd_key)");
  }
  const bool https = std::any_of(e.etcd.endpoints.begin(), e.etcd.endpoints.end(),
                                 [](const std::string& endpoint) { return endpoint.rfind("https://", 0) == 0; });
  if (!https && !(rep.cacert.empty() && rep.cert.empty() && rep.key.empty())) {
    throw usage_error("--etcd_cacert, --etcd_cert and --etcd_key are for https:// endpoints; --etcd has none");
  }
  e.etcd.user = rep.user;
  if (!rep.user.empty()) {
    if (rep.password_file.empty()) throw usage_error("--etcd_user needs --etcd_password_file");
    e.etcd.password = read_password(rep.password_file);
  }
  if (rep.lease_ttl < 2 || rep.lease_ttl > 600) throw usage_error("--etcd_lease_ttl: 2..600 seconds");
  e.lease_ttl = rep.lease_ttl;
  e.watch = rep.watch;
  if (rep.prefix.empty()) throw usage_error("--etcd_prefix must not be empty");
  e.key = rep.prefix + "leader";
  e.records_prefix = rep.prefix + "jobs/";
  return e;
}

// What the metrics endpoint serves from the event bus: null without --metrics_port.
struct Observers {
  std::shared_ptr<DaemonMetrics> metrics;
  std::shared_ptr<metrics::EventRing> recent;  // the dashboard's timeline
};

// The event bus the state machine records into: the daemon's metrics and the dashboard's recent
// events (with --metrics_port) and the event log (--event_log) consume it.
void add_observers(const Observability& obs, ServerOptions& server, Observers& observers) {
  auto bus = std::make_shared<metrics::EventBus>();
  if (obs.metrics_port >= 0) {
    observers.metrics = std::make_shared<DaemonMetrics>();
    observers.recent = std::make_shared<metrics::EventRing>();
    bus->add(observers.metrics);
    bus->add(observers.recent);
  }
  if (!obs.event_log.empty()) {
    try {
      bus->add(std::make_shared<metrics::EventLog>(obs.event_log));
    } catch (const std::runtime_error& e) {
      throw usage_error(std::string(e.what()) + " (--event_log)");
    }
  }
  if (!bus->empty()) server.on_event = [bus](const metrics::Event& e) { bus->record(e); };
}

// Everything the Server takes from the command line but the address it binds.
ServerOptions server_options(const DaemonOptions& o, Observers& observers) {
  ServerOptions server;
  server.replicated = !o.replication.etcd.empty();
  const TlsFiles& tls = o.listen.tls;
  if (!tls.cert.empty() || !tls.key.empty() || !tls.ca.empty()) {
    Expected<std::shared_ptr<TlsContext>> context = TlsContext::for_server(tls);
    if (!context) throw usage_error(context.error());
    server.tls = std::move(*context);
  }
  server.retention.keep_finished = o.observability.keep_finished;
  server.retention.max_finished = o.observability.max_finished;
  add_observers(o.observability, server, observers);
  if (const std::string path = flag_or_env(o.listen.token_file, "DDPLAUNCH_RDZV_TOKEN_FILE"); !path.empty()) {
    Expected<Secrets> secrets = Secrets::load(path);
    if (!secrets) throw usage_error(secrets.error() + " (--token_file)");
    server.secrets = std::move(*secrets);
  }
  server.max_connections = o.listen.max_connections;
  if (o.listen.writer_threads > 0) server.writer_threads = o.listen.writer_threads;
  if (o.listen.max_unauthenticated > 0) server.max_unauthenticated = o.listen.max_unauthenticated;
  server.log = [quiet = o.listen.quiet_joins](const std::string& line) {
    if (quiet && line.find(": join ") != std::string::npos) return;
    std::cout << timestamp() << " " << line << '\n';
    std::cout.flush();
  };
  return server;
}

asio::ip::address ip_address(const std::string& text, const char* flag) {
  boost::system::error_code ec;
  auto address = asio::ip::make_address(text, ec);
  if (ec) throw usage_error(std::string(flag) + " " + text + " is not an IP address: " + ec.message());
  return address;
}

// One daemon run: the objects serve() wires together, on one io_context and its thread.
// Members are declared in the order they must outlive each other.
class Daemon {
 public:
  explicit Daemon(const DaemonOptions& options);
  int run();

 private:
  void serve_metrics();
  void start_election();
  void on_leadership(const Leadership& l);
  void stop(int signo);
  void announce();

  const DaemonOptions& options_;
  asio::io_context io_{1};
  Observers observers_;
  ServerOptions server_options_;
  ElectionOptions election_options_;
  asio::ip::address address_;
  // Writes the leader's job records (started in start_election()); declared before the
  // server, whose options hand it the writes.
  std::unique_ptr<Election> election_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<metrics::HttpServer> http_;
  // A leader steps down at `valid_until` by this loop's own timer, even while the election
  // thread is stuck in an etcd call.
  asio::steady_timer leadership_timer_{io_};
};

Daemon::Daemon(const DaemonOptions& options) : options_(options) {
  const Observability& obs = options.observability;
  if (obs.metrics_port > 65535 || obs.metrics_port < -1) throw usage_error("--metrics_port: not a port (0-65535)");
  if (!options.replication.etcd.empty()) election_options_ = election_options(options.replication);
  server_options_ = server_options(options, observers_);
  if (server_options_.replicated) {
    server_options_.write_records = [this](RecordWrite w) {
      if (election_) election_->write(std::move(w));
    };
    server_options_.on_redirect = [this](const std::string& leader) {
      if (election_) election_->redirected(leader);
    };
  }
  const ListenOptions& listen = options.listen;
  address_ = ip_address(listen.host, "--host");
  try {
    server_ = std::make_unique<Server>(io_, tcp::endpoint(address_, listen.port), server_options_);
  } catch (const boost::system::system_error& e) {
    throw connect_error_exit("cannot listen on " + listen.host + ":" + std::to_string(listen.port) + ": " +
                             e.code().message());
  }
  if (observers_.metrics) serve_metrics();
  if (server_options_.replicated) start_election();
}

void Daemon::serve_metrics() {
  const Observability& obs = options_.observability;
  const auto address = ip_address(obs.metrics_addr, "--metrics_addr");
  try {
    const tcp::endpoint where(address, static_cast<unsigned short>(obs.metrics_port));
    http_ = std::make_unique<metrics::HttpServer>(io_, where);
  } catch (const boost::system::system_error& e) {
    throw connect_error_exit("cannot serve metrics on " + obs.metrics_addr + ":" + std::to_string(obs.metrics_port) +
                             ": " + e.code().message() + " (--metrics_port)");
  }
  Server* server = server_.get();
  http_->route("/metrics", [server, metrics = observers_.metrics] {
    metrics::HttpResponse r;
    r.content_type = metrics::kExpositionContentType;
    r.body = metrics->render(server->state().gauges(), server->connection_count());
    return r;
  });
  http_->route("/healthz", [] { return metrics::HttpResponse{200, "text/plain; charset=utf-8", "ok\n"}; });
  http_->route("/readyz", [server] {
    return server->serving() ? metrics::HttpResponse{200, "text/plain; charset=utf-8", "ready\n"}
                             : metrics::HttpResponse{503, "text/plain; charset=utf-8", "stopping\n"};
  });
  metrics::serve_dashboard(*http_, {[server] { return server->status(); }, observers_.recent});
}

// The election runs on its own thread; its news is applied on this loop.
void Daemon::start_election() {
  const Replication& rep = options_.replication;
  std::string me = rep.advertise;
  if (me.empty()) {
    std::string host = options_.listen.host;
    if (address_.is_unspecified()) {
      char name[256] = {};
      gethostname(name, sizeof name - 1);
      host = name;
    }
    me = Endpoint{host, server_->port()}.text();
  }
  if (!valid_leader_endpoint(me)) throw usage_error("--advertise " + me + ": expected HOST:PORT");
  election_options_.me = me;
  const auto log = server_options_.log;
  Server* server = server_.get();
  election_options_.log = [this, log](const std::string& line) {
    asio::post(io_, [log, line] { log("etcd: " + line); });
  };
  election_options_.on_written = [this, server, log](std::uint64_t seq, const std::string& error,
                                                     std::uint64_t txns) {
    asio::post(io_, [server, log, seq, error, txns] {
      if (error.empty()) log("etcd: job records written (transaction " + std::to_string(txns) + ")");
      if (server->serving()) server->records_written(seq, error);
    });
  };
  election_options_.on_change = [this](const Leadership& l) {
    asio::post(io_, [this, l] { on_leadership(l); });
  };
  log("replica of " + rep.etcd + " as " + me + ", leader key " + election_options_.key + ", lease TTL " +
      std::to_string(rep.lease_ttl) + " s: following until elected");
  election_ = std::make_unique<Election>(election_options_);
  election_->start();
}

void Daemon::on_leadership(const Leadership& l) {
  if (!server_->serving()) return;
  const bool leading = l.leading && std::chrono::steady_clock::now() < l.valid_until;
  server_->set_leadership(leading, l.leader, l.records ? &*l.records : nullptr);
  if (!leading) return;
  leadership_timer_.expires_at(l.valid_until);
  leadership_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || !server_->leading()) return;
    server_options_.log("etcd: the lease was not renewed in time: stepping down before it can expire");
    server_->set_leadership(false, "");
  });
}

void Daemon::stop(int signo) {
  server_options_.log(std::string("stopping on ") + (signo == SIGINT ? "SIGINT" : "SIGTERM"));
  if (auto error = notify_systemd("STOPPING=1"); !error.empty()) server_options_.log(error);
  server_->stop();
  if (http_) http_->stop();
  leadership_timer_.cancel();
  if (election_) election_->stop();  // a leader revokes its lease: a follower takes over at once
  io_.stop();
}

void Daemon::announce() {
  const ListenOptions& listen = options_.listen;
  const auto& log = server_options_.log;
  const bool open = server_options_.secrets.open();
  const char* tls = !server_options_.tls ? "" : listen.tls.ca.empty() ? " (TLS)" : " (TLS, client certificates required)";
  log("listening on " + listen.host + ":" + std::to_string(server_->port()) +
      (open ? " (no token)" : " (token required)") + tls);
  if (http_) {
    const std::string base = "http://" + options_.observability.metrics_addr + ":" + std::to_string(http_->port());
    log("metrics on " + base + "/metrics");
    log("dashboard on " + base + "/");
  }
  if (open && !address_.is_loopback()) {
    const std::string warning =
        "WARNING: listening on " + listen.host + " with no secret: anyone who can reach this port can read every "
        "job, join any job as group rank 0 (and so choose MASTER_ADDR) or report fake failures. Give the daemon "
        "--token_file=PATH and every agent --rdzv_conf token_file=PATH (see docs/security.md)";
    log(warning);
    std::cerr << "ddp-rendezvous: " << warning << "\n";
  }
}

int Daemon::run() {
  asio::signal_set signals(io_, SIGINT, SIGTERM);
  signals.async_wait([this](const boost::system::error_code& e, int signo) {
    if (!e) stop(signo);
  });
  announce();
  // Under systemd (Type=notify): the port accepts connections from here on; with WatchdogSec=,
  // keep-alives from the event loop itself.
  SystemdWatchdog watchdog(io_, server_options_.log);
  if (auto error = notify_systemd("READY=1\nSTATUS=listening on " + options_.listen.host + ":" +
                                  std::to_string(server_->port()));
      !error.empty()) {
    server_options_.log("cannot tell systemd that the daemon is ready: " + error);
  }
  io_.run();
  if (election_) {
    election_->stop();
    io_.restart();
    io_.poll();  // the election's last log lines (posted), e.g. the revoked lease
  }
  return static_cast<int>(DaemonExit::ok);
}

// A ServerAccess resolved: the endpoint checked, the secret and TLS from the flags, else the
// environment. Throws a usage error naming what is wrong.
struct Reach {
  Endpoint endpoint;
  std::string secret;
  std::shared_ptr<TlsContext> tls;
};

Reach reach(const ServerAccess& access) {
  Reach r;
  const Expected<Endpoint> parsed = parse_endpoint(access.endpoint);
  if (!parsed) throw usage_error("--endpoint " + access.endpoint + ": " + parsed.error() + "; accepted: " + kEndpointSyntax);
  if (const std::string error = connect_error(*parsed); !error.empty()) throw usage_error("--endpoint " + error);
  r.endpoint = *parsed;
  if (const std::string path = flag_or_env(access.token_file, "DDPLAUNCH_RDZV_TOKEN_FILE"); !path.empty()) {
    Expected<std::string> secret = read_secret_file(path);
    if (!secret) throw usage_error(secret.error());
    r.secret = std::move(*secret);
  }
  TlsFiles files = access.tls;
  files.ca = flag_or_env(files.ca, "DDPLAUNCH_RDZV_TLS_CA");
  files.cert = flag_or_env(files.cert, "DDPLAUNCH_RDZV_TLS_CERT");
  files.key = flag_or_env(files.key, "DDPLAUNCH_RDZV_TLS_KEY");
  if (!files.ca.empty() || !files.cert.empty() || !files.key.empty()) {
    Expected<std::shared_ptr<TlsContext>> context = TlsContext::for_client(files);
    if (!context) throw usage_error(context.error());
    r.tls = std::move(*context);
  }
  return r;
}

}  // namespace

int serve(const DaemonOptions& options) {
  Daemon daemon(options);
  return daemon.run();
}

int status(StatusOptions o) {
  const Reach r = reach(o.server);
  if (o.watch) return watch_status(r.endpoint, r.secret, o.server.timeout, o.job, o.interval, o.json, r.tls);
  const StatusResult result = query_status(r.endpoint, r.secret, o.server.timeout, o.job, r.tls);
  if (!result.error.empty()) {
    std::cerr << "ddp-rendezvous status: " << result.error << "\n";
    return static_cast<int>(DaemonExit::connect);
  }
  try {
    std::cout << (o.json ? result.status.dump(2) + "\n" : format_status(result.status));
  } catch (const nlohmann::json::exception& e) {
    std::cerr << "ddp-rendezvous status: " << r.endpoint.text() << " sent a malformed status: " << e.what() << "\n";
    return static_cast<int>(DaemonExit::connect);
  }
  return static_cast<int>(DaemonExit::ok);
}

int drain(DrainOptions o) {
  const Reach r = reach(o.server);
  Drain request;
  request.job = o.job;
  request.node = o.node;
  request.force = o.force;
  const StatusResult result = drain_node(r.endpoint, r.secret, o.server.timeout, request, r.tls);
  if (!result.error.empty()) {
    std::cerr << "ddp-rendezvous drain: " << result.error << "\n";
    return static_cast<int>(result.code.empty() ? DaemonExit::connect : DaemonExit::refused);
  }
  std::cout << "ddp-rendezvous drain: " << result.status.value("message", "drained " + o.node) << "\n";
  return static_cast<int>(DaemonExit::ok);
}

}  // namespace ddp::rdzv
