// Parking, the agent's side of in-memory restart (docs/agent.md, "In-memory restart: the worker
// channel"): which live workers a restart asks to park instead of stopping them, how long they
// have to park (`park_timeout`), who is stopped past it, and what a worker's word on its channel
// does to where it stands.
//
// A worker may park when in-memory restart is on, it said it is restartable, it is not hung, and
// its channel is open. A stop that is a restart asks each such worker to park (Impl sets its
// slot's abandoned word) and signals the others; a stop that ends the job stops parked and
// parking workers too. A stop is over when every worker has exited or parked.
//
// Owned by Agent::Impl for the whole run; pure, used on the agent's io_context thread. Impl keeps
// each worker's ParkState, sends the signals and arms its park timer at the deadline said here.
#pragma once

#include <string>
#include <vector>

#include "agent/policy.h"

namespace ddp::agent {

// Where a worker stands at a restart: kAsked to park (its abandoned word is set, the park deadline
// runs), kParked (waits for its next assignment; kept across the restart).
enum class ParkState { kNo, kAsked, kParked };

// A worker as parking sees it.
struct ParkView {
  WorkerRef ref;
  bool alive = false;
  bool restartable = false;  // it said so on its channel
  bool hung = false;
  bool channel_open = false;
  ParkState park = ParkState::kNo;
};

// What a stop does to one live worker.
enum class AtStop {
  kSignal,     // stop it like any worker
  kAskToPark,  // newly asked: set its abandoned word
  kKeep,       // already asked or parked: leave it
};

// What a worker's word on its channel does.
enum class OnWord {
  kNothing,
  kStop,         // it is kept but said it is no longer restartable: stop it
  kBreak,        // it said it parked without having said it is restartable: close its channel
  kParked,       // it parked now
};

class ParkPolicy {
 public:
  ParkPolicy(bool in_memory_restart, double park_timeout);

  bool may_park(const ParkView& w) const;
  // Kept across the stop in progress: asked to park, or parked.
  static bool kept(const ParkView& w) { return w.alive && w.park != ParkState::kNo; }
  // Every worker has exited or parked: the stop is over.
  static bool settled(const std::vector<ParkView>& workers);
  // A stop reaches live worker `w`; `park`: the stop is a restart (not the job's end).
  AtStop at_stop(const ParkView& w, bool park) const;
  // Some worker was asked to park at `now`: the park deadline. Returns it.
  double deadline(double now) const { return now + park_timeout_; }
  // The park deadline passed: the kept workers that did not park are stopped: one line each.
  std::vector<std::string> overdue(const std::vector<ParkView>& not_parked) const;

  // Worker `w` said whether it is restartable (`restartable`).
  static OnWord restartable_word(const ParkView& w, bool restartable);
  // Worker `w` said it parked; `stopping`: a stop is in progress.
  static OnWord parked_word(const ParkView& w, bool stopping);

 private:
  bool in_memory_restart_;
  double park_timeout_;
};

}  // namespace ddp::agent
