#include "rendezvous/fingerprint_table.h"

#include <cmath>
#include <functional>
#include <utility>

namespace ddp::rdzv {

bool identical_json(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.type() != b.type() || a.size() != b.size()) return false;
  switch (a.type()) {
    case nlohmann::json::value_t::object: {
      // Both are std::maps: the same keys come in the same order.
      for (auto x = a.begin(), y = b.begin(); x != a.end(); ++x, ++y) {
        if (x.key() != y.key() || !identical_json(x.value(), y.value())) return false;
      }
      return true;
    }
    case nlohmann::json::value_t::array: {
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (!identical_json(a[i], b[i])) return false;
      }
      return true;
    }
    case nlohmann::json::value_t::number_float: {
      const double x = a.get<double>(), y = b.get<double>();
      return x == y && std::signbit(x) == std::signbit(y);
    }
    default:
      return a == b;  // strings, integers of one signedness, booleans, null
  }
}

FingerprintTable::Ref FingerprintTable::intern(nlohmann::json fingerprint) {
  if (fingerprint.empty()) return nullptr;
  const std::size_t hash = std::hash<nlohmann::json>{}(fingerprint);
  auto [first, last] = index_->equal_range(hash);
  std::size_t same_hash = 0;
  for (auto it = first; it != last; ++it, ++same_hash) {
    if (Ref held = it->second.lock(); held && identical_json(*held, fingerprint)) return held;
  }
  // Crafted fingerprints that share a hash would make every join compare against all of them:
  // past a few, a fingerprint keeps its own copy, as before interning.
  if (same_hash >= kMaxSameHash) return std::make_shared<const nlohmann::json>(std::move(fingerprint));
  // The last Ref's deleter takes the entry out of the index (when the index still exists): any
  // entry of that hash whose copy is gone, which is this one (the others are dropped the same way).
  std::weak_ptr<Index> index = index_;
  Ref copy(new nlohmann::json(std::move(fingerprint)), [index, hash](const nlohmann::json* p) {
    if (std::shared_ptr<Index> live = index.lock()) {
      auto [from, to] = live->equal_range(hash);
      while (from != to) from = from->second.expired() ? live->erase(from) : std::next(from);
    }
    delete p;
  });
  index_->emplace(hash, copy);
  return copy;
}

const nlohmann::json& FingerprintTable::read(const Ref& ref) {
  static const nlohmann::json empty = nlohmann::json::object();
  return ref ? *ref : empty;
}

}  // namespace ddp::rdzv
