// Time for the rendezvous state machine, injected so tests drive every deadline without sleeping.
#pragma once

#include <chrono>

namespace ddp::rdzv {

// Monotonic seconds. Implementations are called on the thread that owns the state machine.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual double now() const = 0;
};

// The real clock: std::chrono::steady_clock in seconds.
class SteadyClock : public Clock {
 public:
  double now() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};

// A clock that moves only when told to (tests).
class ManualClock : public Clock {
 public:
  double now() const override { return now_; }
  void advance(double seconds) { now_ += seconds; }

 private:
  double now_ = 1000.0;
};

}  // namespace ddp::rdzv
