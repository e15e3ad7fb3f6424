#include "ddp/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#ifdef DDP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <thread>

#include "ddp/checkpoint.h"
#include "ddp/error.h"
#include "ddp/progress.h"
#include "standby.h"

namespace ddp {
namespace {

// libtorch 2.0 split the collective implementations (Backend) from the ProcessGroup
// front-end; ProcessGroupGloo and ProcessGroupNCCL derive from Backend there and from
// ProcessGroup in 1.x. Both bases declare the collectives we call.
#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

std::string where(const WorkerEnv& env) {
  return "rank " + std::to_string(env.rank) + "/" + std::to_string(env.world_size) +
         ", store " + env.master_addr + ":" + std::to_string(env.master_port);
}

// The interface Gloo binds to: GLOO_SOCKET_IFNAME when set (as in PyTorch); loopback when the
// master is on loopback (a single node); otherwise the address this host's name resolves to.
std::shared_ptr<::gloo::transport::Device> gloo_device(const WorkerEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// Waits, at most until `deadline`, for host:port to accept a TCP connection; true once it does.
//
// A client rank usually gets its assignment before rank 0 has made the store's listening socket
// (they start together). libtorch's TCPStore client takes the refused connection for a server
// not yet up and sleeps before it tries again: about 0.5-1 s in libtorch 1.13, measured in the
// namespace cluster, which was most of a restart. Probing every few milliseconds first makes the
// store's own connect succeed at once. Nothing is sent on the probe's connection.
bool wait_until_listening(const std::string& host, int port, std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  constexpr auto kPause = std::chrono::milliseconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    for (const addrinfo* a = addresses.get(); a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) return false;
      bool up = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      if (!up && errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1000))) == 1) {
          int error = 0;
          socklen_t length = sizeof error;
          up = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
        }
      }
      ::close(fd);
      if (up) return true;
    }
    std::this_thread::sleep_for(kPause);
  }
  return false;
}

}  // namespace

struct PendingWork::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  std::string what;
  std::chrono::milliseconds timeout;
  bool sliced = false;  // Gloo: wait in slices, looking at the agent's abandoned-round word
};

PendingWork::PendingWork() = default;
PendingWork::~PendingWork() = default;
PendingWork::PendingWork(PendingWork&&) noexcept = default;
PendingWork& PendingWork::operator=(PendingWork&&) noexcept = default;
PendingWork::PendingWork(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {

// The slice of a Gloo wait between looks at the agent's word (docs/worker-sdk.md, "An abandoned
// round"): short against a restart, long against the cost of a look (one atomic load).
constexpr std::chrono::milliseconds kWaitSlice{20};

// The round was abandoned by the agent while this worker waits for `what`: the collective has a
// failed peer and will not complete, so the step cannot be finished. SIGTERM's default action,
// which the Trainer's handler deferred to the end of the step, is taken now, once a checkpoint
// write in flight on a background thread (checkpoint_async) has completed.
[[noreturn]] void die_of_abandoned_round(const std::string& what) {
  const std::string line = "[ddp] " + what + ": the agent abandoned the round (a peer failed) while this "
                           "worker waited for it; exiting at once, nothing saved\n";
  (void)!::write(STDERR_FILENO, line.data(), line.size());
  AsyncCheckpointWriter::wait_for_all();
  ::signal(SIGTERM, SIG_DFL);
  ::raise(SIGTERM);
  ::_exit(128 + SIGTERM);  // SIGTERM blocked in this thread: the same exit status by hand
}

}  // namespace

void PendingWork::wait() {
  if (!impl_ || !impl_->work) return;
  auto work = std::move(impl_->work);
  try {
    if (!impl_->sliced) {
      if (!work->wait(impl_->timeout)) {
        throw CommError(impl_->what + ": did not complete within " +
                        std::to_string(impl_->timeout.count()) + " ms");
      }
      return;
    }
    // c10d's Work::wait(timeout) throws when the time runs out before the work completes; a
    // completed work's own error is raised by the unbounded wait below.
    const auto deadline = std::chrono::steady_clock::now() + impl_->timeout;
    Progress& progress = Progress::instance();
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        throw CommError(impl_->what + ": did not complete within " +
                        std::to_string(impl_->timeout.count()) + " ms");
      }
      try {
        if (work->wait(std::min(left, kWaitSlice))) return;
      } catch (const std::exception&) {
        if (work->isCompleted()) {
          work->wait();  // no timeout: the work's own outcome, rethrowing its error
          return;
        }
      }
      if (progress.round_abandoned()) {
        if (detail::parking_allowed()) {
          throw RoundAbandoned(impl_->what + ": the agent abandoned the round (a peer failed)");
        }
        die_of_abandoned_round(impl_->what);
      }
    }
  } catch (const ddp::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(impl_->what + ": " + e.what());
  }
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<BackendBase> backend;
  std::string name = "none";
};

ProcessGroup::ProcessGroup(WorkerEnv env, ProcessGroupOptions options)
    : env_(std::move(env)), options_(options), impl_(std::make_unique<Impl>()) {}

ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::from_environment(const ProcessGroupOptions& options) {
  return create(WorkerEnv::from_environment(), options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const WorkerEnv& env,
                                                   const ProcessGroupOptions& options) {
  std::shared_ptr<ProcessGroup> group(new ProcessGroup(env, options));
  group->connect();
  return group;
}

void ProcessGroup::reconnect(const WorkerEnv& env) {
  // The old backend may hold a collective that never completes (its peer failed), and destroying
  // it would join the threads that wait for it. It is kept instead, never destroyed: a few
  // threads and buffers per in-memory restart, for the rest of the process.
  static auto* kept = new std::vector<std::unique_ptr<Impl>>();
  kept->push_back(std::move(impl_));
  impl_ = std::make_unique<Impl>();
  env_ = env;
  device_ = torch::Device(torch::kCPU);
  connect();
}

void ProcessGroup::connect() {
  const WorkerEnv& env = env_;
  const ProcessGroupOptions& options = options_;
  Backend backend = options.backend;
  bool gpu = false;
#ifdef DDP_WITH_NCCL
  gpu = torch::cuda::is_available() && env.local_rank < static_cast<int>(torch::cuda::device_count());
#endif
  if (backend == Backend::kAuto) backend = gpu ? Backend::kNccl : Backend::kGloo;
  if (backend == Backend::kNccl && !gpu) {
#ifdef DDP_WITH_NCCL
    throw UsageError("process group: NCCL requested but no GPU for LOCAL_RANK " +
                     std::to_string(env.local_rank) + " is visible");
#else
    throw UsageError("process group: NCCL requested but this libtorch was built without CUDA; "
                     "use Backend::kGloo");
#endif
  }
  if (backend == Backend::kNccl) device_ = torch::Device(torch::kCUDA, env.local_rank);
  if (!env.distributed()) return;

  const bool store_server = env.rank == 0 && !env.use_agent_store;
  if (!store_server) {
    // On a timeout, TCPStore below tries once more and reports the failure in its own words.
    wait_until_listening(env.master_addr, env.master_port,
                         std::chrono::steady_clock::now() + options.connect_timeout);
  }
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(env.master_port);
    store_options.isServer = store_server;
    store_options.numWorkers = env.use_agent_store ? c10::nullopt
                                                   : c10::optional<std::size_t>(env.world_size);
    store_options.waitWorkers = false;  // the backend's own rendezvous waits for every rank
    store_options.timeout = options.connect_timeout;
    c10::intrusive_ptr<c10d::Store> tcp =
        c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
    // A fresh key space per start of the worker group, so a restarted group on a long-lived
    // agent store never reads the keys of the previous one (torchrun's convention).
    const std::string prefix =
        "/worker/attempt_" + std::to_string(env.generation ? *env.generation : env.restart_count);
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
    impl_->store->setTimeout(options.connect_timeout);
  } catch (const std::exception& e) {
    throw CommError("process group: connecting to the store failed (" + where(env) + ", " +
                    std::to_string(options.connect_timeout.count() / 1000) + " s): " + e.what());
  }

  try {
    if (backend == Backend::kGloo) {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
      gloo_options->devices.push_back(gloo_device(env));
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          impl_->store, env.rank, env.world_size, gloo_options);
      impl_->name = "gloo";
    } else {
#ifdef DDP_WITH_NCCL
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options.timeout;
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          impl_->store, env.rank, env.world_size, nccl_options);
      impl_->name = "nccl";
#endif
    }
    impl_->store->setTimeout(options.timeout);
  } catch (const std::exception& e) {
    throw CommError("process group: creating the " +
                    std::string(backend == Backend::kGloo ? "gloo" : "nccl") +
                    " backend failed (" + where(env) + "): " + e.what());
  }
}

std::string ProcessGroup::backend_name() const { return impl_->name; }

PendingWork ProcessGroup::allreduce_sum_async(torch::Tensor tensor) {
  if (!impl_->backend) return PendingWork();
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  auto impl = std::make_unique<PendingWork::Impl>();
  try {
    impl->work = impl_->backend->allreduce(tensors, opts);
  } catch (const std::exception& e) {
    throw CommError("allreduce (rank " + std::to_string(rank()) + "): " + e.what());
  }
  impl->what = "allreduce (rank " + std::to_string(rank()) + ")";
  impl->timeout = options_.timeout;
  impl->sliced = impl_->name == "gloo";
  return PendingWork(std::move(impl));
}

void ProcessGroup::allreduce_sum(torch::Tensor tensor) { allreduce_sum_async(std::move(tensor)).wait(); }

void ProcessGroup::allreduce_max(torch::Tensor tensor) {
  if (!impl_->backend) return;
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  auto impl = std::make_unique<PendingWork::Impl>();
  try {
    impl->work = impl_->backend->allreduce(tensors, opts);
  } catch (const std::exception& e) {
    throw CommError("allreduce max (rank " + std::to_string(rank()) + "): " + e.what());
  }
  impl->what = "allreduce max (rank " + std::to_string(rank()) + ")";
  impl->timeout = options_.timeout;
  impl->sliced = impl_->name == "gloo";
  PendingWork(std::move(impl)).wait();
}

void ProcessGroup::broadcast(torch::Tensor tensor, int root) {
  if (!impl_->backend) return;
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  auto impl = std::make_unique<PendingWork::Impl>();
  try {
    impl->work = impl_->backend->broadcast(tensors, opts);
  } catch (const std::exception& e) {
    throw CommError("broadcast (rank " + std::to_string(rank()) + "): " + e.what());
  }
  impl->what = "broadcast from rank " + std::to_string(root) + " (rank " +
               std::to_string(rank()) + ")";
  impl->timeout = options_.timeout;
  impl->sliced = impl_->name == "gloo";
  PendingWork(std::move(impl)).wait();
}

void ProcessGroup::barrier() {
  if (!impl_->backend) return;
  auto impl = std::make_unique<PendingWork::Impl>();
  try {
    impl->work = impl_->backend->barrier(c10d::BarrierOptions());
  } catch (const std::exception& e) {
    throw CommError("barrier (rank " + std::to_string(rank()) + "): " + e.what());
  }
  impl->what = "barrier (rank " + std::to_string(rank()) + ")";
  impl->timeout = options_.timeout;
  impl->sliced = impl_->name == "gloo";
  PendingWork(std::move(impl)).wait();
}

}  // namespace ddp
