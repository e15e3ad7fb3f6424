// ddp-rendezvous: the rendezvous daemon (serve) and its status query.
// Exit codes: 0 ok, 2 usage, 3 cannot bind or connect.
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>

#include "metrics/event.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "rendezvous/auth.h"
#include "rendezvous/election.h"
#include "rendezvous/notify.h"
#include "rendezvous/metrics.h"
#include "rendezvous/server.h"
#include "rendezvous/status.h"
#include "rendezvous/stream.h"

// The CMake project version (rendezvous/CMakeLists.txt), the same one `ddplaunch --version` prints.
#ifndef DDPLAUNCH_VERSION
#define DDPLAUNCH_VERSION "unknown"
#endif

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

constexpr int kExitOk = 0;
constexpr int kExitUsage = 2;
constexpr int kExitConnect = 3;

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

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool is_loopback(const asio::ip::address& a) { return a.is_loopback(); }

// A flag's value, else the environment variable's, else "" (the token file: $DDPLAUNCH_RDZV_TOKEN_FILE;
// status's TLS files: $DDPLAUNCH_RDZV_TLS_*).
std::string flag_or_env(const std::string& flag, const char* variable) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv(variable);
  return env ? env : "";
}

// Issue 15/17: metrics, events and how long finished jobs stay listed.
struct Observability {
  int metrics_port = -1;                 // --metrics_port; -1 = no metrics server
  std::string metrics_addr = "127.0.0.1";  // --metrics_addr
  std::string event_log;                 // --event_log; "" = none
  double keep_finished = 600;            // --keep_finished seconds
  std::size_t max_finished = 256;        // --max_finished
};

// Issue 14: replicas on etcd (docs/etcd.md).
struct Replication {
  std::string etcd;                         // --etcd: comma-separated endpoints; "" = a lone daemon
  int lease_ttl = 5;                        // --etcd_lease_ttl seconds
  std::string prefix = "/ddplaunch/rendezvous/";  // --etcd_prefix
  std::string user;                         // --etcd_user
  std::string password_file;                // --etcd_password_file
  std::string advertise;                    // --advertise HOST:PORT; default --host (or the host name)
  std::string cacert;                       // --etcd_cacert: CA of etcd's certificates ("" = the system's)
  std::string cert;                         // --etcd_cert: client certificate (--client-cert-auth)
  std::string key;                          // --etcd_key: its key
  bool watch = true;                        // --etcd_watch: watch the leader key (else reads only)
};

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
  if (!in) throw UsageError("cannot read --etcd_password_file " + path + ": " + std::strerror(errno));
  std::string password;
  std::getline(in, password);
  if (password.empty()) throw UsageError("--etcd_password_file " + path + " is empty");
  return password;
}

int serve(const std::string& host, unsigned short port, const std::string& token_file, std::size_t max_connections,
          bool quiet, const ddp::rdzv::TlsFiles& tls, const Observability& obs, const Replication& rep) {
  ddp::rdzv::ServerOptions options;
  options.replicated = !rep.etcd.empty();
  ddp::rdzv::ElectionOptions election_options;
  if (options.replicated) {
    election_options.etcd.endpoints = split_list(rep.etcd);
    if (election_options.etcd.endpoints.empty()) throw UsageError("--etcd: no endpoint given");
    election_options.etcd.ca_file = rep.cacert;
    election_options.etcd.cert_file = rep.cert;
    election_options.etcd.key_file = rep.key;
    if (const std::string e = ddp::rdzv::EtcdClient(election_options.etcd).config_error(); !e.empty()) {
      throw UsageError("--etcd: " + e + " (--etcd_cacert, --etcd_cert, --etcd_key)");
    }
    const bool https = std::any_of(election_options.etcd.endpoints.begin(), election_options.etcd.endpoints.end(),
                                   [](const std::string& e) { return e.rfind("https://", 0) == 0; });
    if (!https && !(rep.cacert.empty() && rep.cert.empty() && rep.key.empty())) {
      throw UsageError("--etcd_cacert, --etcd_cert and --etcd_key are for https:// endpoints; --etcd has none");
    }
    election_options.etcd.user = rep.user;
    if (!rep.user.empty()) {
      if (rep.password_file.empty()) throw UsageError("--etcd_user needs --etcd_password_file");
      election_options.etcd.password = read_password(rep.password_file);
    }
    if (rep.lease_ttl < 2 || rep.lease_ttl > 600) throw UsageError("--etcd_lease_ttl: 2..600 seconds");
    election_options.lease_ttl = rep.lease_ttl;
    election_options.watch = rep.watch;
    if (rep.prefix.empty()) throw UsageError("--etcd_prefix must not be empty");
    election_options.key = rep.prefix + "leader";
    election_options.records_prefix = rep.prefix + "jobs/";
  }
  if (!tls.cert.empty() || !tls.key.empty() || !tls.ca.empty()) {
    try {
      options.tls = ddp::rdzv::TlsContext::for_server(tls);
    } catch (const ddp::rdzv::TlsError& e) {
      throw UsageError(e.what());
    }
  }
  options.retention.keep_finished = obs.keep_finished;
  options.retention.max_finished = obs.max_finished;
  // One place records the state machine's events; the metrics and the event log consume them.
  auto bus = std::make_shared<ddp::metrics::EventBus>();
  std::shared_ptr<ddp::rdzv::DaemonMetrics> metrics;
  if (obs.metrics_port >= 0) {
    metrics = std::make_shared<ddp::rdzv::DaemonMetrics>();
    bus->add(metrics);
  }
  if (!obs.event_log.empty()) {
    try {
      bus->add(std::make_shared<ddp::metrics::EventLog>(obs.event_log));
    } catch (const std::runtime_error& e) {
      throw UsageError(std::string(e.what()) + " (--event_log)");
    }
  }
  if (!bus->empty()) options.on_event = [bus](const ddp::metrics::Event& e) { bus->record(e); };
  const std::string path = flag_or_env(token_file, "DDPLAUNCH_RDZV_TOKEN_FILE");
  if (!path.empty()) {
    try {
      options.secrets = ddp::rdzv::Secrets::load(path);
    } catch (const ddp::rdzv::SecretError& e) {
      throw UsageError(std::string(e.what()) + " (--token_file)");
    }
  }
  options.max_connections = max_connections;
  options.log = [quiet](const std::string& line) {
    if (quiet && line.find(": join ") != std::string::npos) return;
    std::cout << timestamp() << " " << line << '\n';
    std::cout.flush();
  };
  asio::io_context io(1);
  // Issue 14: the election (started below) writes the leader's job records; declared before the
  // server, whose options hand it the writes.
  std::unique_ptr<ddp::rdzv::Election> election;
  if (options.replicated) {
    options.write_records = [&election](ddp::rdzv::RecordWrite w) {
      if (election) election->write(std::move(w));
    };
  }
  boost::system::error_code ec;
  auto address = asio::ip::make_address(host, ec);
  if (ec) {
    std::cerr << "ddp-rendezvous: --host " << host << " is not an IP address: " << ec.message() << "\n";
    return kExitUsage;
  }
  std::unique_ptr<ddp::rdzv::Server> server;
  try {
    server = std::make_unique<ddp::rdzv::Server>(io, tcp::endpoint(address, port), options);
  } catch (const boost::system::system_error& e) {
    std::cerr << "ddp-rendezvous: cannot listen on " << host << ":" << port << ": " << e.code().message() << "\n";
    return kExitConnect;
  }
  std::unique_ptr<ddp::metrics::HttpServer> http;
  if (metrics) {
    auto maddr = asio::ip::make_address(obs.metrics_addr, ec);
    if (ec) {
      std::cerr << "ddp-rendezvous: --metrics_addr " << obs.metrics_addr << " is not an IP address: " << ec.message()
                << "\n";
      return kExitUsage;
    }
    try {
      http = std::make_unique<ddp::metrics::HttpServer>(
          io, tcp::endpoint(maddr, static_cast<unsigned short>(obs.metrics_port)));
    } catch (const boost::system::system_error& e) {
      std::cerr << "ddp-rendezvous: cannot serve metrics on " << obs.metrics_addr << ":" << obs.metrics_port << ": "
                << e.code().message() << " (--metrics_port)\n";
      return kExitConnect;
    }
    ddp::rdzv::Server* srv = server.get();
    http->route("/metrics", [srv, metrics] {
      ddp::metrics::HttpResponse r;
      r.content_type = ddp::metrics::kExpositionContentType;
      r.body = metrics->render(srv->state().gauges(), srv->connection_count());
      return r;
    });
    http->route("/healthz", [] { return ddp::metrics::HttpResponse{200, "text/plain; charset=utf-8", "ok\n"}; });
    http->route("/readyz", [srv] {
      return srv->serving() ? ddp::metrics::HttpResponse{200, "text/plain; charset=utf-8", "ready\n"}
                            : ddp::metrics::HttpResponse{503, "text/plain; charset=utf-8", "stopping\n"};
    });
  }
  // Issue 14: the election runs on its own thread; its news is applied on this loop. A leader
  // steps down at `valid_until` by this loop's own timer, even while the election thread is
  // stuck in an etcd call.
  asio::steady_timer leadership_timer(io);
  if (options.replicated) {
    std::string me = rep.advertise;
    if (me.empty()) {
      std::string h = host;
      if (address.is_unspecified()) {
        char name[256] = {};
        gethostname(name, sizeof name - 1);
        h = name;
      }
      me = (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(server->port());
    }
    if (!ddp::rdzv::valid_leader_endpoint(me)) throw UsageError("--advertise " + me + ": expected HOST:PORT");
    election_options.me = me;
    ddp::rdzv::Server* srv = server.get();
    election_options.log = [&io, log = options.log](const std::string& line) {
      asio::post(io, [log, line] { log("etcd: " + line); });
    };
    election_options.on_written = [&io, srv, log = options.log](std::uint64_t seq, const std::string& error,
                                                                 std::uint64_t txns) {
      asio::post(io, [srv, log, seq, error, txns] {
        if (error.empty()) log("etcd: job records written (transaction " + std::to_string(txns) + ")");
        if (srv->serving()) srv->records_written(seq, error);
      });
    };
    election_options.on_change = [&io, srv, &leadership_timer, log = options.log](const ddp::rdzv::Leadership& l) {
      asio::post(io, [srv, &leadership_timer, log, l] {
        if (!srv->serving()) return;
        const bool leading = l.leading && std::chrono::steady_clock::now() < l.valid_until;
        srv->set_leadership(leading, l.leader, l.records ? &*l.records : nullptr);
        if (!leading) return;
        leadership_timer.expires_at(l.valid_until);
        leadership_timer.async_wait([srv, log](const boost::system::error_code& ec) {
          if (ec || !srv->leading()) return;
          log("etcd: the lease was not renewed in time: stepping down before it can expire");
          srv->set_leadership(false, "");
        });
      });
    };
    options.log("replica of " + rep.etcd + " as " + me + ", leader key " + election_options.key + ", lease TTL " +
                std::to_string(rep.lease_ttl) + " s: following until elected");
    election = std::make_unique<ddp::rdzv::Election>(election_options);
    election->start();
  }
  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code& e, int signo) {
    if (e) return;
    options.log(std::string("stopping on ") + (signo == SIGINT ? "SIGINT" : "SIGTERM"));
    if (auto error = ddp::rdzv::notify_systemd("STOPPING=1"); !error.empty()) options.log(error);
    server->stop();
    if (http) http->stop();
    leadership_timer.cancel();
    if (election) election->stop();  // a leader revokes its lease: a follower takes over at once
    io.stop();
  });
  options.log("listening on " + host + ":" + std::to_string(server->port()) +
              (options.secrets.open() ? " (no token)" : " (token required)") +
              (options.tls ? (tls.ca.empty() ? " (TLS)" : " (TLS, client certificates required)") : ""));
  if (http) options.log("metrics on http://" + obs.metrics_addr + ":" + std::to_string(http->port()) + "/metrics");
  if (options.secrets.open() && !is_loopback(address)) {
    const std::string warning =
        "WARNING: listening on " + host + " with no secret: anyone who can reach this port can read every job, "
        "join any job as group rank 0 (and so choose MASTER_ADDR) or report fake failures. Give the daemon "
        "--token_file=PATH and every agent --rdzv_conf token_file=PATH (see docs/security.md)";
    options.log(warning);
    std::cerr << "ddp-rendezvous: " << warning << "\n";
  }
  // Under systemd (Type=notify): the port accepts connections from here on; with WatchdogSec=,
  // keep-alives from the event loop itself.
  ddp::rdzv::SystemdWatchdog watchdog(io, options.log);
  if (auto error = ddp::rdzv::notify_systemd("READY=1\nSTATUS=listening on " + host + ":" +
                                             std::to_string(server->port()));
      !error.empty()) {
    options.log("cannot tell systemd that the daemon is ready: " + error);
  }
  io.run();
  if (election) {
    election->stop();
    io.restart();
    io.poll();  // the election's last log lines (posted), e.g. the revoked lease
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"ddp-rendezvous: the ddplaunch rendezvous daemon"};
  app.set_version_flag("-V,--version", "ddp-rendezvous " DDPLAUNCH_VERSION, "print the version and exit");
  std::string host = "0.0.0.0";
  unsigned short port = 29400;
  std::string token_file;
  std::size_t max_connections = 16384;
  bool quiet = false;
  app.add_option("--host", host, "address to listen on")->capture_default_str();
  app.add_option("--port", port, "TCP port to listen on (0 = any free port)")->capture_default_str();
  app.add_option("--token_file,--token-file", token_file,
                 "file of secrets clients must prove (SECRET for the cluster, JOB_ID SECRET per job); "
                 "default $DDPLAUNCH_RDZV_TOKEN_FILE, else none");
  app.add_option("--max-connections", max_connections, "concurrent connections served")->capture_default_str();
  app.add_flag("--quiet-joins", quiet, "do not log one line per join (large jobs)");
  ddp::rdzv::TlsFiles server_tls;
  app.add_option("--tls_cert,--tls-cert", server_tls.cert,
                 "PEM certificate (chain) of this server: serve TLS only (docs/security.md)");
  app.add_option("--tls_key,--tls-key", server_tls.key, "PEM private key of --tls_cert");
  app.add_option("--tls_client_ca,--tls-client-ca", server_tls.ca,
                 "PEM CA: clients must present a certificate it signed (needs --tls_cert)");
  Observability obs;
  app.add_option("--metrics_port,--metrics-port", obs.metrics_port,
                 "serve Prometheus /metrics, /healthz and /readyz on this port (0 = any free port); default: off");
  app.add_option("--metrics_addr,--metrics-addr", obs.metrics_addr,
                 "address of the metrics server (it has no authentication; docs/metrics.md)")
      ->capture_default_str();
  app.add_option("--event_log,--event-log", obs.event_log,
                 "append one JSON line per lifecycle event to this file ('-' = stderr)");
  app.add_option("--keep_finished,--keep-finished", obs.keep_finished,
                 "seconds a finished job stays listed by status after its last node left (0 = not at all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max_finished,--max-finished", obs.max_finished, "finished jobs listed at most (oldest go first)")
      ->capture_default_str();

  Replication rep;
  app.add_option("--etcd", rep.etcd,
                 "run as one of several replicas on this etcd cluster: http://HOST:PORT,... or https://... "
                 "(docs/etcd.md)");
  app.add_option("--etcd_cacert,--etcd-cacert", rep.cacert,
                 "PEM CA that signed the etcd members' certificates, for https:// endpoints "
                 "(default: the system's trusted CAs)");
  app.add_option("--etcd_cert,--etcd-cert", rep.cert,
                 "PEM client certificate for etcd (etcd --client-cert-auth); needs --etcd_key");
  app.add_option("--etcd_key,--etcd-key", rep.key, "PEM private key of --etcd_cert");
  app.add_option("--etcd_watch,--etcd-watch", rep.watch,
                 "watch the leader key, so that a follower takes over as soon as it is deleted; false: read it "
                 "every TTL/4 only (docs/etcd.md)")
      ->capture_default_str();
  app.add_option("--etcd_lease_ttl,--etcd-lease-ttl", rep.lease_ttl,
                 "seconds of the leader's etcd lease: a dead leader is replaced after about this long")
      ->capture_default_str();
  app.add_option("--etcd_prefix,--etcd-prefix", rep.prefix, "etcd key prefix of this group of replicas")
      ->capture_default_str();
  app.add_option("--etcd_user,--etcd-user", rep.user, "etcd user (needs --etcd_password_file)");
  app.add_option("--etcd_password_file,--etcd-password-file", rep.password_file, "file holding --etcd_user's password");
  app.add_option("--advertise", rep.advertise,
                 "HOST:PORT agents reach this replica at, named to them by followers "
                 "(default: --host and the port; the host name when --host is a wildcard)");

  auto* status = app.add_subcommand("status", "print every job's generation, state, nodes and restarts");
  std::string endpoint = "localhost:29400";
  bool as_json = false;
  double timeout = 10.0;
  bool watch = false;
  double interval = 2.0;
  status->add_option("--endpoint", endpoint, "HOST:PORT of the rendezvous server")->capture_default_str();
  status->add_flag("--json", as_json, "print JSON (with --watch: one JSON document per line)");
  status->add_flag("--watch", watch, "redraw the table every --interval seconds until Ctrl-C");
  status->add_option("--interval", interval, "seconds between redraws with --watch")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  std::string status_job;
  status->add_option("--token_file,--token-file", token_file,
                     "file holding the secret (default $DDPLAUNCH_RDZV_TOKEN_FILE)");
  status->add_option("--job", status_job, "the job whose own secret the token file holds (shows that job only)");
  status->add_option("--timeout", timeout, "seconds to wait for the answer")->capture_default_str();
  ddp::rdzv::TlsFiles status_tls;
  status->add_option("--tls_ca,--tls-ca", status_tls.ca,
                     "PEM CA that signed the server's certificate: speak TLS (default $DDPLAUNCH_RDZV_TLS_CA)");
  status->add_option("--tls_cert,--tls-cert", status_tls.cert,
                     "PEM client certificate, for a server with --tls_client_ca (default $DDPLAUNCH_RDZV_TLS_CERT)");
  status->add_option("--tls_key,--tls-key", status_tls.key, "PEM key of --tls_cert (default $DDPLAUNCH_RDZV_TLS_KEY)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  try {
    if (*status) {
      std::string secret;
      if (const std::string path = flag_or_env(token_file, "DDPLAUNCH_RDZV_TOKEN_FILE"); !path.empty()) {
        try {
          secret = ddp::rdzv::read_secret_file(path);
        } catch (const ddp::rdzv::SecretError& e) {
          throw UsageError(e.what());
        }
      }
      std::shared_ptr<ddp::rdzv::TlsContext> tls;
      status_tls.ca = flag_or_env(status_tls.ca, "DDPLAUNCH_RDZV_TLS_CA");
      status_tls.cert = flag_or_env(status_tls.cert, "DDPLAUNCH_RDZV_TLS_CERT");
      status_tls.key = flag_or_env(status_tls.key, "DDPLAUNCH_RDZV_TLS_KEY");
      if (!status_tls.ca.empty() || !status_tls.cert.empty() || !status_tls.key.empty()) {
        try {
          tls = ddp::rdzv::TlsContext::for_client(status_tls);
        } catch (const ddp::rdzv::TlsError& e) {
          throw UsageError(e.what());
        }
      }
      if (watch) return ddp::rdzv::watch_status(endpoint, secret, timeout, status_job, interval, as_json, tls);
      auto result = ddp::rdzv::query_status(endpoint, secret, timeout, status_job, tls);
      if (!result.error.empty()) {
        std::cerr << "ddp-rendezvous status: " << result.error << "\n";
        return result.usage_error ? kExitUsage : kExitConnect;
      }
      try {
        std::cout << (as_json ? result.status.dump(2) + "\n" : ddp::rdzv::format_status(result.status));
      } catch (const nlohmann::json::exception& e) {
        std::cerr << "ddp-rendezvous status: " << endpoint << " sent a malformed status: " << e.what() << "\n";
        return kExitConnect;
      }
      return kExitOk;
    }
    if (obs.metrics_port > 65535 || obs.metrics_port < -1) throw UsageError("--metrics_port: not a port (0-65535)");
    return serve(host, port, token_file, max_connections, quiet, server_tls, obs, rep);
  } catch (const UsageError& e) {
    std::cerr << "ddp-rendezvous: " << e.what() << "\n";
    return kExitUsage;
  }
}
