#include "agent/stall_watch.h"

#include <algorithm>

namespace ddp::agent {

void StallWatch::reset(double now) {
  round_began_ = now;
  beats_ = 0;
  seen_ = false;
  next_report_ = 0;
}

double StallWatch::threshold() const { return std::max(kFloor, kFactor * step_time_); }

std::optional<double> StallWatch::observe(std::uint64_t beats, int steppers, double now) {
  if (beats != beats_) {
    // The workers stepped: one more sample of their step time, unless the gap was a stall (a
    // stall is not a step time: it would raise the bar for the next one).
    const double gap = now - last_change_;
    if (seen_ && beats > beats_ && steppers > 0 && (step_time_ == 0 || gap <= threshold())) {
      const double sample = gap * steppers / static_cast<double>(beats - beats_);
      step_time_ = step_time_ == 0 ? sample : 0.8 * step_time_ + 0.2 * sample;
    }
    beats_ = beats;
    last_change_ = now;
    seen_ = beats > 0;
    ever_seen_ = ever_seen_ || seen_;
    next_report_ = 0;
    return std::nullopt;
  }
  if (!seen_ || steppers == 0) return std::nullopt;
  const double silent = now - last_change_;
  if (next_report_ == 0) {
    if (silent < threshold()) return std::nullopt;
    next_report_ = silent;
    repeat_ = kFirstRepeat;
  }
  if (silent < next_report_) return std::nullopt;
  next_report_ = silent + repeat_;
  repeat_ *= 2;
  return silent;
}

std::optional<std::string> StallWatch::blind(double now, bool python) {
  if (said_blind_ || ever_seen_ || now - round_began_ < kBlindAfter) return std::nullopt;
  said_blind_ = true;
  return std::string("no worker of this node has reported a step in 30 s: a node of this job that vanishes "
                     "without a word (power, link) is found after heartbeat_timeout, not within a second "
                     "(docs/rendezvous.md, \"Silent nodes\"); ") +
         (python ? "a step is an optimizer.step() (torch 2.0 and later) or a ddplaunch.step() call, and a worker "
                   "started through a wrapper script does not get ddplaunch's Python helper"
                 : "a step is reported through the worker SDK (ddp::Progress, or its Trainer)");
}

}  // namespace ddp::agent
