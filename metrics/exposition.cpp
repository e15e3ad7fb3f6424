#include "metrics/exposition.h"

#include <sstream>
#include <vector>

#include <prometheus/text_serializer.h>

namespace ddp::metrics {

std::string exposition(std::initializer_list<const prometheus::Registry*> registries) {
  std::vector<prometheus::MetricFamily> families;
  for (const auto* r : registries) {
    auto f = r->Collect();
    families.insert(families.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
  }
  std::ostringstream os;
  prometheus::TextSerializer().Serialize(os, families);
  return os.str();
}

std::string LabelValues::admit(const std::string& value) {
  std::string v = value.empty() ? "unknown" : value.substr(0, max_length_);
  if (seen_.count(v)) return v;
  if (seen_.size() >= max_values_) return "other";
  seen_.insert(v);
  return v;
}

}  // namespace ddp::metrics
