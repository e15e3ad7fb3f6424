// When standbys matter (docs/agent.md, "Standby workers"): when the next standbys start after a
// round's workers started, and how long the agent's first join waits for its first standbys to
// say they have loaded.
//
// The next standbys start once every worker of the round has reported a step on the progress
// board (the round is up: its imports, process group and checkpoint load are done), at the
// earliest `delay` and at the latest `delay_max` after the round began (a program that reports no
// steps). Started at once, their imports (a Python standby's `import torch` is 1.5-2 s of CPU)
// would compete with the new round's start on a small machine.
//
// The first join waits until every standby started with the agent has said it is ready (or has
// ended), at most `ready_timeout`: joining first would make a node that comes back into a running
// job stop every other node's workers for as long as its own take to load.
//
// Owned by Agent::Impl for the whole run; pure (whether the round stepped and the time are
// given), used on the agent's io_context thread. Impl starts the standbys, watches their sockets
// and arms its timers at the times said here.
#pragma once

#include <optional>
#include <set>
#include <string>
#include <vector>

namespace ddp::agent {

class StandbySchedule {
 public:
  // How often the agent looks whether a new round's workers have reported a step.
  static constexpr double kStepPoll = 0.1;

  StandbySchedule(double delay, double delay_max, double ready_timeout);

  // A round's workers started at `now`: when to look first.
  double round_started(double now);
  // A look at `now`: nullopt = start the standbys now; else when to look again.
  std::optional<double> look(double now, bool every_worker_stepped) const;

  // The first join waits for the standbys of `local_ranks` to say they are ready, from `now`.
  // Returns the deadline, or nullopt when there is none to wait for (join now).
  std::optional<double> await_ready(const std::vector<int>& local_ranks, double now);
  // The standby of `local_rank` said it is ready, or ended, or said something else: it is not
  // waited for any more. True when it was the last one: join now.
  bool ready(int local_rank);
  // The deadline passed: what to say (nullopt when no longer waiting); the wait ends: join now.
  std::optional<std::string> ready_timed_out();
  bool awaiting() const { return awaiting_; }
  // The job ended: nothing is awaited any more.
  void cancel() { awaiting_ = false; }

 private:
  double delay_, delay_max_, ready_timeout_;
  double round_began_ = 0;
  bool awaiting_ = false;
  std::set<int> waiting_for_;
};

}  // namespace ddp::agent
