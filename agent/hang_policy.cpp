#include "agent/hang_policy.h"

#include <signal.h>

#include <algorithm>

namespace ddp::agent {

HangWatch::HangWatch(HangPolicy policy, int slots) : policy_(policy), monitor_(policy, slots) {}

double HangWatch::period() const {
  if (!policy_.enabled() || policy_.automatic) return 1.0;
  return std::clamp(policy_.timeout / 50.0, 0.02, 1.0);
}

HangVerdict HangWatch::check(const std::vector<WatchedWorker>& workers, double now) const {
  HangVerdict verdict;
  if (!policy_.enabled()) return verdict;
  const auto hangs = monitor_.check(now);
  if (hangs.empty()) return verdict;
  verdict.hang = true;
  verdict.sigkill_at = now + kDumpGrace;
  for (const auto& h : hangs) {
    auto it = std::find_if(workers.begin(), workers.end(),
                           [&](const WatchedWorker& w) { return w.ref.local_rank == h.slot; });
    if (it == workers.end() || it->hung) continue;
    HungWorker hw;
    hw.pid = it->ref.pid;
    hw.signal = it->python ? SIGABRT : SIGKILL;
    hw.note = "rank " + std::to_string(it->ref.rank) + " made no progress for " + tenths(h.stalled_for) +
              " s (last step " + std::to_string(h.step) + (h.phase.empty() ? "" : ", phase " + h.phase) +
              "; --hang_timeout " + seconds_text(h.timeout) + " s)";
    hw.message = hw.note + (it->python ? "; sending SIGABRT for its Python stacks" : "; killing it");
    verdict.declared.push_back(std::move(hw));
  }
  return verdict;
}

}  // namespace ddp::agent
