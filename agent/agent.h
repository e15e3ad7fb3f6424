// The agent: supervises this node's worker group for one job. It joins a round through its
// RendezvousHandler, starts nproc workers with the environment of docs/architecture.md, watches them
// (child exit is an event), stops the whole group when one fails, reports to the rendezvous,
// and restarts them or ends the job as the rendezvous decides. It forwards the signals it
// handles to the workers and owns their console/log output.
//
// Created by launcher/launch.cpp; lives for one ddplaunch run. Single-threaded: every method,
// callback and handler runs on the io_context thread that calls run(). That thread must be the
// one that stays alive for the whole run: the workers' parent-death signal is tied to it.
#pragma once

#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "agent/numa.h"
#include "agent/process.h"
#include "agent/progress.h"
#include "agent/rendezvous_handler.h"
#include "agent/worker_env.h"
#include "metrics/event.h"
#include "rendezvous/types.h"

namespace ddp::agent {

struct AgentOptions {
  // This node as the rendezvous sees it. The agent reads local_world_size (nproc), host (for
  // failure reports), job_id; it sets master_port before each join() when pick_master_port.
  rdzv::NodeSpec node;
  WorkerCommand command;
  std::string role = "default";       // ROLE_NAME, and the default console prefix
  std::string run_id = "none";        // TORCHELASTIC_RUN_ID and the log sub-directory
  // Root of <log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log, error.json.
  // REQUIRES: not empty (launch.cpp makes a temporary one when --log_dir is not given).
  std::string log_dir;
  std::vector<int> redirects;         // StdBits per local rank; missing ranks: none. Default none.
  std::vector<int> tee;               // StdBits per local rank; missing ranks: none. Default none.
  std::vector<int> local_ranks_filter;  // only these ranks reach the console; empty = all
  std::string line_prefix_template;   // TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE; empty = [role0]:
  // --log_dedup: the console streams of the shown ranks pass through the agent, and a line that
  // several local ranks print within `log_dedup_window` is written once, naming them
  // (agent/line_dedup.h). Default off: un-tee'd streams go to the console directly.
  bool log_dedup = false;
  std::chrono::milliseconds log_dedup_window{250};
  double shutdown_timeout = 30.0;     // seconds between SIGTERM and SIGKILL
  // Seconds after SIGKILL before a worker that still has not exited (stuck in the kernel) is
  // given up on, with a message naming its pid, so that the agent goes on. Default 30.
  double kill_timeout = 30.0;
  // torchrun 2.x --duplicate-stdout-filters / --duplicate-stderr-filters: tee'd lines that
  // contain any of these strings are also written, prefixed, to
  // <log_dir>/<run_id>/attempt_<n>/filtered_stdout.log / filtered_stderr.log. Default none.
  std::vector<std::string> duplicate_stdout_filters, duplicate_stderr_filters;
  std::vector<int> signals = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};  // forwarded to the workers
  // Pick a free port (pick_free_port(master_port_bind_addr)) into node.master_port before each
  // join(). Default on: single-node jobs get a fresh MASTER_PORT every round.
  bool pick_master_port = true;
  std::string master_port_bind_addr = "127.0.0.1";
  // --virtual_local_rank (RoundEnv::virtual_local_rank). Default off.
  bool virtual_local_rank = false;
  // --numa_binding: the binding of each local rank (agent/numa.h); empty = none (default).
  std::vector<NumaBinding> numa_bindings;
  // --hang_timeout (agent/progress.h): a rank whose heartbeats stop for longer is a failure.
  // Default off.
  HangPolicy hang;
  // Keep one standby process per local rank for the next round (agent/standby.h). For
  // a Python command: python_helper_dir/ddplaunch_standby.py under command.python, which imports
  // torch and `preload` and then waits for its assignment. For a no_python command: the program
  // itself, which must wait inside the worker SDK (worker_sdk/src/standby.h). REQUIRES: one of
  // those; the launcher decides (--standby). Default off: every worker starts cold.
  bool standby = false;
  // With `standby`: the first round's workers come from standbys too, and the agent joins once
  // they have loaded (--standby=on). Otherwise (auto) the first round starts cold at once, and
  // standbys start once it is up: a job that ends before its first step never pays for them.
  bool standby_first_round = false;
  std::vector<std::string> preload;  // --preload: modules a standby imports besides torch
  // In-memory restart (contracts/worker_channel.h, docs/agent.md). Every worker gets
  // a channel to the agent (DDPLAUNCH_WORKER_FD); at a restart, a worker that said it is
  // restartable is asked to park (its slot's abandoned word) instead of being stopped, and is sent
  // the next round's assignment on its channel. Default off; the launcher decides
  // (--in_memory_restart).
  bool in_memory_restart = false;
  // Seconds a restartable worker has to park after a restart began; past them it is stopped like
  // any worker (SIGTERM, SIGKILL after shutdown_timeout). Default 10.
  double park_timeout = 10.0;
  // When the next standbys start after a round's workers started: once every worker reported a
  // step on the progress board, but not before standby_delay and at the latest standby_delay_max
  // (programs that report no steps). Their imports compete for CPU with the new workers' start.
  // Defaults 0 and 10 s: a step is the sign that the round is up, and a failure soon after it
  // (tests crash a node 10 steps in) should still find a standby, loaded or loading.
  double standby_delay = 0.0;
  double standby_delay_max = 10.0;
  // Seconds an agent that starts with standbys waits for each to say it has loaded
  // ({"type": "standby_ready"}) before it joins the job; past them it joins anyway. A node that
  // comes back into a running job then costs the others a restart of ~0.2 s instead of the whole
  // load of its workers (docs/agent.md, "Standby workers"). Default 30
  // (DDPLAUNCH_STANDBY_READY_TIMEOUT).
  double standby_ready_timeout = 30.0;
  // A directory holding the `ddplaunch` Python helper, appended to PYTHONPATH of Python
  // workers so that `import ddplaunch` works. Empty (default): PYTHONPATH is left alone.
  std::string python_helper_dir;
  // The environment digest of this node (agent::environment_digest()), exported to workers as
  // DDPLAUNCH_ENV_FINGERPRINT with node.env_check as DDPLAUNCH_ENV_CHECK, so that checkpoints can
  // record which environment wrote them. Empty (default): neither is exported.
  std::string env_digest;
  // TORCHELASTIC_ENABLE_FILE_TIMER=1: the FIFO the agent serves torch's FileTimerClient on
  // (agent/file_timer.h), exported as TORCHELASTIC_TIMER_FILE. Empty (default): off.
  std::string file_timer_path;
  // --crash_loop_limit: after this many restarts in a row during which no rank
  // reported a step or a checkpoint beyond the best seen so far, the job fails. 0 (default): off.
  int max_restarts_without_progress = 0;
  // --no_restart_exit_codes: a worker exiting with one of these ends the job at once. Default none.
  std::vector<int> no_restart_exit_codes;
  // --check_health: a shell command (/bin/sh -c) run before this node joins each round (it
  // stays out, retrying every health_check_interval, until the command exits 0) and every
  // health_check_interval seconds while its workers run (a failure is this node's failure).
  // "gpu" runs only the built-in GPU check. Empty (default): no checks.
  std::string health_check;
  double health_check_interval = 30;  // seconds; > 0
  double health_check_timeout = 60;   // a check still running after this fails (killed)
  // One line per completed round (generation, this node's ranks, world size,
  // master). Default off; the launcher turns it on wherever nodes wait for each other.
  bool announce_rounds = false;
  // The sub-directory of log_dir for this run's logs; empty (default) = run_id.
  std::string log_subdir;
  // Where the agent's lifecycle events go (round, worker_started, worker_exited with
  // its cause, restart, job_end): the event log and the metrics. The failure summary is built
  // from the same records. Null (default) = nowhere.
  std::shared_ptr<metrics::EventSink> events;
  // Each sample of a worker's progress slot that has reported (local rank, its last
  // step, monotonic seconds), at most once a second per worker without --hang_timeout (the
  // agent's metrics: last step, steps per second). Null (default) = none.
  std::function<void(int local_rank, int64_t step, double time)> on_progress;
};

class Agent {
 public:
  // `processes` defaults to the real POSIX implementation on `io`.
  Agent(boost::asio::io_context& io, AgentOptions options,
        std::unique_ptr<RendezvousHandler> rendezvous, std::unique_ptr<Processes> processes = nullptr);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Joins the first round and runs `io` until the job ends. Returns ddplaunch's exit code
  // (ddp::ExitCode: 0, 1, 2 when a worker cannot be started, 3, or 128+N).
  int run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddp::agent
