// The multi-node rendezvous as the agent sees it: the TCP client of rendezvous/ behind the
// agent's RendezvousHandler interface. With `--rdzv_backend=c10d` and an endpoint on this host
// where nothing listens yet, the first agent hosts the server in-process (as torchrun's c10d
// backend does); `--standalone` hosts one on a free loopback port.
//
// Owned by the Agent; lives as long as the agent run; every call and callback on the agent's
// io_context thread. A hosted server lives as long as this object, which is why the hosting
// agent stays until the job has ended on every node (it exits on on_job_succeeded/failed).
//
// There may be several endpoints (--rdzv_endpoint=head:29400,standby:29400). Losing the
// connection does not stop the workers: the agent reconnects through every endpoint in turn,
// with jittered backoff, for up to reconnect_timeout, and resumes its round
// (rendezvous/resume.h) with the secret the server issued; worker failures and successes that
// happen meanwhile are kept and sent after the resume. Only when reconnect_timeout passes does
// on_rendezvous_error fire (exit 3). An agent whose host appears in the list hosts a standby
// server on the first of its local endpoints that is free, so survivors can resume there when
// the host dies.
//
// With --rdzv_backend=etcd / etcd-v2 (docs/etcd.md "Agents on etcd") and `etcd_replica`,
// the agent hosts a replica of its job's rendezvous (rdzv::Replica) on a free port of its node
// address and uses it as its only endpoint; the replica redirects the agent to whichever replica
// of the job leads, and when the leader's node dies another agent's replica takes over.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "agent/progress_line.h"
#include "agent/rendezvous_handler.h"
#include "rendezvous/error.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/etcd.h"

namespace ddp::metrics {
class EventSink;
}  // namespace ddp::metrics

namespace ddp::rdzv {
class Client;
struct ClientEvents;
struct ClientOptions;
class Replica;
class Server;
struct ServerOptions;
struct Waiting;
class TlsContext;
}  // namespace ddp::rdzv

namespace ddp::agent {

// The replica an agent hosts with --rdzv_backend=etcd / etcd-v2.
struct EtcdReplicaOptions {
  rdzv::EtcdOptions etcd;
  std::string prefix;          // the job's keys: PREFIX + "leader", PREFIX + "jobs/"
  int lease_ttl = 5;           // seconds of the leader's lease; default 5
  std::string listen_addr;     // IP address to listen on (port: a free one)
  std::string advertise_host;  // HOST in the leader key (HOST:PORT); other agents reach it there
};

struct RemoteRendezvousOptions {
  std::vector<rdzv::Endpoint> endpoints;  // the rendezvous, then its standbys, tried in order;
                                         // empty with `standalone` and `etcd_replica`
  std::string job_id;            // --rdzv_id
  std::string token;             // shared token, empty = none
  std::shared_ptr<rdzv::TlsContext> tls;  // TLS to the rendezvous; null = plain TCP. With it the
                                          // agent never hosts a server in-process (plain only);
                                          // --standalone ignores it (its own loopback server)
  double connect_timeout = 600;  // seconds to keep retrying a refused connection (join_timeout)
  double reconnect_timeout = 60; // after losing a connection, seconds to find a rendezvous again
  bool standalone = false;       // host a server on a free loopback port and use it
  bool host_if_local = true;     // host the server when the endpoint is this host and it is free
  std::function<void(const std::string&)> log;  // event lines; empty = stderr
  // Where every wait shows what it waits for and how long is left (connecting,
  // nodes joined out of MIN/MAX, the last call, reconnecting). Null (default): not shown.
  ProgressLine* progress = nullptr;
  // The hosted server's event log (joins, rounds, losses) goes to `log`. Default off:
  // the agent's own lines say what matters; environment differences (--env_check=warn) are
  // always shown.
  bool echo_server_log = false;
  // Host a replica of the job's rendezvous on etcd and use it (`endpoints` unused).
  // Unset (default): no replica.
  std::optional<EtcdReplicaOptions> etcd_replica;
  // Where a server this agent hosts records its events (the dashboard's timeline with
  // --metrics_port, docs/dashboard.md). Null (default): nowhere.
  std::shared_ptr<metrics::EventSink> hosted_events;
};

class RemoteRendezvous final : public RendezvousHandler {
 public:
  // Throws LaunchError (exit 2, naming the flag) when the options cannot work: no endpoint, an
  // endpoint that cannot be connected to, port 0 on another host, a replica that cannot listen.
  RemoteRendezvous(boost::asio::io_context& io, RemoteRendezvousOptions options);
  ~RemoteRendezvous() override;

  void set_events(RendezvousEvents events) override;
  void set_progress_source(std::function<std::optional<rdzv::NodeProgress>()> source) override;
  void join(const rdzv::NodeSpec& spec) override;
  void report_failure(const rdzv::WorkerFailure& failure) override;
  void report_success() override;
  bool hears_stalls() const override { return true; }
  void report_stall(double stalled_for) override;
  void close() override;
  bool said_elsewhere() const override;

  // The endpoints actually used (the free port with --standalone).
  const std::vector<rdzv::Endpoint>& endpoints() const { return endpoints_; }
  // The server this agent hosts in-process (known once constructed; never a replica), or null.
  // Lives as long as this object.
  const rdzv::Server* hosted_server() const { return server_.get(); }

 private:
  void start_replica(rdzv::ServerOptions server_options);
  void forget_job_records();
  void start_client();
  // start_client()'s parts: the options of the next connection (TLS, reconnect backoff, whether a
  // refused leader ends the attempt) and the events the client delivers to this handler.
  rdzv::ClientOptions client_options() const;
  rdzv::ClientEvents client_events();
  void on_lost(const std::string& why);
  void on_redirect(const std::string& leader, const std::string& why);
  void log(const std::string& line) const;
  std::string endpoint_list() const;
  void show_progress();
  void arm_progress_timer();
  void end_progress();

  boost::asio::io_context& io_;
  RemoteRendezvousOptions options_;
  RendezvousEvents events_;
  std::function<std::optional<rdzv::NodeProgress>()> progress_source_;
  std::vector<rdzv::Endpoint> endpoints_;
  std::size_t current_ = 0;              // index in endpoints_ of the connection in use
  std::unique_ptr<rdzv::Server> server_;
  std::unique_ptr<rdzv::Replica> replica_;  // etcd backends
  std::shared_ptr<rdzv::Client> client_;
  boost::asio::steady_timer backoff_timer_;
  std::chrono::steady_clock::time_point deadline_;  // of the connect or reconnect in progress
  std::chrono::steady_clock::time_point lost_at_{};  // when the last connection was lost
  std::chrono::steady_clock::time_point round_at_{};  // when round_ came
  std::string lost_endpoint_;
  std::string redirected_to_;            // the leader a follower named last (logged once)
  bool redirected_ = false;              // the next attempt follows a redirect (a short slice)
  bool redirect_attempt_ = false;        // the attempt in progress follows a redirect
  bool reconnecting_ = false;            // lost a connection, looking for a rendezvous
  bool closed_ = false;
  bool finished_ = false;
  // What a resume gives back, and the reports made in this round (re-sent after a resume).
  std::optional<rdzv::NodeSpec> joining_;  // join() called, no round yet
  rdzv::NodeSpec spec_;
  std::optional<rdzv::Assignment> round_;
  std::string secret_;
  std::optional<rdzv::WorkerFailure> reported_failure_;
  bool reported_success_ = false;
  // What the server last said about the wait, when, and the redraw timer.
  std::unique_ptr<rdzv::Waiting> waiting_;
  std::chrono::steady_clock::time_point waiting_at_{};
  boost::asio::steady_timer progress_timer_;
  int reconnect_attempts_ = 0;  // connection attempts since the last loss
  std::chrono::steady_clock::time_point joined_at_{};  // the last join() call
};

// True when `host` names this machine: a loopback address, "localhost", this host's name, or
// an address of one of its interfaces. Never resolves through reverse DNS.
bool is_local_host(const std::string& host);

}  // namespace ddp::agent
