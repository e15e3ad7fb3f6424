// The worker environment set by ddplaunch (or torchrun), read once at start.
// Plain data; no torch dependency.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace ddp {

// What a worker learns from its environment. See docs/worker-sdk.md for the rules.
struct WorkerEnv {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  int group_rank = 0;
  std::string master_addr;  // empty for a single process
  int master_port = 0;      // 0 for a single process
  int restart_count = 0;    // TORCHELASTIC_RESTART_COUNT, 0 when unset
  int max_restarts = 0;     // TORCHELASTIC_MAX_RESTARTS, 0 when unset
  std::string run_id;       // TORCHELASTIC_RUN_ID, empty when unset
  std::optional<int64_t> generation;  // DDPLAUNCH_GENERATION when set
  // TORCHELASTIC_USE_AGENT_STORE: the agent hosts the TCP store at MASTER_PORT and every
  // worker (rank 0 too) connects as a client. When false, rank 0 hosts it.
  bool use_agent_store = false;
  // False when none of the launcher variables is set: a single process, for debugging.
  bool launched = false;

  bool distributed() const { return world_size > 1; }

  // Reads the process environment. Throws EnvError naming the variable and what to do.
  static WorkerEnv from_environment();
  // Same rules over any lookup (tests). lookup returns nullopt for an unset variable.
  static WorkerEnv from_lookup(
      const std::function<std::optional<std::string>(const std::string&)>& lookup);

  // One line for logs: "rank 1/4 (local 1/2, node 0) master 10.0.0.1:29500 restart 0".
  std::string describe() const;
};

}  // namespace ddp
