#include "rendezvous/protocol.h"

#include "rendezvous/endpoint.h"
#include "rendezvous/goodput.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

namespace ddp::rdzv {

using nlohmann::json;

// ---- message types ----

namespace {

struct TypeName {
  MessageType type;
  const char* name;
};
constexpr TypeName kTypeNames[] = {
    {MessageType::greeting, "greeting"},
    {MessageType::hello, "hello"},
    {MessageType::status, "status"},
    {MessageType::join, "join"},
    {MessageType::heartbeat, "heartbeat"},
    {MessageType::failure, "failure"},
    {MessageType::success, "success"},
    {MessageType::leave, "leave"},
    {MessageType::challenge, "challenge"},
    {MessageType::welcome, "welcome"},
    {MessageType::error, "error"},
    {MessageType::round, "round"},
    {MessageType::restart, "restart"},
    {MessageType::job_succeeded, "job_succeeded"},
    {MessageType::job_failed, "job_failed"},
    {MessageType::heartbeat_ack, "heartbeat_ack"},
    {MessageType::status_reply, "status_reply"},
    {MessageType::resume, "resume"},
    {MessageType::resumed, "resumed"},
    {MessageType::waiting, "waiting"},
    {MessageType::not_leader, "not_leader"},
    {MessageType::stall, "stall"},
    {MessageType::probe, "probe"},
    {MessageType::drain, "drain"},
    {MessageType::drained, "drained"},
    {MessageType::check_peer, "check_peer"},
    {MessageType::peer_alive, "peer_alive"},
};

std::optional<MessageType> type_from(std::string_view name) {
  for (const TypeName& t : kTypeNames) {
    if (name == t.name) return t.type;
  }
  return std::nullopt;
}

// Cuts `s` at `max` bytes (at a UTF-8 character boundary) and appends the marker.
void truncate_with_marker(std::string& s, std::size_t max) {
  if (s.size() <= max) return;
  std::size_t cut = max;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  const std::size_t dropped = s.size() - cut;
  s.resize(cut);
  s += std::string(kTruncatedMarker) + " (" + std::to_string(dropped) + " bytes cut)";
}

// Reads the fields of one JSON object with type and range checks; the first problem is kept.
class Fields {
 public:
  Fields(const json& object, std::string what) : object_(object), what_(std::move(what)) {
    if (!object_.is_object()) fail("is not a JSON object");
  }
  const std::optional<std::string>& error() const { return error_; }

  template <typename Int>
  void integer(const char* key, Int& out, long long min, long long max) {
    const json* v = find(key);
    if (v == nullptr) return;
    long long value = 0;
    if (v->is_number_unsigned()) {
      const auto u = v->get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<long long>::max())) return out_of_range(key, min, max);
      value = static_cast<long long>(u);
    } else if (v->is_number_integer()) {
      value = v->get<long long>();
    } else {
      return fail(std::string("field \"") + key + "\" must be an integer");
    }
    if (value < min || value > max) return out_of_range(key, min, max);
    out = static_cast<Int>(value);
  }
  void unsigned64(const char* key, std::uint64_t& out) {
    const json* v = find(key);
    if (v == nullptr) return;
    if (!v->is_number_unsigned()) return fail(std::string("field \"") + key + "\" must be an unsigned integer");
    out = v->get<std::uint64_t>();
  }
  void number(const char* key, double& out, double min, double max) {
    const json* v = find(key);
    if (v == nullptr) return;
    if (!v->is_number()) return fail(std::string("field \"") + key + "\" must be a number");
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < min || d > max) {
      return fail(std::string("field \"") + key + "\" must be between " + json(min).dump() + " and " +
                  json(max).dump() + ", got " + v->dump());
    }
    out = d;
  }
  void boolean(const char* key, bool& out) {
    const json* v = find(key);
    if (v == nullptr) return;
    if (!v->is_boolean()) return fail(std::string("field \"") + key + "\" must be true or false");
    out = v->get<bool>();
  }
  // Refuses strings over `max` bytes, or truncates them with the marker when `truncate`.
  void string(const char* key, std::string& out, std::size_t max, bool truncate = false) {
    const json* v = find(key);
    if (v == nullptr) return;
    if (!v->is_string()) return fail(std::string("field \"") + key + "\" must be a string");
    const auto& s = v->get_ref<const std::string&>();
    if (s.size() > max && !truncate) {
      return fail(std::string("field \"") + key + "\" is " + std::to_string(s.size()) + " bytes long; the limit is " +
                  std::to_string(max));
    }
    out = s;
    truncate_with_marker(out, max);
  }
  const json* object(const char* key) {
    const json* v = find(key);
    if (v != nullptr && !v->is_object()) {
      fail(std::string("field \"") + key + "\" must be a JSON object");
      return nullptr;
    }
    return v;
  }
  const json* require(const char* key) {
    const json* v = find(key);
    if (v == nullptr && !error_) fail(std::string("field \"") + key + "\" is missing");
    return v;
  }
  void fail(const std::string& why) {
    if (!error_) error_ = what_ + ": " + why;
  }

 private:
  const json* find(const char* key) {
    if (error_ || !object_.is_object()) return nullptr;
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  void out_of_range(const char* key, long long min, long long max) {
    fail(std::string("field \"") + key + "\" must be in " + std::to_string(min) + ".." + std::to_string(max) +
         ", got " + object_.at(key).dump());
  }

  const json& object_;
  std::string what_;
  std::optional<std::string> error_;
};

constexpr long long kIntMax = std::numeric_limits<int>::max();
constexpr long long kIntMin = std::numeric_limits<int>::min();

std::optional<std::string> read_timeouts(const json& j, Timeouts& t) {
  Fields f(j, "timeouts");
  f.number("join_timeout", t.join_timeout, 0, kMaxTimeoutSeconds);
  f.number("last_call_timeout", t.last_call_timeout, 0, kMaxTimeoutSeconds);
  f.number("heartbeat_interval", t.heartbeat_interval, 0, kMaxTimeoutSeconds);
  f.number("heartbeat_timeout", t.heartbeat_timeout, 0, kMaxTimeoutSeconds);
  f.number("probe_timeout", t.probe_timeout, 0, kMaxTimeoutSeconds);
  f.number("shutdown_timeout", t.shutdown_timeout, 0, kMaxTimeoutSeconds);
  return f.error();
}

std::optional<std::string> read_straggler(const json& j, StragglerPolicy& p) {
  Fields f(j, "straggler");
  f.string("mode", p.mode, 16);
  f.number("factor", p.factor, kMinStragglerFactor, kMaxStragglerFactor);
  f.number("window", p.window, 1, kMaxTimeoutSeconds);
  if (!f.error() && p.mode != "off" && p.mode != "report" && p.mode != "replace") {
    f.fail("field \"mode\" must be off, report or replace");
  }
  return f.error();
}

// Counts the fingerprint's entries and checks its shape; false with `why` when it breaks a limit.
bool check_fingerprint_value(const json& v, int depth, std::size_t& entries, std::string& why) {
  if (++entries > kMaxFingerprintEntries) {
    why = "has more than " + std::to_string(kMaxFingerprintEntries) + " entries";
    return false;
  }
  if (v.is_object()) {
    if (depth >= kMaxFingerprintDepth) {
      why = "nests objects deeper than " + std::to_string(kMaxFingerprintDepth) + " levels";
      return false;
    }
    for (const auto& item : v.items()) {
      if (!check_fingerprint_value(item.value(), depth + 1, entries, why)) return false;
    }
    return true;
  }
  if (v.is_array()) {
    for (const auto& e : v) {
      if (e.is_structured()) {
        why = "holds an array of objects or arrays (only arrays of plain values are allowed)";
        return false;
      }
      if (++entries > kMaxFingerprintEntries) {
        why = "has more than " + std::to_string(kMaxFingerprintEntries) + " entries";
        return false;
      }
    }
  }
  return true;
}

std::optional<std::string> check_fingerprint(const json& fp) {
  if (!fp.is_object()) return "fingerprint must be a JSON object";
  std::size_t entries = 0;
  std::string why;
  if (!check_fingerprint_value(fp, 0, entries, why)) return "fingerprint " + why;
  const std::size_t bytes = fp.dump(-1, ' ', false, json::error_handler_t::replace).size();
  if (bytes > kMaxFingerprintBytes) {
    return "fingerprint is " + std::to_string(bytes) + " bytes; the limit is " + std::to_string(kMaxFingerprintBytes);
  }
  return std::nullopt;
}

std::optional<std::string> read_node_spec(const json& j, NodeSpec& s) {
  Fields f(j, "join.node");
  f.string("job_id", s.job_id, kMaxIdBytes);
  f.string("host", s.host, kMaxHostBytes);
  f.string("addr", s.addr, kMaxHostBytes);
  f.integer("local_world_size", s.local_world_size, 1, kMaxLocalWorldSize);
  f.integer("requested_rank", s.requested_rank, -1, kMaxNodes - 1);
  f.integer("min_nodes", s.min_nodes, 1, kMaxNodes);
  f.integer("max_nodes", s.max_nodes, 1, kMaxNodes);
  f.integer("max_restarts", s.max_restarts, 0, kMaxRestarts);
  f.integer("master_port", s.master_port, 0, 65535);
  f.string("env_check", s.env_check, 16);
  f.boolean("progress", s.progress);
  f.boolean("peer_checks", s.peer_checks);
  f.boolean("spare", s.spare);
  if (const json* fp = f.object("fingerprint")) {
    if (auto err = check_fingerprint(*fp)) {
      f.fail(*err);
    } else {
      s.fingerprint = *fp;
    }
  }
  if (const json* t = f.object("timeouts")) {
    if (auto err = read_timeouts(*t, s.timeouts)) f.fail(*err);
  }
  if (const json* t = f.object("straggler")) {
    if (auto err = read_straggler(*t, s.straggler)) f.fail(*err);
  }
  return f.error();
}

std::optional<std::string> read_failure(const json& j, WorkerFailure& w) {
  Fields f(j, "failure");
  f.string("host", w.host, kMaxHostBytes, /*truncate=*/true);
  f.integer("rank", w.rank, -1, kIntMax);
  f.integer("local_rank", w.local_rank, -1, kIntMax);
  f.integer("exit_code", w.exit_code, kIntMin, kIntMax);
  f.integer("signal", w.signal, 0, 1024);
  f.integer("pid", w.pid, 0, kIntMax);
  f.number("timestamp", w.timestamp, 0, 1e12);
  f.string("error_file_message", w.error_file_message, kMaxFailureMessageBytes, /*truncate=*/true);
  f.string("fatal", w.fatal, kMaxFailureMessageBytes, /*truncate=*/true);
  return f.error();
}

std::optional<std::string> read_assignment(const json& j, Assignment& a) {
  Fields f(j, "round.assignment");
  f.unsigned64("generation", a.generation);
  f.integer("group_rank", a.group_rank, 0, kMaxNodes - 1);
  f.integer("group_world_size", a.group_world_size, 1, kMaxNodes);
  f.integer("world_size", a.world_size, 1, kIntMax);
  f.integer("rank_offset", a.rank_offset, 0, kIntMax);
  f.string("master_addr", a.master_addr, kMaxHostBytes);
  f.integer("master_port", a.master_port, 0, 65535);
  f.integer("restart_count", a.restart_count, 0, kMaxRestarts);
  f.integer("max_restarts", a.max_restarts, 0, kMaxRestarts);
  f.string("secret", a.secret, kMaxNonceBytes);
  if (auto g = j.find("goodput"); g != j.end() && !f.error()) {
    if (GoodputTotals::from_array(*g)) {
      a.goodput = g->get<std::vector<double>>();
    } else {
      f.fail("goodput must be an array of " + std::to_string(GoodputTotals::kArraySize) + " non-negative numbers");
    }
  }
  if (!f.error()) {
    if (a.group_rank >= a.group_world_size) f.fail("group_rank must be below group_world_size");
    if (static_cast<long long>(a.rank_offset) >= a.world_size) f.fail("rank_offset must be below world_size");
  }
  return f.error();
}

std::optional<std::string> read_hello(const json& j, Hello& h, const char* what) {
  Fields f(j, what);
  if (f.require("protocol_version")) f.integer("protocol_version", h.protocol_version, kIntMin, kIntMax);
  f.string("job_id", h.job_id, kMaxIdBytes);
  f.string("client_nonce", h.client_nonce, kMaxNonceBytes);
  f.string("proof", h.proof, kMaxNonceBytes);
  return f.error();
}

// Decodes the body of a message whose type is known; the first problem is returned.
// The messages of a connection itself: the handshake, heartbeats, leaving, errors.
std::optional<std::string> decode_connection_body(MessageType type, const json& j, Message& m) {
  switch (type) {
    case MessageType::greeting: {
      Fields f(j, "greeting");
      Greeting g;
      if (f.require("protocol_version")) f.integer("protocol_version", g.protocol_version, kIntMin, kIntMax);
      g.magic.clear();
      f.string("magic", g.magic, 64);
      m.body = std::move(g);
      return f.error();
    }
    case MessageType::hello:
    case MessageType::status: {
      Hello h;
      auto err = read_hello(j, h, to_string(type));
      m.body = std::move(h);
      return err;
    }
    case MessageType::challenge: {
      Fields f(j, "challenge");
      Challenge c;
      if (f.require("protocol_version")) f.integer("protocol_version", c.protocol_version, kIntMin, kIntMax);
      f.string("nonce", c.nonce, kMaxNonceBytes);
      c.magic.clear();
      f.string("magic", c.magic, 64);
      m.body = std::move(c);
      return f.error();
    }
    case MessageType::welcome: {
      Fields f(j, "welcome");
      Welcome w;
      f.integer("protocol_version", w.protocol_version, kIntMin, kIntMax);
      f.string("proof", w.proof, kMaxNonceBytes);
      m.body = std::move(w);
      return f.error();
    }
    case MessageType::error: {
      Fields f(j, "error");
      ErrorMessage e;
      f.string("code", e.code, 64, true);
      f.string("message", e.message, kMaxReasonBytes, true);
      m.body = std::move(e);
      return f.error();
    }
    case MessageType::heartbeat: {
      Fields f(j, "heartbeat");
      Heartbeat h;
      if (j.contains("step") || j.contains("checkpoint_step") || j.contains("checkpoint_interval") ||
          j.contains("busy") || j.contains("checkpoint_stall") || j.contains("first_step")) {
        NodeProgress p;
        f.integer("step", p.step, -1, kMaxReportedStep);
        f.integer("checkpoint_step", p.checkpoint_step, -1, kMaxReportedStep);
        f.number("checkpoint_interval", p.checkpoint_interval, 0, kMaxTimeoutSeconds);
        f.number("checkpoint_stall", p.checkpoint_stall, 0, kMaxTimeoutSeconds);
        f.integer("first_step", p.first_step, -1, kMaxReportedStep);
        if (j.contains("busy") && f.require("busy_rank")) {
          f.number("busy", p.busy, 0, kMaxTimeoutSeconds);
          f.integer("busy_rank", p.busy_local_rank, 0, kMaxLocalWorldSize - 1);
        }
        h.progress = p;
      }
      m.body = std::move(h);
      return f.error();
    }
    case MessageType::success:
    case MessageType::leave:
    case MessageType::heartbeat_ack:
    case MessageType::probe:
      m.body = Empty{};
      return std::nullopt;
    default:
      break;
  }
  return std::string("unknown message type");
}

// The messages of a silent node's detection: a stall report, and the indirect checks of a
// probed node (docs/rendezvous.md, "Silent nodes").
std::optional<std::string> decode_liveness_body(MessageType type, const json& j, Message& m) {
  switch (type) {
    case MessageType::stall: {
      Fields f(j, "stall");
      Stall s;
      if (f.require("stalled_for")) f.number("stalled_for", s.stalled_for, 0, kMaxTimeoutSeconds);
      m.body = s;
      return f.error();
    }
    case MessageType::check_peer: {
      Fields f(j, "check_peer");
      CheckPeer c;
      if (f.require("id")) f.integer("id", c.id, 1, static_cast<long long>(kMaxCheckId));
      if (f.require("addr")) f.string("addr", c.addr, kMaxHostBytes);
      if (f.require("port")) f.integer("port", c.port, 1, 65535);
      if (f.require("within")) f.number("within", c.within, 0.001, 60);
      if (!f.error() && c.addr.empty()) f.fail("field \"addr\" is empty");
      m.body = std::move(c);
      return f.error();
    }
    case MessageType::peer_alive: {
      Fields f(j, "peer_alive");
      PeerAlive a;
      if (f.require("id")) f.integer("id", a.id, 1, static_cast<long long>(kMaxCheckId));
      m.body = a;
      return f.error();
    }
    default:
      break;
  }
  return std::string("unknown message type");
}

// The messages of a job's rounds: joining, failures, assignments, restarts, the job's end.
std::optional<std::string> decode_round_body(MessageType type, const json& j, Message& m) {
  switch (type) {
    case MessageType::join: {
      Fields f(j, "join");
      NodeSpec spec;
      if (const json* node = f.require("node")) {
        if (auto err = read_node_spec(*node, spec)) f.fail(*err);
      }
      m.body = std::move(spec);
      return f.error();
    }
    case MessageType::failure: {
      Fields f(j, "failure");
      WorkerFailure w;
      if (const json* failure = f.require("failure")) {
        if (auto err = read_failure(*failure, w)) return err;
      }
      m.body = std::move(w);
      return f.error();
    }
    case MessageType::round: {
      Fields f(j, "round");
      Assignment a;
      if (const json* assignment = f.require("assignment")) {
        if (auto err = read_assignment(*assignment, a)) return err;
      }
      m.body = std::move(a);
      return f.error();
    }
    case MessageType::restart: {
      Fields f(j, "restart");
      Restart r;
      f.string("reason", r.reason, kMaxReasonBytes, true);
      f.boolean("counted", r.counted);
      f.boolean("failing", r.failing);
      f.boolean("failure", r.failure);
      f.boolean("quiet", r.quiet);
      f.integer("restart_count", r.restart_count, 0, kMaxRestarts);
      f.integer("max_restarts", r.max_restarts, 0, kMaxRestarts);
      m.body = std::move(r);
      return f.error();
    }
    case MessageType::job_succeeded: {
      Fields f(j, "job_succeeded");
      JobSucceeded s;
      f.string("job_id", s.job_id, kMaxIdBytes);
      if (j.contains("goodput")) f.string("goodput", s.goodput, kMaxReasonBytes, true);
      m.body = std::move(s);
      return f.error();
    }
    case MessageType::job_failed: {
      Fields f(j, "job_failed");
      JobFailed jf;
      if (const json* failure = f.require("failure")) {
        if (auto err = read_failure(*failure, jf.failure)) return err;
      }
      f.string("summary", jf.summary, kMaxReasonBytes, true);
      if (j.contains("goodput")) f.string("goodput", jf.goodput, kMaxReasonBytes, true);
      f.boolean("quiet", jf.quiet);
      m.body = std::move(jf);
      return f.error();
    }
    default:
      break;
  }
  return std::string("unknown message type");
}

// The messages that keep a job going across losses and show it: resume, progress, replicas,
// status.
std::optional<std::string> decode_continuity_body(MessageType type, const json& j, Message& m) {
  switch (type) {
    case MessageType::resume: {
      auto decoded = decode_resume(j);
      if (auto* err = std::get_if<std::string>(&decoded)) return *err;
      ResumeRequest& r = std::get<ResumeRequest>(decoded);
      // The same limits as a join's spec (fingerprint shape, sizes): a resume is no back door.
      if (auto err = validate_node_spec(r.node)) return "invalid resume message: \"node\": " + *err;
      m.body = std::move(r);
      return std::nullopt;
    }
    case MessageType::resumed: {
      Fields f(j, "resumed");
      Resumed r;
      f.unsigned64("generation", r.generation);
      f.integer("restart_count", r.restart_count, 0, kMaxRestarts);
      f.boolean("rebuilt", r.rebuilt);
      m.body = r;
      return f.error();
    }
    case MessageType::waiting: {
      Fields f(j, "waiting");
      Waiting w;
      f.string("job_id", w.job_id, kMaxIdBytes);
      f.integer("waiting", w.waiting, 0, kIntMax);
      f.integer("rejoining", w.rejoining, 0, kIntMax);
      f.integer("min_nodes", w.min_nodes, 1, kMaxNodes);
      f.integer("max_nodes", w.max_nodes, 1, kMaxNodes);
      double left = -1;
      f.number("join_left", left, 0, kMaxTimeoutSeconds);
      if (left >= 0) w.join_left = left;
      left = -1;
      f.number("last_call_left", left, 0, kMaxTimeoutSeconds);
      if (left >= 0) w.last_call_left = left;
      if (!f.error() && w.min_nodes > w.max_nodes) f.fail("min_nodes must not exceed max_nodes");
      m.body = std::move(w);
      return f.error();
    }
    case MessageType::not_leader: {
      Fields f(j, "not_leader");
      NotLeader n;
      f.string("leader", n.leader, kMaxEndpointBytes);
      if (!f.error() && !valid_leader_endpoint(n.leader)) f.fail("field \"leader\" is not HOST:PORT");
      m.body = std::move(n);
      return f.error();
    }
    case MessageType::status_reply: {
      Fields f(j, "status_reply");
      StatusReply r;
      if (const json* status = f.object("status")) r.status = *status;
      if (!f.error() && !r.status.is_object()) f.fail("field \"status\" is missing");
      m.body = std::move(r);
      return f.error();
    }
    default:
      break;
  }
  return std::string("unknown message type");
}

// An operator's drain and its answer.
std::optional<std::string> decode_drain_body(MessageType type, const json& j, Message& m) {
  switch (type) {
    case MessageType::drain: {
      Drain d;
      if (auto err = read_hello(j, d.hello, "drain")) return err;
      Fields f(j, "drain");
      if (f.require("job")) f.string("job", d.job, kMaxIdBytes);
      if (f.require("node")) f.string("node", d.node, kMaxHostBytes);
      f.boolean("force", d.force);
      if (!f.error() && (d.job.empty() || d.node.empty())) f.fail("fields \"job\" and \"node\" must not be empty");
      m.body = std::move(d);
      return f.error();
    }
    case MessageType::drained: {
      Fields f(j, "drained");
      Drained d;
      f.string("job_id", d.job_id, kMaxIdBytes);
      f.string("node", d.node, kMaxReasonBytes, true);
      f.string("message", d.message, kMaxReasonBytes, true);
      m.body = std::move(d);
      return f.error();
    }
    default:
      break;
  }
  return std::string("unknown message type");
}

std::optional<std::string> decode_body(MessageType type, const json& j, Message& m) {
  switch (type) {
    case MessageType::greeting:
    case MessageType::hello:
    case MessageType::status:
    case MessageType::challenge:
    case MessageType::welcome:
    case MessageType::error:
    case MessageType::heartbeat:
    case MessageType::success:
    case MessageType::leave:
    case MessageType::heartbeat_ack:
    case MessageType::probe:
      return decode_connection_body(type, j, m);
    case MessageType::stall:
    case MessageType::check_peer:
    case MessageType::peer_alive:
      return decode_liveness_body(type, j, m);
    case MessageType::drain:
    case MessageType::drained:
      return decode_drain_body(type, j, m);
    case MessageType::join:
    case MessageType::failure:
    case MessageType::round:
    case MessageType::restart:
    case MessageType::job_succeeded:
    case MessageType::job_failed:
      return decode_round_body(type, j, m);
    case MessageType::resume:
    case MessageType::resumed:
    case MessageType::waiting:
    case MessageType::not_leader:
    case MessageType::status_reply:
      return decode_continuity_body(type, j, m);
  }
  return std::string("unknown message type");
}

}  // namespace

// Job records in etcd (rendezvous/job_record.cpp) reuse the message field checks.
std::optional<std::string> decode_timeouts(const json& j, Timeouts& t) { return read_timeouts(j, t); }
std::optional<std::string> decode_straggler(const json& j, StragglerPolicy& p) { return read_straggler(j, p); }
std::optional<std::string> decode_failure(const json& j, WorkerFailure& w) { return read_failure(j, w); }

const char* to_string(MessageType type) {
  for (const TypeName& t : kTypeNames) {
    if (t.type == type) return t.name;
  }
  return "?";
}

Decoded decode(std::string_view payload) {
  Decoded out;
  if (json_depth(payload, kMaxJsonDepth) > kMaxJsonDepth) {
    out.error = ProtocolError{"bad_json", "JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                                              " levels in a frame of " + std::to_string(payload.size()) + " bytes"};
    return out;
  }
  json j = json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    out.error = ProtocolError{"bad_json", "malformed JSON in frame of " + std::to_string(payload.size()) +
                                              " bytes: the rendezvous protocol sends one JSON object per frame"};
    return out;
  }
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    out.error = ProtocolError{"bad_message", "message is not a JSON object with a string \"type\""};
    return out;
  }
  const std::string& name = j["type"].get_ref<const std::string&>();
  auto type = type_from(name);
  if (!type) {
    out.error = ProtocolError{"bad_message", "unknown message type \"" + name.substr(0, 64) + "\""};
    return out;
  }
  Message m;
  m.type = *type;
  if (auto err = decode_body(*type, j, m)) {
    out.error = ProtocolError{*type == MessageType::join     ? "bad_join"
                              : *type == MessageType::resume ? "bad_resume"
                                                             : "bad_message",
                              "malformed \"" + std::string(to_string(*type)) + "\" message: " + *err};
    return out;
  }
  out.message = std::move(m);
  return out;
}

std::optional<std::string> validate_node_spec(const NodeSpec& s) {
  // The decoder's range checks, on the struct (specs built in-process: local rendezvous, tests;
  // cheap enough to run again on every join the server decoded).
  auto range = [](const char* name, long long v, long long min, long long max) -> std::optional<std::string> {
    if (v >= min && v <= max) return std::nullopt;
    return std::string(name) + " must be in " + std::to_string(min) + ".." + std::to_string(max) + ", got " +
           std::to_string(v);
  };
  auto length = [](const char* name, const std::string& v, std::size_t max) -> std::optional<std::string> {
    if (v.size() <= max) return std::nullopt;
    return std::string(name) + " is " + std::to_string(v.size()) + " bytes long; the limit is " + std::to_string(max);
  };
  for (auto err : {length("job_id", s.job_id, kMaxIdBytes), length("host", s.host, kMaxHostBytes),
                   length("addr", s.addr, kMaxHostBytes), length("env_check", s.env_check, 16),
                   range("local_world_size", s.local_world_size, 1, kMaxLocalWorldSize),
                   range("requested_rank", s.requested_rank, -1, kMaxNodes - 1),
                   range("min_nodes", s.min_nodes, 1, kMaxNodes), range("max_nodes", s.max_nodes, 1, kMaxNodes),
                   range("max_restarts", s.max_restarts, 0, kMaxRestarts),
                   range("master_port", s.master_port, 0, 65535)}) {
    if (err) return err;
  }
  for (double t : {s.timeouts.join_timeout, s.timeouts.last_call_timeout, s.timeouts.heartbeat_interval,
                   s.timeouts.heartbeat_timeout, s.timeouts.probe_timeout, s.timeouts.shutdown_timeout}) {
    if (!std::isfinite(t) || t < 0 || t > kMaxTimeoutSeconds) {
      return "timeouts must be between 0 and " + json(kMaxTimeoutSeconds).dump() + " s";
    }
  }
  StragglerPolicy straggler;
  if (auto err = read_straggler(json(s.straggler), straggler)) return err;
  if (!s.fingerprint.is_object()) return std::string("fingerprint must be a JSON object");
  std::size_t entries = 0;
  std::string why;
  if (!check_fingerprint_value(s.fingerprint, 0, entries, why)) return "fingerprint " + why;
  return std::nullopt;
}

}  // namespace ddp::rdzv
