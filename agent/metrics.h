// The agent's Prometheus metrics (docs/metrics.md): worker starts, exits by cause, restarts,
// the round, and per local rank the last training step and steps per second.
//
// Owned by the launcher (shared with the agent's EventBus); lives for one ddplaunch run. Events
// and progress reports arrive on the agent's io_context thread; the metrics HTTP server runs on
// the same thread, so nothing here locks (prometheus-cpp's own objects are thread-safe anyway).
#pragma once

#include <map>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "metrics/event.h"
#include "metrics/exposition.h"

namespace ddp::agent {

class AgentMetrics : public metrics::EventSink {
 public:
  AgentMetrics();
  // worker_started, worker_exited (by cause), restart (by cause), round (generation).
  void record(const metrics::Event& event) override;
  // A progress report of local rank `local_rank`: it reached `step` at `time` (seconds, any
  // monotonic origin). Sets ddp_agent_last_step and, from the previous report of that rank,
  // ddp_agent_steps_per_second (a step count that goes back, as after a restart from a
  // checkpoint, starts the rate again).
  void set_progress(int local_rank, double step, double time);
  // Workers running now (started and not yet exited), from the events.
  int running() const { return running_; }
  std::string render() const { return metrics::exposition({&registry_}); }

 private:
  prometheus::Registry registry_;
  prometheus::Family<prometheus::Counter>& starts_;
  prometheus::Family<prometheus::Counter>& exits_;
  prometheus::Family<prometheus::Counter>& restarts_;
  prometheus::Family<prometheus::Gauge>& running_gauge_;
  prometheus::Family<prometheus::Gauge>& generation_;
  prometheus::Family<prometheus::Gauge>& last_step_;
  prometheus::Family<prometheus::Gauge>& steps_per_second_;
  metrics::LabelValues causes_;
  int running_ = 0;
  struct Last {
    double step = 0;
    double time = 0;
  };
  std::map<int, Last> last_;
};

}  // namespace ddp::agent
