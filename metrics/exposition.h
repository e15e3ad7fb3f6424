// The Prometheus text exposition format (0.0.4), written by Debian's prometheus-cpp (the
// maintained library: names, label escaping, HELP/TYPE lines, histogram buckets), plus the one
// rule it leaves to us: bounded label values.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <set>
#include <string>

#include <prometheus/registry.h>

namespace ddp::metrics {

constexpr const char* kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

// The families of every registry, in order, as one text exposition.
std::string exposition(std::initializer_list<const prometheus::Registry*> registries);

// Caps the distinct values of one label (a cause string comes from outside: an unbounded label
// would grow the series, and the server's memory, without limit). The first `max_values`
// distinct values are kept, longer ones cut to `max_length`; later new values become "other".
class LabelValues {
 public:
  explicit LabelValues(std::size_t max_values = 32, std::size_t max_length = 64)
      : max_values_(max_values), max_length_(max_length) {}
  std::string admit(const std::string& value);

 private:
  std::size_t max_values_;
  std::size_t max_length_;
  std::set<std::string> seen_;
};

}  // namespace ddp::metrics
