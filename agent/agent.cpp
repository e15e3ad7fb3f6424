// The agent's shell: events in, effects out (agent/agent_shell.h). The decisions are the
// Supervisor's (agent/supervisor.h).

#include "agent/agent.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

#include <boost/asio/post.hpp>

#include "agent/agent_shell.h"
#include "agent/containment.h"
#include "rendezvous/error.h"
#include "agent/failure.h"
#include "agent/progress_line.h"

namespace asio = boost::asio;

namespace ddp::agent {

namespace {

// A time of monotonic_seconds() as the steady clock's time point.
std::chrono::steady_clock::time_point steady_time(double seconds) {
  using namespace std::chrono;
  return steady_clock::time_point(duration_cast<steady_clock::duration>(duration<double>(seconds)));
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

Supervisor::Config supervisor_config(const AgentOptions& o) {
  Supervisor::Config c;
  c.host = o.node.host;
  c.program = o.command.program;
  c.local_world_size = o.node.local_world_size;
  c.shutdown_timeout = o.shutdown_timeout;
  c.kill_timeout = o.kill_timeout;
  c.in_memory_restart = o.in_memory_restart;
  c.park_timeout = o.park_timeout;
  c.max_restarts_without_progress = o.max_restarts_without_progress;
  c.no_restart_exit_codes = o.no_restart_exit_codes;
  return c;
}

}  // namespace

double monotonic_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

double wall_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

Agent::Impl::Impl(asio::io_context& io, AgentOptions opts, std::unique_ptr<RendezvousHandler> rdzv,
                  std::unique_ptr<Processes> procs)
    : io(io),
      options(std::move(opts)),
      rendezvous(std::move(rdzv)),
      processes(procs ? std::move(procs) : make_posix_processes(io)),
      core(supervisor_config(options)),
      signals(io),
      kill_timer(io),
      give_up_timer(io),
      park_timer(io),
      progress_timer(io),
      stall_timer(io),
      dump_timer(io),
      dump_step_timer(io),
      health_timer(io),
      health_deadline(io),
      standby_timer(io),
      standby_ready_timer(io),
      inherited(current_environment()),
      standbys(static_cast<std::size_t>(std::max(0, options.node.local_world_size))),
      cwd(working_directory()),
      board(options.node.local_world_size),
      hang(options.hang, options.node.local_world_size),
      standby_schedule(options.standby_delay, options.standby_delay_max, options.standby_ready_timeout),
      health(options.health_check, options.health_check_interval, options.health_check_timeout) {
  if (options.log_dedup) dedup = std::make_shared<ConsoleDedup>(io, options.log_dedup_window);
}

int Agent::Impl::run() {
  RendezvousEvents events;
  events.on_round = [this](const rdzv::Assignment& a) {
    // A standby or a parked worker that died meanwhile is heard of before it would be given a
    // worker to become (a round nobody waits for is dropped: no reap could end a stop for it).
    if (core.state() != Supervisor::State::kJoining) return;
    if (options.standby || options.in_memory_restart) processes->reap_exited();
    deliver(event::Round{a});
  };
  events.on_restart = [this](const std::string& reason, bool counted, bool failing, bool failure) {
    before_decision();
    event::Restart r;
    r.reason = reason;
    r.counted = counted;
    r.failing = failing;
    r.failure = failure;
    r.quiet = options.log_dedup && rendezvous->said_elsewhere();
    if (counted) {
      // After a failed round: did any rank get beyond the job's best step or checkpoint?
      sample_progress(monotonic_seconds());
      r.best_step = hang.monitor().best_step();
      r.best_checkpoint = hang.monitor().best_checkpoint();
    }
    deliver(r);
  };
  events.on_job_succeeded = [this] { deliver(event::JobSucceeded{}); };
  events.on_job_failed = [this](const rdzv::WorkerFailure& f, const std::string& s) {
    before_decision();
    deliver(event::JobFailed{f, s, options.log_dedup && rendezvous->said_elsewhere()});
  };
  events.on_rendezvous_error = [this](const std::string& m) {
    before_decision();
    deliver(event::RendezvousError{m});
  };
  events.on_drained = [this](const std::string& m) {
    before_decision();
    deliver(event::Drained{m});
  };
  rendezvous->set_events(std::move(events));
  rendezvous->set_progress_source([this] {
    std::vector<ProgressSample> samples;
    for (int slot = 0; slot < board.slots(); ++slot) samples.push_back(board.read(slot));
    return summarize(samples);
  });
  processes->set_exit_handler([this](int pid, ExitStatus st) { exited(pid, st); });
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
  return core.exit_code();
}

// ---- events in, effects out ----------------------------------------------------------------------

// Steps the supervisor with `e` at the time now and carries out what it decided, oldest first.
// An effect that delivers an event (a worker started, a failure recorded) queues that event's
// effects behind the ones already decided.
void Agent::Impl::deliver(const Event& e) {
  core.tick({monotonic_seconds(), wall_seconds()});
  core.step(e);
  for (auto& fx : core.take()) effects.push_back(std::move(fx));
  if (carrying_out) return;
  carrying_out = true;
  while (!effects.empty()) {
    const Effect fx = std::move(effects.front());
    effects.pop_front();
    carry_out(fx);
  }
  carrying_out = false;
}

// A decision (restart, job failed, rendezvous error) acts on the workers as they are: a worker
// that died before it arrived is a failure of its round, not a worker the agent stopped.
void Agent::Impl::before_decision() {
  if (core.state() == Supervisor::State::kRunning) processes->reap_exited();
}

void Agent::Impl::carry_out(const Effect& fx) {
  std::visit(
      Overloaded{
          [](const effect::Say& s) { say(s.line); },
          [this](const effect::Record& r) {
            record_event(r.type, r.cause, r.ranks, r.fields, r.message, r.generation);
          },
          [this](const effect::Join& j) {
            if (j.check_health && health.enabled()) {
              run_health_check(HealthPurpose::kBeforeJoin);
            } else {
              join_now();
            }
          },
          [this](const effect::StartRound& s) { start_round(s); },
          [this](const effect::Signal& s) {
            if (s.group) {
              processes->signal_group(s.pid, s.signo);
            } else {
              processes->signal_process(s.pid, s.signo);
            }
          },
          [this](const effect::ReportFailure& r) { rendezvous->report_failure(r.failure); },
          [this](const effect::ReportSuccess&) { rendezvous->report_success(); },
          [this](const effect::CloseRendezvous&) { rendezvous->close(); },
          [this](const effect::AbandonRound&) { board.abandon_round(); },
          [this](const effect::AbandonSlot& a) { board.abandon_slot(a.local_rank); },
          [this](const effect::Arm& a) {
            const Deadline d = a.deadline;
            arm(timer(d), a.at, [this, d] { deliver(event::Due{d}); });
          },
          [this](const effect::Cancel& c) { timer(c.deadline).cancel(); },
          [this](const effect::Post& p) {
            const Later what = p.what;
            asio::post(io, [this, what] { deliver(event::Posted{what}); });
          },
          [this](const effect::CloseChannel& c) {
            if (WorkerIo* w = worker_io(c.pid); w != nullptr && w->link) w->link->close();
          },
          [this](const effect::RecordFailure& r) { record_failure(r); },
          [this](const effect::NoteParked& p) {
            WorkerIo* w = worker_io(p.pid);
            if (w == nullptr) return;
            w->parked_step = p.step;
            if (w->marker.empty()) w->marker = environ_value(p.pid, Containment::kMarkerVariable);
          },
          [this](const effect::DrainOutput& d) {
            // A parked worker's pipes stay open: it may still write before its next assignment
            // gives it new streams (a closed pipe would kill it with SIGPIPE).
            for (int pid : d.pids) {
              WorkerIo* w = worker_io(pid);
              if (w == nullptr) continue;
              for (auto& p : w->pipes) p->drain_and_close();
              w->pipes.clear();
            }
          },
          [this](const effect::FlushLines&) { flush_worker_lines(); },
          [](const effect::Console& c) { OutputQueue::console().write(STDERR_FILENO, c.text); },
          [this](const effect::StopSettled&) {
            dump_timer.cancel();
            dump_step_timer.cancel();
            dumps.clear();
            ProgressLine::console().release();
          },
          [this](const effect::KillLeftovers&) { processes->kill_leftovers(); },
          [this](const effect::Exit&) { release_everything(); },
      },
      fx);
}

asio::steady_timer& Agent::Impl::timer(Deadline d) {
  switch (d) {
    case Deadline::kKill: return kill_timer;
    case Deadline::kGiveUp: return give_up_timer;
    case Deadline::kPark: break;
  }
  return park_timer;
}

// Runs `then` at `at` (monotonic_seconds()) unless `timer` is cancelled or re-armed first: how
// the deadlines are kept.
void Agent::Impl::arm(asio::steady_timer& timer, double at, std::function<void()> then) {
  timer.expires_at(steady_time(at));
  timer.async_wait([then = std::move(then)](const boost::system::error_code& ec) {
    if (!ec) then();
  });
}

WorkerIo* Agent::Impl::worker_io(int pid) {
  for (auto& w : workers) {
    if (w.pid == pid) return &w;
  }
  return nullptr;
}

// The one place the agent records a lifecycle event: the event log and the metrics consume it.
void Agent::Impl::record_event(const std::string& type, const std::string& cause, std::vector<int> ranks,
                               nlohmann::json fields, const std::string& message, std::uint64_t generation) {
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

// What the summary shows of a failed worker: its error file, else the last lines of its stderr
// (after the rest of its output is read).
void Agent::Impl::record_failure(const effect::RecordFailure& r) {
  event::FailureRecorded rec;
  rec.into_last = r.into_last;
  FailedWorker& fw = rec.worker;
  fw.exit_code = r.exit_code;
  fw.signal = r.signal;
  if (WorkerIo* w = worker_io(r.pid)) {
    for (auto& p : w->pipes) p->drain_and_close();
    fw.ref = {w->pid, w->rank, w->local_rank};
    fw.note = w->note;
    fw.error_file = w->error_file;
    fw.error = read_error_file(w->error_file);
    if (!fw.error.present && fw.error.problem.empty()) {
      if (w->stderr_tail) {
        fw.stderr_tail = w->stderr_tail->text();
      } else if (!w->stderr_log.empty()) {
        fw.stderr_tail = tail_of_file(w->stderr_log);
        fw.stderr_log = w->stderr_log;
      }
    }
    for (const auto& path : {w->stdout_log, w->stderr_log}) {
      if (!path.empty()) fw.log_files.push_back(path);
    }
    rec.final = w->local_rank >= 0 && w->local_rank < board.slots() && board.read(w->local_rank).final;
  } else if (const SupervisedWorker* s = core.live(r.pid)) {
    fw.ref = s->ref;
  }
  deliver(rec);
}

void Agent::Impl::join_now() {
  if (options.pick_master_port) {
    try {
      options.node.master_port = pick_free_port(options.master_port_bind_addr);
    } catch (const std::exception& e) {
      deliver(event::CannotJoin{e.what()});
      return;
    }
  }
  rendezvous->join(options.node);
}

// ---- processes that ended ----------------------------------------------------------------------

void Agent::Impl::exited(int pid, ExitStatus st) {
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
  if (core.live(pid) == nullptr) return;  // not ours (or from an earlier round)
  deliver(event::Exited{pid, st.exit_code, st.signal});
  if (pid == dumps.dumping()) send_next_dump();
}

// ---- signals -------------------------------------------------------------------------------------

void Agent::Impl::wait_for_signal() {
  signals.async_wait([this](const boost::system::error_code& ec, int signo) {
    if (ec) return;
    deliver(event::Signal{signo});
    wait_for_signal();
  });
}

// ---- the end -------------------------------------------------------------------------------------

// The supervisor is done: nothing of this run may outlive it.
void Agent::Impl::release_everything() {
  stop_standbys();
  rendezvous->close();
  processes->close();  // kills what is left, a health check among it, and reaps it
  boost::system::error_code ignored;
  signals.cancel(ignored);
  for (auto* t : {&kill_timer, &give_up_timer, &park_timer, &progress_timer, &stall_timer, &dump_timer,
                  &dump_step_timer, &health_timer, &health_deadline, &standby_timer, &standby_ready_timer}) {
    t->cancel();
  }
  ProgressLine::console().release();
  file_timer.reset();
  io.stop();
}

// Gives the queued output (the failure summary among it) a bounded time to reach the console
// and the log files: a console nobody reads must not keep ddplaunch from exiting.
void Agent::Impl::flush_output() {
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
void Agent::Impl::flush_worker_lines() {
  if (dedup) dedup->flush();
}

void Agent::Impl::close_filtered_files() {
  for (int& fd : filtered_fds) {
    if (fd >= 0) files->close_after(fd);
    fd = -1;
  }
}

Agent::Agent(asio::io_context& io, AgentOptions options, std::unique_ptr<RendezvousHandler> rendezvous,
             std::unique_ptr<Processes> processes)
    : impl_(std::make_unique<Impl>(io, std::move(options), std::move(rendezvous), std::move(processes))) {}

Agent::~Agent() = default;

int Agent::run() { return impl_->run(); }

}  // namespace ddp::agent
