// Stragglers (docs/maintenance.md, "Stragglers"). In synchronous DDP every rank finishes its steps
// at the same rate, so the step rate cannot tell a slow node from the others. What differs is each
// rank's busy time per step: the part of the step it did not spend waiting for its peers in a
// collective. Workers measure it (the worker SDK around its all-reduces, the Python bootstrap
// from the end of an optimizer step to the end of the next DDP forward), agents send their
// slowest rank's with their heartbeats, and the server compares each node with the median of the
// job's other nodes. A node at --straggler_factor x that median or more (and at least
// kStragglerMinExcessSeconds above it) for --straggler_window seconds is named a straggler
// (event, metric, status); a dip below the factor shorter than a quarter of the window does not
// restart the count. It is cleared once it stays below half that excess for as long
// (hysteresis: a node near the line does not flap in and out). With --straggler=replace the
// slowest named straggler is drained onto a waiting spare; the round that follows is judged
// afresh, so the next replacement comes a whole window later at least.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "rendezvous/state.h"

namespace ddp::rdzv {

namespace {

// The median of `sorted` without its element at index `skip` (the others' median of a node).
double median_without(const std::vector<double>& sorted, std::size_t skip) {
  const std::size_t m = sorted.size() - 1;
  auto at = [&](std::size_t k) { return sorted[k < skip ? k : k + 1]; };
  return m % 2 == 1 ? at(m / 2) : (at(m / 2 - 1) + at(m / 2)) / 2;
}

std::string fixed(double value, const char* format) {
  char text[32];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

std::string millis(double seconds) { return fixed(seconds * 1000, seconds < 0.01 ? "%.1f ms" : "%.0f ms"); }

}  // namespace

std::vector<int> StateMachine::first_ranks(const Job& job) {
  std::vector<int> first;
  for (const auto& [conn, node] : job.nodes) {
    if (node.state != NodeState::Running || node.group_rank < 0) continue;
    if (first.size() <= static_cast<std::size_t>(node.group_rank)) first.resize(static_cast<std::size_t>(node.group_rank) + 1, 0);
    first[static_cast<std::size_t>(node.group_rank)] = node.spec.local_world_size;
  }
  int offset = 0;
  for (int& f : first) offset += std::exchange(f, offset);
  return first;
}

int StateMachine::first_rank_of(const std::vector<int>& first, const Node& node) {
  return node.group_rank >= 0 && static_cast<std::size_t>(node.group_rank) < first.size()
             ? first[static_cast<std::size_t>(node.group_rank)]
             : 0;
}

// "node B: 1.8x the median busy time for 60 s (rank 5: 412 ms vs 230 ms)"
std::string StateMachine::straggler_line(const Node& node, int first_rank, double now) {
  const int rank = first_rank + node.progress->busy_local_rank;
  return "node " + describe(node) + ": " + fixed(node.busy_ratio, "%.1fx") + " the median busy time for " +
         seconds_text(std::round(now - node.slow_since)) + " (rank " + std::to_string(rank) + ": " +
         millis(node.progress->busy) + " vs " + millis(node.busy_median) + ")";
}

void StateMachine::judge_stragglers(Job& job, double now) {
  const StragglerPolicy& policy = job.straggler;
  if (policy.mode == "off" || job.state != JobState::Running || now < job.next_straggler_judgement) return;
  std::vector<std::pair<ConnId, Node*>> measured;
  for (auto& [conn, node] : job.nodes) {
    if (node.state == NodeState::Running && node.progress && node.progress->busy_local_rank >= 0 &&
        node.progress->busy > 0) {
      measured.emplace_back(conn, &node);
    }
  }
  if (measured.size() < 2) return;  // nothing to compare a node with
  // Once a second at most: a job of 10,000 nodes sorts its figures once, not at each heartbeat.
  job.next_straggler_judgement = now + kStragglerJudgementEvery;
  std::vector<double> sorted;
  sorted.reserve(measured.size());
  for (const auto& [conn, node] : measured) sorted.push_back(node->progress->busy);
  std::sort(sorted.begin(), sorted.end());
  std::optional<ConnId> replace;  // the slowest named straggler
  double slowest = 0;
  for (auto& [conn, node] : measured) {
    const double busy = node->progress->busy;
    const auto index = static_cast<std::size_t>(std::lower_bound(sorted.begin(), sorted.end(), busy) - sorted.begin());
    node->busy_median = median_without(sorted, index);
    node->busy_ratio = busy / node->busy_median;
    if (judge_straggler(job, *node, now) && node->busy_ratio > slowest) {
      slowest = node->busy_ratio;
      replace = conn;
    }
  }
  // One at a time: the replacement ends the round, and the next is judged afresh (send_round),
  // so another node is named, and replaced, only after a whole window of the new round.
  if (replace && policy.mode == "replace") replace_straggler(job, *replace, now);
}

bool StateMachine::judge_straggler(Job& job, Node& node, double now) {
  const StragglerPolicy& policy = job.straggler;
  // Slow: at the factor or above, and by a margin worth acting on (a few milliseconds of a step
  // are noise: scheduling, a log line, rank 0's checkpoint).
  const bool slow = node.busy_ratio >= policy.factor &&
                    node.progress->busy - node.busy_median >= kStragglerMinExcessSeconds;
  if (!node.straggler) {
    if (!slow) {
      // A dip (a stale figure, a step that waited on its disk) does not restart the count;
      // staying below for a quarter of the window does.
      if (node.fast_since < 0) node.fast_since = now;
      if (now - node.fast_since >= std::max(kStragglerDipSeconds, policy.window / 4)) node.slow_since = -1;
      return false;
    }
    node.fast_since = -1;
    if (node.slow_since < 0) node.slow_since = now;
    if (now - node.slow_since < policy.window) return false;
    node.straggler = true;
    const int first = first_rank_of(first_ranks(job), node);
    const std::string line = straggler_line(node, first, now);
    out_.log("job " + job.id + ": straggler: " + line);
    emit(job, "straggler", "busy_time", describe(node), {first + node.progress->busy_local_rank},
         {{"ratio", node.busy_ratio}, {"busy", node.progress->busy}, {"median", node.busy_median},
          {"slow_for", now - node.slow_since}},
         line);
    changed(job);
    return true;
  }
  if (node.busy_ratio >= 1 + (policy.factor - 1) / 2) {  // above the clearing line
    node.fast_since = -1;
    return true;
  }
  if (node.fast_since < 0) node.fast_since = now;
  if (now - node.fast_since < policy.window) return true;
  node.straggler = false;
  node.slow_since = -1;
  out_.log("job " + job.id + ": straggler cleared: " + describe(node) + " (" + fixed(node.busy_ratio, "%.1fx") +
           " the median busy time for " + seconds_text(std::round(now - node.fast_since)) + ")");
  emit(job, "straggler_cleared", "busy_time", describe(node), {}, {{"ratio", node.busy_ratio}});
  changed(job);
  return false;
}

void StateMachine::replace_straggler(Job& job, ConnId conn, double now) {
  std::size_t spares = 0;
  for (const auto& [other, node] : job.nodes) spares += is_spare(job, node) ? 1 : 0;
  if (spares == 0) {
    if (!job.straggler_unreplaced_said) {
      job.straggler_unreplaced_said = true;
      out_.log("job " + job.id + ": --straggler=replace: no spare waits to take the place of " +
               describe(job.nodes.at(conn)) + "; it stays until one does (start a node with --spare)");
    }
    return;
  }
  const Node& slow = job.nodes.at(conn);
  const std::string line = straggler_line(slow, first_rank_of(first_ranks(job), slow), now);
  const std::string id = job.id;
  take_out(job, conn, "straggler",
           "--straggler=replace took this node out of job " + id + " as a straggler (" + line + ")", false);
  maybe_complete(job);
  erase_if_empty(id);
}

}  // namespace ddp::rdzv
