// A job's goodput account: where its wall time went, split into categories that add up to it
// (docs/goodput.md). Pure: the state machine tells it what the job does, on its clock, and reads
// the totals for status, metrics, events and the final summary.
//
// What it is told and how it splits the time:
//  - From the job's creation until its first round, and between rounds while fewer than MIN
//    nodes wait: waiting.
//  - Between rounds otherwise (a restart's stopping and rendezvous), and from a round's start
//    until the first step its workers report (start-up, checkpoint load or state transfer):
//    recovery. A job whose workers never report a step has no start-up to tell apart: its
//    running time is training.
//  - Training: productive, but for the share of the nodes missing from MAX (reduced_capacity),
//    the checkpoint stalls the workers report (checkpoint), and at a restart:
//      hang   the silence since the last step, when it is longer than two steps and two reports
//             take (a hang, until it was detected);
//      lost   the training the next round does again: from the moment the ended round reached
//             the step the next round resumes at (its first report), to the end; between two
//             reports the moment is interpolated, after the last one extrapolated at the rate
//             the steps went.
//    The steps come from the nodes' heartbeats: at most every report_period seconds, and at a
//    round's start every heartbeat until its first step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp::rdzv {

enum class Spent { productive, lost, recovery, checkpoint, hang, waiting, reduced_capacity, kCount };
inline constexpr int kSpentCount = static_cast<int>(Spent::kCount);
// "productive", "lost", ..., "reduced_capacity": the names in status, metrics and events.
const char* spent_name(Spent s);

struct GoodputTotals {
  double wall = 0;                  // seconds since the job was created (until it ended)
  double seconds[kSpentCount] = {};  // by category; they add up to wall
  int restarts = 0;                 // rounds that ended before the job did
  double percent() const { return wall > 0 ? 100.0 * seconds[0] / wall : 0.0; }
  // The percent as every reader shows it ("97.4"): of the seconds rounded to the millisecond, as
  // status --json holds them, to one decimal. The daemon's and agent's line and a status made
  // from the JSON alone so print the same figure, even where rounding first would tip it.
  std::string shown_percent() const;
  double operator[](Spent s) const { return seconds[static_cast<int>(s)]; }
  // {"wall_seconds", "percent", "seconds": {category: s}, "restarts"}
  nlohmann::json to_json() const;
  // nullopt unless `j` is to_json()'s shape with finite, non-negative numbers.
  static std::optional<GoodputTotals> from_json(const nlohmann::json& j);
  // The compact form a round message and a job record carry: wall, the categories in order, restarts.
  std::vector<double> to_array() const;
  static constexpr std::size_t kArraySize = kSpentCount + 2;
  // nullopt unless `j` is an array of kArraySize finite, non-negative numbers (restarts an integer).
  static std::optional<GoodputTotals> from_array(const nlohmann::json& j);
  // "goodput 97.4% of 5m 2s: 12.1 s lost to 3 restarts, 4.0 s recovering, 3.2 s in checkpoints"
  std::string summary() const;
};

class GoodputAccount {
 public:
  // `report_period`: how late a step can be seen (a silence longer than two steps and two of
  // these is a hang).
  GoodputAccount(double now, double report_period);
  // Carries on a job's account from `totals` (a job record, a resume): its wall time is taken as
  // already spent, and the job is between rounds (or training, when `running`) from `now`.
  void restore(double now, const GoodputTotals& totals, bool running, std::size_t nodes, std::size_t max_nodes);

  // Between rounds: waiting for nodes (`waiting`: fewer than MIN, or the job never ran), else
  // recovering. Idempotent.
  void between_rounds(double now, bool waiting);
  // A round of `nodes` formed (MAX = `max_nodes`): start-up until its first step is reported.
  void round_formed(double now, std::size_t nodes, std::size_t max_nodes);
  // The round's highest step (a node's report after the round formed), the checkpoint stall its
  // workers reported (cumulative, seconds; the most of any node), and the first step they
  // reported this round (where it resumed; -1 = not known: the round's first report stands for it).
  void step(double now, std::int64_t step, double checkpoint_stall, std::int64_t first_step = -1);
  // The round ended (a restart).
  void round_ended(double now);
  // The job ended (succeeded, failed or dropped): the account stops at `now`.
  void ended(double now);

  GoodputTotals totals(double now) const;
  bool has_ended() const { return phase_ == Phase::ended; }

 private:
  enum class Phase { waiting, recovery, start_up, training, ended };
  struct Round {
    std::vector<std::pair<double, std::int64_t>> steps;  // (when, step) at each report that advanced
    double capacity = 1;  // nodes / MAX
    double end = 0;       // when its training ended (a hang's start, else the restart)
    double per_step = 0;  // seconds per step between its first and last report; 0 = unknown
    std::int64_t resumed = -1;  // the step it resumed at (its first report's first step)
  };
  static constexpr std::size_t kMaxSteps = 4096;  // of a round's timeline (thinned beyond)

  void commit(double now);
  void add_training(double span, double capacity);
  void move(Spent from, Spent to, double seconds);
  // Moves the ended round's training after `resumed_at` to lost, once the moment it reached that
  // step is known (false: not yet, for want of a rate to extrapolate with).
  bool resolve_rollback(std::int64_t resumed_at);
  // When the ended round reached `step` (interpolated, or extrapolated at `per_step`); -1: unknown.
  double reached(std::int64_t step) const;
  // The open span's category when it is not training.
  Spent open_category() const;
  // The open span is training: a round that trains, or the job's first start-up, which is dated
  // at its first report and so counts as training until then.
  bool trains() const { return phase_ == Phase::training || (phase_ == Phase::start_up && !ever_stepped_); }

  double report_period_;
  double per_step_ = 0;  // the last rate measured (s per step), for a round too short to have its own
  double began_;
  double since_;  // the open span's start
  double ended_at_ = 0;
  Phase phase_ = Phase::waiting;
  double spent_[kSpentCount] = {};
  int restarts_ = 0;
  bool ever_stepped_ = false;  // some round reported a step
  Round round_;
  double stall_seen_ = 0;  // of the round's checkpoint stall, what was moved already
  Round previous_;         // the last round that trained, until the next one reports its step
  bool rollback_pending_ = false;
};

}  // namespace ddp::rdzv
