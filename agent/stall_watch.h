// Notices that this node's workers stopped stepping, so that the rendezvous can look for a
// silent node at once instead of after heartbeat_timeout (docs/rendezvous.md, "Silent nodes").
// In synchronous DDP a node that vanishes without a word (power, link, kernel) blocks every
// other rank in its next collective: the survivors' steps stop together. A stall is a silence
// of the node's workers longer than kFactor of their own step time, and never under kFloor; it
// is reported once, then again while it lasts at growing intervals (kFirstRepeat, doubling).
//
// Pure: the shell samples the progress board every kPeriod and feeds the sums here, with the
// time (agent_features.cpp); tested on a fake clock (tests/agent/policies_test.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ddp::agent {

class StallWatch {
 public:
  static constexpr double kPeriod = 0.05;      // s between samples of the board
  static constexpr double kFloor = 0.15;       // s: no shorter silence is a stall
  static constexpr double kFactor = 5.0;       // step times: nor one shorter than this many
  static constexpr double kFirstRepeat = 0.5;  // s after the first report, then doubling
  static constexpr double kBlindAfter = 30.0;  // s of a round without a step: say it once

  // A new round starts at `now`: nothing seen yet (the step time of the last one is kept: same
  // steps).
  void reset(double now);
  // `beats`: the sum of the live workers' beats; `steppers`: how many of them have beaten.
  // Returns how long the workers have been silent when a report is due, else nullopt.
  std::optional<double> observe(std::uint64_t beats, int steppers, double now);
  // The silence that is a stall now.
  double threshold() const;
  // A watch with nothing to watch says so: once per agent, when no worker has reported a step
  // kBlindAfter into a round (and none ever did), what to say; else nullopt. `python`: the
  // workers are Python programs.
  std::optional<std::string> blind(double now, bool python);
  double step_time() const { return step_time_; }

 private:
  std::uint64_t beats_ = 0;
  double last_change_ = 0;
  bool seen_ = false;       // a beat of this round was seen
  double step_time_ = 0;    // smoothed seconds per step of one worker; 0 = not known yet
  double next_report_ = 0;  // the silence at which the next report is due; 0 = none reported
  double repeat_ = 0;
  double round_began_ = 0;
  bool ever_seen_ = false;  // a beat of any round was seen
  bool said_blind_ = false;
};

}  // namespace ddp::agent
