// Drain and spares (docs/maintenance.md). An operator takes a node out of a running job on
// purpose, for maintenance or because it is slow. The node gets error "drained" and closes: its
// agent stops its workers and exits 0. The job's other nodes restart (not counted, not a
// failure: workers with in-memory restart park with the state of their last completed step, the
// others finish their step and checkpoint), and the next round takes a waiting node in the
// drained one's place. A --spare node (NodeSpec::spare) waits for such a place: eligible()
// counts it only up to the size of the last round.
#include <algorithm>
#include <cctype>

#include "rendezvous/state.h"

namespace ddp::rdzv {

namespace {

DrainResult refused(std::string code, std::string message) { return {std::move(code), std::move(message), ""}; }

// "3" names group rank 3; anything else is a host name.
std::optional<int> rank_named(const std::string& node) {
  if (node.empty() || node.size() > 6) return std::nullopt;
  for (char c : node) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  return std::stoi(node);
}

}  // namespace

// From the per-state counts, not a scan: a round of N joins asks this N times.
std::size_t StateMachine::eligible(const Job& job) const {
  const std::size_t spares = job.spares[static_cast<int>(NodeState::Waiting)];
  const std::size_t regular = count(job, NodeState::Waiting) - spares;
  const std::size_t places = job.last_round_size > regular ? job.last_round_size - regular : 0;
  return regular + std::min(spares, places);
}

DrainResult StateMachine::drain(const std::string& job_id, const std::string& node_name, bool force) {
  auto jt = jobs_.find(job_id);
  if (jt == jobs_.end()) {
    return refused("unknown_job", "no running job " + job_id + " on this rendezvous server (ddp-rendezvous status lists them)");
  }
  Job& job = jt->second;
  if (job.state == JobState::Restoring) {
    return refused("drain_refused", "job " + job_id + " is being restored after a rendezvous restart; drain it once it runs");
  }
  if (job.failing || job.state == JobState::Succeeded || job.state == JobState::Failed) {
    return refused("drain_refused", "job " + job_id + " is ending; there is nothing to drain");
  }
  // The node as status shows it: its group rank in the running round, or its host.
  const std::optional<int> rank = rank_named(node_name);
  std::vector<ConnId> matches;
  for (const auto& [conn, node] : job.nodes) {
    if (node.state == NodeState::Finished || node.state == NodeState::Succeeded) continue;
    const bool ranked = node.state == NodeState::Running && node.group_rank >= 0;
    if (rank ? ranked && node.group_rank == *rank : node.spec.host == node_name || node.spec.addr == node_name) {
      matches.push_back(conn);
    }
  }
  if (matches.empty()) {
    return refused("unknown_node", "job " + job_id + " has no node " + node_name +
                                " that runs or waits: give the host or the group rank that ddp-rendezvous status shows");
  }
  if (matches.size() > 1) {
    return refused("unknown_node", std::to_string(matches.size()) + " nodes of job " + job_id + " have host " + node_name +
                                ": give the group rank that ddp-rendezvous status shows instead");
  }
  const ConnId conn = matches.front();
  const Node& node = job.nodes.at(conn);
  const std::size_t left = left_without_one(job);
  if (left < static_cast<std::size_t>(job.min_nodes) && !force) {
    return refused("drain_refused", "draining " + describe(node) + " would leave job " + job_id + " " + std::to_string(left) +
                                 " node(s), fewer than its minimum of " + std::to_string(job.min_nodes) +
                                 ": start a spare node first, or pass --force (the job then waits join_timeout for one)");
  }
  const std::string who = describe(node);
  std::string message = "drained " + who + " from job " + job_id +
                        take_out(job, conn, "drain", "ddp-rendezvous drain took this node out of job " + job_id, force);
  maybe_complete(job);
  erase_if_empty(job_id);
  return {"", message, who};
}

std::string StateMachine::take_out(Job& job, ConnId conn, const std::string& cause, const std::string& why, bool force) {
  Node& node = job.nodes.at(conn);
  const bool running = node.state == NodeState::Running && job.state == JobState::Running;
  const std::size_t left = left_without_one(job);
  const std::string who = describe(node);
  const std::size_t spares = count(job, NodeState::Waiting) - (node.state == NodeState::Waiting ? 1 : 0);
  remove_node(job, conn);
  out_.drop(conn, "drained", why);
  job.waiting_changed = true;
  out_.log("job " + job.id + (cause == "drain" ? ": drained: " : ": replaced a straggler: ") + who);
  emit(job, "node_drained", cause, who, {}, {{"force", force}, {"spares", spares}});
  if (!running) return "";
  end_round(job, "node " + who + (cause == "drain" ? " was drained" : " was replaced as a straggler"), false, cause);
  if (left < static_cast<std::size_t>(job.min_nodes)) {
    return "; the job waits join_timeout for " + std::to_string(job.min_nodes - left) + " more node(s)";
  }
  if (spares > 0) return "; the job restarts with a waiting node in its place";
  return "; the job restarts with " + std::to_string(left) + " node(s)";
}

}  // namespace ddp::rdzv
