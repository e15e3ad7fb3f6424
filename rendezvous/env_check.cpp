#include "rendezvous/env_check.h"

#include "rendezvous/fingerprint_schema.h"

#include <algorithm>
#include <map>
#include <set>

namespace ddp::rdzv {
namespace {

using nlohmann::json;

constexpr std::size_t kNamesShown = 6;  // longer node lists end in "and N more"

// Fields that say how a fingerprint was made, not what the node has: never compared.
bool is_ignored_field(std::string_view field) {
  const fingerprint::Field* f = fingerprint::find(field);
  return f != nullptr && f->kind == fingerprint::Kind::ignored;
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// Shared libraries whose difference breaks a job: the framework and the GPU stack. Other
// libraries (libc, libstdc++, libm...) differ harmlessly between patch releases of an OS.
bool is_framework_library(std::string_view name) {
  static constexpr std::string_view kPrefixes[] = {
      "libtorch", "libc10", "libcuda", "libcudart", "libcublas", "libcudnn", "libnccl",
      "libgloo", "libnvrtc", "libcaffe2", "libshm", "libddp"};
  for (auto p : kPrefixes) {
    if (starts_with(name, p)) return true;
  }
  return false;
}

std::string label_of(const std::string& field) {
  if (const fingerprint::Field* f = fingerprint::find(field)) return std::string(f->label);
  if (starts_with(field, fingerprint::kLibrariesPrefix)) {
    return "shared library " + field.substr(fingerprint::kLibrariesPrefix.size());
  }
  if (starts_with(field, std::string(fingerprint::kEnv) + ".")) return field.substr(fingerprint::kEnv.size() + 1);
  return field;
}

// Shortens 64-hex-digit hashes to 12 digits for messages; the rest is shown as is.
std::string display(const std::string& value) {
  if (value.size() == 64 &&
      std::all_of(value.begin(), value.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
    return value.substr(0, 12);
  }
  return value;
}

using Path = std::vector<std::string>;

std::string join(const Path& path) {
  std::string out;
  for (const auto& seg : path) {
    if (!out.empty()) out += '.';
    out += seg;
  }
  return out;
}

// Every leaf under j (objects are walked; arrays and scalars are leaves).
void leaf_paths(const json& j, Path& path, std::set<Path>& out) {
  if (!j.is_object()) {
    if (!path.empty()) out.insert(path);
    return;
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    path.push_back(it.key());
    leaf_paths(it.value(), path, out);
    path.pop_back();
  }
}

// The leaves where a and b differ (a missing leaf differs from any value). Equal subtrees are
// skipped without building any string: the common case, nodes that agree, costs one walk.
void diff_paths(const json* a, const json* b, Path& path, std::set<Path>& out) {
  if (a && b && *a == *b) return;
  if (a && b && a->is_object() && b->is_object()) {
    for (auto it = a->begin(); it != a->end(); ++it) {
      auto other = b->find(it.key());
      path.push_back(it.key());
      diff_paths(&it.value(), other == b->end() ? nullptr : &*other, path, out);
      path.pop_back();
    }
    for (auto it = b->begin(); it != b->end(); ++it) {
      if (a->contains(it.key())) continue;
      path.push_back(it.key());
      diff_paths(nullptr, &it.value(), path, out);
      path.pop_back();
    }
    return;
  }
  if (a && a->is_object()) leaf_paths(*a, path, out);
  if (b && b->is_object()) leaf_paths(*b, path, out);
  if ((a && !a->is_object()) || (b && !b->is_object())) out.insert(path);
}

// The text of the leaf at path, or nullptr when it is missing.
const json* lookup(const json& j, const Path& path) {
  const json* at = &j;
  for (const auto& seg : path) {
    if (!at->is_object()) return nullptr;
    auto it = at->find(seg);
    if (it == at->end()) return nullptr;
    at = &*it;
  }
  return at;
}

std::string node_list(const std::vector<NodeFingerprint>& nodes, const std::vector<std::size_t>& idx,
                      bool with_addr) {
  std::string out = idx.size() == 1 ? "node " : "nodes ";
  std::size_t shown = std::min(idx.size(), kNamesShown);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto& n = nodes[idx[i]];
    if (i > 0) out += ", ";
    out += n.name.empty() ? "#" + std::to_string(idx[i]) : n.name;
    if (with_addr && !n.addr.empty()) out += " (" + n.addr + ")";
  }
  if (idx.size() > shown) out += " and " + std::to_string(idx.size() - shown) + " more";
  return out;
}

}  // namespace

std::optional<EnvCheckMode> parse_env_check_mode(std::string_view text) {
  if (text == "strict") return EnvCheckMode::strict;
  if (text == "warn") return EnvCheckMode::warn;
  if (text == "off") return EnvCheckMode::off;
  return std::nullopt;
}

const char* to_string(EnvCheckMode mode) {
  switch (mode) {
    case EnvCheckMode::strict: return "strict";
    case EnvCheckMode::warn: return "warn";
    case EnvCheckMode::off: return "off";
  }
  return "strict";
}

bool is_breaking_field(std::string_view field) {
  if (const fingerprint::Field* f = fingerprint::find(field)) return f->kind == fingerprint::Kind::breaking;
  if (starts_with(field, fingerprint::kLibrariesPrefix)) {
    return is_framework_library(field.substr(fingerprint::kLibrariesPrefix.size()));
  }
  return false;
}

bool EnvCheckResult::has_breaking() const {
  return std::any_of(differences.begin(), differences.end(),
                     [](const EnvDifference& d) { return d.breaking; });
}

std::string EnvCheckResult::message(bool breaking_only) const {
  std::string out;
  for (const auto& d : differences) {
    if (breaking_only && !d.breaking) continue;
    if (!out.empty()) out += '\n';
    out += d.message;
  }
  return out;
}

EnvCheckResult compare_fingerprints(const std::vector<NodeFingerprint>& nodes) {
  EnvCheckResult result;
  const std::size_t n = nodes.size();
  if (n < 2) return result;
  // Every node against the first: the union of the leaves where any node differs.
  std::set<Path> differing;
  Path path;
  for (std::size_t i = 1; i < n; ++i) {
    diff_paths(&nodes[0].fingerprint, &nodes[i].fingerprint, path, differing);
  }
  std::vector<std::string> values;  // distinct values of the field at hand, interned
  std::vector<int> of_node(n);      // index into values; -1: missing
  for (const Path& p : differing) {
    std::string name = join(p);
    if (is_ignored_field(name)) continue;
    values.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const json* leaf = lookup(nodes[i].fingerprint, p);
      // Absent and null say the same (no torch, no cuDNN): one group, "(none)".
      if (leaf == nullptr || leaf->is_null()) { of_node[i] = -1; continue; }
      std::string value = leaf->is_string() ? leaf->get<std::string>() : leaf->dump();
      auto it = std::find(values.begin(), values.end(), value);
      of_node[i] = static_cast<int>(it - values.begin());
      if (it == values.end()) values.push_back(std::move(value));
    }
    EnvDifference d;
    d.field = name;
    d.label = label_of(name);
    d.breaking = is_breaking_field(name);
    // Groups in order of first appearance, then stable-sorted by size (smallest first).
    std::vector<int> group_of_value(values.size() + 1, -1);  // last slot: "missing"
    for (std::size_t i = 0; i < n; ++i) {
      int key = of_node[i] < 0 ? static_cast<int>(values.size()) : of_node[i];
      if (group_of_value[key] < 0) {
        group_of_value[key] = static_cast<int>(d.groups.size());
        std::string value = of_node[i] < 0 ? (starts_with(name, "env.") ? "(unset)" : "(none)")
                                           : display(values[of_node[i]]);
        d.groups.push_back({value, {}});
      }
      d.groups[group_of_value[key]].nodes.push_back(i);
    }
    if (d.groups.size() < 2) continue;  // e.g. a subtree that differed only in ignored leaves
    std::stable_sort(d.groups.begin(), d.groups.end(),
                     [](const auto& a, const auto& b) { return a.nodes.size() < b.nodes.size(); });
    for (std::size_t g = 0; g < d.groups.size(); ++g) {
      const auto& group = d.groups[g];
      bool majority = g + 1 == d.groups.size();
      if (g > 0) d.message += "; ";
      d.message += node_list(nodes, group.nodes, !majority);
      d.message += group.nodes.size() == 1 ? " has " : " have ";
      if (g == 0) d.message += d.label + " ";
      d.message += group.value;
    }
    result.differences.push_back(std::move(d));
  }
  std::sort(result.differences.begin(), result.differences.end(),
            [](const EnvDifference& a, const EnvDifference& b) {
              if (a.breaking != b.breaking) return a.breaking;
              return a.field < b.field;
            });
  return result;
}

EnvVerdict env_check_verdict(EnvCheckMode mode, const EnvCheckResult& result) {
  if (mode == EnvCheckMode::off || result.empty()) return EnvVerdict::pass;
  if (mode == EnvCheckMode::strict && result.has_breaking()) return EnvVerdict::refuse;
  return EnvVerdict::warn;
}

std::string refusal_message(const EnvCheckResult& result) {
  std::string out = "environment mismatch between the job's nodes (--env_check=strict):";
  for (const auto& d : result.differences) {
    if (d.breaking) out += "\n  " + d.message;
  }
  out += "\nmake the nodes' software the same, or pass --env_check=warn to run anyway";
  return out;
}

}  // namespace ddp::rdzv
