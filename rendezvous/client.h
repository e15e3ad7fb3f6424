// The agent's TCP client of a rendezvous server.
//
// Created by the agent (through Client::create) on the agent's io_context, and owned by it
// through a shared_ptr; pending operations keep it alive until close(). Every call and every
// callback happens on that io_context's thread. After close() or an on_error callback the
// client says nothing more.
//
// Typical use (agent/remote_rendezvous.*):
//   auto c = Client::create(io, options, events);
//   c->connect(*parse_endpoint("10.0.0.1:29400"), join_timeout);  // retries until the deadline
//   c->join(spec);                                 // sent once the server welcomed us
//   ... on_round -> start workers; report_failure()/report_success(); on_restart -> join() again
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio.hpp>

#include "rendezvous/endpoint.h"
#include "rendezvous/protocol.h"
#include "rendezvous/resume.h"
#include "rendezvous/stream.h"
#include "rendezvous/types.h"

namespace ddp::rdzv {

struct ClientOptions {
  std::string job_id;                  // --rdzv_id, sent in hello
  std::string token;                   // the job's or cluster's secret (--rdzv_conf token_file=),
                                       // proven by HMAC, never sent; empty = none
  double heartbeat_interval = 1.0;     // replaced by the NodeSpec's timeouts at join()
  double heartbeat_timeout = 5.0;      // the server silent this long = error (replaced at join())
  std::size_t max_frame_bytes = kDefaultMaxFrameBytes;
  double max_retry_delay = 1.0;        // cap of the jittered connect backoff (s)
  // A refused connection ends the attempt at once (on_disconnected) instead of being
  // retried until the deadline: a leader named by a follower that refuses has died. Default off.
  bool give_up_when_refused = false;
  // A connected peer must send a rendezvous challenge within this (s), else the attempt counts as
  // failed ("is another service listening there?") and is retried until the connect deadline.
  // A peer that sends anything else is refused at once (on_error): it is not a rendezvous server.
  double greeting_timeout = 3.0;
  // TLS (docs/security.md): the server's certificate is checked against this context's CA and
  // the endpoint's host. Null (default) = plain TCP.
  std::shared_ptr<TlsContext> tls;
};

struct ClientEvents {
  // What each heartbeat tells of the node's workers (status shows it); none when unset or empty.
  std::function<std::optional<NodeProgress>()> progress;
  std::function<void(const Assignment&)> on_round;
  // `failing`: the job is failing; stop the workers and wait for its verdict (job_failed).
  std::function<void(const std::string& reason, bool counted, bool failing, bool failure)> on_restart;
  std::function<void()> on_job_succeeded;
  std::function<void(const WorkerFailure& first_failure, const std::string& summary)> on_job_failed;
  // Connection refused past the deadline, closed, server silent, version or token mismatch,
  // refused join or round, join timeout. The client is closed when this fires.
  std::function<void(const std::string& message)> on_error;
  // When set, losing the connection (cannot connect before the deadline, closed by
  // the peer, server silent past heartbeat_timeout, a failed send) fires this instead of
  // on_error, so that the owner can reconnect and resume. Refusals still go to on_error.
  std::function<void(const std::string& message)> on_disconnected;
  // An operator drained this node (ddp-rendezvous drain): it is out of the job for good. The
  // client is closed when this fires. Unset: handled as on_error.
  std::function<void(const std::string& message)> on_drained;
  // The server is a follower replica (not_leader, after its welcome): connect to
  // `leader` ("" = none known) instead. The client is closed when this fires. Unset: handled
  // as on_disconnected.
  std::function<void(const std::string& leader, const std::string& message)> on_redirect;
  // The server let the round go on after a resume (no restart).
  std::function<void(std::uint64_t generation, int restart_count)> on_resumed;
  // Progress worth a log line ("connect to rendezvous ...: Connection refused (retrying for 598 s)").
  std::function<void(const std::string& message)> on_log;
  // How many nodes of the job wait, and how long is left (while the job gathers).
  // When set, join() asks the server for these (NodeSpec::progress).
  std::function<void(const Waiting& waiting)> on_waiting;
};

class Client : public std::enable_shared_from_this<Client> {
 public:
  static std::shared_ptr<Client> create(boost::asio::io_context& io, ClientOptions options, ClientEvents events);

  // Connects to `endpoint`, retrying refused or failed connections until `timeout_s` has passed,
  // then says hello. REQUIRES: called once. Errors arrive through on_error, an endpoint that
  // cannot be connected to (no port, port 0: rdzv::connect_error) among them.
  void connect(const Endpoint& endpoint, double timeout_s);
  // Joins (or rejoins after on_restart) the job. Before the server's welcome the join is queued.
  // An empty spec.addr is filled with the local address of the connection (MASTER_ADDR must be
  // reachable; never reverse DNS); an empty spec.job_id with options.job_id.
  void join(NodeSpec spec);
  // Resumes the round this node ran before its previous connection went away.
  // Queued until the server's welcome, like join().
  void resume(ResumeRequest request);
  // The per-node secret the server sent with the last round ("" before any round).
  const std::string& secret() const { return secret_; }
  // The job's goodput line the server sent with its verdict (to one node of the job only); empty
  // when none came.
  const std::string& goodput() const { return goodput_; }
  // The last restart or job_failed said that another node of the job prints its reason in full.
  bool quiet() const { return quiet_; }
  // Before the server's welcome these are queued and sent after the resume or join.
  void report_failure(const WorkerFailure& failure);
  void report_success();
  // The node's workers stalled (a stall message). Dropped, not queued, before the welcome: a
  // stall is news only while it lasts.
  void report_stall(double stalled_for);
  // Leaves the job (the server does not count it as a lost node to restart) and closes.
  void close();

  bool connected() const { return welcomed_; }
  // Connection attempts made so far, and the error of the last failed one ("" when none).
  int attempts() const { return attempts_; }
  const std::string& last_connect_error() const { return last_connect_error_; }
  // Why the host name did not resolve when that ended the last attempt ("" otherwise).
  const std::string& resolve_error() const { return resolve_error_; }
  // The local address of the connection ("" before it is connected).
  std::string local_address() const;

  // Use create().
  Client(boost::asio::io_context& io, ClientOptions options, ClientEvents events);

 private:
  void try_connect();
  void retry(const std::string& error, bool refused = false);
  void on_connected();
  void read_more();
  void handle(Message& message);
  void on_challenge(const Challenge& challenge);
  void on_welcome(const Welcome& welcome);
  void on_not_leader(const std::string& leader);
  void on_error_message(const ErrorMessage& error);
  void check_peer(const CheckPeer& check);
  void send(const Message& message);
  void send_frame(Frame frame);
  bool identify(const char* data, std::size_t n);
  void write_next();
  void heartbeat();
  void fail(const std::string& message, bool lost = false);
  void shutdown();
  double seconds_left() const;

  boost::asio::io_context& io_;
  ClientOptions options_;
  ClientEvents events_;
  boost::asio::ip::tcp::resolver resolver_;
  boost::asio::ip::tcp::socket socket_;     // connecting; then moved into stream_
  std::unique_ptr<Stream> stream_;          // the connection, once connected (plain or TLS)
  boost::asio::steady_timer retry_timer_;
  boost::asio::steady_timer heartbeat_timer_;
  std::string host_;
  std::string port_;
  std::string endpoint_text_;  // HOST:PORT as connected to, for every message
  std::chrono::steady_clock::time_point deadline_;
  std::chrono::steady_clock::time_point last_heard_;
  bool silence_seen_ = false;  // the last look found heartbeat_timeout passed (heartbeat())
  // The progress the last heartbeat carried, and when: a heartbeat carries it when it changed,
  // at most every kProgressEvery, so that a daemon of many nodes parses little more than before.
  // After a round came, until the workers report a step of their own, every heartbeat carries
  // what changed: the daemon's goodput account learns when the round's training began, and from
  // which step, within a heartbeat interval (docs/goodput.md).
  std::optional<NodeProgress> progress_sent_;
  std::chrono::steady_clock::time_point progress_sent_at_;
  static constexpr std::chrono::seconds kProgressEvery{static_cast<int>(kProgressReportSeconds)};
  bool round_started_ = false;
  std::int64_t round_first_step_ = -1;  // the step the heartbeats carried when the round came
  double retry_delay_ = 0.05;
  std::chrono::steady_clock::time_point last_retry_log_{};
  bool welcomed_ = false;
  bool served_ = false;  // the server sent something after its welcome: it led
  bool closed_ = false;
  bool finished_ = false;  // the job succeeded or failed: a close is expected
  std::optional<NodeSpec> pending_join_;
  std::optional<ResumeRequest> pending_resume_;
  std::vector<Message> pending_reports_;  // failure/success said before the welcome
  std::string secret_;
  std::string goodput_;  // the verdict's goodput line (goodput())
  bool quiet_ = false;   // quiet()
  bool connect_timed_out_ = false;   // the connect deadline cut the attempt in flight short
  std::string last_connect_error_;
  std::string resolve_error_;
  int attempts_ = 0;
  int checks_in_flight_ = 0;  // check_peer connections being tried (at most kMaxChecksInFlight)
  static constexpr int kMaxChecksInFlight = 8;
  // Identification of the peer (check_server_start): what it sent before it proved to be a
  // rendezvous server, and until when it may take to say so.
  bool identified_ = false;
  std::string start_bytes_;
  std::chrono::steady_clock::time_point greeting_deadline_;
  FrameReader reader_;
  std::vector<char> rbuf_ = std::vector<char>(4096);
  std::string payload_;
  std::string server_nonce_;
  std::string client_nonce_;
  std::string seal_key_;  // seals this node's secret on this connection (auth.h); "" without a token
  std::deque<Frame> queue_;
  bool writing_ = false;
  bool close_when_flushed_ = false;
};

}  // namespace ddp::rdzv
