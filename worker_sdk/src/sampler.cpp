#include "ddp/sampler.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>

#include "ddp/error.h"

namespace ddp {

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size,
                                       Options options)
    : size_(dataset_size), rank_(rank), world_(world_size), options_(options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError("DistributedSampler: rank " + std::to_string(rank) +
                     " is outside [0, world size " + std::to_string(world_size) + ")");
  }
  if (dataset_size < 0) {
    throw UsageError("DistributedSampler: negative data set size " + std::to_string(dataset_size));
  }
  build();
}

std::vector<int64_t> DistributedSampler::permutation(int64_t n, bool shuffle, uint64_t seed,
                                                     int64_t epoch) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  if (!shuffle) {
    for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
    return perm;
  }
  // Same generator and call as PyTorch: g.manual_seed(seed + epoch); randperm(n, generator=g).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
  torch::Tensor t = torch::randperm(n, gen, torch::TensorOptions().dtype(torch::kLong));
  std::copy(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n, perm.begin());
  return perm;
}

void DistributedSampler::build() {
  std::vector<int64_t> perm = permutation(size_, options_.shuffle, options_.seed, epoch_);
  std::vector<int64_t> rest(perm.begin() + base_, perm.end());
  rest_len_ = static_cast<int64_t>(rest.size());
  const int64_t w = world_;
  int64_t total;
  if (options_.drop_last) {
    total = (rest_len_ / w) * w;
    rest.resize(static_cast<size_t>(total));
  } else {
    total = (rest_len_ + w - 1) / w * w;
    // Pad by repeating the head, as PyTorch does (several times if the rest is tiny).
    for (size_t i = 0; rest.size() < static_cast<size_t>(total); ++i) rest.push_back(rest[i]);
  }
  shard_.clear();
  for (int64_t i = rank_; i < total; i += w) shard_.push_back(rest[static_cast<size_t>(i)]);
  taken_ = 0;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  base_ = 0;
  build();
}

void DistributedSampler::restore(const SamplerPosition& position) {
  if (position.consumed < 0 || position.consumed > size_) {
    throw UsageError("DistributedSampler: saved position " + std::to_string(position.consumed) +
                     " is outside the data set of " + std::to_string(size_) +
                     " samples; was the checkpoint written for another data set?");
  }
  epoch_ = position.epoch;
  base_ = position.consumed;
  build();
}

SamplerPosition DistributedSampler::position() const {
  const int64_t used = std::min<int64_t>(taken_ * world_, rest_len_);
  // With drop_last the dropped tail counts as consumed once the shards are exhausted.
  const int64_t consumed = epoch_done() ? size_ : base_ + used;
  return SamplerPosition{epoch_, consumed};
}

int64_t DistributedSampler::batches_remaining(int64_t batch_size) const {
  if (batch_size < 1) throw UsageError("DistributedSampler: batch size must be at least 1");
  return (remaining() + batch_size - 1) / batch_size;
}

std::vector<int64_t> DistributedSampler::next_batch(int64_t batch_size) {
  if (batch_size < 1) throw UsageError("DistributedSampler: batch size must be at least 1");
  const int64_t n = std::min(batch_size, remaining());
  std::vector<int64_t> batch(shard_.begin() + taken_, shard_.begin() + taken_ + n);
  taken_ += n;
  return batch;
}

}  // namespace ddp
