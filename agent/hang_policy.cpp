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

std::optional<std::string> HangWatch::silence(double now, bool python) {
  if (!policy_.enabled() || said_silence_ || monitor_.any_beat()) return std::nullopt;
  const double wait = policy_.automatic ? policy_.auto_floor : policy_.timeout;
  if (now - round_began_ < wait) return std::nullopt;
  said_silence_ = true;
  return std::string("--hang_timeout: no worker has reported a step in ") + seconds_text(wait) +
         " s, and a worker is watched only from its first step: " +
         (python ? "a step is an optimizer.step() (torch 2.0 and later) or a ddplaunch.step() call"
                 : "a step is reported through the worker SDK (ddp::Progress, or its Trainer)");
}

}  // namespace ddp::agent
