// The resolved configuration of one ddplaunch run: command-line flags, then PET_<NAME>
// environment variables, then defaults (torchrun's order). Produced by parse_command_line(),
// consumed by main.cpp, which builds the agent from it.
#pragma once

#include <functional>
#include <iosfwd>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/exit_codes.h"
#include "rendezvous/types.h"

namespace ddp::launcher {

// A command-line or configuration error: main() prints what() and exits with code().
// Errors thrown by parse_command_line() carry a complete message, ready to print as is: it starts
// with "ddplaunch: ", names the flag (or PET_ variable) and its value, says what is accepted, and
// ends with a hint to --help.
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
  // cpu = number of CPUs this process may run on; auto without GPUs = the CPU count, as torchrun
  // does). Default 1.
  int nproc_per_node = 1;
  std::string nproc_spec = "1";        // as given, for messages
  std::string rdzv_backend = "static"; // static | c10d | ddp (c10d and ddp are the same: ours)
  std::string rdzv_endpoint;           // HOST[:PORT]; default port 29400 (c10d)
  std::string rdzv_host;               // rdzv_endpoint's host (IPv6 without brackets); "" = none
  int rdzv_port = 29400;               // rdzv_endpoint's port, 29400 when it names none
  std::string rdzv_id = "none";        // run id
  std::map<std::string, std::string> rdzv_conf;  // --rdzv_conf key=value,...
  // The deadlines of rdzv_conf (join_timeout, last_call_timeout, heartbeat_interval,
  // heartbeat_timeout, shutdown_timeout), validated, with rdzv::Timeouts' defaults for the rest.
  // timeouts.shutdown_timeout == shutdown_timeout (the flag wins over the rdzv_conf key).
  rdzv::Timeouts timeouts;
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
  int node_rank = -1;                  // --node_rank; -1 = not given (rendezvous assigns).
                                       // Always >= 0 with the static backend (0 on one node).
  std::string master_addr = "127.0.0.1";  // static backend; from --rdzv_endpoint when given
  int master_port = 29500;             // static backend; 0 = pick a free port
  bool master_port_given = false;
  std::string local_addr;              // --local_addr
  double shutdown_timeout = 30.0;      // seconds, SIGTERM -> SIGKILL
  std::vector<int> signals_to_handle;  // resolved, never empty: default SIGTERM, SIGINT, SIGHUP,
                                       // SIGQUIT
  std::string python = "python3";      // --python, PET_PYTHON, $PYTHON_EXEC, then python3
  std::string env_check = "strict";    // --env_check strict|warn|off (issue 6)
  std::string env_lock;                // --env_lock FILE (issue 6)
  bool check_env = false;              // --check_env (issue 6)
  std::string program;                 // training script, module or executable
  std::vector<std::string> program_args;
};

// What parse_command_line() needs from the world besides argv and the environment; tests swap
// these. The defaults write to std::cout/std::cerr and count this machine's GPUs and CPUs.
struct ParseContext {
  std::ostream* out = nullptr;        // --help and --version; nullptr = std::cout
  std::ostream* err = nullptr;        // warnings (the parse goes on); nullptr = std::cerr
  std::function<int()> count_gpus;    // empty = count_visible_gpus()
  std::function<int()> count_cpus;    // empty = count_usable_cpus()
};

// Parses argv (and the PET_ environment). Throws UsageError on bad input. `--help` prints the
// help to stdout and throws UsageError with code kSuccess and an empty message; `--version`
// does the same with the version. Does no file or process I/O, except counting GPUs when
// --nproc_per_node is auto or gpu. Warnings (ignored --rdzv_conf keys, flags that --standalone
// overrides) go to stderr.
LaunchConfig parse_command_line(int argc, const char* const* argv);
LaunchConfig parse_command_line(int argc, const char* const* argv, const ParseContext& context);

// The text --help prints (a man page: synopsis, options by group with defaults, exit status,
// environment, examples).
std::string help_text();

// "ddplaunch <version>", what --version prints.
std::string version_text();

// GPUs this process may use: NVIDIA devices (entries of /proc/driver/nvidia/gpus, else
// /dev/nvidia<N> nodes), narrowed by CUDA_VISIBLE_DEVICES. No libtorch, no driver calls.
int count_visible_gpus();
// The same with the directories given (tests). `cuda_visible_devices` nullptr = unset.
int count_visible_gpus(const std::string& proc_gpus_dir, const std::string& dev_dir,
                       const char* cuda_visible_devices);
// How many of `physical` GPUs CUDA_VISIBLE_DEVICES leaves visible, as the CUDA runtime reads it:
// unset (nullptr) = all; "" = none; a comma list of indices or GPU-/MIG- UUIDs, cut at the first
// entry that is invalid (out of range, negative, repeated, not a number).
int apply_cuda_visible_devices(int physical, const char* cuda_visible_devices);

// CPUs this process may run on (its affinity mask), at least 1.
int count_usable_cpus();

// Parses a --redirects/--tee value: "0".."3", or "LOCAL_RANK:V,..." with V in 0..3.
// Throws UsageError naming `flag`.
StdSpec parse_std_spec(const std::string& value, const std::string& flag);

// Parses --signals_to_handle: comma list of names (SIGTERM, TERM, sigterm) or numbers.
// Throws UsageError naming `flag`.
std::vector<int> parse_signal_list(const std::string& value, const std::string& flag);

}  // namespace ddp::launcher
