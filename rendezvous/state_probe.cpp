// Silent nodes found in under a second (docs/rendezvous.md, "Silent nodes"): a node that loses
// power or its link sends nothing, and only heartbeat_timeout would notice. But the job notices
// first: its other nodes' workers stop stepping, blocked in a collective with the silent one.
// Their agents say so (stall); the server then probes the nodes of the round it has not heard
// from since the stall began, and a node that does not answer within probe_timeout is lost.
//
// Three signals must coincide: a stall somewhere in the job, silence from the node itself, and
// silence from its host: a host that is up acknowledges the probe's bytes at the TCP level
// within milliseconds, even while its agent is busy or stopped (PeerCheck). A node whose workers
// stall but which answers (a slow step, a checkpoint, a lossy path between two other nodes) is
// cleared; a node whose host acknowledged the probe is left to heartbeat_timeout, and so is a
// node that is silent while the job keeps stepping.
//
// Silent since the stall began is not the only suspect: a node can speak after the stall began
// (its own stall report, a last heartbeat) and die a moment later. So a node that has missed a
// heartbeat (silent for more than heartbeat_interval) is probed too, at the next report: the
// survivors repeat theirs while they stay stalled. Every report is weighed (the reports of one
// kStallScanGap as one scan), none waits for another's probes to conclude. What bounds the
// traffic is per node: a node that answered a probe is not probed again within
// heartbeat_interval, so probes cost no more than heartbeats. A stall report names only its
// sender, so a client can cause probes, never the loss of a node.
#include <algorithm>

#include "rendezvous/state.h"

namespace ddp::rdzv {

void StateMachine::stall(ConnId conn, double stalled_for) {
  Job* job = job_of(conn);
  if (!job || job->state != JobState::Running || !(job->timeouts.probe_timeout > 0)) return;
  auto reporter = job->nodes.find(conn);
  if (reporter == job->nodes.end() || reporter->second.state != NodeState::Running) return;
  const double now = clock_.now();
  // Heard from since the stall began = alive while the job stalled, unless it has since missed a
  // heartbeat.
  const Job::StallReport report{conn, now - std::min(stalled_for, job->timeouts.heartbeat_interval), stalled_for};
  if (now >= job->next_stall_scan) {
    scan_for_silent(*job, report, now);
  } else if (!job->pending_stall || report.since > job->pending_stall->since) {
    job->pending_stall = report;
  }
}

void StateMachine::scan_for_silent(Job& job, const Job::StallReport& report, double now) {
  auto reporter = job.nodes.find(report.reporter);
  if (job.state != JobState::Running || reporter == job.nodes.end() || reporter->second.state != NodeState::Running)
    return;
  job.next_stall_scan = now + kStallScanGap;
  const Timeouts& t = job.timeouts;
  const Frame probe = encode(make_probe());
  std::size_t sent = 0;
  for (auto& [c, node] : job.nodes) {
    if (c == report.reporter || node.state != NodeState::Running || node.probe_out) continue;
    if (node.last_seen >= report.since) continue;
    const bool answered_lately = node.probed_at > now - t.heartbeat_interval && node.last_seen >= node.probed_at;
    if (answered_lately) continue;
    node.probed_at = now;
    node.probe_out = true;
    job.probes.emplace_back(c, now + t.probe_timeout);
    out_.send(c, probe);
    ++sent;
  }
  if (sent == 0) return;
  const std::string what = "the workers of " + describe(reporter->second) + " stalled for " +
                           seconds_text(report.stalled_for) + ": probing " + std::to_string(sent) +
                           " node(s) not heard from since it began, or for a heartbeat_interval";
  out_.log("job " + job.id + ": " + what);
  emit(job, "probe", "stall", describe(reporter->second), {},
       {{"stalled_for", report.stalled_for}, {"probed", sent}}, what);
}

void StateMachine::conclude_probes(Job& job, double now) {
  std::vector<std::pair<ConnId, std::string>> silent;
  while (!job.probes.empty() && job.probes.front().second <= now) {
    const ConnId c = job.probes.front().first;
    job.probes.pop_front();
    auto it = job.nodes.find(c);
    if (it == job.nodes.end()) continue;
    Node& node = it->second;
    node.probe_out = false;
    if (node.last_seen >= node.probed_at || node.state != NodeState::Running) continue;
    if (peer_check_ && peer_check_(c)) {
      // Its host is up (it acknowledged the probe): the agent is busy or stopped. Not a lost
      // host; heartbeat_timeout still bounds how long it may stay silent.
      out_.log("job " + job.id + ": " + describe(node) + " did not answer a probe within " +
               seconds_text(job.timeouts.probe_timeout) + " but its host acknowledged it: left to heartbeat_timeout");
      continue;
    }
    silent.emplace_back(c, "no answer to a probe within " + seconds_text(job.timeouts.probe_timeout) +
                               " (probe_timeout), nor an acknowledgement from its host, while the job's "
                               "other nodes stalled; silent for " + seconds_text(now - node.last_seen));
  }
  for (const auto& [c, why] : silent) {
    if (job.nodes.count(c) == 0) continue;
    node_gone(job, c, why, false);
    out_.drop(c, "probe_timeout", "dropped by the rendezvous server: " + why);
  }
}

}  // namespace ddp::rdzv
