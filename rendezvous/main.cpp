// ddp-rendezvous: the rendezvous daemon (serve), its status query and drain. Parses the command line
// into DaemonOptions, StatusOptions or DrainOptions and runs the command (rendezvous/daemon.h).
// Exit codes (DaemonExit): 0 ok, 2 usage, 3 cannot bind or connect.
#include <csignal>
#include <iostream>

#include <CLI/CLI.hpp>

#include "rendezvous/daemon.h"

// The CMake project version (rendezvous/CMakeLists.txt), the same one `ddplaunch --version` prints.
#ifndef DDPLAUNCH_VERSION
#define DDPLAUNCH_VERSION "unknown"
#endif

namespace {

using ddp::rdzv::DaemonOptions;
using ddp::rdzv::DrainOptions;
using ddp::rdzv::ServerAccess;
using ddp::rdzv::StatusOptions;

// The option table of the daemon itself.
void add_serve_options(CLI::App& app, DaemonOptions& o) {
  ddp::rdzv::ListenOptions& l = o.listen;
  app.add_option("--host", l.host, "address to listen on")->capture_default_str();
  app.add_option("--port", l.port, "TCP port to listen on (0 = any free port)")->capture_default_str();
  app.add_option("--token_file,--token-file", l.token_file,
                 "file of secrets clients must prove (SECRET for the cluster, JOB_ID SECRET per job); "
                 "default $DDPLAUNCH_RDZV_TOKEN_FILE, else none");
  app.add_option("--max-connections", l.max_connections, "concurrent connections served")->capture_default_str();
  app.add_flag("--quiet-joins", l.quiet_joins, "do not log one line per join (large jobs)");
  app.add_option("--writer_threads,--writer-threads", l.writer_threads,
                 "threads that write a restart to a large job's nodes (0 = as many as cores, at most 4)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  app.add_option("--max_unauthenticated,--max-unauthenticated", l.max_unauthenticated,
                 "connections that have not said hello yet; past this the oldest is closed (0 = 4096)")
      ->capture_default_str();
  app.add_option("--tls_cert,--tls-cert", l.tls.cert,
                 "PEM certificate (chain) of this server: serve TLS only (docs/security.md)");
  app.add_option("--tls_key,--tls-key", l.tls.key, "PEM private key of --tls_cert");
  app.add_option("--tls_client_ca,--tls-client-ca", l.tls.ca,
                 "PEM CA: clients must present a certificate it signed (needs --tls_cert)");
  ddp::rdzv::Observability& obs = o.observability;
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
  ddp::rdzv::Replication& rep = o.replication;
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
                 "watch the leader key, so that a follower takes over as soon as it is deleted, and at once from a "
                 "leader whose port refuses connections; false: read it every TTL/4 only (docs/etcd.md)")
      ->capture_default_str();
  app.add_option("--etcd_lease_ttl,--etcd-lease-ttl", rep.lease_ttl,
                 "seconds of the leader's etcd lease: a leader whose host died or was cut off is replaced after "
                 "about this long (a killed leader process at once, docs/etcd.md)")
      ->capture_default_str();
  app.add_option("--etcd_prefix,--etcd-prefix", rep.prefix, "etcd key prefix of this group of replicas")
      ->capture_default_str();
  app.add_option("--etcd_user,--etcd-user", rep.user, "etcd user (needs --etcd_password_file)");
  app.add_option("--etcd_password_file,--etcd-password-file", rep.password_file, "file holding --etcd_user's password");
  app.add_option("--advertise", rep.advertise,
                 "HOST:PORT agents reach this replica at, named to them by followers "
                 "(default: --host and the port; the host name when --host is a wildcard)");
}

// The options of status and drain that reach the daemon; `token_help` says whose secret counts.
void add_server_access_options(CLI::App& command, ServerAccess& o, const std::string& token_help) {
  command.add_option("--endpoint", o.endpoint, "HOST:PORT of the rendezvous server")->capture_default_str();
  command.add_option("--token_file,--token-file", o.token_file, token_help + " (default $DDPLAUNCH_RDZV_TOKEN_FILE)");
  command.add_option("--timeout", o.timeout, "seconds to wait for the answer")->capture_default_str();
  command.add_option("--tls_ca,--tls-ca", o.tls.ca,
                     "PEM CA that signed the server's certificate: speak TLS (default $DDPLAUNCH_RDZV_TLS_CA)");
  command.add_option("--tls_cert,--tls-cert", o.tls.cert,
                     "PEM client certificate, for a server with --tls_client_ca (default $DDPLAUNCH_RDZV_TLS_CERT)");
  command.add_option("--tls_key,--tls-key", o.tls.key, "PEM key of --tls_cert (default $DDPLAUNCH_RDZV_TLS_KEY)");
}

// The option table of `status`.
void add_status_options(CLI::App& status, StatusOptions& o) {
  add_server_access_options(status, o.server, "file holding the secret");
  status.add_flag("--json", o.json, "print JSON (with --watch: one JSON document per line)");
  status.add_flag("--watch", o.watch, "redraw the table every --interval seconds until Ctrl-C");
  status.add_option("--interval", o.interval, "seconds between redraws with --watch")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  status.add_option("--job", o.job, "the job whose own secret the token file holds (shows that job only)");
}

// The option table of `drain`.
void add_drain_options(CLI::App& drain, DrainOptions& o) {
  drain.add_option("job", o.job, "the job's --rdzv_id")->required();
  drain.add_option("node", o.node, "the node to drain: its host, or its group rank, as status shows it")->required();
  drain.add_flag("--force", o.force, "drain even if the job is left with fewer than its minimum nodes");
  add_server_access_options(drain, o.server, "file holding the cluster secret or the job's own");
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"ddp-rendezvous: the ddplaunch rendezvous daemon"};
  app.set_version_flag("-V,--version", "ddp-rendezvous " DDPLAUNCH_VERSION, "print the version and exit");
  DaemonOptions daemon;
  add_serve_options(app, daemon);
  StatusOptions status;
  CLI::App* status_command = app.add_subcommand("status", "print every job's generation, state, nodes and restarts");
  add_status_options(*status_command, status);
  DrainOptions drain;
  CLI::App* drain_command =
      app.add_subcommand("drain", "take a node out of a running job: it stops and exits 0, a waiting node takes its place");
  add_drain_options(*drain_command, drain);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return static_cast<int>(rc == 0 ? ddp::DaemonExit::ok : ddp::DaemonExit::usage);
  }
  try {
    if (*status_command) {
      // A --token_file given before `status` counts for it too.
      if (status.server.token_file.empty()) status.server.token_file = daemon.listen.token_file;
      return ddp::rdzv::status(status);
    }
    if (*drain_command) {
      if (drain.server.token_file.empty()) drain.server.token_file = daemon.listen.token_file;
      return ddp::rdzv::drain(drain);
    }
    return ddp::rdzv::serve(daemon);
  } catch (const ddp::LaunchError& e) {
    std::cerr << e.what() << "\n";
    return e.exit_code();
  }
}
