#include "ddp/ddp.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "ddp/error.h"

namespace ddp {
namespace {

std::string signature(const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  std::ostringstream out;
  for (const auto& [name, t] : named) {
    out << name << ":" << t.sizes() << ":" << t.dtype() << ";";
  }
  return out.str();
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DdpOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  if (!module_ || !group_) throw UsageError("DistributedDataParallel: null module or group");
  for (auto& p : module_->parameters()) {
    if (p.requires_grad()) params_.push_back(p);
  }
  check_parameter_sets();
  {
    torch::NoGradGuard no_grad;
    broadcast_from_rank0(params_);
    if (options_.broadcast_buffers) broadcast_from_rank0(module_->buffers());
  }

  // Buckets in reverse registration order: backward produces the last layers' gradients
  // first, so the first bucket fills first. A bucket closes once it reaches its cap (the
  // small first cap, then bucket_cap_bytes) or when the dtype changes.
  slots_.resize(params_.size());
  param_ready_.assign(params_.size(), false);
  size_t bucket_bytes = 0;
  bool open = false;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const bool same_kind =
        open && params_[buckets_.back().params.front()].scalar_type() == p.scalar_type();
    if (!same_kind) {
      buckets_.emplace_back();
      bucket_bytes = 0;
      open = true;
    }
    buckets_.back().params.push_back(k);
    bucket_bytes += static_cast<size_t>(p.numel()) * p.element_size();
    const size_t cap = buckets_.size() == 1
                           ? std::min(options_.first_bucket_cap_bytes, options_.bucket_cap_bytes)
                           : options_.bucket_cap_bytes;
    if (bucket_bytes >= cap) open = false;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    int64_t offset = 0;
    for (size_t k : buckets_[b].params) {
      slots_[k] = Slot{b, offset, params_[k].numel()};
      offset += params_[k].numel();
    }
    buckets_[b].flat = torch::zeros({offset}, params_[buckets_[b].params.front()].options());
  }
  // One process needs no averaging: no hooks, and synchronize() has nothing to do.
  for (size_t k = 0; group_->world_size() > 1 && k < params_.size(); ++k) {
    hook_ids_.push_back(params_[k].register_hook([this, k](torch::Tensor grad) {
      on_gradient(k, grad);
    }));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t k = 0; k < hook_ids_.size(); ++k) {
    try {
      params_[k].remove_hook(hook_ids_[k]);
    } catch (...) {
      // A parameter whose autograd meta is gone has no hook left to remove.
    }
  }
  // Never leave a collective in flight on destruction: its buffers die with us.
  for (auto& b : buckets_) {
    try {
      b.work.wait();
    } catch (...) {
    }
  }
}

void DistributedDataParallel::check_parameter_sets() {
  if (group_->world_size() == 1) return;
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& item : module_->named_parameters()) {
    if (item.value().requires_grad()) named.emplace_back(item.key(), item.value());
  }
  const std::string mine = signature(named);
  // Rank 0's signature goes to everyone; each rank compares; a per-rank flag vector tells
  // every rank who differs, so they all throw the same error instead of hanging later.
  auto length = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong);
  group_->broadcast(length, 0);
  auto bytes = torch::zeros({length.item<int64_t>()}, torch::kUInt8);
  if (group_->rank() == 0) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  group_->broadcast(bytes, 0);
  const std::string reference(static_cast<const char*>(bytes.data_ptr()),
                              static_cast<size_t>(bytes.numel()));
  auto flags = torch::zeros({group_->world_size()}, torch::kInt);
  if (reference != mine) flags[group_->rank()] = 1;
  group_->allreduce_sum(flags);
  std::string differing;
  for (int r = 0; r < group_->world_size(); ++r) {
    if (flags[r].item<int>() != 0) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (differing.empty()) return;
  std::string detail;
  if (reference != mine) {
    detail = "; this rank (" + std::to_string(group_->rank()) + ") has " +
             std::to_string(named.size()) + " parameters: " + mine.substr(0, 400) +
             " while rank 0 has: " + reference.substr(0, 400);
  }
  throw MismatchError("DistributedDataParallel: the parameter set (names, shapes, dtypes) of "
                      "rank(s) " + differing + " differs from rank 0's; every rank must build "
                      "the same model" + detail);
}

void DistributedDataParallel::broadcast_from_rank0(std::vector<torch::Tensor> tensors) {
  if (group_->world_size() == 1 || tensors.empty()) return;
  // Coalesce per dtype into flat buffers of at most bucket_cap_bytes: fewer collectives.
  size_t i = 0;
  while (i < tensors.size()) {
    std::vector<torch::Tensor> chunk{tensors[i]};
    size_t bytes = tensors[i].numel() * tensors[i].element_size();
    size_t j = i + 1;
    while (j < tensors.size() && tensors[j].scalar_type() == tensors[i].scalar_type() &&
           bytes + tensors[j].numel() * tensors[j].element_size() <= options_.bucket_cap_bytes) {
      bytes += tensors[j].numel() * tensors[j].element_size();
      chunk.push_back(tensors[j]);
      ++j;
    }
    std::vector<torch::Tensor> flat_views;
    for (auto& t : chunk) flat_views.push_back(t.reshape({-1}));
    auto flat = torch::cat(flat_views);
    group_->broadcast(flat, 0);
    int64_t offset = 0;
    for (auto& t : chunk) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
    i = j;
  }
}

void DistributedDataParallel::on_gradient(size_t index, const torch::Tensor& grad) {
  if (!sync_enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (param_ready_[index]) {
    // The parameter was used twice in one graph: its hook fires per use. Add to the slot.
    const Slot& s = slots_[index];
    buckets_[s.bucket].flat.narrow(0, s.offset, s.numel).add_(grad.reshape({-1}),
                                                                1.0 / group_->world_size());
    return;
  }
  pending_ = true;
  const Slot& s = slots_[index];
  auto view = buckets_[s.bucket].flat.narrow(0, s.offset, s.numel);
  const auto& param = params_[index];
  torch::NoGradGuard no_grad;
  // The hook sees this backward's gradient before it is accumulated into .grad; the value
  // to average is what .grad is about to become (accumulated after no_sync() steps).
  if (param.grad().defined()) {
    torch::add_out(view, param.grad().reshape({-1}), grad.reshape({-1}));
    view.div_(group_->world_size());
  } else {
    torch::div_out(view, grad.reshape({-1}), group_->world_size());
  }
  param_ready_[index] = true;
  Bucket& bucket = buckets_[s.bucket];
  bucket.ready += 1;
  launch_ready_buckets();
}

void DistributedDataParallel::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].ready == buckets_[next_bucket_].params.size()) {
    launch(buckets_[next_bucket_]);
    ++next_bucket_;
  }
}

void DistributedDataParallel::launch(Bucket& bucket) {
  bucket.launched = true;
  bucket.work = group_->allreduce_sum_async(bucket.flat);
}

void DistributedDataParallel::backward(const torch::Tensor& loss) {
  loss.backward();
  synchronize();
}

void DistributedDataParallel::synchronize() {
  if (!sync_enabled_) return;  // inside no_sync(): nothing to average yet
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_) return;  // no synced backward since the last synchronize()
  const auto start = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  // Parameters without a gradient this step: contribute what .grad holds (zero if none).
  for (size_t k = 0; k < params_.size(); ++k) {
    if (param_ready_[k]) continue;
    const Slot& s = slots_[k];
    auto view = buckets_[s.bucket].flat.narrow(0, s.offset, s.numel);
    if (params_[k].grad().defined()) {
      torch::div_out(view, params_[k].grad().reshape({-1}), group_->world_size());
    } else {
      view.zero_();
    }
    param_ready_[k] = true;
    buckets_[s.bucket].ready += 1;
  }
  launch_ready_buckets();
  for (auto& bucket : buckets_) bucket.work.wait();
  for (size_t k = 0; k < params_.size(); ++k) {
    const Slot& s = slots_[k];
    auto averaged = buckets_[s.bucket].flat.narrow(0, s.offset, s.numel).view(params_[k].sizes());
    auto& grad = params_[k].mutable_grad();
    if (grad.defined()) {
      grad.copy_(averaged);
    } else {
      grad = averaged.clone();
    }
    param_ready_[k] = false;
  }
  for (auto& bucket : buckets_) {
    bucket.ready = 0;
    bucket.launched = false;
  }
  next_bucket_ = 0;
  pending_ = false;
  stats_.syncs += 1;
  stats_.exposed_sync_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace ddp
