// A job's record in etcd (docs/etcd.md "Job records"): what a new leader needs to carry
// a job on where the old one left it: policy, restart count, generation, the running round's
// members with their per-node secrets, and a failing or finished job's verdict.
//
// Pure data and a codec; no Boost.Asio. The state machine makes a record (StateMachine::record)
// and loads one (StateMachine::load); the server has them written by the election thread. A
// record read from etcd is input: decode_record checks size, depth, types and ranges, and the
// consistency of the round, and never throws.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "rendezvous/types.h"

namespace ddp::rdzv {

inline constexpr std::size_t kMaxRecordBytes = 1u << 20;  // etcd's request limit is 1.5 MiB
inline constexpr std::size_t kMaxRecordFailures = 64;     // failures of a failing round kept

// One node of the running round, as the record keeps it.
struct RecordMember {
  int group_rank = 0;
  std::string host;
  std::string addr;
  int local_world_size = 1;
  int requested_rank = -1;
  std::string secret;  // the per-node secret it proves itself with in a resume (hex)
};

struct JobRecord {
  enum class State { gathering, running, succeeded, failed };
  std::string job_id;
  State state = State::gathering;
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  Timeouts timeouts;
  StragglerPolicy straggler;
  std::uint64_t generation = 0;  // the last round formed; 0 = none yet
  int restarts_used = 0;
  bool failing = false;                 // the budget is spent: the job fails once its nodes stopped
  std::vector<WorkerFailure> failures;  // a failing round's reports (at most kMaxRecordFailures)
  std::optional<WorkerFailure> fatal;
  std::string summary;                  // a finished job's verdict
  // The running round (state running): its shape and its members, one per group rank.
  int group_world_size = 0;
  int world_size = 0;
  std::string master_addr;
  int master_port = 0;
  std::vector<RecordMember> members;
  // The job's goodput account when the record was written (GoodputTotals::to_array; empty = none).
  std::vector<double> goodput;
};

// One etcd transaction of a replicated leader: the records of every job that changed since the
// last one (the server batches them: one in flight at a time, so one per round, not per agent).
struct RecordWrite {
  std::uint64_t seq = 0;                                  // the server's number for it
  std::vector<std::pair<std::string, std::string>> puts;  // job id -> record text
  std::vector<std::string> deletes;                       // job ids whose record goes
};

const char* to_string(JobRecord::State s);
// The record's JSON text (compact).
std::string encode_record(const JobRecord& record);
// Validates and decodes a record's text; the error says what is wrong ("record of job X: ...").
std::variant<JobRecord, std::string> decode_record(std::string_view text);

}  // namespace ddp::rdzv
