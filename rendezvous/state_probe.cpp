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
// node that is silent while the job keeps stepping. A stall report names only its sender, so a
// client can cause probes (one round per job at a time, then at most one per
// heartbeat_interval), never the loss of a node.
#include <algorithm>

#include "rendezvous/state.h"

namespace ddp::rdzv {

void StateMachine::stall(ConnId conn, double stalled_for) {
  Job* job = job_of(conn);
  if (!job || job->state != JobState::Running || !(job->timeouts.probe_timeout > 0)) return;
  auto reporter = job->nodes.find(conn);
  if (reporter == job->nodes.end() || reporter->second.state != NodeState::Running) return;
  const double now = clock_.now();
  if (!job->probed.empty() || now < job->next_probe_round) return;  // a round is in progress or just ended
  // Heard from since the stall began = alive while the job stalled; the rest are asked.
  const double since = now - std::min(stalled_for, job->timeouts.heartbeat_timeout);
  const Frame probe = encode(make_probe());
  for (auto& [c, node] : job->nodes) {
    if (c == conn || node.state != NodeState::Running || node.last_seen >= since) continue;
    job->probed.push_back(c);
    out_.send(c, probe);
  }
  if (job->probed.empty()) return;
  job->probed_at = now;
  job->probe_deadline = now + job->timeouts.probe_timeout;
  const std::string what = "the workers of " + describe(reporter->second) + " stalled for " +
                           seconds_text(stalled_for) + ": probing " + std::to_string(job->probed.size()) +
                           " node(s) not heard from since";
  out_.log("job " + job->id + ": " + what);
  emit(*job, "probe", "stall", describe(reporter->second), {},
       {{"stalled_for", stalled_for}, {"probed", job->probed.size()}}, what);
}

void StateMachine::conclude_probes(Job& job, double now) {
  std::vector<ConnId> probed;
  probed.swap(job.probed);
  std::vector<std::pair<ConnId, std::string>> silent;
  for (ConnId c : probed) {
    auto it = job.nodes.find(c);
    if (it == job.nodes.end()) continue;
    const Node& node = it->second;
    if (node.last_seen >= job.probed_at || node.state != NodeState::Running) continue;
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
  if (silent.empty()) job.next_probe_round = now + job.timeouts.heartbeat_interval;
  for (const auto& [c, why] : silent) {
    if (job.nodes.count(c) == 0) continue;
    node_gone(job, c, why, false);
    out_.drop(c, "probe_timeout", "dropped by the rendezvous server: " + why);
  }
}

}  // namespace ddp::rdzv
