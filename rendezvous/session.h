// One rendezvous connection on the server side: its stream (plain TCP or TLS, rendezvous/stream.h),
// read buffers and write queue.
//
// Created by the Server on accept, owned by the SessionManager (and by its own pending async
// operations through shared_from_this); lives until the socket closes. All calls happen on the
// server's io_context thread. Frames are length-checked before their buffer is allocated.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio.hpp>
#include <nlohmann/json.hpp>

#include "rendezvous/protocol.h"
#include "rendezvous/stream.h"

namespace ddp::rdzv {

class Session;

// What a session reports to its owner (the Server).
class SessionHandler {
 public:
  virtual ~SessionHandler() = default;
  virtual void on_message(Session& session, Message message) = 0;
  // A frame that does not decode (bad JSON, wrong field types or ranges). The handler must end
  // the session (fail()); it is told so that a member's job learns the node is gone.
  virtual void on_bad_message(Session& session, const ProtocolError& error) = 0;
  // The session closed (peer closed, error, or fail()). Called once per session.
  virtual void on_closed(Session& session, const std::string& why) = 0;
  // A session's deadline passed (no hello in time, or idle before joining).
  virtual void on_deadline(Session& session) = 0;
};

struct SessionLimits {
  std::size_t max_frame_bytes = kDefaultMaxFrameBytes;
  std::size_t max_queued_bytes = 64 << 20;  // a peer that never reads is dropped past this
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  enum class Phase { Handshake, Authenticated, Closing, Closed };

  Session(std::unique_ptr<Stream> stream, std::uint64_t id, SessionHandler& handler, SessionLimits limits);

  // Starts the TLS handshake (when the stream is TLS), then reading; the deadline fires
  // on_deadline after `deadline_s` unless extended (it covers a stalled handshake too).
  void start(double deadline_s);
  // Queues one frame (written once the handshake is done).
  void send(const Frame& frame);
  // A broadcast's direct write (rendezvous/fanout.h): the socket a frame may be written to
  // straight away, from another thread while this one waits, or -1 when it must go through
  // send() (something queued or being written, TLS, closed). Then wrote_directly() with what
  // was written of it (bytes, or -errno): the rest goes through the queue.
  int direct_fd();
  void wrote_directly(const Frame& frame, long result);
  // Sends an error message, then closes once it is written (at most ~1 s later).
  void fail(const std::string& code, const std::string& message);
  // Closes once the queued frames are written.
  void close_after_flush();
  // Closes now (no more handlers will reach the SessionHandler except on_closed).
  void close(const std::string& why);
  // Moves the deadline to now + seconds; a negative value cancels it.
  void set_deadline(double seconds);

  std::uint64_t id() const { return id_; }
  Phase phase() const { return phase_; }
  void set_phase(Phase p) { phase_ = p; }
  // "ADDRESS:PORT" (made when asked: a session keeps its address once), "?" when not known.
  std::string peer() const {
    return peer_address_.empty() ? "?" : peer_address_ + ":" + std::to_string(peer_port_);
  }
  std::string peer_address() const { return peer_address_; }
  int peer_port() const { return peer_port_; }
  // Whether the peer's host has acknowledged every byte sent to it: nothing waits in this
  // session's queue, nor unacknowledged in the kernel (SIOCOUTQ). A host that is up acknowledges
  // within milliseconds, whatever its process does; a host that lost power or its link does not.
  // false when it cannot tell.
  bool peer_acknowledged_all();
  std::string job_id;      // from hello
  std::string nonce;       // the challenge sent to this connection (hex); released once welcomed
  std::string seal_key;    // seals node secrets on this connection (auth.h); "" without a secret
  bool member = false;     // joined a job: the state machine watches its heartbeats
  bool redirected = false;     // told not_leader (a follower replica); ignored from then on
  bool greeted = false;        // sent its greeting (optional, at most one, before hello)
  bool authenticated = false;  // said a valid hello or status
  bool all_jobs = true;        // status shows every job (open server or cluster secret), else job_id's

 private:
  void read_more();
  void on_read(const boost::system::error_code& ec, const char* data, std::size_t n);
  bool process_frames();
  void write_next();
  void arm_deadline();

  std::unique_ptr<Stream> stream_;
  boost::asio::steady_timer timer_;
  std::uint64_t id_;
  SessionHandler& handler_;
  SessionLimits limits_;
  Phase phase_ = Phase::Handshake;
  // Splits what the socket returns into frames; grows only to a checked frame size.
  FrameReader reader_;
  std::vector<char> rbuf_;  // TLS only (plain TCP reads into a buffer of the thread)
  std::string payload_;
  std::list<Frame> queue_;  // not a deque: an empty one allocates nothing (a deque holds 576 bytes)
  std::size_t queued_bytes_ = 0;
  std::size_t front_offset_ = 0;  // bytes of queue_.front() already written directly
  bool writing_ = false;
  bool ready_ = false;  // the handshake is done: frames may be written
  bool close_when_flushed_ = false;
  std::chrono::steady_clock::time_point deadline_;
  bool deadline_armed_ = false;
  std::string peer_address_;
  int peer_port_ = 0;
};

// Owns the live sessions of a server and can stop them all. Server thread only.
class SessionManager {
 public:
  void add(std::shared_ptr<Session> session);
  void remove(std::uint64_t id);
  Session* find(std::uint64_t id);
  void stop_all();
  // Calls f on every live session (f must not add or remove sessions).
  template <class F>
  void for_each(F&& f) {
    for (auto& [id, session] : sessions_) f(*session);
  }
  std::size_t size() const { return sessions_.size(); }

 private:
  std::unordered_map<std::uint64_t, std::shared_ptr<Session>> sessions_;
};

}  // namespace ddp::rdzv
