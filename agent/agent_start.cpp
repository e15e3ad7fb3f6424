// The agent's shell: a round's workers (agent/agent_shell.h). Where each worker's output goes,
// what environment it gets, and which process becomes it: its rank's parked worker (in-memory
// restart), else its standby, else a fresh process.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/write.hpp>
#include <boost/filesystem.hpp>

#include "agent/agent_shell.h"
#include "agent/containment.h"
#include "agent/standby.h"
#include "rendezvous/error.h"

namespace asio = boost::asio;

namespace ddp::agent {

namespace {

int open_log(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

int std_bits(const std::vector<int>& per_rank, int local_rank) {
  return local_rank < static_cast<int>(per_rank.size()) ? per_rank[local_rank] : kStdNone;
}

}  // namespace

// Where a worker's output goes (--redirects, --tee, --local_ranks_filter), decided per worker.
struct Agent::Impl::OutputPlan {
  std::string dir;     // the worker's log directory
  std::string prefix;  // the console prefix of tee'd lines
  int redirect;        // StdBits that go to a log file
  int tee;             // StdBits that also reach the console
  int attempt;         // the restart count, for the filtered files
  bool shown;          // within --local_ranks_filter
};

void Agent::Impl::start_round(const effect::StartRound& s) {
  const rdzv::Assignment& a = s.assignment;
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
    say("OMP_NUM_THREADS is set to 1 for each worker by default, so that " + std::to_string(round.local_world_size) +
        " workers do not overload this machine; set it yourself to tune performance.");
  }
  if (options.announce_rounds) say(describe_round(a));
  previous_pids = s.previous;
  parked_workers.clear();
  for (auto& w : workers) {
    const bool parked = std::any_of(s.parked.begin(), s.parked.end(), [&](const auto& p) { return p.second == w.pid; });
    if (parked) {
      parked_workers.emplace(w.local_rank, std::move(w));
    } else if (w.link) {
      w.link->close();
    }
  }
  workers.clear();
  board.reset();
  hang.round_started(monotonic_seconds());
  if (file_timer) file_timer->clear();
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
    deliver(event::StartFailed{e.what(), forget_unstarted(e)});
    return;
  }
  if (options.hang.enabled() || options.on_progress) schedule_progress_check();
  if (rendezvous->hears_stalls() && s.assignment.group_world_size > 1) {
    stalls.reset(monotonic_seconds());
    schedule_stall_watch();
  }
  if (health.enabled()) schedule_health_check(health.first_while_running(monotonic_seconds()));
  schedule_standbys();
}

// After a failed start: the workers that could not exec, gone already (reaped by
// confirm_spawned(), which runs here too for those forked before the failure).
std::vector<int> Agent::Impl::forget_unstarted(const std::exception& e) {
  std::vector<int> gone;
  if (auto* spawn_error = dynamic_cast<const SpawnError*>(&e)) gone = spawn_error->pids;
  try {
    processes->confirm_spawned();
  } catch (const SpawnError& more) {
    gone.insert(gone.end(), more.pids.begin(), more.pids.end());
  }
  return gone;
}

// "generation 2: this node is group rank 1 of 2 (ranks 4-7), world size 8, master 10.0.0.1:29500".
std::string Agent::Impl::describe_round(const rdzv::Assignment& a) const {
  const int n = options.node.local_world_size;
  const std::string ranks = n == 1 ? "rank " + std::to_string(a.rank_offset)
                                   : "ranks " + std::to_string(a.rank_offset) + "-" + std::to_string(a.rank_offset + n - 1);
  return "generation " + std::to_string(a.generation) + ": this node is group rank " + std::to_string(a.group_rank) +
         " of " + std::to_string(a.group_world_size) + " (" + ranks + "), world size " + std::to_string(a.world_size) +
         ", master " + (a.master_addr.find(':') != std::string::npos ? "[" + a.master_addr + "]" : a.master_addr) + ":" +
         std::to_string(a.master_port) +
         (a.restart_count > 0 ? ", restart " + std::to_string(a.restart_count) + " of " + std::to_string(a.max_restarts)
                              : std::string());
}

const std::string& Agent::Impl::log_subdir() const {
  return options.log_subdir.empty() ? options.run_id : options.log_subdir;
}

// What every worker gets besides its round (agent/worker_env.h): the heartbeat board, the file
// timer, the Python helpers, faulthandler for the stacks of a hung Python worker.
WorkerSetup Agent::Impl::worker_setup() const {
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

// Sets one stream of a worker (kStdOut or kStdErr): its log file, a tee pipe into the file and
// the console, /dev/null for a rank outside the filter, or the agent's own (child_fd stays -1).
// Descriptors the child gets are added to close_after_spawn.
// With --log_dedup, a shown stream that is not redirected passes through the agent too, with
// no file, so that its lines can be collapsed.
void Agent::Impl::setup_stream(WorkerIo& w, const OutputPlan& plan, int bit, int& child_fd,
                               std::vector<int>& close_after_spawn) {
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
    if (file_fd < 0) throw LaunchError(ExitCode::kUsage, "open log file " + path + ": " + std::strerror(errno));
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
    throw LaunchError(ExitCode::kUsage, std::string("pipe for worker output: ") + std::strerror(errno));
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

// The filtered file of `stream` (0 stdout, 1 stderr) for `attempt`, opened on first use;
// -1 when that stream has no filters.
int Agent::Impl::filtered_fd(int stream, int attempt) {
  const auto& filters = stream == 0 ? options.duplicate_stdout_filters : options.duplicate_stderr_filters;
  if (filters.empty()) return -1;
  if (attempt != filtered_attempt) {
    close_filtered_files();
    filtered_attempt = attempt;
  }
  if (filtered_fds[stream] < 0) {
    const std::string dir =
        boost::filesystem::path(worker_log_dir(options.log_dir, log_subdir(), attempt, 0)).parent_path().string();
    const std::string path = dir + (stream == 0 ? "/filtered_stdout.log" : "/filtered_stderr.log");
    filtered_fds[stream] = open_log(path);
    if (filtered_fds[stream] < 0) throw LaunchError(ExitCode::kUsage, "open log file " + path + ": " + std::strerror(errno));
  }
  return filtered_fds[stream];
}

void Agent::Impl::start_worker(const RoundEnv& round, int local_rank, const std::vector<std::string>& argv) {
  WorkerIo w;
  w.local_rank = local_rank;
  w.rank = round.assignment.rank_offset + local_rank;
  const std::string dir = worker_log_dir(options.log_dir, log_subdir(), round.assignment.restart_count, local_rank);
  boost::system::error_code ec;
  boost::filesystem::create_directories(dir, ec);
  if (ec) throw LaunchError(ExitCode::kUsage, "create log directory " + dir + ": " + ec.message());
  w.error_file = dir + "/error.json";
  ::unlink(w.error_file.c_str());  // a stale one from an earlier round would be misread

  SpawnRequest req;
  req.argv = argv;
  req.env = build_worker_env(round, worker_setup(), local_rank, w.error_file, inherited);
  if (local_rank < static_cast<int>(options.numa_bindings.size())) {
    req.numa = prepare_binding(options.numa_bindings[local_rank]);
  }
  req.check_exec_later = true;  // start_round() confirms the whole group's execs at once

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
  for (auto& p : w.pipes) p->start();
  nlohmann::json fields = {{"local_rank", w.local_rank}, {"pid", w.pid}, {"standby", how == StartedAs::kStandby}};
  if (how == StartedAs::kInMemory) {
    fields["in_memory"] = true;
    fields["step"] = w.parked_step;
    w.parked_step = -1;
  } else if (w.link) {
    start_link(w);
  }
  event::Started started;
  started.ref = {w.pid, w.rank, w.local_rank};
  started.python = !options.command.no_python;
  started.channel = w.link && w.link->is_open();
  started.in_memory = how == StartedAs::kInMemory;
  record_event("worker_started", "", {w.rank}, std::move(fields), "", core.generation());
  workers.push_back(std::move(w));
  deliver(started);
}

// Starts the worker `req` describes into `w` and returns its pid: its local rank's parked worker
// takes it when one waits (in-memory restart), else its standby when one waits, else a fresh
// process. Throws SpawnError (a fresh process).
int Agent::Impl::start_process(SpawnRequest& req, WorkerIo& w, StartedAs& how) {
  const int local_rank = w.local_rank;
  how = StartedAs::kCold;
  if (auto it = parked_workers.find(local_rank); it != parked_workers.end()) {
    WorkerIo parked = std::move(it->second);
    parked_workers.erase(it);
    if (resume(parked, req)) {
      how = StartedAs::kInMemory;
      w.link = parked.link;
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

// A fresh process; with in-memory restart, with its channel (DDPLAUNCH_WORKER_FD).
int Agent::Impl::spawn_cold(SpawnRequest& req, WorkerIo& w) {
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
bool Agent::Impl::resume(WorkerIo& parked, SpawnRequest& req) {
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
void Agent::Impl::drop_parked() {
  for (auto& [lr, w] : parked_workers) {
    if (w.link) w.link->close();
    processes->signal_group(w.pid, SIGKILL);
  }
  parked_workers.clear();
}

// Sends `req` (its environment, the agent's working directory, its stdout and stderr) to the
// standby `sb`, which becomes the worker `w`. False (the standby is killed) when it cannot take
// it. With in-memory restart the standby's socket stays open: it is the worker's channel.
bool Agent::Impl::assign(const Standby& sb, int local_rank, SpawnRequest& req, WorkerIo& w) {
  const std::string who =
      "standby for local rank " + std::to_string(local_rank) + " (pid " + std::to_string(sb.pid) + ")";
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

}  // namespace ddp::agent
