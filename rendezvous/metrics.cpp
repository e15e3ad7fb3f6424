#include "rendezvous/metrics.h"

#include <prometheus/gauge.h>

namespace ddp::rdzv {

namespace {

// Seconds: a round forms in milliseconds on one host and in minutes when it waits for nodes.
const prometheus::Histogram::BucketBoundaries kSecondsBuckets = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                                 1,     2.5,   5,    10,    30,   60,  120, 300, 600};

}  // namespace

DaemonMetrics::DaemonMetrics()
    : rounds_(prometheus::BuildCounter()
                  .Name("ddp_rendezvous_rounds_total")
                  .Help("Rendezvous rounds completed, all jobs")
                  .Register(registry_)),
      restarts_(prometheus::BuildCounter()
                    .Name("ddp_rendezvous_restarts_total")
                    .Help("Rounds ended for a restart, by cause (worker_failure, node_lost, node_left, drain, straggler, "
                          "node_joined, job_failing, membership) and whether the restart counted against --max_restarts")
                    .Register(registry_)),
      failures_(prometheus::BuildCounter()
                    .Name("ddp_rendezvous_failures_total")
                    .Help("Worker failures reported by agents, by cause (exit_code, signal, hang, ...)")
                    .Register(registry_)),
      nodes_lost_(prometheus::BuildCounter()
                      .Name("ddp_rendezvous_nodes_lost_total")
                      .Help("Nodes that left a job or were lost, by cause (connection_closed, heartbeat_timeout, probe_timeout, left, "
                            "drain)")
                      .Register(registry_)),
      jobs_ended_(prometheus::BuildCounter()
                      .Name("ddp_rendezvous_jobs_ended_total")
                      .Help("Jobs that ended, by result (succeeded, failed, join_timeout)")
                      .Register(registry_)),
      formation_(prometheus::BuildHistogram()
                     .Name("ddp_rendezvous_round_formation_seconds")
                     .Help("Time from the start of gathering (job start or end of the previous round) to the "
                           "round's completion")
                     .Register(registry_)),
      failure_to_restart_(prometheus::BuildHistogram()
                              .Name("ddp_rendezvous_failure_to_restart_seconds")
                              .Help("Time from a worker failure or a lost node ending a round to the next round's "
                                    "completion")
                              .Register(registry_)),
      rounds_total_(rounds_.Add({})),
      formation_seconds_(formation_.Add({}, kSecondsBuckets)),
      failure_to_restart_seconds_(failure_to_restart_.Add({}, kSecondsBuckets)) {}

void DaemonMetrics::record(const metrics::Event& e) {
  if (e.type == "round") {
    rounds_total_.Increment();
    if (auto it = e.fields.find("formation_seconds"); it != e.fields.end() && it->is_number()) {
      formation_seconds_.Observe(it->get<double>());
    }
    if (auto it = e.fields.find("failure_to_restart_seconds"); it != e.fields.end() && it->is_number()) {
      failure_to_restart_seconds_.Observe(it->get<double>());
    }
  } else if (e.type == "restart") {
    const bool counted = e.fields.value("counted", false);
    restarts_.Add({{"cause", causes_.admit(e.cause)}, {"counted", counted ? "true" : "false"}}).Increment();
  } else if (e.type == "failure" || e.type == "hang") {
    failures_.Add({{"cause", causes_.admit(e.type == "hang" ? "hang" : e.cause)}}).Increment();
  } else if (e.type == "node_lost" || e.type == "node_left" || e.type == "node_drained") {
    nodes_lost_.Add({{"cause", causes_.admit(e.cause)}}).Increment();
  } else if (e.type == "job_end") {
    jobs_ended_.Add({{"result", causes_.admit(e.cause)}}).Increment();
  }
}

std::string DaemonMetrics::render(const Gauges& g, std::size_t connections) const {
  prometheus::Registry now;  // gauges of this scrape only: a job gone is no series left behind
  auto& jobs = prometheus::BuildGauge().Name("ddp_rendezvous_jobs").Help("Jobs the daemon serves, by state").Register(now);
  for (const auto& [state, n] : g.jobs_by_state) jobs.Add({{"state", state}}).Set(static_cast<double>(n));
  auto& kept = prometheus::BuildGauge()
                   .Name("ddp_rendezvous_finished_jobs_kept")
                   .Help("Finished jobs still listed by status (--keep_finished)")
                   .Register(now);
  kept.Add({}).Set(static_cast<double>(g.finished_jobs_kept));
  auto& nodes = prometheus::BuildGauge().Name("ddp_rendezvous_nodes").Help("Nodes of every job, by state").Register(now);
  for (const auto& [state, n] : g.nodes_by_state) nodes.Add({{"state", state}}).Set(static_cast<double>(n));
  auto& age = prometheus::BuildGauge()
                  .Name("ddp_rendezvous_heartbeat_age_seconds")
                  .Help("Per job: seconds since its most silent node was last heard from")
                  .Register(now);
  for (const auto& [job, seconds] : g.oldest_heartbeat_age) age.Add({{"job", job}}).Set(seconds);
  auto& spares = prometheus::BuildGauge()
                     .Name("ddp_rendezvous_spare_nodes")
                     .Help("Per job: nodes waiting beside its running round to take a failed or drained node's place")
                     .Register(now);
  for (const auto& [job, n] : g.spares) spares.Add({{"job", job}}).Set(static_cast<double>(n));
  auto& stragglers = prometheus::BuildGauge()
                         .Name("ddp_rendezvous_straggler_nodes")
                         .Help("Per job: nodes named stragglers (busy time per step above --straggler_factor x the "
                               "others' median for --straggler_window)")
                         .Register(now);
  for (const auto& [job, n] : g.stragglers) stragglers.Add({{"job", job}}).Set(static_cast<double>(n));
  // Gauges, not counters: a restart moves training already counted productive to lost.
  auto& spent = prometheus::BuildGauge()
                    .Name("ddp_rendezvous_goodput_seconds")
                    .Help("Per job: its wall time so far by category (docs/goodput.md); the categories add up to it")
                    .Register(now);
  auto& ratio = prometheus::BuildGauge()
                    .Name("ddp_rendezvous_goodput_ratio")
                    .Help("Per job: productive time as a share of its wall time (0-1)")
                    .Register(now);
  for (const auto& [job, totals] : g.goodput) {
    for (int i = 0; i < kSpentCount; ++i) {
      spent.Add({{"job", job}, {"category", spent_name(static_cast<Spent>(i))}}).Set(totals.seconds[i]);
    }
    ratio.Add({{"job", job}}).Set(totals.percent() / 100.0);
  }
  auto& conns = prometheus::BuildGauge()
                    .Name("ddp_rendezvous_connections")
                    .Help("Open client connections (agents and status queries)")
                    .Register(now);
  conns.Add({}).Set(static_cast<double>(connections));
  return metrics::exposition({&registry_, &now});
}

}  // namespace ddp::rdzv
