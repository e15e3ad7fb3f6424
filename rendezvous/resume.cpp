#include "rendezvous/resume.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "rendezvous/goodput.h"
#include "rendezvous/json_fields.h"
#include "rendezvous/protocol.h"

namespace ddp::rdzv {

using nlohmann::json;

namespace {

using Bad = json_fields::FieldError;
using json_fields::field;
using json_fields::integer;

std::string text(const json& obj, const char* key, bool allow_empty, std::size_t max = kMaxResumeStringBytes) {
  return json_fields::text(obj, key, allow_empty, max);
}

double seconds(const json& obj, const char* key, bool allow_zero) {
  const json& v = field(obj, key);
  if (!v.is_number()) throw Bad{std::string("\"timeouts.") + key + "\" must be a number"};
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < 0 || (!allow_zero && d == 0) || d > kMaxResumeSeconds) {
    throw Bad{std::string("\"timeouts.") + key + "\" must be a finite number of seconds in " +
              (allow_zero ? "[0, " : "(0, ") + std::to_string(static_cast<long long>(kMaxResumeSeconds)) + "]"};
  }
  return d;
}

NodeSpec decode_node(const json& j) {
  if (!j.is_object()) throw Bad{"\"node\" must be an object"};
  NodeSpec s;
  s.job_id = text(j, "job_id", false);
  s.host = text(j, "host", true);
  s.addr = text(j, "addr", true);
  s.local_world_size = static_cast<int>(integer(j, "local_world_size", 1, 1 << 16));
  s.min_nodes = static_cast<int>(integer(j, "min_nodes", 1, kMaxResumeNodes));
  s.max_nodes = static_cast<int>(integer(j, "max_nodes", s.min_nodes, kMaxResumeNodes));
  s.requested_rank = static_cast<int>(integer(j, "requested_rank", -1, s.min_nodes - 1));
  s.max_restarts = static_cast<int>(integer(j, "max_restarts", 0, kMaxResumeRestarts));
  s.master_port = static_cast<int>(integer(j, "master_port", 0, 65535));
  s.env_check = text(j, "env_check", true, 16);
  if (s.env_check != "strict" && s.env_check != "warn" && s.env_check != "off") {
    throw Bad{"\"env_check\" must be strict, warn or off"};
  }
  if (auto fp = j.find("fingerprint"); fp != j.end()) {
    if (!fp->is_object()) throw Bad{"\"fingerprint\" must be an object"};
    s.fingerprint = *fp;  // compared as a whole; the frame limit bounds its size
  }
  const json& t = field(j, "timeouts");
  if (!t.is_object()) throw Bad{"\"timeouts\" must be an object"};
  s.timeouts.join_timeout = seconds(t, "join_timeout", false);
  s.timeouts.last_call_timeout = seconds(t, "last_call_timeout", true);
  s.timeouts.heartbeat_interval = seconds(t, "heartbeat_interval", false);
  s.timeouts.heartbeat_timeout = seconds(t, "heartbeat_timeout", false);
  if (t.contains("probe_timeout")) s.timeouts.probe_timeout = seconds(t, "probe_timeout", true);
  s.timeouts.shutdown_timeout = seconds(t, "shutdown_timeout", true);
  if (auto st = j.find("straggler"); st != j.end()) {  // absent from an agent that predates it
    if (auto err = decode_straggler(*st, s.straggler)) throw Bad{*err};
  }
  return s;
}

Assignment decode_assignment(const json& j, const NodeSpec& node) {
  if (!j.is_object()) throw Bad{"\"assignment\" must be an object"};
  Assignment a;
  // Generations are counted from 1; 2^53 keeps them exact in every JSON implementation.
  a.generation = static_cast<std::uint64_t>(integer(j, "generation", 1, (1LL << 53)));
  a.group_world_size = static_cast<int>(integer(j, "group_world_size", 1, node.max_nodes));
  a.group_rank = static_cast<int>(integer(j, "group_rank", 0, a.group_world_size - 1));
  a.world_size = static_cast<int>(
      integer(j, "world_size", node.local_world_size, std::numeric_limits<int>::max()));
  a.rank_offset = static_cast<int>(integer(j, "rank_offset", 0, a.world_size - node.local_world_size));
  a.master_addr = text(j, "master_addr", false);
  a.master_port = static_cast<int>(integer(j, "master_port", 0, 65535));
  a.max_restarts = static_cast<int>(integer(j, "max_restarts", node.max_restarts, node.max_restarts));
  a.restart_count = static_cast<int>(integer(j, "restart_count", 0, a.max_restarts));
  if (auto g = j.find("goodput"); g != j.end()) {
    if (!GoodputTotals::from_array(*g)) {
      throw Bad{"\"goodput\" must be an array of " + std::to_string(GoodputTotals::kArraySize) + " non-negative numbers"};
    }
    a.goodput = g->get<std::vector<double>>();
  }
  if (auto age = j.find("round_age"); age != j.end()) {
    if (!age->is_number() || !std::isfinite(age->get<double>()) || age->get<double>() < 0 ||
        age->get<double>() > kMaxResumeSeconds) {
      throw Bad{"\"round_age\" must be a finite number of seconds in [0, " +
                std::to_string(static_cast<long long>(kMaxResumeSeconds)) + "]"};
    }
    a.round_age = age->get<double>();
  }
  return a;
}

}  // namespace

bool is_hex(const std::string& s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

json make_resume(const ResumeRequest& r) {
  return {{"type", "resume"},
          {"resume", {{"job_id", r.job_id}, {"secret", r.secret}, {"node", r.node}, {"assignment", r.assignment}}}};
}

json make_resumed(std::uint64_t generation, int restart_count, bool rebuilt) {
  return {{"type", "resumed"}, {"generation", generation}, {"restart_count", restart_count}, {"rebuilt", rebuilt}};
}

std::variant<ResumeRequest, std::string> decode_resume(const json& message) {
  try {
    if (!message.is_object()) throw Bad{"not an object"};
    const json& body = field(message, "resume");
    if (!body.is_object()) throw Bad{"\"resume\" must be an object"};
    ResumeRequest r;
    r.job_id = text(body, "job_id", false);
    r.secret = text(body, "secret", false, kMaxSecretChars);
    if (r.secret.size() < kMinSecretChars || !is_hex(r.secret)) {
      throw Bad{"\"secret\" must be " + std::to_string(kMinSecretChars) + ".." + std::to_string(kMaxSecretChars) +
                " lowercase hex characters"};
    }
    r.node = decode_node(field(body, "node"));
    if (r.node.job_id != r.job_id) throw Bad{"\"node.job_id\" differs from \"job_id\""};
    r.assignment = decode_assignment(field(body, "assignment"), r.node);
    return r;
  } catch (const Bad& bad) {
    return "invalid resume message: " + bad.what;
  } catch (const json::exception& e) {
    return std::string("invalid resume message: ") + e.what();
  }
}

}  // namespace ddp::rdzv
