// The shutdown grace of a stop: SIGTERM to the workers' groups; SIGKILL --shutdown_timeout later
// to those still running; --kill_timeout after that the agent gives up on a worker that still
// has not exited (stuck in the kernel, state D: it cannot be killed), so that neither the agent
// nor the job hangs on it.
//
// The unit holds the two deadlines and says what to tell the user at each; Agent::Impl sends the
// signals, arms a timer at each deadline, and passes the workers the stop still waits for (live,
// not kept across an in-memory restart). Owned by Agent::Impl for the whole run; pure (time is
// given), used on the agent's io_context thread.
#pragma once

#include <string>
#include <vector>

#include "agent/policy.h"

namespace ddp::agent {

class ShutdownGrace {
 public:
  static constexpr double kNever = -1;

  // `shutdown_timeout`: seconds between SIGTERM and SIGKILL. `kill_timeout`: seconds after
  // SIGKILL before a worker that has not exited is given up on.
  ShutdownGrace(double shutdown_timeout, double kill_timeout);

  // A SIGTERM went out at `now`: the SIGKILL deadline starts over. Returns it.
  double terminated(double now);
  // The SIGKILL deadline passed with `running` still running: one line each for the user. The
  // caller then kills them (killed()).
  std::vector<std::string> overdue(const std::vector<WorkerRef>& running);
  // SIGKILL went to every running group at `now`: the give-up deadline starts over. Returns it.
  double killed(double now);
  // The give-up deadline passed with `running` still running: the agent stops waiting for them;
  // one line each for the user.
  std::vector<std::string> give_up(const std::vector<WorkerRef>& running);
  // The stop is over: no deadline runs.
  void settled();

  double kill_at() const { return kill_at_; }        // kNever: none
  double give_up_at() const { return give_up_at_; }  // kNever: none

 private:
  double shutdown_timeout_, kill_timeout_;
  double kill_at_ = kNever, give_up_at_ = kNever;
};

}  // namespace ddp::agent
