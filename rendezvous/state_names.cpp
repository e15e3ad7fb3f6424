// What the state machine shows of itself: its states' names, a node as its messages name it,
// durations as text, and the natural order of host names in which new nodes take group ranks.
#include "rendezvous/state.h"

#include <sstream>

namespace ddp::rdzv {

std::string seconds_text(double s) {
  std::ostringstream os;
  os << s << " s";
  return os.str();
}

std::string StateMachine::describe(const Node& node) {
  std::string s = node.spec.host.empty() ? node.spec.addr : node.spec.host;
  if (!node.spec.addr.empty() && node.spec.addr != s) s += " (" + node.spec.addr + ")";
  if (node.group_rank >= 0) s += " [group rank " + std::to_string(node.group_rank) + "]";
  return s;
}

bool natural_less(std::string_view a, std::string_view b) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      // Compare the two numbers: leading zeros skipped, then the longer is larger, then digits.
      std::size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      std::size_t is = i, js = j;
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      const std::string_view na = a.substr(is, ie - is), nb = b.substr(js, je - js);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i;
    ++j;
  }
  if ((a.size() - i) != (b.size() - j)) return (a.size() - i) < (b.size() - j);
  return a < b;  // equal but for leading zeros: a total order all the same
}

const char* StateMachine::state_name(NodeState s) {
  switch (s) {
    case NodeState::Waiting: return "waiting";
    case NodeState::Running: return "running";
    case NodeState::Succeeded: return "succeeded";
    case NodeState::Rejoining: return "rejoining";
    case NodeState::Finished: return "finished";
    default: return "?";
  }
}

const char* StateMachine::state_name(JobState s) {
  switch (s) {
    case JobState::Gathering: return "gathering";
    case JobState::Running: return "running";
    case JobState::Succeeded: return "succeeded";
    case JobState::Failed: return "failed";
    case JobState::Restoring: return "restoring";
  }
  return "?";
}

}  // namespace ddp::rdzv
