#include "rendezvous/server.h"

#include <algorithm>
#include <thread>

#include "rendezvous/cloexec.h"
#include "rendezvous/fanout.h"
#include "rendezvous/job_record.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;
using nlohmann::json;

namespace {
// A tick this much later than its interval is a stall of the server, whose time no node's
// heartbeat pays for; from a second on it is logged.
constexpr double kStallSeconds = 0.1;
constexpr int kListenBacklog = 65535;
constexpr double kStallLogSeconds = 1.0;

std::string seconds(double s) {
  json j = s;  // shortest round-trip text: "5", "0.3"
  return j.dump() + " s";
}
}  // namespace

Server::Server(asio::io_context& io, const tcp::endpoint& endpoint, ServerOptions options)
    : io_(io),
      options_(std::move(options)),
      secrets_(options_.secrets),
      leading_(!options_.replicated),
      acceptor_(io),
      tick_timer_(io),
      accept_retry_timer_(io),
      heartbeat_ack_(encode(make_heartbeat_ack())) {
  if (!options_.token.empty()) secrets_.set_cluster(options_.token);  // per-job secrets keep precedence
  make_state();
  acceptor_.open(endpoint.protocol());
  close_on_exec(acceptor_.native_handle());
  acceptor_.set_option(tcp::acceptor::reuse_address(true));
  acceptor_.bind(endpoint);
  // As deep as the kernel allows (net.core.somaxconn caps it, 4096 by default): a storm of
  // connects beyond the backlog waits for TCP's SYN retransmission, a second or more.
  acceptor_.listen(kListenBacklog);
  bound_ = acceptor_.local_endpoint();
  accept();
  tick();
}

void Server::make_state() {
  // The environment check (rendezvous/env_check.h) runs unless the owner installs its own check.
  state_.emplace(clock_, static_cast<Outbox&>(*this),
                 options_.round_check ? options_.round_check
                                      : make_env_round_check([this](const std::string& line) { log(line); }));
  state_->set_retention(options_.retention);
  state_->set_recording(static_cast<bool>(options_.write_records));
  state_->set_secret_seal([this](ConnId conn, const std::string& secret) {
    const Session* session = sessions_.find(conn);
    return session == nullptr ? std::string() : seal_hex(session->seal_key, secret);
  });
  state_->set_peer_check([this](ConnId conn) {
    Session* session = sessions_.find(conn);
    return session != nullptr && session->peer_acknowledged_all();
  });
  state_->set_peer_port([this](ConnId conn) {
    const Session* session = sessions_.find(conn);
    return session == nullptr ? 0 : session->peer_port();
  });
}

void Server::set_leadership(bool leading, const std::string& leader,
                            const std::vector<std::pair<std::string, std::string>>* records) {
  const bool was_leading = leading_;
  leading_ = leading;
  leader_ = leading ? std::string() : leader;
  if (leading && !was_leading && records) {
    std::size_t loaded = 0;
    for (const auto& [key, value] : *records) {
      auto decoded = decode_record(value);
      if (auto* bad = std::get_if<std::string>(&decoded)) {
        log("etcd: refused the job record " + key + ": " + *bad + " (left in etcd; the job's agents are served "
            "from their resumes as without a record)");
        continue;
      }
      if (state_->load(std::get<JobRecord>(decoded))) ++loaded;
    }
    log("etcd: " + std::to_string(loaded) + " job(s) loaded from " + std::to_string(records->size()) +
        " record(s) before serving as the leader");
  }
  if (!was_leading || leading) return;
  // Stepping down: nobody may be driven by a replica that no longer leads.
  std::size_t closed = 0;
  const Frame redirect = encode(make_not_leader(""));
  sessions_.for_each([&](Session& s) {
    if (!s.authenticated || s.redirected) return;
    s.member = false;
    s.redirected = true;
    s.send(redirect);
    s.close_after_flush();
    ++closed;
  });
  staged_.clear();
  held_.clear();
  unwritten_.clear();
  in_flight_ = 0;
  make_state();
  log("no longer the leader: told " + std::to_string(closed) + " connection(s) not_leader and forgot every job");
}

Server::~Server() {
  *alive_ = false;
  stop();
}

void Server::stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  tick_timer_.cancel();
  accept_retry_timer_.cancel();
  sessions_.stop_all();
}

void Server::accept() {
  if (stopped_ || accepting_) return;
  accepting_ = true;
  acceptor_.async_accept([this, alive = alive_](boost::system::error_code ec, tcp::socket socket) {
    if (!*alive) return;
    accepting_ = false;
    if (stopped_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of file descriptors or similar: back off instead of spinning, keep serving the others.
      log("accept failed: " + ec.message() + " (retrying in 100 ms)");
      accept_retry_timer_.expires_after(std::chrono::milliseconds(100));
      accept_retry_timer_.async_wait([this, alive](boost::system::error_code e) {
        if (*alive && !e) accept();
      });
      return;
    }
    close_on_exec(socket.native_handle());
    SessionHandler& handler = *this;
    auto session = std::make_shared<Session>(make_server_stream(std::move(socket), options_.tls), next_id_++, handler,
                                             SessionLimits{options_.max_frame_bytes, options_.max_queued_bytes});
    sessions_.add(session);
    ++unauthenticated_;
    unauthenticated_order_.push_back(session->id());
    evict_unauthenticated();
    session->nonce = random_hex();
    session->send(encode(make_challenge(session->nonce)));
    session->start(options_.hello_timeout);
    if (sessions_.size() > options_.max_connections) {
      session->fail("busy", "the rendezvous server is at its limit of " + std::to_string(options_.max_connections) +
                                " connections; try again later");
    }
    accept();
  });
}

void Server::evict_unauthenticated() {
  while (unauthenticated_ > options_.max_unauthenticated && unauthenticated_order_.size() > 1) {
    const std::uint64_t id = unauthenticated_order_.front();
    unauthenticated_order_.pop_front();
    Session* oldest = sessions_.find(id);
    if (oldest == nullptr || oldest->authenticated) continue;  // said hello or closed meanwhile
    // Closed at once, not after an error it may never read: its place is the newcomer's now.
    oldest->close("evicted: " + std::to_string(options_.max_unauthenticated) +
                  " connections had not said hello");
    ++evicted_unlogged_;
  }
  // The entries at the front that no longer count go too, so that the queue stays as long as
  // the connections accepted since the oldest one still waiting for its hello.
  while (!unauthenticated_order_.empty()) {
    const Session* front = sessions_.find(unauthenticated_order_.front());
    if (front != nullptr && !front->authenticated) break;
    unauthenticated_order_.pop_front();
  }
  if (evicted_unlogged_ > 0 && clock_.now() - eviction_logged_at_ >= 1.0) {
    log("closed the oldest of the connections that had not said hello, " + std::to_string(evicted_unlogged_) +
        " time(s): more than max_unauthenticated (" + std::to_string(options_.max_unauthenticated) +
        ") were open at once (a flood, or a slow network)");
    evicted_unlogged_ = 0;
    eviction_logged_at_ = clock_.now();
  }
}

void Server::tick() {
  if (stopped_) return;
  try {
    // A tick far later than its interval means this process did not run meanwhile: the nodes'
    // heartbeats of that time are still unread, and their silence is the server's own.
    const double now = clock_.now();
    const double late = last_tick_ < 0 ? 0 : now - last_tick_ - options_.tick_interval;
    last_tick_ = now;
    if (late > kStallSeconds) {
      if (late >= kStallLogSeconds) {
        log("this server did not run for " + seconds(late) + "; that time does not count against any node's heartbeat");
      }
      state_->stalled(late);
    }
    state_->tick();
  } catch (const std::exception& e) {  // a bug, not input: keep serving the other jobs
    log(std::string("internal error in the deadline check: ") + e.what());
  }
  settle();
  tick_timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.tick_interval)));
  tick_timer_.async_wait([this, alive = alive_](boost::system::error_code ec) {
    if (*alive && !ec) tick();
  });
}

void Server::on_message(Session& session, Message message) {
  // Nothing a client sends may throw out of the event loop: whatever escapes ends this client.
  try {
    if (session.phase() == Session::Phase::Handshake) {
      handle_first(session, message);
    } else {
      handle(session, message);
    }
  } catch (const std::exception& e) {
    log("internal error on a \"" + std::string(to_string(message.type)) + "\" from " + session.peer() + ": " + e.what());
    end_member(session, "internal_error", std::string("the rendezvous server could not handle \"") +
                                              to_string(message.type) + "\": " + e.what());
  }
  settle();
}

void Server::on_bad_message(Session& session, const ProtocolError& error) {
  log("refused " + session.peer() + (session.job_id.empty() ? "" : " (job " + session.job_id + ")") + ": " +
      error.message);
  end_member(session, error.code, error.message);
  settle();
}

// Ends a session; a member's job learns that the node is gone.
void Server::end_member(Session& session, const std::string& code, const std::string& message) {
  if (session.member) state_->disconnected(session.id(), "sent a bad message: " + message);
  session.member = false;
  session.fail(code, message);
}

void Server::handle_first(Session& session, const Message& message) {
  if (message.type == MessageType::greeting && !session.greeted) {
    // Sent by clients the moment they connect (docs/protocol.md); hello follows the challenge.
    session.greeted = true;
    if (auto err = check_greeting(std::get<Greeting>(message.body))) {
      log("refused " + session.peer() + ": " + err->message);
      session.fail(err->code, err->message);
    }
    return;
  }
  if (auto err = check_first_message(message)) {
    log("refused " + session.peer() + ": " + err->message);
    session.fail(err->code, err->message);
    return;
  }
  const Hello& hello = first_hello(message);
  const char* role = to_string(message.type);
  const std::optional<std::string> secret = secrets_.for_job(hello.job_id);
  if (!secret || (!secret->empty() && !proofs_equal(hello.proof, auth_proof(*secret, role, session.nonce,
                                                                           hello.client_nonce, hello.job_id)))) {
    const std::string why = hello.proof.empty() ? "no rendezvous secret proven" : "wrong rendezvous secret";
    log("refused " + session.peer() + (hello.job_id.empty() ? "" : " (job " + hello.job_id + ")") + ": " + why);
    session.fail("bad_token", why + ": give this node the server's secret with --rdzv_conf token_file=PATH "
                                    "(or DDPLAUNCH_RDZV_TOKEN_FILE)");
    return;
  }
  --unauthenticated_;
  session.authenticated = true;
  session.all_jobs = secrets_.is_cluster_secret(hello.job_id);
  session.job_id = hello.job_id;
  session.seal_key = seal_key(*secret, session.nonce, hello.client_nonce, hello.job_id);
  session.set_phase(Session::Phase::Authenticated);
  if (message.type == MessageType::status) {
    send_status(session);
    session.close_after_flush();
    return;
  }
  if (message.type == MessageType::drain) {
    handle_drain(session, std::get<Drain>(message.body));
    return;
  }
  session.set_deadline(options_.idle_timeout);
  session.send(encode(make_welcome(secret->empty() ? std::string()
                                                   : auth_proof(*secret, "server", session.nonce, hello.client_nonce,
                                                                hello.job_id))));
  std::string().swap(session.nonce);  // proven: 80 bytes per connection no longer needed
  if (!leading_) {
    // After the welcome, whose proof tells the agent this follower is genuine.
    session.redirected = true;
    session.send(encode(make_not_leader(leader_)));
    session.close_after_flush();
    if (options_.on_redirect) options_.on_redirect(leader_);
  }
}

nlohmann::json Server::status() const {
  nlohmann::json status = state_->status();
  if (options_.replicated) status["replica"] = {{"leading", leading_}, {"leader", leading_ ? "" : leader_}};
  return status;
}

void Server::send_status(Session& session) {
  nlohmann::json status = this->status();
  if (!session.all_jobs) {  // a job's own secret shows that job only
    nlohmann::json mine = nlohmann::json::array();
    for (auto& job : status["jobs"]) {
      if (job["job_id"] == session.job_id) mine.push_back(std::move(job));
    }
    status["jobs"] = std::move(mine);
  }
  session.send(encode(make_status_reply(std::move(status))));
}

// An operator's drain (ddp-rendezvous drain): answered with `drained` or an error, then closed.
// A follower replica names its leader; a job's own secret drains that job only.
void Server::handle_drain(Session& session, const Drain& drain) {
  if (!leading_) {
    session.send(encode(make_not_leader(leader_)));
    session.close_after_flush();
    return;
  }
  if (!session.all_jobs && drain.job != session.job_id) {
    log("refused a drain of job " + drain.job + " from " + session.peer() + ": it proved job " + session.job_id +
        "'s own secret");
    session.fail("bad_token", "the secret proven is job " + session.job_id + "'s own: it may drain that job only; " +
                                  "give the cluster secret (--token_file) to drain job " + drain.job);
    return;
  }
  const DrainResult result = state_->drain(drain.job, drain.node, drain.force);
  if (!result.code.empty()) {
    log("refused a drain of " + drain.node + " in job " + drain.job + " from " + session.peer() + ": " + result.message);
    session.fail(result.code, result.message);
    return;
  }
  log("drain from " + session.peer() + ": " + result.message);
  session.send(encode(make_drained(Drained{drain.job, result.node, result.message})));
  session.close_after_flush();
}

void Server::handle(Session& session, Message& message) {
  if (session.redirected) return;  // told not_leader: closing
  if (session.member) state_->touch(session.id());
  switch (message.type) {
    case MessageType::heartbeat:
      if (!session.member) session.set_deadline(options_.idle_timeout);
      session.send(heartbeat_ack_);  // first: the progress may take this very node out (a straggler replaced)
      if (const auto& progress = std::get<Heartbeat>(message.body).progress; progress && session.member) {
        state_->progress(session.id(), *progress);
      }
      return;
    case MessageType::join: {
      NodeSpec& spec = std::get<NodeSpec>(message.body);
      if (spec.job_id.empty()) spec.job_id = session.job_id;
      if (spec.job_id != session.job_id) {
        end_member(session, "bad_join", "join names job " + spec.job_id + " but hello named " + session.job_id);
        return;
      }
      if (spec.addr.empty()) spec.addr = session.peer_address();
      session.member = true;
      session.set_deadline(-1);  // the state machine watches its heartbeats from now on
      state_->join(session.id(), std::move(spec));
      return;
    }
    case MessageType::stall:
      if (session.member) state_->stall(session.id(), std::get<Stall>(message.body).stalled_for);
      return;
    case MessageType::peer_alive:
      if (session.member) state_->peer_alive(session.id(), std::get<PeerAlive>(message.body).id);
      return;
    case MessageType::failure:
      state_->report_failure(session.id(), std::get<WorkerFailure>(message.body));
      return;
    case MessageType::success:
      state_->report_success(session.id());
      return;
    case MessageType::leave:
      state_->leave(session.id());
      session.member = false;
      session.close_after_flush();
      return;
    case MessageType::status:
      send_status(session);
      return;
    case MessageType::resume:
      handle_resume(session, std::get<ResumeRequest>(message.body));
      return;
    case MessageType::hello:
      end_member(session, "bad_message", "a second hello on one connection");
      return;
    case MessageType::drain:
      end_member(session, "bad_message", "a drain must be the first message of its own connection");
      return;
    default:
      end_member(session, "bad_message",
                 std::string("\"") + to_string(message.type) + "\" is a message of the server, not of a client");
      return;
  }
}

// An agent that lost its rendezvous gives back its round. The codec validated it whole
// (decode_resume) before the state machine sees it; any error closes this connection only.
void Server::handle_resume(Session& session, ResumeRequest& r) {
  if (r.job_id != session.job_id) {
    end_member(session, "bad_resume", "resume names job " + r.job_id + " but hello named " + session.job_id);
    return;
  }
  if (r.node.addr.empty()) r.node.addr = session.peer_address();
  // The secret came sealed under this connection's key (auth.h), like the round that issued it.
  r.secret = seal_hex(session.seal_key, r.secret);
  r.assignment.secret.clear();  // a copy the client need not send; never compared
  state_->resume(session.id(), r);
  if (state_->is_member(session.id())) {
    session.member = true;
    session.set_deadline(-1);  // the state machine watches its heartbeats from now on
  }
}

void Server::on_closed(Session& session, const std::string& why) {
  // Posted: a session may close from inside a state-machine call (Outbox::send), and the state
  // machine is not re-entrant.
  const std::uint64_t id = session.id();
  const bool member = session.member;
  if (!session.authenticated) {
    session.authenticated = true;  // counted once
    --unauthenticated_;
  }
  asio::post(io_, [this, alive = alive_, id, member, why]() {
    if (!*alive) return;
    sessions_.remove(id);
    if (member) state_->disconnected(id, why);
    settle();
    accept();
  });
}

void Server::on_deadline(Session& session) {
  if (session.authenticated) {
    session.fail("idle_timeout", "no join within " + seconds(options_.idle_timeout) + " after hello");
  } else {
    log("dropped " + session.peer() + ": no hello within " + seconds(options_.hello_timeout));
    session.fail("hello_timeout", "no hello within " + seconds(options_.hello_timeout) +
                                      " of connecting: dropping the connection");
  }
}

void Server::send(ConnId to, const Frame& frame) {
  if (options_.write_records) {
    staged_.push_back(Outgoing{0, to, frame, false, {}, {}});
    return;
  }
  if (Session* s = sessions_.find(to)) s->send(frame);
}

// A job-wide restart to 10,000 nodes is 10,000 sends of one frame: those that can go out at
// once go to write_to_all, which spreads a large one over threads while this one waits (the
// state machine is not re-entered meanwhile); the rest, and every send of a replica, go through
// send().
void Server::broadcast(const std::vector<ConnId>& to, const Frame& frame) {
  if (options_.write_records) {
    for (ConnId conn : to) send(conn, frame);
    return;
  }
  std::vector<Session*> direct;
  std::vector<int> fds;
  for (ConnId conn : to) {
    Session* s = sessions_.find(conn);
    if (!s) continue;
    const int fd = s->direct_fd();
    if (fd < 0) {
      s->send(frame);
    } else {
      direct.push_back(s);
      fds.push_back(fd);
    }
  }
  const std::vector<long> written = write_to_all(fds, frame->data(), frame->size(), options_.writer_threads);
  for (std::size_t i = 0; i < direct.size(); ++i) direct[i]->wrote_directly(frame, written[i]);
}

unsigned default_writer_threads() { return std::clamp(std::thread::hardware_concurrency(), 1u, 4u); }

void Server::drop(ConnId conn, const std::string& code, const std::string& message) {
  Session* s = sessions_.find(conn);
  if (s) s->member = false;  // the state machine has forgotten it already
  if (options_.write_records) {
    staged_.push_back(Outgoing{0, conn, {}, true, code, message});
    return;
  }
  if (s) s->fail(code, message);
}

void Server::deliver(const Outgoing& o) {
  Session* s = sessions_.find(o.conn);
  if (!s) return;
  if (o.drop) {
    s->member = false;
    s->fail(o.code, o.message);
  } else {
    s->send(o.frame);
  }
}

void Server::settle() {
  if (!options_.write_records) return;
  const std::vector<std::string> ids = state_->take_changed();
  for (const std::string& id : ids) {
    std::optional<JobRecord> r = state_->record(id);
    unwritten_[id] = r ? std::optional<std::string>(encode_record(*r)) : std::nullopt;
  }
  if (staged_.empty() && unwritten_.empty()) return;
  // What this call said waits for the write that carries its changes (the one starting now, or
  // the next when one is in flight); with no change of its own, for what was said before it.
  std::uint64_t after = held_.empty() ? 0 : held_.back().after;
  if (!ids.empty()) after = next_write_;  // the write starting now, or the next when one is in flight
  if (!unwritten_.empty() && in_flight_ == 0) start_write();
  for (Outgoing& o : staged_) {
    if (after == 0) {
      deliver(o);
    } else {
      o.after = after;
      held_.push_back(std::move(o));
    }
  }
  staged_.clear();
}

void Server::start_write() {
  RecordWrite w;
  w.seq = next_write_++;
  for (auto& [id, text] : unwritten_) {
    if (text) {
      w.puts.emplace_back(id, std::move(*text));
    } else {
      w.deletes.push_back(id);
    }
  }
  unwritten_.clear();
  in_flight_ = w.seq;
  options_.write_records(std::move(w));
}

void Server::records_written(std::uint64_t seq, const std::string& error) {
  if (seq == 0 || seq != in_flight_) return;  // from a term this replica no longer leads
  in_flight_ = 0;
  if (!error.empty()) {
    log("etcd: the job records were not written (" + error + "): stepping down, " + std::to_string(held_.size()) +
        " message(s) to agents dropped");
    held_.clear();
    unwritten_.clear();
    set_leadership(false, "");
    return;
  }
  ++record_txns_;
  while (!held_.empty() && held_.front().after <= seq) {
    deliver(held_.front());
    held_.pop_front();
  }
  if (!unwritten_.empty()) start_write();
}

void Server::log(const std::string& line) {
  if (options_.log) options_.log(line);
}

void Server::event(const metrics::Event& event) {
  if (options_.on_event) options_.on_event(event);
}

}  // namespace ddp::rdzv
