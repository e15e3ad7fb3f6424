#include "rendezvous/job_record.h"

#include <cstdint>
#include <limits>

#include <nlohmann/json.hpp>

#include "rendezvous/goodput.h"
#include "rendezvous/json_fields.h"
#include "rendezvous/protocol.h"
#include "rendezvous/resume.h"

namespace ddp::rdzv {

using nlohmann::json;

namespace {

using Bad = json_fields::FieldError;
using json_fields::field;
using json_fields::integer;
using json_fields::boolean;

constexpr int kRecordVersion = 1;
constexpr int kMaxRecordDepth = 8;
constexpr std::size_t kMaxRecordSummaryBytes = 64u << 10;  // a finished job's summary (cut when longer)

std::string text(const json& obj, const char* key, bool allow_empty, std::size_t max = kMaxHostBytes) {
  return json_fields::text(obj, key, allow_empty, max);
}

WorkerFailure failure(const json& j) {
  WorkerFailure w;
  if (!j.is_object()) throw Bad{"a failure must be an object"};
  if (auto err = decode_failure(j, w)) throw Bad{*err};
  return w;
}

bool is_secret(const std::string& s) {
  if (s.size() < kMinSecretChars || s.size() > kMaxSecretChars) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

JobRecord::State state_named(const std::string& s) {
  for (auto st : {JobRecord::State::gathering, JobRecord::State::running, JobRecord::State::succeeded,
                  JobRecord::State::failed}) {
    if (s == to_string(st)) return st;
  }
  throw Bad{"\"state\" must be gathering, running, succeeded or failed"};
}

// The running round: one member per group rank 0..N-1, local world sizes that add up.
void decode_round(const json& j, JobRecord& r) {
  r.group_world_size = static_cast<int>(integer(j, "group_world_size", 1, r.max_nodes));
  r.world_size = static_cast<int>(integer(j, "world_size", 1, std::numeric_limits<int>::max()));
  r.master_addr = text(j, "master_addr", false);
  r.master_port = static_cast<int>(integer(j, "master_port", 0, 65535));
  const json& members = field(j, "members");
  if (!members.is_array()) throw Bad{"\"members\" must be an array"};
  if (members.size() != static_cast<std::size_t>(r.group_world_size)) {
    throw Bad{"\"members\" lists " + std::to_string(members.size()) + " nodes for a round of " +
              std::to_string(r.group_world_size)};
  }
  std::vector<bool> seen(static_cast<std::size_t>(r.group_world_size), false);
  long long world = 0;
  for (const json& m : members) {
    if (!m.is_object()) throw Bad{"a member must be an object"};
    RecordMember rm;
    rm.group_rank = static_cast<int>(integer(m, "group_rank", 0, r.group_world_size - 1));
    if (seen[static_cast<std::size_t>(rm.group_rank)]) {
      throw Bad{"group rank " + std::to_string(rm.group_rank) + " is listed twice"};
    }
    seen[static_cast<std::size_t>(rm.group_rank)] = true;
    rm.host = text(m, "host", true);
    rm.addr = text(m, "addr", true);
    rm.local_world_size = static_cast<int>(integer(m, "local_world_size", 1, 1 << 16));
    rm.requested_rank = static_cast<int>(integer(m, "requested_rank", -1, r.min_nodes - 1));
    rm.secret = text(m, "secret", false, kMaxSecretChars);
    if (!is_secret(rm.secret)) throw Bad{"a member's \"secret\" is not " + std::to_string(kMinSecretChars) + ".." +
                                         std::to_string(kMaxSecretChars) + " lowercase hex characters"};
    world += rm.local_world_size;
    r.members.push_back(std::move(rm));
  }
  if (world != r.world_size) {
    throw Bad{"\"world_size\" " + std::to_string(r.world_size) + " is not the sum of the members' local world sizes (" +
              std::to_string(world) + ")"};
  }
}

}  // namespace

const char* to_string(JobRecord::State s) {
  switch (s) {
    case JobRecord::State::gathering: return "gathering";
    case JobRecord::State::running: return "running";
    case JobRecord::State::succeeded: return "succeeded";
    case JobRecord::State::failed: return "failed";
  }
  return "?";
}

std::string encode_record(const JobRecord& r) {
  json j = {{"version", kRecordVersion},
            {"job_id", r.job_id},
            {"state", to_string(r.state)},
            {"min_nodes", r.min_nodes},
            {"max_nodes", r.max_nodes},
            {"max_restarts", r.max_restarts},
            {"timeouts", r.timeouts},
            {"straggler", r.straggler},
            {"generation", r.generation},
            {"restarts_used", r.restarts_used},
            {"failing", r.failing},
            {"failures", json::array()},
            {"summary", r.summary.substr(0, kMaxRecordSummaryBytes)}};
  for (std::size_t i = 0; i < r.failures.size() && i < kMaxRecordFailures; ++i) j["failures"].push_back(r.failures[i]);
  if (r.fatal) j["fatal"] = *r.fatal;
  if (!r.goodput.empty()) j["goodput"] = r.goodput;
  if (r.state == JobRecord::State::running) {
    json members = json::array();
    for (const RecordMember& m : r.members) {
      members.push_back({{"group_rank", m.group_rank},
                         {"host", m.host},
                         {"addr", m.addr},
                         {"local_world_size", m.local_world_size},
                         {"requested_rank", m.requested_rank},
                         {"secret", m.secret}});
    }
    j["round"] = {{"group_world_size", r.group_world_size},
                  {"world_size", r.world_size},
                  {"master_addr", r.master_addr},
                  {"master_port", r.master_port},
                  {"members", std::move(members)}};
  }
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::variant<JobRecord, std::string> decode_record(std::string_view input) {
  if (input.size() > kMaxRecordBytes) {
    return "a job record of " + std::to_string(input.size()) + " bytes is over the limit of " +
           std::to_string(kMaxRecordBytes);
  }
  if (json_depth(input, kMaxRecordDepth) > kMaxRecordDepth) {
    return "a job record nested deeper than " + std::to_string(kMaxRecordDepth) + " levels";
  }
  json j = json::parse(input.begin(), input.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::string("a job record that is not a JSON object");
  JobRecord r;
  try {
    r.job_id = text(j, "job_id", false, kMaxResumeStringBytes);
  } catch (const Bad& bad) {
    return "a job record: " + bad.what;
  }
  try {
    if (integer(j, "version", 1, 1000) != kRecordVersion) {
      throw Bad{"version " + j["version"].dump() + " is not " + std::to_string(kRecordVersion) +
                " (written by another release of ddp-rendezvous)"};
    }
    r.state = state_named(text(j, "state", false, 16));
    r.min_nodes = static_cast<int>(integer(j, "min_nodes", 1, kMaxNodes));
    r.max_nodes = static_cast<int>(integer(j, "max_nodes", r.min_nodes, kMaxNodes));
    r.max_restarts = static_cast<int>(integer(j, "max_restarts", 0, kMaxRestarts));
    const json& t = field(j, "timeouts");
    if (!t.is_object()) throw Bad{"\"timeouts\" must be an object"};
    if (auto err = decode_timeouts(t, r.timeouts)) throw Bad{*err};
    if (r.timeouts.heartbeat_timeout <= 0 || r.timeouts.join_timeout <= 0) {
      throw Bad{"\"timeouts\": join_timeout and heartbeat_timeout must be positive"};
    }
    if (auto st = j.find("straggler"); st != j.end()) {  // absent from a record that predates it
      if (auto err = decode_straggler(*st, r.straggler)) throw Bad{*err};
    }
    r.generation = static_cast<std::uint64_t>(integer(j, "generation", 0, 1LL << 53));
    r.restarts_used = static_cast<int>(integer(j, "restarts_used", 0, r.max_restarts));
    r.failing = boolean(j, "failing");
    const json& failures = field(j, "failures");
    if (!failures.is_array() || failures.size() > kMaxRecordFailures) {
      throw Bad{"\"failures\" must be an array of at most " + std::to_string(kMaxRecordFailures)};
    }
    for (const json& f : failures) r.failures.push_back(failure(f));
    if (auto it = j.find("fatal"); it != j.end()) r.fatal = failure(*it);
    r.summary = text(j, "summary", true, kMaxRecordSummaryBytes);
    if (auto g = j.find("goodput"); g != j.end()) {  // absent from a record that predates it
      if (!GoodputTotals::from_array(*g)) throw Bad{"\"goodput\" must be an array of non-negative numbers"};
      r.goodput = g->get<std::vector<double>>();
    }
    if (r.failing && r.failures.empty() && !r.fatal) throw Bad{"a failing job without any failure"};
    if (r.state == JobRecord::State::running) {
      if (r.generation == 0) throw Bad{"a running job with generation 0"};
      const json& round = field(j, "round");
      if (!round.is_object()) throw Bad{"\"round\" must be an object"};
      decode_round(round, r);
    }
  } catch (const Bad& bad) {
    return "the record of job " + r.job_id + ": " + bad.what;
  } catch (const json::exception& e) {
    return "the record of job " + r.job_id + ": " + e.what();
  }
  return r;
}

}  // namespace ddp::rdzv
