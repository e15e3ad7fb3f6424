// Keeps one copy of each distinct node fingerprint for the rendezvous state machine.
//
// A job's nodes usually run one image, so thousands of joins carry the same fingerprint (about
// 25 fields, ~4 KB parsed for a GPU node running Python): each node holds a shared, immutable
// copy instead of its own. Pure logic, no I/O. Owned by the StateMachine, called on its thread
// only, so it holds no locks.
#pragma once

#include <cstddef>
#include <memory>
#include <unordered_map>

#include <nlohmann/json.hpp>

namespace ddp::rdzv {

class FingerprintTable {
 public:
  using Ref = std::shared_ptr<const nlohmann::json>;

  FingerprintTable() : index_(std::make_shared<Index>()) {}
  FingerprintTable(const FingerprintTable&) = delete;
  FingerprintTable& operator=(const FingerprintTable&) = delete;

  // The shared copy of `fingerprint`: the copy held already when one is identical to it (same
  // structure, types and values, so every reader sees exactly what its own node sent), else a
  // new one. An empty fingerprint (a node with --env_check=off) is null: it costs nothing.
  // The entry goes when its last Ref does, even after the table (the Refs do not need it).
  Ref intern(nlohmann::json fingerprint);
  // Distinct fingerprints held now (those kept apart past kMaxSameHash not counted).
  std::size_t size() const { return index_->size(); }
  // Fingerprints of one hash that are shared at most; a further one keeps its own copy.
  static constexpr std::size_t kMaxSameHash = 8;

  // What a Ref reads as: the fingerprint, or an empty object for null.
  static const nlohmann::json& read(const Ref& ref);

 private:
  // Structural hash -> each live copy with that hash. A Ref's deleter removes its entry.
  using Index = std::unordered_multimap<std::size_t, std::weak_ptr<const nlohmann::json>>;
  std::shared_ptr<Index> index_;
};

// Whether two JSON values are the same to every reader: equal and of the same types all the way
// down (nlohmann's == holds 1 equal to 1.0, and 0.0 to -0.0, which print differently).
bool identical_json(const nlohmann::json& a, const nlohmann::json& b);

}  // namespace ddp::rdzv
