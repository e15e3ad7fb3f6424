#include "agent/line_dedup.h"

#include <algorithm>
#include <set>

namespace ddp::agent {

namespace {

// A search through the held groups that gives up past this many (then a line is not shared):
// the graph is small in practice, a window of lines.
constexpr std::size_t kMaxSearch = 4096;

}  // namespace

std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(ranks[i]);
    if (j > i) out += '-' + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

LineDedup::LineDedup(std::chrono::milliseconds window, std::size_t max_line, std::size_t max_bytes)
    : window_(window), max_line_(max_line), max_bytes_(max_bytes) {}

void LineDedup::expect(int fd, std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  expected_[fd] = std::move(ranks);
}

std::string LineDedup::key(int fd, std::string_view line) {
  std::string k = std::to_string(fd);
  k += ':';
  k += line;
  return k;
}

// Whether group `later` must be written after group `earlier`: it can be reached from `earlier`
// through the ranks' orders. Gives up (true: "do not join") past kMaxSearch groups.
bool LineDedup::after(std::uint64_t later, std::uint64_t earlier) const {
  std::vector<std::uint64_t> todo{earlier};
  std::set<std::uint64_t> seen{earlier};
  while (!todo.empty()) {
    const std::uint64_t seq = todo.back();
    todo.pop_back();
    if (seq == later) return true;
    for (int rank : groups_.at(seq).ranks) {
      const auto& order = held_.at(rank);
      auto it = std::find(order.begin(), order.end(), seq);
      if (it == order.end() || ++it == order.end()) continue;
      if (seen.insert(*it).second) todo.push_back(*it);  // its next group; the rest follow from it
    }
    if (seen.size() > kMaxSearch) return true;
  }
  return false;
}

void LineDedup::add(int fd, int rank, std::string_view prefix, std::string_view line, Time now) {
  if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  const bool shareable = line.size() <= max_line_;
  auto& mine = held_[rank];
  if (shareable) {
    auto found = by_text_.find(key(fd, line));
    if (found != by_text_.end()) {
      for (std::uint64_t seq : found->second) {
        Group& g = groups_.at(seq);
        if (std::binary_search(g.ranks.begin(), g.ranks.end(), rank)) continue;
        // Joining puts the group after this rank's latest line: not if that line must come after it.
        if (!mine.empty() && after(mine.back(), seq)) continue;
        g.ranks.insert(std::upper_bound(g.ranks.begin(), g.ranks.end(), rank), rank);
        mine.push_back(seq);
        return;
      }
    }
  }
  const std::uint64_t seq = next_seq_++;
  Group g{fd, std::string(line), std::string(prefix), {rank}, now + window_, shareable};
  bytes_ += cost(g);
  if (shareable) by_text_[key(fd, line)].push_back(seq);
  groups_.emplace(seq, std::move(g));
  mine.push_back(seq);
}

bool LineDedup::ready(std::uint64_t seq, const Group& g, Time now, bool force) const {
  for (int rank : g.ranks) {
    if (held_.at(rank).front() != seq) return false;  // an earlier line of this rank is held
  }
  if (force || !g.open || g.deadline <= now) return true;
  auto it = expected_.find(g.fd);
  if (it == expected_.end()) return true;  // no other rank prints here
  return std::includes(g.ranks.begin(), g.ranks.end(), it->second.begin(), it->second.end());
}

void LineDedup::emit(std::uint64_t seq, std::vector<ConsoleLine>& out) {
  auto node = groups_.extract(seq);
  Group& g = node.mapped();
  std::string text = g.ranks.size() == 1 ? g.first_prefix : "[ranks " + rank_ranges(g.ranks) + "] ";
  text += g.text;
  text += '\n';
  out.push_back({g.fd, std::move(text)});
  bytes_ -= cost(g);
  for (int rank : g.ranks) {
    auto& order = held_[rank];
    order.pop_front();
    if (order.empty()) held_.erase(rank);
  }
  if (g.open) {
    auto it = by_text_.find(key(g.fd, g.text));
    if (it != by_text_.end()) {
      it->second.erase(std::find(it->second.begin(), it->second.end(), seq));
      if (it->second.empty()) by_text_.erase(it);
    }
  }
}

// Writes ready groups while there are: only the groups first in all their ranks' orders can be,
// at most one per rank, so each round looks at those and writes the oldest ready one.
void LineDedup::drain(Time now, bool force, std::vector<ConsoleLine>& out) {
  for (;;) {
    const bool over = bytes_ > max_bytes_;
    std::optional<std::uint64_t> best;
    for (const auto& [rank, order] : held_) {
      const std::uint64_t seq = order.front();
      if (best && *best <= seq) continue;
      if (ready(seq, groups_.at(seq), now, force || over)) best = seq;
    }
    if (!best) return;
    emit(*best, out);
  }
}

std::vector<ConsoleLine> LineDedup::take(Time now) {
  std::vector<ConsoleLine> out;
  drain(now, false, out);
  return out;
}

std::vector<ConsoleLine> LineDedup::take_all() {
  std::vector<ConsoleLine> out;
  drain(Time{}, true, out);
  return out;
}

std::optional<LineDedup::Time> LineDedup::next_deadline(Time now) const {
  for (const auto& [seq, g] : groups_) {
    if (g.deadline > now) return g.deadline;  // windows end in the order they began
  }
  return std::nullopt;
}

}  // namespace ddp::agent
