#include "agent/crash_loop.h"

#include <algorithm>
#include <utility>

namespace ddp::agent {

CrashLoopPolicy::CrashLoopPolicy(int limit, std::vector<int> no_restart_exit_codes)
    : limit_(limit), no_restart_exit_codes_(std::move(no_restart_exit_codes)) {}

void CrashLoopPolicy::worker_failed(int rank, int exit_code, int signal, bool hung, bool final) {
  if (fatal() || signal != 0 || hung) return;
  if (final) {
    reason_ = "worker " + std::to_string(rank) + " exited with code " + std::to_string(exit_code) +
              " and said a restart would fail the same way (its output says why): not restarting";
    return;
  }
  if (std::count(no_restart_exit_codes_.begin(), no_restart_exit_codes_.end(), exit_code) == 0) return;
  reason_ = "worker " + std::to_string(rank) + " exited with code " + std::to_string(exit_code) +
            ", which --no_restart_exit_codes lists: not restarting";
}

void CrashLoopPolicy::round_ended(int64_t best_step, int64_t best_checkpoint, int round_restart_count) {
  const bool progressed = best_step > best_step_ || best_checkpoint > best_checkpoint_;
  best_step_ = std::max(best_step_, best_step);
  best_checkpoint_ = std::max(best_checkpoint_, best_checkpoint);
  if (progressed) {
    restarts_without_progress_ = 0;
  } else if (round_restart_count > 0) {
    ++restarts_without_progress_;
  }
  if (limit_ <= 0 || restarts_without_progress_ < limit_ || fatal()) return;
  const std::string best = best_step_ < 0 && best_checkpoint_ < 0
                               ? "no rank ever reported a step or a checkpoint"
                               : "no rank reported a step beyond " + std::to_string(best_step_) +
                                     " or a checkpoint beyond " + std::to_string(best_checkpoint_);
  reason_ = std::to_string(restarts_without_progress_) + " restart(s) in a row made no progress (" + best +
            "); --crash_loop_limit=" + std::to_string(limit_);
}

}  // namespace ddp::agent
