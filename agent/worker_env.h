// What each worker is started with: its command line and the environment of docs/architecture.md
// ("The worker environment"), built here and nowhere else: the round's variables, the agent's own
// (heartbeat slot, file timer, Python helpers), the worker channel and a standby's socket.
// Pure functions of plain inputs except interface_towards(), current_environment() and
// pick_free_port(), which ask the system; no processes. Any thread. Tested in tests/agent.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "rendezvous/error.h"
#include "rendezvous/types.h"

namespace ddp::agent {

// How the program is run (torchrun's --no_python, -m, --run_path).
struct WorkerCommand {
  std::string python = "python3";  // interpreter for Python workers (--python / $PYTHON_EXEC)
  bool no_python = false;          // execute `program` directly
  bool module = false;             // python -u -m program args
  bool run_path = false;           // python -u -c <runpy.run_path(program)> program args
  std::string program;
  std::vector<std::string> args;
};

// argv of every worker of the command (the same for each local rank).
std::vector<std::string> worker_argv(const WorkerCommand& command);

// The per-round facts every worker of this node shares.
struct RoundEnv {
  rdzv::Assignment assignment;
  int local_world_size = 1;
  std::string role = "default";
  std::string run_id = "none";
  bool set_omp_num_threads = false;  // OMP_NUM_THREADS=1 (unset and local_world_size > 1)
  // GLOO_SOCKET_IFNAME for the workers: the interface this node reaches MASTER_ADDR through, when
  // the user set none and the job spans nodes. Empty = leave it alone. Gloo otherwise binds to
  // the address of the hostname, which Debian maps to 127.0.1.1 and namespaces to 127.0.0.1.
  std::string gloo_socket_ifname;
  // --virtual_local_rank: every worker sees LOCAL_RANK=0 and only its own device
  // (CUDA_VISIBLE_DEVICES, and HIP_VISIBLE_DEVICES when set, narrowed to entry LOCAL_RANK of
  // the agent's list, or to "LOCAL_RANK" when the agent's is unset), as torchrun 2.x does.
  bool virtual_local_rank = false;
};

// The name of the interface whose address this host uses to reach `addr` (a routing lookup
// through a connected UDP socket; nothing is sent). Empty when `addr` is a loopback address,
// not an IPv4/IPv6 literal, or unreachable.
std::string interface_towards(const std::string& addr);

// The variables the agent adds to (or overrides in) its own environment for one worker.
// `inherited` is the agent's environment; NCCL error-handling variables keep a value set there.
// Throws LaunchError (exit 2) with virtual_local_rank when the inherited device list has no
// entry for `local_rank`.
std::map<std::string, std::string> worker_env(const RoundEnv& round, int local_rank,
                                              const std::string& error_file,
                                              const std::map<std::string, std::string>& inherited);

// What this agent gives every worker besides the round, the same in every round.
struct WorkerSetup {
  std::string progress_file;      // DDPLAUNCH_PROGRESS_FILE (slot: the local rank); empty: none
  std::string timer_file;         // TORCHELASTIC_TIMER_FILE (torch's file timer); empty: none
  bool python = true;             // a Python worker: the two below apply (false: --no_python)
  std::string python_helper_dir;  // appended to PYTHONPATH (`import ddplaunch`); empty: none
  // PYTHONFAULTHANDLER=1 unless the agent's environment sets it: a hung worker's stacks, printed
  // by faulthandler on SIGABRT (--hang_timeout). Default false.
  bool fault_handler = false;
  // DDPLAUNCH_ENV_FINGERPRINT and DDPLAUNCH_ENV_CHECK, for the lineage that checkpoints record
  // (docs/checkpoints.md); both unset when env_digest is empty (default).
  std::string env_digest;
  std::string env_check;
};

// The complete environment of the worker of `local_rank` in `round`: the agent's own
// (`inherited`), the round's variables (worker_env()), then `setup`'s. No channel: see
// set_worker_channel().
std::map<std::string, std::string> build_worker_env(const RoundEnv& round, const WorkerSetup& setup, int local_rank,
                                                    const std::string& error_file,
                                                    const std::map<std::string, std::string>& inherited);

// The complete environment of a standby (agent/standby.h): the agent's, what every worker of
// this node gets in every round and must have before torch loads (OMP_NUM_THREADS sizes its
// thread pool at import; the Python helpers), and DDPLAUNCH_STANDBY_FD=`standby_fd`; nothing of
// any round.
std::map<std::string, std::string> build_standby_env(const WorkerSetup& setup, int local_world_size, int standby_fd,
                                                     const std::map<std::string, std::string>& inherited);

// DDPLAUNCH_WORKER_FD=`fd` in `env` (in-memory restart: the worker's end of its channel), or no
// such variable when `fd` < 0.
void set_worker_channel(std::map<std::string, std::string>& env, int fd);

// The agent's own environment as a map.
std::map<std::string, std::string> current_environment();

// Whether OMP_NUM_THREADS should be set to 1 for the workers (torchrun's rule).
bool should_set_omp_num_threads(int local_world_size,
                                const std::map<std::string, std::string>& inherited);

// A TCP port that was free on `addr` a moment ago (bind port 0, read it, close). Used for
// MASTER_PORT on a single node and for NodeSpec.master_port when joining a multi-node round.
// Throws LaunchError when no socket can be bound.
int pick_free_port(const std::string& addr = "127.0.0.1");

}  // namespace ddp::agent
