// The daemon's Prometheus metrics (docs/metrics.md): counters and histograms fed by the state
// machine's events, gauges read from the state machine at each scrape.
//
// Owned by the daemon's main; lives as long as the server. Called on the server's io_context
// thread only (events come from the state machine, scrapes from the metrics HTTP server on the
// same io_context).
#pragma once

#include <cstddef>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "metrics/event.h"
#include "metrics/exposition.h"
#include "rendezvous/state.h"

namespace ddp::rdzv {

class DaemonMetrics : public metrics::EventSink {
 public:
  DaemonMetrics();
  // Counts rounds, restarts, failures, lost nodes and ended jobs by cause; observes the round's
  // formation and failure-to-restart times.
  void record(const metrics::Event& event) override;
  // The whole exposition: the counters and histograms, plus gauges from `gauges` (jobs and nodes
  // by state, each job's oldest heartbeat age) and the open connections.
  std::string render(const Gauges& gauges, std::size_t connections) const;

 private:
  prometheus::Registry registry_;
  prometheus::Family<prometheus::Counter>& rounds_;
  prometheus::Family<prometheus::Counter>& restarts_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Family<prometheus::Counter>& nodes_lost_;
  prometheus::Family<prometheus::Counter>& jobs_ended_;
  prometheus::Family<prometheus::Histogram>& formation_;
  prometheus::Family<prometheus::Histogram>& failure_to_restart_;
  prometheus::Counter& rounds_total_;
  prometheus::Histogram& formation_seconds_;
  prometheus::Histogram& failure_to_restart_seconds_;
  metrics::LabelValues causes_;
};

}  // namespace ddp::rdzv
