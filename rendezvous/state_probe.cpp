// Silent nodes found in under a second (docs/rendezvous.md, "Silent nodes"): a node that loses
// power or its link sends nothing, and only heartbeat_timeout would notice. But the job notices
// first: its other nodes' workers stop stepping, blocked in a collective with the silent one.
// Their agents say so (stall); the server then probes the nodes of the round it has not heard
// from since the stall began, and a node that does not answer within probe_timeout is lost.
//
// Three signals must coincide: a stall somewhere in the job, silence from the node itself, and
// silence from its host: a host that is up acknowledges the probe's bytes at the TCP level
// within milliseconds, even while its agent is busy or stopped (PeerCheck), and answers a
// connection that one or two other agents of the job attempt for the server (check_peer, the
// indirect probes of SWIM: a path to the server that loses the probe does not convict a host
// that its peers still reach). A node whose workers stall but which answers (a slow step, a
// checkpoint, a lossy path between two other nodes) is cleared; a node whose host acknowledged
// the probe, or was reached by a peer, is left to heartbeat_timeout, and so is a node that is
// silent while the job keeps stepping. The peers' word can only spare a node, never convict one.
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
  std::vector<ConnId> probed;
  // Agents heard from since the stall began can check a probed node's host for the server; a few
  // are enough (kCheckHelpers per probed node, taken in turn).
  std::vector<ConnId> helpers;
  constexpr std::size_t kMaxHelpers = 8;
  if (reporter->second.spec.peer_checks) helpers.push_back(report.reporter);
  for (auto& [c, node] : job.nodes) {
    if (c == report.reporter || node.state != NodeState::Running || node.probe_out) continue;
    if (node.last_seen >= report.since) {
      if (node.spec.peer_checks && helpers.size() < kMaxHelpers) helpers.push_back(c);
      continue;
    }
    const bool answered_lately = node.probed_at > now - t.heartbeat_interval && node.answered_probe;
    if (answered_lately) continue;
    node.probed_at = now;
    node.probe_out = true;
    node.answered_probe = false;
    node.vouched_by = 0;
    job.probes.emplace_back(c, now + t.probe_timeout);
    out_.send(c, probe);
    probed.push_back(c);
  }
  if (probed.empty()) return;
  for (std::size_t i = 0; i < probed.size(); ++i) ask_to_check(job, probed[i], helpers, i);
  const std::string what = "the workers of " + describe(reporter->second) + " stalled for " +
                           seconds_text(report.stalled_for) + ": probing " + std::to_string(probed.size()) +
                           " node(s) not heard from since it began, or for a heartbeat_interval";
  out_.log("job " + job.id + ": " + what);
  emit(job, "probe", "stall", describe(reporter->second), {},
       {{"stalled_for", report.stalled_for}, {"probed", probed.size()}}, what);
}

void StateMachine::ask_to_check(Job& job, ConnId node, const std::vector<ConnId>& helpers, std::size_t turn) {
  Node& n = job.nodes.at(node);
  n.check_id = 0;
  const int port = peer_port_ ? peer_port_(node) : 0;
  if (helpers.empty() || port <= 0 || n.spec.addr.empty()) return;
  Job::IndirectCheck check{node, {}};
  for (std::size_t k = 0; k < std::min(kCheckHelpers, helpers.size()); ++k) {
    check.helpers.push_back(helpers[(turn * kCheckHelpers + k) % helpers.size()]);
  }
  n.check_id = ++next_check_id_;
  // Half the probe's time: the answer must be back before the probe's verdict.
  const Frame frame = encode(make_check_peer({n.check_id, n.spec.addr, port, job.timeouts.probe_timeout / 2}));
  for (ConnId helper : check.helpers) out_.send(helper, frame);
  job.checks.emplace(n.check_id, std::move(check));
}

void StateMachine::peer_alive(ConnId conn, std::uint64_t id) {
  Job* job = job_of(conn);
  if (!job) return;
  auto check = job->checks.find(id);
  if (check == job->checks.end()) return;
  const auto& helpers = check->second.helpers;
  if (std::find(helpers.begin(), helpers.end(), conn) == helpers.end()) return;  // not asked
  auto node = job->nodes.find(check->second.node);
  if (node != job->nodes.end() && node->second.check_id == id && node->second.vouched_by == 0) {
    node->second.vouched_by = conn;
  }
}

void StateMachine::tick_probes(Job& job, double now) {
  if (job.pending_stall && now >= job.next_stall_scan) {
    const Job::StallReport report = *job.pending_stall;
    job.pending_stall.reset();
    scan_for_silent(job, report, now);
  }
  if (!job.probes.empty() && now >= job.probes.front().second) conclude_probes(job, now);
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
    job.checks.erase(node.check_id);
    node.check_id = 0;
    if (node.answered_probe || node.state != NodeState::Running) continue;
    std::string alive_by;
    if (peer_check_ && peer_check_(c)) {
      alive_by = "its host acknowledged it";
    } else if (auto helper = job.nodes.find(node.vouched_by); node.vouched_by != 0 && helper != job.nodes.end()) {
      alive_by = describe(helper->second) + " reached its host";
    }
    if (!alive_by.empty()) {
      // Its host is up: the agent is busy or stopped, or only the path to the server is lossy.
      // Not a lost host; heartbeat_timeout still bounds how long it may stay silent.
      out_.log("job " + job.id + ": " + describe(node) + " did not answer a probe within " +
               seconds_text(job.timeouts.probe_timeout) + " but " + alive_by + ": left to heartbeat_timeout");
      continue;
    }
    silent.emplace_back(c, "no answer to a probe within " + seconds_text(job.timeouts.probe_timeout) +
                               " (probe_timeout), nor an acknowledgement from its host, while the job's "
                               "other nodes stalled; silent for " + seconds_text(now - node.last_seen));
  }
  if (job.probes.empty()) job.checks.clear();  // checks of nodes gone meanwhile
  for (const auto& [c, why] : silent) {
    if (job.nodes.count(c) == 0) continue;
    node_gone(job, c, why, false);
    out_.drop(c, "probe_timeout", "dropped by the rendezvous server: " + why);
  }
}

}  // namespace ddp::rdzv
