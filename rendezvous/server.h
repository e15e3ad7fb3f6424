// The rendezvous server: an acceptor, its sessions and the state machine, on one io_context.
//
// Embeddable: the ddp-rendezvous daemon runs one on its own io_context, and an agent can host
// one in-process on the agent's io_context. Owned by whoever creates it; lives until stop() or
// destruction. Every call and every handler runs on the io_context's (single) thread, so the
// state machine and the session table need no locks. Signals are the owner's business (the
// daemon's main installs them); the server installs none.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio.hpp>

#include "rendezvous/auth.h"
#include "rendezvous/clock.h"
#include "rendezvous/session.h"
#include "rendezvous/state.h"

namespace ddp::rdzv {

// Up to 4 (a broadcast's sends gain little past that), no more than the machine's cores.
unsigned default_writer_threads();

struct ServerOptions {
  // The secrets clients must prove (HMAC challenge-response, rendezvous/auth.h). `token` is a
  // cluster secret; `secrets` may add per-job ones. Both empty (default): every client is accepted.
  std::string token;
  Secrets secrets;
  std::size_t max_frame_bytes = kDefaultMaxFrameBytes;  // per frame payload (default 1 MiB)
  std::size_t max_connections = 16384;              // more are answered with an error and closed
  std::size_t max_unauthenticated = 4096;           // connections that have not said hello; past
                                                    // this the oldest of them is closed (accepting
                                                    // never pauses: a flood cannot queue honest
                                                    // agents behind it). As many as the kernel's
                                                    // default listen backlog: a storm of agents the
                                                    // backlog holds is accepted without closing any
  std::size_t max_queued_bytes = 16u << 20;         // per connection; a peer that never reads is cut off
  double hello_timeout = 5.0;                       // a connection must say hello within this (s)
  double idle_timeout = 60.0;                       // after hello, before join: dropped when silent (s)
  double tick_interval = 0.01;                      // how often deadlines are checked (s)
  // Threads that write a broadcast to many nodes at once (rendezvous/fanout.h), the server's
  // own included; 1 = the server's thread alone. The state machine stays on one thread.
  unsigned writer_threads = default_writer_threads();
  std::function<void(const std::string&)> log;      // one line per event; empty = silent
  RoundCheck round_check;                           // the environment check (rendezvous/env_check.h)
  std::shared_ptr<TlsContext> tls;                  // TLS for every connection; null (default) = plain TCP
  // The state machine's lifecycle events (event log, metrics); empty = none.
  std::function<void(const metrics::Event&)> on_event;
  Retention retention;                              // finished jobs kept in status
  // One replica of several (--etcd): starts as a follower until set_leadership(true).
  // false (default): a lone daemon, always leading.
  bool replicated = false;
  // Where a leader's job records go (docs/etcd.md "Job records"): the election thread writes
  // them to etcd and answers with records_written(). While a write is in flight, what the
  // state machine says to agents waits for it. Empty (default): nothing is written.
  std::function<void(RecordWrite)> write_records;
  // A follower told an agent that proved itself `not_leader` naming `leader`, on this server's
  // thread (the election may check that leader: Election::redirected). Empty (default): nothing.
  std::function<void(const std::string& leader)> on_redirect;
};

class Server : private SessionHandler, private Outbox {
 public:
  // Binds and listens on `endpoint` (port 0 = any free port; see port()) and starts serving.
  // Throws boost::system::system_error when it cannot bind.
  Server(boost::asio::io_context& io, const boost::asio::ip::tcp::endpoint& endpoint, ServerOptions options);
  ~Server() override;
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The bound endpoint (the real port when constructed with port 0).
  boost::asio::ip::tcp::endpoint local_endpoint() const { return bound_; }
  unsigned short port() const { return bound_.port(); }
  // Closes the acceptor and every connection; pending handlers finish on the io_context.
  void stop();

  // Whether this replica leads (rendezvous/election.*); else the leader's HOST:PORT
  // ("" = none known). A follower welcomes agents, then answers not_leader and closes. Losing
  // leadership sends not_leader to every connection, closes it and forgets every job: the next
  // leader rebuilds them from the agents' resumes, and this replica holds no stale state if it
  // leads again later.
  // `records` (key, value), when given with leading, are the job records read from etcd as this
  // replica took the lead: each is validated (decode_record; a corrupt one is logged and
  // skipped) and loaded into the state machine before anything is served.
  void set_leadership(bool leading, const std::string& leader,
                      const std::vector<std::pair<std::string, std::string>>* records = nullptr);
  // The outcome of the write numbered `seq`: error "" = committed (what waited for it goes out),
  // else this replica steps down and what waited is dropped.
  void records_written(std::uint64_t seq, const std::string& error);
  std::uint64_t record_transactions() const { return record_txns_; }
  bool leading() const { return leading_; }
  const std::string& leader() const { return leader_; }

  const StateMachine& state() const { return *state_; }
  // Every job's status as a `status` request of the cluster secret gets it (StateMachine::status(),
  // plus "replica" on a replicated daemon): what `ddp-rendezvous status --json` prints.
  nlohmann::json status() const;
  bool serving() const { return !stopped_; }
  std::size_t connection_count() const { return sessions_.size(); }
  std::size_t unauthenticated_count() const { return unauthenticated_; }

 private:
  void accept();
  // Closes the oldest connections that have not said hello until at most max_unauthenticated
  // remain (the newest, just accepted, is kept).
  void evict_unauthenticated();
  void tick();
  void on_message(Session& session, Message message) override;
  void on_bad_message(Session& session, const ProtocolError& error) override;
  void on_closed(Session& session, const std::string& why) override;
  void on_deadline(Session& session) override;
  void send(ConnId to, const Frame& frame) override;
  void broadcast(const std::vector<ConnId>& to, const Frame& frame) override;
  void drop(ConnId conn, const std::string& code, const std::string& message) override;
  void log(const std::string& line) override;
  void event(const metrics::Event& event) override;
  void handle_first(Session& session, const Message& message);
  void handle(Session& session, Message& message);
  void send_status(Session& session);
  void handle_drain(Session& session, const Drain& drain);
  void end_member(Session& session, const std::string& code, const std::string& message);
  void handle_resume(Session& session, ResumeRequest& request);
  void make_state();
  // After every call into the state machine: collects the changed jobs' records and lets what
  // the call said go out now, or after the write that carries its changes.
  void settle();
  void start_write();
  struct Outgoing {
    std::uint64_t after = 0;  // the write that must commit first; 0 = none
    ConnId conn = 0;
    Frame frame;
    bool drop = false;
    std::string code, message;
  };
  void deliver(const Outgoing& o);

  boost::asio::io_context& io_;
  ServerOptions options_;
  Secrets secrets_;
  SteadyClock clock_;
  std::optional<StateMachine> state_;  // replaced when leadership is lost
  bool leading_ = true;
  std::string leader_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::ip::tcp::endpoint bound_;
  boost::asio::steady_timer tick_timer_;
  boost::asio::steady_timer accept_retry_timer_;
  SessionManager sessions_;
  std::size_t unauthenticated_ = 0;
  double last_tick_ = -1;  // when tick() last ran (SteadyClock seconds); -1: never
  // Sessions in the order they were accepted, oldest first, for eviction; entries of sessions
  // that said hello or closed since are skipped when they reach the front.
  std::deque<std::uint64_t> unauthenticated_order_;
  std::size_t evicted_unlogged_ = 0;  // evictions not yet said in the log (one line a second)
  double eviction_logged_at_ = -1e9;
  bool accepting_ = false;
  bool stopped_ = false;
  std::uint64_t next_id_ = 1;
  Frame heartbeat_ack_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  // What waits for job records to be written (empty unless options_.write_records).
  std::vector<Outgoing> staged_;                               // said by the current call
  std::deque<Outgoing> held_;                                  // waiting for their write, in order
  std::map<std::string, std::optional<std::string>> unwritten_;  // job -> record (nullopt = delete)
  std::uint64_t next_write_ = 1;
  std::uint64_t in_flight_ = 0;  // the write being made; 0 = none
  std::uint64_t record_txns_ = 0;
};

}  // namespace ddp::rdzv
