// The resolved configuration of one ddplaunch run: command-line flags, then PET_<NAME>
// environment variables, then defaults (torchrun's order). Produced by parse_command_line(),
// consumed by main.cpp, which builds the agent from it.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/exit_codes.h"

namespace ddp::launcher {

// A command-line or configuration error: main() prints what() and exits with code().
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& message, ExitCode code = ExitCode::kUsage)
      : std::runtime_error(message), code_(code) {}
  ExitCode code() const { return code_; }

 private:
  ExitCode code_;
};

// How a worker's stdout/stderr is handled: 0 none, 1 stdout, 2 stderr, 3 both (torchrun's Std).
// `default_value` applies to local ranks without an entry in `per_rank`.
struct StdSpec {
  int default_value = 0;
  std::map<int, int> per_rank;  // local rank -> 0..3
  int for_rank(int local_rank) const {
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? default_value : it->second;
  }
};

struct LaunchConfig {
  // --nnodes: MIN:MAX or N (MIN == MAX). Default 1:1.
  int min_nodes = 1;
  int max_nodes = 1;
  // --nproc_per_node: resolved to a count (auto/gpu count GPUs, honouring CUDA_VISIBLE_DEVICES;
  // cpu = number of CPUs; auto without GPUs = 1). Default 1.
  int nproc_per_node = 1;
  std::string nproc_spec = "1";        // as given, for messages
  std::string rdzv_backend = "static"; // static | c10d | ddp (c10d and ddp are the same: ours)
  std::string rdzv_endpoint;           // HOST[:PORT]; default port 29400 (c10d)
  std::string rdzv_id = "none";        // run id
  std::map<std::string, std::string> rdzv_conf;  // --rdzv_conf key=value,...
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;       // accepted; we watch child exits as events, not by polling
  std::string start_method = "spawn";  // accepted for compatibility
  std::string role = "default";
  bool module = false;                 // -m/--module
  bool no_python = false;              // --no_python
  bool run_path = false;               // --run_path
  std::string log_dir;                 // --log_dir; empty = a temporary directory when needed
  StdSpec redirects;                   // -r/--redirects
  StdSpec tee;                         // -t/--tee
  std::vector<int> local_ranks_filter; // empty = all ranks reach the console
  int node_rank = -1;                  // --node_rank; -1 = not given (rendezvous assigns)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;             // static backend; 0 = pick a free port
  bool master_port_given = false;
  std::string local_addr;              // --local_addr
  double shutdown_timeout = 30.0;      // seconds, SIGTERM -> SIGKILL
  std::vector<int> signals_to_handle;  // default SIGTERM, SIGINT, SIGHUP, SIGQUIT
  std::string python = "python3";      // --python / $PYTHON_EXEC
  std::string env_check = "strict";    // --env_check strict|warn|off (issue 6)
  std::string env_lock;                // --env_lock FILE (issue 6)
  bool check_env = false;              // --check_env (issue 6)
  std::string program;                 // training script, module or executable
  std::vector<std::string> program_args;
};

// Parses argv (and the PET_ environment). Throws UsageError on bad input. `--help` prints the
// help to stdout and throws UsageError with code kSuccess and an empty message.
LaunchConfig parse_command_line(int argc, const char* const* argv);

}  // namespace ddp::launcher
