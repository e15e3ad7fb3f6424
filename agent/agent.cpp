#include "agent/agent.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/filesystem.hpp>

#include "agent/exit_codes.h"
#include "agent/failure.h"
#include "agent/logs.h"

namespace asio = boost::asio;

namespace ddp::agent {

namespace {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // console gone (EPIPE, closed): nothing sensible to do with the output
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

void say(const std::string& line) { write_all(STDERR_FILENO, "ddplaunch: " + line + "\n"); }

int open_log(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

// One tee'd stream of one worker: raw bytes to its log file, whole prefixed lines to the
// console. Shared by the pending read (which keeps it alive) and the worker that owns it.
class TeePipe : public std::enable_shared_from_this<TeePipe> {
 public:
  TeePipe(asio::io_context& io, int read_fd, int file_fd, int console_fd, std::string prefix)
      : pipe_(io, read_fd),
        file_fd_(file_fd),
        console_fd_(console_fd),
        prefix_(std::move(prefix)),
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
    read_available();
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

  // Reads until the pipe is empty. Returns false at end of file (and closes).
  bool read_available() {
    const int fd = pipe_.native_handle();
    for (;;) {
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
  }

  void consume(std::size_t n) {
    if (file_fd_ >= 0) write_all(file_fd_, std::string_view(buffer_.data(), n));
    splitter_.feed(std::string_view(buffer_.data(), n));
  }

  void emit_line(std::string_view line) {
    std::string out;
    out.reserve(prefix_.size() + line.size() + 1);
    out += prefix_;
    out += line;
    if (out.back() != '\n') out += '\n';
    write_all(console_fd_, out);  // one write per line: lines never interleave mid-line
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    splitter_.finish();
    boost::system::error_code ignored;
    pipe_.close(ignored);
    if (file_fd_ >= 0) ::close(file_fd_);
    file_fd_ = -1;
  }

  asio::posix::stream_descriptor pipe_;
  int file_fd_;
  int console_fd_;
  std::string prefix_;
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
};

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
        inherited(current_environment()) {}

  asio::io_context& io;
  AgentOptions options;
  std::unique_ptr<RendezvousHandler> rendezvous;
  std::unique_ptr<Processes> processes;
  asio::signal_set signals;
  asio::steady_timer kill_timer;
  std::map<std::string, std::string> inherited;
  std::vector<Worker> workers;
  std::vector<LocalFailure> failures;  // of the current round, in the order observed
  std::vector<LocalFailure> last_failures;  // of the round that ended with a failure
  std::function<void()> after_stop;
  State state = State::kIdle;
  int exit_code = static_cast<int>(ExitCode::kSuccess);
  int handled_signal = 0;
  bool omp_warned = false;

  int run() {
    RendezvousEvents events;
    events.on_round = [this](const rdzv::Assignment& a) { on_round(a); };
    events.on_restart = [this](const std::string& reason, bool counted) { on_restart(reason, counted); };
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
    wait_for_signal();
    join_round();
    io.run();
    return exit_code;
  }

  // ---- rounds ----------------------------------------------------------------------------

  void join_round() {
    state = State::kJoining;
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
    failures.clear();
    workers.clear();
    state = State::kRunning;
    const auto argv = worker_argv(options.command);
    for (int lr = 0; lr < round.local_world_size; ++lr) {
      try {
        start_worker(round, lr, argv);
      } catch (const std::exception& e) {
        say(e.what());
        exit_code = static_cast<int>(ExitCode::kUsage);
        rendezvous->close();
        stop_workers(SIGTERM, [this] { finish(static_cast<int>(ExitCode::kUsage)); });
        return;
      }
    }
  }

  void start_worker(const RoundEnv& round, int local_rank, const std::vector<std::string>& argv) {
    Worker w;
    w.local_rank = local_rank;
    w.rank = round.assignment.rank_offset + local_rank;
    const std::string dir =
        worker_log_dir(options.log_dir, options.run_id, round.assignment.restart_count, local_rank);
    boost::system::error_code ec;
    boost::filesystem::create_directories(dir, ec);
    if (ec) throw std::runtime_error("create log directory " + dir + ": " + ec.message());
    w.error_file = dir + "/error.json";
    ::unlink(w.error_file.c_str());  // a stale one from an earlier round would be misread

    SpawnRequest req;
    req.argv = argv;
    req.env = inherited;
    for (auto& [k, v] : worker_env(round, local_rank, w.error_file, inherited)) req.env[k] = v;
    if (local_rank < static_cast<int>(options.numa_bindings.size())) {
      req.numa = prepare_binding(options.numa_bindings[local_rank]);
    }

    const bool shown = options.local_ranks_filter.empty() ||
                       std::count(options.local_ranks_filter.begin(), options.local_ranks_filter.end(), local_rank) > 0;
    // Tee'd streams go to their log file too; ranks outside --local_ranks_filter keep their
    // files but lose the console (torchrun's rule).
    const int redirect = std_bits(options.redirects, local_rank) | std_bits(options.tee, local_rank);
    const int tee = shown ? std_bits(options.tee, local_rank) : kStdNone;
    std::vector<int> close_after_spawn;
    const std::string prefix =
        line_prefix(options.line_prefix_template, options.role, w.rank, local_rank);

    auto setup_stream = [&](int bit, const char* name, int console_fd, int& child_fd) {
      if (redirect & bit) {
        std::string path = dir + "/" + name;
        int file_fd = open_log(path);
        if (file_fd < 0) throw std::runtime_error("open log file " + path + ": " + std::strerror(errno));
        if (tee & bit) {
          int fds[2];
          if (::pipe2(fds, O_CLOEXEC) != 0) {
            ::close(file_fd);
            throw std::runtime_error(std::string("pipe for worker output: ") + std::strerror(errno));
          }
          w.pipes.push_back(std::make_shared<TeePipe>(io, fds[0], file_fd, console_fd, prefix));
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
      w.pid = processes->spawn(req);
    } catch (...) {
      for (int fd : close_after_spawn) ::close(fd);
      throw;
    }
    for (int fd : close_after_spawn) ::close(fd);
    w.alive = true;
    for (auto& p : w.pipes) p->start();
    workers.push_back(std::move(w));
  }

  // ---- worker exits ----------------------------------------------------------------------

  void on_exit(int pid, ExitStatus st) {
    auto it = std::find_if(workers.begin(), workers.end(), [pid](const Worker& w) { return w.alive && w.pid == pid; });
    if (it == workers.end()) return;  // not ours (or from an earlier round)
    it->alive = false;
    it->status = st;
    const bool all_exited = std::none_of(workers.begin(), workers.end(), [](const Worker& w) { return w.alive; });
    if (state == State::kRunning) {
      if (!st.success()) {
        record_failure(*it);
        stop_workers(SIGTERM, [this] { report_failure(); });
        return;
      }
      if (all_exited) {
        drain_pipes();
        state = State::kIdle;
        rendezvous->report_success();
      }
    } else if (state == State::kStopping && all_exited) {
      stop_done();
    }
  }

  void record_failure(const Worker& w) {
    LocalFailure lf;
    auto& f = lf.failure;
    f.host = options.node.host;
    f.rank = w.rank;
    f.local_rank = w.local_rank;
    f.exit_code = w.status.exit_code;
    f.signal = w.status.signal;
    f.pid = w.pid;
    f.timestamp = now_seconds();
    ErrorFileContent content = read_error_file(w.error_file);
    if (content.present) {
      lf.error_file = w.error_file;
      f.error_file_message = summarise_error_file(content);
      if (content.timestamp > 0) f.timestamp = content.timestamp;
    } else if (!content.problem.empty()) {
      lf.error_file = w.error_file;
      f.error_file_message = content.problem;
    }
    failures.push_back(std::move(lf));
  }

  void report_failure() {
    // The first failure by time: error-file timestamps when the workers wrote them.
    auto first = std::min_element(failures.begin(), failures.end(), [](const LocalFailure& a, const LocalFailure& b) {
      return a.failure.timestamp < b.failure.timestamp;
    });
    last_failures = failures;
    state = State::kIdle;
    say("worker " + std::to_string(first->failure.rank) + " (local rank " +
        std::to_string(first->failure.local_rank) + ", pid " + std::to_string(first->failure.pid) + ") " +
        (first->failure.signal ? "was killed by " + signal_name(first->failure.signal)
                               : "exited with code " + std::to_string(first->failure.exit_code)) +
        "; stopped the other workers");
    rendezvous->report_failure(first->failure);
  }

  // ---- stopping ----------------------------------------------------------------------------

  // Sends `signo` to every live worker's process group; SIGKILL after --shutdown_timeout.
  // `then` runs once every worker has exited.
  void stop_workers(int signo, std::function<void()> then) {
    after_stop = std::move(then);
    state = State::kStopping;
    bool any_alive = false;
    for (auto& w : workers) {
      if (!w.alive) continue;
      any_alive = true;
      processes->signal_group(w.pid, signo);
    }
    if (!any_alive) {
      asio::post(io, [this] {
        if (state == State::kStopping) stop_done();
      });
      return;
    }
    kill_timer.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(options.shutdown_timeout)));
    kill_timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;  // cancelled: every worker exited in time
      for (auto& w : workers) {
        if (!w.alive) continue;
        say("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") still runs " +
            std::to_string(options.shutdown_timeout) + " s after it was asked to stop; sending SIGKILL");
        processes->signal_group(w.pid, SIGKILL);
      }
    });
  }

  void stop_done() {
    kill_timer.cancel();
    // Leftovers in the workers' process groups (their own children) go with them.
    for (auto& w : workers) processes->signal_group(w.pid, SIGKILL);
    drain_pipes();
    state = State::kIdle;
    auto then = std::move(after_stop);
    after_stop = nullptr;
    if (then) then();
  }

  void drain_pipes() {
    for (auto& w : workers) {
      for (auto& p : w.pipes) p->drain_and_close();
      w.pipes.clear();
    }
  }

  // ---- what the rendezvous decided ---------------------------------------------------------

  void on_restart(const std::string& reason, bool counted) {
    if (state == State::kDone || handled_signal) return;
    say("restarting the workers: " + reason);
    stop_workers(SIGTERM, [this] { join_round(); });
  }

  void on_job_failed(const rdzv::WorkerFailure& first, const std::string& summary) {
    if (state == State::kDone) return;
    stop_workers(SIGTERM, [this, first, summary] {
      std::string error_file;
      std::vector<LocalFailure> others;
      for (const auto& lf : last_failures) {
        const auto& f = lf.failure;
        if (f.host == first.host && f.pid == first.pid && f.rank == first.rank) {
          error_file = lf.error_file;
        } else {
          others.push_back(lf);
        }
      }
      write_all(STDERR_FILENO, format_failure_summary(options.command.program, first, error_file, others));
      if (!summary.empty()) say("job failed: " + summary);
      finish(static_cast<int>(ExitCode::kJobFailed));
    });
  }

  void on_rendezvous_error(const std::string& message) {
    if (state == State::kDone) return;
    say("rendezvous failed: " + message);
    stop_workers(SIGTERM, [this] { finish(static_cast<int>(ExitCode::kRendezvousFailed)); });
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
      for (auto& w : workers) {
        if (w.alive) processes->signal_group(w.pid, SIGKILL);
      }
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
    state = State::kDone;
    drain_pipes();
    rendezvous->close();
    processes->close();
    boost::system::error_code ignored;
    signals.cancel(ignored);
    kill_timer.cancel();
    io.stop();
  }
};

Agent::Agent(asio::io_context& io, AgentOptions options, std::unique_ptr<RendezvousHandler> rendezvous,
             std::unique_ptr<Processes> processes)
    : impl_(std::make_unique<Impl>(io, std::move(options), std::move(rendezvous), std::move(processes))) {}

Agent::~Agent() = default;

int Agent::run() { return impl_->run(); }

}  // namespace ddp::agent
