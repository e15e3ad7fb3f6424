// The worker SDK's heartbeat per step (ddp::Progress::step), timed inside a worker that
// ddplaunch started (so the slot is real shared memory the agent samples). Built by bench/hang/run.
#include <chrono>
#include <cstdio>

#include "ddp/progress.h"

int main() {
  auto& progress = ddp::Progress::instance();
  if (!progress.enabled()) {
    std::fprintf(stderr, "step_cost: no DDPLAUNCH_PROGRESS_FILE (run it under ddplaunch)\n");
    return 2;
  }
  constexpr long kSteps = 50'000'000;
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < kSteps; ++i) progress.step(i);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kSteps;
    if (ns < best) best = ns;
  }
  std::printf("%.2f ns per step\n", best);
  return 0;
}
