// How deeply a JSON text nests, counted without parsing it: the check every reader of untrusted
// JSON runs before nlohmann::json::parse, which recurses. Header-only and dependency-free: the
// rendezvous's codecs use it with their own limits, and so do the agent-worker messages
// (kMaxAssignmentDepth, kMaxWorkerDepth), whose Python readers run the same count (_depth in
// python/ddplaunch_standby.py).
#pragma once

#include <string_view>

namespace ddp::contracts {

// The largest nesting depth of arrays/objects in `text` (strings skipped); stops counting past
// `limit` + 1. Runs in constant memory, so it is safe on any input.
inline int json_depth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > deepest) deepest = depth;
      if (deepest > limit) return deepest;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace ddp::contracts
