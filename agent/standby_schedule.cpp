#include "agent/standby_schedule.h"

#include <algorithm>

#include "agent/policy.h"

namespace ddp::agent {

StandbySchedule::StandbySchedule(double delay, double delay_max, double ready_timeout)
    : delay_(delay), delay_max_(delay_max), ready_timeout_(ready_timeout) {}

double StandbySchedule::round_started(double now) {
  round_began_ = now;
  return now + delay_;
}

std::optional<double> StandbySchedule::look(double now, bool every_worker_stepped) const {
  const double waited = now - round_began_;
  if (waited >= delay_max_ || every_worker_stepped) return std::nullopt;
  return now + std::min(kStepPoll, delay_max_ - waited);
}

std::optional<double> StandbySchedule::await_ready(const std::vector<int>& local_ranks, double now) {
  waiting_for_ = std::set<int>(local_ranks.begin(), local_ranks.end());
  awaiting_ = !waiting_for_.empty();
  if (!awaiting_) return std::nullopt;
  return now + ready_timeout_;
}

bool StandbySchedule::ready(int local_rank) {
  waiting_for_.erase(local_rank);
  if (!awaiting_ || !waiting_for_.empty()) return false;
  awaiting_ = false;
  return true;
}

std::optional<std::string> StandbySchedule::ready_timed_out() {
  if (!awaiting_) return std::nullopt;
  awaiting_ = false;
  waiting_for_.clear();
  return "standbys: not all of them said they are ready within " + seconds_text(ready_timeout_) +
         " s (DDPLAUNCH_STANDBY_READY_TIMEOUT); joining the job without waiting for them";
}

}  // namespace ddp::agent
