#include "agent/agent.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/filesystem.hpp>

#include "agent/console_dedup.h"
#include "agent/containment.h"
#include "agent/crash_loop.h"
#include "agent/devices.h"
#include "agent/exit_codes.h"
#include "agent/failure.h"
#include "agent/failure_policy.h"
#include "agent/file_timer.h"
#include "agent/hang_policy.h"
#include "agent/health_schedule.h"
#include "agent/logs.h"
#include "agent/park_policy.h"
#include "agent/policy.h"
#include "agent/progress_line.h"
#include "agent/shutdown_policy.h"
#include "agent/standby.h"
#include "agent/standby_schedule.h"
#include "agent/tee_pipe.h"
#include "contracts/worker_channel.h"
#include "agent/worker_link.h"

namespace asio = boost::asio;

namespace ddp::agent {

namespace {

double monotonic_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// A time of monotonic_seconds() as the steady clock's time point.
std::chrono::steady_clock::time_point steady_time(double seconds) {
  using namespace std::chrono;
  return steady_clock::time_point(duration_cast<steady_clock::duration>(duration<double>(seconds)));
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

int open_log(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

struct Worker {
  int local_rank = 0;
  int rank = 0;
  int pid = 0;
  bool alive = false;
  ExitStatus status;
  std::string error_file;
  std::vector<std::shared_ptr<TeePipe>> pipes;
  std::shared_ptr<LineTail> stderr_tail;  // when stderr passes through the agent (tee)
  std::string stdout_log, stderr_log;     // paths, when redirected or tee'd to a file
  bool given_up = false;                  // did not exit after SIGKILL (stuck in the kernel)
  bool python = false;                    // runs under the Python interpreter (faulthandler)
  bool hung = false;                      // declared hung: its exit is a failure, whatever its status
  bool recorded = false;                  // its failure is in `failures`
  std::string note;                       // why the agent stopped it; heads its failure message
  // In-memory restart (docs/agent.md, "In-memory restart: the worker channel"): the agent's end
  // of its channel (null without one), what it last said, and where it stands at a restart
  // (agent/park_policy.h).
  std::shared_ptr<WorkerLink> link;
  bool restartable = false;
  ParkState park = ParkState::kNo;
  int64_t parked_step = -1;
  std::string marker;  // its DDPLAUNCH_SUPERVISOR value, for the environment of its next assignment
};

// The value of `name` in the environment block /proc/<pid>/environ (what the process was
// started with); empty when absent or unreadable.
std::string environ_value(int pid, const std::string& name) {
  const int fd = ::open(("/proc/" + std::to_string(pid) + "/environ").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string block;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || block.size() > (4u << 20)) break;
    block.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  const std::string prefix = name + "=";
  for (std::size_t at = 0; at < block.size();) {
    std::size_t end = block.find('\0', at);
    if (end == std::string::npos) end = block.size();
    if (block.compare(at, prefix.size(), prefix) == 0) return block.substr(at + prefix.size(), end - at - prefix.size());
    at = end + 1;
  }
  return {};
}

// The agent's working directory, which its workers inherit; empty when it cannot be named (it
// was removed): a standby then cannot be told it, and its worker starts cold.
std::string working_directory() {
  std::vector<char> buf(4096);
  for (;;) {
    if (::getcwd(buf.data(), buf.size()) != nullptr) return buf.data();
    if (errno != ERANGE || buf.size() > (1u << 20)) return {};
    buf.resize(buf.size() * 2);
  }
}

int std_bits(const std::vector<int>& per_rank, int local_rank) {
  return local_rank < static_cast<int>(per_rank.size()) ? per_rank[local_rank] : kStdNone;
}

}  // namespace

struct Agent::Impl {
  enum class State { kJoining, kRunning, kStopping, kIdle, kDone };

  Impl(asio::io_context& io, AgentOptions options, std::unique_ptr<RendezvousHandler> rendezvous,
       std::unique_ptr<Processes> processes)
      : io(io),
        options(std::move(options)),
        rendezvous(std::move(rendezvous)),
        processes(processes ? std::move(processes) : make_posix_processes(io)),
        signals(io),
        kill_timer(io),
        give_up_timer(io),
        progress_timer(io),
        dump_timer(io),
        dump_step_timer(io),
        health_timer(io),
        health_deadline(io),
        standby_timer(io),
        standby_ready_timer(io),
        park_timer(io),
        inherited(current_environment()),
        standbys(static_cast<std::size_t>(std::max(0, this->options.node.local_world_size))),
        board(this->options.node.local_world_size),
        grace(this->options.shutdown_timeout, this->options.kill_timeout),
        hang(this->options.hang, this->options.node.local_world_size),
        crash_loop(this->options.max_restarts_without_progress, this->options.no_restart_exit_codes),
        standby_schedule(this->options.standby_delay, this->options.standby_delay_max,
                         this->options.standby_ready_timeout),
        parking(this->options.in_memory_restart, this->options.park_timeout),
        health(this->options.health_check, this->options.health_check_interval,
               this->options.health_check_timeout) {
    if (this->options.log_dedup) dedup = std::make_shared<ConsoleDedup>(io, this->options.log_dedup_window);
  }

  asio::io_context& io;
  AgentOptions options;
  std::unique_ptr<RendezvousHandler> rendezvous;
  std::unique_ptr<Processes> processes;
  asio::signal_set signals;
  asio::steady_timer kill_timer;
  asio::steady_timer give_up_timer;
  asio::steady_timer progress_timer;  // samples the progress board (--hang_timeout)
  asio::steady_timer dump_timer;      // SIGKILLs hung workers that did not die of their dump signal
  asio::steady_timer dump_step_timer;  // the next hung worker's dump signal, if the last one lives on
  DumpQueue dumps;                    // hung workers whose dump signal waits its turn
  asio::steady_timer health_timer;    // the next --check_health (retry before a join, or periodic)
  asio::steady_timer health_deadline; // kills a check that runs too long
  asio::steady_timer standby_timer;   // starts the next standbys once the round is up (schedule_standbys)
  asio::steady_timer standby_ready_timer;  // joins without the standbys' word (standby_ready_timeout)
  asio::steady_timer park_timer;      // stops the workers asked to park that did not (park_timeout)
  // Tee'd output into log files: its own queue and thread, so a stalled console does not
  // hold up the files, nor a hung file system the console. 64 MiB before bytes are dropped.
  std::shared_ptr<OutputQueue> files = std::make_shared<OutputQueue>("the log file system", 64 << 20);
  // <attempt dir>/filtered_{stdout,stderr}.log of the current attempt ([0] stdout, [1] stderr).
  int filtered_fds[2] = {-1, -1};
  // --log_dedup: collapses the workers' identical console lines; null when off.
  std::shared_ptr<ConsoleDedup> dedup;
  std::vector<int> dedup_ranks[2];  // this round's ranks whose stdout [0] / stderr [1] go through it
  int filtered_attempt = -1;
  std::map<std::string, std::string> inherited;
  // Standbys: the standby waiting for each local rank's next worker (pid 0: none), with the
  // agent's end of its socket.
  struct Standby {
    int pid = 0;
    int fd = -1;
    int child_fd = -1;  // the number of the standby's end in the standby (DDPLAUNCH_STANDBY_FD)
    // While the agent waits to join: watches `fd` for the standby's standby_ready frame.
    std::shared_ptr<asio::posix::stream_descriptor> watch;
    WorkerChannelDecoder ready_decoder;
  };
  std::vector<Standby> standbys;
  std::string cwd = working_directory();  // the workers' (empty when unknown: standbys cannot be used)
  std::vector<Worker> workers;
  // In-memory restart: the parked workers of the last round, by local rank, between the moment a
  // round completes and their assignment (on_round).
  std::map<int, Worker> parked_workers;
  std::vector<LocalFailure> failures;  // of the current round, in the order observed
  std::vector<LocalFailure> last_failures;  // of the round that ended with a failure
  std::function<void()> after_stop;
  bool failure_report_pending = false;  // a failure was seen; its report is posted, not yet sent
  State state = State::kIdle;
  int exit_code = static_cast<int>(ExitCode::kSuccess);
  int handled_signal = 0;
  bool omp_warned = false;
  ProgressBoard board;   // the workers' heartbeats
  std::unique_ptr<FileTimerServer> file_timer;  // TORCHELASTIC_ENABLE_FILE_TIMER=1
  // The policies (agent/*_policy.h, agent/*_schedule.h): they decide, Impl carries it out.
  ShutdownGrace grace;
  HangWatch hang;
  CrashLoopPolicy crash_loop;  // the job's end instead of a restart: no-restart codes, crash loops
  StandbySchedule standby_schedule;
  ParkPolicy parking;
  HealthSchedule health;
  int round_restart_count = 0;
  bool fatal_reported = false;  // the rendezvous was told crash_loop.reason() (a fatal failure report)
  std::optional<rdzv::WorkerFailure> reported_this_round;  // what this node reported, if anything
  std::vector<int> previous_pids;  // of the last round's workers (the built-in GPU check looks for them)
  std::uint64_t generation = 0;  // of the current (or last) round; 0 before the first

  // The one place the agent records a lifecycle event: the event log and the metrics
  // consume it.
  void record_event(const char* type, const std::string& cause, std::vector<int> ranks,
                    nlohmann::json fields = nlohmann::json::object(), const std::string& message = "") {
    if (!options.events) return;
    metrics::Event e;
    e.type = type;
    e.job = options.run_id;
    e.node = options.node.host;
    e.generation = generation;
    e.ranks = std::move(ranks);
    e.cause = cause;
    e.message = message;
    e.fields = std::move(fields);
    e.time = metrics::wall_time();
    options.events->record(e);
  }

  static nlohmann::json exit_fields(const Worker& w) {
    return {{"local_rank", w.local_rank}, {"pid", w.pid}, {"exit_code", w.status.exit_code}, {"signal", w.status.signal}};
  }

  // Runs `then` at `at` (monotonic_seconds()) unless `timer` is cancelled or re-armed first: how
  // the deadlines the policies name are kept.
  static void arm(asio::steady_timer& timer, double at, std::function<void()> then) {
    timer.expires_at(steady_time(at));
    timer.async_wait([then = std::move(then)](const boost::system::error_code& ec) {
      if (!ec) then();
    });
  }

  // ---- the workers as the policies see them ------------------------------------------------

  static WorkerRef ref(const Worker& w) { return {w.pid, w.rank, w.local_rank}; }

  ParkView park_view(const Worker& w) const {
    return {ref(w), w.alive, w.restartable, w.hung, w.link && w.link->is_open(), w.park};
  }

  // Whether `w` is kept across the stop in progress (in-memory restart): asked to park, or parked.
  bool kept(const Worker& w) const { return ParkPolicy::kept(park_view(w)); }

  // Every worker has exited or parked: the stop is over.
  bool settled() const {
    std::vector<ParkView> views;
    for (const auto& w : workers) views.push_back(park_view(w));
    return ParkPolicy::settled(views);
  }

  // The workers a stop waits for: live, not kept.
  std::vector<WorkerRef> still_running() const {
    std::vector<WorkerRef> out;
    for (const auto& w : workers) {
      if (w.alive && !kept(w)) out.push_back(ref(w));
    }
    return out;
  }

  int run() {
    RendezvousEvents events;
    events.on_round = [this](const rdzv::Assignment& a) { on_round(a); };
    events.on_restart = [this](const std::string& reason, bool counted, bool failing, bool failure) {
      on_restart(reason, counted, failing, failure);
    };
    events.on_job_succeeded = [this] { finish(static_cast<int>(ExitCode::kSuccess)); };
    events.on_job_failed = [this](const rdzv::WorkerFailure& f, const std::string& s) { on_job_failed(f, s); };
    events.on_rendezvous_error = [this](const std::string& m) { on_rendezvous_error(m); };
    rendezvous->set_events(std::move(events));
    rendezvous->set_progress_source([this] {
      std::vector<ProgressSample> samples;
      for (int slot = 0; slot < board.slots(); ++slot) samples.push_back(board.read(slot));
      return summarize(samples);
    });
    processes->set_exit_handler([this](int pid, ExitStatus st) { on_exit(pid, st); });
    for (int signo : options.signals) {
      boost::system::error_code ec;
      signals.add(signo, ec);
      if (ec) say("cannot handle signal " + std::to_string(signo) + ": " + ec.message());
    }
    // A closed console must not kill the agent (and with it, every worker): writes fail instead.
    ::signal(SIGPIPE, SIG_IGN);
    if (!options.file_timer_path.empty() && !start_file_timer()) {
      flush_output();
      return exit_code;
    }
    wait_for_signal();
    if (options.standby_first_round) start_standbys();
    join_when_standbys_ready();
    io.run();
    flush_output();
    return exit_code;
  }

  // Gives the queued output (the failure summary among it) a bounded time to reach the console
  // and the log files: a console nobody reads must not keep ddplaunch from exiting.
  void flush_output() {
    flush_worker_lines();
    close_filtered_files();
    const auto deadline = std::chrono::seconds(10);
    if (!files->flush(deadline)) say("log files: gave up waiting for the file system to take the last output");
    if (files->dropped() > 0) {
      say("log files: " + std::to_string(files->dropped()) +
          " chunk(s) of worker output were dropped because the file system did not keep up");
    }
    if (OutputQueue::console().dropped() > 0) {
      say(std::to_string(OutputQueue::console().dropped()) +
          " line(s) of output were dropped in all because the console did not keep up");
    }
    OutputQueue::console().flush(deadline);
  }

  // The workers' lines that --log_dedup still holds go out before the agent speaks of them.
  void flush_worker_lines() {
    if (dedup) dedup->flush();
  }

  void close_filtered_files() {
    for (int& fd : filtered_fds) {
      if (fd >= 0) files->close_after(fd);
      fd = -1;
    }
  }

  // The filtered file of `stream` (0 stdout, 1 stderr) for `attempt`, opened on first use;
  // -1 when that stream has no filters.
  int filtered_fd(int stream, int attempt) {
    const auto& filters = stream == 0 ? options.duplicate_stdout_filters : options.duplicate_stderr_filters;
    if (filters.empty()) return -1;
    if (attempt != filtered_attempt) {
      close_filtered_files();
      filtered_attempt = attempt;
    }
    if (filtered_fds[stream] < 0) {
      const std::string dir = boost::filesystem::path(worker_log_dir(options.log_dir, log_subdir(), attempt, 0))
                                  .parent_path()
                                  .string();
      const std::string path = dir + (stream == 0 ? "/filtered_stdout.log" : "/filtered_stderr.log");
      filtered_fds[stream] = open_log(path);
      if (filtered_fds[stream] < 0) throw std::runtime_error("open log file " + path + ": " + std::strerror(errno));
    }
    return filtered_fds[stream];
  }

  // ---- rounds ----------------------------------------------------------------------------

  void join_round() {
    state = State::kJoining;
    if (health.enabled()) {
      run_health_check(HealthPurpose::kBeforeJoin);
      return;
    }
    join_now();
  }

  void join_now() {
    if (options.pick_master_port) {
      try {
        options.node.master_port = pick_free_port(options.master_port_bind_addr);
      } catch (const std::exception& e) {
        say(e.what());
        finish(static_cast<int>(ExitCode::kRendezvousFailed));
        return;
      }
    }
    rendezvous->join(options.node);
  }

  void on_round(const rdzv::Assignment& a) {
    if (state != State::kJoining) return;
    // A standby or a parked worker that died meanwhile is heard of before it would be given a
    // worker to become.
    if (options.standby || options.in_memory_restart) processes->reap_exited();
    if (state != State::kJoining) return;
    if (crash_loop.fatal()) {
      // A round after this node's fatal report: the rendezvous did not take it (a daemon that
      // predates it, or one that restarted meanwhile). The decision stands: the job ends here.
      say("the rendezvous started a new round despite this node's decision; leaving the job");
      rendezvous->close();
      if (reported_this_round) {
        on_job_failed(*reported_this_round, crash_loop.reason());
      } else {
        say("job failed: " + crash_loop.reason());
        finish(static_cast<int>(ExitCode::kJobFailed));
      }
      return;
    }
    RoundEnv round;
    round.assignment = a;
    round.local_world_size = options.node.local_world_size;
    round.role = options.role;
    round.run_id = options.run_id;
    round.virtual_local_rank = options.virtual_local_rank;
    round.set_omp_num_threads = should_set_omp_num_threads(round.local_world_size, inherited);
    if (a.group_world_size > 1 && inherited.count("GLOO_SOCKET_IFNAME") == 0) {
      round.gloo_socket_ifname = interface_towards(a.master_addr);
    }
    if (round.set_omp_num_threads && !omp_warned) {
      omp_warned = true;
      say("OMP_NUM_THREADS is set to 1 for each worker by default, so that " +
          std::to_string(round.local_world_size) +
          " workers do not overload this machine; set it yourself to tune performance.");
    }
    if (options.announce_rounds) say(describe_round(a));
    failures.clear();
    previous_pids.clear();
    parked_workers.clear();
    for (auto& w : workers) {
      if (w.alive && w.park == ParkState::kParked && w.link && w.link->is_open()) {
        parked_workers.emplace(w.local_rank, std::move(w));  // keeps its GPU memory: not a previous pid
        continue;
      }
      previous_pids.push_back(w.pid);
      if (w.link) w.link->close();
    }
    workers.clear();
    reported_this_round.reset();
    round_restart_count = a.restart_count;
    board.reset();
    hang.round_started(monotonic_seconds());
    if (file_timer) file_timer->clear();
    state = State::kRunning;
    generation = a.generation;
    record_round(a);
    const auto argv = worker_argv(options.command);
    try {
      for (auto& ranks : dedup_ranks) ranks.clear();
      for (int lr = 0; lr < round.local_world_size; ++lr) start_worker(round, lr, argv);
      if (dedup) {
        dedup->expect(STDOUT_FILENO, dedup_ranks[0]);
        dedup->expect(STDERR_FILENO, dedup_ranks[1]);
      }
      drop_parked();
      processes->confirm_spawned();  // every worker forked: now wait for their execs
    } catch (const std::exception& e) {
      drop_parked();
      say(e.what());
      forget_unstarted(e);
      exit_code = static_cast<int>(ExitCode::kUsage);
      rendezvous->close();
      stop_workers(SIGTERM, [this] { finish(static_cast<int>(ExitCode::kUsage)); });
      return;
    }
    if (options.hang.enabled() || options.on_progress) schedule_progress_check();
    if (health.enabled()) schedule_health_check(health.first_while_running(monotonic_seconds()));
    schedule_standbys();
  }

  void record_round(const rdzv::Assignment& a) {
    std::vector<int> ranks;
    for (int lr = 0; lr < options.node.local_world_size; ++lr) ranks.push_back(a.rank_offset + lr);
    record_event("round", "complete", std::move(ranks),
                 {{"group_rank", a.group_rank}, {"group_world_size", a.group_world_size}, {"world_size", a.world_size},
                  {"master", a.master_addr + ":" + std::to_string(a.master_port)}, {"restart_count", a.restart_count}});
  }

  // After a failed start: the workers that could not exec are gone already (reaped by
  // confirm_spawned(), which runs here too for those forked before the failure).
  void forget_unstarted(const std::exception& e) {
    std::vector<int> gone;
    if (auto* spawn_error = dynamic_cast<const SpawnError*>(&e)) gone = spawn_error->pids;
    try {
      processes->confirm_spawned();
    } catch (const SpawnError& more) {
      gone.insert(gone.end(), more.pids.begin(), more.pids.end());
    }
    for (auto& w : workers) {
      if (std::count(gone.begin(), gone.end(), w.pid) > 0) w.alive = false;
    }
  }

  // "generation 2: this node is group rank 1 of 2 (ranks 4-7), world size 8, master 10.0.0.1:29500".
  std::string describe_round(const rdzv::Assignment& a) const {
    const int n = options.node.local_world_size;
    const std::string ranks = n == 1 ? "rank " + std::to_string(a.rank_offset)
                                     : "ranks " + std::to_string(a.rank_offset) + "-" + std::to_string(a.rank_offset + n - 1);
    return "generation " + std::to_string(a.generation) + ": this node is group rank " + std::to_string(a.group_rank) +
           " of " + std::to_string(a.group_world_size) + " (" + ranks + "), world size " + std::to_string(a.world_size) +
           ", master " + (a.master_addr.find(':') != std::string::npos ? "[" + a.master_addr + "]" : a.master_addr) +
           ":" + std::to_string(a.master_port) +
           (a.restart_count > 0 ? ", restart " + std::to_string(a.restart_count) + " of " + std::to_string(a.max_restarts)
                                : std::string());
  }

  const std::string& log_subdir() const { return options.log_subdir.empty() ? options.run_id : options.log_subdir; }

  // What every worker gets besides its round (agent/worker_env.h): the heartbeat board, the file
  // timer, the Python helpers, faulthandler for the stacks of a hung Python worker.
  WorkerSetup worker_setup() const {
    WorkerSetup setup;
    setup.progress_file = board.path();
    setup.timer_file = options.file_timer_path;
    setup.python = !options.command.no_python;
    setup.python_helper_dir = options.python_helper_dir;
    setup.fault_handler = options.hang.enabled();
    setup.env_digest = options.env_digest;
    setup.env_check = options.node.env_check;
    return setup;
  }

  // Where a worker's output goes (--redirects, --tee, --local_ranks_filter), decided per worker.
  struct OutputPlan {
    std::string dir;     // the worker's log directory
    std::string prefix;  // the console prefix of tee'd lines
    int redirect;        // StdBits that go to a log file
    int tee;             // StdBits that also reach the console
    int attempt;         // the restart count, for the filtered files
    bool shown;          // within --local_ranks_filter
  };

  // Sets one stream of a worker (kStdOut or kStdErr): its log file, a tee pipe into the file and
  // the console, /dev/null for a rank outside the filter, or the agent's own (child_fd stays -1).
  // Descriptors the child gets are added to close_after_spawn.
  // With --log_dedup, a shown stream that is not redirected passes through the agent too, with
  // no file, so that its lines can be collapsed.
  void setup_stream(Worker& w, const OutputPlan& plan, int bit, int& child_fd, std::vector<int>& close_after_spawn) {
    const bool to_file = (plan.redirect & bit) != 0;
    const bool to_console = (plan.tee & bit) != 0 || (dedup && plan.shown && !to_file);
    if (!to_file && !to_console) {
      if (!plan.shown) {
        child_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
        close_after_spawn.push_back(child_fd);
      }
      return;
    }
    int file_fd = -1;
    if (to_file) {
      std::string path = plan.dir + (bit == kStdOut ? "/stdout.log" : "/stderr.log");
      (bit == kStdOut ? w.stdout_log : w.stderr_log) = path;
      file_fd = open_log(path);
      if (file_fd < 0) throw std::runtime_error("open log file " + path + ": " + std::strerror(errno));
    }
    if (!to_console) {
      child_fd = file_fd;
      close_after_spawn.push_back(child_fd);
      return;
    }
    const int filtered = (plan.tee & bit) ? filtered_fd(bit == kStdOut ? 0 : 1, plan.attempt) : -1;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      if (file_fd >= 0) ::close(file_fd);
      throw std::runtime_error(std::string("pipe for worker output: ") + std::strerror(errno));
    }
    LineSinks sinks;
    sinks.console_fd = bit == kStdOut ? STDOUT_FILENO : STDERR_FILENO;
    sinks.prefix = plan.prefix;
    sinks.filtered_fd = filtered;
    sinks.filters = bit == kStdOut ? options.duplicate_stdout_filters : options.duplicate_stderr_filters;
    if (bit == kStdErr) sinks.tail = w.stderr_tail = std::make_shared<LineTail>();
    if (dedup) {
      sinks.dedup = dedup;
      sinks.rank = w.rank;
      dedup_ranks[bit == kStdOut ? 0 : 1].push_back(w.rank);
    }
    w.pipes.push_back(std::make_shared<TeePipe>(io, fds[0], file_fd, files, std::move(sinks)));
    child_fd = fds[1];
    close_after_spawn.push_back(child_fd);
  }

  void start_worker(const RoundEnv& round, int local_rank, const std::vector<std::string>& argv) {
    Worker w;
    w.local_rank = local_rank;
    w.rank = round.assignment.rank_offset + local_rank;
    const std::string dir =
        worker_log_dir(options.log_dir, log_subdir(), round.assignment.restart_count, local_rank);
    boost::system::error_code ec;
    boost::filesystem::create_directories(dir, ec);
    if (ec) throw std::runtime_error("create log directory " + dir + ": " + ec.message());
    w.error_file = dir + "/error.json";
    ::unlink(w.error_file.c_str());  // a stale one from an earlier round would be misread

    SpawnRequest req;
    req.argv = argv;
    req.env = build_worker_env(round, worker_setup(), local_rank, w.error_file, inherited);
    w.python = !options.command.no_python;
    if (local_rank < static_cast<int>(options.numa_bindings.size())) {
      req.numa = prepare_binding(options.numa_bindings[local_rank]);
    }
    req.check_exec_later = true;  // start_workers() confirms the whole group's execs at once

    const bool shown = options.local_ranks_filter.empty() ||
                       std::count(options.local_ranks_filter.begin(), options.local_ranks_filter.end(), local_rank) > 0;
    // Tee'd streams go to their log file too; ranks outside --local_ranks_filter keep their
    // files but lose the console (torchrun's rule).
    const int redirect = std_bits(options.redirects, local_rank) | std_bits(options.tee, local_rank);
    const int tee = shown ? std_bits(options.tee, local_rank) : kStdNone;
    std::vector<int> close_after_spawn;
    const std::string prefix =
        line_prefix(options.line_prefix_template, options.role, w.rank, local_rank, options.node.host);
    const int attempt = round.assignment.restart_count;

    StartedAs how = StartedAs::kCold;
    const OutputPlan plan{dir, prefix, redirect, tee, attempt, shown};
    try {
      setup_stream(w, plan, kStdOut, req.stdout_fd, close_after_spawn);
      setup_stream(w, plan, kStdErr, req.stderr_fd, close_after_spawn);
      w.pid = start_process(req, w, how);
    } catch (...) {
      for (int fd : close_after_spawn) ::close(fd);
      throw;
    }
    for (int fd : close_after_spawn) ::close(fd);
    w.alive = true;
    for (auto& p : w.pipes) p->start();
    nlohmann::json fields = {{"local_rank", w.local_rank}, {"pid", w.pid}, {"standby", how == StartedAs::kStandby}};
    if (how == StartedAs::kInMemory) {
      fields["in_memory"] = true;
      fields["step"] = w.parked_step;
      w.parked_step = -1;
    } else if (w.link) {
      start_link(w);
    }
    record_event("worker_started", "", {w.rank}, std::move(fields));
    workers.push_back(std::move(w));
  }

  // ---- worker exits ----------------------------------------------------------------------

  void on_exit(int pid, ExitStatus st) {
    switch (health.exited(pid)) {
      case HealthSchedule::Exit::kCheck: on_health_exit(st); return;
      case HealthSchedule::Exit::kStale: return;
      case HealthSchedule::Exit::kNotOurs: break;
    }
    for (auto& sb : standbys) {
      if (sb.pid == pid && pid != 0) {
        on_standby_exit(sb, st);
        return;
      }
    }
    Worker* it = live_worker(pid);
    if (it == nullptr) return;  // not ours (or from an earlier round)
    it->alive = false;
    it->status = st;
    if (pid == dumps.dumping()) send_next_dump();
    if (it->link) it->link->close();
    // A failure is recorded with what the summary shows (record_failure); every other exit here.
    if (state != State::kRunning || st.success()) {
      record_event("worker_exited", state == State::kRunning ? "success" : "stopped", {it->rank}, exit_fields(*it));
    }
    const bool all_exited = std::none_of(workers.begin(), workers.end(), [](const Worker& w) { return w.alive; });
    if (state == State::kStopping && it->hung && !it->recorded) {
      // A hung worker that died of its dump signal after the stop began: its stacks belong in
      // the summary with the others'.
      for (auto& p : it->pipes) p->drain_and_close();
      record_failure(*it);
      last_failures.push_back(failures.back());
    }
    if (state == State::kRunning) {
      if (!st.success() || it->hung) {
        // Its last output may still sit in its pipes: read it before the tail is taken.
        for (auto& p : it->pipes) p->drain_and_close();
        record_failure(*it);
        // Reported at once, not after the other workers stopped: stopping can take up to
        // --shutdown_timeout (workers save checkpoints on SIGTERM). Posted, so that the exits
        // reaped in the same batch are recorded first: a worker killed by a signal and the peer
        // that exited 1 because of it can be reaped together, in either order (report_failure
        // picks the cause). The stop comes after the report, so the report precedes the rejoin
        // and no worker we stopped is taken for a candidate.
        if (!failure_report_pending) {
          failure_report_pending = true;
          asio::post(io, [this] {
            report_failure();
            if (state == State::kRunning) {
              board.abandon_round();  // the other ranks wait in collectives for the failed one
              stop_workers(SIGTERM, nullptr, /*park=*/true);
            }
          });
        }
        return;
      }
      if (all_exited && failures.empty()) {
        drain_pipes();
        state = State::kIdle;
        rendezvous->report_success();
      }
    } else if (state == State::kStopping && settled()) {
      stop_done();
    }
  }

  void record_failure(Worker& w) {
    w.recorded = true;
    const bool final = w.local_rank >= 0 && w.local_rank < board.slots() && board.read(w.local_rank).final;
    crash_loop.worker_failed(w.rank, w.status.exit_code, w.status.signal, w.hung, final);
    FailedWorker fw;
    fw.ref = ref(w);
    fw.exit_code = w.status.exit_code;
    fw.signal = w.status.signal;
    fw.note = w.note;
    fw.error_file = w.error_file;
    fw.error = read_error_file(w.error_file);
    if (!fw.error.present && fw.error.problem.empty()) {
      if (w.stderr_tail) {
        fw.stderr_tail = w.stderr_tail->text();
      } else if (!w.stderr_log.empty()) {
        fw.stderr_tail = tail_of_file(w.stderr_log);
        fw.stderr_log = w.stderr_log;
      }
    }
    for (const auto& path : {w.stdout_log, w.stderr_log}) {
      if (!path.empty()) fw.log_files.push_back(path);
    }
    // Exits reaped in one batch happened in an order we cannot know: they share a time.
    const double seen =
        failure_report_pending && !failures.empty() ? failures.front().failure.timestamp : now_seconds();
    LocalFailure lf = describe_failure(fw, options.node.host, seen);
    nlohmann::json fields = exit_fields(w);
    fields["error_file"] = lf.error_file;
    fields["log_files"] = lf.log_files;
    record_event("worker_exited", lf.failure.signal != 0 ? "signal" : "exit_code", {w.rank}, std::move(fields),
                 lf.failure.error_file_message);
    failures.push_back(std::move(lf));
  }

  // Tells the rendezvous about the failure that explains this round's others (root_cause).
  // REQUIRES: failures not empty.
  void report_failure() {
    failure_report_pending = false;
    last_failures = failures;
    reported_this_round = root_cause(failures).failure;
    if (crash_loop.fatal()) {
      // A --no_restart_exit_codes exit: the whole job ends, on every node (end_job_everywhere).
      reported_this_round->fatal = crash_loop.reason();
      fatal_reported = true;
    }
    flush_worker_lines();
    say(failure_line(*reported_this_round, parking_others()));
    rendezvous->report_failure(*reported_this_round);
  }

  // Whether the restart now under way keeps some live worker (it parks, not stops).
  bool parking_others() const {
    return std::any_of(workers.begin(), workers.end(),
                       [this](const Worker& w) { return w.alive && parking.may_park(park_view(w)); });
  }

  // ---- stopping ----------------------------------------------------------------------------

  // Runs `then` once every worker has exited: stops them with SIGTERM, or, when they are being
  // stopped already (after a local failure), waits for that stop instead of signalling again
  // (a second SIGTERM could cut a checkpoint short, and would restart the kill deadline).
  // With `park` (a restart), restartable workers park instead (stop_workers); without it (the job
  // ends), parked and parking workers are stopped too.
  void when_stopped(std::function<void()> then, bool park = false) {
    // A worker that died before this decision arrived is a failure of its round, not a worker
    // we stopped: hear of it first (it is recorded and reported like any failure).
    if (state == State::kRunning) processes->reap_exited();
    if (state == State::kStopping) {
      after_stop = std::move(then);
      if (!park) stop_kept_workers("the job ends");
      return;
    }
    stop_workers(SIGTERM, std::move(then), park);
  }

  // Sends `signo` to every live worker's process group; SIGKILL after --shutdown_timeout.
  // With `park` and in-memory restart, a worker that may park is asked to park instead (its
  // abandoned word), and stopped like the others only when it has not parked within the park
  // deadline (agent/park_policy.h). `then` runs once every worker has exited or parked.
  void stop_workers(int signo, std::function<void()> then, bool park = false) {
    after_stop = std::move(then);
    state = State::kStopping;
    bool signalled = false, asked = false;
    for (auto& w : workers) {
      if (!w.alive) continue;
      switch (parking.at_stop(park_view(w), park)) {
        case AtStop::kAskToPark:
          w.park = ParkState::kAsked;
          board.abandon_slot(w.local_rank);
          asked = true;
          break;
        case AtStop::kKeep:
          asked = asked || w.park == ParkState::kAsked;
          break;
        case AtStop::kSignal:
          w.park = ParkState::kNo;
          signalled = true;
          // A hung worker gets its dump signal instead, in its turn, and SIGKILL if it outlives it:
          // a stop signal could end it before its stacks are written.
          if (!w.hung) processes->signal_group(w.pid, signo);
          break;
      }
    }
    if (asked) {
      arm(park_timer, parking.deadline(monotonic_seconds()), [this] {
        if (state == State::kStopping) stop_kept_workers("");
      });
    }
    if (settled()) {
      asio::post(io, [this] {
        if (state == State::kStopping && settled()) stop_done();
      });
      return;
    }
    if (signalled) arm_kill_timer();
  }

  // Stops the workers that were kept (asked to park, or parked) like any other: the job ends
  // (`why`), or, with an empty `why`, the park deadline passed for those that did not park.
  void stop_kept_workers(const std::string& why) {
    std::vector<Worker*> stopped;
    std::vector<ParkView> overdue;
    for (auto& w : workers) {
      if (!kept(w) || (why.empty() && w.park == ParkState::kParked)) continue;
      stopped.push_back(&w);
      overdue.push_back(park_view(w));
    }
    if (why.empty()) {
      for (const auto& line : parking.overdue(overdue)) say(line);
    }
    for (Worker* w : stopped) {
      w->park = ParkState::kNo;
      processes->signal_group(w->pid, SIGTERM);
    }
    park_timer.cancel();
    if (!stopped.empty()) arm_kill_timer();
  }

  // A worker kept across a restart that cannot be kept any more (`why`): stopped like any other
  // while a stop runs; between rounds, killed (it waits on a channel that is gone).
  void stop_kept_worker(Worker& w, const std::string& why) {
    if (!kept(w)) return;
    say("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " + why + "; stopping it");
    w.park = ParkState::kNo;
    if (state == State::kStopping) {
      processes->signal_group(w.pid, SIGTERM);
      arm_kill_timer();
    } else {
      processes->signal_group(w.pid, SIGKILL);
    }
  }

  // SIGKILL, --shutdown_timeout from now, to the workers still running then (kept ones aside).
  void arm_kill_timer() {
    arm(kill_timer, grace.terminated(monotonic_seconds()), [this] {
      for (const auto& line : grace.overdue(still_running())) say(line);
      kill_now();
    });
  }

  // SIGKILLs every live worker's group, and gives up on those that still have not exited
  // --kill_timeout later (agent/shutdown_policy.h).
  void kill_now() {
    for (auto& w : workers) {
      if (w.alive && !kept(w)) processes->signal_group(w.pid, SIGKILL);
    }
    arm(give_up_timer, grace.killed(monotonic_seconds()), [this] {
      if (state != State::kStopping) return;
      const auto lines = grace.give_up(still_running());
      std::size_t line = 0;
      for (auto& w : workers) {
        if (!w.alive || kept(w)) continue;
        say(lines[line++]);
        w.alive = false;
        w.given_up = true;
        record_event("worker_exited", "given_up", {w.rank}, exit_fields(w), "did not exit after SIGKILL");
      }
      if (settled()) stop_done();
    });
  }

  void stop_done() {
    grace.settled();
    kill_timer.cancel();
    give_up_timer.cancel();
    dump_timer.cancel();
    dump_step_timer.cancel();
    dumps.clear();
    ProgressLine::console().release();
    park_timer.cancel();
    // Leftovers in the workers' process groups (their own children) go with them, and with a
    // cgroup, also those that left their group (setsid). Parked workers stay, and with them the
    // cgroup's (or the marker's) leftovers until the next full stop: the containment cannot
    // spare some of its members (docs/agent.md).
    bool any_kept = false;
    for (auto& w : workers) {
      if (kept(w)) {
        any_kept = true;
      } else if (!w.given_up) {
        processes->signal_group(w.pid, SIGKILL);
      }
    }
    if (!any_kept) processes->kill_leftovers();
    drain_pipes();
    state = State::kIdle;
    auto then = std::move(after_stop);
    after_stop = nullptr;
    if (then) then();
  }

  // A parked worker's pipes stay open: it may still write before its next assignment gives it new
  // streams (a closed pipe would kill it with SIGPIPE); they end when it lets go of them.
  void drain_pipes() {
    for (auto& w : workers) {
      if (kept(w)) continue;
      for (auto& p : w.pipes) p->drain_and_close();
      w.pipes.clear();
    }
  }

  // ---- what the rendezvous decided ---------------------------------------------------------

  void on_restart(const std::string& reason, bool counted, bool failing, bool failure) {
    if (state == State::kDone || handled_signal) return;
    if (counted) note_round_progress();
    if (crash_loop.fatal()) {
      end_job_everywhere();
      return;
    }
    if (failure && state == State::kRunning) board.abandon_round();
    say((failing ? "stopping the workers: " : "restarting the workers: ") + reason);
    record_event("restart", failing ? "job_failing" : counted ? "worker_failure" : "membership", {}, {{"counted", counted}},
                 reason);
    when_stopped([this] { join_round(); }, /*park=*/!failing);
  }

  void on_job_failed(const rdzv::WorkerFailure& first, const std::string& summary) {
    if (state == State::kDone) return;
    if (state == State::kRunning) board.abandon_round();
    when_stopped([this, first, summary] {
      const SummaryParts parts = summary_parts(last_failures, first);
      const std::string text =
          format_failure_summary(options.command.program, first, parts.error_file, parts.others, parts.log_files);
      flush_worker_lines();
      OutputQueue::console().write(STDERR_FILENO, text);
      if (!summary.empty()) say("job failed: " + summary);
      finish(static_cast<int>(ExitCode::kJobFailed));
    });
  }

  // This node decided that the job must end (--no_restart_exit_codes, a crash loop). The decision
  // is the job's, not this node's: the rendezvous hears it in a fatal failure report and fails the
  // job on every node with that reason (on_job_failed shows the verdict, here as everywhere).
  // Meanwhile this node stops its workers and rejoins, which tells the rendezvous they have
  // stopped; a failing job gets no new round. No health check before that join: the node only
  // says it has stopped.
  void end_job_everywhere() {
    if (!fatal_reported && !failure_report_pending) {
      fatal_reported = true;
      rendezvous->report_failure(fatal_report(reported_this_round ? &*reported_this_round : nullptr, options.node.host,
                                              crash_loop.reason(), now_seconds()));
    }
    say("the job fails: " + crash_loop.reason() + "; stopping the workers");
    if (state == State::kRunning) board.abandon_round();
    when_stopped([this] {
      state = State::kJoining;
      join_now();
    });
  }

  // ---- progress, hangs, crash loops, torch's file timer -------------------------------------

  void sample_progress(double now) {
    for (const auto& w : workers) {
      if (w.local_rank >= board.slots()) continue;
      ProgressSample sample = board.read(w.local_rank);
      if (options.on_progress && sample.beats != 0) options.on_progress(w.local_rank, sample.step, now);
      hang.observe(w.local_rank, sample, now);
    }
  }

  // Samples the board every hang.period(), until a hang is seen (agent/hang_policy.h).
  void schedule_progress_check() {
    arm(progress_timer, monotonic_seconds() + hang.period(), [this] {
      if (state != State::kRunning) return;
      const double now = monotonic_seconds();
      sample_progress(now);
      if (auto line = hang.silence(now, !options.command.no_python)) say(*line);
      std::vector<WatchedWorker> watched;
      for (const auto& w : workers) {
        if (w.alive) watched.push_back({ref(w), w.python, w.hung});
      }
      const HangVerdict verdict = hang.check(watched, now);
      if (!verdict.hang) {
        schedule_progress_check();
        return;
      }
      declare_hangs(verdict);
    });
  }

  // Each hung worker is sent its dump signal, one at a time (HangWatch::kDumpStep); its exit is
  // then a failure like any other, headed by what the board said about it. Those still alive
  // kDumpGrace after the last dump signal are killed.
  void declare_hangs(const HangVerdict& verdict) {
    for (const auto& h : verdict.declared) {
      Worker* w = live_worker(h.pid);
      w->hung = true;
      w->note = h.note;
      say(h.message);
      dumps.add(h.pid, h.signal);
    }
    send_next_dump();
  }

  void send_next_dump() {
    const auto dump = dumps.next(monotonic_seconds(), [this](int pid) { return live_worker(pid) != nullptr; });
    if (dump) {
      if (dump->signal == SIGABRT) {
        // Its stacks go to the console in one piece: what the agent said is out first, and what
        // it says meanwhile waits (a Python worker's dump takes milliseconds).
        OutputQueue::console().flush(std::chrono::milliseconds(200));
        ProgressLine::console().hold();
      }
      processes->signal_process(dump->pid, dump->signal);
      arm(dump_step_timer, dump->next_at, [this] { send_next_dump(); });
      arm(dump_timer, dump->kill_at, [this] {
        for (auto& w : workers) {
          if (w.alive && w.hung) processes->signal_group(w.pid, SIGKILL);
        }
      });
      return;
    }
    ProgressLine::console().release();
  }

  // After a failed round: did any rank get beyond the job's best step or checkpoint?
  void note_round_progress() {
    sample_progress(monotonic_seconds());
    crash_loop.round_ended(hang.monitor().best_step(), hang.monitor().best_checkpoint(), round_restart_count);
  }

  bool start_file_timer() {
    FileTimerServer::Callbacks cb;
    cb.is_worker = [this](int pid) {
      return std::any_of(workers.begin(), workers.end(), [pid](const Worker& w) { return w.alive && w.pid == pid; });
    };
    cb.on_expired = [this](const TimerRequest& r) { on_timer_expired(r); };
    cb.say = [](const std::string& line) { say(line); };
    try {
      boost::system::error_code ignored;  // mkfifo below names the path when this failed
      boost::filesystem::create_directories(boost::filesystem::path(options.file_timer_path).parent_path(), ignored);
      file_timer = std::make_unique<FileTimerServer>(io, options.file_timer_path, std::move(cb));
    } catch (const std::exception& e) {
      say(e.what());
      exit_code = static_cast<int>(ExitCode::kUsage);
      return false;
    }
    return true;
  }

  void on_timer_expired(const TimerRequest& r) {
    auto it = std::find_if(workers.begin(), workers.end(), [&](const Worker& w) { return w.alive && w.pid == r.pid; });
    if (it == workers.end()) return;
    it->note = "its timer '" + r.scope_id + "' (torch.distributed.elastic.timer) expired; sent " + signal_name(r.signal);
    say("worker " + std::to_string(it->rank) + " (pid " + std::to_string(it->pid) + "): " + it->note);
    processes->signal_process(it->pid, r.signal);
  }

  // ---- standbys (agent/standby.h) ------------------------------------------------------------

  // The standby's command line, fixed for the run (docs/agent.md, "Standby workers"): a worker
  // SDK program's own (it waits inside the SDK), or the Python bootstrap's.
  std::vector<std::string> standby_argv() const {
    const auto& c = options.command;
    if (c.no_python) return worker_argv(c);
    std::string preload;
    for (const auto& m : options.preload) preload += (preload.empty() ? "" : ",") + m;
    std::vector<std::string> argv = {c.python, "-u", options.python_helper_dir + "/ddplaunch_standby.py",
                                     c.module ? "module" : c.run_path ? "run_path" : "script", preload, c.program};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    return argv;
  }

  // Starts a standby for every local rank that has none.
  void start_standbys() {
    if (!options.standby || state == State::kDone) return;
    const auto argv = standby_argv();
    for (int lr = 0; lr < static_cast<int>(standbys.size()); ++lr) {
      if (standbys[lr].pid == 0) start_standby(lr, argv);
    }
  }

  // A standby starts with the agent's environment and what every worker of this node gets in
  // every round and must have before torch loads (OMP_NUM_THREADS sizes its thread pool at
  // import): nothing of any round. Its stdout goes nowhere until it is assigned one; its stderr
  // is the agent's (it says there why it gave up on a bad assignment).
  void start_standby(int local_rank, const std::vector<std::string>& argv) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      say(std::string("standby for local rank ") + std::to_string(local_rank) + ": socketpair: " +
          std::strerror(errno) + "; its next worker starts cold");
      return;
    }
    SpawnRequest req;
    req.argv = argv;
    req.env = build_standby_env(worker_setup(), options.node.local_world_size, sv[1], inherited);
    req.pass_fd = sv[1];
    req.standby = true;
    req.stdout_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (local_rank < static_cast<int>(options.numa_bindings.size())) {
      req.numa = prepare_binding(options.numa_bindings[local_rank]);
    }
    int pid = 0;
    try {
      pid = processes->spawn(req);
    } catch (const std::exception& e) {
      say("standby for local rank " + std::to_string(local_rank) + ": " + e.what() + "; its next worker starts cold");
    }
    ::close(sv[1]);
    if (req.stdout_fd >= 0) ::close(req.stdout_fd);
    if (pid == 0) {
      ::close(sv[0]);
      return;
    }
    standbys[local_rank] = Standby{};
    standbys[local_rank].pid = pid;
    standbys[local_rank].fd = sv[0];
    standbys[local_rank].child_fd = sv[1];
  }

  // Joins once every standby started with the agent has said it is ready (or has ended), at most
  // standby_ready_timeout later (agent/standby_schedule.h).
  void join_when_standbys_ready() {
    std::vector<int> waiting;
    for (int lr = 0; lr < static_cast<int>(standbys.size()); ++lr) {
      Standby& sb = standbys[lr];
      if (sb.pid == 0) continue;
      sb.watch = std::make_shared<asio::posix::stream_descriptor>(io, sb.fd);
      watch_standby(lr);
      waiting.push_back(lr);
    }
    const auto deadline = standby_schedule.await_ready(waiting, monotonic_seconds());
    if (!deadline) {
      join_round();
      return;
    }
    arm(standby_ready_timer, *deadline, [this] {
      if (state == State::kDone) return;
      const auto line = standby_schedule.ready_timed_out();
      if (!line) return;
      say(*line);
      for (auto& sb : standbys) unwatch(sb);
      join_round();
    });
  }

  void watch_standby(int local_rank) {
    Standby& sb = standbys[local_rank];
    const int pid = sb.pid;
    sb.watch->async_wait(asio::posix::stream_descriptor::wait_read,
                         [this, local_rank, pid](const boost::system::error_code& ec) {
                           if (ec || !standby_schedule.awaiting() || standbys[local_rank].pid != pid) return;
                           on_standby_readable(local_rank);
                         });
  }

  // The standby's first words: standby_ready, read whole (it is all a standby sends before its
  // assignment). Anything else (end of file, an error, a bad frame) ends the wait for it too: its
  // exit, if it exits, is handled as any standby's.
  void on_standby_readable(int local_rank) {
    Standby& sb = standbys[local_rank];
    char buffer[kWorkerHeaderSize + 64];
    const ssize_t n = ::recv(sb.fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      watch_standby(local_rank);
      return;
    }
    std::vector<WorkerMessage> messages;
    if (n > 0 && sb.ready_decoder.feed(std::string_view(buffer, static_cast<std::size_t>(n)), messages) &&
        messages.empty()) {
      watch_standby(local_rank);  // the rest of the frame is still on its way
      return;
    }
    unwatch(sb);
    join_if_standbys_ready(local_rank);
  }

  // Stops watching the standby's socket; `fd` stays open and is the standby's again.
  void unwatch(Standby& sb) {
    if (!sb.watch) return;
    boost::system::error_code ignored;
    sb.watch->cancel(ignored);
    sb.watch->release();
    sb.watch.reset();
  }

  // The standby of `local_rank` is no longer waited for: join when it was the last.
  void join_if_standbys_ready(int local_rank) {
    if (!standby_schedule.ready(local_rank) || state == State::kDone) return;
    standby_ready_timer.cancel();
    join_round();
  }

  // The next standbys start once the round is up (agent/standby_schedule.h).
  void schedule_standbys() {
    if (!options.standby) return;
    look_for_standby_start(standby_schedule.round_started(monotonic_seconds()));
  }

  void look_for_standby_start(double at) {
    arm(standby_timer, at, [this] {
      if (state == State::kDone) return;
      if (const auto next = standby_schedule.look(monotonic_seconds(), round_has_stepped())) {
        look_for_standby_start(*next);
        return;
      }
      start_standbys();
    });
  }

  // Whether every running worker of the round has reported at least one step (the board is reset
  // when a round starts). Workers that ended are not waited for.
  bool round_has_stepped() const {
    for (const Worker& w : workers) {
      if (!w.alive || w.local_rank >= board.slots()) continue;
      if (board.read(w.local_rank).beats == 0) return false;
    }
    return true;
  }

  enum class StartedAs { kCold, kStandby, kInMemory };

  // Starts the worker `req` describes into `w` and returns its pid: its local rank's parked worker
  // takes it when one waits (in-memory restart), else its standby when one waits, else a fresh
  // process. Throws SpawnError (a fresh process).
  int start_process(SpawnRequest& req, Worker& w, StartedAs& how) {
    const int local_rank = w.local_rank;
    how = StartedAs::kCold;
    if (auto it = parked_workers.find(local_rank); it != parked_workers.end()) {
      Worker parked = std::move(it->second);
      parked_workers.erase(it);
      if (resume(parked, req)) {
        how = StartedAs::kInMemory;
        w.link = parked.link;
        w.restartable = parked.restartable;
        w.marker = parked.marker;
        w.parked_step = parked.parked_step;
        return parked.pid;
      }
    }
    if (local_rank < static_cast<int>(standbys.size()) && standbys[local_rank].pid != 0) {
      const Standby sb = standbys[local_rank];
      standbys[local_rank] = {};
      if (standby_keeps_channel()) set_worker_channel(req.env, sb.child_fd);
      if (assign(sb, local_rank, req, w)) {
        how = StartedAs::kStandby;
        return sb.pid;
      }
      set_worker_channel(req.env, -1);
    }
    return spawn_cold(req, w);
  }

  // Whether a worker made from a standby keeps the standby's socket as its channel: with
  // in-memory restart, an SDK program's standby and the Python bootstrap both do (the bootstrap
  // keeps it when the assignment names it as DDPLAUNCH_WORKER_FD).
  bool standby_keeps_channel() const { return options.in_memory_restart; }

  // A fresh process; with in-memory restart, with its channel (DDPLAUNCH_WORKER_FD).
  int spawn_cold(SpawnRequest& req, Worker& w) {
    if (!options.in_memory_restart) return processes->spawn(req);
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      say("worker " + std::to_string(w.rank) + ": socketpair: " + std::strerror(errno) +
          "; it runs without in-memory restart");
      return processes->spawn(req);
    }
    set_worker_channel(req.env, sv[1]);
    req.pass_fd = sv[1];
    int pid = 0;
    try {
      pid = processes->spawn(req);
    } catch (...) {
      ::close(sv[0]);
      ::close(sv[1]);
      throw;
    }
    ::close(sv[1]);
    w.link = std::make_shared<WorkerLink>(io, sv[0], sv[1]);
    return pid;
  }

  // Sends the parked worker `parked` its next assignment, `req`'s environment (with its channel's
  // number and its containment marker), on its channel. False (it is killed) when it cannot take it.
  bool resume(Worker& parked, SpawnRequest& req) {
    set_worker_channel(req.env, parked.link->worker_fd());
    if (!parked.marker.empty()) req.env[Containment::kMarkerVariable] = parked.marker;
    StandbyAssignment a;
    a.env = req.env;
    a.cwd = cwd;
    std::string why;
    bool sent = false;
    try {
      sent = parked.link->send(encode_assignment(a), req.stdout_fd >= 0 ? req.stdout_fd : STDOUT_FILENO,
                               req.stderr_fd >= 0 ? req.stderr_fd : STDERR_FILENO, why);
    } catch (const std::invalid_argument& e) {
      why = e.what();
    }
    if (sent) return true;
    say("parked worker of local rank " + std::to_string(parked.local_rank) + " (pid " + std::to_string(parked.pid) +
        ") cannot take its next assignment: " + why + "; starting that rank fresh");
    parked.link->close();
    processes->signal_group(parked.pid, SIGKILL);
    set_worker_channel(req.env, -1);
    req.env.erase(Containment::kMarkerVariable);
    return false;
  }

  // Parked workers no rank of the new round took (none can be left: nproc is fixed), or all of
  // them when the round could not start: killed, they wait on a channel nobody will write.
  void drop_parked() {
    for (auto& [lr, w] : parked_workers) {
      if (w.link) w.link->close();
      processes->signal_group(w.pid, SIGKILL);
    }
    parked_workers.clear();
  }

  // Sends `req` (its environment, the agent's working directory, its stdout and stderr) to the
  // standby `sb`, which becomes the worker `w`. False (the standby is killed) when it cannot take
  // it. With in-memory restart the standby's socket stays open: it is the worker's channel.
  bool assign(const Standby& sb, int local_rank, SpawnRequest& req, Worker& w) {
    const std::string who = "standby for local rank " + std::to_string(local_rank) + " (pid " + std::to_string(sb.pid) + ")";
    StandbyAssignment a;
    a.env = req.env;
    a.cwd = cwd;
    processes->adopt(sb.pid, a.env);
    std::string message;
    long sent = -1;
    std::string why;
    std::shared_ptr<WorkerLink> link;
    try {
      message = encode_assignment(a);
      const int out = req.stdout_fd >= 0 ? req.stdout_fd : STDOUT_FILENO;
      const int err = req.stderr_fd >= 0 ? req.stderr_fd : STDERR_FILENO;
      if (standby_keeps_channel()) {
        link = std::make_shared<WorkerLink>(io, sb.fd, sb.child_fd);
        sent = link->send(message, out, err, why) ? 1 : -1;
      } else {
        sent = send_assignment(sb.fd, message, out, err);
        if (sent < 0) why = errno == EPIPE || errno == ECONNRESET ? "it has exited" : std::strerror(errno);
      }
    } catch (const std::invalid_argument& e) {
      why = e.what();
    }
    if (sent < 0) {
      say(who + " cannot take its worker: " + why + "; starting that worker cold");
      processes->signal_group(sb.pid, SIGKILL);
      if (link) {
        link->close();  // closes sb.fd
      } else {
        ::close(sb.fd);
      }
      return false;
    }
    if (link) {
      w.link = link;
      auto marker = a.env.find(Containment::kMarkerVariable);
      if (marker != a.env.end()) w.marker = marker->second;
      return true;
    }
    if (static_cast<std::size_t>(sent) == message.size()) {
      ::close(sb.fd);  // the standby reads to the end, then sees it closed
      return true;
    }
    // The rest when the standby reads it (it may still be importing): never block the loop.
    auto socket = std::make_shared<asio::posix::stream_descriptor>(io, sb.fd);
    auto rest = std::make_shared<std::string>(message.substr(static_cast<std::size_t>(sent)));
    asio::async_write(*socket, asio::buffer(*rest), [socket, rest](const boost::system::error_code&, std::size_t) {
      boost::system::error_code ignored;
      socket->close(ignored);
    });
    return true;
  }

  // ---- in-memory restart: what workers say on their channel (contracts/worker_channel.h) ---

  Worker* live_worker(int pid) {
    auto it = std::find_if(workers.begin(), workers.end(), [pid](const Worker& w) { return w.alive && w.pid == pid; });
    return it == workers.end() ? nullptr : &*it;
  }

  // Handlers find the worker by pid: its Worker moves between rounds, its pid does not.
  void start_link(Worker& w) {
    const int pid = w.pid;
    WorkerLink::Handlers h;
    h.on_message = [this, pid](const WorkerMessage& m) { on_worker_message(pid, m); };
    h.on_error = [this, pid](const std::string& problem) { on_link_lost(pid, problem); };
    h.on_closed = [this, pid] { on_link_lost(pid, ""); };
    w.link->start(std::move(h));
  }

  void on_worker_message(int pid, const WorkerMessage& m) {
    Worker* w = live_worker(pid);
    if (w == nullptr || m.type == WorkerMessage::Type::kStandbyReady) return;  // a standby's word, read late
    if (m.type == WorkerMessage::Type::kRestartable) {
      w->restartable = m.restartable;
      if (ParkPolicy::restartable_word(park_view(*w), m.restartable) == OnWord::kStop) {
        stop_kept_worker(*w, "said it is no longer restartable");
      }
      return;
    }
    const OnWord word = ParkPolicy::parked_word(park_view(*w), state == State::kStopping);
    if (word == OnWord::kBreak) {
      w->link->close();
      on_link_lost(pid, "it said it parked without having said it is restartable");
      return;
    }
    if (word != OnWord::kParked) return;
    w->park = ParkState::kParked;
    w->parked_step = m.step;
    if (w->marker.empty()) w->marker = environ_value(pid, Containment::kMarkerVariable);
    record_event("worker_parked", "", {w->rank}, {{"local_rank", w->local_rank}, {"pid", pid}, {"step", m.step}});
    if (state == State::kStopping && settled()) stop_done();
  }

  // The channel broke (`problem`) or was closed by the worker (empty): it is no longer
  // restartable; kept across a restart, it is stopped.
  void on_link_lost(int pid, const std::string& problem) {
    Worker* w = live_worker(pid);
    if (w == nullptr) return;
    w->restartable = false;
    if (!problem.empty()) {
      say("worker " + std::to_string(w->rank) + " (local rank " + std::to_string(w->local_rank) + ", pid " +
          std::to_string(pid) + "): its channel to the agent: " + problem +
          "; closed it, the worker is not restartable (it is stopped at a restart like any worker)");
    }
    stop_kept_worker(*w, problem.empty() ? "closed its channel" : "broke its channel");
  }

  // A standby ended before it was given a worker (killed, out of memory, a broken interpreter):
  // not a failure of any round; its local rank's next worker starts cold.
  void on_standby_exit(Standby& sb, ExitStatus st) {
    const int local_rank = static_cast<int>(&sb - standbys.data());
    say("standby for local rank " + std::to_string(local_rank) + " (pid " + std::to_string(sb.pid) + ") " +
        (st.signal ? "was killed by " + signal_name(st.signal) : "exited with code " + std::to_string(st.exit_code)) +
        " before it was needed; the next worker of that rank starts cold");
    unwatch(sb);
    ::close(sb.fd);
    sb = {};
    join_if_standbys_ready(local_rank);
  }

  void stop_standbys() {
    for (auto& sb : standbys) {
      if (sb.pid == 0) continue;
      processes->signal_group(sb.pid, SIGKILL);
      unwatch(sb);
      ::close(sb.fd);
      sb = {};
    }
  }

  // ---- health checks -------------------------------------------------------------------------

  std::string health_log_path() const { return options.log_dir + "/" + options.run_id + "/health_check.log"; }

  // Runs the check for `purpose` in a process of its own (reaped like a worker, never blocking the
  // loop); its output goes to <log_dir>/<run_id>/health_check.log, whose tail explains a failure.
  void run_health_check(HealthPurpose purpose) {
    if (const int stale = health.supersede()) {
      processes->signal_group(stale, SIGKILL);
      health_deadline.cancel();
    }
    const std::string log = health_log_path();
    boost::system::error_code ignored;
    boost::filesystem::create_directories(boost::filesystem::path(log).parent_path(), ignored);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    std::string note;
    SpawnRequest req;
    req.argv = {"/bin/sh", "-c", health.command(count_visible_gpus(), previous_pids, note)};
    if (!note.empty()) say(note);
    req.env = inherited;
    req.stdout_fd = req.stderr_fd = fd;
    int pid = 0;
    try {
      pid = processes->spawn(req);
    } catch (const std::exception& e) {
      if (fd >= 0) ::close(fd);
      asio::post(io, [this, purpose, why = std::string(e.what())] { on_health_result(purpose, false, why); });
      return;
    }
    if (fd >= 0) ::close(fd);
    arm(health_deadline, health.started(pid, purpose, monotonic_seconds()), [this] {
      if (const int overdue = health.deadline_passed()) processes->signal_group(overdue, SIGKILL);
    });
  }

  void on_health_exit(ExitStatus st) {
    health_deadline.cancel();
    const std::string why =
        st.success() ? "" : health.why_failed(st.exit_code, st.signal, tail_of_file(health_log_path(), 5, 1024));
    on_health_result(health.purpose(), st.success(), why);
  }

  // Carries out what a check's result does (agent/health_schedule.h). A result for a state the
  // agent has left is dropped: the round ended meanwhile, and the next join checks again.
  void on_health_result(HealthPurpose purpose, bool ok, const std::string& why) {
    if (state != (purpose == HealthPurpose::kBeforeJoin ? State::kJoining : State::kRunning)) return;
    const HealthStep step = health.result(purpose, ok, why, options.node.host, now_seconds(), monotonic_seconds());
    if (!step.message.empty()) say(step.message);
    switch (step.action) {
      case HealthStep::Do::kJoin:
        join_now();
        return;
      case HealthStep::Do::kRetry:
        arm(health_timer, step.at, [this] {
          if (state == State::kJoining) join_round();
        });
        return;
      case HealthStep::Do::kNext:
        schedule_health_check(step.at);
        return;
      case HealthStep::Do::kLeave:
        break;
    }
    LocalFailure lf;
    lf.failure = step.failure;
    failures.push_back(lf);
    last_failures = failures;
    reported_this_round = step.failure;
    rendezvous->report_failure(step.failure);
    stop_workers(SIGTERM, nullptr);
  }

  void schedule_health_check(double at) {
    arm(health_timer, at, [this] {
      if (state == State::kRunning) run_health_check(HealthPurpose::kWhileRunning);
    });
  }

  void on_rendezvous_error(const std::string& message) {
    if (state == State::kDone) return;
    say("rendezvous failed: " + message);
    when_stopped([this] { finish(static_cast<int>(ExitCode::kRendezvousFailed)); });
  }

  // ---- signals -----------------------------------------------------------------------------

  void wait_for_signal() {
    signals.async_wait([this](const boost::system::error_code& ec, int signo) {
      if (ec) return;
      on_signal(signo);
      wait_for_signal();
    });
  }

  void on_signal(int signo) {
    if (state == State::kDone) return;
    if (handled_signal) {
      // A second signal while stopping: do not wait for the grace period.
      say("got " + signal_name(signo) + " again; killing the workers now");
      if (state == State::kStopping) kill_now();
      return;
    }
    handled_signal = signo;
    say("got " + signal_name(signo) + "; forwarding it to the workers and stopping them");
    rendezvous->close();
    stop_workers(signo, [this, signo] { finish(exit_code_for_signal(signo)); });
  }

  void finish(int code) {
    if (state == State::kDone) return;
    exit_code = code;
    record_event("job_end", code == 0                                            ? "succeeded"
                            : code == static_cast<int>(ExitCode::kJobFailed)       ? "failed"
                            : code == static_cast<int>(ExitCode::kRendezvousFailed) ? "rendezvous_failed"
                            : code == static_cast<int>(ExitCode::kUsage)           ? "usage"
                                                                                   : "signal",
                 {}, {{"exit_code", code}});
    state = State::kDone;
    drain_pipes();
    stop_standbys();
    rendezvous->close();
    processes->close();
    boost::system::error_code ignored;
    signals.cancel(ignored);
    kill_timer.cancel();
    give_up_timer.cancel();
    progress_timer.cancel();
    dump_timer.cancel();
    dump_step_timer.cancel();
    ProgressLine::console().release();
    health_timer.cancel();
    health_deadline.cancel();
    standby_timer.cancel();
    standby_ready_timer.cancel();
    park_timer.cancel();
    if (health.running() != 0) processes->signal_group(health.running(), SIGKILL);
    file_timer.reset();
    io.stop();
  }
};

Agent::Agent(asio::io_context& io, AgentOptions options, std::unique_ptr<RendezvousHandler> rendezvous,
             std::unique_ptr<Processes> processes)
    : impl_(std::make_unique<Impl>(io, std::move(options), std::move(rendezvous), std::move(processes))) {}

Agent::~Agent() = default;

int Agent::run() { return impl_->run(); }

}  // namespace ddp::agent
