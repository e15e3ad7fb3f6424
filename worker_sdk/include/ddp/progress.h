// Progress heartbeats to the ddplaunch agent: each completed step, the last saved checkpoint and
// the current phase go into this worker's slot of a shared-memory page the agent reads
// (DDPLAUNCH_PROGRESS_FILE, DDPLAUNCH_PROGRESS_SLOT). A step is two atomic stores: no system
// call, no lock. Without the variables (another launcher, a debugging run) every call does
// nothing. The slot's layout is the agent's contract with its workers (contracts/progress_slot.h
// in the ddplaunch sources, compiled into the SDK; docs/worker-sdk.md, "Progress").
//
// One per process (Progress::instance()), opened on first use, alive until exit. step() and
// checkpoint() may be called from any one thread at a time; the agent only reads.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace ddp {

class Progress {
 public:
  static Progress& instance();

  bool enabled() const { return slot_ != nullptr; }
  // A step completed; `step` is its number.
  void step(int64_t step) noexcept;
  // The steps are over (the Trainer calls it when fit() leaves its loop): teardown, a final
  // checkpoint or evaluation are not taken for a hang. A later step() resumes watching.
  void done() noexcept;
  // A checkpoint of `step` was saved.
  void checkpoint(int64_t step) noexcept;
  // The interval between checkpoints this worker chose (an automatic cadence), in seconds; the
  // agent passes it on and `ddp-rendezvous status` shows it.
  void checkpoint_interval(double seconds) noexcept;
  // The busy time of the step that just ended: its time not spent waiting for the peers in a
  // collective (the Trainer measures it). The slot holds a moving average over the recent steps,
  // which the daemon compares across nodes to find a straggler (--straggler).
  void busy(double seconds) noexcept;
  // How long this worker's steps have stood still for checkpoints since it started, in seconds
  // (cumulative): the daemon's goodput account counts it as checkpoint time, not training.
  void checkpoint_stall(double total_seconds) noexcept;
  // Asks the agent to end the job when this worker exits with a failure, instead of restarting
  // it: a restart would fail the same way (`train` calls it before it exits 3 for a checkpoint
  // refused under a strict environment check, ddp::LineageError).
  void final_failure() noexcept;
  // The agent abandoned this round (a peer failed): a collective that waits for the peers will
  // not complete, so a stop must not wait for the step to finish (PendingWork::wait).
  bool round_abandoned() const noexcept;
  // What the worker does now ("forward/backward", "checkpoint"); at most 31 characters are kept.
  // REQUIRES: `name` is a NUL-terminated string.
  void set_phase(const char* name) noexcept;
  std::string phase() const;

 private:
  Progress();
  std::atomic<uint64_t>* slot_ = nullptr;  // the slot as 64-bit words
  uint64_t beats_ = 0;
  double busy_ = 0;  // the moving average of busy(), seconds; 0 until the first after the warm-up
  int busy_steps_ = 0;  // busy() calls of the warm-up seen
};

// Sets a phase for its lifetime and restores the previous one.
class PhaseScope {
 public:
  explicit PhaseScope(const char* name) : previous_(Progress::instance().phase()) {
    Progress::instance().set_phase(name);
  }
  ~PhaseScope() { Progress::instance().set_phase(previous_.c_str()); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  std::string previous_;
};

}  // namespace ddp
