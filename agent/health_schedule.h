// --check_health: when this node's health check runs and what its result does. Before each join
// the check runs, and a node whose check fails stays out of the job, checking again every
// `interval` seconds (it says so once, and says when the check passes again). While its workers
// run, the check runs every `interval` seconds; a failure then is this node's failure: it is
// reported, the workers are stopped, and the next join checks again. A check still running after
// `timeout` is killed and fails. A check that a newer one replaced (a periodic one still running
// when a join needs one) is killed and its exit ignored.
//
// Owned by Agent::Impl for the whole run; pure (pids, exit statuses, the log's tail and the time
// are given), used on the agent's io_context thread. Impl spawns the check (/bin/sh -c
// command()), kills the pids named here, and arms its timers at the times said here.
#pragma once

#include <string>
#include <vector>

#include "rendezvous/types.h"

namespace ddp::agent {

enum class HealthPurpose { kBeforeJoin, kWhileRunning };

// What a check's result does.
struct HealthStep {
  enum class Do {
    kJoin,   // before a join: it passed; join now
    kRetry,  // before a join: it failed; check again at `at`
    kNext,   // while running: it passed; check again at `at`
    kLeave,  // while running: it failed; report `failure`, stop the workers
  };
  Do action = Do::kJoin;
  double at = -1;
  std::string message;  // to say now, when not empty
  rdzv::WorkerFailure failure;
};

class HealthSchedule {
 public:
  // `check`: the --check_health command ("gpu": only the built-in GPU check; empty: off).
  // `interval`, `timeout`: seconds.
  HealthSchedule(std::string check, double interval, double timeout);
  bool enabled() const { return !check_.empty(); }
  double interval() const { return interval_; }

  // The check's shell command: the built-in GPU check first when `visible_gpus` > 0 (nvidia-smi
  // answers, and no GPU memory is held by `previous_pids`, the last round's workers), then the
  // user's. `say` gets a line once per run when no GPU is visible.
  std::string command(int visible_gpus, const std::vector<int>& previous_pids, std::string& say);

  // A check is about to start: the pid of the one still running (0: none), which the caller
  // kills; its exit will be ignored.
  int supersede();
  // The check for `purpose` started as `pid` at `now`. Returns its deadline.
  double started(int pid, HealthPurpose purpose, double now);
  // The deadline passed: the pid to kill (0: none runs).
  int deadline_passed();

  enum class Exit { kNotOurs, kStale, kCheck };
  // Process `pid` exited: the running check's (its result follows), a replaced one's, or not ours.
  Exit exited(int pid);
  // Why the check that ended with `exit_code`/`signal` failed, with the tail of its log; empty
  // when it passed.
  std::string why_failed(int exit_code, int signal, const std::string& log_tail) const;
  // What the check that ended was for.
  HealthPurpose purpose() const { return purpose_; }
  // The result of a check for `purpose`: passed (`ok`) or failed (`why`; also when it could not
  // start). `host`: this node, and `wall` (seconds since the epoch) for the failure's report;
  // `now` monotonic.
  HealthStep result(HealthPurpose purpose, bool ok, const std::string& why, const std::string& host, double wall,
                    double now);
  // When the first check of a round that started at `now` runs.
  double first_while_running(double now) const { return now + interval_; }
  // The running check's pid (0: none), which the caller kills when the job ends.
  int running() const { return pid_; }

 private:
  std::string check_;
  double interval_, timeout_;
  int pid_ = 0;
  bool timed_out_ = false;
  bool failing_ = false;
  bool gpu_skip_said_ = false;
  HealthPurpose purpose_ = HealthPurpose::kBeforeJoin;
  std::vector<int> stale_;
};

}  // namespace ddp::agent
