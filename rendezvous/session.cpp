#include "rendezvous/session.h"

#include <linux/sockios.h>
#include <sys/ioctl.h>

#include <cerrno>
#include <vector>

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;

bool Session::peer_acknowledged_all() {
  if (queued_bytes_ != 0 || !stream_->socket().is_open()) return false;
  int outstanding = 0;
  if (::ioctl(stream_->socket().native_handle(), SIOCOUTQ, &outstanding) != 0) return false;
  return outstanding == 0;
}

Session::Session(std::unique_ptr<Stream> stream, std::uint64_t id, SessionHandler& handler, SessionLimits limits)
    : stream_(std::move(stream)),
      timer_(stream_->socket().get_executor()),
      id_(id),
      handler_(handler),
      limits_(limits),
      reader_(limits.max_frame_bytes) {
  boost::system::error_code ec;
  tcp::socket& socket = stream_->socket();
  auto remote = socket.remote_endpoint(ec);
  if (!ec) {
    peer_address_ = remote.address().to_string();
    peer_port_ = remote.port();
  }
  socket.set_option(tcp::no_delay(true), ec);
  socket.non_blocking(true, ec);  // for the direct write in send()
  ready_ = !stream_->tls();          // plain TCP: nothing to wait for (the challenge goes out at once)
}

void Session::start(double deadline_s) {
  set_deadline(deadline_s);
  auto handshake = [](const std::shared_ptr<Session>& self) {
    self->stream_->async_handshake([self](const boost::system::error_code& ec) {
      if (self->phase_ == Phase::Closed) return;
      if (ec) {
        self->close(describe_tls_failure(ec, false));
        return;
      }
      self->ready_ = true;
      if (!self->queue_.empty() && !self->writing_) self->write_next();
      self->read_more();
    });
  };
  if (!stream_->tls()) {
    read_more();
    return;
  }
  // A TLS port: a client that does not start with a TLS handshake record (0x16), such as a
  // plaintext rendezvous client's greeting, is told in plain text what to do, then closed.
  stream_->socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), handshake](
                                                           const boost::system::error_code& ec) {
    if (self->phase_ == Phase::Closed) return;
    if (ec) {
      self->close(ec.message());
      return;
    }
    unsigned char first = 0;
    boost::system::error_code peek_ec;
    const std::size_t n = self->stream_->socket().receive(asio::buffer(&first, 1), tcp::socket::message_peek, peek_ec);
    if (peek_ec || n == 0) {
      self->close(peek_ec ? peek_ec.message() : "connection closed by peer");
      return;
    }
    if (first != 0x16) {
      const Frame refusal = encode(make_error(
          "tls_required", "this rendezvous server speaks TLS only: give the client the CA of its certificate "
                          "(--rdzv_conf tls_ca=FILE, or ddp-rendezvous status --tls_ca=FILE; docs/security.md)"));
      boost::system::error_code ignored;
      self->stream_->socket().send(asio::buffer(*refusal), 0, ignored);  // best effort: the socket does not block
      self->close("a client without TLS on a TLS port");
      return;
    }
    handshake(self);
  });
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
// Plain TCP waits until the socket is readable and then reads into one buffer of the thread, so
// that an idle connection holds no read buffer (4 KiB each was 40 MB of 85 at 10,000 agents);
// TLS reads through its stream into the session's own buffer.
void Session::read_more() {
  if (!stream_->tls()) {
    stream_->socket().async_wait(tcp::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
      if (self->phase_ == Phase::Closed) return;
      static thread_local std::vector<char> shared(64 * 1024);
      std::size_t n = 0;
      if (!ec) n = self->stream_->socket().read_some(asio::buffer(shared), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) return self->read_more();
      self->on_read(ec, shared.data(), n);
    });
    return;
  }
  rbuf_.resize(4096);
  stream_->async_read_some(asio::buffer(rbuf_), [self = shared_from_this()](const boost::system::error_code& ec, std::size_t n) {
    if (self->phase_ != Phase::Closed) self->on_read(ec, self->rbuf_.data(), n);
  });
}

void Session::on_read(const boost::system::error_code& ec, const char* data, std::size_t n) {
  if (ec) {
    close(ec == asio::error::eof ? "connection closed by peer" : ec.message());
    return;
  }
  if (phase_ == Phase::Closing) return;
  reader_.feed(data, n);
  if (process_frames()) read_more();
}

// Returns false when the session stopped reading (closing).
bool Session::process_frames() {
  while (true) {
    switch (reader_.next(payload_)) {
      case FrameReader::Result::need_more:
        if (payload_.capacity() > kKeptBufferBytes) std::string().swap(payload_);  // a join's, not kept while idle
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
  if (queued_bytes_ + frame->size() > limits_.max_queued_bytes) {
    close("peer does not read: more than " + std::to_string(limits_.max_queued_bytes) + " bytes queued");
    return;
  }
  if (ready_ && !writing_ && queue_.empty()) {
    // Fast path (a round broadcast to 10,000 nodes): write straight from this call; only what
    // the kernel does not take right now goes through an async write (all of it over TLS).
    boost::system::error_code ec;
    const std::size_t n = stream_->write_now(asio::buffer(*frame), ec);
    wrote_directly(frame, ec ? -static_cast<long>(ec.value()) : static_cast<long>(n));
    return;
  }
  queued_bytes_ += frame->size();
  queue_.push_back(frame);
  if (ready_ && !writing_) write_next();
}

int Session::direct_fd() {
  const bool direct = phase_ != Phase::Closed && ready_ && !writing_ && queue_.empty() && !stream_->tls();
  return direct ? stream_->socket().native_handle() : -1;
}

// What the kernel did not take is queued behind nothing; an error other than a full buffer ends
// the session. send()'s fast path and a broadcast's writes (Server::broadcast) both end here.
void Session::wrote_directly(const Frame& frame, long result) {
  if (result == static_cast<long>(frame->size())) return;
  if (result < 0 && result != -EAGAIN && result != -EWOULDBLOCK) {
    close(boost::system::error_code(static_cast<int>(-result), boost::system::system_category()).message());
    return;
  }
  queued_bytes_ += frame->size();
  front_offset_ = result < 0 ? 0 : static_cast<std::size_t>(result);
  queue_.push_back(frame);
  write_next();
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
  stream_->async_write(asio::buffer(frame->data() + offset, frame->size() - offset),
                       [self = shared_from_this(), frame](const boost::system::error_code& ec, std::size_t) {
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
  if (!writing_ && (ready_ || queue_.empty())) close("closed by the server");
}

void Session::close(const std::string& why) {
  if (phase_ == Phase::Closed) return;
  phase_ = Phase::Closed;
  stream_->close();
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
