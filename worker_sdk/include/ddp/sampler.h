// DistributedSampler: splits a data set of N samples among the ranks with PyTorch's
// semantics, plus a position that survives restarts, also at another world size.
#pragma once

#include <cstdint>
#include <vector>

namespace ddp {

// Where a sampler stands in an epoch. `consumed` counts positions of the epoch's global
// permutation that have been handed out by all ranks together, so it means the same thing at
// every world size. Saved in checkpoints by the Trainer.
struct SamplerPosition {
  int64_t epoch = 0;
  int64_t consumed = 0;  // in [0, dataset_size]
};

// One per rank; owned by the training loop; single-threaded.
//
// Layout (identical to torch.utils.data.DistributedSampler when consumed == 0):
//   perm     = shuffle ? randperm(N, generator seeded with seed + epoch) : 0..N-1
//   rest     = perm[consumed:]
//   rest     padded by repeating its head (drop_last=false) or truncated (drop_last=true)
//            to a multiple of world_size
//   shard(r) = rest[r::world_size]
// Every rank takes batches from the front of its own shard; after each rank has taken t
// samples, the first t*world_size positions of `rest` are used, so the global position is
// consumed + min(t*world_size, len(rest)). Resuming from that position with another world
// size hands out exactly the samples not used yet.
class DistributedSampler {
 public:
  struct Options {
    bool shuffle = true;    // default true, as in PyTorch
    uint64_t seed = 0;      // default 0
    bool drop_last = false; // default false: pad to equal shards instead
  };

  // REQUIRES: 0 <= rank < world_size.
  DistributedSampler(int64_t dataset_size, int rank, int world_size, Options options);

  // Starts epoch `epoch` from its first sample.
  void set_epoch(int64_t epoch);
  // Continues an epoch from a saved position (any world size may have saved it).
  // Throws ddp::UsageError when position.consumed is outside [0, dataset_size].
  void restore(const SamplerPosition& position);

  // The position to save now.
  SamplerPosition position() const;

  // This rank's whole shard for the current epoch from where the epoch (re)started;
  // PyTorch's list(iter(sampler)) when the epoch started at 0.
  const std::vector<int64_t>& shard() const { return shard_; }
  // Samples left for this rank in this epoch.
  int64_t remaining() const { return static_cast<int64_t>(shard_.size()) - taken_; }
  bool epoch_done() const { return remaining() == 0; }
  // Number of batches of `batch_size` this rank still has (the last one may be short).
  int64_t batches_remaining(int64_t batch_size) const;

  // Takes this rank's next batch (up to batch_size samples; empty at the end of the epoch).
  // Every rank must call it the same number of times: shards have equal length, so they do.
  std::vector<int64_t> next_batch(int64_t batch_size);

  int64_t dataset_size() const { return size_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int64_t epoch() const { return epoch_; }

  // The epoch's global permutation (exposed for tests and tools).
  static std::vector<int64_t> permutation(int64_t dataset_size, bool shuffle, uint64_t seed,
                                          int64_t epoch);

 private:
  void build();

  int64_t size_;
  int rank_;
  int world_;
  Options options_;
  int64_t epoch_ = 0;
  int64_t base_ = 0;       // global position where the current layout starts
  int64_t rest_len_ = 0;   // N - base_ (real samples left when the layout was built)
  std::vector<int64_t> shard_;
  int64_t taken_ = 0;
};

}  // namespace ddp
