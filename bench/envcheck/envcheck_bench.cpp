// What the environment check costs the rendezvous: compare_fingerprints and the
// state machine's round check on N realistic fingerprints, and a whole round of N agents with
// the check against the same round without it. Prints one line per measurement (median and
// max of the repetitions, in milliseconds). No sockets, no sleeps.
//
//   ddp-envcheck-bench [NODES=100] [REPETITIONS=200]
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rendezvous/clock.h"
#include "rendezvous/env_check.h"
#include "rendezvous/state.h"

namespace {

using nlohmann::json;
using namespace ddp::rdzv;
using Clock = std::chrono::steady_clock;

std::string hex64(unsigned seed) {
  static const char* digits = "0123456789abcdef";
  std::string s(64, '0');
  unsigned x = seed * 2654435761u + 12345u;
  for (char& c : s) {
    x = x * 1103515245u + 12345u;
    c = digits[(x >> 16) & 0xf];
  }
  return s;
}

// A fingerprint as a GPU node running Python workers sends it (agent/fingerprint.cpp).
json python_node(const std::string& torch) {
  return {
      {"machine", {{"arch", "x86_64"}, {"os", "Ubuntu 22.04.4 LTS"}, {"glibc", "2.35"}}},
      {"gpu", {{"count", 8}, {"models", std::vector<std::string>(8, "NVIDIA H100 80GB HBM3")}, {"driver", "535.104.05"}}},
      {"python",
       {{"version", "3.10.12"}, {"implementation", "CPython"}, {"executable", "/opt/conda/envs/train/bin/python3"},
        {"torch", torch}, {"torch_cuda", "12.1"}, {"nccl", "2.18.1"}, {"cudnn", "8902"}}},
      {"program", {{"path", "/shared/jobs/llm/train.py"}, {"sha256", hex64(1)}}},
      {"env_lock", {{"source", "cmd:conda list --explicit"}, {"sha256", hex64(2)}}},
      {"env",
       {{"CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"}, {"NCCL_SOCKET_IFNAME", "ens"}, {"NCCL_IB_HCA", "mlx5"},
        {"NCCL_DEBUG", "WARN"}, {"NCCL_ASYNC_ERROR_HANDLING", "1"}}},
  };
}

// A --no_python node: an executable linked against libtorch, with its shared libraries hashed.
json executable_node(unsigned libtorch_seed) {
  json libs = json::object();
  static const char* names[] = {"libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libc10.so", "libc10_cuda.so",
                                "libcudart.so.12", "libnccl.so.2", "libcublas.so.12", "libcudnn.so.8", "libgloo.so"};
  for (unsigned i = 0; i < 10; ++i) libs[names[i]] = hex64(100 + i + (i == 0 ? libtorch_seed : 0));
  for (unsigned i = 0; i < 50; ++i) libs["libsystem" + std::to_string(i) + ".so.1"] = hex64(200 + i);
  json fp = python_node("unused");
  fp.erase("python");
  fp["program"] = {{"path", "/shared/jobs/llm/train"}, {"sha256", hex64(3)}, {"libraries", libs}};
  return fp;
}

struct NullOutbox : Outbox {
  void send(ConnId, const Frame&) override { ++sent; }
  void drop(ConnId, const std::string&, const std::string&) override { ++dropped; }
  void log(const std::string&) override {}
  std::size_t sent = 0, dropped = 0;
};

// CPU time of this thread: what the work costs, whatever else the machine is running.
double cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Stats {
  double wall_median_ms, wall_max_ms, cpu_median_ms;
};

template <typename F>
Stats measure(int reps, F&& body) {
  std::vector<double> wall, cpu;
  for (int i = 0; i < reps; ++i) {
    double c0 = cpu_ms();
    auto t0 = Clock::now();
    body();
    wall.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    cpu.push_back(cpu_ms() - c0);
  }
  double wall_max = *std::max_element(wall.begin(), wall.end());
  return {median(wall), wall_max, median(cpu)};
}

void print(const char* what, std::size_t nodes, Stats s) {
  std::printf("%-66s nodes=%-4zu cpu %7.3f ms  wall median %7.3f ms  max %7.3f ms\n", what, nodes, s.cpu_median_ms,
              s.wall_median_ms, s.wall_max_ms);
}

std::vector<NodeSpec> specs_for(const std::vector<json>& prints, const std::string& mode) {
  std::vector<NodeSpec> specs;
  for (std::size_t i = 0; i < prints.size(); ++i) {
    NodeSpec s;
    s.job_id = "bench";
    s.host = "gpu-node-" + std::to_string(i);
    s.addr = "10.0." + std::to_string(i / 250) + "." + std::to_string(i % 250 + 1);
    s.local_world_size = 8;
    s.min_nodes = s.max_nodes = static_cast<int>(prints.size());
    s.master_port = 29500;
    s.env_check = mode;
    s.fingerprint = prints[i];
    specs.push_back(std::move(s));
  }
  return specs;
}

// One whole round: N joins into a fresh state machine; the last one completes the round.
// Returns the CPU milliseconds of the joins.
double round_ms(const std::vector<NodeSpec>& specs, bool with_check, std::size_t& rounds_sent) {
  ManualClock clock;
  NullOutbox out;
  RoundCheck check;
  if (with_check) check = make_env_round_check([](const std::string&) {});
  StateMachine sm(clock, out, check);
  double c0 = cpu_ms();
  for (std::size_t i = 0; i < specs.size(); ++i) sm.join(i + 1, specs[i]);
  double ms = cpu_ms() - c0;
  rounds_sent = out.sent;
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 100;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 200;
  if (n < 2 || reps < 1) {
    std::fprintf(stderr, "usage: ddp-envcheck-bench [NODES>=2] [REPETITIONS>=1]\n");
    return 2;
  }
  std::vector<json> same(n, python_node("2.1.0+cu121"));
  std::vector<json> one_off = same;
  one_off[n / 2] = python_node("2.1.0+cu118");
  std::vector<json> exe_same(n, executable_node(0));
  std::vector<json> exe_off = exe_same;
  exe_off[n / 3] = executable_node(7);
  // Differences that break nothing (the round runs, the check's slow path): one node names
  // another network interface.
  std::vector<json> info_off = same, exe_info_off = exe_same;
  info_off[n / 4]["env"]["NCCL_SOCKET_IFNAME"] = "ib";
  exe_info_off[n / 4]["env"]["NCCL_SOCKET_IFNAME"] = "ib";
  std::printf("fingerprint sizes: python node %zu bytes of JSON, executable node %zu bytes (60 libraries)\n",
              same[0].dump().size(), exe_same[0].dump().size());

  auto nodes_of = [](const std::vector<json>& prints) {
    std::vector<NodeFingerprint> nodes;
    for (std::size_t i = 0; i < prints.size(); ++i) nodes.push_back({"gpu-node-" + std::to_string(i), "10.0.0.1", prints[i]});
    return nodes;
  };
  std::size_t sink = 0;
  for (auto [what, prints] : {std::pair<const char*, const std::vector<json>*>{"compare_fingerprints, python nodes, all equal", &same},
                              {"compare_fingerprints, python nodes, one torch differs", &one_off},
                              {"compare_fingerprints, executables + 60 libs, all equal", &exe_same},
                              {"compare_fingerprints, executables + 60 libs, one libtorch differs", &exe_off}}) {
    auto nodes = nodes_of(*prints);
    print(what, n, measure(reps, [&] { sink += compare_fingerprints(nodes).differences.size(); }));
  }

  for (auto [what, prints] : {std::pair<const char*, const std::vector<json>*>{"make_env_round_check (strict), python nodes, all equal", &same},
                              {"make_env_round_check (strict), python nodes, one differs", &one_off},
                              {"make_env_round_check (strict), python nodes, informational diff", &info_off},
                              {"make_env_round_check (strict), executables, all equal", &exe_same},
                              {"make_env_round_check (strict), executables, informational diff", &exe_info_off}}) {
    auto specs = specs_for(*prints, "strict");
    std::vector<CheckedNode> members;
    for (const auto& s : specs) members.push_back({&s, &s.fingerprint});
    RoundCheck check = make_env_round_check([](const std::string&) {});
    print(what, n, measure(reps, [&] { sink += check("bench", members).has_value(); }));
  }

  // The whole round, with and without the check: the difference is what the check adds.
  for (auto [what, prints] : {std::pair<const char*, const std::vector<json>*>{"python nodes", &same},
                              {"python nodes, one informational difference", &info_off},
                              {"executables + 60 libs", &exe_same},
                              {"executables + 60 libs, one informational difference", &exe_info_off}}) {
    auto specs = specs_for(*prints, "strict");
    std::size_t sent_with = 0, sent_without = 0;
    std::vector<double> with, without;
    for (int i = 0; i < reps; ++i) {  // interleaved, so machine load hits both alike
      without.push_back(round_ms(specs, false, sent_without));
      with.push_back(round_ms(specs, true, sent_with));
    }
    if (sent_with != n || sent_without != n) {
      std::fprintf(stderr, "a round did not complete (%zu / %zu assignments of %zu)\n", sent_with, sent_without, n);
      return 1;
    }
    std::sort(with.begin(), with.end());
    std::sort(without.begin(), without.end());
    double mw = with[with.size() / 2], mo = without[without.size() / 2];
    std::printf("round of %zu agents (%s): cpu without check %.3f ms, with check %.3f ms, added %.3f ms (medians)\n", n,
                what, mo, mw, mw - mo);
  }
  return sink == 0xffffffff ? 1 : 0;  // keeps the measured calls from being optimised away
}
