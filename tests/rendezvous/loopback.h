// Helpers for loopback tests: an embedded server on 127.0.0.1 and agents made of the real
// Client, all driven by one io_context on the test thread (waits have deadlines, no sleeps).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio.hpp>
#include <doctest/doctest.h>

#include "rendezvous/client.h"
#include "rendezvous/server.h"

namespace ddp::rdzv::test {

// Runs `io` until `done()` or the deadline; returns done().
inline bool run_until(boost::asio::io_context& io, const std::function<bool()>& done, double seconds = 10.0) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    io.restart();
    io.run_for(std::chrono::milliseconds(5));
  }
  return true;
}

// One simulated agent: a real Client and what it heard.
struct TestAgent {
  std::shared_ptr<Client> client;
  std::vector<Assignment> rounds;
  std::vector<std::pair<std::string, bool>> restarts;
  bool succeeded = false;
  std::optional<std::pair<WorkerFailure, std::string>> failed;
  std::vector<std::string> errors;
  std::vector<std::string> logs;
  NodeSpec spec;

  static std::shared_ptr<TestAgent> make(boost::asio::io_context& io, unsigned short port, NodeSpec spec,
                                         const std::string& token = "", double connect_timeout = 10.0) {
    auto a = std::make_shared<TestAgent>();
    a->spec = spec;
    ClientOptions o;
    o.job_id = spec.job_id;
    o.token = token;
    TestAgent* raw = a.get();
    ClientEvents e;
    e.on_round = [raw](const Assignment& x) { raw->rounds.push_back(x); };
    e.on_restart = [raw](const std::string& reason, bool counted, bool, bool) { raw->restarts.emplace_back(reason, counted); };
    e.on_job_succeeded = [raw] { raw->succeeded = true; };
    e.on_job_failed = [raw](const WorkerFailure& f, const std::string& s) { raw->failed.emplace(f, s); };
    e.on_error = [raw](const std::string& m) { raw->errors.push_back(m); };
    e.on_log = [raw](const std::string& m) { raw->logs.push_back(m); };
    a->client = Client::create(io, o, e);
    a->client->connect(Endpoint{"127.0.0.1", port}, connect_timeout);
    a->client->join(spec);
    return a;
  }
};

inline NodeSpec node_spec(const std::string& job, const std::string& host, int min_nodes, int max_nodes,
                          int workers = 1) {
  NodeSpec s;
  s.job_id = job;
  s.host = host;
  s.local_world_size = workers;
  s.min_nodes = min_nodes;
  s.max_nodes = max_nodes;
  s.master_port = 40000;
  s.timeouts.join_timeout = 20;
  s.timeouts.last_call_timeout = 0.2;
  s.timeouts.heartbeat_interval = 0.1;
  s.timeouts.heartbeat_timeout = 2;
  return s;
}

}  // namespace ddp::rdzv::test
