#include "agent/metrics.h"

namespace ddp::agent {

AgentMetrics::AgentMetrics()
    : starts_(prometheus::BuildCounter().Name("ddp_agent_worker_starts_total").Help("Workers started").Register(registry_)),
      exits_(prometheus::BuildCounter()
                 .Name("ddp_agent_worker_exits_total")
                 .Help("Worker exits by cause (success, exit_code, signal, stopped, given_up, hang, ...)")
                 .Register(registry_)),
      restarts_(prometheus::BuildCounter()
                    .Name("ddp_agent_restarts_total")
                    .Help("Restarts of this node's worker group decided by the rendezvous, by cause")
                    .Register(registry_)),
      running_gauge_(prometheus::BuildGauge().Name("ddp_agent_workers_running").Help("Workers running now").Register(registry_)),
      generation_(prometheus::BuildGauge()
                      .Name("ddp_agent_generation")
                      .Help("The rendezvous round the workers run in (DDPLAUNCH_GENERATION)")
                      .Register(registry_)),
      last_step_(prometheus::BuildGauge()
                     .Name("ddp_agent_last_step")
                     .Help("Last training step a worker reported, by local rank")
                     .Register(registry_)),
      steps_per_second_(prometheus::BuildGauge()
                            .Name("ddp_agent_steps_per_second")
                            .Help("Training steps per second between a worker's last two progress reports, by local rank")
                            .Register(registry_)) {
  running_gauge_.Add({}).Set(0);
  generation_.Add({}).Set(0);
}

void AgentMetrics::record(const metrics::Event& e) {
  if (e.type == "worker_started") {
    starts_.Add({}).Increment();
    running_gauge_.Add({}).Set(++running_);
  } else if (e.type == "worker_exited") {
    exits_.Add({{"cause", causes_.admit(e.cause)}}).Increment();
    if (running_ > 0) --running_;
    running_gauge_.Add({}).Set(running_);
  } else if (e.type == "restart") {
    restarts_.Add({{"cause", causes_.admit(e.cause)}}).Increment();
  } else if (e.type == "round") {
    generation_.Add({}).Set(static_cast<double>(e.generation));
  }
}

void AgentMetrics::set_progress(int local_rank, double step, double time) {
  const std::string rank = std::to_string(local_rank);
  last_step_.Add({{"local_rank", rank}}).Set(step);
  auto it = last_.find(local_rank);
  if (it != last_.end() && time > it->second.time && step >= it->second.step) {
    steps_per_second_.Add({{"local_rank", rank}}).Set((step - it->second.step) / (time - it->second.time));
  } else if (it != last_.end() && step < it->second.step) {
    steps_per_second_.Add({{"local_rank", rank}}).Set(0);  // went back (restarted): the rate starts again
  }
  last_[local_rank] = {step, time};
}

}  // namespace ddp::agent
