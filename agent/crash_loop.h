// When a failure must end the job instead of restarting it: a worker exiting with a code of
// --no_restart_exit_codes, a worker that said a restart would fail the same way (its progress
// slot's `final` word: a checkpoint refused under a strict environment check), or --crash_loop_limit restarts in a row during which no rank got
// beyond the best step or checkpoint of the job. The first verdict stands: later ones do not
// replace its reason. The agent sends it as a fatal failure report (rdzv::WorkerFailure::fatal),
// and the rendezvous fails the job on every node with it.
//
// Owned by Agent::Impl for the whole run; pure (no clock, no processes), used on the agent's
// io_context thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::agent {

class CrashLoopPolicy {
 public:
  // `limit`: --crash_loop_limit, 0 = off. `no_restart_exit_codes`: --no_restart_exit_codes.
  CrashLoopPolicy(int limit, std::vector<int> no_restart_exit_codes);

  // Worker `rank` failed: exited with `exit_code` (signal 0) or died of `signal`. A listed code
  // is fatal unless the worker was declared hung (its exit is then the agent's doing); so is an
  // exit of a worker that said `final` (contracts/progress_slot.h) before it exited.
  void worker_failed(int rank, int exit_code, int signal, bool hung, bool final = false);

  // A counted restart ended a round whose ranks reached `best_step` and `best_checkpoint` (-1:
  // none). `round_restart_count` is that round's restart count: the first round's failure is no
  // restart in a row yet.
  void round_ended(int64_t best_step, int64_t best_checkpoint, int round_restart_count);

  bool fatal() const { return !reason_.empty(); }
  // Why the job ends (empty: it does not).
  const std::string& reason() const { return reason_; }
  int restarts_without_progress() const { return restarts_without_progress_; }

 private:
  int limit_;
  std::vector<int> no_restart_exit_codes_;
  int64_t best_step_ = -1, best_checkpoint_ = -1;
  int restarts_without_progress_ = 0;
  std::string reason_;
};

}  // namespace ddp::agent
