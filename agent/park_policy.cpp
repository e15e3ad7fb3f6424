#include "agent/park_policy.h"

#include <algorithm>

namespace ddp::agent {

ParkPolicy::ParkPolicy(bool in_memory_restart, double park_timeout)
    : in_memory_restart_(in_memory_restart), park_timeout_(park_timeout) {}

bool ParkPolicy::may_park(const ParkView& w) const {
  return in_memory_restart_ && w.restartable && !w.hung && w.channel_open;
}

bool ParkPolicy::settled(const std::vector<ParkView>& workers) {
  return std::all_of(workers.begin(), workers.end(),
                     [](const ParkView& w) { return !w.alive || w.park == ParkState::kParked; });
}

AtStop ParkPolicy::at_stop(const ParkView& w, bool park) const {
  if (!park || !may_park(w)) return AtStop::kSignal;
  return w.park == ParkState::kNo ? AtStop::kAskToPark : AtStop::kKeep;
}

std::vector<std::string> ParkPolicy::overdue(const std::vector<ParkView>& not_parked) const {
  std::vector<std::string> lines;
  for (const auto& w : not_parked) {
    lines.push_back("worker " + std::to_string(w.ref.rank) + " (pid " + std::to_string(w.ref.pid) +
                    ") did not park within " + seconds_text(park_timeout_) +
                    " s of the restart (in-memory restart); stopping it");
  }
  return lines;
}

OnWord ParkPolicy::restartable_word(const ParkView& w, bool restartable) {
  return !restartable && w.park == ParkState::kAsked ? OnWord::kStop : OnWord::kNothing;
}

OnWord ParkPolicy::parked_word(const ParkView& w, bool stopping) {
  if (!w.restartable) return OnWord::kBreak;
  if (w.park == ParkState::kParked) return OnWord::kNothing;
  // A worker being stopped (signalled) dies of it, parked or not.
  if (stopping && w.park == ParkState::kNo) return OnWord::kNothing;
  return OnWord::kParked;
}

}  // namespace ddp::agent
