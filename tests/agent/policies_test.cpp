// The supervisor's policy units (agent/*_policy.h, agent/*_schedule.h, agent/crash_loop.h): each
// case is a table of rows, each row a script of calls with the time given and the decisions
// expected. No processes, no timers, no clock: time is the number each call is given.
#include <doctest/doctest.h>

#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "agent/crash_loop.h"
#include "agent/failure_policy.h"
#include "agent/hang_policy.h"
#include "agent/health_schedule.h"
#include "agent/park_policy.h"
#include "agent/shutdown_policy.h"
#include "agent/stall_watch.h"
#include "agent/standby_schedule.h"

using namespace ddp::agent;
namespace rdzv = ddp::rdzv;

namespace {

constexpr double kNever = ShutdownGrace::kNever;

ProgressSample beat(uint64_t beats, int64_t step, std::string phase = "") {
  ProgressSample s;
  s.beats = beats;
  s.step = step;
  s.phase = std::move(phase);
  return s;
}

HangPolicy fixed(double seconds) {
  HangPolicy p;
  p.timeout = seconds;
  return p;
}

}  // namespace

TEST_SUITE("the shutdown grace kills what outlives SIGTERM and gives up on what outlives SIGKILL") {
  // op: "term" (SIGTERM sent), "overdue" (the SIGKILL deadline passed), "kill" (SIGKILL sent),
  // "give_up" (the give-up deadline passed), "settled" (every worker exited).
  struct Step {
    std::string op;
    double now;
    std::vector<WorkerRef> running;
    double kill_at, give_up_at;         // the deadlines after the step
    std::vector<std::string> lines;     // what the step says
  };
  struct Row {
    std::string name;
    double shutdown_timeout, kill_timeout;
    std::vector<Step> steps;
  };

  TEST_CASE("each deadline follows the signal before it, and each survivor is named") {
    const std::string stuck =
        "worker 0 (pid 42) has not exited 2 s after SIGKILL; it is probably stuck in the kernel (see "
        "/proc/42/stack and its state in /proc/42/status); giving up on it. It may still hold resources such as "
        "GPU memory.";
    const std::vector<Row> rows = {
        {"SIGKILL follows SIGTERM after shutdown_timeout, the give-up kill_timeout after that", 30, 30,
         {{"term", 100, {}, 130, kNever, {}},
          {"overdue", 130, {{7, 3, 1}}, kNever, kNever,
           {"worker 3 (pid 7) still runs 30 s after it was asked to stop; sending SIGKILL"}},
          {"kill", 130, {}, kNever, 160, {}},
          {"settled", 131, {}, kNever, kNever, {}}}},
        {"a SIGTERM sent later (a kept worker stopped) starts the grace over", 5, 2,
         {{"term", 0, {}, 5, kNever, {}}, {"term", 3, {}, 8, kNever, {}}}},
        {"a second signal kills at once; the first grace still runs and kills again when it ends", 30, 30,
         {{"term", 0, {}, 30, kNever, {}},
          {"kill", 1, {}, 30, 31, {}},
          {"overdue", 30, {}, kNever, 31, {}},
          {"kill", 30, {}, kNever, 60, {}}}},
        {"a worker stuck in the kernel is given up on, named with where to look", 30, 2,
         {{"kill", 10, {}, kNever, 12, {}}, {"give_up", 12, {{42, 0, 0}}, kNever, kNever, {stuck}}}},
        {"fractions of a second are written as a person writes them", 0.5, 30,
         {{"term", 0, {}, 0.5, kNever, {}},
          {"overdue", 0.5, {{9, 1, 1}, {10, 2, 0}}, kNever, kNever,
           {"worker 1 (pid 9) still runs 0.5 s after it was asked to stop; sending SIGKILL",
            "worker 2 (pid 10) still runs 0.5 s after it was asked to stop; sending SIGKILL"}}}},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      ShutdownGrace grace(row.shutdown_timeout, row.kill_timeout);
      for (const auto& step : row.steps) {
        CAPTURE(step.op);
        CAPTURE(step.now);
        std::vector<std::string> lines;
        if (step.op == "term") CHECK(grace.terminated(step.now) == doctest::Approx(step.kill_at));
        if (step.op == "overdue") lines = grace.overdue(step.running);
        if (step.op == "kill") CHECK(grace.killed(step.now) == doctest::Approx(step.give_up_at));
        if (step.op == "give_up") lines = grace.give_up(step.running);
        if (step.op == "settled") grace.settled();
        CHECK(grace.kill_at() == doctest::Approx(step.kill_at));
        CHECK(grace.give_up_at() == doctest::Approx(step.give_up_at));
        CHECK(lines == step.lines);
      }
    }
  }
}

TEST_SUITE("hang detection samples the board and sends hung workers their dump signal") {
  TEST_CASE("the board is sampled often enough to declare a hang within 2% of its timeout, at most every second") {
    HangPolicy automatic;
    automatic.automatic = true;
    const std::vector<std::pair<HangPolicy, double>> rows = {
        {HangPolicy{}, 1.0}, {automatic, 1.0}, {fixed(5), 0.1}, {fixed(100), 1.0}, {fixed(0.5), 0.02}};
    for (const auto& [policy, period] : rows) {
      CAPTURE(policy.timeout);
      CHECK(HangWatch(policy, 1).period() == doctest::Approx(period));
    }
  }

  struct Sample {
    int slot;
    ProgressSample sample;
    double at;
  };
  struct Row {
    std::string name;
    HangPolicy policy;
    std::vector<WatchedWorker> workers;  // the live ones
    std::vector<Sample> samples;         // after a round started at 0
    double now;
    bool hang;
    std::vector<HungWorker> declared;    // pid, signal, note, message
  };

  TEST_CASE("a hang takes the live workers that stalled and were not declared before") {
    const std::string note = "rank 4 made no progress for 5.0 s (last step 2, phase allreduce; --hang_timeout 5 s)";
    const std::vector<Sample> stalled = {{0, beat(1, 1), 1}, {0, beat(2, 2, "allreduce"), 2}};
    const std::vector<Row> rows = {
        {"before the timeout there is no hang", fixed(5), {{{100, 4, 0}, true, false}}, stalled, 6.9, false, {}},
        {"a Python worker gets SIGABRT: faulthandler prints its stacks", fixed(5), {{{100, 4, 0}, true, false}},
         stalled, 7, true, {{100, SIGABRT, note, note + "; sending SIGABRT for its Python stacks"}}},
        {"any other worker is killed", fixed(5), {{{100, 4, 0}, false, false}}, stalled, 7, true,
         {{100, SIGKILL, note, note + "; killing it"}}},
        {"a worker declared before is not sent its signal again", fixed(5), {{{100, 4, 0}, true, true}}, stalled, 7,
         true, {}},
        {"a worker that is gone is not declared", fixed(5), {}, stalled, 7, true, {}},
        {"without --hang_timeout there is never a hang", HangPolicy{}, {{{100, 4, 0}, true, false}}, stalled, 1e9,
         false, {}},
        {"a stall of 100 s or more is written in whole seconds", fixed(100), {{{5, 1, 0}, false, false}},
         {{0, beat(1, 7), 1}}, 151, true,
         {{5, SIGKILL, "rank 1 made no progress for 150 s (last step 7; --hang_timeout 100 s)",
           "rank 1 made no progress for 150 s (last step 7; --hang_timeout 100 s); killing it"}}},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      HangWatch watch(row.policy, 2);
      watch.round_started(0);
      for (const auto& s : row.samples) watch.observe(s.slot, s.sample, s.at);
      const HangVerdict verdict = watch.check(row.workers, row.now);
      CHECK(verdict.hang == row.hang);
      REQUIRE(verdict.declared.size() == row.declared.size());
      for (std::size_t i = 0; i < row.declared.size(); ++i) {
        CHECK(verdict.declared[i].pid == row.declared[i].pid);
        CHECK(verdict.declared[i].signal == row.declared[i].signal);
        CHECK(verdict.declared[i].note == row.declared[i].note);
        CHECK(verdict.declared[i].message == row.declared[i].message);
      }
    }
  }

  TEST_CASE("hung workers are dumped one at a time, in order, skipping those that ended before their turn") {
    DumpQueue q;
    const auto always = [](int) { return true; };
    CHECK_FALSE(q.next(0, always));
    CHECK(q.dumping() == 0);
    q.add(11, SIGABRT);
    q.add(12, SIGKILL);
    q.add(13, SIGABRT);
    auto d = q.next(10, always);
    REQUIRE(d);
    CHECK(d->pid == 11);
    CHECK(d->signal == SIGABRT);
    CHECK(d->next_at == doctest::Approx(10 + HangWatch::kDumpStep));
    CHECK(d->kill_at == doctest::Approx(10 + HangWatch::kDumpGrace));
    CHECK(q.dumping() == 11);
    // 12 exited meanwhile: 13 is next.
    d = q.next(10.5, [](int pid) { return pid != 12; });
    REQUIRE(d);
    CHECK(d->pid == 13);
    CHECK(d->kill_at == doctest::Approx(10.5 + HangWatch::kDumpGrace));
    CHECK_FALSE(q.next(12, always));
    CHECK(q.dumping() == 0);
    q.add(14, SIGABRT);
    q.clear();
    CHECK_FALSE(q.next(13, always));
  }

  TEST_CASE("a new round forgets the last one's beats and best step") {
    HangWatch watch(fixed(5), 1);
    watch.round_started(0);
    watch.observe(0, beat(3, 30), 1);
    CHECK(watch.monitor().best_step() == 30);
    watch.round_started(50);
    CHECK(watch.monitor().best_step() == -1);
    CHECK_FALSE(watch.check({{{1, 0, 0}, false, false}}, 100).hang);
  }

  TEST_CASE("a watch that sees no step for its timeout says once that nothing reports, and how a step is made") {
    HangPolicy automatic;
    automatic.automatic = true;
    struct SilenceRow {
      std::string name;
      HangPolicy policy;
      bool beat;   // a rank beat at 1 s
      double now;  // the round began at 0
      bool said;
    };
    const std::vector<SilenceRow> rows = {
        {"no step before the timeout: not yet", fixed(5), false, 4.9, false},
        {"no step for the timeout: said", fixed(5), false, 5, true},
        {"a step was seen: nothing to say", fixed(5), true, 100, false},
        {"auto waits for its floor", automatic, false, 59, false},
        {"auto says it at its floor", automatic, false, 60, true},
        {"without --hang_timeout nothing is watched, nothing is said", HangPolicy{}, false, 1e9, false},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      HangWatch watch(row.policy, 1);
      watch.round_started(0);
      if (row.beat) watch.observe(0, beat(1, 1), 1);
      CHECK(watch.silence(row.now, true).has_value() == row.said);
    }
    HangWatch watch(fixed(5), 1);
    watch.round_started(0);
    const auto python = watch.silence(6, true);
    REQUIRE(python);
    CHECK(*python == "--hang_timeout: no worker has reported a step in 5 s, and a worker is watched only from its "
                     "first step: a step is an optimizer.step() (torch 2.0 and later) or a ddplaunch.step() call");
    CHECK_FALSE(watch.silence(7, true));  // once per job, not once per round
    watch.round_started(10);
    CHECK_FALSE(watch.silence(20, true));
    HangWatch sdk(fixed(5), 1);
    sdk.round_started(0);
    CHECK(sdk.silence(6, false)->find("through the worker SDK (ddp::Progress, or its Trainer)") != std::string::npos);
  }
}

TEST_SUITE("crash loops and no-restart exit codes end the job instead of restarting it") {
  // op: "exit" (a worker failed: rank, exit code, signal, hung) or "round" (a counted restart
  // ended a round: best step, best checkpoint, the round's restart count).
  struct Step {
    std::string op;
    std::vector<int64_t> args;
    int restarts_without_progress;
    std::string reason;  // after the step; empty: not fatal
  };
  struct Row {
    std::string name;
    int limit;
    std::vector<int> codes;
    std::vector<Step> steps;
  };

  TEST_CASE("the first verdict stands and names its cause") {
    const std::string code3 = "worker 2 exited with code 3, which --no_restart_exit_codes lists: not restarting";
    const std::string final1 =
        "worker 1 exited with code 3 and said a restart would fail the same way (its output says why): not restarting";
    const std::string never =
        "2 restart(s) in a row made no progress (no rank ever reported a step or a checkpoint); --crash_loop_limit=2";
    const std::string beyond =
        "2 restart(s) in a row made no progress (no rank reported a step beyond 6 or a checkpoint beyond 4); "
        "--crash_loop_limit=2";
    const std::vector<Row> rows = {
        {"a listed exit code is fatal", 0, {3}, {{"exit", {2, 3, 0, 0}, 0, code3}}},
        {"a code not listed is not", 0, {3}, {{"exit", {2, 1, 0, 0}, 0, ""}}},
        {"a hung worker's exit is the agent's doing, whatever its code", 0, {3}, {{"exit", {2, 3, 0, 1}, 0, ""}}},
        {"a death by signal is not an exit code", 0, {0}, {{"exit", {2, 0, SIGKILL, 0}, 0, ""}}},
        {"a worker that said final ends the job, whatever its code", 0, {}, {{"exit", {1, 3, 0, 0, 1}, 0, final1}}},
        {"final or not, a hung worker's exit is the agent's doing", 0, {}, {{"exit", {1, 3, 0, 1, 1}, 0, ""}}},
        {"final or not, a death by signal is not the worker's word", 0, {}, {{"exit", {1, 0, SIGKILL, 0, 1}, 0, ""}}},
        {"a listed code first: its verdict stands", 0, {3},
         {{"exit", {2, 3, 0, 0, 0}, 0, code3}, {"exit", {1, 3, 0, 0, 1}, 0, code3}}},
        {"a later verdict does not replace the first", 2, {3, 4},
         {{"exit", {2, 3, 0, 0}, 0, code3},
          {"exit", {5, 4, 0, 0}, 0, code3},
          {"round", {-1, -1, 1}, 1, code3},
          {"round", {-1, -1, 2}, 2, code3}}},
        {"restarts in a row without a step end the job at the limit; the first round's failure is no restart",
         2, {},
         {{"round", {-1, -1, 0}, 0, ""}, {"round", {-1, -1, 1}, 1, ""}, {"round", {-1, -1, 2}, 2, never}}},
        {"a step or a checkpoint beyond the best seen starts the count over", 2, {},
         {{"round", {5, -1, 0}, 0, ""},
          {"round", {5, -1, 1}, 1, ""},
          {"round", {6, -1, 2}, 0, ""},
          {"round", {6, -1, 3}, 1, ""},
          {"round", {6, 4, 4}, 0, ""},
          {"round", {3, 2, 5}, 1, ""},
          {"round", {6, 4, 6}, 2, beyond}}},
        {"without a limit restarts go on", 0, {},
         {{"round", {-1, -1, 1}, 1, ""}, {"round", {-1, -1, 2}, 2, ""}, {"round", {-1, -1, 3}, 3, ""}}},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      CrashLoopPolicy policy(row.limit, row.codes);
      for (const auto& step : row.steps) {
        const auto& a = step.args;
        if (step.op == "exit") policy.worker_failed(int(a[0]), int(a[1]), int(a[2]), a[3] != 0, a.size() > 4 && a[4] != 0);
        if (step.op == "round") policy.round_ended(a[0], a[1], int(a[2]));
        CHECK(policy.restarts_without_progress() == step.restarts_without_progress);
        CHECK(policy.fatal() == !step.reason.empty());
        CHECK(policy.reason() == step.reason);
      }
    }
  }
}

TEST_SUITE("standbys start once the round is up and the first join waits for them to load") {
  struct Look {
    double now;
    bool stepped;
    std::optional<double> next;  // nullopt: start the standbys now
  };
  struct Row {
    std::string name;
    double delay, delay_max;
    double first_look;  // the round began at 100
    std::vector<Look> looks;
  };

  TEST_CASE("the next standbys start when every worker stepped, not before the delay, at the latest at the maximum") {
    const std::vector<Row> rows = {
        {"every worker stepped: start", 0, 10, 100, {{100, false, 100.1}, {100.1, true, std::nullopt}}},
        {"no step yet: look again every 0.1 s", 0, 10, 100, {{100, false, 100.1}, {104, false, 104.1}}},
        {"the last look falls on the maximum", 0, 10, 100, {{109.95, false, 110.0}, {110, false, std::nullopt}}},
        {"a program that reports no steps gets its standbys at the maximum", 0, 10, 100,
         {{110.01, false, std::nullopt}}},
        {"the first look waits for the delay", 2, 10, 102, {{102, true, std::nullopt}}},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      StandbySchedule schedule(row.delay, row.delay_max, 30);
      CHECK(schedule.round_started(100) == doctest::Approx(row.first_look));
      for (const auto& look : row.looks) {
        CAPTURE(look.now);
        const auto next = schedule.look(look.now, look.stepped);
        REQUIRE(next.has_value() == look.next.has_value());
        if (next) CHECK(*next == doctest::Approx(*look.next));
      }
    }
  }

  // op: "ready" (a standby said it is ready or ended: local rank) or "timeout" (the deadline passed).
  struct Step {
    std::string op;
    int local_rank;
    bool join;  // the step says: join now
  };
  struct WaitRow {
    std::string name;
    std::vector<int> standbys;
    std::optional<double> deadline;  // waiting from 5 with a 30 s timeout
    std::vector<Step> steps;
  };

  TEST_CASE("the first join waits for every standby's word, at most standby_ready_timeout") {
    const std::vector<WaitRow> rows = {
        {"no standby: join at once", {}, std::nullopt, {}},
        {"the last word joins", {0, 1}, 35.0, {{"ready", 0, false}, {"ready", 1, true}, {"ready", 1, false}}},
        {"a standby heard from twice counts once", {0, 1}, 35.0,
         {{"ready", 0, false}, {"ready", 0, false}, {"ready", 1, true}}},
        {"the deadline joins without the rest, once", {0, 1}, 35.0,
         {{"ready", 0, false}, {"timeout", 0, true}, {"ready", 1, false}, {"timeout", 0, false}}},
        {"the deadline after the last word does nothing", {0}, 35.0, {{"ready", 0, true}, {"timeout", 0, false}}},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      StandbySchedule schedule(0, 10, 30);
      const auto deadline = schedule.await_ready(row.standbys, 5);
      REQUIRE(deadline.has_value() == row.deadline.has_value());
      if (deadline) CHECK(*deadline == doctest::Approx(*row.deadline));
      for (const auto& step : row.steps) {
        CAPTURE(step.op);
        if (step.op == "ready") CHECK(schedule.ready(step.local_rank) == step.join);
        if (step.op == "timeout") {
          const auto line = schedule.ready_timed_out();
          CHECK(line.has_value() == step.join);
          if (line) {
            CHECK(*line == "standbys: not all of them said they are ready within 30 s "
                           "(DDPLAUNCH_STANDBY_READY_TIMEOUT); joining the job without waiting for them");
          }
        }
      }
      CHECK_FALSE(schedule.awaiting());
    }
  }
}

TEST_SUITE("restartable workers park at a restart within the park timeout") {
  ParkView worker(bool restartable, bool hung, bool channel_open, ParkState park = ParkState::kNo, bool alive = true) {
    ParkView v;
    v.ref = {100, 3, 1};
    v.alive = alive;
    v.restartable = restartable;
    v.hung = hung;
    v.channel_open = channel_open;
    v.park = park;
    return v;
  }

  TEST_CASE("only a restartable worker that is not hung, with its channel open, may park, and only with in-memory restart") {
    struct Row {
      bool in_memory_restart, restartable, hung, channel_open, may_park;
    };
    const std::vector<Row> rows = {
        {true, true, false, true, true},   {false, true, false, true, false}, {true, false, false, true, false},
        {true, true, true, true, false},   {true, true, false, false, false},
    };
    for (const auto& r : rows) {
      CAPTURE(r.in_memory_restart);
      CAPTURE(r.restartable);
      CAPTURE(r.hung);
      CAPTURE(r.channel_open);
      CHECK(ParkPolicy(r.in_memory_restart, 10).may_park(worker(r.restartable, r.hung, r.channel_open)) == r.may_park);
    }
  }

  TEST_CASE("a restart asks a worker that may park once and keeps it; the job's end and the others are signalled") {
    struct Row {
      std::string name;
      bool restart;
      ParkView w;
      AtStop expected;
    };
    const std::vector<Row> rows = {
        {"a restart asks a worker that may park", true, worker(true, false, true), AtStop::kAskToPark},
        {"one asked already is kept, not asked again", true, worker(true, false, true, ParkState::kAsked), AtStop::kKeep},
        {"one parked already is kept", true, worker(true, false, true, ParkState::kParked), AtStop::kKeep},
        {"one that may not park is signalled", true, worker(false, false, true), AtStop::kSignal},
        {"a hung one is signalled, even when asked before", true, worker(true, true, true, ParkState::kAsked),
         AtStop::kSignal},
        {"the job's end signals even a parked worker", false, worker(true, false, true, ParkState::kParked),
         AtStop::kSignal},
    };
    const ParkPolicy policy(true, 10);
    for (const auto& row : rows) {
      CAPTURE(row.name);
      CHECK(policy.at_stop(row.w, row.restart) == row.expected);
    }
    CHECK(policy.deadline(100) == doctest::Approx(110));
  }

  TEST_CASE("a stop is over when every worker has exited or parked; a worker asked or parked is kept") {
    struct Row {
      std::string name;
      std::vector<ParkView> workers;
      bool settled;
    };
    const std::vector<Row> rows = {
        {"nobody", {}, true},
        {"every worker exited", {worker(true, false, true, ParkState::kNo, false)}, true},
        {"one parked, one exited",
         {worker(true, false, true, ParkState::kParked), worker(false, false, false, ParkState::kNo, false)}, true},
        {"one still asked", {worker(true, false, true, ParkState::kParked), worker(true, false, true, ParkState::kAsked)},
         false},
        {"one still running", {worker(false, false, true)}, false},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      CHECK(ParkPolicy::settled(row.workers) == row.settled);
    }
    CHECK(ParkPolicy::kept(worker(true, false, true, ParkState::kAsked)));
    CHECK(ParkPolicy::kept(worker(true, false, true, ParkState::kParked)));
    CHECK_FALSE(ParkPolicy::kept(worker(true, false, true, ParkState::kParked, false)));
    CHECK_FALSE(ParkPolicy::kept(worker(true, false, true)));
  }

  TEST_CASE("what a worker says on its channel moves it, and a word out of order breaks the channel") {
    struct Row {
      std::string name;
      std::string word;  // "restartable", "not restartable", "parked"
      ParkView w;
      bool stopping;
      OnWord expected;
    };
    const std::vector<Row> rows = {
        {"restartable changes nothing here", "restartable", worker(false, false, true), false, OnWord::kNothing},
        {"no longer restartable while asked to park: stopped", "not restartable",
         worker(true, false, true, ParkState::kAsked), true, OnWord::kStop},
        {"no longer restartable while running: nothing yet", "not restartable", worker(true, false, true), false,
         OnWord::kNothing},
        {"parked without having said it is restartable: the channel breaks", "parked", worker(false, false, true),
         true, OnWord::kBreak},
        {"parked when asked: parked", "parked", worker(true, false, true, ParkState::kAsked), true, OnWord::kParked},
        {"parked on its own between stops: parked", "parked", worker(true, false, true), false, OnWord::kParked},
        {"parked twice: nothing", "parked", worker(true, false, true, ParkState::kParked), true, OnWord::kNothing},
        {"parked while being signalled: it dies of the signal", "parked", worker(true, false, true), true,
         OnWord::kNothing},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      const OnWord got = row.word == "parked" ? ParkPolicy::parked_word(row.w, row.stopping)
                                              : ParkPolicy::restartable_word(row.w, row.word == "restartable");
      CHECK(got == row.expected);
    }
  }

  TEST_CASE("each worker that did not park in time is named") {
    const ParkPolicy policy(true, 2.5);
    CHECK(policy.overdue({worker(true, false, true, ParkState::kAsked)}) ==
          std::vector<std::string>{"worker 3 (pid 100) did not park within 2.5 s of the restart (in-memory restart); "
                                   "stopping it"});
  }
}

TEST_SUITE("health checks keep a failing node out of the job and end its round when they fail") {
  struct Step {
    HealthPurpose purpose;
    bool ok;
    double now;
    HealthStep::Do action;
    std::string message;
  };
  struct Row {
    std::string name;
    std::vector<Step> steps;
  };

  TEST_CASE("before a join a failure is said once and retried every interval; a pass after it is said") {
    const auto before = HealthPurpose::kBeforeJoin;
    const auto running = HealthPurpose::kWhileRunning;
    const std::string failed =
        "health check failed: `check` exited with code 1; this node stays out of the job and checks again every 30 s";
    const std::string passes = "health check passes again; this node joins the job";
    const std::vector<Row> rows = {
        {"a pass joins, silently", {{before, true, 0, HealthStep::Do::kJoin, ""}}},
        {"a failure is said once, then retried quietly until a pass, which is said",
         {{before, false, 0, HealthStep::Do::kRetry, failed},
          {before, false, 30, HealthStep::Do::kRetry, ""},
          {before, true, 60, HealthStep::Do::kJoin, passes},
          {before, true, 90, HealthStep::Do::kJoin, ""}}},
        {"while running, a pass schedules the next check", {{running, true, 10, HealthStep::Do::kNext, ""}}},
        {"a pass while running does not end the failing streak of the joins",
         {{before, false, 0, HealthStep::Do::kRetry, failed},
          {running, true, 10, HealthStep::Do::kNext, ""},
          {before, true, 20, HealthStep::Do::kJoin, passes}}},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      HealthSchedule health("check", 30, 60);
      for (const auto& step : row.steps) {
        CAPTURE(step.now);
        const HealthStep got =
            health.result(step.purpose, step.ok, step.ok ? "" : "`check` exited with code 1", "node1", 1e9, step.now);
        CHECK(got.action == step.action);
        CHECK(got.message == step.message);
        if (step.action != HealthStep::Do::kJoin) CHECK(got.at == doctest::Approx(step.now + 30));
      }
    }
  }

  TEST_CASE("a failure while running is this node's failure, reported with the check's reason") {
    HealthSchedule health("check", 30, 60);
    const HealthStep step = health.result(HealthPurpose::kWhileRunning, false, "`check` exited with code 2", "node1",
                                          1234.5, 10);
    CHECK(step.action == HealthStep::Do::kLeave);
    CHECK(step.message ==
          "health check failed: `check` exited with code 2; this node leaves the round: its failure is reported and "
          "its workers stopped, and it joins again once the check passes");
    CHECK(step.failure.host == "node1");
    CHECK(step.failure.rank == -1);
    CHECK(step.failure.local_rank == -1);
    CHECK(step.failure.exit_code == 1);
    CHECK(step.failure.timestamp == doctest::Approx(1234.5));
    CHECK(step.failure.error_file_message == "health check failed on node1: `check` exited with code 2");
  }

  TEST_CASE("a check is killed at its deadline; a replaced one is killed and its exit ignored") {
    // op: "start" (pid), "supersede", "deadline", "exit" (pid); each step is 10 s after the one before.
    struct Step {
      std::string op;
      int pid;
      int expected;  // start: the deadline; supersede / deadline: the pid to kill; exit: HealthSchedule::Exit
    };
    using Exit = HealthSchedule::Exit;
    const std::vector<Step> steps = {
        {"start", 11, 60},          {"supersede", 0, 11},  {"start", 12, 80},          {"exit", 11, int(Exit::kStale)},
        {"exit", 11, int(Exit::kNotOurs)}, {"deadline", 0, 12}, {"exit", 12, int(Exit::kCheck)}, {"deadline", 0, 0},
        {"supersede", 0, 0},        {"exit", 0, int(Exit::kNotOurs)},
    };
    HealthSchedule health("check", 30, 60);
    double now = 0;
    for (const auto& step : steps) {
      CAPTURE(step.op);
      CAPTURE(step.pid);
      if (step.op == "start") CHECK(health.started(step.pid, HealthPurpose::kWhileRunning, now) == step.expected);
      if (step.op == "supersede") CHECK(health.supersede() == step.expected);
      if (step.op == "deadline") CHECK(health.deadline_passed() == step.expected);
      if (step.op == "exit") CHECK(int(health.exited(step.pid)) == step.expected);
      now += 10;
    }
    CHECK(health.purpose() == HealthPurpose::kWhileRunning);
    CHECK(health.running() == 0);
  }

  TEST_CASE("why a check failed names the command, how it ended, and its log's last lines") {
    struct Row {
      std::string name;
      bool timed_out;
      int exit_code, signal;
      std::string tail, why;
    };
    const std::vector<Row> rows = {
        {"it passed", false, 0, 0, "ok\n", ""},
        {"an exit code, with the log's tail trimmed", false, 3, 0, "disk full\n \n",
         "`check` exited with code 3: disk full"},
        {"a signal", false, 0, SIGSEGV, "", "`check` was killed by SIGSEGV"},
        {"killed at its deadline", true, 0, SIGKILL, "", "`check` ran longer than 60 s (killed)"},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      HealthSchedule health("check", 30, 60);
      health.started(7, HealthPurpose::kBeforeJoin, 0);
      if (row.timed_out) health.deadline_passed();
      CHECK(health.why_failed(row.exit_code, row.signal, row.tail) == row.why);
    }
  }

  TEST_CASE("the built-in GPU check comes first when GPUs are visible, and its absence is said once") {
    struct Row {
      std::string name;
      std::string check;
      int gpus;
      std::vector<int> previous;
      std::string starts, ends;  // of the command
      bool says;
    };
    const std::vector<Row> rows = {
        {"no GPU: the user's command alone", "my_check", 0, {}, "my_check", "my_check", true},
        {"no GPU and \"gpu\": nothing to check", "gpu", 0, {}, "true", "true", true},
        {"GPUs: nvidia-smi first", "my_check", 2, {}, "nvidia-smi --query-gpu", "; my_check", false},
        {"GPUs and the last round's pids: held memory is looked for", "gpu", 1, {5, 6}, "nvidia-smi", "; true", false},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      HealthSchedule health(row.check, 30, 60);
      std::string say;
      const std::string command = health.command(row.gpus, row.previous, say);
      CHECK(command.rfind(row.starts, 0) == 0);
      CHECK(command.size() >= row.ends.size());
      CHECK(command.compare(command.size() - row.ends.size(), row.ends.size(), row.ends) == 0);
      CHECK(say.empty() == !row.says);
      if (!row.previous.empty()) CHECK(command.find("grep -Ex '5|6'") != std::string::npos);
      std::string again;
      health.command(row.gpus, row.previous, again);
      CHECK(again.empty());
    }
  }
}

TEST_SUITE("a failed round is reported by the failure that explains the others") {
  rdzv::WorkerFailure failure(int rank, int exit_code, int signal, double timestamp) {
    rdzv::WorkerFailure f;
    f.host = "node1";
    f.rank = rank;
    f.local_rank = rank;
    f.pid = 100 + rank;
    f.exit_code = exit_code;
    f.signal = signal;
    f.timestamp = timestamp;
    return f;
  }

  TEST_CASE("a death by signal explains exits with a code; then the earliest; then the lowest rank") {
    struct Row {
      std::string name;
      std::vector<rdzv::WorkerFailure> seen;
      int root_rank;
    };
    const std::vector<Row> rows = {
        {"one failure", {failure(3, 1, 0, 10)}, 3},
        {"a signal over an earlier exit code", {failure(1, 1, 0, 10), failure(2, 0, SIGKILL, 11)}, 2},
        {"the earliest of two exit codes", {failure(1, 1, 0, 11), failure(2, 1, 0, 10)}, 2},
        {"the lower rank at the same time", {failure(4, 1, 0, 10), failure(2, 1, 0, 10)}, 2},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      std::vector<LocalFailure> failures;
      for (const auto& f : row.seen) failures.push_back(LocalFailure{f, "", {}});
      CHECK(root_cause(failures).failure.rank == row.root_rank);
    }
  }

  TEST_CASE("a failure is described by its error file, else by its stderr's last lines, headed by the agent's note") {
    ErrorFileContent present;
    present.present = true;
    present.message = "RuntimeError: boom";
    present.timestamp = 77;
    ErrorFileContent broken;
    broken.problem = "error file /x/error.json: not JSON";
    struct Row {
      std::string name;
      int signal;
      std::string note;
      ErrorFileContent error;
      std::string tail, stderr_log;
      std::string message, error_file;
      double timestamp;
    };
    const std::vector<Row> rows = {
        {"its error file, with the file's time", 0, "", present, "", "", summarise_error_file(present), "/x/error.json",
         77},
        {"an error file that cannot be read says why", 0, "", broken, "", "", broken.problem, "/x/error.json", 50},
        {"no error file: the tail of its tee'd stderr", 0, "", {}, "line\n", "",
         "the worker wrote no error file; the last lines of its stderr:\nline\n", "", 50},
        {"killed: the signal heads the tail of stderr.log, which is named", SIGSEGV, "", {}, "line\n", "/x/stderr.log",
         "Signal 11 (SIGSEGV) received by PID 107; the last lines of its stderr (/x/stderr.log):\nline\n", "", 50},
        {"nothing to show", 0, "", {}, "", "", "", "", 50},
        {"the agent's note heads it", SIGABRT, "rank 7 made no progress", {}, "", "", "rank 7 made no progress", "",
         50},
        {"the agent's note and the error file", 0, "its timer expired", present, "", "",
         "its timer expired\n" + summarise_error_file(present), "/x/error.json", 77},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      FailedWorker w;
      w.ref = {107, 7, 3};
      w.exit_code = row.signal ? 0 : 1;
      w.signal = row.signal;
      w.note = row.note;
      w.error_file = "/x/error.json";
      w.error = row.error;
      w.stderr_tail = row.tail;
      w.stderr_log = row.stderr_log;
      w.log_files = {"/x/stdout.log"};
      const LocalFailure lf = describe_failure(w, "node1", 50);
      CHECK(lf.failure.host == "node1");
      CHECK(lf.failure.rank == 7);
      CHECK(lf.failure.local_rank == 3);
      CHECK(lf.failure.pid == 107);
      CHECK(lf.failure.signal == row.signal);
      CHECK(lf.failure.error_file_message == row.message);
      CHECK(lf.error_file == row.error_file);
      CHECK(lf.failure.timestamp == doctest::Approx(row.timestamp));
      CHECK(lf.log_files == std::vector<std::string>{"/x/stdout.log"});
    }
  }

  TEST_CASE("the agent says how the root cause ended and whether the others park or stop") {
    CHECK(failure_line(failure(3, 0, SIGKILL, 0), false) ==
          "worker 3 (local rank 3, pid 103) was killed by SIGKILL; stopped the other workers");
    CHECK(failure_line(failure(3, 2, 0, 0), true) ==
          "worker 3 (local rank 3, pid 103) exited with code 2; the other workers park, to go on from memory "
          "(in-memory restart)");
  }

  TEST_CASE("a fatal report carries this node's failure, or names no worker when a peer's ended the round") {
    const auto mine = failure(2, 3, 0, 10);
    const auto reported = fatal_report(&mine, "node1", "the reason", 99);
    CHECK(reported.rank == 2);
    CHECK(reported.timestamp == doctest::Approx(10));
    CHECK(reported.fatal == "the reason");
    const auto anonymous = fatal_report(nullptr, "node1", "the reason", 99);
    CHECK(anonymous.host == "node1");
    CHECK(anonymous.exit_code == 1);
    CHECK(anonymous.timestamp == doctest::Approx(99));
    CHECK(anonymous.fatal == "the reason");
  }

  TEST_CASE("the summary takes the root's files when it failed here and lists the others") {
    std::vector<LocalFailure> seen = {{failure(1, 1, 0, 10), "/1/error.json", {"/1/stderr.log"}},
                                      {failure(2, 0, SIGKILL, 11), "", {"/2/stderr.log"}}};
    auto parts = summary_parts(seen, failure(2, 0, SIGKILL, 11));
    CHECK(parts.error_file.empty());
    CHECK(parts.log_files == std::vector<std::string>{"/2/stderr.log"});
    REQUIRE(parts.others.size() == 1);
    CHECK(parts.others[0].failure.rank == 1);
    auto elsewhere = failure(5, 0, SIGKILL, 9);
    elsewhere.host = "node2";
    parts = summary_parts(seen, elsewhere);
    CHECK(parts.log_files.empty());
    CHECK(parts.others.size() == 2);
  }
}

TEST_SUITE("stall watch") {
  // Two workers stepping every 10 ms, sampled every 50 ms: 10 beats a sample.
  void step_for(StallWatch& w, double& now, std::uint64_t& beats, double seconds) {
    for (double end = now + seconds; now < end - 1e-9;) {
      now += StallWatch::kPeriod;
      beats += 10;
      CHECK_FALSE(w.observe(beats, 2, now));
    }
  }

  TEST_CASE("workers that stop stepping are a stall after kFactor step times, never under the floor") {
    StallWatch w;
    double now = 100;
    std::uint64_t beats = 0;
    CHECK_FALSE(w.observe(0, 0, now));  // nothing beat yet: not watched
    now += 5;
    CHECK_FALSE(w.observe(0, 0, now));
    step_for(w, now, beats, 1.0);
    CHECK(w.step_time() == doctest::Approx(0.01));
    CHECK(w.threshold() == StallWatch::kFloor);  // 5 x 10 ms is under the floor
    const double stopped = now;
    std::optional<double> first;
    while (!first && now < stopped + 1) {
      now += StallWatch::kPeriod;
      first = w.observe(beats, 2, now);
    }
    REQUIRE(first);
    CHECK(*first >= StallWatch::kFloor);
    CHECK(*first < StallWatch::kFloor + StallWatch::kPeriod + 1e-9);
    // Repeated while it lasts: after 0.5 s, then 1 s, then 2 s more.
    std::vector<double> again;
    for (; now < stopped + 4; now += StallWatch::kPeriod) {
      if (auto s = w.observe(beats, 2, now + StallWatch::kPeriod)) again.push_back(*s);
    }
    REQUIRE(again.size() == 3);
    CHECK(again[0] == doctest::Approx(*first + 0.5).epsilon(0.05));
    CHECK(again[1] == doctest::Approx(*first + 1.5).epsilon(0.05));
    CHECK(again[2] == doctest::Approx(*first + 3.5).epsilon(0.05));
  }

  TEST_CASE("slow steps raise the bar; a stall's own length is not taken for a step time") {
    StallWatch w;
    double now = 0;
    std::uint64_t beats = 2;
    CHECK_FALSE(w.observe(beats, 2, now));
    for (int i = 0; i < 20; ++i) {  // one step a second on both workers
      now += 1;
      beats += 2;
      CHECK_FALSE(w.observe(beats, 2, now));
    }
    CHECK(w.step_time() == doctest::Approx(1.0));
    CHECK(w.threshold() == doctest::Approx(5.0));
    CHECK_FALSE(w.observe(beats, 2, now + 4.9));
    auto s = w.observe(beats, 2, now + 5.0);
    REQUIRE(s);
    now += 30;  // the stall ends after 30 s: its gap is not a step time
    beats += 2;
    CHECK_FALSE(w.observe(beats, 2, now));
    CHECK(w.step_time() == doctest::Approx(1.0));
  }

  TEST_CASE("a new round starts unwatched until its first beat; workers that finished are not watched") {
    StallWatch w;
    double now = 0;
    std::uint64_t beats = 0;
    step_for(w, now, beats, 0.5);
    w.reset(now);
    CHECK_FALSE(w.observe(0, 0, now + 10));  // loading the next round: silence is not a stall
    CHECK_FALSE(w.observe(5, 2, now + 11));
    CHECK_FALSE(w.observe(5, 0, now + 20));  // every worker finished (none steps any more)
    CHECK(w.observe(5, 2, now + 20));
  }

  TEST_CASE("a watch with nothing to watch says so once, kBlindAfter into a round; never once a step was seen") {
    StallWatch w;
    w.reset(100);
    CHECK_FALSE(w.observe(0, 0, 110));
    CHECK_FALSE(w.blind(100 + StallWatch::kBlindAfter - 0.1, true));
    auto line = w.blind(100 + StallWatch::kBlindAfter, true);
    REQUIRE(line);
    CHECK(line->find("heartbeat_timeout") != std::string::npos);
    CHECK(line->find("optimizer.step()") != std::string::npos);
    w.reset(200);
    CHECK_FALSE(w.blind(300, true));  // said once per agent, not per round
    StallWatch sdk;
    sdk.reset(0);
    auto sdk_line = sdk.blind(StallWatch::kBlindAfter, false);
    REQUIRE(sdk_line);
    CHECK(sdk_line->find("worker SDK") != std::string::npos);
    StallWatch stepping;
    stepping.reset(0);
    double now = 0;
    std::uint64_t beats = 0;
    step_for(stepping, now, beats, 0.5);
    stepping.reset(now);  // a later round that has not stepped yet
    CHECK_FALSE(stepping.blind(now + 100, true));
  }
}
