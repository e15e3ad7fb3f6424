// NUMA binding of workers (torchrun 2.x --numa-binding): each local rank runs on the CPUs, and
// allocates from the memory, of the NUMA node its accelerator sits on. The topology comes from
// sysfs (no libnuma, no driver calls); the plan is made once by the launcher, and each child
// applies its binding between fork and exec (apply_numa_binding(), async-signal-safe).
//
// Plain data and pure functions except read_topology() (reads files) and apply_numa_binding()
// (two system calls). Any thread.
#pragma once

#include <sched.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rendezvous/error.h"

namespace ddp::agent {

// torch.numa.binding.AffinityMode.
enum class NumaMode {
  kNode,         // every CPU of the device's NUMA node
  kSocket,       // every CPU of the NUMA nodes of the device's socket
  kExclusive,    // the node's physical cores split evenly among the node's devices
  kCoreComplex,  // one L3-sharing group of cores of the node per device
};

// "node", "socket", "exclusive", "core-complex" (torchrun's spellings); nullopt otherwise.
std::optional<NumaMode> parse_numa_mode(const std::string& text);
const char* numa_mode_name(NumaMode mode);

// What sysfs says about the CPUs this process may use.
struct Topology {
  std::map<int, std::set<int>> node_cpus;  // NUMA node -> allowed CPUs (nodes without any: absent)
  std::map<int, int> cpu_package;          // CPU -> physical_package_id (socket)
  std::map<int, int> cpu_core;             // CPU -> smallest CPU sharing its physical core
  std::map<int, int> cpu_complex;          // CPU -> smallest CPU sharing its last-level cache
  // NUMA node of each visible accelerator, in CUDA device order (NVIDIA GPUs from
  // /proc/driver/nvidia/gpus, narrowed by CUDA_VISIBLE_DEVICES). Empty on a CPU-only machine.
  std::vector<int> device_nodes;
};

// Reads the topology under `sys_root` (normally "/sys") and `proc_root` ("/proc"), keeping the
// CPUs in `allowed` (this process's affinity). `cuda_visible_devices` nullptr = unset.
// Refused when sysfs holds no NUMA node with an allowed CPU, or a node's cpulist is malformed.
Expected<Topology> read_topology(const std::string& sys_root, const std::string& proc_root,
                                 const std::set<int>& allowed, const char* cuda_visible_devices);
// The same for this machine and process.
Expected<Topology> read_topology();

// Where one worker runs. An empty `cpus` means "no binding".
struct NumaBinding {
  std::set<int> cpus;
  int memory_node = -1;  // preferred memory node; -1 = leave the memory policy alone
};

// The binding of each local rank 0..nproc-1. Local rank r uses device r; without
// accelerators (or past the last one), local ranks go round-robin over the NUMA nodes that
// have allowed CPUs. Refused, saying why and what to use instead, when a mode cannot be satisfied
// (exclusive with fewer physical cores than devices on a node).
Expected<std::vector<NumaBinding>> plan_numa_bindings(const Topology& topology, NumaMode mode, int nproc);

// "0-3,8" for {0,1,2,3,8} (the sysfs cpulist format).
std::string cpu_list_string(const std::set<int>& cpus);
// Parses the sysfs cpulist format ("0-3,8\n"); refuses anything else.
Expected<std::set<int>> parse_cpu_list(const std::string& text);

// The binding in the form the child applies without allocating.
struct PreparedBinding {
  bool enabled = false;
  cpu_set_t cpus{};
  unsigned long memory_mask[16] = {};  // 1024 nodes
  bool has_memory_node = false;
};
PreparedBinding prepare_binding(const NumaBinding& binding);

// In the child between fork and exec: sched_setaffinity and set_mempolicy(MPOL_PREFERRED).
// Async-signal-safe; errors are ignored (the worker then runs unbound, as torchrun's
// fallback does), so a container that forbids set_mempolicy still starts its workers.
void apply_numa_binding(const PreparedBinding& binding) noexcept;

}  // namespace ddp::agent
