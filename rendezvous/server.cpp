#include "rendezvous/server.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;
using nlohmann::json;

namespace {
std::string seconds(double s) {
  json j = s;  // shortest round-trip text: "5", "0.3"
  return j.dump() + " s";
}
}  // namespace

Server::Server(asio::io_context& io, const tcp::endpoint& endpoint, ServerOptions options)
    : io_(io),
      options_(std::move(options)),
      // The environment check of issue 6 runs unless the owner installs its own check.
      state_(clock_, *this,
             options_.round_check ? options_.round_check
                                  : make_env_round_check([this](const std::string& line) { log(line); })),
      acceptor_(io),
      tick_timer_(io),
      accept_retry_timer_(io),
      welcome_(encode_frame(make_welcome())),
      heartbeat_ack_(encode_frame(make_heartbeat_ack())) {
  acceptor_.open(endpoint.protocol());
  acceptor_.set_option(tcp::acceptor::reuse_address(true));
  acceptor_.bind(endpoint);
  acceptor_.listen(asio::socket_base::max_listen_connections);
  bound_ = acceptor_.local_endpoint();
  accept();
  tick();
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
  if (unauthenticated_ >= options_.max_unauthenticated) return;  // resumed when one says hello or goes
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
    SessionHandler& handler = *this;
    auto session = std::make_shared<Session>(std::move(socket), next_id_++, handler,
                                             SessionLimits{options_.max_frame_bytes, options_.max_queued_bytes});
    sessions_.add(session);
    ++unauthenticated_;
    session->start(options_.hello_timeout);
    if (sessions_.size() > options_.max_connections) {
      session->fail("busy", "the rendezvous server is at its limit of " + std::to_string(options_.max_connections) +
                                " connections; try again later");
    }
    accept();
  });
}

void Server::tick() {
  if (stopped_) return;
  state_.tick();
  tick_timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.tick_interval)));
  tick_timer_.async_wait([this, alive = alive_](boost::system::error_code ec) {
    if (*alive && !ec) tick();
  });
}

void Server::on_message(Session& session, json message) {
  if (session.phase() == Session::Phase::Handshake) {
    handle_first(session, message);
    return;
  }
  try {
    handle(session, message);
  } catch (const json::exception& e) {
    if (session.member) state_.disconnected(session.id(), "sent a malformed message");
    session.member = false;
    session.fail("bad_message", "malformed \"" + message.value("type", std::string()) + "\" message: " + e.what());
  }
}

void Server::handle_first(Session& session, const json& message) {
  if (auto err = check_first_message(message, options_.token)) {
    log("refused " + session.peer() + ": " + err->message);
    session.fail(err->code, err->message);
    return;
  }
  --unauthenticated_;
  session.authenticated = true;
  session.set_phase(Session::Phase::Authenticated);
  accept();  // may have paused at max_unauthenticated
  if (message["type"] == "status") {
    session.send(encode_frame({{"type", "status_reply"}, {"status", state_.status()}}));
    session.close_after_flush();
    return;
  }
  session.job_id = message["job_id"].get<std::string>();
  session.set_deadline(options_.idle_timeout);
  session.send(welcome_);
}

void Server::handle(Session& session, const json& message) {
  const std::string& type = message["type"].get_ref<const std::string&>();
  if (session.member) state_.touch(session.id());
  if (type == "heartbeat") {
    if (!session.member) session.set_deadline(options_.idle_timeout);
    session.send(heartbeat_ack_);
  } else if (type == "join") {
    NodeSpec spec = message.at("node").get<NodeSpec>();
    if (spec.job_id.empty()) spec.job_id = session.job_id;
    if (spec.job_id != session.job_id) {
      session.fail("bad_join", "join names job " + spec.job_id + " but hello named " + session.job_id);
      return;
    }
    if (spec.addr.empty()) spec.addr = session.peer_address();
    session.member = true;
    session.set_deadline(-1);  // the state machine watches its heartbeats from now on
    state_.join(session.id(), std::move(spec));
  } else if (type == "failure") {
    state_.report_failure(session.id(), message.at("failure").get<WorkerFailure>());
  } else if (type == "success") {
    state_.report_success(session.id());
  } else if (type == "leave") {
    state_.leave(session.id());
    session.member = false;
    session.close_after_flush();
  } else if (type == "status") {
    session.send(encode_frame({{"type", "status_reply"}, {"status", state_.status()}}));
  } else if (type == "resume") {
    handle_resume(session, message);
  } else {
    if (session.member) state_.disconnected(session.id(), "sent an unknown message");
    session.member = false;
    session.fail("bad_message", "unknown message type \"" + type + "\"");
  }
}

// Issue 10: an agent that lost its rendezvous gives back its round. Validated whole before the
// state machine sees it; any error closes this connection only.
void Server::handle_resume(Session& session, const json& message) {
  auto decoded = decode_resume(message);
  if (auto* err = std::get_if<ProtocolError>(&decoded)) {
    if (session.member) state_.disconnected(session.id(), "sent an invalid resume");
    session.member = false;
    log("refused a resume from " + session.peer() + ": " + err->message);
    session.fail(err->code, err->message);
    return;
  }
  ResumeRequest& r = std::get<ResumeRequest>(decoded);
  if (r.job_id != session.job_id) {
    if (session.member) state_.disconnected(session.id(), "sent a resume for another job");
    session.member = false;
    session.fail("bad_resume", "resume names job " + r.job_id + " but hello named " + session.job_id);
    return;
  }
  if (r.node.addr.empty()) r.node.addr = session.peer_address();
  state_.resume(session.id(), r);
  if (state_.is_member(session.id())) {
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
    if (member) state_.disconnected(id, why);
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
  if (Session* s = sessions_.find(to)) s->send(frame);
}

void Server::drop(ConnId conn, const std::string& code, const std::string& message) {
  if (Session* s = sessions_.find(conn)) {
    s->member = false;
    s->fail(code, message);
  }
}

void Server::log(const std::string& line) {
  if (options_.log) options_.log(line);
}

}  // namespace ddp::rdzv
