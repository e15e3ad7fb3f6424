#include "rendezvous/types.h"

namespace ddp::rdzv {
namespace {

// Reads `key` into `out` when present; absent keys keep the default (forward compatible).
template <typename T>
void read_opt(const nlohmann::json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_null()) it->get_to(out);
}

}  // namespace

void to_json(nlohmann::json& j, const Timeouts& v) {
  j = {{"join_timeout", v.join_timeout},
       {"last_call_timeout", v.last_call_timeout},
       {"heartbeat_interval", v.heartbeat_interval},
       {"heartbeat_timeout", v.heartbeat_timeout},
       {"probe_timeout", v.probe_timeout},
       {"shutdown_timeout", v.shutdown_timeout}};
}

void from_json(const nlohmann::json& j, Timeouts& v) {
  read_opt(j, "join_timeout", v.join_timeout);
  read_opt(j, "last_call_timeout", v.last_call_timeout);
  read_opt(j, "heartbeat_interval", v.heartbeat_interval);
  read_opt(j, "heartbeat_timeout", v.heartbeat_timeout);
  read_opt(j, "probe_timeout", v.probe_timeout);
  read_opt(j, "shutdown_timeout", v.shutdown_timeout);
}

void to_json(nlohmann::json& j, const StragglerPolicy& v) {
  j = {{"mode", v.mode}, {"factor", v.factor}, {"window", v.window}};
}

void from_json(const nlohmann::json& j, StragglerPolicy& v) {
  read_opt(j, "mode", v.mode);
  read_opt(j, "factor", v.factor);
  read_opt(j, "window", v.window);
}

void to_json(nlohmann::json& j, const NodeSpec& v) {
  j = {{"job_id", v.job_id},
       {"host", v.host},
       {"addr", v.addr},
       {"local_world_size", v.local_world_size},
       {"requested_rank", v.requested_rank},
       {"min_nodes", v.min_nodes},
       {"max_nodes", v.max_nodes},
       {"max_restarts", v.max_restarts},
       {"master_port", v.master_port},
       {"env_check", v.env_check},
       {"fingerprint", v.fingerprint},
       {"timeouts", v.timeouts},
       {"straggler", v.straggler}};
  if (v.progress) j["progress"] = true;  // absent otherwise: the join of an older agent
  if (v.peer_checks) j["peer_checks"] = true;  // the same
  if (v.spare) j["spare"] = true;
}

void from_json(const nlohmann::json& j, NodeSpec& v) {
  read_opt(j, "job_id", v.job_id);
  read_opt(j, "host", v.host);
  read_opt(j, "addr", v.addr);
  read_opt(j, "local_world_size", v.local_world_size);
  read_opt(j, "requested_rank", v.requested_rank);
  read_opt(j, "min_nodes", v.min_nodes);
  read_opt(j, "max_nodes", v.max_nodes);
  read_opt(j, "max_restarts", v.max_restarts);
  read_opt(j, "master_port", v.master_port);
  read_opt(j, "env_check", v.env_check);
  read_opt(j, "fingerprint", v.fingerprint);
  read_opt(j, "timeouts", v.timeouts);
  read_opt(j, "straggler", v.straggler);
  read_opt(j, "progress", v.progress);
  read_opt(j, "peer_checks", v.peer_checks);
  read_opt(j, "spare", v.spare);
}

void to_json(nlohmann::json& j, const Assignment& v) {
  j = {{"generation", v.generation},
       {"group_rank", v.group_rank},
       {"group_world_size", v.group_world_size},
       {"world_size", v.world_size},
       {"rank_offset", v.rank_offset},
       {"master_addr", v.master_addr},
       {"master_port", v.master_port},
       {"restart_count", v.restart_count},
       {"max_restarts", v.max_restarts}};
  if (!v.secret.empty()) j["secret"] = v.secret;
  if (!v.goodput.empty()) j["goodput"] = v.goodput;
  if (v.round_age > 0) j["round_age"] = v.round_age;
}

void from_json(const nlohmann::json& j, Assignment& v) {
  read_opt(j, "generation", v.generation);
  read_opt(j, "group_rank", v.group_rank);
  read_opt(j, "group_world_size", v.group_world_size);
  read_opt(j, "world_size", v.world_size);
  read_opt(j, "rank_offset", v.rank_offset);
  read_opt(j, "master_addr", v.master_addr);
  read_opt(j, "master_port", v.master_port);
  read_opt(j, "restart_count", v.restart_count);
  read_opt(j, "max_restarts", v.max_restarts);
  read_opt(j, "secret", v.secret);
  read_opt(j, "goodput", v.goodput);
  read_opt(j, "round_age", v.round_age);
}

void to_json(nlohmann::json& j, const WorkerFailure& v) {
  j = {{"host", v.host},
       {"rank", v.rank},
       {"local_rank", v.local_rank},
       {"exit_code", v.exit_code},
       {"signal", v.signal},
       {"pid", v.pid},
       {"timestamp", v.timestamp},
       {"error_file_message", v.error_file_message}};
  if (!v.fatal.empty()) j["fatal"] = v.fatal;
}

void from_json(const nlohmann::json& j, WorkerFailure& v) {
  read_opt(j, "host", v.host);
  read_opt(j, "rank", v.rank);
  read_opt(j, "local_rank", v.local_rank);
  read_opt(j, "exit_code", v.exit_code);
  read_opt(j, "signal", v.signal);
  read_opt(j, "pid", v.pid);
  read_opt(j, "timestamp", v.timestamp);
  read_opt(j, "error_file_message", v.error_file_message);
  read_opt(j, "fatal", v.fatal);
}

bool explains(const WorkerFailure& a, const WorkerFailure& b) {
  const bool a_signal = a.signal != 0, b_signal = b.signal != 0;
  if (a_signal != b_signal) return a_signal;
  if (a.timestamp != b.timestamp) return a.timestamp < b.timestamp;
  return a.rank < b.rank;
}

}  // namespace ddp::rdzv
