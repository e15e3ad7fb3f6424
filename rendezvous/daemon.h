// The ddp-rendezvous daemon's wiring, behind its thin main (rendezvous/main.cpp): what the
// command line gives (options), and the two commands it runs. `serve` builds the server on one
// io_context with its TLS, secrets, event log, metrics endpoint, etcd replica, signals and
// systemd notifications, and runs it until SIGINT or SIGTERM; `status` asks a running daemon for
// its jobs and prints them. docs/cli.md describes the flags, docs/metrics.md and docs/etcd.md
// what they turn on.
//
// Both commands run on the calling thread (main's) and return an exit code; a bad flag value is
// a LaunchError carrying its exit code (rendezvous/error.h), caught once in main.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "rendezvous/endpoint.h"
#include "rendezvous/error.h"
#include "rendezvous/stream.h"

namespace ddp::rdzv {

// Where and how the daemon listens.
struct ListenOptions {
  std::string host = "0.0.0.0";                        // --host: an IP address
  unsigned short port = kDefaultRendezvousPort;        // --port; 0 = any free port
  std::string token_file;                              // --token_file; default $DDPLAUNCH_RDZV_TOKEN_FILE
  std::size_t max_connections = 16384;                 // --max-connections
  bool quiet_joins = false;                            // --quiet-joins: no log line per join
  unsigned writer_threads = 0;                         // --writer_threads; 0 = default_writer_threads()
  std::size_t max_unauthenticated = 0;                 // --max_unauthenticated; 0 = ServerOptions' default
  TlsFiles tls;                                        // --tls_cert, --tls_key, --tls_client_ca; none = plain
};

// Metrics, events and how long finished jobs stay listed.
struct Observability {
  int metrics_port = -1;                   // --metrics_port; -1 (default) = no metrics server
  std::string metrics_addr = "127.0.0.1";  // --metrics_addr
  std::string event_log;                   // --event_log; "" (default) = none, "-" = stderr
  double keep_finished = 600;              // --keep_finished seconds
  std::size_t max_finished = 256;          // --max_finished
};

// Replicas on etcd (docs/etcd.md).
struct Replication {
  std::string etcd;                               // --etcd: comma-separated endpoints; "" = a lone daemon
  int lease_ttl = 5;                              // --etcd_lease_ttl seconds (2..600)
  std::string prefix = "/ddplaunch/rendezvous/";  // --etcd_prefix
  std::string user;                               // --etcd_user; "" = none
  std::string password_file;                      // --etcd_password_file (needed with a user)
  std::string advertise;                          // --advertise HOST:PORT; default --host (or the host name)
  std::string cacert;                             // --etcd_cacert: CA of etcd's certificates ("" = the system's)
  std::string cert;                               // --etcd_cert: client certificate (--client-cert-auth)
  std::string key;                                // --etcd_key: its key
  bool watch = true;                              // --etcd_watch: watch the leader key (else reads only)
};

struct DaemonOptions {
  ListenOptions listen;
  Observability observability;
  Replication replication;
};

// How the status and drain commands reach a daemon.
struct ServerAccess {
  std::string endpoint = "localhost:" + std::to_string(kDefaultRendezvousPort);  // --endpoint
  double timeout = 10.0;             // --timeout seconds to wait for each answer
  std::string token_file;            // --token_file; default $DDPLAUNCH_RDZV_TOKEN_FILE
  TlsFiles tls;                      // --tls_ca, --tls_cert, --tls_key; default $DDPLAUNCH_RDZV_TLS_*
};

// `ddp-rendezvous status`.
struct StatusOptions {
  ServerAccess server;
  bool json = false;                 // --json
  bool watch = false;                // --watch: redraw until Ctrl-C
  double interval = 2.0;             // --interval seconds between redraws (0.1..3600)
  std::string job;                   // --job: the job whose own secret the token file holds
};

// `ddp-rendezvous drain JOB NODE`.
struct DrainOptions {
  ServerAccess server;
  std::string job;                   // JOB: the job's --rdzv_id
  std::string node;                  // NODE: its host or group rank, as status shows it
  bool force = false;                // --force: even if fewer than MIN nodes are left
};

// Serves until SIGINT or SIGTERM; returns DaemonExit::ok then. Throws LaunchError when a flag's
// value is bad (usage) or the port cannot be bound (connect).
int serve(const DaemonOptions& options);

// Queries the daemon at options.endpoint and prints its jobs (or, with watch, redraws them until
// SIGINT or SIGTERM). Returns the exit code (a daemon that cannot be reached or answers badly:
// connect, said on stderr); throws LaunchError for a bad flag value.
int status(StatusOptions options);

// Asks the daemon to drain options.node from options.job and says what it did. Returns ok,
// refused (the daemon's reason on stderr) or connect; throws LaunchError for a bad flag value.
int drain(DrainOptions options);

}  // namespace ddp::rdzv
