// StateMachine::resume and the restore of a job from its agents' resumes.
// Kept beside state.cpp so the resume rules read in one place; same class, same thread rules.
#include <limits>
#include <sstream>

#include "rendezvous/auth.h"
#include "rendezvous/state.h"

namespace ddp::rdzv {

namespace {

std::string who(const ResumeRequest& r) {
  const std::string& name = r.node.host.empty() ? r.node.addr : r.node.host;
  return name + " [group rank " + std::to_string(r.assignment.group_rank) + ", generation " +
         std::to_string(r.assignment.generation) + "]";
}

bool same_round(const Assignment& a, const Assignment& b) {
  return a.generation == b.generation && a.group_world_size == b.group_world_size &&
         a.world_size == b.world_size && a.master_addr == b.master_addr && a.master_port == b.master_port;
}

}  // namespace

// From OpenSSL's generator (auth.h), like the nonces: a node's secret is a credential, and one
// std::random_device per secret cost 12-16% of the daemon's CPU in a 1,000-agent round. Drawn
// from a pool: one RAND_bytes call per secret was still 5% of a round's daemon CPU.
std::string random_secret() { return pooled_random_hex(kMinSecretChars / 2); }

void StateMachine::resume(ConnId conn, const ResumeRequest& r) {
  if (Job* old = job_of(conn)) {
    // A resume is the first thing a new connection says; a member saying it is confused.
    std::string id = old->id;
    node_gone(*old, conn, "sent resume after joining", true);
    erase_if_empty(id);
    out_.drop(conn, "bad_resume", "resume must be the first message after hello, before any join");
    return;
  }
  auto jit = jobs_.find(r.job_id);
  if (jit == jobs_.end()) {
    restore_job(conn, r);
    return;
  }
  Job& job = jit->second;
  if (r.node.min_nodes != job.min_nodes || r.node.max_nodes != job.max_nodes) {
    out_.drop(conn, "nnodes_mismatch", "resume names --nnodes " + std::to_string(r.node.min_nodes) + ":" +
                                           std::to_string(r.node.max_nodes) + " but job " + job.id + " has " +
                                           std::to_string(job.min_nodes) + ":" + std::to_string(job.max_nodes));
    return;
  }
  if (job.state == JobState::Succeeded || job.state == JobState::Failed) {
    out_.drop(conn, "job_closed", "job " + job.id + " already " + state_name(job.state));
    return;
  }
  if (job.state == JobState::Restoring) {
    resume_restoring(job, conn, r);
  } else {
    resume_live(job, conn, r);
  }
}

// A job nobody here knows: the first resume defines it, with its policy and its round.
void StateMachine::adopt_goodput(Job& job, const ResumeRequest& r) {
  const Assignment& a = r.assignment;
  if (job.goodput_adopted || a.generation != job.generation) return;
  auto totals = GoodputTotals::from_array(a.goodput);
  if (!totals) return;
  // The account when the round formed, and the round's time since as training: the old server's
  // finer split of it (start-up, checkpoint stalls) went with it.
  job.goodput.restore(clock_.now() - a.round_age, *totals, true, static_cast<std::size_t>(a.group_world_size),
                      static_cast<std::size_t>(job.max_nodes));
  job.goodput_adopted = true;
}

void StateMachine::restore_job(ConnId conn, const ResumeRequest& r) {
  const double now = clock_.now();
  Job& job = jobs_[r.job_id];
  job.id = r.job_id;
  job.min_nodes = r.node.min_nodes;
  job.max_nodes = r.node.max_nodes;
  job.max_restarts = r.node.max_restarts;
  job.timeouts = r.node.timeouts;
  job.straggler = r.node.straggler;
  job.state = JobState::Restoring;
  job.generation = r.assignment.generation;
  job.restarts_used = r.assignment.restart_count;
  job.round_size = static_cast<std::size_t>(r.assignment.group_world_size);
  job.last_round_size = job.round_size;
  job.restore_round = r.assignment;
  job.rebuilt_at = now;
  job.restore_deadline = now + job.timeouts.heartbeat_timeout;
  job.gather_since = now;
  job.goodput = new_account(now, job.timeouts);
  adopt_goodput(job, r);
  out_.log("job " + job.id + ": rebuilt from the resume of " + who(r) + " (restarts " +
           std::to_string(job.restarts_used) + "/" + std::to_string(job.max_restarts) + "); waiting up to " +
           seconds_text(job.timeouts.heartbeat_timeout) + " for the other " +
           std::to_string(job.round_size - 1) + " nodes of generation " + std::to_string(job.generation));
  add_resumed(job, conn, r, NodeState::Running);
  if (job.restore_holders.size() == job.round_size) conclude_restore(job);
}

void StateMachine::resume_restoring(Job& job, ConnId conn, const ResumeRequest& r) {
  const Assignment& a = r.assignment;
  if (job.loaded && a.generation == job.generation) {
    // Loaded from etcd: the rank's secret is known; no trust on first use.
    for (const RecordMember& m : job.round_members) {
      if (m.group_rank != a.group_rank || m.secret == r.secret) continue;
      out_.log("job " + job.id + ": refused the resume of " + who(r) + ": not the secret etcd holds for that rank");
      out_.drop(conn, "resume_refused", "group rank " + std::to_string(a.group_rank) + " of job " + job.id +
                                            " generation " + std::to_string(a.generation) +
                                            " belongs to another node; a node can only resume its own rank");
      return;
    }
  }
  if (job.restore_deadline == std::numeric_limits<double>::infinity()) {
    job.restore_deadline = clock_.now() + job.timeouts.heartbeat_timeout;  // the first resume of a loaded job
  }
  // The restart count is the highest any node saw: a restart the old server counted stays
  // counted even when the node that heard of it comes back last.
  job.restarts_used = std::max(job.restarts_used, a.restart_count);
  adopt_goodput(job, r);
  if (a.generation > job.generation) {
    // A newer round than the nodes so far resumed: it wins; their older round is over.
    out_.log("job " + job.id + ": " + who(r) + " ran a newer round than generation " +
             std::to_string(job.generation) + "; the nodes of the older round rejoin");
    Frame frame = encode(make_restart("a newer round of the job exists (generation " +
                                                std::to_string(a.generation) + ")",
                                            false, job.restarts_used, job.max_restarts));
    for (auto& [c, node] : job.nodes) {
      if (node.state == NodeState::Running) {
        out_.send(c, frame);
        set_state(job, node, NodeState::Rejoining);
        node.group_rank = -1;
      }
    }
    job.generation = a.generation;
    job.round_size = static_cast<std::size_t>(a.group_world_size);
    job.last_round_size = job.round_size;
    job.round_members.clear();  // described again once restored
    job.restore_round = a;
    job.restore_conflict = false;
    job.restore_holders.clear();
  } else if (a.generation < job.generation) {
    // Its round already ended: it rejoins (the same as a node that missed a restart).
    out_.log("job " + job.id + ": " + who(r) + " resumed an older round than generation " +
             std::to_string(job.generation) + "; it rejoins");
    add_resumed(job, conn, r, NodeState::Rejoining);
    out_.send(conn, encode(make_restart("the round of generation " + std::to_string(a.generation) +
                                                  " ended while the rendezvous was away",
                                              false, job.restarts_used, job.max_restarts)));
    return;
  }
  if (auto ht = job.restore_holders.find(a.group_rank); ht != job.restore_holders.end()) {
    const ConnId c = ht->second;
    const Node& node = job.nodes.at(c);
    if (node.secret != r.secret) {
      out_.log("job " + job.id + ": refused the resume of " + who(r) + ": the rank already resumed with another secret");
      out_.drop(conn, "resume_refused", "group rank " + std::to_string(a.group_rank) + " of job " + job.id +
                                            " generation " + std::to_string(a.generation) +
                                            " was resumed by another node; a node can only resume its own rank");
      return;
    }
    rebind(job, c, conn);  // the same node again, on a newer connection
    return;
  }
  if (!same_round(a, job.restore_round)) {
    out_.log("job " + job.id + ": " + who(r) + " describes generation " + std::to_string(a.generation) +
             " differently from the first resume; the round will restart");
    job.restore_conflict = true;
  }
  add_resumed(job, conn, r, NodeState::Running);
  if (job.restore_holders.size() == job.round_size) conclude_restore(job);
}

// The server knows the job: it never went away, only this node's connection did.
void StateMachine::resume_live(Job& job, ConnId conn, const ResumeRequest& r) {
  const Assignment& a = r.assignment;
  for (auto& [c, node] : job.nodes) {
    if (node.secret != r.secret) continue;
    if (job.state == JobState::Running && job.generation == a.generation &&
        (node.state == NodeState::Running || node.state == NodeState::Succeeded) && node.group_rank == a.group_rank) {
      ConnId old = c;
      rebind(job, old, conn);
      out_.send(conn, encode(make_resumed_message(job.generation, job.restarts_used, false)));
      out_.log("job " + job.id + ": " + who(r) + " resumed on a new connection");
      return;
    }
    break;
  }
  if (job.state == JobState::Running && job.generation == a.generation) {
    for (auto& [c, node] : job.nodes) {
      if ((node.state == NodeState::Running || node.state == NodeState::Succeeded) &&
          node.group_rank == a.group_rank && node.secret != r.secret) {
        out_.log("job " + job.id + ": refused the resume of " + who(r) + ": wrong secret for that rank");
        out_.drop(conn, "resume_refused", "group rank " + std::to_string(a.group_rank) + " of job " + job.id +
                                              " is held by another node; a node can only resume its own rank");
        return;
      }
    }
  }
  // Its round is over (it was lost, or the job moved on): it stops its workers and joins again.
  out_.log("job " + job.id + ": " + who(r) + " resumed a round that has ended; it rejoins");
  out_.send(conn, encode(make_restart("the round of generation " + std::to_string(a.generation) +
                                                " ended while this node was away",
                                            false, job.restarts_used, job.max_restarts)));
}

void StateMachine::add_resumed(Job& job, ConnId conn, const ResumeRequest& r, NodeState state) {
  Node node;
  node.take_spec(NodeSpec(r.node), fingerprints_);
  node.state = state;
  node.group_rank = state == NodeState::Running ? r.assignment.group_rank : -1;
  node.last_seen = clock_.now();
  node.join_seq = next_join_seq_++;
  node.secret = r.secret;
  node.resumed_generation = r.assignment.generation;
  if (node.spec.requested_rank >= 0 && job.requested_ranks.count(node.spec.requested_rank) == 0) {
    job.requested_ranks[node.spec.requested_rank] = conn;
  }
  tally(job, job.nodes.emplace(conn, std::move(node)).first->second, true);
  conn_job_[conn] = job.id;
  if (state == NodeState::Running) job.restore_holders[r.assignment.group_rank] = conn;
}

void StateMachine::rebind(Job& job, ConnId old_conn, ConnId conn) {
  auto it = job.nodes.find(old_conn);
  Node node = std::move(it->second);
  job.nodes.erase(it);
  conn_job_.erase(old_conn);
  node.heard(clock_.now());
  int r = node.spec.requested_rank;
  if (r >= 0) {
    auto rt = job.requested_ranks.find(r);
    if (rt != job.requested_ranks.end() && rt->second == old_conn) rt->second = conn;
  }
  if (auto ht = job.restore_holders.find(node.group_rank); ht != job.restore_holders.end() && ht->second == old_conn) {
    ht->second = conn;
  }
  job.nodes.emplace(conn, std::move(node));
  conn_job_[conn] = job.id;
  out_.drop(old_conn, "replaced", "this node resumed on a newer connection");
}

// A failure held while restoring goes through report_failure like any other, from a node of the
// restored round (the reporting node when it is still there), so it is counted exactly once.
bool StateMachine::report_pending_failure(Job& job, const WorkerFailure& failure) {
  ConnId from = 0;
  bool found = false;
  for (auto& [c, node] : job.nodes) {
    if (node.state != NodeState::Running) continue;
    if (!found || node.spec.host == failure.host) {
      from = c;
      found = true;
    }
    if (node.spec.host == failure.host) break;
  }
  if (found) report_failure(from, failure);
  return found;
}

// Every node of the round resumed, or the grace period passed.
void StateMachine::conclude_restore(Job& job) {
  const std::size_t resumed = job.restore_holders.size();
  job.restore_holders.clear();
  const bool whole = resumed == job.round_size && !job.restore_conflict;
  job.state = JobState::Running;  // the round as it was, for end_round and the reports below
  job.round_succeeded = 0;
  job.min_reached_at.reset();
  job.restore_conflict = false;
  std::optional<WorkerFailure> failure = std::move(job.pending_failure);
  job.pending_failure.reset();
  if (!whole) {
    const std::string why = std::to_string(job.round_size - std::min(resumed, job.round_size)) + " of " +
                            std::to_string(job.round_size) + " nodes of generation " + std::to_string(job.generation) +
                            " did not resume within " + seconds_text(job.timeouts.heartbeat_timeout) +
                            " (or their rounds disagree)";
    out_.log("job " + job.id + ": restore ends the round: " + why);
    // The failure wins (the budget stays exact) while a node of the round is there to carry it.
    if (!failure || !report_pending_failure(job, *failure)) end_round(job, why, false);
    maybe_complete(job);
    return;
  }
  if (job.round_members.size() != job.round_size) {  // rebuilt from resumes: described now
    describe_round(job);
    job.round_master_addr = job.restore_round.master_addr;
    job.round_master_port = job.restore_round.master_port;
  }
  changed(job);
  Frame frame = encode(make_resumed_message(job.generation, job.restarts_used, true));
  std::vector<ConnId> succeeded;
  for (auto& [c, node] : job.nodes) {
    if (node.state != NodeState::Running) continue;
    out_.send(c, frame);
    if (node.success_pending) succeeded.push_back(c);
    node.success_pending = false;
  }
  out_.log("job " + job.id + ": restored: every one of " + std::to_string(job.round_size) +
           " nodes resumed generation " + std::to_string(job.generation) + ", restarts " +
           std::to_string(job.restarts_used) + "/" + std::to_string(job.max_restarts));
  if (failure) {
    report_pending_failure(job, *failure);
    return;
  }
  for (ConnId c : succeeded) report_success(c);
  if (job.state == JobState::Running && count(job, NodeState::Waiting) > 0 &&
      job.round_size < static_cast<std::size_t>(job.max_nodes)) {
    end_round(job, "a node joined while the job was restoring", false);
    maybe_complete(job);
  }
}

}  // namespace ddp::rdzv
