// Unit tests of agent/numa.h and agent/devices.h on fake sysfs/procfs trees: the topology is
// read as the kernel lays it out, and each --numa_binding mode gives each local rank the CPUs
// torch.numa.binding would.
#include <doctest/doctest.h>

#include <sched.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "agent/devices.h"
#include "agent/numa.h"

namespace fs = std::filesystem;
using namespace ddp::agent;

namespace {

// A temporary root holding sys/ and proc/ trees; removed at the end of the test.
class FakeRoot {
 public:
  FakeRoot() : root_(fs::temp_directory_path() / ("ddplaunch-numa-" + std::to_string(::getpid()) +
                                                  "-" + std::to_string(counter_++))) {
    fs::remove_all(root_);
  }
  ~FakeRoot() { fs::remove_all(root_); }
  void write(const std::string& path, const std::string& text) {
    const fs::path p = root_ / path;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  // A CPU: its NUMA node membership is written by node(), this writes its topology.
  void cpu(int cpu, int package, const std::string& siblings, const std::string& l3) {
    const std::string base = "sys/devices/system/cpu/cpu" + std::to_string(cpu);
    write(base + "/topology/physical_package_id", std::to_string(package) + "\n");
    write(base + "/topology/thread_siblings_list", siblings + "\n");
    write(base + "/cache/index0/level", "1\n");
    write(base + "/cache/index0/shared_cpu_list", siblings + "\n");
    write(base + "/cache/index3/level", "3\n");
    write(base + "/cache/index3/shared_cpu_list", l3 + "\n");
  }
  void node(int node, const std::string& cpulist) {
    write("sys/devices/system/node/node" + std::to_string(node) + "/cpulist", cpulist + "\n");
  }
  void gpu(const std::string& pci, int numa_node, const std::string& uuid) {
    write("proc/driver/nvidia/gpus/" + pci + "/information", "Model: \t NVIDIA H200\nGPU UUID: \t " + uuid + "\n");
    write("sys/bus/pci/devices/" + pci + "/numa_node", std::to_string(numa_node) + "\n");
  }
  std::string sys() const { return (root_ / "sys").string(); }
  std::string proc() const { return (root_ / "proc").string(); }

 private:
  static inline int counter_ = 0;
  fs::path root_;
};

std::set<int> range(int first, int last) {
  std::set<int> s;
  for (int i = first; i <= last; ++i) s.insert(i);
  return s;
}

// Two sockets, one NUMA node each, 4 cores x 2 threads per node (siblings N and N+8), two L3
// complexes of 2 cores per node.
void two_socket_machine(FakeRoot& root) {
  root.node(0, "0-3,8-11");
  root.node(1, "4-7,12-15");
  for (int c = 0; c < 16; ++c) {
    const int core = c % 8;
    const int package = core / 4;
    const std::string siblings = std::to_string(core) + "," + std::to_string(core + 8);
    const int ccx_first = core - core % 2;
    const std::string l3 = std::to_string(ccx_first) + "-" + std::to_string(ccx_first + 1) + "," +
                           std::to_string(ccx_first + 8) + "-" + std::to_string(ccx_first + 9);
    root.cpu(c, package, siblings, l3);
  }
}

}  // namespace

TEST_SUITE("numa binding follows the machine's topology") {
  TEST_CASE("cpulists are parsed and printed in the sysfs format") {
    CHECK(*parse_cpu_list("0-3,8,10-11\n") == std::set<int>{0, 1, 2, 3, 8, 10, 11});
    CHECK(parse_cpu_list("")->empty());
    CHECK_FALSE(parse_cpu_list("3-1"));
    CHECK_FALSE(parse_cpu_list("a"));
    CHECK(cpu_list_string({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
    CHECK(parse_numa_mode("core-complex") == NumaMode::kCoreComplex);
    CHECK_FALSE(parse_numa_mode("nodes"));
  }

  TEST_CASE("each GPU's local rank runs on its GPU's NUMA node, narrowed by CUDA_VISIBLE_DEVICES") {
    FakeRoot root;
    two_socket_machine(root);
    root.gpu("0000:17:00.0", 0, "GPU-aaaa");
    root.gpu("0000:65:00.0", 0, "GPU-bbbb");
    root.gpu("0000:b1:00.0", 1, "GPU-cccc");
    root.gpu("0000:e3:00.0", 1, "GPU-dddd");
    const std::set<int> all = range(0, 15);
    Topology t = *read_topology(root.sys(), root.proc(), all, nullptr);
    CHECK(t.device_nodes == std::vector<int>{0, 0, 1, 1});
    auto plan = *plan_numa_bindings(t, NumaMode::kNode, 4);
    CHECK(cpu_list_string(plan[0].cpus) == "0-3,8-11");
    CHECK(cpu_list_string(plan[3].cpus) == "4-7,12-15");
    CHECK(plan[3].memory_node == 1);
    // Visible devices 0 and 1 are the physical GPUs 2 and 3 (node 1); UUIDs work too.
    t = *read_topology(root.sys(), root.proc(), all, "2,3");
    CHECK(t.device_nodes == std::vector<int>{1, 1});
    t = *read_topology(root.sys(), root.proc(), all, "GPU-dddd,GPU-aaaa");
    CHECK(t.device_nodes == std::vector<int>{1, 0});
  }

  TEST_CASE("exclusive splits a node's physical cores among its devices, siblings together") {
    FakeRoot root;
    two_socket_machine(root);
    root.gpu("0000:17:00.0", 0, "GPU-aaaa");
    root.gpu("0000:65:00.0", 0, "GPU-bbbb");
    root.gpu("0000:b1:00.0", 0, "GPU-cccc");
    const Topology t = *read_topology(root.sys(), root.proc(), range(0, 15), nullptr);
    const auto plan = *plan_numa_bindings(t, NumaMode::kExclusive, 3);
    // 4 cores for 3 devices: 2, 1, 1 (the first gets the extra one), as torch divides them.
    CHECK(cpu_list_string(plan[0].cpus) == "0-1,8-9");
    CHECK(cpu_list_string(plan[1].cpus) == "2,10");
    CHECK(cpu_list_string(plan[2].cpus) == "3,11");
  }

  TEST_CASE("socket and core-complex modes") {
    FakeRoot root;
    two_socket_machine(root);
    // Both nodes on one socket this time.
    for (int c = 0; c < 16; ++c) root.write("sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/physical_package_id", "0\n");
    root.gpu("0000:17:00.0", 1, "GPU-aaaa");
    root.gpu("0000:65:00.0", 1, "GPU-bbbb");
    const Topology t = *read_topology(root.sys(), root.proc(), range(0, 15), nullptr);
    CHECK(cpu_list_string(plan_numa_bindings(t, NumaMode::kSocket, 1)->at(0).cpus) == "0-15");
    const auto plan = *plan_numa_bindings(t, NumaMode::kCoreComplex, 2);
    CHECK(cpu_list_string(plan[0].cpus) == "4-5,12-13");
    CHECK(cpu_list_string(plan[1].cpus) == "6-7,14-15");
  }

  TEST_CASE("without GPUs local ranks go round-robin over the nodes; the affinity mask limits") {
    FakeRoot root;
    two_socket_machine(root);
    // This process may use 0-5 only (as under taskset).
    const Topology t = *read_topology(root.sys(), root.proc(), range(0, 5), nullptr);
    CHECK(t.device_nodes.empty());
    const auto plan = *plan_numa_bindings(t, NumaMode::kNode, 3);
    CHECK(cpu_list_string(plan[0].cpus) == "0-3");
    CHECK(cpu_list_string(plan[1].cpus) == "4-5");
    CHECK(cpu_list_string(plan[2].cpus) == "0-3");
    // Exclusive: ranks 0 and 2 share node 0's four cores.
    const auto ex = *plan_numa_bindings(t, NumaMode::kExclusive, 3);
    CHECK(cpu_list_string(ex[0].cpus) == "0-1");
    CHECK(cpu_list_string(ex[2].cpus) == "2-3");
    CHECK(cpu_list_string(ex[1].cpus) == "4-5");
  }

  TEST_CASE("impossible requests are refused with the reason") {
    FakeRoot root;
    root.node(0, "0-1");
    for (int c = 0; c < 2; ++c) root.cpu(c, 0, "0-1", "0-1");  // one core, two threads
    const Topology t = *read_topology(root.sys(), root.proc(), range(0, 1), nullptr);
    CHECK(plan_numa_bindings(t, NumaMode::kExclusive, 2).error() ==
          "NUMA node 0 has 1 usable physical cores for 2 devices; use --numa_binding=node");
    CHECK(read_topology(root.sys(), root.proc(), range(4, 5), nullptr).error().find("no NUMA node with a usable CPU") !=
          std::string::npos);
  }
}

TEST_SUITE("devices are probed from the driver's files") {
  TEST_CASE("GPUs are listed in PCI order with model and UUID, CUDA_VISIBLE_DEVICES applies") {
    FakeRoot root;
    root.gpu("0000:65:00.0", 0, "GPU-bbbb");
    root.gpu("0000:17:00.0", 0, "GPU-aaaa");
    const auto gpus = list_nvidia_gpus(root.proc() + "/driver/nvidia/gpus");
    REQUIRE(gpus.size() == 2);
    CHECK(gpus[0].pci_address == "0000:17:00.0");
    CHECK(gpus[0].uuid == "GPU-aaaa");
    CHECK(gpus[1].model == "NVIDIA H200");
    CHECK(visible_gpus(gpus, "1").at(0).uuid == "GPU-bbbb");
    CHECK(visible_gpus(gpus, "GPU-bb,0").size() == 2);
    CHECK(visible_gpus(gpus, "0,7,1").size() == 1);
    CHECK(visible_gpus(gpus, "").empty());
  }

  TEST_CASE("this machine's counters agree with its /proc and its affinity mask") {
    // GPUs: what the driver lists, when CUDA_VISIBLE_DEVICES leaves them all visible.
    std::size_t listed = list_nvidia_gpus("/proc/driver/nvidia/gpus").size();
    if (listed == 0 && fs::exists("/dev")) {
      for (const auto& e : fs::directory_iterator("/dev")) {
        const std::string name = e.path().filename().string();
        if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
            name.find_first_not_of("0123456789", 6) == std::string::npos) {
          ++listed;
        }
      }
    }
    CHECK(count_visible_gpus("/proc/driver/nvidia/gpus", "/dev", nullptr) == static_cast<int>(listed));
    CHECK(count_visible_gpus("/proc/driver/nvidia/gpus", "/dev", "") == 0);
    // CPUs: narrowing this thread's affinity to one CPU is seen at once, and restored.
    cpu_set_t saved;
    REQUIRE(::sched_getaffinity(0, sizeof saved, &saved) == 0);
    CHECK(count_usable_cpus() == CPU_COUNT(&saved));
    int first = 0;
    while (!CPU_ISSET(first, &saved)) ++first;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    REQUIRE(::sched_setaffinity(0, sizeof one, &one) == 0);
    CHECK(count_usable_cpus() == 1);
    REQUIRE(::sched_setaffinity(0, sizeof saved, &saved) == 0);
  }
}
