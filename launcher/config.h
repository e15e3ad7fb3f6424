// The resolved configuration of one ddplaunch run: command-line flags, then PET_<NAME>
// environment variables, then (inside a Slurm allocation) Slurm's variables, then defaults
// (torchrun's order, with Slurm added before the defaults). parse_command_line() reads argv once
// (launcher/command_line.h) and resolves it here, checking every rule that ties flags together
// in one place; main.cpp then builds the agent from the typed result.
#pragma once

#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/error.h"
#include "agent/numa.h"
#include "agent/progress.h"
#include "launcher/endpoint.h"
#include "launcher/options.h"
#include "launcher/values.h"
#include "rendezvous/types.h"

namespace ddp::launcher {

// --rdzv_backend. torchrun's c10d and our ddp both mean the ddp-rendezvous daemon; torchrun's
// etcd and etcd-v2 both mean a rendezvous hosted by the job's agents on etcd (docs/etcd.md).
enum class RendezvousBackend { kStatic, kC10d, kEtcd, kEtcdV2 };
// --env_check.
enum class EnvCheckMode { kStrict, kWarn, kOff };
// --start_method: accepted for compatibility, workers are always new processes.
enum class StartMethod { kSpawn, kFork, kForkserver };

const char* backend_name(RendezvousBackend backend);   // "static", "c10d", "etcd", "etcd-v2"
const char* env_check_name(EnvCheckMode mode);         // "strict", "warn", "off"

// --rdzv_backend=etcd / etcd-v2 (docs/etcd.md "Agents on etcd"): every agent hosts a
// replica of its job's rendezvous in-process; the replicas elect their leader through etcd.
struct EtcdRendezvousConfig {
  // --rdzv_endpoint: etcd's endpoints, "PROTOCOL://HOST:PORT" (port 2379 when absent), in turn.
  std::vector<std::string> endpoints;
  std::string protocol = "http";            // rdzv_conf protocol: http (default) or https
  // rdzv_conf cacert (etcd-v2: ca_cert), cert (ssl_cert), key (ssl_cert_key): TLS files; "" = none.
  std::string ca_file, cert_file, key_file;
  // rdzv_conf etcd_prefix: the job's keys live under PREFIX/<rdzv_id>/. Default /ddplaunch/jobs.
  std::string prefix = "/ddplaunch/jobs";
  int lease_ttl = 5;                        // rdzv_conf etcd_lease_ttl: seconds, 2..600; default 5
  double timeout = 10;                      // rdzv_conf etcd_timeout: seconds to reach etcd at start
  std::string user, password_file;          // rdzv_conf etcd_user, etcd_password_file; "" = none
  // The rdzv_conf keys above that were given, as "key=value", for the warning with other backends.
  std::vector<std::string> given;
};

struct LaunchConfig {
  // --nnodes: MIN:MAX or N (MIN == MAX). Default 1:1.
  int min_nodes = 1;
  int max_nodes = 1;
  // --nproc_per_node resolved to a count (auto/gpu count GPUs, honouring CUDA_VISIBLE_DEVICES;
  // cpu = CPUs this process may run on; auto without GPUs = the CPU count, as torchrun does).
  // Default 1.
  int nproc_per_node = 1;
  RendezvousBackend rdzv_backend = RendezvousBackend::kStatic;
  // --rdzv_endpoint, port 29400 when it names none (c10d). With the static backend it becomes
  // master_addr/master_port instead and stays empty (except with --check_env, which queries the
  // daemon there). Empty with --standalone.
  std::optional<Endpoint> rdzv_endpoint;
  // The rest of a --rdzv_endpoint list (A,B,C): standby daemons the agent fails over to, in order.
  std::vector<Endpoint> rdzv_standby_endpoints;
  // --rdzv_conf reconnect_timeout: how long workers keep running while no rendezvous answers
  // (the agent reconnects through every endpoint meanwhile). Default 60 s.
  double reconnect_timeout = 60;
  std::string rdzv_id = "none";        // run id; a random UUID with --standalone
  // The deadlines of --rdzv_conf (join_timeout, last_call_timeout, heartbeat_interval,
  // heartbeat_timeout, torchrun's keep_alive_interval/keep_alive_max_attempt) and the shutdown
  // grace (--shutdown_timeout, else the rdzv_conf key, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
  // else 30 s), validated; rdzv::Timeouts' defaults for the rest.
  rdzv::Timeouts timeouts;
  std::string token_file;              // --rdzv_conf token_file=PATH; "" = no token
  // --rdzv_conf tls_ca=,tls_cert=,tls_key= (PEM files; "" = $DDPLAUNCH_RDZV_TLS_CA etc., else
  // plain TCP): TLS to the rendezvous, the server's certificate checked (docs/security.md).
  std::string tls_ca, tls_cert, tls_key;
  std::optional<bool> is_host;         // --rdzv_conf is_host=BOOL; unset = decide by address
  EtcdRendezvousConfig etcd;           // --rdzv_backend=etcd / etcd-v2
  // --rdzv_conf keys that have no effect here (read_timeout, timeout, unknown keys), as given.
  std::map<std::string, std::string> unused_rdzv_conf;
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;       // accepted; we watch child exits as events, not by polling
  agent::HangPolicy hang;              // --hang_timeout; default off
  int max_restarts_without_progress = 0;   // --crash_loop_limit; 0 = off
  rdzv::StragglerPolicy straggler;         // --straggler, --straggler_factor, --straggler_window
  bool straggler_given = false;            // one of them was given (a line when it cannot act)
  std::vector<int> no_restart_exit_codes;  // --no_restart_exit_codes; default none
  std::string health_check;                // --check_health; empty = none
  double health_check_interval = 30;       // --check_health_interval, seconds > 0
  StartMethod start_method = StartMethod::kSpawn;
  std::string role = "default";
  bool module = false;                 // -m/--module
  bool no_python = false;              // --no_python
  bool run_path = false;               // --run_path
  bool virtual_local_rank = false;     // --virtual_local_rank
  std::optional<agent::NumaMode> numa_binding;  // --numa_binding; unset = no binding
  enum class Standby { kOff, kOn, kAuto };
  Standby standby = Standby::kAuto;    // --standby; default auto (docs/agent.md)
  std::vector<std::string> preload;    // --preload: module names; default none
  enum class InMemoryRestart { kOff, kOn, kAuto };
  InMemoryRestart in_memory_restart = InMemoryRestart::kAuto;  // --in_memory_restart; default auto
  std::string log_dir;                 // --log_dir; empty = a temporary directory when needed
  StdSpec redirects;                   // -r/--redirects
  StdSpec tee;                         // -t/--tee
  std::vector<int> local_ranks_filter; // empty = all ranks reach the console
  bool log_dedup = false;              // --log_dedup
  double log_dedup_window = 0.25;      // --log_dedup_window, seconds > 0
  // --duplicate_stdout_filters / --duplicate_stderr_filters; empty = copy nothing.
  std::vector<std::string> duplicate_stdout_filters, duplicate_stderr_filters;
  int node_rank = -1;                  // --node_rank; -1 = not given (rendezvous assigns).
                                       // Always >= 0 with the static backend (0 on one node).
  bool spare = false;                  // --spare: wait to replace a node (docs/maintenance.md)
  std::string master_addr = "127.0.0.1";  // static backend; from --rdzv_endpoint when given
  std::optional<int> master_port;      // static backend; unset = 29500 on several nodes, a free
                                       // port per round on one; 0 = pick a free port
  std::string local_addr;              // --local_addr
  std::vector<int> signals_to_handle;  // resolved, never empty: default SIGTERM, SIGINT, SIGHUP,
                                       // SIGQUIT
  std::string signals_to_handle_text = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";  // as given: the
                                       // workers' TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun's
  std::string python = "python3";      // --python, PET_PYTHON, $PYTHON_EXEC, then python3 (the
                                       // wheel's: its environment's, beside the binary)
  bool python_of_environment = false;  // python is that python3 beside the wheel's binary
  EnvCheckMode env_check = EnvCheckMode::kStrict;  // --env_check
  std::string env_lock;                // --env_lock FILE
  bool check_env = false;              // --check_env
  // The options Slurm's variables supplied (launcher/slurm.h), one "--flag=value (VARIABLE)"
  // each, for the start-up line; empty outside a Slurm allocation.
  std::vector<std::string> from_slurm;
  std::string event_log;               // --event_log FILE ('-' = stderr); "" = none
  std::optional<int> metrics_port;     // --metrics_port; unset = no metrics server
  std::string metrics_addr = "127.0.0.1";  // --metrics_addr (docs/metrics.md)
  std::string program;                 // training script, module or executable
  std::vector<std::string> program_args;
};

// What parse_command_line() needs from the world besides argv and the environment; tests swap
// these. The defaults write to std::cout/std::cerr and count this machine's GPUs and CPUs.
struct ParseContext {
  std::ostream* out = nullptr;        // --help and --version; nullptr = std::cout
  std::ostream* err = nullptr;        // warnings (the parse goes on); nullptr = std::cerr
  std::function<int()> count_gpus;    // empty = agent::count_visible_gpus()
  std::function<int()> count_cpus;    // empty = agent::count_usable_cpus()
};

// Parses argv (and the PET_ environment). Throws LaunchError on bad input. `--help` prints the
// help to stdout and throws LaunchError with code kSuccess and an empty message; `--version`
// does the same with the version. Does no file or process I/O, except counting GPUs when
// --nproc_per_node is auto or gpu. Warnings (ignored --rdzv_conf keys, flags that --standalone
// overrides) go to stderr.
LaunchConfig parse_command_line(int argc, const char* const* argv);
LaunchConfig parse_command_line(int argc, const char* const* argv, const ParseContext& context);

}  // namespace ddp::launcher
