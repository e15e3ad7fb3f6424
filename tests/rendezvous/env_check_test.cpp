#include "rendezvous/env_check.h"

#include <chrono>
#include <string>
#include <vector>

#include <doctest/doctest.h>

using nlohmann::json;
using namespace ddp::rdzv;

namespace {

json fingerprint(const std::string& torch, const std::string& os = "Debian GNU/Linux 12 (bookworm)") {
  return {
      {"machine", {{"arch", "x86_64"}, {"os", os}, {"glibc", "2.36"}}},
      {"gpu", {{"count", 0}, {"models", json::array()}, {"driver", nullptr}, {"note", "no driver"}}},
      {"python",
       {{"version", "3.11.2"}, {"executable", "/usr/bin/python3"}, {"torch", torch},
        {"torch_cuda", "12.1"}, {"nccl", "2.18.1"}, {"cudnn", "8902"}}},
      {"program", {{"path", "/job/train.py"}, {"sha256", std::string(64, 'a')}}},
      {"env", json::object()},
  };
}

NodeFingerprint node(const std::string& name, const std::string& addr, json fp) {
  return NodeFingerprint{name, addr, std::move(fp)};
}

}  // namespace

TEST_CASE("identical fingerprints show no difference and pass in every mode") {
  std::vector<NodeFingerprint> nodes = {node("a", "10.0.0.1", fingerprint("2.1.0+cu121")),
                                        node("b", "10.0.0.2", fingerprint("2.1.0+cu121")),
                                        node("c", "10.0.0.3", fingerprint("2.1.0+cu121"))};
  auto r = compare_fingerprints(nodes);
  CHECK(r.empty());
  CHECK_FALSE(r.has_breaking());
  CHECK(r.message().empty());
  CHECK(env_check_verdict(EnvCheckMode::strict, r) == EnvVerdict::pass);
  CHECK(env_check_verdict(EnvCheckMode::warn, r) == EnvVerdict::pass);
  CHECK(env_check_verdict(EnvCheckMode::off, r) == EnvVerdict::pass);
}

TEST_CASE("a node with another torch is named side by side with the majority") {
  std::vector<NodeFingerprint> nodes = {node("a", "10.0.0.1", fingerprint("2.1.0+cu121")),
                                        node("b", "10.0.0.2", fingerprint("2.1.0+cu118")),
                                        node("c", "10.0.0.3", fingerprint("2.1.0+cu121"))};
  auto r = compare_fingerprints(nodes);
  REQUIRE(r.differences.size() == 1);
  const auto& d = r.differences[0];
  CHECK(d.field == "python.torch");
  CHECK(d.breaking);
  CHECK(d.message == "node b (10.0.0.2) has torch 2.1.0+cu118; nodes a, c have 2.1.0+cu121");
  REQUIRE(d.groups.size() == 2);
  CHECK(d.groups[0].nodes == std::vector<std::size_t>{1});
  CHECK(d.groups[1].nodes == std::vector<std::size_t>{0, 2});
  CHECK(env_check_verdict(EnvCheckMode::strict, r) == EnvVerdict::refuse);
  CHECK(env_check_verdict(EnvCheckMode::warn, r) == EnvVerdict::warn);
  CHECK(env_check_verdict(EnvCheckMode::off, r) == EnvVerdict::pass);
  CHECK(refusal_message(r) ==
        "environment mismatch between the job's nodes (--env_check=strict):\n"
        "  node b (10.0.0.2) has torch 2.1.0+cu118; nodes a, c have 2.1.0+cu121\n"
        "make the nodes' software the same, or pass --env_check=warn to run anyway");
}

TEST_CASE("an OS difference alone is informational: strict warns and does not refuse") {
  std::vector<NodeFingerprint> nodes = {node("a", "10.0.0.1", fingerprint("2.1.0", "Debian 12")),
                                        node("b", "10.0.0.2", fingerprint("2.1.0", "Ubuntu 22.04"))};
  auto r = compare_fingerprints(nodes);
  REQUIRE(r.differences.size() == 1);
  CHECK_FALSE(r.differences[0].breaking);
  CHECK(r.differences[0].message == "node a (10.0.0.1) has OS Debian 12; node b has Ubuntu 22.04");
  CHECK(env_check_verdict(EnvCheckMode::strict, r) == EnvVerdict::warn);
  CHECK(r.message(/*breaking_only=*/true).empty());
}

TEST_CASE("breaking differences come first and hashes are shortened") {
  auto a = fingerprint("2.1.0", "Debian 12");
  auto b = fingerprint("2.1.0", "Debian 13");
  b["program"]["sha256"] = std::string(64, 'b');
  b["env"]["NCCL_SOCKET_IFNAME"] = "eth1";
  auto r = compare_fingerprints({node("a", "", a), node("b", "", b)});
  REQUIRE(r.differences.size() == 3);
  CHECK(r.differences[0].field == "program.sha256");
  CHECK(r.differences[0].message == "node a has program sha256 aaaaaaaaaaaa; node b has bbbbbbbbbbbb");
  CHECK(r.differences[1].field == "env.NCCL_SOCKET_IFNAME");
  CHECK(r.differences[1].message == "node a has NCCL_SOCKET_IFNAME (unset); node b has eth1");
  CHECK_FALSE(r.differences[1].breaking);
  CHECK(r.differences[2].field == "machine.os");
  CHECK(r.has_breaking());
}

TEST_CASE("a field missing on some nodes is shown as (none) and compared like a value") {
  auto with_lock = fingerprint("2.1.0");
  with_lock["env_lock"] = {{"source", "requirements.txt"}, {"sha256", std::string(64, 'c')}};
  auto r = compare_fingerprints({node("a", "1.1.1.1", fingerprint("2.1.0")),
                                 node("b", "1.1.1.2", with_lock), node("c", "1.1.1.3", fingerprint("2.1.0"))});
  REQUIRE(r.differences.size() == 2);
  CHECK(r.differences[0].field == "env_lock.sha256");
  CHECK(r.differences[0].message == "node b (1.1.1.2) has lock file sha256 cccccccccccc; nodes a, c have (none)");
  CHECK(r.differences[1].field == "env_lock.source");
  CHECK_FALSE(r.differences[1].breaking);
}

TEST_CASE("a field that is null on one node and absent on another is not a difference") {
  auto without_cudnn = fingerprint("2.1.0");
  without_cudnn["python"]["cudnn"] = nullptr;
  auto absent = fingerprint("2.1.0");
  absent["python"].erase("cudnn");
  auto r = compare_fingerprints({node("a", "1.1.1.1", without_cudnn), node("b", "1.1.1.2", absent)});
  CHECK(r.empty());
  // A value against null is still a difference, shown as (none).
  r = compare_fingerprints({node("a", "1.1.1.1", fingerprint("2.1.0")), node("b", "1.1.1.2", without_cudnn)});
  REQUIRE(r.differences.size() == 1);
  CHECK(r.differences[0].message.find("(none)") != std::string::npos);
}

TEST_CASE("three different values are three groups, smallest first, majority last") {
  auto r = compare_fingerprints({node("a", "", fingerprint("1")), node("b", "", fingerprint("2")),
                                 node("c", "", fingerprint("2")), node("d", "", fingerprint("3"))});
  REQUIRE(r.differences.size() == 1);
  CHECK(r.differences[0].message == "node a has torch 1; node d has 3; nodes b, c have 2");
}

TEST_CASE("framework libraries break a job, system libraries only inform") {
  CHECK(is_breaking_field("program.libraries.libtorch_cpu.so"));
  CHECK(is_breaking_field("program.libraries.libc10.so"));
  CHECK(is_breaking_field("program.libraries.libnccl.so.2"));
  CHECK_FALSE(is_breaking_field("program.libraries.libc.so.6"));
  CHECK_FALSE(is_breaking_field("program.libraries.libstdc++.so.6"));
  CHECK(is_breaking_field("python.torch_cuda"));
  CHECK(is_breaking_field("python.cudnn"));
  CHECK_FALSE(is_breaking_field("gpu.driver"));
  CHECK_FALSE(is_breaking_field("gpu.count"));
  CHECK_FALSE(is_breaking_field("machine.glibc"));
}

TEST_CASE("fewer than two nodes never differ") {
  CHECK(compare_fingerprints({}).empty());
  CHECK(compare_fingerprints({node("a", "", fingerprint("1"))}).empty());
}

TEST_CASE("env_check modes parse and print") {
  CHECK(parse_env_check_mode("strict") == EnvCheckMode::strict);
  CHECK(parse_env_check_mode("warn") == EnvCheckMode::warn);
  CHECK(parse_env_check_mode("off") == EnvCheckMode::off);
  CHECK_FALSE(parse_env_check_mode("Strict").has_value());
  CHECK_FALSE(parse_env_check_mode("").has_value());
  CHECK(std::string(to_string(EnvCheckMode::warn)) == "warn");
}

TEST_CASE("100 nodes: the few that differ are named, the majority is summarised") {
  std::vector<NodeFingerprint> nodes;
  for (int i = 0; i < 100; ++i) {
    auto fp = fingerprint(i == 17 || i == 42 ? "2.1.0+cu118" : "2.1.0+cu121");
    if (i == 99) fp["python"]["nccl"] = "2.19.3";
    fp["env"]["NCCL_SOCKET_IFNAME"] = "eth0";
    nodes.push_back(node("n" + std::to_string(i), "10.0.1." + std::to_string(i), std::move(fp)));
  }
  auto r = compare_fingerprints(nodes);
  REQUIRE(r.differences.size() == 2);
  CHECK(r.differences[0].field == "python.nccl");
  CHECK(r.differences[0].message ==
        "node n99 (10.0.1.99) has NCCL 2.19.3; nodes n0, n1, n2, n3, n4, n5 and 93 more have 2.18.1");
  CHECK(r.differences[1].field == "python.torch");
  CHECK(r.differences[1].message ==
        "nodes n17 (10.0.1.17), n42 (10.0.1.42) have torch 2.1.0+cu118; "
        "nodes n0, n1, n2, n3, n4, n5 and 92 more have 2.1.0+cu121");
  REQUIRE(r.differences[1].groups.size() == 2);
  CHECK(r.differences[1].groups[1].nodes.size() == 98);
  CHECK(env_check_verdict(EnvCheckMode::strict, r) == EnvVerdict::refuse);
}

// Not a test: a measurement, skipped by default (timings are not asserted). Run it with
//   env_check_test --no-skip --test-case='benchmark*'
TEST_CASE("benchmark: compare_fingerprints at 10, 100 and 1000 nodes" * doctest::skip()) {
  for (int n : {10, 100, 1000}) {
    std::vector<NodeFingerprint> nodes;
    for (int i = 0; i < n; ++i) {
      auto fp = fingerprint(i == 7 ? "2.1.0+cu118" : "2.1.0+cu121");
      json libs = json::object();
      for (int l = 0; l < 30; ++l) libs["lib" + std::to_string(l) + ".so"] = std::string(64, 'a' + l % 6);
      fp["program"]["libraries"] = libs;
      fp["env"]["NCCL_SOCKET_IFNAME"] = "eth0";
      nodes.push_back(node("node" + std::to_string(i), "10.0.0." + std::to_string(i % 256), std::move(fp)));
    }
    const int reps = 200;
    std::size_t found = 0;
    auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) found += compare_fingerprints(nodes).differences.size();
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / reps;
    MESSAGE("nodes=" << n << " (about 45 fields each, one node differs): " << us
                     << " us per compare_fingerprints, mean of " << reps << "; differences=" << found / reps);
    CHECK(found == static_cast<std::size_t>(reps));
  }
}
