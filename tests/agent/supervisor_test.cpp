// The agent's state machine (agent/supervisor.h) on a fake clock: each row is a script of
// events, each at the time given, and the effects and state expected after each. No processes,
// no timers, no sockets: the effects are rendered as short words ("signal 101 15", "arm kill
// 40", "exit 1"), so a row reads as the lifecycle in docs/architecture.md.
#include <doctest/doctest.h>

#include <signal.h>

#include <string>
#include <vector>

#include "agent/supervisor.h"

using namespace ddp::agent;
namespace rdzv = ddp::rdzv;

namespace {

std::string fmt(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

const char* deadline_word(Deadline d) {
  switch (d) {
    case Deadline::kKill: return "kill";
    case Deadline::kGiveUp: return "give_up";
    case Deadline::kPark: return "park";
  }
  return "?";
}

std::string pids(const std::vector<int>& v) {
  std::string s;
  for (int p : v) s += (s.empty() ? "" : ",") + std::to_string(p);
  return s;
}

// One effect as a word. "say" and "record" carry the line or the event's type and cause.
std::string word(const Effect& fx) {
  return std::visit(
      Overloaded{
          [](const effect::Say& s) { return "say " + s.line; },
          [](const effect::Record& r) { return "record " + r.type + (r.cause.empty() ? "" : " " + r.cause); },
          [](const effect::Join& j) { return std::string(j.check_health ? "join" : "join unchecked"); },
          [](const effect::StartRound& s) {
            std::string parked;
            for (const auto& [lr, pid] : s.parked) parked += " parked " + std::to_string(lr) + ":" + std::to_string(pid);
            return "start " + std::to_string(s.assignment.generation) + parked +
                   (s.previous.empty() ? "" : " previous " + pids(s.previous));
          },
          [](const effect::Signal& s) { return "signal " + std::to_string(s.pid) + " " + std::to_string(s.signo); },
          [](const effect::ReportFailure& r) {
            return "report rank " + std::to_string(r.failure.rank) + (r.failure.fatal.empty() ? "" : " fatal");
          },
          [](const effect::ReportSuccess&) { return std::string("report success"); },
          [](const effect::CloseRendezvous&) { return std::string("close rendezvous"); },
          [](const effect::AbandonRound&) { return std::string("abandon round"); },
          [](const effect::AbandonSlot& a) { return "abandon slot " + std::to_string(a.local_rank); },
          [](const effect::Arm& a) { return std::string("arm ") + deadline_word(a.deadline) + " " + fmt(a.at); },
          [](const effect::Cancel& c) { return std::string("cancel ") + deadline_word(c.deadline); },
          [](const effect::Post& p) {
            return std::string(p.what == Later::kReportFailure ? "post report" : "post stop_done");
          },
          [](const effect::CloseChannel& c) { return "close channel " + std::to_string(c.pid); },
          [](const effect::RecordFailure& r) {
            return "record failure " + std::to_string(r.pid) + (r.into_last ? " into last" : "");
          },
          [](const effect::NoteParked& p) { return "parked " + std::to_string(p.pid) + " at " + std::to_string(p.step); },
          [](const effect::DrainOutput& d) { return "drain " + pids(d.pids); },
          [](const effect::FlushLines&) { return std::string("flush lines"); },
          [](const effect::Console& c) { return std::string(c.text.empty() ? "console" : "console summary"); },
          [](const effect::StopSettled&) { return std::string("settled"); },
          [](const effect::KillLeftovers&) { return std::string("kill leftovers"); },
          [](const effect::Exit& e) { return "exit " + std::to_string(e.code); },
      },
      fx);
}

// A row's step: an event at a time, then the effects (words; "say" lines compared by prefix
// only, up to the given text) and the state after it.
struct Step {
  double at;
  Event event;
  std::vector<std::string> effects;
  Supervisor::State state;
};

struct Row {
  std::string name;
  Supervisor::Config config;
  std::vector<Step> steps;
};

Supervisor::Config two_workers(bool in_memory = false, std::vector<int> no_restart = {}) {
  Supervisor::Config c;
  c.host = "node0";
  c.program = "train.py";
  c.local_world_size = 2;
  c.shutdown_timeout = 30;
  c.kill_timeout = 10;
  c.in_memory_restart = in_memory;
  c.park_timeout = 5;
  c.no_restart_exit_codes = std::move(no_restart);
  return c;
}

rdzv::Assignment generation(std::uint64_t g, int restart_count = 0) {
  rdzv::Assignment a;
  a.generation = g;
  a.group_world_size = 1;
  a.world_size = 2;
  a.restart_count = restart_count;
  return a;
}

event::Started started(int pid, int local_rank, bool channel = false, bool in_memory = false) {
  event::Started s;
  s.ref = {pid, local_rank, local_rank};
  s.python = true;
  s.channel = channel;
  s.in_memory = in_memory;
  return s;
}

event::FailureRecorded recorded(int pid, int local_rank, int exit_code, int signal, bool into_last = false) {
  event::FailureRecorded r;
  r.worker.ref = {pid, local_rank, local_rank};
  r.worker.exit_code = exit_code;
  r.worker.signal = signal;
  r.into_last = into_last;
  return r;
}

event::Restart restart(bool counted, bool failing = false) {
  event::Restart r;
  r.reason = counted ? "worker 0 failed" : "a node joined";
  r.counted = counted;
  r.failing = failing;
  r.failure = counted;
  return r;
}

rdzv::WorkerFailure failure_of(int rank) {
  rdzv::WorkerFailure f;
  f.rank = rank;
  f.host = "node0";
  f.exit_code = 1;
  return f;
}

using S = Supervisor::State;

// The first steps of every row that runs a round: join, a round of generation 1, two workers.
std::vector<Step> running_two(bool channels = false) {
  return {
      {0, event::Join{}, {"join"}, S::kJoining},
      {1, event::Round{generation(1)}, {"record round complete", "start 1"}, S::kRunning},
      {1, started(101, 0, channels), {}, S::kRunning},
      {1, started(102, 1, channels), {}, S::kRunning},
  };
}

std::vector<Step> then(std::vector<Step> first, const std::vector<Step>& more) {
  first.insert(first.end(), more.begin(), more.end());
  return first;
}

void play(const Row& row) {
  Supervisor sv(row.config);
  int n = 0;
  for (const auto& step : row.steps) {
    ++n;
    sv.tick({step.at, 1000 + step.at});
    sv.step(step.event);
    std::vector<std::string> got;
    for (const auto& fx : sv.take()) got.push_back(word(fx));
    std::string all;
    for (const auto& g : got) all += "\n  " + g;
    INFO(row.name << ", step " << n << " (t=" << step.at << "), effects:" << all);
    REQUIRE(got.size() == step.effects.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      const std::string& want = step.effects[i];
      if (want.rfind("say ", 0) == 0) {
        CHECK_MESSAGE(got[i].rfind(want, 0) == 0, got[i] << " does not start with " << want);
      } else {
        CHECK(got[i] == want);
      }
    }
    CHECK(state_name(sv.state()) == std::string(state_name(step.state)));
  }
}

}  // namespace

TEST_SUITE("the supervisor runs the agent's lifecycle as events in and effects out") {
  TEST_CASE("a round starts, succeeds and ends the job; rounds nobody waits for are ignored") {
    play({"success", two_workers(),
          then(running_two(),
               {
                   {2, event::Round{generation(2)}, {}, S::kRunning},
                   {5, event::Exited{101, 0, 0}, {"record worker_exited success"}, S::kRunning},
                   {6, event::Exited{102, 0, 0}, {"record worker_exited success", "drain 101,102", "report success"},
                    S::kIdle},
                   {7, event::JobSucceeded{}, {"record job_end succeeded", "drain 101,102", "exit 0"}, S::kDone},
                   {8, event::Signal{SIGTERM}, {}, S::kDone},
               })});
  }

  TEST_CASE("a failure is recorded, reported after the batch, and the others are stopped; the rendezvous's restart rejoins") {
    play({"failure then restart", two_workers(),
          then(running_two(),
               {
                   {10, event::Exited{101, 1, 0}, {"record failure 101", "post report"}, S::kRunning},
                   {10, recorded(101, 0, 1, 0), {"record worker_exited exit_code"}, S::kRunning},
                   {10,
                    event::Posted{Later::kReportFailure},
                    {"flush lines", "say ", "report rank 0", "abandon round", "signal 102 15", "arm kill 40"},
                    S::kStopping},
                   // The rendezvous's restart waits for the stop under way instead of signalling again.
                   {11, restart(true), {"say restarting the workers: worker 0 failed", "record restart worker_failure"},
                    S::kStopping},
                   {12,
                    event::Exited{102, 0, SIGTERM},
                    {"record worker_exited stopped", "cancel kill", "cancel give_up", "cancel park", "settled",
                     "signal 101 9", "signal 102 9", "kill leftovers", "drain 101,102", "join"},
                    S::kJoining},
                   {13, event::Round{generation(2, 1)}, {"record round complete", "start 2 previous 101,102"}, S::kRunning},
               })});
  }

  TEST_CASE("two exits reaped in one batch make one report, of the failure that explains the other") {
    play({"batch", two_workers(),
          then(running_two(),
               {
                   {10, event::Exited{102, 1, 0}, {"record failure 102", "post report"}, S::kRunning},
                   {10, event::Exited{101, 0, SIGSEGV}, {"record failure 101"}, S::kRunning},
                   {10, recorded(102, 1, 1, 0), {"record worker_exited exit_code"}, S::kRunning},
                   {10, recorded(101, 0, 0, SIGSEGV), {"record worker_exited signal"}, S::kRunning},
                   // The death by a signal explains the peer's exit 1: rank 0 is reported.
                   {10,
                    event::Posted{Later::kReportFailure},
                    {"flush lines", "say ", "report rank 0", "abandon round", "post stop_done"},
                    S::kStopping},
                   {10,
                    event::Posted{Later::kStopDone},
                    {"cancel kill", "cancel give_up", "cancel park", "settled", "signal 101 9", "signal 102 9",
                     "kill leftovers", "drain 101,102"},
                    S::kIdle},
               })});
  }

  TEST_CASE("a signal is forwarded; SIGKILL after the grace, then the agent gives up and exits 128+N") {
    play({"signal", two_workers(),
          then(running_two(),
               {
                   {10,
                    event::Signal{SIGTERM},
                    {"say got SIGTERM; forwarding", "close rendezvous", "signal 101 15", "signal 102 15", "arm kill 40"},
                    S::kStopping},
                   {12, event::Exited{101, 0, SIGTERM}, {"record worker_exited stopped"}, S::kStopping},
                   {40,
                    event::Due{Deadline::kKill},
                    {"say ", "signal 102 9", "arm give_up 50"},
                    S::kStopping},
                   {50,
                    event::Due{Deadline::kGiveUp},
                    {"say ", "record worker_exited given_up", "cancel kill", "cancel give_up", "cancel park", "settled",
                     "signal 101 9", "kill leftovers", "drain 101,102", "record job_end signal", "drain 101,102",
                     "exit 143"},
                    S::kDone},
               })});
    play({"signal before the first join", two_workers(),
          {
              // While the standbys load, before the first join: nothing to stop, and their word
              // that comes after does not join.
              {0, event::Signal{SIGTERM}, {"say got SIGTERM", "close rendezvous", "post stop_done"}, S::kStopping},
              {0, event::Join{}, {}, S::kStopping},
              {0,
               event::Posted{Later::kStopDone},
               {"cancel kill", "cancel give_up", "cancel park", "settled", "kill leftovers", "drain ",
                "record job_end signal", "drain ", "exit 143"},
               S::kDone},
          }});
    play({"second signal", two_workers(),
          then(running_two(),
               {
                   {10,
                    event::Signal{SIGINT},
                    {"say got SIGINT", "close rendezvous", "signal 101 2", "signal 102 2", "arm kill 40"},
                    S::kStopping},
                   {11,
                    event::Signal{SIGINT},
                    {"say got SIGINT again; killing the workers now", "signal 101 9", "signal 102 9", "arm give_up 21"},
                    S::kStopping},
                   // The restart that follows is not acted on: the agent is on its way out.
                   {12, restart(false), {}, S::kStopping},
               })});
  }

  TEST_CASE("the job's failure and the rendezvous's loss end the run with the documented exit codes") {
    play({"job failed", two_workers(),
          then(running_two(),
               {
                   {10,
                    event::JobFailed{failure_of(3), "restart budget spent"},
                    {"abandon round", "signal 101 15", "signal 102 15", "arm kill 40"},
                    S::kStopping},
                   {11, event::Exited{101, 0, SIGTERM}, {"record worker_exited stopped"}, S::kStopping},
                   {11,
                    event::Exited{102, 0, SIGTERM},
                    {"record worker_exited stopped", "cancel kill", "cancel give_up", "cancel park", "settled",
                     "signal 101 9", "signal 102 9", "kill leftovers", "drain 101,102", "flush lines",
                     "console summary", "say job failed: restart budget spent", "record job_end failed",
                     "drain 101,102", "exit 1"},
                    S::kDone},
               })});
    play({"rendezvous lost between rounds", two_workers(),
          {
              {0, event::Join{}, {"join"}, S::kJoining},
              {4, event::RendezvousError{"timed out"}, {"say rendezvous failed: timed out", "post stop_done"}, S::kStopping},
              {4,
               event::Posted{Later::kStopDone},
               {"cancel kill", "cancel give_up", "cancel park", "settled", "kill leftovers", "drain ",
                "record job_end rendezvous_failed", "drain ", "exit 3"},
               S::kDone},
          }});
    play({"no master port", two_workers(),
          {
              {0, event::Join{}, {"join"}, S::kJoining},
              {0, event::CannotJoin{"no free port"}, {"say no free port", "record job_end rendezvous_failed", "drain ", "exit 3"},
               S::kDone},
          }});
  }

  TEST_CASE("a drained node stops its workers (abandoning the round with in-memory restart) and exits 0") {
    const std::vector<Step> stop_then_exit = {
        {11, event::Exited{101, 0, SIGTERM}, {"record worker_exited stopped"}, S::kStopping},
        {11,
         event::Exited{102, 0, SIGTERM},
         {"record worker_exited stopped", "cancel kill", "cancel give_up", "cancel park", "settled", "signal 101 9",
          "signal 102 9", "kill leftovers", "drain 101,102", "say drained: the workers have stopped",
          "record job_end drained", "drain 101,102", "exit 0"},
         S::kDone},
        // What the rendezvous may still say is not acted on: this node is out of the job.
        {12, restart(false), {}, S::kDone},
    };
    std::vector<Step> plain = {{10,
                                event::Drained{"ddp-rendezvous drain took this node out of job j"},
                                {"say ddp-rendezvous drain took this node out of job j; stopping the workers",
                                 "record drained drain", "signal 101 15", "signal 102 15", "arm kill 40"},
                                S::kStopping}};
    plain.insert(plain.end(), stop_then_exit.begin(), stop_then_exit.end());
    play({"drained", two_workers(), then(running_two(), plain)});
    std::vector<Step> in_memory = plain;
    in_memory[0].effects.insert(in_memory[0].effects.begin() + 2, "abandon round");
    play({"drained, in-memory restart", two_workers(/*in_memory=*/true), then(running_two(), in_memory)});
  }

  TEST_CASE("a round whose workers cannot start stops those that did and exits 2") {
    play({"start failed", two_workers(),
          {
              {0, event::Join{}, {"join"}, S::kJoining},
              {1, event::Round{generation(1)}, {"record round complete", "start 1"}, S::kRunning},
              {1, started(101, 0), {}, S::kRunning},
              {1, started(102, 1), {}, S::kRunning},
              {1,
               event::StartFailed{"cannot execute ./train: No such file", {102}},
               {"say cannot execute", "close rendezvous", "signal 101 15", "arm kill 31"},
               S::kStopping},
              {2,
               event::Exited{101, 0, SIGTERM},
               {"record worker_exited stopped", "cancel kill", "cancel give_up", "cancel park", "settled",
                "signal 101 9", "signal 102 9", "kill leftovers", "drain 101,102", "record job_end usage",
                "drain 101,102", "exit 2"},
               S::kDone},
          }});
  }

  TEST_CASE("a hung worker's exit during the stop is in the summary before the stop ends") {
    play({"hung", two_workers(),
          then(running_two(),
               {
                   {10, event::Hung{101}, {}, S::kRunning},
                   // The peer times out in its collective first.
                   {11, event::Exited{102, 1, 0}, {"record failure 102", "post report"}, S::kRunning},
                   {11, recorded(102, 1, 1, 0), {"record worker_exited exit_code"}, S::kRunning},
                   // The hung worker gets its dump signal from the shell, not SIGTERM.
                   {11,
                    event::Posted{Later::kReportFailure},
                    {"flush lines", "say ", "report rank 1", "abandon round", "arm kill 41"},
                    S::kStopping},
                   {12,
                    event::Exited{101, 0, SIGABRT},
                    {"record worker_exited stopped", "record failure 101 into last"},
                    S::kStopping},
                   {12,
                    recorded(101, 0, 0, SIGABRT, true),
                    {"record worker_exited signal", "cancel kill", "cancel give_up", "cancel park", "settled",
                     "signal 101 9", "signal 102 9", "kill leftovers", "drain 101,102"},
                    S::kIdle},
               })});
  }

  TEST_CASE("restartable workers park at a restart and are handed to the next round") {
    play({"park", two_workers(/*in_memory=*/true),
          then(running_two(/*channels=*/true),
               {
                   {2, event::Restartable{101, true}, {}, S::kRunning},
                   {2, event::Restartable{102, true}, {}, S::kRunning},
                   {10,
                    restart(false),
                    {"say restarting the workers: a node joined", "record restart membership", "abandon slot 0",
                     "abandon slot 1", "arm park 15"},
                    S::kStopping},
                   {11, event::Parked{101, 7}, {"parked 101 at 7", "record worker_parked"}, S::kStopping},
                   {11,
                    event::Parked{102, 7},
                    {"parked 102 at 7", "record worker_parked", "cancel kill", "cancel give_up", "cancel park", "settled",
                     "drain ", "join"},
                    S::kJoining},
                   {12, event::Round{generation(2)}, {"record round complete", "start 2 parked 0:101 parked 1:102"},
                    S::kRunning},
                   {12, started(101, 0, true, true), {}, S::kRunning},
                   {12, started(102, 1, true, true), {}, S::kRunning},
                   // Still restartable in its new round: it parks again without saying so anew.
                   {20, restart(false), {"say ", "record restart membership", "abandon slot 0", "abandon slot 1", "arm park 25"},
                    S::kStopping},
               })});
    play({"park deadline", two_workers(true),
          then(running_two(true),
               {
                   {2, event::Restartable{101, true}, {}, S::kRunning},
                   {2, event::Restartable{102, true}, {}, S::kRunning},
                   {10, restart(false), {"say ", "record restart membership", "abandon slot 0", "abandon slot 1", "arm park 15"},
                    S::kStopping},
                   {11, event::Parked{101, 7}, {"parked 101 at 7", "record worker_parked"}, S::kStopping},
                   {15,
                    event::Due{Deadline::kPark},
                    {"say ", "signal 102 15", "cancel park", "arm kill 45"},
                    S::kStopping},
                   {16,
                    event::Exited{102, 0, SIGTERM},
                    {"close channel 102", "record worker_exited stopped", "cancel kill", "cancel give_up", "cancel park",
                     "settled", "signal 102 9", "drain 102", "join"},
                    S::kJoining},
               })});
    play({"not restartable any more", two_workers(true),
          then(running_two(true),
               {
                   {2, event::Restartable{101, true}, {}, S::kRunning},
                   {10, restart(false), {"say ", "record restart membership", "abandon slot 0", "signal 102 15", "arm park 15", "arm kill 40"},
                    S::kStopping},
                   {11, event::Restartable{101, false}, {"say worker 0 (pid 101) said it is no longer restartable", "signal 101 15", "arm kill 41"},
                    S::kStopping},
                   {12, event::ChannelLost{102, "bad frame"}, {"say worker 1 (local rank 1, pid 102)"}, S::kStopping},
               })});
  }

  TEST_CASE("a no-restart exit code makes the report fatal, and the node rejoins unchecked to say it stopped") {
    play({"fatal", two_workers(false, {3}),
          then(running_two(),
               {
                   {10, event::Exited{101, 3, 0}, {"record failure 101", "post report"}, S::kRunning},
                   {10, recorded(101, 0, 3, 0), {"record worker_exited exit_code"}, S::kRunning},
                   {10,
                    event::Posted{Later::kReportFailure},
                    {"flush lines", "say ", "report rank 0 fatal", "abandon round", "signal 102 15", "arm kill 40"},
                    S::kStopping},
                   // The rendezvous's restart does not restart: the job ends everywhere.
                   {11, restart(true), {"say the job fails: ", "cancel park"}, S::kStopping},
                   {12,
                    event::Exited{102, 0, SIGTERM},
                    {"record worker_exited stopped", "cancel kill", "cancel give_up", "cancel park", "settled",
                     "signal 101 9", "signal 102 9", "kill leftovers", "drain 101,102", "join unchecked"},
                    S::kJoining},
                   // A round despite the decision: the node leaves with the verdict.
                   {13,
                    event::Round{generation(2)},
                    {"say the rendezvous started a new round despite", "close rendezvous", "post stop_done"},
                    S::kStopping},
               })});
  }

  TEST_CASE("a failed health check while running reports this node's failure and stops the workers") {
    rdzv::WorkerFailure f = failure_of(-1);
    play({"health", two_workers(),
          then(running_two(),
               {
                   {30, event::HealthFailed{f}, {"report rank -1", "signal 101 15", "signal 102 15", "arm kill 60"},
                    S::kStopping},
                   // A result for a round that is over is not acted on.
                   {31, event::HealthFailed{f}, {}, S::kStopping},
               })});
  }

  TEST_CASE("deadlines of a stop that is over and exits of processes that are not workers do nothing") {
    play({"stale", two_workers(),
          then(running_two(),
               {
                   {5, event::Due{Deadline::kKill}, {}, S::kRunning},
                   {5, event::Due{Deadline::kGiveUp}, {}, S::kRunning},
                   {5, event::Due{Deadline::kPark}, {}, S::kRunning},
                   {5, event::Exited{999, 1, 0}, {}, S::kRunning},
                   {5, event::Posted{Later::kStopDone}, {}, S::kRunning},
               })});
  }
}
