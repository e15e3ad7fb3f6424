// Waits for a condition that a real process brings about (a child exiting, a file appearing),
// polling every 5 ms up to `deadline`; returns whether it held. For the agent's process tests,
// which have no clock to inject: what they wait on happens in another process.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace ddp::agent::testing {

inline bool wait_until(const std::function<bool()>& condition, std::chrono::seconds deadline) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return condition();
}

}  // namespace ddp::agent::testing
