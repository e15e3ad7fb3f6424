#include "rendezvous/session.h"

#include <vector>

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;

Session::Session(tcp::socket socket, std::uint64_t id, SessionHandler& handler, SessionLimits limits)
    : socket_(std::move(socket)),
      timer_(socket_.get_executor()),
      id_(id),
      handler_(handler),
      limits_(limits),
      reader_(limits.max_frame_bytes) {
  boost::system::error_code ec;
  auto remote = socket_.remote_endpoint(ec);
  if (!ec) {
    peer_address_ = remote.address().to_string();
    peer_ = peer_address_ + ":" + std::to_string(remote.port());
  } else {
    peer_ = "?";
  }
  socket_.set_option(tcp::no_delay(true), ec);
  socket_.non_blocking(true, ec);  // for the direct write in send()
}

void Session::start(double deadline_s) {
  set_deadline(deadline_s);
  read_more();
}

void Session::set_deadline(double seconds) {
  if (seconds < 0) {
    deadline_armed_ = false;
    timer_.cancel();
    return;
  }
  deadline_ = std::chrono::steady_clock::now() +
              std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  if (!deadline_armed_) {
    deadline_armed_ = true;
    arm_deadline();
  }
}

// Lazy deadline: the timer fires at the old expiry and re-arms if the deadline moved, so
// extending a deadline costs no timer cancellation.
void Session::arm_deadline() {
  timer_.expires_at(deadline_);
  timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->phase_ == Phase::Closed || !self->deadline_armed_) return;
    if (std::chrono::steady_clock::now() < self->deadline_) {
      self->arm_deadline();
      return;
    }
    self->deadline_armed_ = false;
    if (self->phase_ == Phase::Closing) {
      self->close("did not read its error message in time");
    } else {
      self->handler_.on_deadline(*self);
    }
  });
}

// Reads whatever the socket has (often several frames at once) and handles every complete frame.
void Session::read_more() {
  socket_.async_read_some(asio::buffer(rbuf_), [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
    if (self->phase_ == Phase::Closed) return;
    if (ec) {
      self->close(ec == asio::error::eof ? "connection closed by peer" : ec.message());
      return;
    }
    if (self->phase_ == Phase::Closing) return;
    self->reader_.feed(self->rbuf_.data(), n);
    if (self->process_frames()) self->read_more();
  });
}

// Returns false when the session stopped reading (closing).
bool Session::process_frames() {
  while (true) {
    switch (reader_.next(payload_)) {
      case FrameReader::Result::need_more:
        return true;
      case FrameReader::Result::error:
        fail(reader_.error().code, reader_.error().message);
        return false;
      case FrameReader::Result::frame:
        break;
    }
    Decoded decoded = decode(payload_);
    if (decoded.error) {
      handler_.on_bad_message(*this, *decoded.error);
      return false;
    }
    handler_.on_message(*this, std::move(*decoded.message));
    if (phase_ != Phase::Handshake && phase_ != Phase::Authenticated) return false;
  }
}

void Session::send(const Frame& frame) {
  if (phase_ == Phase::Closed) return;
  queued_bytes_ += frame->size();
  if (queued_bytes_ > limits_.max_queued_bytes) {
    close("peer does not read: more than " + std::to_string(limits_.max_queued_bytes) + " bytes queued");
    return;
  }
  if (!writing_ && queue_.empty()) {
    // Fast path (a round broadcast to 10,000 nodes): write straight from this call; only what
    // the kernel does not take right now goes through an async write.
    boost::system::error_code ec;
    std::size_t n = socket_.send(asio::buffer(*frame), 0, ec);
    if (ec && ec != asio::error::would_block && ec != asio::error::try_again) {
      queued_bytes_ -= frame->size();
      close(ec.message());
      return;
    }
    if (!ec && n == frame->size()) {
      queued_bytes_ -= frame->size();
      return;
    }
    front_offset_ = ec ? 0 : n;
  }
  queue_.push_back(frame);
  if (!writing_) write_next();
}

void Session::write_next() {
  if (queue_.empty()) {
    writing_ = false;
    if (close_when_flushed_) close("closed by the server");
    return;
  }
  writing_ = true;
  Frame frame = queue_.front();
  const std::size_t offset = front_offset_;
  front_offset_ = 0;
  asio::async_write(socket_, asio::buffer(frame->data() + offset, frame->size() - offset),
                    [self = shared_from_this(), frame](boost::system::error_code ec, std::size_t) {
                      if (self->phase_ == Phase::Closed) return;
                      self->queued_bytes_ -= frame->size();
                      self->queue_.pop_front();
                      if (ec) {
                        self->close(ec.message());
                        return;
                      }
                      self->write_next();
                    });
}

void Session::fail(const std::string& code, const std::string& message) {
  if (phase_ == Phase::Closed || phase_ == Phase::Closing) return;
  send(encode(make_error(code, message)));
  close_after_flush();
}

void Session::close_after_flush() {
  if (phase_ == Phase::Closed) return;
  phase_ = Phase::Closing;
  close_when_flushed_ = true;
  deadline_armed_ = false;
  set_deadline(1.0);  // a peer that never reads its error is cut off
  if (!writing_) close("closed by the server");
}

void Session::close(const std::string& why) {
  if (phase_ == Phase::Closed) return;
  phase_ = Phase::Closed;
  boost::system::error_code ec;
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  timer_.cancel();
  queue_.clear();
  handler_.on_closed(*this, why);
}

void SessionManager::add(std::shared_ptr<Session> session) { sessions_.emplace(session->id(), std::move(session)); }
void SessionManager::remove(std::uint64_t id) { sessions_.erase(id); }
Session* SessionManager::find(std::uint64_t id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.get();
}
void SessionManager::stop_all() {
  std::vector<std::shared_ptr<Session>> all;
  for (auto& [id, s] : sessions_) all.push_back(s);
  for (auto& s : all) s->close("server stopping");
  sessions_.clear();
}

}  // namespace ddp::rdzv
