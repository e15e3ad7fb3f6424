// Frames and the start of a connection (rendezvous/protocol.h): the length-prefixed frame, its
// incremental reader, what the server checks in a client's greeting and first message, and how
// a client tells a rendezvous server from another service by the first bytes it answers; the
// greeting itself, the leader address a redirect may name, and the builders of every message. Pure,
// like the rest of the codec: tested without sockets.
#include <string>

#include "rendezvous/endpoint.h"
#include "rendezvous/protocol.h"

namespace ddp::rdzv {

using nlohmann::json;

void write_frame_header(std::uint32_t length, unsigned char out[kFrameHeaderBytes]) {
  out[0] = static_cast<unsigned char>(length >> 24);
  out[1] = static_cast<unsigned char>(length >> 16);
  out[2] = static_cast<unsigned char>(length >> 8);
  out[3] = static_cast<unsigned char>(length);
}

std::uint32_t read_frame_header(const unsigned char in[kFrameHeaderBytes]) {
  return (std::uint32_t{in[0]} << 24) | (std::uint32_t{in[1]} << 16) |
         (std::uint32_t{in[2]} << 8) | std::uint32_t{in[3]};
}

std::optional<ProtocolError> check_frame_length(std::uint32_t length, std::size_t max_frame_bytes) {
  if (length == 0) return ProtocolError{"bad_frame", "empty frame: every frame must carry one JSON message"};
  if (length > max_frame_bytes) {
    return ProtocolError{"too_large", "frame of " + std::to_string(length) + " bytes exceeds the limit of " +
                                          std::to_string(max_frame_bytes) + " bytes"};
  }
  return std::nullopt;
}

Frame encode_frame(const json& payload) {
  std::string text = payload.dump(-1, ' ', false, json::error_handler_t::replace);
  std::string frame(kFrameHeaderBytes, '\0');
  write_frame_header(static_cast<std::uint32_t>(text.size()), reinterpret_cast<unsigned char*>(frame.data()));
  frame += text;
  return std::make_shared<const std::string>(std::move(frame));
}

// ---- FrameReader ----

void FrameReader::feed(const char* data, std::size_t size) {
  if (failed_) return;
  // Compact before growing: consumed bytes are dropped once they are half the buffer.
  if (pos_ > 0 && pos_ * 2 >= buf_.size()) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  buf_.append(data, size);
}

FrameReader::Result FrameReader::next(std::string& payload) {
  if (failed_) return Result::error;
  const std::size_t have = buf_.size() - pos_;
  if (have < kFrameHeaderBytes) return Result::need_more;
  const std::uint32_t length = read_frame_header(reinterpret_cast<const unsigned char*>(buf_.data() + pos_));
  if (auto err = check_frame_length(length, max_frame_bytes_)) {
    error_ = std::make_unique<ProtocolError>(*err);
    failed_ = true;
    buf_.clear();
    buf_.shrink_to_fit();
    pos_ = 0;
    return Result::error;
  }
  if (have - kFrameHeaderBytes < length) return Result::need_more;
  payload.assign(buf_, pos_ + kFrameHeaderBytes, length);
  pos_ += kFrameHeaderBytes + length;
  if (pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
    // An idle connection keeps no read buffer (kKeptBufferBytes): 10,000 agents' joins would
    // otherwise stay allocated for the whole job.
    if (buf_.capacity() > kKeptBufferBytes) std::string().swap(buf_);
  }
  return Result::frame;
}

bool is_client_message(MessageType type) {
  switch (type) {
    case MessageType::greeting:
    case MessageType::hello:
    case MessageType::status:
    case MessageType::join:
    case MessageType::heartbeat:
    case MessageType::failure:
    case MessageType::success:
    case MessageType::leave:
    case MessageType::resume:
    case MessageType::stall:
    case MessageType::drain:
    case MessageType::peer_alive:
      return true;
    default:
      return false;
  }
}

const Hello& first_hello(const Message& message) {
  if (message.type == MessageType::drain) return std::get<Drain>(message.body).hello;
  return std::get<Hello>(message.body);
}

std::optional<ProtocolError> check_first_message(const Message& message) {
  if (message.type != MessageType::hello && message.type != MessageType::status && message.type != MessageType::drain) {
    return ProtocolError{"bad_message", std::string("the first message must be \"hello\", \"status\" or \"drain\", got \"") +
                                            to_string(message.type) + "\""};
  }
  const Hello& h = first_hello(message);
  if (h.protocol_version != kProtocolVersion) {
    return ProtocolError{"version_mismatch", "protocol version " + std::to_string(h.protocol_version) +
                                                 " is not supported; this server speaks version " +
                                                 std::to_string(kProtocolVersion) +
                                                 ": run the same ddplaunch version on every node and the rendezvous server"};
  }
  if (message.type == MessageType::hello && h.job_id.empty()) {
    return ProtocolError{"bad_message", "hello carries no job_id (--rdzv_id)"};
  }
  return std::nullopt;
}

std::optional<ProtocolError> check_greeting(const Greeting& greeting) {
  if (greeting.magic != kMagic) {
    return ProtocolError{"bad_message", "greeting names \"" + printable_excerpt(greeting.magic) +
                                            "\", not \"" + std::string(kMagic) + "\": this is a ddp-rendezvous server"};
  }
  if (greeting.protocol_version != kProtocolVersion) {
    return ProtocolError{"version_mismatch", "protocol version " + std::to_string(greeting.protocol_version) +
                                                 " is not supported; this server speaks version " +
                                                 std::to_string(kProtocolVersion) +
                                                 ": run the same ddplaunch version on every node and the rendezvous server"};
  }
  return std::nullopt;
}

std::string printable_excerpt(std::string_view bytes, std::size_t max) {
  std::string out;
  std::size_t i = 0;
  for (; i < bytes.size() && out.size() < max; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      // A text protocol's lines and indentation read as single spaces.
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else if (c > 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static const char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (i < bytes.size()) out += "...";
  return out;
}

ServerCheck check_server_start(std::string_view bytes, bool closed) {
  using V = ServerCheck::Verdict;
  const auto not_ours = [&](const std::string& why) {
    return ServerCheck{V::refuse, "is not a ddp-rendezvous server (" + why + ")"};
  };
  if (bytes.empty()) {
    return closed ? ServerCheck{V::refuse, "closed the connection before saying anything (a ddp-rendezvous server "
                                           "started with --tls_cert does that to a client without tls_ca)"}
                  : ServerCheck{};
  }
  // A TLS record (alert 0x15 or handshake 0x16, version 3.x): a TLS server refusing plain text.
  const auto first = static_cast<unsigned char>(bytes[0]);
  if ((first == 0x15 || first == 0x16) && (bytes.size() < 2 || bytes[1] == '\x03')) {
    return ServerCheck{V::refuse, "speaks TLS (it answered with a TLS record): if it is a ddp-rendezvous server "
                                  "started with --tls_cert, give this client its CA with tls_ca (docs/security.md)"};
  }
  const std::string answered = "it answered '" + printable_excerpt(bytes, 120) + "'";
  // The first frame must be a challenge: a small length (so a zero first byte) and a JSON object.
  if (bytes[0] != '\0') return not_ours(answered);
  if (bytes.size() >= kFrameHeaderBytes) {
    const std::uint32_t length = read_frame_header(reinterpret_cast<const unsigned char*>(bytes.data()));
    if (length == 0 || length > kMaxChallengeBytes) return not_ours(answered);
    if (bytes.size() > kFrameHeaderBytes && bytes[kFrameHeaderBytes] != '{') return not_ours(answered);
    if (bytes.size() >= kFrameHeaderBytes + length) {
      Decoded d = decode(bytes.substr(kFrameHeaderBytes, length));
      if (!d.error && d.message->type == MessageType::error) {  // a rendezvous server refusing at once
        const ErrorMessage& e = std::get<ErrorMessage>(d.message->body);
        return ServerCheck{V::refuse, "refused the connection: " + e.message + " [" + e.code + "]"};
      }
      if (d.error || d.message->type != MessageType::challenge) return not_ours(answered);
      const Challenge& c = std::get<Challenge>(d.message->body);
      if (c.protocol_version != kProtocolVersion) {
        return ServerCheck{V::refuse, "is a ddp-rendezvous server of protocol version " +
                                          std::to_string(c.protocol_version) + "; this program speaks version " +
                                          std::to_string(kProtocolVersion) +
                                          ": run the same ddplaunch version on every node and the rendezvous server"};
      }
      if (c.magic != kMagic) return not_ours(answered);
      return ServerCheck{V::rendezvous, ""};
    }
  }
  if (closed) return not_ours(answered + ", then closed the connection");
  return ServerCheck{};
}

bool valid_leader_endpoint(std::string_view text) {
  if (text.empty()) return true;
  if (text.size() > kMaxEndpointBytes) return false;
  // The one endpoint syntax, in its canonical form (what Endpoint::text() writes): no blanks,
  // no leading zeros, brackets around an IPv6 address and only there; a port to connect to.
  const Expected<Endpoint> e = parse_endpoint(text, -1);
  return e && connect_error(*e).empty() && e->text() == text;
}

Frame encode_greeting() {
  Message m;
  m.type = MessageType::greeting;
  m.body = Greeting{};
  std::string text = to_json(m).dump() + "\r\n";
  std::string frame(kFrameHeaderBytes, '\0');
  write_frame_header(static_cast<std::uint32_t>(text.size()), reinterpret_cast<unsigned char*>(frame.data()));
  frame += text;
  return std::make_shared<const std::string>(std::move(frame));
}

// ---- builders ----

namespace {
Message message(MessageType type, decltype(Message::body) body) {
  Message m;
  m.type = type;
  m.body = std::move(body);
  return m;
}
}  // namespace

Message make_challenge(const std::string& nonce) { return message(MessageType::challenge, Challenge{kProtocolVersion, nonce}); }
Message make_welcome(const std::string& proof) { return message(MessageType::welcome, Welcome{kProtocolVersion, proof}); }
Message make_error(const std::string& code, const std::string& text) {
  return message(MessageType::error, ErrorMessage{code, text});
}
Message make_resume_message(const ResumeRequest& request) { return message(MessageType::resume, request); }
Message make_resumed_message(std::uint64_t generation, int restart_count, bool rebuilt) {
  return message(MessageType::resumed, Resumed{generation, restart_count, rebuilt});
}
Message make_round(const Assignment& assignment) { return message(MessageType::round, assignment); }
Message make_restart(const std::string& reason, bool counted, int restart_count, int max_restarts, bool failing,
                     bool failure) {
  return message(MessageType::restart, Restart{reason, counted, failing, restart_count, max_restarts, failure});
}
Message make_job_succeeded(const std::string& job_id, const std::string& goodput) {
  return message(MessageType::job_succeeded, JobSucceeded{job_id, goodput});
}
Message make_job_failed(const WorkerFailure& first_failure, const std::string& summary, const std::string& goodput,
                        bool quiet) {
  return message(MessageType::job_failed, JobFailed{first_failure, summary, goodput, quiet});
}
Message make_heartbeat_ack() { return message(MessageType::heartbeat_ack, Empty{}); }
Message make_status_reply(json status) { return message(MessageType::status_reply, StatusReply{std::move(status)}); }
Message make_waiting(const Waiting& waiting) { return message(MessageType::waiting, waiting); }
Message make_not_leader(const std::string& leader) { return message(MessageType::not_leader, NotLeader{leader}); }
Message make_probe() { return message(MessageType::probe, Empty{}); }
Message make_check_peer(const CheckPeer& check) { return message(MessageType::check_peer, check); }
Message make_drained(const Drained& drained) { return message(MessageType::drained, drained); }

Message make_hello(const Hello& hello) { return message(MessageType::hello, hello); }
Message make_status_request(const Hello& hello) { return message(MessageType::status, hello); }
Message make_join(const NodeSpec& spec) { return message(MessageType::join, spec); }
Message make_heartbeat(std::optional<NodeProgress> progress) {
  return message(MessageType::heartbeat, Heartbeat{progress});
}
Message make_failure(const WorkerFailure& failure) { return message(MessageType::failure, failure); }
Message make_success() { return message(MessageType::success, Empty{}); }
Message make_leave() { return message(MessageType::leave, Empty{}); }
Message make_stall(double stalled_for) { return message(MessageType::stall, Stall{stalled_for}); }
Message make_peer_alive(std::uint64_t id) { return message(MessageType::peer_alive, PeerAlive{id}); }
Message make_drain(const Drain& drain) { return message(MessageType::drain, drain); }

}  // namespace ddp::rdzv
