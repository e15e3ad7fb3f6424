// StateMachine's job records: what a replicated leader writes to etcd before its
// agents hear of a change, and how the next leader carries a job on from it. Same class, same
// thread rules as state.cpp; docs/etcd.md "Job records" has the rules.
#include <algorithm>
#include <limits>

#include "rendezvous/state.h"

namespace ddp::rdzv {

void StateMachine::changed(const Job& job) {
  if (recording_) changed_.insert(job.id);
}

std::vector<std::string> StateMachine::take_changed() {
  std::vector<std::string> ids(changed_.begin(), changed_.end());
  changed_.clear();
  return ids;
}

// The round that just formed (or was restored whole), as its record keeps it.
void StateMachine::describe_round(Job& job) {
  job.round_members.clear();
  job.round_world_size = 0;
  for (const auto& [conn, node] : job.nodes) {
    if (node.group_rank < 0 || (node.state != NodeState::Running && node.state != NodeState::Succeeded)) continue;
    RecordMember m;
    m.group_rank = node.group_rank;
    m.host = node.spec.host;
    m.addr = node.spec.addr;
    m.local_world_size = node.spec.local_world_size;
    m.requested_rank = node.spec.requested_rank;
    m.secret = node.secret;
    job.round_world_size += m.local_world_size;
    if (m.group_rank == 0) {
      job.round_master_addr = node.spec.addr;
      job.round_master_port = node.spec.master_port;
    }
    job.round_members.push_back(std::move(m));
  }
  std::sort(job.round_members.begin(), job.round_members.end(),
            [](const RecordMember& a, const RecordMember& b) { return a.group_rank < b.group_rank; });
}

std::optional<JobRecord> StateMachine::record(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  const Job& job = it->second;
  JobRecord r;
  r.job_id = job.id;
  r.min_nodes = job.min_nodes;
  r.max_nodes = job.max_nodes;
  r.max_restarts = job.max_restarts;
  r.timeouts = job.timeouts;
  r.straggler = job.straggler;
  r.generation = job.generation;
  r.restarts_used = job.restarts_used;
  r.failing = job.failing;
  for (const WorkerFailure& f : job.round_failures) {
    if (r.failures.size() == kMaxRecordFailures) break;
    r.failures.push_back(f);
  }
  r.fatal = job.fatal;
  r.summary = job.end_summary;
  r.goodput = job.goodput.totals(clock_.now()).to_array();
  switch (job.state) {
    case JobState::Gathering: r.state = JobRecord::State::gathering; break;
    case JobState::Succeeded: r.state = JobRecord::State::succeeded; break;
    case JobState::Failed: r.state = JobRecord::State::failed; break;
    case JobState::Running:
    case JobState::Restoring:
      r.state = JobRecord::State::running;
      // A round rebuilt from resumes that has no description yet (or an incomplete one) is
      // written as between rounds: its nodes are told to rejoin if the leader changes now.
      if (job.round_members.size() != job.round_size || job.round_members.empty()) {
        r.state = JobRecord::State::gathering;
        break;
      }
      r.group_world_size = static_cast<int>(job.round_size);
      r.world_size = job.round_world_size;
      r.master_addr = job.round_master_addr;
      r.master_port = job.round_master_port;
      r.members = job.round_members;
      break;
  }
  return r;
}

bool StateMachine::load(const JobRecord& r) {
  if (jobs_.count(r.job_id) != 0) {
    out_.log("job " + r.job_id + ": not loaded from etcd: already known here");
    return false;
  }
  const double now = clock_.now();
  Job& job = jobs_[r.job_id];
  job.id = r.job_id;
  job.min_nodes = r.min_nodes;
  job.max_nodes = r.max_nodes;
  job.max_restarts = r.max_restarts;
  job.timeouts = r.timeouts;
  job.straggler = r.straggler;
  job.generation = r.generation;
  job.restarts_used = r.restarts_used;
  job.failing = r.failing;
  job.round_failures = r.failures;
  job.fatal = r.fatal;
  job.end_summary = r.summary;
  job.loaded = true;
  job.hold_until = now + kLoadedHoldSeconds;
  job.gather_since = now;
  // The account as the record left it; a running round's resumes carry it on from the round's
  // start (adopt_goodput). The time between the record's write and this load is not known.
  job.goodput = new_account(now, job.timeouts);
  if (auto totals = GoodputTotals::from_array(r.goodput)) {
    job.goodput.restore(now, *totals, r.state == JobRecord::State::running, static_cast<std::size_t>(r.group_world_size),
                        static_cast<std::size_t>(r.max_nodes));
    if (r.state == JobRecord::State::succeeded || r.state == JobRecord::State::failed) job.goodput.ended(now);
  }
  switch (r.state) {
    case JobRecord::State::gathering: job.state = JobState::Gathering; break;
    case JobRecord::State::succeeded: job.state = JobState::Succeeded; job.ended_at = now; break;
    case JobRecord::State::failed: job.state = JobState::Failed; job.ended_at = now; break;
    case JobRecord::State::running: {
      // Restored from the resumes like a rebuilt job (state_resume.cpp), but the round, the
      // restart count and every rank's secret are known: the grace period starts at the first
      // resume, and a resume with another secret than its rank's is refused.
      job.state = JobState::Restoring;
      job.round_size = static_cast<std::size_t>(r.group_world_size);
      job.last_round_size = job.round_size;
      job.round_members = r.members;
      job.round_world_size = r.world_size;
      job.round_master_addr = r.master_addr;
      job.round_master_port = r.master_port;
      job.restore_round.generation = r.generation;
      job.restore_round.group_world_size = r.group_world_size;
      job.restore_round.world_size = r.world_size;
      job.restore_round.master_addr = r.master_addr;
      job.restore_round.master_port = r.master_port;
      job.restore_round.restart_count = r.restarts_used;
      job.restore_round.max_restarts = r.max_restarts;
      job.rebuilt_at = now;
      job.restore_deadline = std::numeric_limits<double>::infinity();
      break;
    }
  }
  out_.log("job " + job.id + ": loaded from etcd (" + to_string(r.state) + (r.failing ? ", failing" : "") +
           ", generation " + std::to_string(job.generation) + ", restarts " + std::to_string(job.restarts_used) + "/" +
           std::to_string(job.max_restarts) + "); waiting up to " + seconds_text(kLoadedHoldSeconds) +
           " for its nodes");
  return true;
}

}  // namespace ddp::rdzv
