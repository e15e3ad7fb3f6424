// What this machine offers the workers: NVIDIA GPUs (from the driver's /proc files, no libtorch,
// no driver calls) narrowed by CUDA_VISIBLE_DEVICES as the CUDA runtime reads it, and the CPUs
// this process may run on. Used by the launcher (--nproc_per_node=gpu|auto|cpu) and by the NUMA
// binding (agent/numa.h); the node fingerprint lists GPUs by the same rules.
//
// Functions only; each reads the file system when called. Any thread.
#pragma once

#include <string>
#include <vector>

namespace ddp::agent {

// One NVIDIA GPU as /proc/driver/nvidia/gpus/<pci address>/information describes it.
struct GpuInfo {
  std::string pci_address;  // "0000:3b:00.0", the directory name
  std::string model;        // "Model:" line, "" when unreadable
  std::string uuid;         // "GPU UUID:" line, "" when unreadable
};

// The GPUs under `nvidia_gpus_dir` (normally /proc/driver/nvidia/gpus), in PCI bus order, which
// is CUDA's device order for GPUs of one model. Empty when the directory is missing.
std::vector<GpuInfo> list_nvidia_gpus(const std::string& nvidia_gpus_dir);

// The GPUs of `all` that CUDA_VISIBLE_DEVICES leaves visible, in its order: unset (nullptr) =
// all; "" = none; a comma list of indices or GPU-/MIG- UUID prefixes, cut at the first entry
// that is invalid (out of range, negative, repeated, not a number, an unknown UUID).
std::vector<GpuInfo> visible_gpus(const std::vector<GpuInfo>& all, const char* cuda_visible_devices);

// How many of `physical` GPUs CUDA_VISIBLE_DEVICES leaves visible (the rule above; UUIDs are
// counted without checking them against the GPUs).
int apply_cuda_visible_devices(int physical, const char* cuda_visible_devices);

// GPUs this process may use: entries of `proc_gpus_dir`, else /dev/nvidia<N> nodes in `dev_dir`,
// narrowed by `cuda_visible_devices` (nullptr = unset).
int count_visible_gpus(const std::string& proc_gpus_dir, const std::string& dev_dir,
                       const char* cuda_visible_devices);
// The same for this machine and this process's CUDA_VISIBLE_DEVICES.
int count_visible_gpus();

// CPUs this process may run on (its affinity mask), at least 1.
int count_usable_cpus();

}  // namespace ddp::agent
