// Runs a short-lived helper program (the interpreter probe, ldd, an --env_lock command) with a
// deadline and captures its output. Called on the agent's thread while it computes the
// fingerprint, before any worker exists; blocking by design (bounded by the deadline).
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace ddp::agent {

struct ChildResult {
  bool started = false;
  bool timed_out = false;
  int exit_code = -1;  // WEXITSTATUS, or 128+signal
  std::string out;
  std::string err;
  std::string error;   // why it could not start
};

// Runs argv (argv[0] looked up in PATH) with stdin from /dev/null and exactly the environment
// `env`, in a process group of its own, capturing both outputs. Started by the spawner
// (agent/spawn.h), under its rules. At the deadline the child's process group is killed. Output
// beyond 16 MiB per stream is dropped.
ChildResult run_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                      std::chrono::milliseconds timeout);

// "WHAT: exit code N: <stderr tail>", "WHAT: no answer within T s (killed)" or why it did not start.
std::string describe_failure(const std::string& what, const ChildResult& r, std::chrono::milliseconds timeout);

}  // namespace ddp::agent
