#include "agent/stall_watch.h"

#include <algorithm>

namespace ddp::agent {

void StallWatch::reset() {
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

}  // namespace ddp::agent
