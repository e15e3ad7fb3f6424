// Plain data shared by the rendezvous server, its client and the agent.
// No Boost.Asio here: the state machine and the agent's local rendezvous use these types too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp::rdzv {

// Deadlines of a job, set through --rdzv_conf key=value,... (seconds on the command line).
struct Timeouts {
  double join_timeout = 600.0;       // waiting for MIN nodes before the job fails (torchrun: 600 s)
  double last_call_timeout = 30.0;   // after MIN nodes joined, how long to wait for more (torchrun: 30 s)
  double heartbeat_interval = 1.0;   // agent -> server heartbeat period
  double heartbeat_timeout = 5.0;    // a node silent this long is lost
  // A node that does not answer the server's probe this long, while the job's other nodes say
  // their workers stalled, is lost without waiting for heartbeat_timeout (docs/rendezvous.md,
  // "Silent nodes"). 0 = only heartbeat_timeout finds a silent node.
  double probe_timeout = 0.3;
  double shutdown_timeout = 30.0;    // SIGTERM -> SIGKILL grace for workers
};

// --straggler, --straggler_factor, --straggler_window: what the server does about a node whose
// busy time per step stays above the other nodes' (docs/maintenance.md, "Stragglers"). The job's
// policy, set by its first node like --max_restarts.
struct StragglerPolicy {
  std::string mode = "report";  // off | report (event, metric, status) | replace (drain onto a spare)
  double factor = 1.5;          // slow: busy time >= factor x the median of the other nodes'
  double window = 60.0;         // s a node stays slow before it is named, and fast before it is cleared
  bool operator==(const StragglerPolicy& o) const {
    return mode == o.mode && factor == o.factor && window == o.window;
  }
};
inline constexpr double kMinStragglerFactor = 1.05;
inline constexpr double kMaxStragglerFactor = 100.0;

// What an agent says about itself when it joins (or rejoins) a job's rendezvous.
struct NodeSpec {
  std::string job_id;            // --rdzv_id
  std::string host;              // hostname, for messages and status
  std::string addr;              // address other nodes reach this node at (--local_addr, else the
                                 // local address of the agent's rendezvous connection)
  int local_world_size = 1;      // --nproc_per_node
  int requested_rank = -1;       // --node_rank, -1 = any
  int min_nodes = 1;             // --nnodes MIN
  int max_nodes = 1;             // --nnodes MAX
  int max_restarts = 0;          // --max_restarts (the job's budget; the first joiner's value wins)
  int master_port = 0;           // a free port this node offers, used when it becomes group rank 0
  std::string env_check = "strict";  // strict | warn | off
  nlohmann::json fingerprint = nlohmann::json::object();  // this node's software fingerprint
  Timeouts timeouts;
  StragglerPolicy straggler;
  // This agent understands `waiting` (the counts of a gathering job); the server sends
  // it to such nodes only, so agents that predate it never see it. Default false.
  bool progress = false;
  // This agent answers `check_peer` (reaches another node's host for the server); the server asks
  // such nodes only. Default false.
  bool peer_checks = false;
  // --spare: this node only takes the place of one the job lost, failed or drained; it never
  // counts toward MAX or MIN for a round and never ends a running one (docs/maintenance.md).
  bool spare = false;
};

// A completed round, as told to one node.
struct Assignment {
  std::uint64_t generation = 0;  // the rendezvous round, unique per start of the worker group
  int group_rank = 0;            // GROUP_RANK
  int group_world_size = 1;      // GROUP_WORLD_SIZE
  int world_size = 1;            // WORLD_SIZE: the sum of local world sizes
  int rank_offset = 0;           // RANK = rank_offset + LOCAL_RANK
  std::string master_addr;       // group rank 0's reachable address
  int master_port = 0;           // group rank 0's offered port
  int restart_count = 0;         // job-wide failure restarts so far (TORCHELASTIC_RESTART_COUNT)
  int max_restarts = 0;          // the job's budget (TORCHELASTIC_MAX_RESTARTS)
  // The per-node secret the server issues with a round (hex); the node proves itself with it in
  // a resume. Sent in the round message to its node only; empty from LocalRendezvous.
  std::string secret;
  // The job's goodput account when the round formed (GoodputTotals::to_array: wall, the
  // categories, restarts; empty = none), and, in a resume only, the seconds since the node got
  // the round: a server rebuilt from the resumes carries the account on from them.
  std::vector<double> goodput;
  double round_age = 0;
};

// The first failure of a job, as reported by the agent whose worker failed.
struct WorkerFailure {
  std::string host;
  int rank = -1;
  int local_rank = -1;
  int exit_code = 0;             // when the worker exited
  int signal = 0;                // when it was killed by a signal (0 = none)
  int pid = 0;
  double timestamp = 0;          // seconds since the epoch
  std::string error_file_message;  // the worker's TORCHELASTIC_ERROR_FILE content, summarised
  // Non-empty: the agent decided that the job must end, not restart (--no_restart_exit_codes, a
  // crash loop), and why. The rendezvous then fails the job on every node with this reason.
  // Empty (the default): an ordinary failure, restarted while the budget lasts.
  std::string fatal;
};

// The root-cause order of failures: true when `a` explains `b` rather than the reverse. A worker
// killed by a signal (SIGKILL by the OOM killer or a user, SIGSEGV) comes before workers that
// exited with a code, because peers exit with an error code when a collective fails *because* a
// worker died, and their agent may reap them first or report first. Among failures of the same
// kind the earlier timestamp wins, then the lower rank (a total order: every node agrees).
bool explains(const WorkerFailure& a, const WorkerFailure& b);

void to_json(nlohmann::json& j, const Timeouts& v);
void from_json(const nlohmann::json& j, Timeouts& v);
void to_json(nlohmann::json& j, const StragglerPolicy& v);
void from_json(const nlohmann::json& j, StragglerPolicy& v);
void to_json(nlohmann::json& j, const NodeSpec& v);
void from_json(const nlohmann::json& j, NodeSpec& v);
void to_json(nlohmann::json& j, const Assignment& v);
void from_json(const nlohmann::json& j, Assignment& v);
void to_json(nlohmann::json& j, const WorkerFailure& v);
void from_json(const nlohmann::json& j, WorkerFailure& v);

// What a node's workers reported on their progress slots (contracts/progress_slot.h), carried by
// its agent's heartbeats for `status` to show. Optional fields on the wire: "step",
// "checkpoint_step" (integers, -1 = none), "checkpoint_interval" (seconds, 0 = none), "busy"
// (seconds) and "busy_rank" (a local rank; both absent when no worker measured its busy time),
// "checkpoint_stall" (seconds; absent when 0), "first_step" (the round's first step, where it
// resumed; absent when not known).
// An agent's heartbeats carry new progress at most this often (but every heartbeat at a round's
// start, until its workers' first step): rendezvous/client.h.
inline constexpr double kProgressReportSeconds = 2.0;
inline constexpr std::int64_t kMaxReportedStep = std::int64_t{1} << 62;  // a step or checkpoint on the wire
struct NodeProgress {
  std::int64_t step = -1;             // the highest step a local worker reported this round
  std::int64_t checkpoint_step = -1;  // the highest checkpoint step a local worker reported
  double checkpoint_interval = 0;     // the workers' automatic checkpoint interval (s)
  // The busy time per step of its slowest local rank (s; contracts/progress_slot.h, busy_us), and
  // that rank's local rank; -1 = no worker measured it.
  double busy = 0;
  int busy_local_rank = -1;
  // How long its workers' steps stood still for checkpoints since they started (s; the most of any
  // local worker): the goodput account's checkpoint stalls.
  double checkpoint_stall = 0;
  // The first step its workers reported this round (the lowest of any local worker): the step the
  // round resumed at; -1 = not known.
  std::int64_t first_step = -1;
  bool operator==(const NodeProgress& o) const {
    return step == o.step && checkpoint_step == o.checkpoint_step && checkpoint_interval == o.checkpoint_interval &&
           busy == o.busy && busy_local_rank == o.busy_local_rank && checkpoint_stall == o.checkpoint_stall &&
           first_step == o.first_step;
  }
};

}  // namespace ddp::rdzv
