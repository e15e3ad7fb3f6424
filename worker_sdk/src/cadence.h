// The automatic checkpoint cadence of the Trainer (TrainerOptions::checkpoint_auto, `train
// --checkpoint-every=auto`): the policy of the Python side's ddplaunch.checkpoint_due
// (python/ddplaunch/cadence.py; docs/checkpoints.md, "How often"), rule for rule, and the same
// history file, DIR/cadence.json, in the same format: the two sides read each other's.
//
// The interval is Young and Daly's sqrt(2 C M) within [max(10 s, 10 C), 1 h], C the save stall
// (a moving average, weight 0.3), M the Gamma-Poisson estimate (900 s + exposure) /
// (900 s / prior + failures) of the job's mean time between failures.
//
// The policy (prior_mtbf, mtbf_estimate, bounds, decide, advance, the JSON) is pure; Cadence
// holds one directory's state with its clocks injectable (tests). Private to the SDK: not an
// installed header. No torch.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

namespace ddp::cadence {

inline constexpr const char* kRecord = "cadence.json";
inline constexpr int kFormat = 1;
inline constexpr double kPriorMtbf = 3600.0;         // one failure an hour, until the history says otherwise
inline constexpr double kPriorWeight = 900.0;        // the prior weighs as much as 15 minutes of observation
inline constexpr double kMinInterval = 10.0;
inline constexpr double kMinIntervalStalls = 10.0;   // and at least 10 C
inline constexpr double kMaxInterval = 3600.0;
inline constexpr double kStallWeight = 0.3;          // a new save's stall in the moving average
inline constexpr const char* kMtbfVariable = "DDPLAUNCH_CHECKPOINT_MTBF";

// The prior MTBF in seconds from the variable's text (nullptr or empty: one hour). Throws
// EnvError unless it is a positive finite number.
double prior_mtbf(const char* text);
double mtbf_estimate(int64_t failures, double exposure_s, double prior_mtbf_s = kPriorMtbf);
// (lowest, highest) interval in seconds for a save stall of `stall_s`.
std::pair<double, double> bounds(double stall_s);

enum class Bound { kNone, kLower, kUpper };

struct Decision {
  double interval = 0;           // seconds
  std::optional<double> stall;   // not measured yet: none
  double mtbf = 0;
  int64_t failures = 0;
  double exposure = 0;
  Bound bound = Bound::kNone;    // the bound that set the interval, if one did
};

// Before the first save is measured (no stall) C counts as 0: the lower bound.
Decision decide(std::optional<double> stall_s, int64_t failures, double exposure_s,
                double prior_mtbf_s = kPriorMtbf);
// The line rank 0 prints: "checkpoint every 85 s (save stall 1.00 s, MTBF estimate ...)".
std::string describe(const Decision& d, double prior_mtbf_s = kPriorMtbf);

// The job's history in one directory (cadence.json): the launches before the current one, the
// failures and exposure they add up to, and the current launch.
struct Record {
  int64_t launches = 0;
  int64_t failures = 0;
  double exposure = 0;
  std::optional<double> stall;
  std::optional<std::string> run_id;  // TORCHELASTIC_RUN_ID; none without a launcher
  double start = 0;                   // wall clock (s): the launch's first look,
  double seen = 0;                    // and its last save or exit
  int64_t restarts = 0;               // TORCHELASTIC_RESTART_COUNT last seen in this launch
  bool ended = false;                 // rank 0 exited normally
};

Record fresh(double now, int64_t restarts, std::optional<std::string> run_id);
// The history as a new process of the job finds it: the same launch when its restart count is
// higher than the launch's last (and its run id the same), else a new launch, which closes the
// current one (its restarts are failures, and so is its end unless rank 0 exited normally).
Record advance(std::optional<Record> record, double now, int64_t restarts,
               const std::optional<std::string>& run_id);
std::pair<int64_t, double> failures_and_exposure(const Record& record, double now);

// cadence.json as the Python side writes it (sorted keys, indent 1, a final newline).
std::string to_json(const Record& record);
// nullopt when `text` is not a valid record; `why` says what is wrong (a JSON error, or empty
// when it parses but is not a record).
std::optional<Record> from_json(const std::string& text, std::string* why = nullptr);

// Who asks: this round's rank and restart count, and the job's run id.
struct Who {
  int rank = 0;
  int64_t restarts = 0;
  std::optional<std::string> run_id;
  bool writer() const { return rank == 0; }
  // From a WorkerEnv's fields (an empty run id: none).
  static Who of(int rank, int64_t restarts, const std::string& run_id) {
    return {rank, restarts, run_id.empty() ? std::nullopt : std::optional<std::string>(run_id)};
  }
};

// The cadence of one checkpoint directory in this process. Every rank keeps the history in
// memory; rank 0 writes it (a temporary file renamed; not synced: a hint whose loss costs a
// slightly wrong interval), says the interval and measures the stall.
class Cadence {
 public:
  struct Hooks {
    std::function<double()> clock;                    // seconds, monotonic; default steady_clock
    std::function<double()> wall;                     // seconds since the epoch; default system_clock
    std::function<void(const std::string&)> say;      // rank 0's lines; default stderr
    std::function<void(double)> report;               // the interval, each time it changes
  };
  Cadence(std::string dir, double prior_mtbf_s, Hooks hooks);

  // Brings the history to `who`'s restart count (the first call reads the file; a restart in
  // memory is a new round of the same launch). Rank 0 writes what changed. Every call below
  // refreshes first.
  void refresh(const Who& who);
  // The interval now; rank 0 says it when it is first known (a stall measured) or has changed
  // more than twofold since last said.
  Decision decision(const Who& who);
  // The time since the last save (before the first: since the first due()) reached the interval.
  bool due(const Who& who);
  double interval() const { return reported_; }  // the last decided; 0 before any
  // The interval rank 0 decided, on another rank: reported when it changes.
  void follow(double interval);
  // A save blocked the training loop `stall_s` seconds (rank 0).
  void saved(double stall_s, const Who& who);
  // Rank 0's training ended normally: a relaunch after it is no failure.
  void exited(const Who& who);

  const std::string& file() const { return file_; }
  const Record& record() const { return *record_; }  // REQUIRES: refresh() called

 private:
  std::optional<Record> read();
  void write(const Who& who);

  std::string dir_, file_;
  double prior_;
  Hooks hooks_;
  std::optional<Record> record_;
  int64_t restarts_ = -1;               // the restart count the record was last brought to
  std::optional<double> started_, last_save_;
  std::optional<double> printed_;
  double reported_ = 0;
};

}  // namespace ddp::cadence
