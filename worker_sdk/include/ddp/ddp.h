// DistributedDataParallel: keeps one model identical on every rank by averaging gradients.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "ddp/process_group.h"

namespace ddp {

struct DdpOptions {
  // Gradients are packed, in reverse registration order, into buckets that are closed once
  // they hold at least this many bytes (as PyTorch does); each bucket's all-reduce starts as
  // soon as backward has produced all of its gradients. Default 25 MiB, as in PyTorch.
  size_t bucket_cap_bytes = 25u * 1024u * 1024u;
  // The first bucket (the last layers, whose gradients backward produces first) closes at
  // min(this, bucket_cap_bytes), so communication starts early in backward. Default 1 MiB,
  // as PyTorch's first bucket.
  size_t first_bucket_cap_bytes = 1024u * 1024u;
  // Broadcast buffers (e.g. BatchNorm statistics) from rank 0 at construction. Default true.
  bool broadcast_buffers = true;
};

// Time spent by synchronize() waiting for all-reduces, i.e. communication that backward did
// not hide. Reset by reset_stats().
struct DdpStats {
  int64_t syncs = 0;
  double exposed_sync_seconds = 0;  // wall time inside synchronize()
};

// Wraps a module that the caller owns (shared). Construction compares the parameter set of
// all ranks (shapes and dtypes, in order) and throws ddp::MismatchError when they differ, then
// broadcasts parameters (and buffers) from rank 0. It registers a gradient hook on every
// parameter; the destructor removes them. Use from the training thread only:
//
//   ddp.backward(loss);            // loss.backward() + synchronize()
//   optimizer.step();
//
// or `loss.backward(); ddp.synchronize();`. Inside `auto guard = ddp.no_sync();` gradients
// only accumulate locally; the first backward outside it averages the accumulated total.
// Parameters that get no gradient in a step count as zero gradient on that rank.
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          std::shared_ptr<ProcessGroup> group, DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  ProcessGroup& group() { return *group_; }

  void backward(const torch::Tensor& loss);
  // Waits for every bucket and writes the averaged gradients into the parameters' .grad.
  // Launches buckets whose parameters got no gradient. Throws ddp::CommError on failure.
  void synchronize();

  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel* ddp) : ddp_(ddp) { ddp_->sync_enabled_ = false; }
    ~NoSyncGuard() { if (ddp_) ddp_->sync_enabled_ = true; }
    NoSyncGuard(NoSyncGuard&& other) noexcept : ddp_(other.ddp_) { other.ddp_ = nullptr; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    DistributedDataParallel* ddp_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(this); }

  size_t bucket_count() const { return buckets_.size(); }
  DdpStats stats() const { return stats_; }
  void reset_stats() { stats_ = DdpStats(); }

 private:
  struct Slot {
    size_t bucket;
    int64_t offset;  // in elements within the bucket's flat buffer
    int64_t numel;
  };
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    torch::Tensor flat;
    size_t ready = 0;
    bool launched = false;
    PendingWork work;
  };

  void check_parameter_sets();
  void broadcast_from_rank0(std::vector<torch::Tensor> tensors);
  void on_gradient(size_t index, const torch::Tensor& grad);
  void launch_ready_buckets();  // REQUIRES: mutex_ held
  void launch(Bucket& bucket);

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DdpOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<unsigned> hook_ids_;
  std::vector<Slot> slots_;
  std::vector<bool> param_ready_;
  std::vector<Bucket> buckets_;
  size_t next_bucket_ = 0;  // buckets launch strictly in order: the backend matches by order
  bool pending_ = false;    // a synced backward ran and synchronize() has not yet
  bool sync_enabled_ = true;
  std::mutex mutex_;  // guards the bucket state; hooks may run on an autograd thread
  DdpStats stats_;
};

}  // namespace ddp
