// The encoder of the rendezvous protocol (rendezvous/protocol.h): a Message to its JSON object
// and its frame, and the frames of one round spliced per node. The decoder, which validates what
// a peer sends, is protocol.cpp.
#include "rendezvous/protocol.h"

#include <algorithm>
#include <charconv>
#include <stdexcept>

namespace ddp::rdzv {

using nlohmann::json;

namespace {

// The proof of a hello, a status or a drain request; only a hello must name its job.
void add_hello_fields(const Hello& h, bool job_id_always, json& j) {
  j["protocol_version"] = h.protocol_version;
  if (!h.job_id.empty() || job_id_always) j["job_id"] = h.job_id;
  j["client_nonce"] = h.client_nonce;
  j["proof"] = h.proof;
}

// The fields of the messages of a connection itself (the handshake, errors), stall reports and
// the operator's drain; none for the others.
void add_connection_fields(const Message& m, json& j) {
  switch (m.type) {
    case MessageType::greeting: {
      const auto& g = std::get<Greeting>(m.body);
      j["protocol_version"] = g.protocol_version;
      j["magic"] = g.magic;
      break;
    }
    case MessageType::hello:
    case MessageType::status:
      add_hello_fields(std::get<Hello>(m.body), m.type == MessageType::hello, j);
      break;
    case MessageType::challenge: {
      const auto& c = std::get<Challenge>(m.body);
      j["protocol_version"] = c.protocol_version;
      j["nonce"] = c.nonce;
      j["magic"] = c.magic;
      break;
    }
    case MessageType::welcome: {
      const auto& w = std::get<Welcome>(m.body);
      j["protocol_version"] = w.protocol_version;
      j["proof"] = w.proof;
      break;
    }
    case MessageType::error: {
      const auto& e = std::get<ErrorMessage>(m.body);
      j["code"] = e.code;
      j["message"] = e.message;
      break;
    }
    case MessageType::stall:
      j["stalled_for"] = std::get<Stall>(m.body).stalled_for;
      break;
    case MessageType::check_peer: {
      const auto& c = std::get<CheckPeer>(m.body);
      j["id"] = c.id;
      j["addr"] = c.addr;
      j["port"] = c.port;
      j["within"] = c.within;
      break;
    }
    case MessageType::peer_alive:
      j["id"] = std::get<PeerAlive>(m.body).id;
      break;
    case MessageType::drain: {
      const auto& d = std::get<Drain>(m.body);
      add_hello_fields(d.hello, false, j);
      j["job"] = d.job;
      j["node"] = d.node;
      j["force"] = d.force;
      break;
    }
    case MessageType::drained: {
      const auto& d = std::get<Drained>(m.body);
      j["job_id"] = d.job_id;
      j["node"] = d.node;
      j["message"] = d.message;
      break;
    }
    default:
      break;
  }
}

// A heartbeat's progress of the node's workers; busy and its rank only when measured.
void add_progress_fields(const NodeProgress& p, json& j) {
  j["step"] = p.step;
  j["checkpoint_step"] = p.checkpoint_step;
  j["checkpoint_interval"] = p.checkpoint_interval;
  if (p.checkpoint_stall > 0) j["checkpoint_stall"] = p.checkpoint_stall;
  if (p.first_step >= 0) j["first_step"] = p.first_step;
  if (p.busy_local_rank >= 0) {
    j["busy"] = p.busy;
    j["busy_rank"] = p.busy_local_rank;
  }
}

// What ends a round or a job: restart, job_succeeded, job_failed.
void add_verdict_fields(const Message& m, json& j) {
  if (m.type == MessageType::restart) {
    const auto& r = std::get<Restart>(m.body);
    j["reason"] = r.reason;
    j["counted"] = r.counted;
    if (r.failing) j["failing"] = true;  // absent: false (older agents ignore it)
    if (r.failure) j["failure"] = true;  // the same
    j["restart_count"] = r.restart_count;
    j["max_restarts"] = r.max_restarts;
    if (r.quiet) j["quiet"] = true;  // absent: false
  } else if (m.type == MessageType::job_succeeded) {
    const auto& s = std::get<JobSucceeded>(m.body);
    j["job_id"] = s.job_id;
    if (!s.goodput.empty()) j["goodput"] = s.goodput;  // to one node of the job only
  } else {
    const auto& f = std::get<JobFailed>(m.body);
    j["failure"] = f.failure;
    j["summary"] = f.summary;
    if (!f.goodput.empty()) j["goodput"] = f.goodput;
    if (f.quiet) j["quiet"] = true;
  }
}

}  // namespace

json to_json(const Message& m) {
  json j = {{"type", to_string(m.type)}};
  switch (m.type) {
    case MessageType::join:
      j["node"] = std::get<NodeSpec>(m.body);
      break;
    case MessageType::failure:
      j["failure"] = std::get<WorkerFailure>(m.body);
      break;
    case MessageType::greeting:
    case MessageType::hello:
    case MessageType::status:
    case MessageType::challenge:
    case MessageType::welcome:
    case MessageType::error:
    case MessageType::stall:
    case MessageType::check_peer:
    case MessageType::peer_alive:
    case MessageType::drain:
    case MessageType::drained:
      add_connection_fields(m, j);
      break;
    case MessageType::heartbeat:
      if (const auto& p = std::get<Heartbeat>(m.body).progress) add_progress_fields(*p, j);
      break;
    case MessageType::success:
    case MessageType::leave:
    case MessageType::heartbeat_ack:
    case MessageType::probe:
      break;
    case MessageType::round:
      j["assignment"] = std::get<Assignment>(m.body);
      break;
    case MessageType::restart:
    case MessageType::job_succeeded:
    case MessageType::job_failed:
      add_verdict_fields(m, j);
      break;
    case MessageType::status_reply:
      j["status"] = std::get<StatusReply>(m.body).status;
      break;
    case MessageType::resume:
      return make_resume(std::get<ResumeRequest>(m.body));
    case MessageType::resumed: {
      const auto& r = std::get<Resumed>(m.body);
      return make_resumed(r.generation, r.restart_count, r.rebuilt);
    }
    case MessageType::waiting: {
      const auto& w = std::get<Waiting>(m.body);
      j["job_id"] = w.job_id;
      j["waiting"] = w.waiting;
      j["rejoining"] = w.rejoining;
      j["min_nodes"] = w.min_nodes;
      j["max_nodes"] = w.max_nodes;
      if (w.join_left) j["join_left"] = *w.join_left;
      if (w.last_call_left) j["last_call_left"] = *w.last_call_left;
      break;
    }
    case MessageType::not_leader:
      j["leader"] = std::get<NotLeader>(m.body).leader;
      break;
  }
  return j;
}

Frame encode(const Message& message) { return encode_frame(to_json(message)); }

namespace {

// Where a node's value goes in the round message dumped with group_rank 0, rank_offset 0 and
// secret "0": the key's quoted name and ':' occur nowhere else in the text, because a string
// value's quotes are escaped inside it. The secret's slot takes its comma (it is never the first
// key: "generation" sorts before it), so that a node without one gets no secret field at all.
struct Marker {
  std::string_view text;  // as the dump writes the key with its placeholder
  std::size_t kept;       // how much of it stays in the text before the slot
};
constexpr Marker kGroupRankMarker{"\"group_rank\":0", sizeof("\"group_rank\":") - 1};
constexpr Marker kRankOffsetMarker{"\"rank_offset\":0", sizeof("\"rank_offset\":") - 1};
constexpr Marker kSecretMarker{",\"secret\":\"0\"", 0};

void append_int(std::string& out, int value) {
  char digits[16];
  const auto end = std::to_chars(digits, digits + sizeof digits, value).ptr;
  out.append(digits, end);
}

}  // namespace

RoundFrames::RoundFrames(Assignment shared) {
  shared.group_rank = 0;
  shared.rank_offset = 0;
  shared.secret = "0";
  const std::string text = to_json(make_round(shared)).dump(-1, ' ', false, json::error_handler_t::replace);
  struct Found {
    std::size_t at;
    const Marker* marker;
    Slot slot;
  };
  std::vector<Found> found;
  for (const auto& [marker, slot] : {std::pair{&kGroupRankMarker, Slot::group_rank},
                                     std::pair{&kRankOffsetMarker, Slot::rank_offset},
                                     std::pair{&kSecretMarker, Slot::secret}}) {
    const std::size_t at = text.find(marker->text);
    if (at == std::string::npos) throw std::logic_error("round message without " + std::string(marker->text));
    found.push_back({at, marker, slot});
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.at < b.at; });
  std::size_t from = 0;
  for (const Found& f : found) {
    pieces_.push_back({text.substr(from, f.at + f.marker->kept - from), f.slot});
    from = f.at + f.marker->text.size();
  }
  pieces_.push_back({text.substr(from), Slot::none});
  for (const Piece& p : pieces_) bytes_ += p.text.size();
}

Frame RoundFrames::frame(int group_rank, int rank_offset, const std::string& secret) const {
  std::string out(kFrameHeaderBytes, '\0');
  out.reserve(kFrameHeaderBytes + bytes_ + 2 * 11 + secret.size() + 16);
  for (const Piece& p : pieces_) {
    out += p.text;
    switch (p.then) {
      case Slot::group_rank:
        append_int(out, group_rank);
        break;
      case Slot::rank_offset:
        append_int(out, rank_offset);
        break;
      case Slot::secret:
        if (secret.empty()) break;  // as to_json(Assignment) leaves it out
        out += ",\"secret\":";
        if (is_hex(secret)) {
          out.append("\"").append(secret).append("\"");  // as every secret is: nothing to escape
        } else {
          out += json(secret).dump(-1, ' ', false, json::error_handler_t::replace);
        }
        break;
      case Slot::none:
        break;
    }
  }
  write_frame_header(static_cast<std::uint32_t>(out.size() - kFrameHeaderBytes), reinterpret_cast<unsigned char*>(out.data()));
  return std::make_shared<const std::string>(std::move(out));
}

}  // namespace ddp::rdzv
