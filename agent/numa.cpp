// NUMA binding: the rules of torch.numa.binding, on sysfs (agent/numa.h, docs/cli.md).
#include "agent/numa.h"

#include "agent/devices.h"

#include <dirent.h>
#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace ddp::agent {
namespace {

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<int> read_int(const std::string& path) {
  auto text = read_file(path);
  if (!text) return std::nullopt;
  try {
    return std::stoi(*text);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Entries of `dir` whose name is `prefix` followed by digits, as numbers.
std::vector<int> numbered_entries(const std::string& dir, const std::string& prefix) {
  std::vector<int> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string digits = name.substr(prefix.size());
      if (!std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
        continue;
      }
      out.push_back(std::atoi(digits.c_str()));
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\n") - b + 1);
}

// The smallest CPU of the cpulist in `path`, or `cpu` itself when the file is missing.
int smallest_sharing(const std::string& path, int cpu) {
  auto text = read_file(path);
  if (!text) return cpu;
  const Expected<std::set<int>> cpus = parse_cpu_list(*text);
  return !cpus || cpus->empty() ? cpu : *cpus->begin();
}

int device_node(const Topology& t, int local_rank, const std::vector<int>& cpu_nodes) {
  if (local_rank < static_cast<int>(t.device_nodes.size())) return t.device_nodes[local_rank];
  return cpu_nodes[local_rank % cpu_nodes.size()];
}

}  // namespace

std::optional<NumaMode> parse_numa_mode(const std::string& text) {
  if (text == "node") return NumaMode::kNode;
  if (text == "socket") return NumaMode::kSocket;
  if (text == "exclusive") return NumaMode::kExclusive;
  if (text == "core-complex") return NumaMode::kCoreComplex;
  return std::nullopt;
}

const char* numa_mode_name(NumaMode mode) {
  switch (mode) {
    case NumaMode::kNode: return "node";
    case NumaMode::kSocket: return "socket";
    case NumaMode::kExclusive: return "exclusive";
    case NumaMode::kCoreComplex: return "core-complex";
  }
  return "?";
}

Expected<std::set<int>> parse_cpu_list(const std::string& text) {
  std::set<int> cpus;
  const std::string s = trim(text);
  if (s.empty()) return cpus;
  std::stringstream items(s);
  for (std::string item; std::getline(items, item, ',');) {
    const auto dash = item.find('-');
    char* end = nullptr;
    const long first = std::strtol(item.c_str(), &end, 10);
    long last = first;
    if (dash != std::string::npos) {
      if (end != item.c_str() + dash) return unexpected("bad cpulist '" + s + "'");
      last = std::strtol(item.c_str() + dash + 1, &end, 10);
    }
    if (item.empty() || *end != '\0' || first < 0 || last < first || last >= CPU_SETSIZE) {
      return unexpected("bad cpulist '" + s + "'");
    }
    for (long c = first; c <= last; ++c) cpus.insert(static_cast<int>(c));
  }
  return cpus;
}

std::string cpu_list_string(const std::set<int>& cpus) {
  std::string out;
  for (auto it = cpus.begin(); it != cpus.end();) {
    const int first = *it;
    int last = first;
    for (++it; it != cpus.end() && *it == last + 1; ++it) last = *it;
    if (!out.empty()) out += ',';
    out += std::to_string(first);
    if (last != first) out += "-" + std::to_string(last);
  }
  return out;
}

Expected<Topology> read_topology(const std::string& sys_root, const std::string& proc_root,
                                 const std::set<int>& allowed, const char* cuda_visible_devices) {
  Topology t;
  const std::string node_dir = sys_root + "/devices/system/node";
  for (int node : numbered_entries(node_dir, "node")) {
    auto text = read_file(node_dir + "/node" + std::to_string(node) + "/cpulist");
    if (!text) continue;
    const Expected<std::set<int>> listed = parse_cpu_list(*text);
    if (!listed) return unexpected(node_dir + "/node" + std::to_string(node) + "/cpulist: " + listed.error());
    std::set<int> cpus;
    for (int cpu : *listed) {
      if (allowed.count(cpu) != 0) cpus.insert(cpu);
    }
    if (!cpus.empty()) t.node_cpus[node] = std::move(cpus);
  }
  if (t.node_cpus.empty()) {
    return unexpected("no NUMA node with a usable CPU under " + node_dir);
  }
  const std::string cpu_dir = sys_root + "/devices/system/cpu";
  for (const auto& [node, cpus] : t.node_cpus) {
    for (int cpu : cpus) {
      const std::string base = cpu_dir + "/cpu" + std::to_string(cpu);
      t.cpu_package[cpu] = read_int(base + "/topology/physical_package_id").value_or(0);
      t.cpu_core[cpu] = smallest_sharing(base + "/topology/thread_siblings_list", cpu);
      // The last-level cache: the cache index with the highest level.
      int best_level = -1;
      int complex = cpu;
      for (int index : numbered_entries(base + "/cache", "index")) {
        const std::string cache = base + "/cache/index" + std::to_string(index);
        const int level = read_int(cache + "/level").value_or(-1);
        if (level > best_level) {
          best_level = level;
          complex = smallest_sharing(cache + "/shared_cpu_list", cpu);
        }
      }
      t.cpu_complex[cpu] = complex;
    }
  }
  const int first_node = t.node_cpus.begin()->first;
  const auto gpus = visible_gpus(list_nvidia_gpus(proc_root + "/driver/nvidia/gpus"), cuda_visible_devices);
  for (const auto& gpu : gpus) {
    std::string lower = gpu.pci_address;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    // -1 (one-node machines) means node 0, as torch reads it.
    const int node = std::max(read_int(sys_root + "/bus/pci/devices/" + lower + "/numa_node").value_or(0), 0);
    t.device_nodes.push_back(t.node_cpus.count(node) != 0 ? node : first_node);
  }
  return t;
}

Expected<Topology> read_topology() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::set<int> allowed;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) allowed.insert(c);
    }
  }
  return read_topology("/sys", "/proc", allowed, std::getenv("CUDA_VISIBLE_DEVICES"));
}

Expected<std::vector<NumaBinding>> plan_numa_bindings(const Topology& t, NumaMode mode, int nproc) {
  std::vector<int> cpu_nodes;
  for (const auto& entry : t.node_cpus) cpu_nodes.push_back(entry.first);
  // Which "devices" (local ranks, or the machine's GPUs) share each node, for exclusive and
  // core-complex: torch divides a node among all devices on it.
  const int devices = t.device_nodes.empty() ? nproc : std::max<int>(t.device_nodes.size(), nproc);
  std::map<int, std::vector<int>> node_devices;
  for (int d = 0; d < devices; ++d) node_devices[device_node(t, d, cpu_nodes)].push_back(d);

  std::vector<NumaBinding> plan(nproc);
  for (int rank = 0; rank < nproc; ++rank) {
    const int node = device_node(t, rank, cpu_nodes);
    const std::set<int>& node_cpus = t.node_cpus.at(node);
    NumaBinding& b = plan[rank];
    b.memory_node = node;
    const auto& peers = node_devices[node];
    const int index = static_cast<int>(std::find(peers.begin(), peers.end(), rank) - peers.begin());
    const int count = static_cast<int>(peers.size());
    switch (mode) {
      case NumaMode::kNode:
        b.cpus = node_cpus;
        break;
      case NumaMode::kSocket: {
        const int package = t.cpu_package.at(*node_cpus.begin());
        for (const auto& [other, cpus] : t.node_cpus) {
          if (t.cpu_package.at(*cpus.begin()) == package) b.cpus.insert(cpus.begin(), cpus.end());
        }
        break;
      }
      case NumaMode::kExclusive:
      case NumaMode::kCoreComplex: {
        // Groups of CPUs (physical cores, or last-level-cache complexes) in CPU order.
        const auto& key = mode == NumaMode::kExclusive ? t.cpu_core : t.cpu_complex;
        std::map<int, std::set<int>> groups;
        for (int cpu : node_cpus) groups[key.at(cpu)].insert(cpu);
        std::vector<std::set<int>> ordered;
        for (auto& entry : groups) ordered.push_back(entry.second);
        const int n = static_cast<int>(ordered.size());
        if (mode == NumaMode::kCoreComplex) {
          b.cpus = ordered[index % n];  // a complex of its own when there are enough
          break;
        }
        if (n < count) {
          return unexpected("NUMA node " + std::to_string(node) + " has " + std::to_string(n) +
                            " usable physical cores for " + std::to_string(count) + " devices; use --numa_binding=node");
        }
        const int per = n / count;
        const int extra = n % count;
        const int start = index * per + std::min(index, extra);
        const int end = start + per + (index < extra ? 1 : 0);
        for (int g = start; g < end; ++g) b.cpus.insert(ordered[g].begin(), ordered[g].end());
        break;
      }
    }
  }
  return plan;
}

PreparedBinding prepare_binding(const NumaBinding& binding) {
  PreparedBinding p;
  CPU_ZERO(&p.cpus);
  std::memset(p.memory_mask, 0, sizeof p.memory_mask);
  p.enabled = !binding.cpus.empty();
  for (int cpu : binding.cpus) CPU_SET(cpu, &p.cpus);
  const int bits = static_cast<int>(sizeof p.memory_mask * 8);
  if (binding.memory_node >= 0 && binding.memory_node < bits) {
    p.memory_mask[binding.memory_node / (sizeof(unsigned long) * 8)] |=
        1UL << (binding.memory_node % (sizeof(unsigned long) * 8));
    p.has_memory_node = true;
  }
  return p;
}

void apply_numa_binding(const PreparedBinding& binding) noexcept {
  if (!binding.enabled) return;
  ::sched_setaffinity(0, sizeof binding.cpus, &binding.cpus);
  if (binding.has_memory_node) {
    // Preferred, not bound: a full node spills over instead of killing the worker.
    ::syscall(SYS_set_mempolicy, MPOL_PREFERRED, binding.memory_mask,
              sizeof binding.memory_mask * 8 + 1);
  }
}

}  // namespace ddp::agent
