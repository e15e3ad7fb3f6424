#include "rendezvous/state.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace ddp::rdzv {

namespace {

// `group_rank`: of the node that reported it (-1: not known), which tells apart the nodes of
// one host.
std::string failure_text(const WorkerFailure& f, int group_rank = -1) {
  std::ostringstream os;
  os << "worker rank " << f.rank << " (local rank " << f.local_rank;
  if (f.pid > 0) os << ", pid " << f.pid;
  os << ") on host " << (f.host.empty() ? "?" : f.host);
  if (group_rank >= 0) os << " [group rank " << group_rank << "]";
  if (f.signal != 0) {
    os << " was killed by signal " << f.signal;
  } else {
    os << " exited with code " << f.exit_code;
  }
  if (!f.error_file_message.empty()) os << ": " << f.error_file_message;
  return os.str();
}

std::optional<std::string> validate(const NodeSpec& s) {
  if (s.job_id.empty()) return "join carries no job_id (--rdzv_id)";
  if (auto err = validate_node_spec(s)) return err;  // sizes, ranges, fingerprint shape
  if (s.local_world_size < 1) return "local_world_size must be >= 1 (--nproc_per_node), got " + std::to_string(s.local_world_size);
  if (s.min_nodes < 1 || s.max_nodes < s.min_nodes) {
    return "invalid --nnodes " + std::to_string(s.min_nodes) + ":" + std::to_string(s.max_nodes) +
           ": need 1 <= MIN <= MAX";
  }
  if (s.requested_rank < -1 || s.requested_rank >= s.max_nodes) {
    // Bounded by MAX, as the launcher bounds it (a usage error there, never a rendezvous failure
    // here). A rank a smaller round cannot honour (MIN <= rank, fewer nodes) takes the lowest free
    // rank of that round (complete_round), as torchrun's elastic rendezvous does.
    return "--node_rank " + std::to_string(s.requested_rank) + " is out of range: with --nnodes " +
           std::to_string(s.min_nodes) + ":" + std::to_string(s.max_nodes) + " it must be in 0.." +
           std::to_string(s.max_nodes - 1);
  }
  if (s.max_restarts < 0) return "--max_restarts must be >= 0";
  const Timeouts& t = s.timeouts;
  if (!(t.join_timeout > 0) || !(t.last_call_timeout >= 0) || !(t.heartbeat_interval > 0) ||
      !(t.heartbeat_timeout > 0) || !std::isfinite(t.join_timeout) || !std::isfinite(t.heartbeat_timeout)) {
    return "invalid rdzv timeouts: join_timeout, heartbeat_interval and heartbeat_timeout must be > 0, "
           "last_call_timeout >= 0";
  }
  return std::nullopt;
}

}  // namespace

StateMachine::StateMachine(const Clock& clock, Outbox& out, RoundCheck round_check, SecretSource secrets)
    : clock_(clock), out_(out), round_check_(std::move(round_check)), secrets_(std::move(secrets)) {}

int StateMachine::group_rank_of(const Job& job, int rank) {
  std::vector<const Node*> ordered;
  for (const auto& [conn, node] : job.nodes) {
    if (node.group_rank >= 0) ordered.push_back(&node);
  }
  std::sort(ordered.begin(), ordered.end(), [](const Node* a, const Node* b) { return a->group_rank < b->group_rank; });
  int first = 0;
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    if (ordered[i]->group_rank != static_cast<int>(i)) return -1;  // a node of the round is gone
    if (rank >= first && rank < first + ordered[i]->spec.local_world_size) return ordered[i]->group_rank;
    first += ordered[i]->spec.local_world_size;
  }
  return -1;
}

StateMachine::Job* StateMachine::job_of(ConnId conn) {
  auto it = conn_job_.find(conn);
  if (it == conn_job_.end()) return nullptr;
  auto jt = jobs_.find(it->second);
  return jt == jobs_.end() ? nullptr : &jt->second;
}

void StateMachine::remove_node(Job& job, ConnId conn) {
  auto it = job.nodes.find(conn);
  if (it == job.nodes.end()) return;
  tally(job, it->second, false);
  if (!job.restore_holders.empty()) {  // a node that resumed and then went away
    auto ht = job.restore_holders.find(it->second.group_rank);
    if (ht != job.restore_holders.end() && ht->second == conn) job.restore_holders.erase(ht);
  }
  int r = it->second.spec.requested_rank;
  if (r >= 0) {
    auto rt = job.requested_ranks.find(r);
    if (rt != job.requested_ranks.end() && rt->second == conn) job.requested_ranks.erase(rt);
  }
  job.nodes.erase(it);
  conn_job_.erase(conn);
}

void StateMachine::erase_if_empty(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it != jobs_.end() && it->second.nodes.empty()) {
    const Job& job = it->second;
    const double now = clock_.now();
    if (now < job.hold_until) return;  // loaded from etcd: its nodes may still come back
    changed(job);                      // its record is deleted
    if ((job.state == JobState::Succeeded || job.state == JobState::Failed) && retention_.keep_finished > 0 &&
        retention_.max_finished > 0) {
      // It stays in status() for keep_finished seconds, marked finished.
      FinishedJob done;
      done.ended_at = job.ended_at;
      done.forgotten_at = now + retention_.keep_finished;
      done.status = job_status(job, now);
      done.status["nodes"] = job.end_nodes.is_array() ? job.end_nodes : nlohmann::json::array();
      if (job.end_nodes_omitted > 0) done.status["nodes_omitted"] = job.end_nodes_omitted;
      if (job.end_env.is_object()) done.status["env"] = job.end_env;
      if (!job.end_summary.empty()) done.status["summary"] = job.end_summary;
      finished_.push_back(std::move(done));
      while (finished_.size() > retention_.max_finished) finished_.pop_front();
    }
    out_.log("job " + job_id + ": no nodes left, forgotten");
    jobs_.erase(it);
  }
}

void StateMachine::prune_finished(double now) {
  while (!finished_.empty() && finished_.front().forgotten_at <= now) finished_.pop_front();
}

// The job's policy is set by its first node; every other node must ask for the same, instead of
// the first joiner silently winning. heartbeat_interval and shutdown_timeout are each agent's own.
std::optional<std::string> StateMachine::policy_mismatch(const Job& job, const NodeSpec& spec) const {
  auto differs = [&](const char* what, const std::string& mine, const std::string& theirs) {
    return what + std::string(" ") + mine + " differs from job " + job.id + "'s " + theirs +
           " (set by its first node): start every node with the same " + what;
  };
  if (spec.max_restarts != job.max_restarts) {
    return differs("--max_restarts", std::to_string(spec.max_restarts), std::to_string(job.max_restarts));
  }
  const std::pair<const char*, double Timeouts::*> timeouts[] = {
      {"join_timeout", &Timeouts::join_timeout},
      {"last_call_timeout", &Timeouts::last_call_timeout},
      {"heartbeat_timeout", &Timeouts::heartbeat_timeout},
      {"probe_timeout", &Timeouts::probe_timeout}};
  for (const auto& [name, field] : timeouts) {
    if (spec.timeouts.*field != job.timeouts.*field) {
      return differs((std::string("--rdzv_conf ") + name).c_str(), seconds_text(spec.timeouts.*field),
                     seconds_text(job.timeouts.*field));
    }
  }
  if (spec.straggler.mode != job.straggler.mode) return differs("--straggler", spec.straggler.mode, job.straggler.mode);
  if (spec.straggler.factor != job.straggler.factor) {
    return differs("--straggler_factor", nlohmann::json(spec.straggler.factor).dump(),
                   nlohmann::json(job.straggler.factor).dump());
  }
  if (spec.straggler.window != job.straggler.window) {
    return differs("--straggler_window", seconds_text(spec.straggler.window), seconds_text(job.straggler.window));
  }
  return std::nullopt;
}

void StateMachine::join(ConnId conn, NodeSpec spec) {
  const double now = clock_.now();
  if (auto err = validate(spec)) {
    if (Job* old = job_of(conn)) {
      std::string id = old->id;
      node_gone(*old, conn, "sent an invalid join", true);
      erase_if_empty(id);
    }
    out_.drop(conn, "bad_join", *err);
    return;
  }
  auto existing = conn_job_.find(conn);
  if (existing != conn_job_.end() && existing->second != spec.job_id) {
    out_.drop(conn, "bad_join", "a connection serves one job; it joined " + existing->second + " before, now " +
                                    spec.job_id);
    return;
  }
  Job& job = job_for(spec, now);
  if (auto refusal = join_refusal(job, conn, spec)) {
    if (job.nodes.count(conn) != 0) node_gone(job, conn, "was refused", true);
    out_.log("job " + job.id + ": refused " + (spec.host.empty() ? spec.addr : spec.host) + ": " + refusal->second);
    out_.drop(conn, refusal->first, refusal->second);
    erase_if_empty(spec.job_id);
    return;
  }
  Node& node = enter(job, conn, std::move(spec), now);
  const bool was_running = node.state == NodeState::Running || node.state == NodeState::Succeeded;
  if (node.state != NodeState::Waiting) set_state(job, node, NodeState::Waiting);
  job.waiting_changed = true;
  out_.log("job " + job.id + ": join " + describe(node) + ", " + std::to_string(node.spec.local_world_size) +
           " workers (" + std::to_string(count(job, NodeState::Waiting)) + " waiting, nnodes " +
           std::to_string(job.min_nodes) + ":" + std::to_string(job.max_nodes) + ")");

  if (job.state == JobState::Running) {
    if (was_running) {
      end_round(job, "node " + describe(node) + " rejoined", false, "node_lost");
    } else if (job.round_size < static_cast<std::size_t>(job.max_nodes) && !node.spec.spare) {
      admit_newcomers(job, "node " + describe(node) + " joined");
    } else {
      // A spare: it waits for the next round and takes the place of a node that fails, is lost
      // or is drained (docs/maintenance.md). It never ends the round by arriving.
      out_.log("job " + job.id + ": " + describe(node) + " is a spare: " +
               (node.spec.spare ? "--spare" : "the round runs at MAX nodes"));
      emit(job, "node_spare", node.spec.spare ? "spare" : "max_nodes", describe(node), {}, {{"spares", count(job, NodeState::Waiting)}});
    }
  }
  const std::string id = job.id;
  maybe_complete(job);
  erase_if_empty(id);  // a refused round may have emptied the job
}

StateMachine::Job& StateMachine::job_for(const NodeSpec& spec, double now) {
  auto [jit, created] = jobs_.try_emplace(spec.job_id);
  Job& job = jit->second;
  if (!created) return job;
  // A new job under the id of a finished one replaces it in status().
  finished_.erase(std::remove_if(finished_.begin(), finished_.end(),
                                 [&](const FinishedJob& f) { return f.status.value("job_id", "") == spec.job_id; }),
                  finished_.end());
  job.id = spec.job_id;
  job.min_nodes = spec.min_nodes;
  job.max_nodes = spec.max_nodes;
  job.max_restarts = spec.max_restarts;
  job.timeouts = spec.timeouts;
  job.straggler = spec.straggler;
  job.gather_since = now;
  job.goodput = new_account(now, spec.timeouts);
  out_.log("job " + job.id + ": created (nnodes " + std::to_string(job.min_nodes) + ":" +
           std::to_string(job.max_nodes) + ", max_restarts " + std::to_string(job.max_restarts) + ")");
  return job;
}

std::optional<std::pair<std::string, std::string>> StateMachine::join_refusal(const Job& job, ConnId conn,
                                                                              const NodeSpec& spec) const {
  if (spec.min_nodes != job.min_nodes || spec.max_nodes != job.max_nodes) {
    return std::make_pair(std::string("nnodes_mismatch"),
                          "--nnodes " + std::to_string(spec.min_nodes) + ":" + std::to_string(spec.max_nodes) +
                              " differs from job " + job.id + "'s " + std::to_string(job.min_nodes) + ":" +
                              std::to_string(job.max_nodes) + ": pass the same --nnodes on every node");
  }
  if (auto mismatch = policy_mismatch(job, spec)) return std::make_pair(std::string("policy_mismatch"), *mismatch);
  if (job.state == JobState::Succeeded || job.state == JobState::Failed) {
    return std::make_pair(std::string("job_closed"), "job " + job.id + " already " + state_name(job.state) +
                                                         "; start a new job with another --rdzv_id");
  }
  if (spec.requested_rank >= 0) {
    auto rt = job.requested_ranks.find(spec.requested_rank);
    if (rt != job.requested_ranks.end() && rt->second != conn) {
      const Node& holder = job.nodes.at(rt->second);
      return std::make_pair(std::string("rank_conflict"),
                            "--node_rank " + std::to_string(spec.requested_rank) + " is already taken in job " +
                                job.id + " by " + describe(holder) + ": give every node a distinct --node_rank");
    }
  }
  // A node arriving at a job that has already run is checked against the nodes it would join,
  // alone: a mismatched replacement is refused without disturbing the running nodes.
  if (round_check_ && job.generation > 0 && job.nodes.count(conn) == 0 && !job.nodes.empty()) {
    std::vector<const Node*> running;  // in order of arrival: messages do not depend on hashing
    running.reserve(job.nodes.size());
    for (const auto& [c, node] : job.nodes) running.push_back(&node);
    std::sort(running.begin(), running.end(), [](const Node* a, const Node* b) { return a->join_seq < b->join_seq; });
    std::vector<CheckedNode> specs;  // the newcomer first: a tie names it first
    specs.reserve(running.size() + 1);
    specs.push_back({&spec, &spec.fingerprint});
    for (const Node* node : running) specs.push_back(node->checked());
    if (auto refusal = round_check_(job.id, specs)) return std::make_pair(std::string("round_refused"), *refusal);
  }
  return std::nullopt;
}

StateMachine::Node& StateMachine::enter(Job& job, ConnId conn, NodeSpec spec, double now) {
  auto nit = job.nodes.find(conn);
  if (nit == job.nodes.end()) {
    nit = job.nodes.emplace(conn, Node{}).first;
    nit->second.secret = secrets_ ? secrets_() : random_secret();
    tally(job, nit->second, true);
    conn_job_.emplace(conn, job.id);
  } else if (nit->second.spec.requested_rank >= 0 && nit->second.spec.requested_rank != spec.requested_rank) {
    job.requested_ranks.erase(nit->second.spec.requested_rank);
  }
  Node& node = nit->second;
  tally(job, node, false);  // counted again with its new spec: it may come back as a spare, or not
  node.take_spec(std::move(spec), fingerprints_);
  tally(job, node, true);
  node.heard(now);
  node.join_seq = next_join_seq_++;
  if (node.spec.requested_rank >= 0) job.requested_ranks[node.spec.requested_rank] = conn;
  return node;
}

// A node joining a running round below MAX restarts it so the node can take part. A node that
// keeps joining and leaving would restart the job over and over: after the second such restart
// within kChurnWindow, each one waits twice as long as the one before (1 s, 2 s, ... up to
// kChurnMaxDelay); meanwhile the newcomer waits and tick() admits it when the delay has passed.
void StateMachine::admit_newcomers(Job& job, const std::string& reason) {
  const double now = clock_.now();
  if (now < job.admit_at) {
    if (!job.admit_pending) {
      out_.log("job " + job.id + ": " + reason + "; it enters the round in " + seconds_text(job.admit_at - now) +
               " (restarts caused by joining nodes back off: " + std::to_string(job.join_restarts) + " within " +
               seconds_text(kChurnWindow) + ")");
    }
    job.admit_pending = true;
    return;
  }
  if (now - job.last_join_restart > kChurnWindow) job.join_restarts = 0;
  ++job.join_restarts;
  job.last_join_restart = now;
  job.admit_at = job.join_restarts < 2 ? now : now + std::min(kChurnMaxDelay, std::ldexp(1.0, job.join_restarts - 2));
  job.admit_pending = false;
  end_round(job, reason, false, "node_joined");
}

void StateMachine::end_round(Job& job, const std::string& reason, bool counted, const std::string& cause) {
  if (counted) ++job.restarts_used;
  changed(job);
  job.goodput.round_ended(clock_.now());
  const std::string why = !cause.empty() ? cause : counted ? "worker_failure" : "membership";
  if (!job.restart_since && (why == "worker_failure" || why == "node_lost" || why == "node_left" ||
                             why == "drain" || why == "straggler")) {
    job.restart_since = clock_.now();  // failure-to-restart time runs from here to the next round
  }
  emit(job, "restart", why, "", {}, {{"counted", counted}, {"restarts_used", job.restarts_used}}, reason);
  const bool failure = why == "worker_failure" || why == "node_lost" || why == "job_failing";
  std::vector<ConnId> told;
  for (auto& [conn, node] : job.nodes) {
    if (node.state == NodeState::Running || node.state == NodeState::Succeeded) {
      told.push_back(conn);
      set_state(job, node, NodeState::Rejoining);
    }
  }
  // One node says the reason in full: the failed one when it is told, else the lowest group rank.
  Message restart = make_restart(reason, counted, job.restarts_used, job.max_restarts, why == "job_failing", failure);
  const WorkerFailure* root = job.fatal ? &*job.fatal : !job.round_failures.empty() ? &job.round_failures.back() : nullptr;
  const ConnId speaker = speaker_of(job, told, root);
  if (speaker != 0) out_.send(speaker, encode(restart));
  std::get<Restart>(restart.body).quiet = true;
  told.erase(std::remove(told.begin(), told.end(), speaker), told.end());
  out_.broadcast(told, encode(restart));
  job.state = JobState::Gathering;
  job.gather_since = clock_.now();
  job.min_reached_at.reset();
  job.round_size = 0;
  job.round_succeeded = 0;
  out_.log("job " + job.id + ": restart after generation " + std::to_string(job.generation) + " (" +
           (counted ? "counted, " + std::to_string(job.restarts_used) + "/" + std::to_string(job.max_restarts)
                    : std::string("not counted")) +
           "): " + reason);
}

void StateMachine::maybe_complete(Job& job) {
  if (job.state != JobState::Gathering) return;
  if (job.failing) {
    // No new round for a failing job: its verdict waits until the failing round has stopped.
    if (count(job, NodeState::Rejoining) == 0) finish_failing(job);
    return;
  }
  const std::size_t waiting = eligible(job);
  const auto min = static_cast<std::size_t>(job.min_nodes);
  const auto max = static_cast<std::size_t>(job.max_nodes);
  // Nodes still stopping their workers come back: until then the job recovers, and it waits for
  // nodes only when even they would not make MIN (or it never ran).
  job.goodput.between_rounds(clock_.now(), job.generation == 0 || waiting + count(job, NodeState::Rejoining) < min);
  if (waiting >= max) {
    complete_round(job);
    return;
  }
  if (waiting < min) {
    job.min_reached_at.reset();
    return;
  }
  const double now = clock_.now();
  if (!job.min_reached_at) job.min_reached_at = now;
  // After the first round nobody else is expected once every connected node has rejoined.
  const bool everyone_back = job.generation > 0 && count(job, NodeState::Rejoining) == 0;
  if (everyone_back || now - *job.min_reached_at >= job.timeouts.last_call_timeout) complete_round(job);
}

// Tells every waiting node of a gathering job how many nodes wait and how long is left.
void StateMachine::tell_waiting(Job& job) {
  job.waiting_changed = false;
  if (job.state != JobState::Gathering || job.failing || count(job, NodeState::Waiting) == 0) return;
  const double now = clock_.now();
  job.next_waiting_notice = now + kWaitingNoticeInterval;
  Waiting w;
  w.job_id = job.id;
  w.waiting = static_cast<int>(count(job, NodeState::Waiting));
  w.rejoining = static_cast<int>(count(job, NodeState::Rejoining));
  w.min_nodes = job.min_nodes;
  w.max_nodes = job.max_nodes;
  if (w.waiting < job.min_nodes) {
    w.join_left = std::max(0.0, job.gather_since + job.timeouts.join_timeout - now);
  } else if (job.min_reached_at) {
    w.last_call_left = std::max(0.0, *job.min_reached_at + job.timeouts.last_call_timeout - now);
  }
  const Frame frame = encode(make_waiting(w));
  for (const auto& [conn, node] : job.nodes) {
    if (node.state == NodeState::Waiting && node.spec.progress) out_.send(conn, frame);
  }
}

std::vector<std::pair<ConnId, StateMachine::Node*>> StateMachine::round_members(Job& job) {
  std::vector<std::pair<ConnId, Node*>> waiting;
  waiting.reserve(count(job, NodeState::Waiting));
  for (auto& [conn, node] : job.nodes) {
    if (node.state == NodeState::Waiting) waiting.emplace_back(conn, &node);
  }
  auto priority = [](const Node& n) {
    return n.spec.spare ? 3 : n.spec.requested_rank >= 0 ? 0 : (n.group_rank >= 0 ? 1 : 2);
  };
  std::sort(waiting.begin(), waiting.end(), [&](const auto& a, const auto& b) {
    int pa = priority(*a.second), pb = priority(*b.second);
    return pa != pb ? pa < pb : a.second->join_seq < b.second->join_seq;
  });
  waiting.resize(std::min({waiting.size(), eligible(job), static_cast<std::size_t>(job.max_nodes)}));
  return waiting;
}

std::vector<std::pair<ConnId, StateMachine::Node*>> StateMachine::in_rank_order(
    const std::vector<std::pair<ConnId, Node*>>& members) {
  const std::size_t n = members.size();
  std::vector<std::pair<ConnId, Node*>> by_rank(n, {0, nullptr});
  std::vector<std::pair<ConnId, Node*>> rest;
  for (const auto& [conn, node] : members) {
    int want = node->spec.requested_rank >= 0 ? node->spec.requested_rank : node->group_rank;
    if (want >= 0 && static_cast<std::size_t>(want) < n && by_rank[want].second == nullptr) {
      by_rank[want] = {conn, node};
    } else {
      rest.emplace_back(conn, node);
    }
  }
  // New nodes in natural host order (node7 before node66), so that ranks follow the hardware;
  // several agents of one host by arrival.
  std::stable_sort(rest.begin(), rest.end(), [](const auto& x, const auto& y) {
    const Node& a = *x.second;
    const Node& b = *y.second;
    if (a.spec.host != b.spec.host) return natural_less(a.spec.host, b.spec.host);
    return a.join_seq < b.join_seq;
  });
  std::size_t free_rank = 0;
  for (const auto& member : rest) {
    while (by_rank[free_rank].second != nullptr) ++free_rank;
    by_rank[free_rank] = member;
  }
  return by_rank;
}

Assignment StateMachine::send_round(Job& job, const std::vector<std::pair<ConnId, Node*>>& by_rank) {
  Assignment a;
  a.generation = job.generation;
  a.group_world_size = static_cast<int>(by_rank.size());
  a.world_size = 0;
  for (const auto& [conn, node] : by_rank) a.world_size += node->spec.local_world_size;
  a.master_addr = by_rank[0].second->spec.addr;
  a.master_port = by_rank[0].second->spec.master_port;
  a.restart_count = job.restarts_used;
  a.max_restarts = job.max_restarts;
  a.goodput = job.goodput.totals(clock_.now()).to_array();  // a rebuilt server carries it on
  job.straggler_unreplaced_said = false;
  const RoundFrames frames(a);  // only a node's rank, offset and secret differ
  int offset = 0;
  for (std::size_t r = 0; r < by_rank.size(); ++r) {
    Node* node = by_rank[r].second;
    node->group_rank = static_cast<int>(r);
    node->slow_since = node->fast_since = -1;  // a new round is judged afresh
    node->straggler = false;
    a.group_rank = static_cast<int>(r);
    a.rank_offset = offset;
    offset += node->spec.local_world_size;
    set_state(job, *node, NodeState::Running);
    a.secret = seal_ ? seal_(by_rank[r].first, node->secret) : node->secret;  // proves this node in a resume
    out_.send(by_rank[r].first, frames.frame(a.group_rank, a.rank_offset, a.secret));
  }
  return a;
}

void StateMachine::complete_round(Job& job) {
  const std::vector<std::pair<ConnId, Node*>> members = round_members(job);
  if (round_check_) {
    std::vector<CheckedNode> specs;
    specs.reserve(members.size());
    for (const auto& w : members) specs.push_back(w.second->checked());
    if (auto refusal = round_check_(job.id, specs)) {
      out_.log("job " + job.id + ": round refused: " + *refusal);
      for (const auto& w : members) {
        remove_node(job, w.first);
        out_.drop(w.first, "round_refused", *refusal);
      }
      // The job is not erased here: callers still hold it. Each entry point erases an empty job
      // by id once it is done with it (erase_if_empty).
      return;
    }
  }
  const std::size_t n = members.size();
  ++job.generation;
  const Assignment a = send_round(job, in_rank_order(members));
  job.state = JobState::Running;
  job.round_size = n;
  job.last_round_size = n;
  job.round_succeeded = 0;
  {
    const double now = clock_.now();
    job.goodput.round_formed(now, n, static_cast<std::size_t>(job.max_nodes));
    for (const auto& member : members) {
      Node& node = *member.second;
      node.stale_step = node.progress ? node.progress->step : -1;
      node.fresh_step = false;
    }
    nlohmann::json fields = {{"nodes", n}, {"world_size", a.world_size}, {"formation_seconds", now - job.gather_since},
                             {"restarts_used", job.restarts_used}, {"master", a.master_addr + ":" + std::to_string(a.master_port)}};
    if (job.restart_since) fields["failure_to_restart_seconds"] = now - *job.restart_since;
    job.restart_since.reset();
    emit(job, "round", "complete", "", {}, std::move(fields));
  }
  job.round_failures.clear();
  job.min_reached_at.reset();
  describe_round(job);
  changed(job);
  out_.log("job " + job.id + ": round " + std::to_string(job.generation) + " complete: " + std::to_string(n) +
           " nodes, world size " + std::to_string(a.world_size) + ", master " + a.master_addr + ":" +
           std::to_string(a.master_port) + ", restarts " + std::to_string(job.restarts_used) + "/" +
           std::to_string(job.max_restarts) +
           (count(job, NodeState::Waiting) ? ", " + std::to_string(count(job, NodeState::Waiting)) + " standby" : ""));
}

void StateMachine::report_failure(ConnId conn, const WorkerFailure& failure) {
  Job* job = job_of(conn);
  if (!job) return;
  if (job->state == JobState::Restoring && job->nodes.at(conn).state == NodeState::Running) {
    // Happened while the rendezvous was away: counted once the restore concludes.
    out_.log("job " + job->id + ": failure on " + describe(job->nodes.at(conn)) + " while restoring: " +
             failure_text(failure));
    if (!job->pending_failure || (job->pending_failure->fatal.empty() && !failure.fatal.empty())) {
      job->pending_failure = failure;
    }
    return;
  }
  Node& node = job->nodes.at(conn);
  if (!failure.fatal.empty() && report_fatal(*job, node, failure)) return;
  if (job->failing && node.state == NodeState::Rejoining) {
    // A node of the failing round tells what it saw before it stopped: a candidate root cause.
    out_.log("job " + job->id + ": failure on " + describe(node) + " (job failing): " + failure_text(failure));
    job->round_failures.push_back(failure);
    return;
  }
  if (job->state != JobState::Running || node.state != NodeState::Running) {
    out_.log("job " + job->id + ": ignored a failure report from " + describe(node) +
             " (its round already ended): " + failure_text(failure));
    return;
  }
  out_.log("job " + job->id + ": failure on " + describe(node) + ": " + failure_text(failure));
  emit(*job, "failure", failure.signal != 0 ? "signal" : "exit_code", failure.host, {failure.rank},
       {{"local_rank", failure.local_rank}, {"exit_code", failure.exit_code}, {"signal", failure.signal}},
       failure_text(failure, node.group_rank));
  job->round_failures.push_back(failure);
  if (job->restarts_used < job->max_restarts) {
    end_round(*job, failure_text(failure, node.group_rank), true);
    return;
  }
  // The budget is spent. The first report is not necessarily the cause: a peer that failed in a
  // collective because this worker's node lost a worker may be reported first. Stop every node
  // (each reports what it saw before rejoining), then decide (finish_failing, from maybe_complete).
  job->failing = true;
  end_round(*job, "the job is failing (restart budget of " + std::to_string(job->max_restarts) +
                      " spent): stopping every worker to find the root cause",
            false, "job_failing");
  maybe_complete(*job);
}

// A node decided that the job must end (--no_restart_exit_codes, a crash loop): the job fails
// like one whose budget is spent, with that reason, once the nodes of the round have stopped.
// Taken from a node of the running round, or from one that is rejoining (it heard a counted
// restart and found the crash loop then; a round may even have completed without it). Returns
// false when the report cannot end the job (the job or node is finished, or the node waits
// for its first round), which is then handled as an ordinary report.
bool StateMachine::report_fatal(Job& job, Node& node, const WorkerFailure& failure) {
  if (job.state == JobState::Succeeded || job.state == JobState::Failed || job.state == JobState::Restoring) {
    return false;
  }
  if (node.state != NodeState::Running && node.state != NodeState::Rejoining) return false;
  out_.log("job " + job.id + ": fatal failure on " + describe(node) + ": " + failure.fatal + " (" +
           failure_text(failure) + ")");
  emit(job, "failure", "fatal", failure.host, {failure.rank},
       {{"local_rank", failure.local_rank}, {"exit_code", failure.exit_code}, {"signal", failure.signal}},
       failure.fatal);
  job.round_failures.push_back(failure);
  if (!job.fatal) job.fatal = failure;
  if (!job.failing) {
    job.failing = true;
    changed(job);
    if (job.state == JobState::Running) {
      end_round(job, "the job is failing (" + failure.fatal + "): stopping every worker", false, "job_failing");
    }
  }
  maybe_complete(job);
  return true;
}

void StateMachine::finish_failing(Job& job) {
  if (job.fatal) {
    // The worker the fatal report names, else (a node-wide decision) the round's root cause.
    const WorkerFailure& root = job.fatal->rank >= 0 || job.round_failures.empty()
                                    ? *job.fatal
                                    : *std::min_element(job.round_failures.begin(), job.round_failures.end(), explains);
    fail_job(job, root, "job " + job.id + " failed: " + job.fatal->fatal);
    return;
  }
  const WorkerFailure& root =
      *std::min_element(job.round_failures.begin(), job.round_failures.end(), explains);
  std::string summary = "job " + job.id + " failed after " + std::to_string(job.restarts_used) + " of " +
                        std::to_string(job.max_restarts) + " restarts; first failure: " +
                        failure_text(root, group_rank_of(job, root.rank));
  fail_job(job, root, summary);
}

void StateMachine::fail_job(Job& job, const WorkerFailure& failure, const std::string& summary) {
  job.goodput.ended(clock_.now());
  Frame frame = encode(make_job_failed(failure, summary, "", /*quiet=*/true));
  const ConnId speaker = speaker_of(job, &failure);
  for (auto& [conn, node] : job.nodes) {
    out_.send(conn, conn == speaker ? encode(make_job_failed(failure, summary, goodput_line(job))) : frame);
    set_state(job, node, NodeState::Finished);
  }
  job.state = JobState::Failed;
  changed(job);
  out_.log("job " + job.id + ": failed: " + summary);
  job_ended(job, summary);
}

void StateMachine::report_success(ConnId conn) {
  Job* job = job_of(conn);
  if (!job) return;
  Node& node = job->nodes.at(conn);
  if (job->state == JobState::Restoring && node.state == NodeState::Running) {
    node.success_pending = true;  // applied once the restore concludes
    return;
  }
  if (job->state != JobState::Running || node.state != NodeState::Running) {
    out_.log("job " + job->id + ": ignored a success report from " + describe(node) + " (not in a running round)");
    return;
  }
  set_state(*job, node, NodeState::Succeeded);
  ++job->round_succeeded;
  out_.log("job " + job->id + ": success on " + describe(node) + " (" + std::to_string(job->round_succeeded) + "/" +
           std::to_string(job->round_size) + ")");
  if (job->round_succeeded < job->round_size) return;
  job->goodput.ended(clock_.now());
  Frame frame = encode(make_job_succeeded(job->id));
  const ConnId speaker = speaker_of(*job, nullptr);
  for (auto& [c, n] : job->nodes) {
    out_.send(c, c == speaker ? encode(make_job_succeeded(job->id, goodput_line(*job))) : frame);
    set_state(*job, n, NodeState::Finished);
  }
  job->state = JobState::Succeeded;
  changed(*job);
  out_.log("job " + job->id + ": succeeded (generation " + std::to_string(job->generation) + ")");
  job_ended(*job, "");
}

namespace {
// The cause label of a loss (events, metrics), from the reason's first words.
const char* loss_cause(const std::string& why) {
  if (why.rfind("no heartbeat", 0) == 0) return "heartbeat_timeout";
  if (why.rfind("no answer to a probe", 0) == 0) return "probe_timeout";
  return "connection_closed";
}
}  // namespace

void StateMachine::node_gone(Job& job, ConnId conn, const std::string& why, bool left) {
  auto it = job.nodes.find(conn);
  if (it == job.nodes.end()) return;
  Node& node = it->second;
  const NodeState state = node.state;
  const std::string who = describe(node);
  remove_node(job, conn);
  if (state == NodeState::Finished || state == NodeState::Succeeded) {
    // Done: its close is not a loss (a succeeded node still counts as succeeded for the round).
    return;
  }
  out_.log("job " + job.id + ": " + (left ? "left: " : "lost: ") + who + ": " + why);
  job.waiting_changed = true;
  emit(job, left ? "node_left" : "node_lost", left ? "left" : loss_cause(why), who, {}, {}, why);
  if (state == NodeState::Running && job.state == JobState::Running) {
    end_round(job, "node " + who + (left ? " left the job" : " lost: " + why), false, left ? "node_left" : "node_lost");
  }
  maybe_complete(job);
}

void StateMachine::leave(ConnId conn) {
  Job* job = job_of(conn);
  if (!job) return;
  std::string id = job->id;
  node_gone(*job, conn, "left the job", true);
  erase_if_empty(id);
}

void StateMachine::disconnected(ConnId conn, const std::string& why) {
  Job* job = job_of(conn);
  if (!job) return;
  std::string id = job->id;
  node_gone(*job, conn, why, false);
  erase_if_empty(id);
}

void StateMachine::drop_all(Job& job, const std::string& code, const std::string& message) {
  std::vector<ConnId> conns;
  for (auto& [conn, node] : job.nodes) conns.push_back(conn);
  for (ConnId c : conns) {
    remove_node(job, c);
    out_.drop(c, code, message);
  }
}

void StateMachine::stalled(double seconds) {
  if (!(seconds > 0)) return;
  const double now = clock_.now();
  for (auto& [id, job] : jobs_) {
    // The stall is not the nodes' silence: every time that measures one moves with it (a probe
    // out stays unanswered: the node's answer is a flag, not a time).
    for (auto& [conn, node] : job.nodes) {
      node.last_seen = std::min(now, node.last_seen + seconds);
      if (node.probed_at >= 0) node.probed_at = std::min(now, node.probed_at + seconds);
    }
    if (job.pending_stall) job.pending_stall->since = std::min(now, job.pending_stall->since + seconds);
    job.next_heartbeat_check += seconds;
    for (auto& probe : job.probes) probe.second += seconds;
  }
}

void StateMachine::tick() {
  const double now = clock_.now();
  prune_finished(now);
  std::vector<std::string> ids;
  for (auto& [id, job] : jobs_) ids.push_back(id);
  for (const std::string& id : ids) {
    auto jt = jobs_.find(id);
    if (jt == jobs_.end()) continue;
    Job& job = jt->second;
    // Silent nodes first: a lost node may end the round or change what gathering waits for.
    // Scanning 10,000 nodes every tick would dominate the server: scan only once the oldest
    // heartbeat can have expired (heartbeats only move last_seen forward).
    std::vector<ConnId> silent;
    if (now >= job.next_heartbeat_check) {
      double oldest = now;
      for (auto& [conn, node] : job.nodes) {
        if (now - node.last_seen > job.timeouts.heartbeat_timeout) {
          silent.push_back(conn);
        } else {
          oldest = std::min(oldest, node.last_seen);
        }
      }
      job.next_heartbeat_check = oldest + job.timeouts.heartbeat_timeout;
    }
    for (ConnId conn : silent) {
      auto it = job.nodes.find(conn);
      if (it == job.nodes.end()) continue;
      std::string why = "no heartbeat for " + seconds_text(now - it->second.last_seen) + " (heartbeat_timeout " +
                        seconds_text(job.timeouts.heartbeat_timeout) + ")";
      node_gone(job, conn, why, false);
      out_.drop(conn, "heartbeat_timeout", "dropped by the rendezvous server: " + why);
    }
    tick_probes(job, now);
    if (job.nodes.empty()) {
      erase_if_empty(id);
      continue;
    }
    if (job.state == JobState::Restoring && now >= job.restore_deadline) conclude_restore(job);
    if (job.admit_pending && job.state == JobState::Running && now >= job.admit_at &&
        job.round_size < static_cast<std::size_t>(job.max_nodes) && count(job, NodeState::Waiting) > 0) {
      admit_newcomers(job, std::to_string(count(job, NodeState::Waiting)) + " node(s) waiting to join");
    }
    maybe_complete(job);
    if (job.nodes.empty()) {  // a refused round removed its members
      erase_if_empty(id);
      continue;
    }
    if (job.waiting_changed && now >= job.next_waiting_notice) tell_waiting(job);
    if (job.state == JobState::Gathering && count(job, NodeState::Waiting) < static_cast<std::size_t>(job.min_nodes) &&
        now - job.gather_since >= job.timeouts.join_timeout) {
      std::string message = "rendezvous for job " + job.id + " timed out: " +
                            std::to_string(count(job, NodeState::Waiting)) + " of MIN " +
                            std::to_string(job.min_nodes) + " nodes joined within join_timeout " +
                            seconds_text(job.timeouts.join_timeout);
      out_.log("job " + job.id + ": " + message);
      emit(job, "job_end", "join_timeout", "", {}, {}, message);
      drop_all(job, "join_timeout", message);
      erase_if_empty(id);
    }
  }
}

}  // namespace ddp::rdzv
