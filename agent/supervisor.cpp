#include "agent/supervisor.h"

#include <signal.h>

#include <algorithm>

#include "rendezvous/error.h"

namespace ddp::agent {

namespace {

constexpr int kUsage = static_cast<int>(ExitCode::kUsage);
constexpr int kJobFailed = static_cast<int>(ExitCode::kJobFailed);
constexpr int kRendezvousFailed = static_cast<int>(ExitCode::kRendezvousFailed);

const char* job_end_cause(int code) {
  if (code == 0) return "succeeded";
  if (code == kJobFailed) return "failed";
  if (code == kRendezvousFailed) return "rendezvous_failed";
  if (code == kUsage) return "usage";
  return "signal";
}

}  // namespace

const char* state_name(Supervisor::State s) {
  switch (s) {
    case Supervisor::State::kJoining: return "joining";
    case Supervisor::State::kRunning: return "running";
    case Supervisor::State::kStopping: return "stopping";
    case Supervisor::State::kIdle: return "idle";
    case Supervisor::State::kDone: return "done";
  }
  return "?";
}

Supervisor::Supervisor(Config config)
    : config_(std::move(config)),
      grace_(config_.shutdown_timeout, config_.kill_timeout),
      parking_(config_.in_memory_restart, config_.park_timeout),
      crash_loop_(config_.max_restarts_without_progress, config_.no_restart_exit_codes) {}

std::vector<Effect> Supervisor::take() {
  std::vector<Effect> out;
  out.swap(out_);
  return out;
}

// ---- dispatch --------------------------------------------------------------------------------

void Supervisor::step(const Event& e) {
  switch (state_) {
    case State::kDone: return;  // finished: nothing is heard any more
    case State::kJoining: step_joining(e); return;
    case State::kRunning: step_running(e); return;
    case State::kStopping: step_stopping(e); return;
    case State::kIdle: step_any(e); return;
  }
}

void Supervisor::step_joining(const Event& e) {
  if (const auto* r = std::get_if<event::Round>(&e)) {
    round(r->assignment);
    return;
  }
  step_any(e);
}

void Supervisor::step_running(const Event& e) {
  std::visit(Overloaded{
                 [this](const event::Started& s) { started(s); },
                 [this](const event::StartFailed& f) {
                   say(f.why);
                   for (auto& w : workers_) {
                     if (std::count(f.gone.begin(), f.gone.end(), w.ref.pid) > 0) w.alive = false;
                   }
                   exit_code_ = kUsage;
                   emit(effect::CloseRendezvous{});
                   stop_workers(SIGTERM, Then::make(Then::Do::kExit, kUsage), false);
                 },
                 [this](const event::HealthFailed& h) {
                   LocalFailure lf;
                   lf.failure = h.failure;
                   failures_.push_back(lf);
                   last_failures_ = failures_;
                   reported_ = h.failure;
                   emit(effect::ReportFailure{h.failure});
                   stop_workers(SIGTERM, Then{}, false);
                 },
                 [](const event::Join&) {},  // joined already
                 [this, &e](const auto&) { step_any(e); },
             },
             e);
}

void Supervisor::step_stopping(const Event& e) {
  std::visit(Overloaded{
                 [this](const event::Due& d) {
                   if (d.deadline == Deadline::kGiveUp) {
                     give_up();
                   } else if (d.deadline == Deadline::kPark) {
                     stop_kept_workers("");
                   } else {
                     for (const auto& line : grace_.overdue(still_running())) say(line);
                     kill_now();
                   }
                 },
                 // A join that was due before the stop began (the standbys' word before the
                 // first join, a check's retry): the stop's decision says what comes next.
                 [](const event::Join&) {},
                 [this](const event::Posted& p) {
                   if (p.what == Later::kStopDone) {
                     if (settled()) stop_done();
                   } else {
                     report_failure();
                   }
                 },
                 [this, &e](const auto&) { step_any(e); },
             },
             e);
}

void Supervisor::step_any(const Event& e) {
  std::visit(Overloaded{
                 [this](const event::Join&) { join(true); },
                 [this](const event::CannotJoin& c) {
                   say(c.why);
                   finish(kRendezvousFailed);
                 },
                 [this](const event::Exited& x) { exited(x); },
                 [this](const event::FailureRecorded& r) { failure_recorded(r); },
                 [this](const event::Restartable& r) {
                   SupervisedWorker* w = find(r.pid, true);
                   if (w == nullptr) return;
                   w->restartable = r.restartable;
                   if (ParkPolicy::restartable_word(view(*w), r.restartable) == OnWord::kStop) {
                     stop_kept_worker(*w, "said it is no longer restartable");
                   }
                 },
                 [this](const event::Parked& p) { parked(p); },
                 [this](const event::ChannelLost& c) { channel_lost(c.pid, c.problem); },
                 [this](const event::Hung& h) {
                   if (SupervisedWorker* w = find(h.pid, true)) w->hung = true;
                 },
                 // A deadline of a stop that is over (it fired as the stop ended): nothing to do.
                 [](const event::Due&) {},
                 [this](const event::Posted& p) {
                   if (p.what == Later::kReportFailure) {
                     report_failure();
                     if (state_ == State::kRunning) {
                       emit(effect::AbandonRound{});  // the other ranks wait in collectives for the failed one
                       stop_workers(SIGTERM, Then{}, /*park=*/true);
                     }
                   }
                 },
                 [this](const event::Restart& r) { restart(r); },
                 [this](const event::JobSucceeded&) { finish(0); },
                 [this](const event::JobFailed& f) { job_failed(f.first, f.summary, f.quiet); },
                 [this](const event::RendezvousError& r) {
                   say("rendezvous failed: " + r.message);
                   when_stopped(Then::make(Then::Do::kExit, kRendezvousFailed), false);
                 },
                 [this](const event::Signal& s) { signal(s.signo); },
                 [this](const event::Drained& d) { drained(d.message); },
                 [](const event::Round&) {},        // not joining: a round nobody waits for
                 [](const event::Started&) {},      // only while running
                 [](const event::StartFailed&) {},  // only while running
                 [](const event::HealthFailed&) {}, // a check's result for a round that is over
             },
             e);
}

// ---- rounds ------------------------------------------------------------------------------------

void Supervisor::join(bool check_health) {
  state_ = State::kJoining;
  emit(effect::Join{check_health});
}

void Supervisor::round(const rdzv::Assignment& a) {
  if (crash_loop_.fatal()) {
    // A round after this node's fatal report: the rendezvous did not take it (a daemon that
    // predates it, or one that restarted meanwhile). The decision stands: the job ends here.
    say("the rendezvous started a new round despite this node's decision; leaving the job");
    emit(effect::CloseRendezvous{});
    if (reported_) {
      job_failed(*reported_, crash_loop_.reason(), false);
    } else {
      say("job failed: " + crash_loop_.reason());
      finish(kJobFailed);
    }
    return;
  }
  effect::StartRound start;
  start.assignment = a;
  failures_.clear();
  parked_.clear();
  for (auto& w : workers_) {
    if (w.alive && w.park == ParkState::kParked && w.channel_open) {
      start.parked.emplace_back(w.ref.local_rank, w.ref.pid);  // keeps its GPU memory: not a previous pid
      parked_.push_back(w);
      continue;
    }
    start.previous.push_back(w.ref.pid);
    if (w.channel_open) emit(effect::CloseChannel{w.ref.pid});
  }
  workers_.clear();
  reported_.reset();
  round_restart_count_ = a.restart_count;
  state_ = State::kRunning;
  generation_ = a.generation;
  std::vector<int> ranks;
  for (int lr = 0; lr < config_.local_world_size; ++lr) ranks.push_back(a.rank_offset + lr);
  record("round", "complete", std::move(ranks),
         {{"group_rank", a.group_rank}, {"group_world_size", a.group_world_size}, {"world_size", a.world_size},
          {"master", a.master_addr + ":" + std::to_string(a.master_port)}, {"restart_count", a.restart_count}});
  emit(std::move(start));
}

void Supervisor::started(const event::Started& s) {
  SupervisedWorker w;
  w.ref = s.ref;
  w.python = s.python;
  w.channel_open = s.channel;
  if (s.in_memory) {
    for (const auto& p : parked_) {
      if (p.ref.pid == s.ref.pid) w.restartable = p.restartable;
    }
  }
  workers_.push_back(w);
}

// ---- worker exits ------------------------------------------------------------------------------

void Supervisor::exited(const event::Exited& x) {
  SupervisedWorker* w = find(x.pid, true);
  if (w == nullptr) return;  // not ours (or from an earlier round)
  w->alive = false;
  w->exit_code = x.exit_code;
  w->signal = x.signal;
  if (w->channel_open) {
    w->channel_open = false;
    emit(effect::CloseChannel{w->ref.pid});
  }
  const bool success = x.signal == 0 && x.exit_code == 0;
  // A failure is recorded with what the summary shows (RecordFailure); every other exit here.
  if (state_ != State::kRunning || success) {
    record("worker_exited", state_ == State::kRunning ? "success" : "stopped", {w->ref.rank}, exit_fields(*w));
  }
  if (state_ == State::kStopping) {
    if (w->hung && !w->recorded) {
      // A hung worker that died of its dump signal after the stop began: its stacks belong in
      // the summary with the others' (the stop ends once it is recorded).
      emit(effect::RecordFailure{w->ref.pid, x.exit_code, x.signal, /*into_last=*/true});
      return;
    }
    if (settled()) stop_done();
    return;
  }
  if (state_ != State::kRunning) return;
  if (!success || w->hung) {
    // Reported at once, not after the other workers stopped: stopping can take up to
    // --shutdown_timeout (workers save checkpoints on SIGTERM). Posted, so that the exits
    // reaped in the same batch are recorded first: a worker killed by a signal and the peer
    // that exited 1 because of it can be reaped together, in either order (report_failure
    // picks the cause). The stop comes after the report, so the report precedes the rejoin
    // and no worker we stopped is taken for a candidate.
    emit(effect::RecordFailure{w->ref.pid, x.exit_code, x.signal, false});
    if (!report_pending_) {
      report_pending_ = true;
      emit(effect::Post{Later::kReportFailure});
    }
    return;
  }
  const bool all_exited = std::none_of(workers_.begin(), workers_.end(), [](const auto& v) { return v.alive; });
  if (all_exited && failures_.empty()) {
    emit(effect::DrainOutput{unkept_pids()});
    state_ = State::kIdle;
    emit(effect::ReportSuccess{});
  }
}

void Supervisor::failure_recorded(const event::FailureRecorded& r) {
  SupervisedWorker* w = find(r.worker.ref.pid, false);
  if (w != nullptr) w->recorded = true;
  crash_loop_.worker_failed(r.worker.ref.rank, r.worker.exit_code, r.worker.signal, w != nullptr && w->hung, r.final);
  // Exits reaped in one batch happened in an order we cannot know: they share a time.
  const double seen = report_pending_ && !failures_.empty() ? failures_.front().failure.timestamp : now_.wall;
  LocalFailure lf = describe_failure(r.worker, config_.host, seen);
  nlohmann::json fields = {{"local_rank", r.worker.ref.local_rank},
                           {"pid", r.worker.ref.pid},
                           {"exit_code", r.worker.exit_code},
                           {"signal", r.worker.signal}};
  fields["error_file"] = lf.error_file;
  fields["log_files"] = lf.log_files;
  record("worker_exited", lf.failure.signal != 0 ? "signal" : "exit_code", {r.worker.ref.rank}, std::move(fields),
         lf.failure.error_file_message);
  if (r.into_last) last_failures_.push_back(lf);
  failures_.push_back(std::move(lf));
  if (state_ == State::kStopping && settled()) stop_done();
}

// Tells the rendezvous about the failure that explains this round's others (root_cause).
void Supervisor::report_failure() {
  report_pending_ = false;
  if (failures_.empty()) return;
  last_failures_ = failures_;
  reported_ = root_cause(failures_).failure;
  if (crash_loop_.fatal()) {
    // A --no_restart_exit_codes exit: the whole job ends, on every node (end_job_everywhere).
    reported_->fatal = crash_loop_.reason();
    fatal_reported_ = true;
  }
  emit(effect::FlushLines{});
  say(failure_line(*reported_, parking_others()));
  emit(effect::ReportFailure{*reported_});
}

// ---- what the rendezvous decided ---------------------------------------------------------------

void Supervisor::restart(const event::Restart& r) {
  if (handled_signal_ != 0) return;
  if (r.counted) crash_loop_.round_ended(r.best_step, r.best_checkpoint, round_restart_count_);
  if (crash_loop_.fatal()) {
    end_job_everywhere();
    return;
  }
  if (r.failure && state_ == State::kRunning) emit(effect::AbandonRound{});
  if (r.quiet) {
    say(std::string(r.failing ? "stopping the workers" : "restarting the workers") +
        " (another node of the job prints why: --log_dedup)");
  } else {
    say((r.failing ? "stopping the workers: " : "restarting the workers: ") + r.reason);
  }
  record("restart", r.failing ? "job_failing" : r.counted ? "worker_failure" : "membership", {},
         {{"counted", r.counted}}, r.reason);
  when_stopped(Then::make(Then::Do::kJoin), /*park=*/!r.failing);
}

// This node decided that the job must end (--no_restart_exit_codes, a crash loop). The decision
// is the job's, not this node's: the rendezvous hears it in a fatal failure report and fails the
// job on every node with that reason (job_failed shows the verdict, here as everywhere).
// Meanwhile this node stops its workers and rejoins, which tells the rendezvous they have
// stopped; a failing job gets no new round. No health check before that join: the node only
// says it has stopped.
void Supervisor::end_job_everywhere() {
  if (!fatal_reported_ && !report_pending_) {
    fatal_reported_ = true;
    emit(effect::ReportFailure{
        fatal_report(reported_ ? &*reported_ : nullptr, config_.host, crash_loop_.reason(), now_.wall)});
  }
  say("the job fails: " + crash_loop_.reason() + "; stopping the workers");
  if (state_ == State::kRunning) emit(effect::AbandonRound{});
  when_stopped(Then::make(Then::Do::kRejoin), false);
}

void Supervisor::job_failed(const rdzv::WorkerFailure& first, const std::string& summary, bool quiet) {
  if (state_ == State::kRunning) emit(effect::AbandonRound{});
  Then then = Then::make(Then::Do::kJobFailed);
  then.first = first;
  then.summary = summary;
  then.quiet = quiet;
  when_stopped(std::move(then), false);
}

void Supervisor::signal(int signo) {
  if (handled_signal_ != 0) {
    // A second signal while stopping: do not wait for the grace period.
    say("got " + signal_name(signo) + " again; killing the workers now");
    if (state_ == State::kStopping) kill_now();
    return;
  }
  handled_signal_ = signo;
  say("got " + signal_name(signo) + "; forwarding it to the workers and stopping them");
  emit(effect::CloseRendezvous{});
  stop_workers(signo, Then::make(Then::Do::kExit, exit_code_for_signal(signo)), false);
}

// An operator took this node out of the job (ddp-rendezvous drain); the rendezvous has closed
// its connection, and the job's other nodes restart without it. With in-memory restart they park
// with their last completed step, so this node's workers leave their collectives at once (the
// round is abandoned) instead of finishing a step that can no longer complete. Without it, the
// others finish their step and checkpoint on SIGTERM, so these workers are asked to do the same.
void Supervisor::drained(const std::string& message) {
  if (handled_signal_ != 0 || state_ == State::kDone) return;
  say(message + "; stopping the workers");
  record("drained", "drain", {}, {}, message);
  if (state_ == State::kRunning && config_.in_memory_restart) emit(effect::AbandonRound{});
  when_stopped(Then::make(Then::Do::kDrained), false);
}

// ---- in-memory restart: what workers say on their channel --------------------------------------

void Supervisor::parked(const event::Parked& p) {
  SupervisedWorker* w = find(p.pid, true);
  if (w == nullptr) return;
  const OnWord word = ParkPolicy::parked_word(view(*w), state_ == State::kStopping);
  if (word == OnWord::kBreak) {
    w->channel_open = false;
    emit(effect::CloseChannel{p.pid});
    channel_lost(p.pid, "it said it parked without having said it is restartable");
    return;
  }
  if (word != OnWord::kParked) return;
  w->park = ParkState::kParked;
  emit(effect::NoteParked{p.pid, p.step});
  record("worker_parked", "", {w->ref.rank}, {{"local_rank", w->ref.local_rank}, {"pid", p.pid}, {"step", p.step}});
  if (state_ == State::kStopping && settled()) stop_done();
}

// The channel broke (`problem`) or was closed by the worker (empty): it is no longer
// restartable; kept across a restart, it is stopped.
void Supervisor::channel_lost(int pid, const std::string& problem) {
  SupervisedWorker* w = find(pid, true);
  if (w == nullptr) return;
  w->restartable = false;
  w->channel_open = false;
  if (!problem.empty()) {
    say("worker " + std::to_string(w->ref.rank) + " (local rank " + std::to_string(w->ref.local_rank) + ", pid " +
        std::to_string(pid) + "): its channel to the agent: " + problem +
        "; closed it, the worker is not restartable (it is stopped at a restart like any worker)");
  }
  stop_kept_worker(*w, problem.empty() ? "closed its channel" : "broke its channel");
}

// ---- stopping ----------------------------------------------------------------------------------

// Runs `then` once every worker has exited: stops them with SIGTERM, or, when they are being
// stopped already (after a local failure), waits for that stop instead of signalling again
// (a second SIGTERM could cut a checkpoint short, and would restart the kill deadline).
// With `park` (a restart), restartable workers park instead (stop_workers); without it (the job
// ends), parked and parking workers are stopped too.
void Supervisor::when_stopped(Then then, bool park) {
  if (state_ == State::kStopping) {
    then_ = std::move(then);
    if (!park) stop_kept_workers("the job ends");
    return;
  }
  stop_workers(SIGTERM, std::move(then), park);
}

// Sends `signo` to every live worker's process group; SIGKILL after --shutdown_timeout.
// With `park` and in-memory restart, a worker that may park is asked to park instead (its
// abandoned word), and stopped like the others only when it has not parked within the park
// deadline (agent/park_policy.h). `then` runs once every worker has exited or parked.
void Supervisor::stop_workers(int signo, Then then, bool park) {
  then_ = std::move(then);
  state_ = State::kStopping;
  bool signalled = false, asked = false;
  for (auto& w : workers_) {
    if (!w.alive) continue;
    switch (parking_.at_stop(view(w), park)) {
      case AtStop::kAskToPark:
        w.park = ParkState::kAsked;
        emit(effect::AbandonSlot{w.ref.local_rank});
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
        if (!w.hung) emit(effect::Signal{w.ref.pid, signo});
        break;
    }
  }
  if (asked) emit(effect::Arm{Deadline::kPark, parking_.deadline(now_.mono)});
  if (settled()) {
    emit(effect::Post{Later::kStopDone});
    return;
  }
  if (signalled) arm_kill();
}

// Stops the workers that were kept (asked to park, or parked) like any other: the job ends
// (`why`), or, with an empty `why`, the park deadline passed for those that did not park.
void Supervisor::stop_kept_workers(const std::string& why) {
  std::vector<SupervisedWorker*> stopped;
  std::vector<ParkView> overdue;
  for (auto& w : workers_) {
    if (!kept(w) || (why.empty() && w.park == ParkState::kParked)) continue;
    stopped.push_back(&w);
    overdue.push_back(view(w));
  }
  if (why.empty()) {
    for (const auto& line : parking_.overdue(overdue)) say(line);
  }
  for (SupervisedWorker* w : stopped) {
    w->park = ParkState::kNo;
    emit(effect::Signal{w->ref.pid, SIGTERM});
  }
  emit(effect::Cancel{Deadline::kPark});
  if (!stopped.empty()) arm_kill();
}

// A worker kept across a restart that cannot be kept any more (`why`): stopped like any other
// while a stop runs; between rounds, killed (it waits on a channel that is gone).
void Supervisor::stop_kept_worker(SupervisedWorker& w, const std::string& why) {
  if (!kept(w)) return;
  say("worker " + std::to_string(w.ref.rank) + " (pid " + std::to_string(w.ref.pid) + ") " + why + "; stopping it");
  w.park = ParkState::kNo;
  if (state_ == State::kStopping) {
    emit(effect::Signal{w.ref.pid, SIGTERM});
    arm_kill();
  } else {
    emit(effect::Signal{w.ref.pid, SIGKILL});
  }
}

// SIGKILL, --shutdown_timeout from now, to the workers still running then (kept ones aside).
void Supervisor::arm_kill() { emit(effect::Arm{Deadline::kKill, grace_.terminated(now_.mono)}); }

// SIGKILLs every live worker's group, and gives up on those that still have not exited
// --kill_timeout later (agent/shutdown_policy.h).
void Supervisor::kill_now() {
  for (const auto& w : workers_) {
    if (w.alive && !kept(w)) emit(effect::Signal{w.ref.pid, SIGKILL});
  }
  emit(effect::Arm{Deadline::kGiveUp, grace_.killed(now_.mono)});
}

void Supervisor::give_up() {
  const auto lines = grace_.give_up(still_running());
  std::size_t line = 0;
  for (auto& w : workers_) {
    if (!w.alive || kept(w)) continue;
    if (line < lines.size()) say(lines[line++]);
    w.alive = false;
    w.given_up = true;
    record("worker_exited", "given_up", {w.ref.rank}, exit_fields(w), "did not exit after SIGKILL");
  }
  if (settled()) stop_done();
}

void Supervisor::stop_done() {
  grace_.settled();
  emit(effect::Cancel{Deadline::kKill});
  emit(effect::Cancel{Deadline::kGiveUp});
  emit(effect::Cancel{Deadline::kPark});
  emit(effect::StopSettled{});
  // Leftovers in the workers' process groups (their own children) go with them, and with a
  // cgroup, also those that left their group (setsid). Parked workers stay, and with them the
  // cgroup's (or the marker's) leftovers until the next full stop: the containment cannot
  // spare some of its members (docs/agent.md).
  bool any_kept = false;
  for (const auto& w : workers_) {
    if (kept(w)) {
      any_kept = true;
    } else if (!w.given_up) {
      emit(effect::Signal{w.ref.pid, SIGKILL});
    }
  }
  if (!any_kept) emit(effect::KillLeftovers{});
  emit(effect::DrainOutput{unkept_pids()});
  state_ = State::kIdle;
  Then then = std::move(then_);
  then_ = Then{};
  run(std::move(then));
}

void Supervisor::run(Then then) {
  switch (then.what) {
    case Then::Do::kNothing: return;
    case Then::Do::kJoin: join(true); return;
    case Then::Do::kRejoin: join(false); return;
    case Then::Do::kExit: finish(then.code); return;
    case Then::Do::kDrained:
      say("drained: the workers have stopped; this node is out of the job");
      finish(0, "drained");
      return;
    case Then::Do::kJobFailed: {
      emit(effect::FlushLines{});
      if (then.quiet) {  // the node of the failure (or the job's first) prints the summary
        say("job failed (another node of the job prints the summary: --log_dedup)");
        finish(kJobFailed);
        return;
      }
      const SummaryParts parts = summary_parts(last_failures_, then.first);
      emit(effect::Console{
          format_failure_summary(config_.program, then.first, parts.error_file, parts.others, parts.log_files)});
      if (!then.summary.empty()) say("job failed: " + then.summary);
      finish(kJobFailed);
      return;
    }
  }
}

void Supervisor::finish(int code, const char* cause) {
  exit_code_ = code;
  record("job_end", cause != nullptr ? cause : job_end_cause(code), {}, {{"exit_code", code}});
  state_ = State::kDone;
  emit(effect::DrainOutput{unkept_pids()});
  emit(effect::Exit{code});
}

// ---- the workers -------------------------------------------------------------------------------

const SupervisedWorker* Supervisor::live(int pid) const {
  for (const auto& w : workers_) {
    if (w.alive && w.ref.pid == pid) return &w;
  }
  return nullptr;
}

SupervisedWorker* Supervisor::find(int pid, bool alive_only) {
  for (auto& w : workers_) {
    if (w.ref.pid == pid && (w.alive || !alive_only)) return &w;
  }
  return nullptr;
}

ParkView Supervisor::view(const SupervisedWorker& w) {
  return {w.ref, w.alive, w.restartable, w.hung, w.channel_open, w.park};
}

// Every worker has exited or parked: the stop is over.
bool Supervisor::settled() const {
  std::vector<ParkView> views;
  for (const auto& w : workers_) views.push_back(view(w));
  return ParkPolicy::settled(views);
}

// Whether the restart now under way keeps some live worker (it parks, not stops).
bool Supervisor::parking_others() const {
  return std::any_of(workers_.begin(), workers_.end(),
                     [this](const SupervisedWorker& w) { return w.alive && parking_.may_park(view(w)); });
}

// The workers a stop waits for: live, not kept.
std::vector<WorkerRef> Supervisor::still_running() const {
  std::vector<WorkerRef> out;
  for (const auto& w : workers_) {
    if (w.alive && !kept(w)) out.push_back(w.ref);
  }
  return out;
}

std::vector<int> Supervisor::unkept_pids() const {
  std::vector<int> out;
  for (const auto& w : workers_) {
    if (!kept(w)) out.push_back(w.ref.pid);
  }
  return out;
}

void Supervisor::record(const char* type, const std::string& cause, std::vector<int> ranks, nlohmann::json fields,
                        const std::string& message) {
  emit(effect::Record{type, cause, std::move(ranks), std::move(fields), message, generation_});
}

nlohmann::json Supervisor::exit_fields(const SupervisedWorker& w) {
  return {{"local_rank", w.ref.local_rank}, {"pid", w.ref.pid}, {"exit_code", w.exit_code}, {"signal", w.signal}};
}

}  // namespace ddp::agent
