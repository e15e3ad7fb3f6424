// Progress heartbeats: what each worker says about its training steps, and how the agent
// decides that a worker hangs.
//
// ProgressBoard is a shared-memory page (a memfd) with one slot per local rank. Workers open it
// through DDPLAUNCH_PROGRESS_FILE (/proc/<agent pid>/fd/<n>) and write their own slot,
// DDPLAUNCH_PROGRESS_SLOT, without a system call per step; the agent samples the slots. The
// slot's layout is a contract with the workers: contracts/progress_slot.h (also written down in
// docs/worker-sdk.md, "Progress").
// HangMonitor is the pure decision, with the clock given to every call: tested without processes.
//
// Both are owned by the Agent and used on its io_context thread only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "contracts/progress_slot.h"
#include "rendezvous/types.h"

namespace ddp::agent {

struct ProgressSample {
  uint64_t beats = 0;
  int64_t step = 0;
  int64_t checkpoint_step = -1;
  std::string phase;  // printable ASCII only
  int64_t checkpoint_interval_ms = 0;  // the worker's automatic checkpoint interval; 0 = none said
  bool final = false;  // the worker asks that its failure end the job (a restart would repeat it)
  uint64_t busy_us = 0;  // the worker's busy time per step (us, a moving average); 0 = not measured
  uint64_t checkpoint_stall_us = 0;  // its steps' standstill for checkpoints so far (us, cumulative)
  int64_t first_step = -1;  // the first step it reported since the slot was cleared; -1 = none
};

class ProgressBoard {
 public:
  static constexpr std::size_t kSlotSize = contracts::kSlotSize;
  static constexpr std::size_t kPhaseSize = contracts::kPhaseSize;

  // Creates the memfd with `slots` zeroed slots. Throws LaunchError (a usage error: nothing was started).
  explicit ProgressBoard(int slots);
  ~ProgressBoard();
  ProgressBoard(const ProgressBoard&) = delete;
  ProgressBoard& operator=(const ProgressBoard&) = delete;

  // What a worker is given: the path that opens the memfd from another process.
  const std::string& path() const { return path_; }
  int slots() const { return slots_; }
  // Zeroes every slot (checkpoint_step -1, not abandoned): each round starts from nothing.
  void reset();
  // Tells every worker of the round that the round is lost, before it is stopped: a collective
  // with a failed peer never completes, so a worker blocked in one must not wait to finish its
  // step on SIGTERM (the worker SDK then dies of the signal at once).
  void abandon_round();
  // The same for one slot: the worker there is asked to park (in-memory restart, agent.cpp),
  // whatever ended the round. REQUIRES: 0 <= slot < slots().
  void abandon_slot(int slot);
  bool abandoned(int slot) const;
  // REQUIRES: 0 <= slot < slots().
  ProgressSample read(int slot) const;
  // Writes a slot as a worker would (tests).
  void write(int slot, const ProgressSample& sample);

 private:
  int fd_ = -1;
  int slots_ = 0;
  unsigned char* base_ = nullptr;
  std::string path_;
};

// What a node's workers reported, as its heartbeats tell the rendezvous (status shows it): the
// highest step and checkpoint, the longest automatic checkpoint interval, and the longest busy
// time per step with its slot (the local rank), of the samples given. nullopt when none of them
// reported anything.
std::optional<rdzv::NodeProgress> summarize(const std::vector<ProgressSample>& samples);

// --hang_timeout: a fixed number of seconds, or "auto".
struct HangPolicy {
  double timeout = 0;      // seconds; 0 = off (default)
  bool automatic = false;  // --hang_timeout=auto
  // auto: timeout = max(auto_floor, auto_factor * the slowest step interval seen on this node),
  // counting intervals only after each rank's first auto_skip steps, and only once a rank has
  // auto_warmup counted intervals (before that it is not watched).
  double auto_factor = 5.0;
  double auto_floor = 60.0;
  int auto_skip = 2;
  int auto_warmup = 5;
  bool enabled() const { return timeout > 0 || automatic; }
};

// One rank that made no progress for too long.
struct Hang {
  int slot = 0;
  double stalled_for = 0;  // seconds since its last beat
  double timeout = 0;      // the timeout it exceeded
  int64_t step = 0;        // its last reported step
  std::string phase;
};

// Watches the samples of one round. Times are seconds on a monotonic clock.
class HangMonitor {
 public:
  HangMonitor(HangPolicy policy, int slots);
  // A new round: forgets every beat (the slowest interval of auto is kept: same job, same steps).
  void reset(double now);
  void observe(int slot, const ProgressSample& sample, double now);
  // The ranks that have beaten at least once and not for longer than the timeout, at `now`; and
  // once one has, with it every watched rank that has not beaten for kStalledTogether of its own
  // timeout. A rank blocked forever and the peers blocked in its collective stop beating within
  // moments of each other, in an order that sampling and scheduling decide: all of them are the
  // hang, and the culprit's step and phase are among theirs (a rank that keeps stepping has
  // stalled for one step at most).
  std::vector<Hang> check(double now) const;
  static constexpr double kStalledTogether = 0.9;
  // The timeout in force for `slot` (0: not watched yet).
  double timeout_for(int slot) const;
  // Highest step and checkpoint any rank reported this round.
  int64_t best_step() const { return best_step_; }
  int64_t best_checkpoint() const { return best_checkpoint_; }
  bool any_beat() const { return any_beat_; }

 private:
  struct Slot {
    uint64_t beats = 0;
    double last_change = 0;
    int64_t step = 0;
    std::string phase;
    int counted = 0;  // intervals counted toward auto
    bool done = false;  // said contracts::kDoneBeats: not watched
  };
  HangPolicy policy_;
  std::vector<Slot> slots_;
  double slowest_ = 0;
  int64_t best_step_ = -1;
  int64_t best_checkpoint_ = -1;
  bool any_beat_ = false;
};

}  // namespace ddp::agent
