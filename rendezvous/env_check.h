// Comparing the software fingerprints of a job's nodes. Pure functions: no I/O, no
// clock, no Boost.Asio; the rendezvous state machine calls them when a round is about to
// complete and when a node joins a running job. Fingerprints are the JSON objects made by
// agent/fingerprint.h; which field breaks a job is listed in docs/env-check.md.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp::rdzv {

// --env_check. Default strict.
enum class EnvCheckMode { strict, warn, off };

// "strict" | "warn" | "off" -> mode; anything else -> nullopt (the caller reports a usage error).
std::optional<EnvCheckMode> parse_env_check_mode(std::string_view text);
const char* to_string(EnvCheckMode mode);

// One node as the check names it: `name` ("b", a hostname) and `addr` ("10.0.0.2") make the
// label "b (10.0.0.2)"; addr may be empty.
struct NodeFingerprint {
  std::string name;
  std::string addr;
  nlohmann::json fingerprint;
};

// One field whose value is not the same on every node.
struct EnvDifference {
  std::string field;     // dotted path in the fingerprint, e.g. "python.torch"
  std::string label;     // what a user calls it, e.g. "torch"
  bool breaking = false; // does this difference break a job (docs/env-check.md)?
  // The distinct values, each with the indices (into the input) of the nodes that have it;
  // smallest group first, the largest (the majority) last; ties in order of first node.
  struct Group {
    std::string value;   // "(none)" when the field is missing on those nodes
    std::vector<std::size_t> nodes;
  };
  std::vector<Group> groups;
  // One line, e.g. "node b (10.0.0.2) has torch 2.1.0+cu118; nodes a, c have 2.1.0+cu121".
  std::string message;
};

struct EnvCheckResult {
  std::vector<EnvDifference> differences;  // breaking ones first, then by field name

  bool has_breaking() const;
  bool empty() const { return differences.empty(); }
  // The lines of the differences, one per line; only the breaking ones when breaking_only.
  std::string message(bool breaking_only = false) const;
};

// Compares every field of every node's fingerprint. O(nodes x fields); about a millisecond for
// 100 nodes (measure: see docs/env-check.md). Fewer than two nodes: no differences.
EnvCheckResult compare_fingerprints(const std::vector<NodeFingerprint>& nodes);

// What the rendezvous does with a result under a mode.
enum class EnvVerdict {
  pass,    // nothing to report
  warn,    // log result.message() and go on
  refuse,  // refuse the round: every agent exits 3 with refusal_message()
};
EnvVerdict env_check_verdict(EnvCheckMode mode, const EnvCheckResult& result);

// The text every refused agent prints: the breaking differences and what to do about them.
std::string refusal_message(const EnvCheckResult& result);

// Whether a fingerprint field (dotted path) breaks a job when it differs between nodes.
bool is_breaking_field(std::string_view field);

}  // namespace ddp::rdzv
