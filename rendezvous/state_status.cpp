// What the state machine shows and how it compares nodes' environments: the status of jobs
// (status(), gauges(), what is kept of a job when it ends, with its goodput account, and its
// events), what nodes' heartbeats tell it (touch(), progress()), and the environment check as a
// RoundCheck. Pure, like state.cpp.
#include "rendezvous/state.h"

#include <algorithm>
#include <set>
#include <unordered_map>

#include "rendezvous/env_check.h"

namespace ddp::rdzv {

namespace {

// The members' fingerprints as the environment check names them: by host name, or by address
// when there is none. Several agents on one host (tests, a fat node split in two) are told apart
// by their address: "box (10.0.0.2)". Members without a fingerprint are left out.
// Only the top-level sections ("python", "program", "env", ...) that differ on some node are
// copied: a section equal everywhere cannot show a difference, and copying 100 fingerprints with
// their hashed libraries would cost more than the comparison (bench/results-envcheck.md).
std::vector<NodeFingerprint> env_nodes(const std::vector<CheckedNode>& members) {
  std::unordered_map<std::string, int> uses;
  const nlohmann::json* first = nullptr;
  std::set<std::string> differing;
  for (const CheckedNode& member : members) {
    const NodeSpec* spec = member.spec;
    const nlohmann::json& fp = *member.fingerprint;
    if (fp.empty()) continue;
    ++uses[spec->host.empty() ? spec->addr : spec->host];
    if (first == nullptr) {
      first = &fp;
      continue;
    }
    if (&fp == first) continue;  // the same shared copy: nothing differs
    for (auto it = fp.begin(); it != fp.end(); ++it) {
      if (differing.count(it.key())) continue;
      auto there = first->find(it.key());
      if (there == first->end() || *there != it.value()) differing.insert(it.key());
    }
    for (auto it = first->begin(); it != first->end(); ++it) {
      if (!fp.contains(it.key())) differing.insert(it.key());
    }
  }
  std::vector<NodeFingerprint> prints;
  prints.reserve(members.size());
  for (const CheckedNode& member : members) {
    const NodeSpec* spec = member.spec;
    const nlohmann::json& fp = *member.fingerprint;
    if (fp.empty()) continue;
    nlohmann::json part = nlohmann::json::object();
    for (const std::string& key : differing) {
      auto it = fp.find(key);
      if (it != fp.end()) part[key] = *it;
    }
    std::string name = spec->host.empty() ? spec->addr : spec->host;
    if (uses[name] > 1 && !spec->host.empty() && !spec->addr.empty()) {
      prints.push_back({name + " (" + spec->addr + ")", "", std::move(part)});
    } else {
      prints.push_back({name, spec->host.empty() ? "" : spec->addr, std::move(part)});
    }
  }
  return prints;
}

}  // namespace

RoundCheck make_env_round_check(std::function<void(const std::string&)> log) {
  return [log = std::move(log)](const std::string& job_id,
                                const std::vector<CheckedNode>& members) -> std::optional<std::string> {
    // The strictest mode any member asked for: the outcome does not depend on who came first,
    // and one node's --env_check=warn cannot switch the check off for nodes that want strict.
    // (A node with --env_check=off sends no fingerprint and is not compared.)
    EnvCheckMode mode = EnvCheckMode::off;
    for (const CheckedNode& member : members) {
      EnvCheckMode m = parse_env_check_mode(member.spec->env_check).value_or(EnvCheckMode::strict);
      if (m == EnvCheckMode::strict || (m == EnvCheckMode::warn && mode == EnvCheckMode::off)) mode = m;
    }
    if (mode == EnvCheckMode::off) return std::nullopt;
    // The common case, a job that runs: every fingerprint equals the first. Decided by deep
    // comparison without copying anything (copying 100 fingerprints costs more than comparing);
    // nodes that share one copy are equal without it.
    const nlohmann::json* first = nullptr;
    bool all_same = true;
    for (const CheckedNode& member : members) {
      const nlohmann::json* fp = member.fingerprint;
      if (fp->empty()) continue;
      if (first == nullptr) {
        first = fp;
      } else if (fp != first && *fp != *first) {
        all_same = false;
        break;
      }
    }
    if (all_same) return std::nullopt;
    std::vector<NodeFingerprint> prints = env_nodes(members);
    if (prints.size() < 2) return std::nullopt;
    EnvCheckResult result = compare_fingerprints(prints);
    switch (env_check_verdict(mode, result)) {
      case EnvVerdict::refuse:
        return "job " + job_id + ": " + refusal_message(result);
      case EnvVerdict::warn:
        if (log) {  // one log line per difference, each with the job and the mode
          for (const EnvDifference& d : result.differences) {
            log("job " + job_id + ": environment differs (--env_check=" + to_string(mode) + "): " + d.message);
          }
        }
        return std::nullopt;
      default:
        return std::nullopt;
    }
  };
}

void StateMachine::touch(ConnId conn) {
  Job* job = job_of(conn);
  if (!job) return;
  auto it = job->nodes.find(conn);
  if (it != job->nodes.end()) it->second.heard(clock_.now());
}

void StateMachine::progress(ConnId conn, const NodeProgress& progress) {
  Job* job = job_of(conn);
  if (!job) return;
  auto it = job->nodes.find(conn);
  if (it == job->nodes.end()) return;
  Node& node = it->second;
  node.progress = progress;
  if (progress.busy_local_rank >= node.spec.local_world_size) node.progress->busy_local_rank = -1;
  // The goodput account takes the steps of the round that runs, not a report of the last one.
  if (job->state == JobState::Running && node.state == NodeState::Running && progress.step >= 0 &&
      (node.fresh_step || progress.step != node.stale_step)) {
    node.fresh_step = true;
    job->goodput.step(clock_.now(), progress.step, progress.checkpoint_stall,
                      progress.first_step >= 0 && progress.first_step <= progress.step ? progress.first_step : -1);
  }
  judge_stragglers(*job, clock_.now());
}

nlohmann::json StateMachine::job_status(const Job& job, double now) const {
  const std::string& id = job.id;
  {
    nlohmann::json nodes = nlohmann::json::array();
    double checkpoint_interval = 0;  // the job's: the longest any node's workers chose
    nlohmann::json stragglers = nlohmann::json::array();  // a line for each named straggler
    const std::vector<int> first = first_ranks(job);
    for (const auto& [conn, node] : job.nodes) {
      // A finished node keeps the rank of its last round (finished jobs stay listed).
      nodes.push_back({{"group_rank", node.state == NodeState::Running || node.state == NodeState::Succeeded ||
                                              node.state == NodeState::Finished
                                          ? node.group_rank
                                          : -1},
                       {"host", node.spec.host},
                       {"addr", node.spec.addr},
                       {"workers", node.spec.local_world_size},
                       {"state", state_name(node.state)},
                       {"spare", is_spare(job, node)},
                       {"last_heartbeat_age", now - node.last_seen}});
      if (node.progress) {
        nlohmann::json& row = nodes.back();
        if (node.progress->step >= 0) row["last_step"] = node.progress->step;
        if (node.progress->checkpoint_step >= 0) row["last_checkpoint"] = node.progress->checkpoint_step;
        if (node.progress->checkpoint_interval > 0) row["checkpoint_interval"] = node.progress->checkpoint_interval;
        checkpoint_interval = std::max(checkpoint_interval, node.progress->checkpoint_interval);
        if (node.progress->busy_local_rank >= 0 && node.state == NodeState::Running) {
          row["busy"] = node.progress->busy;
          row["busy_rank"] = first_rank_of(first, node) + node.progress->busy_local_rank;
        }
      }
      if (shows_straggler(job, node)) {
        nodes.back()["straggler"] = true;
        stragglers.push_back(straggler_line(node, first_rank_of(first, node), now));
      }
      if (job.nodes.size() <= kStatusFingerprintNodes && !node.fingerprint_json().empty()) {
        nodes.back()["fingerprint"] = node.fingerprint_json();
      }
    }
    std::sort(nodes.begin(), nodes.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
      int ra = a["group_rank"], rb = b["group_rank"];
      if ((ra < 0) != (rb < 0)) return ra >= 0;
      return ra < rb;
    });
    // Whether the nodes' software agrees. Fingerprints themselves are listed for small
    // jobs only, so the status reply stays far below the frame limit for 10,000 nodes.
    std::vector<const Node*> members;  // in order of arrival, as in the round check
    members.reserve(job.nodes.size());
    for (const auto& [conn, node] : job.nodes) members.push_back(&node);
    std::sort(members.begin(), members.end(), [](const Node* a, const Node* b) { return a->join_seq < b->join_seq; });
    std::vector<CheckedNode> specs;
    specs.reserve(members.size());
    for (const Node* node : members) specs.push_back(node->checked());
    std::vector<NodeFingerprint> prints = env_nodes(specs);
    nlohmann::json env = {{"checked_nodes", prints.size()}, {"agree", true}};
    if (prints.size() > 1) {
      EnvCheckResult cmp = compare_fingerprints(prints);
      env["agree"] = cmp.empty();
      if (!cmp.empty()) {
        env["breaking"] = cmp.has_breaking();
        env["message"] = cmp.message();
      }
    }
    return {{"job_id", id},
                    {"env", std::move(env)},
                    {"checkpoint_interval", checkpoint_interval > 0 ? nlohmann::json(checkpoint_interval) : nlohmann::json()},
                    {"state", state_name(job.state)},
                    {"generation", job.generation},
                    {"min_nodes", job.min_nodes},
                    {"max_nodes", job.max_nodes},
                    {"restarts_used", job.restarts_used},
                    {"goodput", job.goodput.totals(now).to_json()},
                    {"max_restarts", job.max_restarts},
                    {"straggler_policy", job.straggler},
                    {"stragglers", std::move(stragglers)},
                    {"rebuilt_from_resumes", job.rebuilt_at.has_value()},
                    {"rebuilt_seconds_ago", job.rebuilt_at ? nlohmann::json(now - *job.rebuilt_at) : nlohmann::json()},
                    {"nodes", std::move(nodes)}};
  }
}

void StateMachine::emit(const Job& job, const char* type, const std::string& cause, const std::string& node,
                        std::vector<int> ranks, nlohmann::json fields, const std::string& message) {
  metrics::Event e;
  e.type = type;
  e.job = job.id;
  e.node = node;
  e.generation = job.generation;
  e.ranks = std::move(ranks);
  e.cause = cause;
  e.message = message;
  e.fields = std::move(fields);
  out_.event(e);
}

void StateMachine::job_ended(Job& job, const std::string& summary) {
  job.ended_at = clock_.now();
  job.goodput.ended(job.ended_at);
  job.end_summary = summary;
  // What is kept of its nodes once they are gone: the first kKeptNodeRows by group rank, without
  // fingerprints, so that 256 kept jobs of 10,000 nodes stay a few MB (docs/rendezvous.md).
  nlohmann::json status = job_status(job, job.ended_at);
  nlohmann::json& rows = status["nodes"];
  job.end_env = std::move(status["env"]);  // the verdict on the nodes it ended with
  job.end_nodes = nlohmann::json::array();
  for (auto& n : rows) {
    if (job.end_nodes.size() == kKeptNodeRows) break;
    n.erase("fingerprint");
    n["last_heartbeat_age"] = nullptr;  // no heartbeats after the end
    job.end_nodes.push_back(std::move(n));
  }
  job.end_nodes_omitted = rows.size() - job.end_nodes.size();
  const GoodputTotals goodput = job.goodput.totals(job.ended_at);
  out_.log(goodput_line(job));
  emit(job, "job_end", job.state == JobState::Succeeded ? "succeeded" : "failed", "", {},
       {{"restarts_used", job.restarts_used}, {"max_restarts", job.max_restarts}, {"goodput", goodput.to_json()}},
       summary);
}

namespace {

// Picks the node that speaks for a job from the nodes offered to it: the node of the root-cause
// failure's group rank, else the lowest group rank (then the lowest connection).
class SpeakerChoice {
 public:
  explicit SpeakerChoice(int root_rank) : root_rank_(root_rank) {}
  // False once the root-cause failure's node is offered: nothing can beat it.
  bool offer(ConnId conn, int group_rank) {
    if (root_rank_ >= 0 && group_rank == root_rank_) {
      best_ = conn;
      return false;
    }
    const bool better = best_ == 0 || (group_rank >= 0 && (best_rank_ < 0 || group_rank < best_rank_)) ||
                        (group_rank == best_rank_ && conn < best_);
    if (better) {
      best_ = conn;
      best_rank_ = group_rank;
    }
    return true;
  }
  ConnId chosen() const { return best_; }

 private:
  int root_rank_;
  ConnId best_ = 0;
  int best_rank_ = -1;
};

}  // namespace

ConnId StateMachine::speaker_of(const Job& job, const std::vector<ConnId>& among, const WorkerFailure* root) {
  SpeakerChoice choice(root != nullptr ? group_rank_of(job, root->rank) : -1);
  for (ConnId conn : among) {
    auto it = job.nodes.find(conn);
    if (it != job.nodes.end() && !choice.offer(conn, it->second.group_rank)) break;
  }
  return choice.chosen();
}

ConnId StateMachine::speaker_of(const Job& job, const WorkerFailure* root) {
  SpeakerChoice choice(root != nullptr ? group_rank_of(job, root->rank) : -1);
  for (const auto& [conn, node] : job.nodes) {
    if (!choice.offer(conn, node.group_rank)) break;
  }
  return choice.chosen();
}

nlohmann::json StateMachine::status() const {
  const double now = clock_.now();
  nlohmann::json jobs = nlohmann::json::array();
  for (const auto& [id, job] : jobs_) {
    jobs.push_back(job_status(job, now));
    if (job.state == JobState::Succeeded || job.state == JobState::Failed) {
      jobs.back()["finished"] = true;
      jobs.back()["ended_seconds_ago"] = now - job.ended_at;
      if (!job.end_summary.empty()) jobs.back()["summary"] = job.end_summary;
    }
  }
  for (auto it = finished_.rbegin(); it != finished_.rend(); ++it) {  // newest first
    if (it->forgotten_at <= now) continue;
    nlohmann::json j = it->status;
    j["finished"] = true;
    j["ended_seconds_ago"] = now - it->ended_at;
    jobs.push_back(std::move(j));
  }
  return {{"jobs", std::move(jobs)}};
}

Gauges StateMachine::gauges() const {
  const double now = clock_.now();
  Gauges g;
  for (JobState s : {JobState::Gathering, JobState::Running, JobState::Succeeded, JobState::Failed, JobState::Restoring}) {
    g.jobs_by_state[state_name(s)] = 0;
  }
  for (int s = 0; s < static_cast<int>(NodeState::kCount); ++s) g.nodes_by_state[state_name(static_cast<NodeState>(s))] = 0;
  for (const auto& [id, job] : jobs_) {
    ++g.jobs_by_state[state_name(job.state)];
    for (int s = 0; s < static_cast<int>(NodeState::kCount); ++s) {
      g.nodes_by_state[state_name(static_cast<NodeState>(s))] += job.counts[s];
    }
    double oldest = 0;
    std::size_t spares = 0, stragglers = 0;
    for (const auto& [conn, node] : job.nodes) {
      oldest = std::max(oldest, now - node.last_seen);
      spares += is_spare(job, node);
      stragglers += shows_straggler(job, node);
    }
    g.oldest_heartbeat_age[id] = oldest;
    g.spares[id] = spares;
    g.stragglers[id] = stragglers;
    g.goodput[id] = job.goodput.totals(now);
  }
  for (const auto& f : finished_) {
    if (f.forgotten_at > now) ++g.finished_jobs_kept;
  }
  return g;
}

}  // namespace ddp::rdzv
