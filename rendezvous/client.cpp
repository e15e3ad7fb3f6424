#include "rendezvous/client.h"

#include "rendezvous/auth.h"
#include "rendezvous/cloexec.h"
#include "rendezvous/reach.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;
using nlohmann::json;
using steady = std::chrono::steady_clock;

namespace {
steady::duration to_duration(double seconds) {
  return std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(seconds));
}
}  // namespace

std::shared_ptr<Client> Client::create(asio::io_context& io, ClientOptions options, ClientEvents events) {
  return std::make_shared<Client>(io, std::move(options), std::move(events));
}

Client::Client(asio::io_context& io, ClientOptions options, ClientEvents events)
    : io_(io),
      options_(std::move(options)),
      events_(std::move(events)),
      resolver_(io),
      socket_(io),
      retry_timer_(io),
      heartbeat_timer_(io),
      reader_(options_.max_frame_bytes) {}

std::string Client::local_address() const {
  boost::system::error_code ec;
  auto ep = (stream_ ? stream_->socket() : socket_).local_endpoint(ec);
  return ec ? std::string() : ep.address().to_string();
}

double Client::seconds_left() const {
  return std::chrono::duration<double>(deadline_ - steady::now()).count();
}

void Client::connect(const Endpoint& endpoint, double timeout_s) {
  endpoint_text_ = endpoint.text();
  deadline_ = steady::now() + to_duration(timeout_s);
  if (const std::string error = connect_error(endpoint); !error.empty()) {
    asio::post(io_, [self = shared_from_this(), what = "rendezvous endpoint " + error] { self->fail(what); });
    return;
  }
  host_ = endpoint.host;
  port_ = std::to_string(endpoint.port);
  try_connect();
}

void Client::try_connect() {
  if (closed_) return;
  ++attempts_;
  connect_timed_out_ = false;
  // A black-holed address would hold async_connect for minutes: the deadline cuts it short.
  retry_timer_.expires_at(deadline_);
  retry_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (ec || self->closed_) return;
    boost::system::error_code ignored;
    self->connect_timed_out_ = true;
    self->resolver_.cancel();
    self->socket_.cancel(ignored);
  });
  // A numeric address needs no resolver (whose lookups run one at a time on a helper thread).
  boost::system::error_code numeric_ec;
  const auto numeric = asio::ip::make_address(host_, numeric_ec);
  if (!numeric_ec) {
    const tcp::endpoint target(numeric, static_cast<unsigned short>(std::stoi(port_)));
    socket_.async_connect(target, [self = shared_from_this()](boost::system::error_code ec) {
      if (self->closed_) return;
      if (ec) {
        boost::system::error_code ignored;
        self->socket_.close(ignored);
        self->retry(ec.message(), ec == asio::error::connection_refused);
        return;
      }
      self->on_connected();
    });
    return;
  }
  resolver_.async_resolve(host_, port_, [self = shared_from_this()](boost::system::error_code ec,
                                                                    tcp::resolver::results_type results) {
    if (self->closed_) return;
    self->resolve_error_ = ec ? ec.message() : std::string();
    if (ec) {
      self->retry("resolve " + self->host_ + " (for " + self->endpoint_text_ + "): " + ec.message());
      return;
    }
    asio::async_connect(self->socket_, results, [self](boost::system::error_code ec2, const tcp::endpoint&) {
      if (self->closed_) return;
      if (ec2) {
        boost::system::error_code ignored;
        self->socket_.close(ignored);
        self->retry(ec2.message(), ec2 == asio::error::connection_refused);
        return;
      }
      self->on_connected();
    });
  });
}

void Client::retry(const std::string& reported, bool refused) {
  // An attempt cut short by the deadline reports the error of the attempts before it.
  std::string error = reported;
  if (connect_timed_out_) {
    error = last_connect_error_.empty() ? "no answer (timed out connecting)" : last_connect_error_;
  } else {
    last_connect_error_ = reported;
  }
  const double left = seconds_left();
  const std::string what = "connect to rendezvous " + endpoint_text_ + ": " + error;
  if (left <= 0) {
    fail(what + " (gave up: its connect deadline passed)", true);
    return;
  }
  if (refused && options_.give_up_when_refused) {
    fail(what, true);
    return;
  }
  const auto now = steady::now();
  if (now - last_retry_log_ >= std::chrono::seconds(10)) {
    last_retry_log_ = now;
    if (events_.on_log) events_.on_log(what + " (retrying for " + std::to_string(static_cast<long>(std::ceil(left))) + " s)");
  }
  // Jittered (x0.5..1.5): agents that lost one server together do not come back in lockstep.
  static thread_local std::minstd_rand jitter(std::random_device{}());
  const double delay = retry_delay_ * std::uniform_real_distribution<double>(0.5, 1.5)(jitter);
  retry_timer_.expires_after(to_duration(std::min(delay, left)));
  retry_delay_ = std::min(retry_delay_ * 2, options_.max_retry_delay);
  retry_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (!ec) self->try_connect();
  });
}

void Client::on_connected() {
  retry_timer_.cancel();
  close_on_exec(socket_.native_handle());
  boost::system::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);
  stream_ = make_client_stream(std::move(socket_), options_.tls, host_);
  last_heard_ = steady::now();
  identified_ = false;
  start_bytes_.clear();
  greeting_deadline_ = steady::now() + to_duration(std::min(options_.greeting_timeout, std::max(seconds_left(), 0.0)));
  // The welcome must come before the connect deadline (checked by the heartbeat timer), and the
  // server's challenge (after the TLS handshake, if any) within the greeting timeout.
  heartbeat();
  stream_->async_handshake([self = shared_from_this()](const boost::system::error_code& ec) {
    if (self->closed_) return;
    if (ec) {
      self->fail("rendezvous endpoint " + self->endpoint_text_ + ": " + describe_tls_failure(ec, true));
      return;
    }
    // Said at once, before the challenge arrives: a service that is not a rendezvous server
    // answers it (an HTTP server with an error), and identify() names that service.
    self->send_frame(encode_greeting());
    self->read_more();  // the server's challenge, answered by hello
  });
}

void Client::read_more() {
  stream_->async_read_some(asio::buffer(rbuf_), [self = shared_from_this()](const boost::system::error_code& ec, std::size_t n) {
    if (self->closed_) return;
    if (ec) {
      // Closed after saying something that is not a challenge: not a rendezvous server.
      if (!self->identified_ && !self->start_bytes_.empty() && !self->identify(nullptr, 0)) return;
      self->fail("connection to rendezvous " + self->endpoint_text_ + " closed: " +
                 (ec == asio::error::eof ? std::string("the server closed it") : ec.message()), true);
      return;
    }
    if (!self->identified_ && !self->identify(self->rbuf_.data(), n)) return;
    self->reader_.feed(self->rbuf_.data(), n);
    while (!self->closed_) {
      const FrameReader::Result r = self->reader_.next(self->payload_);
      if (r == FrameReader::Result::need_more) break;
      if (r == FrameReader::Result::error) {
        self->fail("rendezvous " + self->endpoint_text_ + " sent a bad frame: " + self->reader_.error().message);
        return;
      }
      Decoded decoded = decode(self->payload_);
      if (decoded.error) {
        self->fail("rendezvous " + self->endpoint_text_ + " sent a bad message: " + decoded.error->message);
        return;
      }
      self->last_heard_ = steady::now();
      self->handle(*decoded.message);
    }
    if (!self->closed_) self->read_more();
  });
}

// Until the peer has proved to be a rendezvous server (a challenge of this protocol version with
// the magic, check_server_start), what it sends is kept and checked. Returns false when the peer
// was refused (the client is then closed). `n == 0` means the peer closed the connection.
bool Client::identify(const char* data, std::size_t n) {
  if (n > 0) start_bytes_.append(data, std::min(n, kFrameHeaderBytes + kMaxChallengeBytes + 1));
  const ServerCheck check = check_server_start(start_bytes_, n == 0);
  switch (check.verdict) {
    case ServerCheck::Verdict::need_more:
      return true;
    case ServerCheck::Verdict::rendezvous:
      identified_ = true;
      start_bytes_.clear();
      return true;
    case ServerCheck::Verdict::refuse:
      break;
  }
  fail("rendezvous endpoint " + endpoint_text_ + " " + check.reason);
  return false;
}

void Client::handle(Message& m) {
  if (welcomed_ && m.type != MessageType::not_leader) served_ = true;
  switch (m.type) {
    case MessageType::heartbeat_ack:
      return;
    case MessageType::probe:  // the server thinks this node may be gone: any message answers
      send(make_heartbeat());
      return;
    case MessageType::check_peer:
      return check_peer(std::get<CheckPeer>(m.body));
    case MessageType::challenge:
      return on_challenge(std::get<Challenge>(m.body));
    case MessageType::welcome:
      return on_welcome(std::get<Welcome>(m.body));
    case MessageType::round: {
      Assignment& a = std::get<Assignment>(m.body);
      a.secret = seal_hex(seal_key_, a.secret);  // sealed under this connection's key (auth.h)
      if (!a.secret.empty()) secret_ = a.secret;
      round_started_ = true;
      round_first_step_ = progress_sent_ ? progress_sent_->step : -1;
      if (events_.on_round) events_.on_round(a);
      return;
    }
    case MessageType::restart: {
      const Restart& r = std::get<Restart>(m.body);
      quiet_ = r.quiet;
      if (events_.on_restart) events_.on_restart(r.reason, r.counted, r.failing, r.failure);
      return;
    }
    case MessageType::resumed: {
      const Resumed& r = std::get<Resumed>(m.body);
      if (events_.on_resumed) events_.on_resumed(r.generation, r.restart_count);
      return;
    }
    case MessageType::waiting:
      if (events_.on_waiting) events_.on_waiting(std::get<Waiting>(m.body));
      return;
    case MessageType::job_succeeded:
      finished_ = true;
      goodput_ = std::get<JobSucceeded>(m.body).goodput;
      if (events_.on_job_succeeded) events_.on_job_succeeded();
      return;
    case MessageType::job_failed: {
      finished_ = true;
      const JobFailed& f = std::get<JobFailed>(m.body);
      goodput_ = f.goodput;
      quiet_ = f.quiet;
      if (events_.on_job_failed) events_.on_job_failed(f.failure, f.summary);
      return;
    }
    case MessageType::not_leader:
      return on_not_leader(std::get<NotLeader>(m.body).leader);
    case MessageType::error:
      return on_error_message(std::get<ErrorMessage>(m.body));
    default:
      // Client messages and status replies are not for an agent; ignored like future notices.
      return;
  }
}

// The server's challenge: answered by hello, with the proof of the token when there is one.
void Client::on_challenge(const Challenge& c) {
  if (c.protocol_version != kProtocolVersion) {
    fail("rendezvous " + endpoint_text_ + " speaks protocol version " + std::to_string(c.protocol_version) +
         ", this agent " + std::to_string(kProtocolVersion) +
         ": run the same ddplaunch version on every node and the rendezvous server");
    return;
  }
  server_nonce_ = c.nonce;
  client_nonce_ = random_hex();
  Hello h;
  h.job_id = options_.job_id;
  h.client_nonce = client_nonce_;
  if (!options_.token.empty()) h.proof = auth_proof(options_.token, "hello", server_nonce_, client_nonce_, h.job_id);
  seal_key_ = seal_key(options_.token, server_nonce_, client_nonce_, h.job_id);
  send(make_hello(h));
}

// The server proved the token (when there is one): what waited for the welcome goes out.
void Client::on_welcome(const Welcome& w) {
  if (!options_.token.empty() &&
      !proofs_equal(w.proof, auth_proof(options_.token, "server", server_nonce_, client_nonce_, options_.job_id))) {
    fail("rendezvous " + endpoint_text_ + " could not prove it knows this job's secret: it is not the server "
         "the token_file is for (or its secret differs)");
    return;
  }
  welcomed_ = true;
  if (pending_resume_) {
    ResumeRequest r = std::move(*pending_resume_);
    pending_resume_.reset();
    resume(std::move(r));
  }
  if (pending_join_) {
    NodeSpec spec = std::move(*pending_join_);
    pending_join_.reset();
    join(std::move(spec));
  }
  for (const Message& report : pending_reports_) send(report);
  pending_reports_.clear();
}

// A follower replica. Followed only after its welcome, which proved (with a token) that it is a
// genuine server of this job: an unauthenticated peer cannot redirect agents.
void Client::on_not_leader(const std::string& leader) {
  const bool genuine = welcomed_;
  // A follower's connection never served: the owner's retry is not a reconnect. A leader that
  // stepped down had served it: its loss starts a reconnect (the workers keep running).
  welcomed_ = served_;
  if (!genuine) {
    fail("rendezvous " + endpoint_text_ + " sent not_leader before its welcome (ignored)", true);
    return;
  }
  const std::string why = "rendezvous " + endpoint_text_ + " is a follower replica; " +
                          (leader.empty() ? "no replica leads at the moment" : "the leader is " + leader);
  if (!events_.on_redirect || closed_) {
    fail(why, true);
    return;
  }
  closed_ = true;
  shutdown();
  events_.on_redirect(leader, why);
}

void Client::on_error_message(const ErrorMessage& e) {
  if (e.code == "drained" && events_.on_drained) {
    if (closed_) return;
    closed_ = true;
    shutdown();
    events_.on_drained(e.message.empty() ? "drained by ddp-rendezvous drain" : e.message);
    return;
  }
  // Dropped for silence while alive (the machine stalled, or its beats or its answer to a probe
  // were delayed past heartbeat_timeout or probe_timeout): not a refusal. Like a lost
  // connection, the owner reconnects and resumes; the server answers that the round ended, and
  // the node rejoins.
  const bool dropped_for_silence = e.code == "heartbeat_timeout" || e.code == "probe_timeout";
  fail("rendezvous " + endpoint_text_ + (dropped_for_silence ? " dropped this node: " : " refused: ") +
           (e.message.empty() ? "(no message)" : e.message) + " [" + (e.code.empty() ? "?" : e.code) + "]",
       dropped_for_silence);
}

void Client::join(NodeSpec spec) {
  if (closed_) return;
  if (spec.job_id.empty()) spec.job_id = options_.job_id;
  spec.progress = static_cast<bool>(events_.on_waiting);  // ask for `waiting` when it is heard
  spec.peer_checks = true;
  options_.heartbeat_interval = spec.timeouts.heartbeat_interval;
  options_.heartbeat_timeout = spec.timeouts.heartbeat_timeout;
  if (!welcomed_) {
    pending_join_ = std::move(spec);
    return;
  }
  if (spec.addr.empty()) spec.addr = local_address();
  send(make_join(spec));
}

void Client::resume(ResumeRequest request) {
  if (closed_) return;
  options_.heartbeat_interval = request.node.timeouts.heartbeat_interval;
  options_.heartbeat_timeout = request.node.timeouts.heartbeat_timeout;
  if (!welcomed_) {
    pending_resume_ = std::move(request);
    return;
  }
  if (request.node.addr.empty()) request.node.addr = local_address();
  secret_ = request.secret;
  // Never in clear on the wire: sealed under this connection's key; the assignment's copy stays home.
  request.secret = seal_hex(seal_key_, request.secret);
  request.assignment.secret.clear();
  send(make_resume_message(request));
}

void Client::report_failure(const WorkerFailure& failure) {
  if (closed_) return;
  if (welcomed_) {
    send(make_failure(failure));
  } else {
    pending_reports_.push_back(make_failure(failure));
  }
}

void Client::report_stall(double stalled_for) {
  if (!closed_ && welcomed_) send(make_stall(stalled_for));
}

void Client::report_success() {
  if (closed_) return;
  if (welcomed_) {
    send(make_success());
  } else {
    pending_reports_.push_back(make_success());
  }
}

void Client::close() {
  if (closed_) return;
  if (welcomed_ && stream_ && stream_->socket().is_open()) {
    send(make_leave());
    close_when_flushed_ = true;
    closed_ = true;
    resolver_.cancel();
    retry_timer_.cancel();
    heartbeat_timer_.cancel();
    if (!writing_) shutdown();
    return;
  }
  closed_ = true;
  shutdown();
}

void Client::shutdown() {
  boost::system::error_code ec;
  resolver_.cancel();
  retry_timer_.cancel();
  heartbeat_timer_.cancel();
  if (stream_) {
    stream_->close();
  } else {
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }
  queue_.clear();
}

// check_peer: another node of the job did not answer the server's probe. A connection to its host
// at a port with no listener, refused or accepted, proves the host is up (peer_alive); no answer
// within `within` says nothing (the server never convicts on a peer's word). A host name, or
// more checks at once than kMaxChecksInFlight, is not tried.
void Client::check_peer(const CheckPeer& check) {
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(check.addr, ec);
  if (ec || checks_in_flight_ >= kMaxChecksInFlight) return;
  ++checks_in_flight_;
  knock(io_, tcp::endpoint(address, static_cast<unsigned short>(check.port)), check.within,
        [self = shared_from_this(), id = check.id](Reach reach) {
          --self->checks_in_flight_;
          if (reach != Reach::silent && self->welcomed_ && !self->closed_) self->send(make_peer_alive(id));
        });
}

void Client::send(const Message& message) { send_frame(encode(message)); }

void Client::send_frame(Frame frame) {
  queue_.push_back(std::move(frame));
  if (!writing_ && stream_) write_next();
}

void Client::write_next() {
  if (queue_.empty()) {
    writing_ = false;
    if (close_when_flushed_) shutdown();
    return;
  }
  writing_ = true;
  Frame frame = queue_.front();
  stream_->async_write(asio::buffer(*frame), [self = shared_from_this(), frame](const boost::system::error_code& ec, std::size_t) {
    if (!self->queue_.empty()) self->queue_.pop_front();
    if (ec) {
      self->writing_ = false;
      if (!self->closed_) self->fail("send to rendezvous " + self->endpoint_text_ + ": " + ec.message(), true);
      return;
    }
    self->write_next();
  });
}

void Client::heartbeat() {
  if (closed_) return;
  const auto now = steady::now();
  if (!welcomed_) {
    if (!identified_ && now >= greeting_deadline_) {
      fail("rendezvous endpoint " + endpoint_text_ + " accepted the connection but sent no ddp-rendezvous challenge "
           "within " + std::to_string(static_cast<int>(std::ceil(options_.greeting_timeout))) +
           " s: is another service listening there?", true);
      return;
    }
    if (seconds_left() <= 0) {
      fail("rendezvous " + endpoint_text_ + " did not answer hello before its connect deadline", true);
      return;
    }
  } else {
    if (!finished_ && now - last_heard_ > to_duration(options_.heartbeat_timeout)) {
      // Looked at twice, 10 ms apart: a process that did not run for a while (stopped, starved,
      // a paused VM) wakes with this timer and its socket ready at once, and what the server
      // sent meanwhile (acks, or that it dropped this node) is read before the verdict.
      if (!silence_seen_) {
        silence_seen_ = true;
        heartbeat_timer_.expires_after(std::chrono::milliseconds(10));
        heartbeat_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
          if (!ec) self->heartbeat();
        });
        return;
      }
      fail("rendezvous " + endpoint_text_ + " silent for " +
           std::to_string(std::chrono::duration<double>(now - last_heard_).count()) + " s (heartbeat_timeout " +
           std::to_string(options_.heartbeat_timeout) + " s)", true);
      return;
    }
    silence_seen_ = false;
    std::optional<NodeProgress> progress;
    if (events_.progress && (!progress_sent_ || round_started_ || now - progress_sent_at_ >= kProgressEvery)) {
      progress = events_.progress();
      if (progress && progress == progress_sent_) {
        progress.reset();  // nothing new to say
      } else if (progress) {
        progress_sent_ = progress;
        progress_sent_at_ = now;
        if (progress->step >= 0 && progress->step != round_first_step_) round_started_ = false;  // the round's own
      }
    }
    send(make_heartbeat(progress));
  }
  heartbeat_timer_.expires_after(to_duration(welcomed_ ? options_.heartbeat_interval : 0.1));
  heartbeat_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (!ec) self->heartbeat();
  });
}

void Client::fail(const std::string& message, bool lost) {
  if (closed_) return;
  const bool quiet = finished_;  // after the job ended, the server closing is expected
  closed_ = true;
  shutdown();
  if (quiet) return;
  if (lost && events_.on_disconnected) {
    events_.on_disconnected(message);
  } else if (events_.on_error) {
    events_.on_error(message);
  }
}

}  // namespace ddp::rdzv
