// The agent's shell: the features that feed the supervisor (agent/agent_shell.h). Standbys,
// hangs and torch's file timer, health checks, and what workers say on their channel. Each
// asks its policy unit what to do and tells the supervisor what it needs to know.

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <boost/asio/post.hpp>
#include <boost/filesystem.hpp>

#include "agent/agent_shell.h"
#include "agent/devices.h"
#include "rendezvous/error.h"
#include "agent/failure.h"
#include "agent/progress_line.h"
#include "agent/standby.h"

namespace asio = boost::asio;

namespace ddp::agent {

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

namespace {

bool done(const Supervisor& core) { return core.state() == Supervisor::State::kDone; }

}  // namespace

// ---- standbys (agent/standby.h) --------------------------------------------------------------------

// The standby's command line, fixed for the run (docs/agent.md, "Standby workers"): a worker
// SDK program's own (it waits inside the SDK), or the Python bootstrap's.
std::vector<std::string> Agent::Impl::standby_argv() const {
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
void Agent::Impl::start_standbys() {
  if (!options.standby || done(core)) return;
  const auto argv = standby_argv();
  for (int lr = 0; lr < static_cast<int>(standbys.size()); ++lr) {
    if (standbys[lr].pid == 0) start_standby(lr, argv);
  }
}

// A standby starts with the agent's environment and what every worker of this node gets in
// every round and must have before torch loads (OMP_NUM_THREADS sizes its thread pool at
// import): nothing of any round. Its stdout goes nowhere until it is assigned one; its stderr
// is the agent's (it says there why it gave up on a bad assignment).
void Agent::Impl::start_standby(int local_rank, const std::vector<std::string>& argv) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    say(std::string("standby for local rank ") + std::to_string(local_rank) + ": socketpair: " + std::strerror(errno) +
        "; its next worker starts cold");
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
void Agent::Impl::join_when_standbys_ready() {
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
    deliver(event::Join{});
    return;
  }
  arm(standby_ready_timer, *deadline, [this] {
    if (done(core)) return;
    const auto line = standby_schedule.ready_timed_out();
    if (!line) return;
    say(*line);
    for (auto& sb : standbys) unwatch(sb);
    deliver(event::Join{});
  });
}

void Agent::Impl::watch_standby(int local_rank) {
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
void Agent::Impl::on_standby_readable(int local_rank) {
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
void Agent::Impl::unwatch(Standby& sb) {
  if (!sb.watch) return;
  boost::system::error_code ignored;
  sb.watch->cancel(ignored);
  sb.watch->release();
  sb.watch.reset();
}

// The standby of `local_rank` is no longer waited for: join when it was the last.
void Agent::Impl::join_if_standbys_ready(int local_rank) {
  if (!standby_schedule.ready(local_rank) || done(core)) return;
  standby_ready_timer.cancel();
  deliver(event::Join{});
}

// The next standbys start once the round is up (agent/standby_schedule.h).
void Agent::Impl::schedule_standbys() {
  if (!options.standby) return;
  look_for_standby_start(standby_schedule.round_started(monotonic_seconds()));
}

void Agent::Impl::look_for_standby_start(double at) {
  arm(standby_timer, at, [this] {
    if (done(core)) return;
    if (const auto next = standby_schedule.look(monotonic_seconds(), round_has_stepped())) {
      look_for_standby_start(*next);
      return;
    }
    start_standbys();
  });
}

// Whether every running worker of the round has reported at least one step (the board is reset
// when a round starts). Workers that ended are not waited for.
bool Agent::Impl::round_has_stepped() const {
  for (const auto& w : core.workers()) {
    if (!w.alive || w.ref.local_rank >= board.slots()) continue;
    if (board.read(w.ref.local_rank).beats == 0) return false;
  }
  return true;
}

// A standby ended before it was given a worker (killed, out of memory, a broken interpreter):
// not a failure of any round; its local rank's next worker starts cold.
void Agent::Impl::on_standby_exit(Standby& sb, ExitStatus st) {
  const int local_rank = static_cast<int>(&sb - standbys.data());
  say("standby for local rank " + std::to_string(local_rank) + " (pid " + std::to_string(sb.pid) + ") " +
      (st.signal ? "was killed by " + signal_name(st.signal) : "exited with code " + std::to_string(st.exit_code)) +
      " before it was needed; the next worker of that rank starts cold");
  unwatch(sb);
  ::close(sb.fd);
  sb = {};
  join_if_standbys_ready(local_rank);
}

void Agent::Impl::stop_standbys() {
  for (auto& sb : standbys) {
    if (sb.pid == 0) continue;
    processes->signal_group(sb.pid, SIGKILL);
    unwatch(sb);
    ::close(sb.fd);
    sb = {};
  }
}

// ---- progress, hangs, torch's file timer -----------------------------------------------------------

void Agent::Impl::sample_progress(double now) {
  for (const auto& w : core.workers()) {
    const int slot = w.ref.local_rank;
    if (slot >= board.slots()) continue;
    ProgressSample sample = board.read(slot);
    if (options.on_progress && sample.beats != 0) options.on_progress(slot, sample.step, now);
    hang.observe(slot, sample, now);
  }
}

// Samples the board every hang.period(), until a hang is seen (agent/hang_policy.h).
void Agent::Impl::schedule_progress_check() {
  arm(progress_timer, monotonic_seconds() + hang.period(), [this] {
    if (core.state() != Supervisor::State::kRunning) return;
    const double now = monotonic_seconds();
    sample_progress(now);
    if (auto line = hang.silence(now, !options.command.no_python)) say(*line);
    std::vector<WatchedWorker> watched;
    for (const auto& w : core.workers()) {
      if (w.alive) watched.push_back({w.ref, w.python, w.hung});
    }
    const HangVerdict verdict = hang.check(watched, now);
    if (!verdict.hang) {
      schedule_progress_check();
      return;
    }
    declare_hangs(verdict);
  });
}

// Samples the board every StallWatch::kPeriod while the round runs; a stall of the workers is
// told to the rendezvous, which looks for a silent node (agent/stall_watch.h).
void Agent::Impl::schedule_stall_watch() {
  arm(stall_timer, monotonic_seconds() + StallWatch::kPeriod, [this] {
    if (core.state() != Supervisor::State::kRunning) return;
    std::uint64_t beats = 0;
    int steppers = 0;
    for (const auto& w : core.workers()) {
      const int slot = w.ref.local_rank;
      if (!w.alive || slot >= board.slots()) continue;
      const ProgressSample sample = board.read(slot);
      if (sample.beats == 0 || sample.beats >= contracts::kDoneBeats) continue;
      beats += sample.beats;
      ++steppers;
    }
    const double now = monotonic_seconds();
    if (auto silent = stalls.observe(beats, steppers, now)) rendezvous->report_stall(*silent);
    if (auto line = stalls.blind(now, !options.command.no_python)) say(*line);
    schedule_stall_watch();
  });
}

// Each hung worker is sent its dump signal, one at a time (HangWatch::kDumpStep); its exit is
// then a failure like any other, headed by what the board said about it. Those still alive
// kDumpGrace after the last dump signal are killed.
void Agent::Impl::declare_hangs(const HangVerdict& verdict) {
  for (const auto& h : verdict.declared) {
    if (WorkerIo* w = worker_io(h.pid)) w->note = h.note;
    deliver(event::Hung{h.pid});
    say(h.message);
    dumps.add(h.pid, h.signal);
  }
  send_next_dump();
}

void Agent::Impl::send_next_dump() {
  const auto dump = dumps.next(monotonic_seconds(), [this](int pid) { return core.live(pid) != nullptr; });
  if (!dump) {
    ProgressLine::console().release();
    return;
  }
  if (dump->signal == SIGABRT) {
    // Its stacks go to the console in one piece: what the agent said is out first, and what
    // it says meanwhile waits (a Python worker's dump takes milliseconds).
    OutputQueue::console().flush(std::chrono::milliseconds(200));
    ProgressLine::console().hold();
  }
  processes->signal_process(dump->pid, dump->signal);
  arm(dump_step_timer, dump->next_at, [this] { send_next_dump(); });
  arm(dump_timer, dump->kill_at, [this] {
    for (const auto& w : core.workers()) {
      if (w.alive && w.hung) processes->signal_group(w.ref.pid, SIGKILL);
    }
  });
}

bool Agent::Impl::start_file_timer() {
  FileTimerServer::Callbacks cb;
  cb.is_worker = [this](int pid) { return core.live(pid) != nullptr; };
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

void Agent::Impl::on_timer_expired(const TimerRequest& r) {
  const SupervisedWorker* live = core.live(r.pid);
  WorkerIo* w = worker_io(r.pid);
  if (live == nullptr || w == nullptr) return;
  w->note = "its timer '" + r.scope_id + "' (torch.distributed.elastic.timer) expired; sent " + signal_name(r.signal);
  say("worker " + std::to_string(w->rank) + " (pid " + std::to_string(w->pid) + "): " + w->note);
  processes->signal_process(w->pid, r.signal);
}

// ---- in-memory restart: what workers say on their channel (contracts/worker_channel.h) -------------

// Handlers name the worker by pid: its WorkerIo moves between rounds, its pid does not.
void Agent::Impl::start_link(WorkerIo& w) {
  const int pid = w.pid;
  WorkerLink::Handlers h;
  h.on_message = [this, pid](const WorkerMessage& m) { on_worker_message(pid, m); };
  h.on_error = [this, pid](const std::string& problem) { deliver(event::ChannelLost{pid, problem}); };
  h.on_closed = [this, pid] { deliver(event::ChannelLost{pid, ""}); };
  w.link->start(std::move(h));
}

void Agent::Impl::on_worker_message(int pid, const WorkerMessage& m) {
  switch (m.type) {
    case WorkerMessage::Type::kStandbyReady: return;  // a standby's word, read late
    case WorkerMessage::Type::kRestartable: deliver(event::Restartable{pid, m.restartable}); return;
    case WorkerMessage::Type::kParked: deliver(event::Parked{pid, m.step}); return;
  }
}

// ---- health checks ------------------------------------------------------------------------------

std::string Agent::Impl::health_log_path() const {
  return options.log_dir + "/" + options.run_id + "/health_check.log";
}

// Runs the check for `purpose` in a process of its own (reaped like a worker, never blocking the
// loop); its output goes to <log_dir>/<run_id>/health_check.log, whose tail explains a failure.
void Agent::Impl::run_health_check(HealthPurpose purpose) {
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

void Agent::Impl::on_health_exit(ExitStatus st) {
  health_deadline.cancel();
  const std::string why =
      st.success() ? "" : health.why_failed(st.exit_code, st.signal, tail_of_file(health_log_path(), 5, 1024));
  on_health_result(health.purpose(), st.success(), why);
}

// Carries out what a check's result does (agent/health_schedule.h). A result for a state the
// agent has left is dropped: the round ended meanwhile, and the next join checks again.
void Agent::Impl::on_health_result(HealthPurpose purpose, bool ok, const std::string& why) {
  const auto wanted = purpose == HealthPurpose::kBeforeJoin ? Supervisor::State::kJoining : Supervisor::State::kRunning;
  if (core.state() != wanted) return;
  const HealthStep step = health.result(purpose, ok, why, options.node.host, wall_seconds(), monotonic_seconds());
  if (!step.message.empty()) say(step.message);
  switch (step.action) {
    case HealthStep::Do::kJoin:
      join_now();
      return;
    case HealthStep::Do::kRetry:
      arm(health_timer, step.at, [this] {
        if (core.state() == Supervisor::State::kJoining) deliver(event::Join{});
      });
      return;
    case HealthStep::Do::kNext:
      schedule_health_check(step.at);
      return;
    case HealthStep::Do::kLeave:
      deliver(event::HealthFailed{step.failure});
      return;
  }
}

void Agent::Impl::schedule_health_check(double at) {
  arm(health_timer, at, [this] {
    if (core.state() == Supervisor::State::kRunning) run_health_check(HealthPurpose::kWhileRunning);
  });
}

}  // namespace ddp::agent
