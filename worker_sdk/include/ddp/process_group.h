// The store and the collective backend of one worker: Gloo on CPU, NCCL on GPUs.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "ddp/env.h"

namespace ddp {

enum class Backend {
  kAuto,  // NCCL when this libtorch has CUDA and a GPU is visible, Gloo otherwise
  kGloo,
  kNccl,
};

struct ProcessGroupOptions {
  Backend backend = Backend::kAuto;  // default kAuto
  // Deadline of every collective and of the store (connect, rendezvous); default 30 min,
  // PyTorch's default. Expiry throws ddp::CommError.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Deadline for connecting to the store and meeting all ranks; default 300 s.
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(300);
};

// A handle on an in-flight collective. Movable; wait() at most once.
class PendingWork {
 public:
  PendingWork();
  ~PendingWork();
  PendingWork(PendingWork&&) noexcept;
  PendingWork& operator=(PendingWork&&) noexcept;

  // Blocks until done or the group's timeout; throws ddp::CommError naming the operation.
  // A default-constructed or single-process handle returns at once.
  void wait();

  struct Impl;
  explicit PendingWork(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// The process group of this worker. Create one per process (it opens sockets and threads);
// share it through shared_ptr. Collectives are called from the training thread in the same
// order on every rank (the backend matches them by order). With world size 1 there is no
// store and every collective is a no-op on its input.
class ProcessGroup {
 public:
  // Connects to the store at MASTER_ADDR:MASTER_PORT and meets every rank.
  // Throws ddp::CommError (with the address, rank and timeout) when that fails.
  static std::shared_ptr<ProcessGroup> create(const WorkerEnv& env,
                                              const ProcessGroupOptions& options = {});
  // WorkerEnv::from_environment() + create().
  static std::shared_ptr<ProcessGroup> from_environment(const ProcessGroupOptions& options = {});

  // Leaves this group and joins the one `env` describes, in place (every holder of this object
  // sees the new rank, world size and backend): the Trainer's in-memory restart, after the
  // agent's next assignment. The old group's collectives are abandoned, not completed. Throws
  // as create() does.
  void reconnect(const WorkerEnv& env);

  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const WorkerEnv& env() const { return env_; }
  // cpu, or cuda:LOCAL_RANK with NCCL.
  torch::Device device() const { return device_; }
  std::string backend_name() const;  // "gloo", "nccl" or "none" (single process)
  std::chrono::milliseconds timeout() const { return options_.timeout; }

  // In-place sum over all ranks. The tensor must stay alive until wait() returns.
  PendingWork allreduce_sum_async(torch::Tensor tensor);
  void allreduce_sum(torch::Tensor tensor);
  void allreduce_max(torch::Tensor tensor);
  // In-place broadcast from root.
  void broadcast(torch::Tensor tensor, int root = 0);
  void barrier();

  struct Impl;

 private:
  ProcessGroup(WorkerEnv env, ProcessGroupOptions options);
  void connect();  // the store and the backend for env_ and options_
  WorkerEnv env_;
  ProcessGroupOptions options_;
  torch::Device device_{torch::kCPU};
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddp
