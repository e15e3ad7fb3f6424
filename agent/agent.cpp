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
#include <set>
#include <sstream>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/filesystem.hpp>

#include "agent/containment.h"
#include "agent/devices.h"
#include "agent/exit_codes.h"
#include "agent/failure.h"
#include "agent/file_timer.h"
#include "agent/logs.h"
#include "agent/standby.h"
#include "contracts/worker_channel.h"
#include "agent/worker_link.h"

namespace asio = boost::asio;

namespace ddp::agent {

namespace {

// How often the agent looks whether a new round's workers have reported a step, to start the
// next standbys (schedule_standbys).
constexpr double kStandbyStepPoll = 0.1;

double monotonic_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::chrono::steady_clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

// "5", "5.3": a stall in seconds, to a tenth.
std::string tenths(double seconds) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(seconds < 100 ? 1 : 0);
  os << seconds;
  return os.str();
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// "30", "0.5": a duration in seconds as a person writes it (not std::to_string's "30.000000").
std::string seconds_text(double seconds) {
  std::ostringstream os;
  os << seconds;
  return os.str();
}

int open_log(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

// Where the lines of one tee'd stream go besides its log file. Shared with the TeePipe, so it
// stays valid however long the pipe outlives the agent's state.
struct LineSinks {
  int console_fd = -1;                 // STDOUT/STDERR, or -1 when not shown (--local_ranks_filter)
  std::string prefix;                  // of console lines and of filtered lines
  int filtered_fd = -1;                // <attempt dir>/filtered_<stream>.log, or -1
  std::vector<std::string> filters;    // --duplicate-<stream>-filters
  std::shared_ptr<LineTail> tail;      // the stderr tail of the failure summary, or null
};

// One tee'd stream of one worker: raw bytes to its log file, whole prefixed lines to the
// console (both through bounded queues: a stalled destination never blocks the event loop),
// matching lines to the filtered file, the last lines to the tail. Shared by the pending read
// (which keeps it alive) and the worker that owns it.
class TeePipe : public std::enable_shared_from_this<TeePipe> {
 public:
  TeePipe(asio::io_context& io, int read_fd, int file_fd, std::shared_ptr<OutputQueue> files, LineSinks sinks)
      : pipe_(io, read_fd),
        file_fd_(file_fd),
        files_(std::move(files)),
        sinks_(std::move(sinks)),
        splitter_([this](std::string_view line) { emit_line(line); }) {}
  ~TeePipe() { close(); }

  void start() {
    boost::system::error_code ignored;
    pipe_.non_blocking(true, ignored);
    wait_readable();
  }

  // Reads what the pipe already holds without waiting, then closes it. Called when the
  // worker has exited: its last output is in the pipe even if our wait has not fired yet, but
  // a grandchild may keep the pipe open, so we do not wait for end of file.
  void drain_and_close() {
    if (closed_) return;
    read_available(64);  // bounded: a grandchild may write forever
    close();
  }

 private:
  // We wait for readability and read ourselves (rather than async_read_some) so that a drain
  // never races with a read the reactor already performed into our buffer.
  void wait_readable() {
    pipe_.async_wait(asio::posix::descriptor_base::wait_read,
                     [self = shared_from_this()](const boost::system::error_code& ec) {
                       if (self->closed_ || ec) return;
                       if (self->read_available()) self->wait_readable();
                     });
  }

  // Reads until the pipe is empty, or at most `max_reads` buffers: a worker that writes without
  // pause must not keep the event loop (heartbeats) from its other work; the next wait fires at
  // once for the rest. Returns false at end of file (and closes).
  bool read_available(int max_reads = 16) {
    const int fd = pipe_.native_handle();
    for (int reads = 0; reads < max_reads; ++reads) {
      ssize_t n = ::read(fd, buffer_.data(), buffer_.size());
      if (n > 0) {
        consume(static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      close();  // end of file, or an error we cannot recover from
      return false;
    }
    return true;
  }

  void consume(std::size_t n) {
    if (file_fd_ >= 0) files_->write(file_fd_, std::string(buffer_.data(), n));
    splitter_.feed(std::string_view(buffer_.data(), n));
  }

  void emit_line(std::string_view line) {
    if (sinks_.tail) sinks_.tail->add(line);
    if (sinks_.console_fd < 0 && sinks_.filtered_fd < 0) return;
    std::string out;
    out.reserve(sinks_.prefix.size() + line.size() + 1);
    out += sinks_.prefix;
    out += line;
    if (out.back() != '\n') out += '\n';
    if (sinks_.filtered_fd >= 0 && matches_any(line, sinks_.filters)) files_->write(sinks_.filtered_fd, out);
    // One write per line: lines never interleave mid-line.
    if (sinks_.console_fd >= 0) OutputQueue::console().write(sinks_.console_fd, std::move(out));
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    splitter_.finish();
    boost::system::error_code ignored;
    pipe_.close(ignored);
    if (file_fd_ >= 0) files_->close_after(file_fd_);
    file_fd_ = -1;
  }

  asio::posix::stream_descriptor pipe_;
  int file_fd_;
  std::shared_ptr<OutputQueue> files_;
  LineSinks sinks_;
  LineSplitter splitter_;
  std::array<char, 32768> buffer_{};
  bool closed_ = false;
};

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
  // of its channel (null without one), what it last said, and where it stands at a restart:
  // kAsked to park (its abandoned word is set, the park deadline runs), kParked (waits for its
  // next assignment; kept across the restart).
  std::shared_ptr<WorkerLink> link;
  bool restartable = false;
  enum class Park { kNo, kAsked, kParked };
  Park park = Park::kNo;
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
        health_timer(io),
        health_deadline(io),
        standby_timer(io),
        standby_ready_timer(io),
        park_timer(io),
        inherited(current_environment()),
        standbys(static_cast<std::size_t>(std::max(0, this->options.node.local_world_size))),
        board(this->options.node.local_world_size),
        monitor(this->options.hang, this->options.node.local_world_size) {}

  asio::io_context& io;
  AgentOptions options;
  std::unique_ptr<RendezvousHandler> rendezvous;
  std::unique_ptr<Processes> processes;
  asio::signal_set signals;
  asio::steady_timer kill_timer;
  asio::steady_timer give_up_timer;
  asio::steady_timer progress_timer;  // samples the progress board (--hang_timeout)
  asio::steady_timer dump_timer;      // SIGKILLs hung workers that did not die of their dump signal
  asio::steady_timer health_timer;    // the next --check_health (retry before a join, or periodic)
  asio::steady_timer health_deadline; // kills a check that runs too long
  asio::steady_timer standby_timer;   // starts the next standbys once the round is up (schedule_standbys)
  double standbys_wait_since = 0;      // when the round began, for standby_delay_max
  asio::steady_timer standby_ready_timer;  // joins without the standbys' word (standby_ready_timeout)
  asio::steady_timer park_timer;      // stops the workers asked to park that did not (park_timeout)
  // Tee'd output into log files: its own queue and thread, so a stalled console does not
  // hold up the files, nor a hung file system the console. 64 MiB before bytes are dropped.
  std::shared_ptr<OutputQueue> files = std::make_shared<OutputQueue>("the log file system", 64 << 20);
  // <attempt dir>/filtered_{stdout,stderr}.log of the current attempt ([0] stdout, [1] stderr).
  int filtered_fds[2] = {-1, -1};
  int filtered_attempt = -1;
  std::map<std::string, std::string> inherited;
  // Issue 13: the standby waiting for each local rank's next worker (pid 0: none), with the
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
  bool awaiting_standbys = false;  // the first join waits for the standbys (join_when_standbys_ready)
  int exit_code = static_cast<int>(ExitCode::kSuccess);
  int handled_signal = 0;
  bool omp_warned = false;
  ProgressBoard board;   // the workers' heartbeats
  HangMonitor monitor;   // what the board says about this round
  std::unique_ptr<FileTimerServer> file_timer;  // TORCHELASTIC_ENABLE_FILE_TIMER=1
  // Crash loops: the best step and checkpoint any round reported, and the restarts in a row
  // that got no further (--crash_loop_limit).
  int64_t job_best_step = -1, job_best_checkpoint = -1;
  int restarts_without_progress = 0;
  int round_restart_count = 0;
  // Set when the job must end instead of restarting (--no_restart_exit_codes, a crash loop).
  std::string stop_reason;
  bool fatal_reported = false;  // the rendezvous was told stop_reason (a fatal failure report)
  std::optional<rdzv::WorkerFailure> reported_this_round;  // what this node reported, if anything
  // --check_health: the running check (0: none), what to do with its result, whether the last
  // one failed (a passing one after that is said), and pids of the last round's workers (the
  // built-in GPU check looks for them).
  int health_pid = 0;
  bool health_timed_out = false;
  std::function<void(bool ok, const std::string& why)> health_then;
  bool health_failing = false;
  bool gpu_skip_said = false;
  std::vector<int> previous_pids;
  std::set<int> stale_health_pids;  // checks abandoned for a newer one: their exits are ignored
  std::uint64_t generation = 0;  // of the current (or last) round; 0 before the first

  // The one place the agent records a lifecycle event (issue 15): the event log and the metrics
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
    start_standbys();
    join_when_standbys_ready();
    io.run();
    flush_output();
    return exit_code;
  }

  // Gives the queued output (the failure summary among it) a bounded time to reach the console
  // and the log files: a console nobody reads must not keep ddplaunch from exiting.
  void flush_output() {
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
    if (!options.health_check.empty()) {
      run_health_check([this](bool ok, const std::string& why) {
        if (state != State::kJoining) return;
        if (ok) {
          if (health_failing) say("health check passes again; this node joins the job");
          health_failing = false;
          join_now();
          return;
        }
        if (!health_failing) {
          say("health check failed: " + why + "; this node stays out of the job and checks again every " +
              seconds_text(options.health_check_interval) + " s");
        }
        health_failing = true;
        health_timer.expires_after(to_duration(options.health_check_interval));
        health_timer.async_wait([this](const boost::system::error_code& ec) {
          if (!ec && state == State::kJoining) join_round();
        });
      });
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
    if (!stop_reason.empty()) {
      // A round after this node's fatal report: the rendezvous did not take it (a daemon that
      // predates it, or one that restarted meanwhile). The decision stands: the job ends here.
      say("the rendezvous started a new round despite this node's decision; leaving the job");
      rendezvous->close();
      if (reported_this_round) {
        on_job_failed(*reported_this_round, stop_reason);
      } else {
        say("job failed: " + stop_reason);
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
      if (w.alive && w.park == Worker::Park::kParked && w.link && w.link->is_open()) {
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
    monitor.reset(monotonic_seconds());
    if (file_timer) file_timer->clear();
    state = State::kRunning;
    generation = a.generation;
    {
      std::vector<int> ranks;
      for (int lr = 0; lr < round.local_world_size; ++lr) ranks.push_back(a.rank_offset + lr);
      record_event("round", "complete", std::move(ranks),
                   {{"group_rank", a.group_rank}, {"group_world_size", a.group_world_size}, {"world_size", a.world_size},
                    {"master", a.master_addr + ":" + std::to_string(a.master_port)}, {"restart_count", a.restart_count}});
    }
    const auto argv = worker_argv(options.command);
    try {
      for (int lr = 0; lr < round.local_world_size; ++lr) start_worker(round, lr, argv);
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
    if (!options.health_check.empty()) schedule_health_check();
    schedule_standbys();
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
    req.env = inherited;
    for (auto& [k, v] : worker_env(round, local_rank, w.error_file, inherited)) req.env[k] = v;
    add_watchdog_env(req.env, local_rank);
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
    auto setup_stream = [&](int bit, const char* name, int console_fd, int& child_fd) {
      if (redirect & bit) {
        std::string path = dir + "/" + name;
        (bit == kStdOut ? w.stdout_log : w.stderr_log) = path;
        const int filtered = (tee & bit) ? filtered_fd(bit == kStdOut ? 0 : 1, attempt) : -1;
        int file_fd = open_log(path);
        if (file_fd < 0) throw std::runtime_error("open log file " + path + ": " + std::strerror(errno));
        if (tee & bit) {
          int fds[2];
          if (::pipe2(fds, O_CLOEXEC) != 0) {
            ::close(file_fd);
            throw std::runtime_error(std::string("pipe for worker output: ") + std::strerror(errno));
          }
          LineSinks sinks;
          sinks.console_fd = console_fd;
          sinks.prefix = prefix;
          sinks.filtered_fd = filtered;
          sinks.filters = bit == kStdOut ? options.duplicate_stdout_filters : options.duplicate_stderr_filters;
          if (bit == kStdErr) sinks.tail = w.stderr_tail = std::make_shared<LineTail>();
          w.pipes.push_back(std::make_shared<TeePipe>(io, fds[0], file_fd, files, std::move(sinks)));
          child_fd = fds[1];
        } else {
          child_fd = file_fd;
        }
        close_after_spawn.push_back(child_fd);
      } else if (!shown) {
        child_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
        close_after_spawn.push_back(child_fd);
      }
    };
    try {
      setup_stream(kStdOut, "stdout.log", STDOUT_FILENO, req.stdout_fd);
      setup_stream(kStdErr, "stderr.log", STDERR_FILENO, req.stderr_fd);
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
    if (pid == health_pid && pid != 0) {
      on_health_exit(st);
      return;
    }
    if (stale_health_pids.erase(pid) > 0) return;
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
    if (stop_reason.empty() && w.status.signal == 0 && !w.hung &&
        std::count(options.no_restart_exit_codes.begin(), options.no_restart_exit_codes.end(), w.status.exit_code)) {
      stop_reason = "worker " + std::to_string(w.rank) + " exited with code " + std::to_string(w.status.exit_code) +
                    ", which --no_restart_exit_codes lists: not restarting";
    }
    LocalFailure lf;
    auto& f = lf.failure;
    f.host = options.node.host;
    f.rank = w.rank;
    f.local_rank = w.local_rank;
    f.exit_code = w.status.exit_code;
    f.signal = w.status.signal;
    f.pid = w.pid;
    // Exits reaped in one batch happened in an order we cannot know: they share a time.
    f.timestamp = failure_report_pending && !failures.empty() ? failures.front().failure.timestamp : now_seconds();
    ErrorFileContent content = read_error_file(w.error_file);
    if (content.present) {
      lf.error_file = w.error_file;
      f.error_file_message = summarise_error_file(content);
      if (content.timestamp > 0) f.timestamp = content.timestamp;
    } else if (!content.problem.empty()) {
      lf.error_file = w.error_file;
      f.error_file_message = content.problem;
    } else {
      f.error_file_message = stderr_tail_message(w);
    }
    if (!w.note.empty()) {
      f.error_file_message = f.error_file_message.empty() ? w.note : w.note + "\n" + f.error_file_message;
    }
    for (const auto& path : {w.stdout_log, w.stderr_log}) {
      if (!path.empty()) lf.log_files.push_back(path);
    }
    nlohmann::json fields = exit_fields(w);
    fields["error_file"] = lf.error_file;
    fields["log_files"] = lf.log_files;
    record_event("worker_exited", f.signal != 0 ? "signal" : "exit_code", {w.rank}, std::move(fields),
                 f.error_file_message);
    failures.push_back(std::move(lf));
  }

  // When a worker wrote no error file, the last lines of its stderr stand in for the traceback
  // (pytorch#113546): from its pipe when tee'd, from stderr.log when redirected. Empty when its
  // stderr went straight to the console, where the user already sees it.
  static std::string stderr_tail_message(const Worker& w) {
    std::string tail;
    std::string where;
    if (w.stderr_tail) {
      tail = w.stderr_tail->text();
    } else if (!w.stderr_log.empty()) {
      tail = tail_of_file(w.stderr_log);
      where = " (" + w.stderr_log + ")";
    }
    if (tail.empty()) return {};
    const std::string head = w.status.signal != 0 ? "Signal " + std::to_string(w.status.signal) + " (" +
                                                        signal_name(w.status.signal) + ") received by PID " +
                                                        std::to_string(w.pid)
                                                  : "the worker wrote no error file";
    return head + "; the last lines of its stderr" + where + ":\n" + tail;
  }

  // Tells the rendezvous about the failure that explains this round's others (rdzv::explains: a
  // death by signal before exits with a code, then the earliest). REQUIRES: failures not empty.
  void report_failure() {
    failure_report_pending = false;
    auto first = std::min_element(failures.begin(), failures.end(), [](const LocalFailure& a, const LocalFailure& b) {
      return rdzv::explains(a.failure, b.failure);
    });
    last_failures = failures;
    reported_this_round = first->failure;
    if (!stop_reason.empty()) {
      // A --no_restart_exit_codes exit: the whole job ends, on every node (end_job_everywhere).
      reported_this_round->fatal = stop_reason;
      fatal_reported = true;
    }
    say("worker " + std::to_string(first->failure.rank) + " (local rank " +
        std::to_string(first->failure.local_rank) + ", pid " + std::to_string(first->failure.pid) + ") " +
        (first->failure.signal ? "was killed by " + signal_name(first->failure.signal)
                               : "exited with code " + std::to_string(first->failure.exit_code)) +
        (parking_others() ? "; the other workers park, to go on from memory (in-memory restart)"
                          : "; stopped the other workers"));
    rendezvous->report_failure(*reported_this_round);
  }

  // Whether a restart asks this live worker to park instead of stopping it: it said it is
  // restartable, is not hung, and its channel is open (stop_workers).
  bool can_park(const Worker& w) const {
    return options.in_memory_restart && w.restartable && !w.hung && w.link && w.link->is_open();
  }

  // Whether the restart now under way keeps some live worker (it parks, not stops).
  bool parking_others() const {
    return std::any_of(workers.begin(), workers.end(), [this](const Worker& w) { return w.alive && can_park(w); });
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

  // Whether `w` is kept across the stop in progress (in-memory restart): asked to park, or parked.
  static bool kept(const Worker& w) { return w.alive && w.park != Worker::Park::kNo; }

  // Every worker has exited or parked: the stop is over.
  bool settled() const {
    return std::all_of(workers.begin(), workers.end(),
                       [](const Worker& w) { return !w.alive || w.park == Worker::Park::kParked; });
  }

  // Sends `signo` to every live worker's process group; SIGKILL after --shutdown_timeout.
  // With `park` and in-memory restart, a worker that said it is restartable is asked to park
  // instead (its abandoned word), and stopped like the others only when it has not parked
  // within the park deadline. `then` runs once every worker has exited or parked.
  void stop_workers(int signo, std::function<void()> then, bool park = false) {
    after_stop = std::move(then);
    state = State::kStopping;
    bool signalled = false, asked = false;
    for (auto& w : workers) {
      if (!w.alive) continue;
      if (park && can_park(w)) {
        if (w.park == Worker::Park::kNo) {
          w.park = Worker::Park::kAsked;
          board.abandon_slot(w.local_rank);
        }
        asked = asked || w.park == Worker::Park::kAsked;
        continue;
      }
      w.park = Worker::Park::kNo;
      signalled = true;
      processes->signal_group(w.pid, signo);
    }
    if (asked) {
      park_timer.expires_after(to_duration(options.park_timeout));
      park_timer.async_wait([this](const boost::system::error_code& ec) {
        if (!ec && state == State::kStopping) stop_kept_workers("");
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
    bool signalled = false;
    for (auto& w : workers) {
      if (!kept(w)) continue;
      if (why.empty() && w.park == Worker::Park::kParked) continue;
      if (why.empty()) {
        say("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") did not park within " +
            seconds_text(options.park_timeout) + " s of the restart (in-memory restart); stopping it");
      }
      w.park = Worker::Park::kNo;
      signalled = true;
      processes->signal_group(w.pid, SIGTERM);
    }
    park_timer.cancel();
    if (signalled) arm_kill_timer();
  }

  // A worker kept across a restart that cannot be kept any more (`why`): stopped like any other
  // while a stop runs; between rounds, killed (it waits on a channel that is gone).
  void stop_kept_worker(Worker& w, const std::string& why) {
    if (!kept(w)) return;
    say("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " + why + "; stopping it");
    w.park = Worker::Park::kNo;
    if (state == State::kStopping) {
      processes->signal_group(w.pid, SIGTERM);
      arm_kill_timer();
    } else {
      processes->signal_group(w.pid, SIGKILL);
    }
  }

  // SIGKILL, --shutdown_timeout from now, to the workers still running then (kept ones aside).
  void arm_kill_timer() {
    kill_timer.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(options.shutdown_timeout)));
    kill_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;  // cancelled: every worker exited in time
      for (auto& w : workers) {
        if (!w.alive || kept(w)) continue;
        say("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") still runs " +
            seconds_text(options.shutdown_timeout) + " s after it was asked to stop; sending SIGKILL");
      }
      kill_now();
    });
  }

  // SIGKILLs every live worker's group, and gives up on those that still have not exited
  // --kill_timeout later: a process stuck in the kernel (state D) cannot be killed, and must
  // not hang the agent (and with it the job) forever.
  void kill_now() {
    for (auto& w : workers) {
      if (w.alive && !kept(w)) processes->signal_group(w.pid, SIGKILL);
    }
    give_up_timer.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(options.kill_timeout)));
    give_up_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec || state != State::kStopping) return;
      for (auto& w : workers) {
        if (!w.alive || kept(w)) continue;
        say("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") has not exited " +
            seconds_text(options.kill_timeout) +
            " s after SIGKILL; it is probably stuck in the kernel (see /proc/" + std::to_string(w.pid) +
            "/stack and its state in /proc/" + std::to_string(w.pid) +
            "/status); giving up on it. It may still hold resources such as GPU memory.");
        w.alive = false;
        w.given_up = true;
        record_event("worker_exited", "given_up", {w.rank}, exit_fields(w), "did not exit after SIGKILL");
      }
      if (settled()) stop_done();
    });
  }

  void stop_done() {
    kill_timer.cancel();
    give_up_timer.cancel();
    dump_timer.cancel();
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
    if (!stop_reason.empty()) {
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
      std::string error_file;
      std::vector<std::string> log_files;
      std::vector<LocalFailure> others;
      for (const auto& lf : last_failures) {
        const auto& f = lf.failure;
        if (f.host == first.host && f.pid == first.pid && f.rank == first.rank) {
          error_file = lf.error_file;
          log_files = lf.log_files;
        } else {
          others.push_back(lf);
        }
      }
      OutputQueue::console().write(
          STDERR_FILENO, format_failure_summary(options.command.program, first, error_file, others, log_files));
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
      rdzv::WorkerFailure f;
      if (reported_this_round) {
        f = *reported_this_round;
      } else {
        // This node saw no failure in the round (a peer's ended it): the report names no worker.
        f.host = options.node.host;
        f.exit_code = 1;
        f.timestamp = now_seconds();
      }
      f.fatal = stop_reason;
      fatal_reported = true;
      rendezvous->report_failure(f);
    }
    say("the job fails: " + stop_reason + "; stopping the workers");
    if (state == State::kRunning) board.abandon_round();
    when_stopped([this] {
      state = State::kJoining;
      join_now();
    });
  }

  // ---- progress, hangs, crash loops, torch's file timer -------------------------------------

  void add_watchdog_env(std::map<std::string, std::string>& env, int local_rank) {
    env["DDPLAUNCH_PROGRESS_FILE"] = board.path();
    env["DDPLAUNCH_PROGRESS_SLOT"] = std::to_string(local_rank);
    if (!options.file_timer_path.empty()) env["TORCHELASTIC_TIMER_FILE"] = options.file_timer_path;
    add_python_env(env);
  }

  // What a Python worker needs from its interpreter's start, the same in every round: `import
  // ddplaunch`, and faulthandler for the stacks of a hung worker.
  void add_python_env(std::map<std::string, std::string>& env) {
    if (options.command.no_python) return;
    if (!options.python_helper_dir.empty()) {
      auto& path = env["PYTHONPATH"];
      path = path.empty() ? options.python_helper_dir : path + ":" + options.python_helper_dir;
    }
    // Stacks of a hung Python worker: faulthandler prints every thread's traceback on SIGABRT.
    if (options.hang.enabled() && inherited.count("PYTHONFAULTHANDLER") == 0) env["PYTHONFAULTHANDLER"] = "1";
  }

  void sample_progress(double now) {
    for (const auto& w : workers) {
      if (w.local_rank >= board.slots()) continue;
      ProgressSample sample = board.read(w.local_rank);
      if (options.on_progress && sample.beats != 0) options.on_progress(w.local_rank, sample.step, now);
      monitor.observe(w.local_rank, sample, now);
    }
  }

  // Samples often enough that a hang is declared within 2% of the timeout (at most every second).
  void schedule_progress_check() {
    const double period = !options.hang.enabled() || options.hang.automatic
                              ? 1.0
                              : std::clamp(options.hang.timeout / 50.0, 0.02, 1.0);
    progress_timer.expires_after(to_duration(period));
    progress_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec || state != State::kRunning) return;
      const double now = monotonic_seconds();
      sample_progress(now);
      auto hangs = options.hang.enabled() ? monitor.check(now) : std::vector<Hang>{};
      if (!hangs.empty()) {
        declare_hangs(hangs);
        return;
      }
      schedule_progress_check();
    });
  }

  // Each hung worker is asked for its stacks (Python: SIGABRT, which faulthandler answers with
  // every thread's traceback before the process dies) or, when it cannot answer, killed; its
  // exit is then a failure like any other, headed by what the board said about it.
  void declare_hangs(const std::vector<Hang>& hangs) {
    for (const auto& h : hangs) {
      auto it = std::find_if(workers.begin(), workers.end(),
                             [&](const Worker& w) { return w.alive && w.local_rank == h.slot; });
      if (it == workers.end() || it->hung) continue;
      it->hung = true;
      it->note = "rank " + std::to_string(it->rank) + " made no progress for " + tenths(h.stalled_for) +
                 " s (last step " + std::to_string(h.step) + (h.phase.empty() ? "" : ", phase " + h.phase) +
                 "; --hang_timeout " + seconds_text(h.timeout) + " s)";
      say(it->note + (it->python ? "; sending SIGABRT for its Python stacks" : "; killing it"));
      processes->signal_process(it->pid, it->python ? SIGABRT : SIGKILL);
    }
    dump_timer.expires_after(std::chrono::seconds(5));
    dump_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      for (auto& w : workers) {
        if (w.alive && w.hung) processes->signal_group(w.pid, SIGKILL);
      }
    });
  }

  // After a failed round: did any rank get beyond the job's best step or checkpoint?
  void note_round_progress() {
    sample_progress(monotonic_seconds());
    const bool progressed = monitor.best_step() > job_best_step || monitor.best_checkpoint() > job_best_checkpoint;
    job_best_step = std::max(job_best_step, monitor.best_step());
    job_best_checkpoint = std::max(job_best_checkpoint, monitor.best_checkpoint());
    if (progressed) {
      restarts_without_progress = 0;
    } else if (round_restart_count > 0) {
      ++restarts_without_progress;
    }
    const int limit = options.max_restarts_without_progress;
    if (limit > 0 && restarts_without_progress >= limit && stop_reason.empty()) {
      const std::string best = job_best_step < 0 && job_best_checkpoint < 0
                                   ? "no rank ever reported a step or a checkpoint"
                                   : "no rank reported a step beyond " + std::to_string(job_best_step) +
                                         " or a checkpoint beyond " + std::to_string(job_best_checkpoint);
      stop_reason = std::to_string(restarts_without_progress) + " restart(s) in a row made no progress (" + best +
                    "); --crash_loop_limit=" + std::to_string(limit);
    }
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

  // ---- standbys (issue 13, agent/standby.h) --------------------------------------------------

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
    req.env = inherited;
    if (should_set_omp_num_threads(options.node.local_world_size, inherited)) req.env["OMP_NUM_THREADS"] = "1";
    add_python_env(req.env);
    req.env[kStandbyFdVariable] = std::to_string(sv[1]);
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
  // standby_ready_timeout later. Joining first would make a node that comes back into a running
  // job stop every other node's workers for as long as its own take to load.
  void join_when_standbys_ready() {
    bool waiting = false;
    for (int lr = 0; lr < static_cast<int>(standbys.size()); ++lr) {
      Standby& sb = standbys[lr];
      if (sb.pid == 0) continue;
      sb.watch = std::make_shared<asio::posix::stream_descriptor>(io, sb.fd);
      watch_standby(lr);
      waiting = true;
    }
    if (!waiting) {
      join_round();
      return;
    }
    awaiting_standbys = true;
    standby_ready_timer.expires_after(to_duration(options.standby_ready_timeout));
    standby_ready_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec || !awaiting_standbys || state == State::kDone) return;
      awaiting_standbys = false;
      say("standbys: not all of them said they are ready within " + seconds_text(options.standby_ready_timeout) +
          " s (DDPLAUNCH_STANDBY_READY_TIMEOUT); joining the job without waiting for them");
      for (auto& sb : standbys) unwatch(sb);
      join_round();
    });
  }

  void watch_standby(int local_rank) {
    Standby& sb = standbys[local_rank];
    const int pid = sb.pid;
    sb.watch->async_wait(asio::posix::stream_descriptor::wait_read,
                         [this, local_rank, pid](const boost::system::error_code& ec) {
                           if (ec || !awaiting_standbys || standbys[local_rank].pid != pid) return;
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
    join_if_standbys_ready();
  }

  // Stops watching the standby's socket; `fd` stays open and is the standby's again.
  void unwatch(Standby& sb) {
    if (!sb.watch) return;
    boost::system::error_code ignored;
    sb.watch->cancel(ignored);
    sb.watch->release();
    sb.watch.reset();
  }

  void join_if_standbys_ready() {
    if (!awaiting_standbys || state == State::kDone) return;
    for (const auto& sb : standbys) {
      if (sb.watch) return;
    }
    awaiting_standbys = false;
    standby_ready_timer.cancel();
    join_round();
  }

  // The next standbys start once every worker of the round has reported a step on the progress
  // board (the round is up: its imports, process group and checkpoint load are done), at the
  // earliest standby_delay and at the latest standby_delay_max after the round began (a program
  // that reports no steps). Started at once, their imports (a Python standby's `import torch`
  // is 1.5-2 s of CPU) would compete with the new round's start on a small machine.
  void schedule_standbys() {
    if (!options.standby) return;
    standbys_wait_since = monotonic_seconds();
    wait_for_standby_start(options.standby_delay);
  }

  void wait_for_standby_start(double seconds) {
    standby_timer.expires_after(to_duration(seconds));
    standby_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec || state == State::kDone) return;
      const double waited = monotonic_seconds() - standbys_wait_since;
      if (waited < options.standby_delay_max && !round_has_stepped()) {
        wait_for_standby_start(std::min(kStandbyStepPoll, options.standby_delay_max - waited));
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
      if (standby_keeps_channel()) req.env[kWorkerFdVariable] = std::to_string(sb.child_fd);
      if (assign(sb, local_rank, req, w)) {
        how = StartedAs::kStandby;
        return sb.pid;
      }
      req.env.erase(kWorkerFdVariable);
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
    req.env[kWorkerFdVariable] = std::to_string(sv[1]);
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
    req.env[kWorkerFdVariable] = std::to_string(parked.link->worker_fd());
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
    req.env.erase(kWorkerFdVariable);
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

  // ---- in-memory restart: what workers say on their channel (agent/worker_channel.h) -------

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
      if (!m.restartable && w->park == Worker::Park::kAsked) stop_kept_worker(*w, "said it is no longer restartable");
      return;
    }
    if (!w->restartable) {
      w->link->close();
      on_link_lost(pid, "it said it parked without having said it is restartable");
      return;
    }
    if (w->park == Worker::Park::kParked) return;
    // A worker being stopped (signalled) dies of it, parked or not.
    if (state == State::kStopping && w->park == Worker::Park::kNo) return;
    w->park = Worker::Park::kParked;
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
    join_if_standbys_ready();
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

  // The command of --check_health, with the built-in GPU check first when GPUs are visible.
  std::string health_command() {
    std::string gpu;
    if (count_visible_gpus() > 0) {
      std::string pids;
      for (int pid : previous_pids) pids += (pids.empty() ? "" : "|") + std::to_string(pid);
      gpu = "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader >/dev/null 2>&1 || "
            "{ echo 'built-in GPU check: nvidia-smi gets no answer from every GPU'; exit 1; }; ";
      if (!pids.empty()) {
        gpu += "held=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -Ex '" + pids +
               "'); [ -z \"$held\" ] || { echo \"built-in GPU check: GPU memory still held by the last "
               "round's workers (pids $held)\"; exit 1; }; ";
      }
    } else if (!gpu_skip_said) {
      gpu_skip_said = true;
      say("built-in GPU health check skipped: no GPU is visible on this node");
    }
    if (options.health_check == "gpu") return gpu.empty() ? "true" : gpu + "true";
    return gpu + options.health_check;
  }

  // Runs the check in a process of its own (reaped like a worker, never blocking the loop); its
  // output goes to <log_dir>/<run_id>/health_check.log, whose tail explains a failure.
  void run_health_check(std::function<void(bool, const std::string&)> then) {
    if (health_pid != 0) {
      // A periodic check still runs when a join needs one: it is of the last round; start over.
      processes->signal_group(health_pid, SIGKILL);
      stale_health_pids.insert(health_pid);
      health_pid = 0;
      health_deadline.cancel();
    }
    health_then = std::move(then);
    const std::string log = health_log_path();
    boost::system::error_code ignored;
    boost::filesystem::create_directories(boost::filesystem::path(log).parent_path(), ignored);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    SpawnRequest req;
    req.argv = {"/bin/sh", "-c", health_command()};
    req.env = inherited;
    req.stdout_fd = req.stderr_fd = fd;
    try {
      health_pid = processes->spawn(req);
    } catch (const std::exception& e) {
      if (fd >= 0) ::close(fd);
      auto then_now = std::move(health_then);
      asio::post(io, [then_now, why = std::string(e.what())] { then_now(false, why); });
      return;
    }
    if (fd >= 0) ::close(fd);
    health_timed_out = false;
    health_deadline.expires_after(to_duration(options.health_check_timeout));
    health_deadline.async_wait([this](const boost::system::error_code& ec) {
      if (ec || health_pid == 0) return;
      health_timed_out = true;
      processes->signal_group(health_pid, SIGKILL);
    });
  }

  void on_health_exit(ExitStatus st) {
    health_pid = 0;
    health_deadline.cancel();
    std::string why;
    if (!st.success()) {
      why = "`" + options.health_check + "` ";
      why += health_timed_out ? "ran longer than " + seconds_text(options.health_check_timeout) + " s (killed)"
             : st.signal ? "was killed by " + signal_name(st.signal)
                         : "exited with code " + std::to_string(st.exit_code);
      const std::string tail = tail_of_file(health_log_path(), 5, 1024);
      if (!tail.empty()) why += ": " + tail;
      while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
    }
    auto then = std::move(health_then);
    health_then = nullptr;
    if (then) then(st.success(), why);
  }

  void schedule_health_check() {
    health_timer.expires_after(to_duration(options.health_check_interval));
    health_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec || state != State::kRunning) return;
      run_health_check([this](bool ok, const std::string& why) {
        if (state != State::kRunning) return;  // the round ended meanwhile: the next join checks again
        if (ok) {
          schedule_health_check();
          return;
        }
        say("health check failed: " + why + "; this node leaves the round: its failure is reported and its "
            "workers stopped, and it joins again once the check passes");
        rdzv::WorkerFailure f;
        f.host = options.node.host;
        f.rank = -1;
        f.local_rank = -1;
        f.exit_code = 1;
        f.timestamp = now_seconds();
        f.error_file_message = "health check failed on " + options.node.host + ": " + why;
        LocalFailure lf;
        lf.failure = f;
        failures.push_back(lf);
        last_failures = failures;
        reported_this_round = f;
        rendezvous->report_failure(f);
        stop_workers(SIGTERM, nullptr);
      });
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
    health_timer.cancel();
    health_deadline.cancel();
    standby_timer.cancel();
    standby_ready_timer.cancel();
    park_timer.cancel();
    if (health_pid != 0) processes->signal_group(health_pid, SIGKILL);
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
