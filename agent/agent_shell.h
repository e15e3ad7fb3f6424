#pragma once

// The agent's shell (private to agent/): it owns the io_context's timers, the processes, pipes,
// channels, sockets and the progress board, tells the Supervisor (agent/supervisor.h) what
// happened, and carries out what it decided. It decides nothing about the lifecycle itself; what
// it still does beside it are the features that feed the supervisor events: standbys (the
// StandbySchedule), hangs and torch's file timer (HangWatch, DumpQueue, FileTimers), health
// checks (HealthSchedule), and how a worker starts (a parked worker, a standby, or a fresh
// process).
//
//   agent.cpp           events in, effects out, the rendezvous, signals, the end
//   agent_start.cpp     a round's workers: output plan, environment, which process becomes each
//   agent_features.cpp  standbys, hangs, the file timer, health checks, the workers' channels

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include "agent/agent.h"
#include "agent/console_dedup.h"
#include "agent/file_timer.h"
#include "agent/hang_policy.h"
#include "agent/health_schedule.h"
#include "agent/logs.h"
#include "agent/stall_watch.h"
#include "agent/standby_schedule.h"
#include "agent/supervisor.h"
#include "agent/tee_pipe.h"
#include "agent/worker_link.h"
#include "contracts/worker_channel.h"

namespace ddp::agent {

double monotonic_seconds();
double wall_seconds();
// The value of `name` in /proc/<pid>/environ (what the process was started with); empty when
// absent or unreadable.
std::string environ_value(int pid, const std::string& name);

// What the shell holds of a worker: its output, files and channel. What it is (alive, hung,
// parked ...) is the supervisor's (SupervisedWorker).
struct WorkerIo {
  int local_rank = 0;
  int rank = 0;
  int pid = 0;
  std::string error_file;
  std::vector<std::shared_ptr<TeePipe>> pipes;
  std::shared_ptr<LineTail> stderr_tail;  // when stderr passes through the agent (tee)
  std::string stdout_log, stderr_log;     // paths, when redirected or tee'd to a file
  std::string note;                       // why the agent stopped it; heads its failure message
  // In-memory restart (docs/agent.md, "In-memory restart: the worker channel"): the agent's end
  // of its channel (null without one), the step it parked at, and its DDPLAUNCH_SUPERVISOR
  // value, for the environment of its next assignment.
  std::shared_ptr<WorkerLink> link;
  std::int64_t parked_step = -1;
  std::string marker;
};

struct Agent::Impl {
  Impl(boost::asio::io_context& io, AgentOptions options, std::unique_ptr<RendezvousHandler> rendezvous,
       std::unique_ptr<Processes> processes);

  boost::asio::io_context& io;
  AgentOptions options;
  std::unique_ptr<RendezvousHandler> rendezvous;
  std::unique_ptr<Processes> processes;
  Supervisor core;
  std::deque<Effect> effects;  // decided, not yet carried out (carried out in order)
  bool carrying_out = false;
  int exit_code = 0;  // before the loop runs (the file timer could not start)
  boost::asio::signal_set signals;
  // The supervisor's deadlines (Deadline), one timer each.
  boost::asio::steady_timer kill_timer;
  boost::asio::steady_timer give_up_timer;
  boost::asio::steady_timer park_timer;
  // The features' own.
  boost::asio::steady_timer progress_timer;   // samples the progress board (--hang_timeout)
  boost::asio::steady_timer stall_timer;      // samples it for stalls (a rendezvous shared with other nodes)
  boost::asio::steady_timer dump_timer;       // SIGKILLs hung workers that did not die of their dump signal
  boost::asio::steady_timer dump_step_timer;  // the next hung worker's dump signal, if the last one lives on
  DumpQueue dumps;                            // hung workers whose dump signal waits its turn
  boost::asio::steady_timer health_timer;     // the next --check_health (retry before a join, or periodic)
  boost::asio::steady_timer health_deadline;  // kills a check that runs too long
  boost::asio::steady_timer standby_timer;    // starts the next standbys once the round is up
  boost::asio::steady_timer standby_ready_timer;  // joins without the standbys' word (standby_ready_timeout)
  // Tee'd output into log files: its own queue and thread, so a stalled console does not
  // hold up the files, nor a hung file system the console. 64 MiB before bytes are dropped.
  std::shared_ptr<OutputQueue> files = std::make_shared<OutputQueue>("the log file system", 64 << 20);
  // <attempt dir>/filtered_{stdout,stderr}.log of the current attempt ([0] stdout, [1] stderr).
  int filtered_fds[2] = {-1, -1};
  int filtered_attempt = -1;
  // --log_dedup: collapses the workers' identical console lines; null when off.
  std::shared_ptr<ConsoleDedup> dedup;
  std::vector<int> dedup_ranks[2];  // this round's ranks whose stdout [0] / stderr [1] go through it
  std::map<std::string, std::string> inherited;
  // Standbys: the standby waiting for each local rank's next worker (pid 0: none), with the
  // agent's end of its socket.
  struct Standby {
    int pid = 0;
    int fd = -1;
    int child_fd = -1;  // the number of the standby's end in the standby (DDPLAUNCH_STANDBY_FD)
    // While the agent waits to join: watches `fd` for the standby's standby_ready frame.
    std::shared_ptr<boost::asio::posix::stream_descriptor> watch;
    WorkerChannelDecoder ready_decoder;
  };
  std::vector<Standby> standbys;
  std::string cwd;  // the workers' (empty when unknown: standbys cannot be used)
  std::vector<WorkerIo> workers;
  // In-memory restart: the parked workers of the last round, by local rank, between the moment a
  // round completes and their assignment (start_round).
  std::map<int, WorkerIo> parked_workers;
  bool omp_warned = false;
  ProgressBoard board;  // the workers' heartbeats
  std::unique_ptr<FileTimerServer> file_timer;  // TORCHELASTIC_ENABLE_FILE_TIMER=1
  HangWatch hang;
  StallWatch stalls;
  StandbySchedule standby_schedule;
  HealthSchedule health;
  std::vector<int> previous_pids;  // of the last round's workers (the built-in GPU check looks for them)

  // ---- agent.cpp: events in, effects out ----
  int run();
  void deliver(const Event& e);
  void carry_out(const Effect& fx);
  void record_event(const std::string& type, const std::string& cause, std::vector<int> ranks,
                    nlohmann::json fields, const std::string& message, std::uint64_t generation);
  void record_failure(const effect::RecordFailure& r);
  void join_now();
  void before_decision();
  void wait_for_signal();
  void exited(int pid, ExitStatus st);
  void release_everything();
  void flush_output();
  void flush_worker_lines();
  void close_filtered_files();
  boost::asio::steady_timer& timer(Deadline d);
  WorkerIo* worker_io(int pid);
  static void arm(boost::asio::steady_timer& timer, double at, std::function<void()> then);

  // ---- agent_start.cpp: a round's workers ----
  void start_round(const effect::StartRound& s);
  std::vector<int> forget_unstarted(const std::exception& e);
  std::string describe_round(const rdzv::Assignment& a) const;
  const std::string& log_subdir() const;
  WorkerSetup worker_setup() const;
  struct OutputPlan;
  void setup_stream(WorkerIo& w, const OutputPlan& plan, int bit, int& child_fd, std::vector<int>& close_after_spawn);
  int filtered_fd(int stream, int attempt);
  void start_worker(const RoundEnv& round, int local_rank, const std::vector<std::string>& argv);
  enum class StartedAs { kCold, kStandby, kInMemory };
  int start_process(SpawnRequest& req, WorkerIo& w, StartedAs& how);
  int spawn_cold(SpawnRequest& req, WorkerIo& w);
  bool resume(WorkerIo& parked, SpawnRequest& req);
  void drop_parked();
  bool assign(const Standby& sb, int local_rank, SpawnRequest& req, WorkerIo& w);

  // ---- agent_features.cpp ----
  std::vector<std::string> standby_argv() const;
  void start_standbys();
  void start_standby(int local_rank, const std::vector<std::string>& argv);
  void join_when_standbys_ready();
  void watch_standby(int local_rank);
  void on_standby_readable(int local_rank);
  void unwatch(Standby& sb);
  void join_if_standbys_ready(int local_rank);
  void schedule_standbys();
  void look_for_standby_start(double at);
  bool round_has_stepped() const;
  bool standby_keeps_channel() const { return options.in_memory_restart; }
  void on_standby_exit(Standby& sb, ExitStatus st);
  void stop_standbys();
  void sample_progress(double now);
  void schedule_progress_check();
  void declare_hangs(const HangVerdict& verdict);
  void schedule_stall_watch();
  void send_next_dump();
  bool start_file_timer();
  void on_timer_expired(const TimerRequest& r);
  void start_link(WorkerIo& w);
  void on_worker_message(int pid, const WorkerMessage& m);
  std::string health_log_path() const;
  void run_health_check(HealthPurpose purpose);
  void on_health_exit(ExitStatus st);
  void on_health_result(HealthPurpose purpose, bool ok, const std::string& why);
  void schedule_health_check(double at);
};

}  // namespace ddp::agent
