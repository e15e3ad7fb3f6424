#include "agent/logs.h"

namespace ddp::agent {

std::string worker_log_dir(const std::string& log_dir, const std::string& run_id, int attempt,
                           int local_rank) {
  std::string dir = log_dir;
  if (!dir.empty() && dir.back() != '/') dir += '/';
  return dir + run_id + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank);
}

std::string line_prefix(const std::string& templ, const std::string& role, int rank, int local_rank) {
  if (templ.empty()) return "[" + role + std::to_string(local_rank) + "]:";
  const std::pair<std::string, std::string> vars[] = {
      {"${role_name}", role}, {"${rank}", std::to_string(rank)}, {"${local_rank}", std::to_string(local_rank)}};
  std::string out;
  for (std::size_t i = 0; i < templ.size();) {
    bool replaced = false;
    for (const auto& [name, value] : vars) {
      if (templ.compare(i, name.size(), name) == 0) {
        out += value;
        i += name.size();
        replaced = true;
        break;
      }
    }
    if (!replaced) out += templ[i++];
  }
  return out;
}

void LineSplitter::feed(std::string_view data) {
  while (!data.empty()) {
    auto nl = data.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(data);
      while (partial_.size() >= max_line_) {
        on_line_(std::string_view(partial_).substr(0, max_line_));
        partial_.erase(0, max_line_);
      }
      return;
    }
    if (partial_.empty()) {
      on_line_(data.substr(0, nl + 1));  // the common case: no copy
    } else {
      partial_.append(data.substr(0, nl + 1));
      on_line_(partial_);
      partial_.clear();
    }
    data.remove_prefix(nl + 1);
  }
}

void LineSplitter::finish() {
  if (!partial_.empty()) {
    on_line_(partial_);
    partial_.clear();
  }
}

}  // namespace ddp::agent
