#pragma once

// The agent's state machine, pure: no Asio, no descriptors, no clock reads, no system calls.
//
// The shell (agent/agent.cpp) tells it what happened as events, each at the time of the last
// `tick`, and carries out what it decided: the effects it finds in `take()`, in their order.
// One handler per state (`step_joining`, `step_running`, `step_stopping`), in the way etcd's
// raft dispatches `stepLeader`/`stepFollower`/`stepCandidate`; what every state does alike is
// `step_any`. Decisions that stand on their own are the policy units it holds (ShutdownGrace,
// ParkPolicy, CrashLoopPolicy) or calls (failure_policy.h). docs/architecture.md, "The agent's
// lifecycle", is this code's.

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/crash_loop.h"
#include "agent/failure.h"
#include "agent/failure_policy.h"
#include "agent/park_policy.h"
#include "agent/policy.h"
#include "agent/shutdown_policy.h"
#include "rendezvous/types.h"

namespace ddp::agent {

// The time of the events that follow: the monotonic clock's seconds (deadlines) and the wall
// clock's (what reports and summaries show).
struct Tick {
  double mono = 0;
  double wall = 0;
};

// The deadlines the supervisor keeps; the shell holds one timer for each.
enum class Deadline { kKill, kGiveUp, kPark };

// Work the supervisor puts after what the shell has queued (the shell posts it back): the
// failure report waits for the exits reaped in the same batch; the end of a stop that found
// nothing to wait for runs after the decision that began it.
enum class Later { kReportFailure, kStopDone };

// A worker as the supervisor sees it. The shell keeps its resources (pipes, channel, log files).
struct SupervisedWorker {
  WorkerRef ref;
  bool alive = true;
  bool python = false;        // runs under the Python interpreter (its dump signal is SIGABRT)
  bool hung = false;          // declared hung: its exit is a failure, whatever its status
  bool recorded = false;      // its failure is recorded
  bool given_up = false;      // did not exit after SIGKILL (stuck in the kernel)
  bool restartable = false;   // it said so on its channel (in-memory restart)
  bool channel_open = false;  // its channel to the agent (in-memory restart)
  ParkState park = ParkState::kNo;
  int exit_code = 0;
  int signal = 0;
};

// std::visit with one lambda per alternative: how events and effects are taken apart.
template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

// What the supervisor decided; the shell carries each out and decides nothing.
namespace effect {
struct Say { std::string line; };
struct Record {  // a lifecycle event for the event log and the metrics
  std::string type, cause;
  std::vector<int> ranks;
  nlohmann::json fields = nlohmann::json::object();
  std::string message;
  std::uint64_t generation = 0;
};
struct Join { bool check_health = true; };  // (the configured check first), then join the rendezvous
// Start the round's workers (answer each with event::Started, or one event::StartFailed).
// `parked`: the workers kept from the last round, by local rank, that may take their rank's
// place; `previous`: the pids of the last round's other workers.
struct StartRound {
  rdzv::Assignment assignment;
  std::vector<std::pair<int, int>> parked;  // (local rank, pid)
  std::vector<int> previous;
};
struct Signal { int pid = 0; int signo = 0; bool group = true; };
struct ReportFailure { rdzv::WorkerFailure failure; };
struct ReportSuccess {};
struct CloseRendezvous {};
struct AbandonRound {};                // the board tells every rank its round is over
struct AbandonSlot { int local_rank = 0; };  // ... this rank only: it is asked to park
struct Arm { Deadline deadline; double at = 0; };
struct Cancel { Deadline deadline; };
struct Post { Later what; };
struct CloseChannel { int pid = 0; };
// Record the failure of the worker `pid` (read its error file or the tail of its stderr, after
// the rest of its output): answer with event::FailureRecorded.
struct RecordFailure { int pid = 0; int exit_code = 0; int signal = 0; bool into_last = false; };
struct NoteParked { int pid = 0; std::int64_t step = -1; };  // keep what its next assignment needs
struct DrainOutput { std::vector<int> pids; };  // read the rest of these workers' output, close it
struct FlushLines {};                           // lines held back (--log_dedup) go out now
struct Console { std::string text; };           // to stderr, as it is (the failure summary)
struct StopSettled {};                          // the stop is over: dumps and their timers end
struct KillLeftovers {};                        // the workers' own children, and with a cgroup, all
struct Exit { int code = 0; };                  // release everything, stop the loop
}  // namespace effect

using Effect = std::variant<effect::Say, effect::Record, effect::Join, effect::StartRound, effect::Signal,
                            effect::ReportFailure, effect::ReportSuccess, effect::CloseRendezvous,
                            effect::AbandonRound, effect::AbandonSlot, effect::Arm, effect::Cancel, effect::Post,
                            effect::CloseChannel, effect::RecordFailure, effect::NoteParked, effect::DrainOutput,
                            effect::FlushLines, effect::Console, effect::StopSettled, effect::KillLeftovers,
                            effect::Exit>;

// What happened. Before an event that decides (Round, Restart, JobFailed, RendezvousError) the
// shell delivers the exits that have already happened, so that a death that raced a decision is
// a failure of its round, not a worker the agent stopped.
namespace event {
struct Join {};                           // join the rendezvous (the first time, or again after a failed check)
struct CannotJoin { std::string why; };   // no master port could be picked
struct Round { rdzv::Assignment assignment; };
struct Started { WorkerRef ref; bool python = false; bool channel = false; bool in_memory = false; };
struct StartFailed { std::string why; std::vector<int> gone; };  // `gone`: forked, never ran
struct Exited { int pid = 0; int exit_code = 0; int signal = 0; };
struct FailureRecorded { FailedWorker worker; bool final = false; bool into_last = false; };
struct Restartable { int pid = 0; bool restartable = false; };
struct Parked { int pid = 0; std::int64_t step = -1; };
struct ChannelLost { int pid = 0; std::string problem; };  // empty: the worker closed it
struct Hung { int pid = 0; };
struct Due { Deadline deadline; };
struct Posted { Later what; };
// quiet: another node of the job prints the reason in full (--log_dedup with a daemon).
struct Restart { std::string reason; bool counted = false, failing = false, failure = false, quiet = false;
                 std::int64_t best_step = -1, best_checkpoint = -1; };
struct JobSucceeded {};
struct JobFailed { rdzv::WorkerFailure first; std::string summary; bool quiet = false; };
struct RendezvousError { std::string message; };
struct Drained { std::string message; };  // an operator took this node out of the job
struct Signal { int signo = 0; };
struct HealthFailed { rdzv::WorkerFailure failure; };  // a check while running: this node leaves the round
}  // namespace event

using Event = std::variant<event::Join, event::CannotJoin, event::Round, event::Started, event::StartFailed,
                           event::Exited, event::FailureRecorded, event::Restartable, event::Parked,
                           event::ChannelLost, event::Hung, event::Due, event::Posted, event::Restart,
                           event::JobSucceeded, event::JobFailed, event::RendezvousError, event::Signal,
                           event::HealthFailed, event::Drained>;

class Supervisor {
 public:
  enum class State { kJoining, kRunning, kStopping, kIdle, kDone };

  struct Config {
    std::string host;     // this node, in failure reports
    std::string program;  // the summary's title
    int local_world_size = 1;
    double shutdown_timeout = 30;
    double kill_timeout = 30;
    bool in_memory_restart = false;
    double park_timeout = 10;
    int max_restarts_without_progress = 0;
    std::vector<int> no_restart_exit_codes;
  };

  explicit Supervisor(Config config);

  void tick(Tick now) { now_ = now; }
  void step(const Event& e);
  std::vector<Effect> take();  // the outbox, oldest first; empties it

  State state() const { return state_; }
  int exit_code() const { return exit_code_; }
  std::uint64_t generation() const { return generation_; }
  const std::vector<SupervisedWorker>& workers() const { return workers_; }
  const SupervisedWorker* live(int pid) const;

 private:
  // What runs once every worker has exited or parked (when_stopped).
  struct Then {
    enum class Do { kNothing, kJoin, kRejoin, kExit, kJobFailed, kDrained } what = Do::kNothing;
    int code = 0;
    rdzv::WorkerFailure first;
    std::string summary;
    bool quiet = false;  // kJobFailed: another node prints the summary
    static Then make(Do what, int code = 0) {
      Then t;
      t.what = what;
      t.code = code;
      return t;
    }
  };

  void step_joining(const Event& e);
  void step_running(const Event& e);
  void step_stopping(const Event& e);
  void step_any(const Event& e);

  void round(const rdzv::Assignment& a);
  void started(const event::Started& s);
  void exited(const event::Exited& x);
  void failure_recorded(const event::FailureRecorded& r);
  void report_failure();
  void restart(const event::Restart& r);
  void end_job_everywhere();
  void job_failed(const rdzv::WorkerFailure& first, const std::string& summary, bool quiet);
  void signal(int signo);
  void drained(const std::string& message);
  void parked(const event::Parked& p);
  void channel_lost(int pid, const std::string& problem);

  void join(bool check_health);
  void when_stopped(Then then, bool park);
  void stop_workers(int signo, Then then, bool park);
  void stop_kept_workers(const std::string& why);
  void stop_kept_worker(SupervisedWorker& w, const std::string& why);
  void arm_kill();
  void kill_now();
  void give_up();
  void stop_done();
  void run(Then then);
  void finish(int code, const char* cause = nullptr);

  SupervisedWorker* find(int pid, bool alive_only);
  static ParkView view(const SupervisedWorker& w);
  bool kept(const SupervisedWorker& w) const { return ParkPolicy::kept(view(w)); }
  bool settled() const;
  bool parking_others() const;
  std::vector<WorkerRef> still_running() const;
  std::vector<int> unkept_pids() const;

  void say(std::string line) { out_.push_back(effect::Say{std::move(line)}); }
  void record(const char* type, const std::string& cause, std::vector<int> ranks,
              nlohmann::json fields = nlohmann::json::object(), const std::string& message = "");
  static nlohmann::json exit_fields(const SupervisedWorker& w);
  template <class E>
  void emit(E e) { out_.push_back(std::move(e)); }

  Config config_;
  ShutdownGrace grace_;
  ParkPolicy parking_;
  CrashLoopPolicy crash_loop_;
  Tick now_;
  State state_ = State::kIdle;
  std::vector<SupervisedWorker> workers_;
  std::vector<SupervisedWorker> parked_;  // kept from the last round, until this round's workers start
  Then then_;
  std::vector<LocalFailure> failures_;       // of the current round, in the order observed
  std::vector<LocalFailure> last_failures_;  // of the round that ended with a failure
  std::optional<rdzv::WorkerFailure> reported_;  // what this node reported this round, if anything
  bool report_pending_ = false;  // a failure was seen; its report is posted, not yet sent
  bool fatal_reported_ = false;  // the rendezvous was told crash_loop_.reason()
  int handled_signal_ = 0;
  int exit_code_ = 0;
  int round_restart_count_ = 0;
  std::uint64_t generation_ = 0;
  std::vector<Effect> out_;
};

const char* state_name(Supervisor::State s);

}  // namespace ddp::agent
