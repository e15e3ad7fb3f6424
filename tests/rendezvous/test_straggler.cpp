// Stragglers (rendezvous/state_straggler.cpp): the busy times a job's nodes report, compared on a
// manual clock (no sockets, no sleep).
#include <doctest/doctest.h>

#include "rendezvous/state.h"
#include "tests/rendezvous/recording_outbox.h"

using namespace ddp::rdzv;
using ddp::rdzv::test::EventOutbox;

namespace {

NodeSpec spec(const std::string& host, int nodes, const std::string& mode = "report") {
  NodeSpec s;
  s.job_id = "job";
  s.host = host;
  s.addr = "10.0.0." + host.substr(host.size() - 1);
  s.local_world_size = 2;
  s.min_nodes = nodes;
  s.max_nodes = nodes;
  s.master_port = 30000 + (host.back() - '0');
  s.timeouts.heartbeat_timeout = 1000;
  s.straggler.mode = mode;  // factor 1.5, window 60 s: the defaults
  return s;
}

NodeProgress busy(double seconds, int local_rank = 1) {
  NodeProgress p;
  p.step = 10;
  p.busy = seconds;
  p.busy_local_rank = local_rank;
  return p;
}

// Three running nodes of two workers each (ranks 0-1, 2-3, 4-5).
struct Job {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm{clock, out};
  explicit Job(const std::string& mode = "report") {
    for (ConnId c : {1, 2, 3}) sm.join(c, spec("node" + std::to_string(c), 3, mode));
    REQUIRE(out.of(3, "round").size() == 1);
    out.clear();
  }
  // Every node reports; node3 reports `slow`, the others 0.2 s and 0.22 s. The server compares
  // at most once a second, at the first report that finds two figures: here node1's, after
  // node3's.
  void report(double slow) {
    sm.progress(3, busy(slow));
    sm.progress(1, busy(0.2));
    sm.progress(2, busy(0.22));
  }
  // Reports every 2 s (an agent's pace) for `seconds`, the first 2 s from now.
  void report_for(double seconds, double slow) {
    for (double t = 0; t < seconds; t += 2) {
      clock.advance(2);
      report(slow);
    }
  }
};

}  // namespace

TEST_CASE("a node at the factor or more for the window is named: event, status line, gauge") {
  Job f;
  f.report_for(60, 0.42);  // 2x the others' median (0.21 s), slow from the first report: 58 s
  CHECK(f.out.of("straggler").empty());
  CHECK(f.sm.status()["jobs"][0]["stragglers"].empty());
  f.report_for(2, 0.42);
  REQUIRE(f.out.of("straggler").size() == 1);
  const auto& e = *f.out.of("straggler")[0];
  CHECK(e.node.find("node3") != std::string::npos);
  CHECK(e.ranks == std::vector<int>{5});  // node3's first rank is 4; its slowest is local rank 1
  CHECK(e.fields["ratio"].get<double>() == doctest::Approx(2.0));
  CHECK(e.fields["median"].get<double>() == doctest::Approx(0.21));
  const auto job = f.sm.status()["jobs"][0];
  REQUIRE(job["stragglers"].size() == 1);
  CHECK(job["stragglers"][0].get<std::string>() ==
        "node node3 (10.0.0.3) [group rank 2]: 2.0x the median busy time for 60 s (rank 5: 420 ms vs 210 ms)");
  CHECK(job["nodes"][2]["straggler"] == true);
  CHECK(job["nodes"][2]["busy"].get<double>() == doctest::Approx(0.42));
  CHECK(job["nodes"][2]["busy_rank"] == 5);
  CHECK(job["straggler_policy"]["mode"] == "report");
  CHECK(f.sm.gauges().stragglers.at("job") == 1);
  f.report_for(30, 0.42);  // named once
  CHECK(f.out.of("straggler").size() == 1);
  CHECK(f.out.dropped.empty());  // report only
}

TEST_CASE("a node slow for less than the window at a time, or below the factor, is never named") {
  Job f;
  for (int i = 0; i < 4; ++i) {
    f.report_for(40, 0.5);
    f.report_for(20, 0.21);  // back at the others' pace for a quarter of the window: the count restarts
  }
  f.report_for(120, 0.3);  // 1.43x: below the factor 1.5
  CHECK(f.out.of("straggler").empty());
  CHECK(f.sm.gauges().stragglers.at("job") == 0);
}

TEST_CASE("a node above the factor by less than 5 ms a step is noise, not a straggler") {
  Job f;
  for (int t = 0; t < 120; t += 2) {
    f.clock.advance(2);
    f.sm.progress(3, busy(0.0048));  // 4x the others', 3.6 ms more
    f.sm.progress(1, busy(0.0012));
    f.sm.progress(2, busy(0.0012));
  }
  CHECK(f.out.of("straggler").empty());
  for (int t = 0; t < 62; t += 2) {
    f.clock.advance(2);
    f.sm.progress(3, busy(0.0075));  // 6.3 ms more: slow
    f.sm.progress(1, busy(0.0012));
    f.sm.progress(2, busy(0.0012));
  }
  REQUIRE(f.out.of("straggler").size() == 1);
  CHECK(f.out.of("straggler")[0]->message.find("(rank 5: 7.5 ms vs 1.2 ms)") != std::string::npos);
}

TEST_CASE("short dips below the factor do not restart the count") {
  Job f;
  for (int i = 0; i < 3; ++i) {
    f.report_for(16, 0.5);
    f.report_for(4, 0.21);  // a dip of 4 s, shorter than a quarter of the window
  }
  CHECK(f.out.of("straggler").empty());  // 58 s since the first slow report
  f.report_for(2, 0.5);
  REQUIRE(f.out.of("straggler").size() == 1);
}

TEST_CASE("a named straggler is cleared only once it stays below half the excess for the window") {
  Job f;
  f.report_for(62, 0.42);
  REQUIRE(f.out.of("straggler").size() == 1);
  f.report_for(120, 0.3);  // 1.43x: below the factor, above the clearing line 1.25x: still named
  CHECK(f.out.of("straggler_cleared").empty());
  f.report_for(60, 0.23);  // 1.1x, for 58 s since its first report
  CHECK(f.out.of("straggler_cleared").empty());
  f.report_for(2, 0.23);
  REQUIRE(f.out.of("straggler_cleared").size() == 1);
  CHECK(f.sm.status()["jobs"][0]["stragglers"].empty());
  CHECK(f.sm.gauges().stragglers.at("job") == 0);
}

TEST_CASE("with two nodes each is compared with the other; with one, or with --straggler=off, nothing is") {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm{clock, out};
  sm.join(1, spec("node1", 2));
  sm.join(2, spec("node2", 2));
  for (int t = 0; t <= 60; t += 2, clock.advance(2)) {
    sm.progress(2, busy(0.4));
    sm.progress(1, busy(0.2));
  }
  REQUIRE(out.of("straggler").size() == 1);
  CHECK(out.of("straggler")[0]->node.find("node2") != std::string::npos);

  Job off("off");
  off.report_for(300, 1.0);
  CHECK(off.out.of("straggler").empty());
  CHECK(off.sm.status()["jobs"][0]["stragglers"].empty());
}

TEST_CASE("a busy rank beyond the node's workers is not believed") {
  Job f;
  for (int t = 0; t <= 70; t += 2, f.clock.advance(2)) {
    f.sm.progress(1, busy(0.2));
    f.sm.progress(2, busy(0.2));
    f.sm.progress(3, busy(0.9, 7));  // two workers: local ranks 0 and 1 only
  }
  CHECK(f.out.of("straggler").empty());
  CHECK_FALSE(f.sm.status()["jobs"][0]["nodes"][2].contains("busy"));
}

TEST_CASE("--straggler=replace drains the slowest named straggler onto a waiting spare; the next round is judged afresh") {
  Job f("replace");
  NodeSpec spare = spec("node4", 3, "replace");
  spare.spare = true;
  f.report_for(62, 0.42);  // named, but no spare: it stays, said once
  REQUIRE(f.out.of("straggler").size() == 1);
  CHECK(f.out.dropped.empty());
  CHECK(std::count_if(f.out.lines.begin(), f.out.lines.end(), [](const std::string& l) {
          return l.find("no spare waits to take the place of node3") != std::string::npos;
        }) == 1);
  for (int t = 0; t < 10; t += 2) {  // node2 turns slow too, not yet for a window
    f.clock.advance(2);
    f.sm.progress(3, busy(0.42));
    f.sm.progress(2, busy(0.5));
    f.sm.progress(1, busy(0.2));
  }
  f.sm.join(4, spare);
  REQUIRE(f.out.of("node_spare").size() == 1);
  CHECK(f.out.of("node_spare")[0]->cause == "spare");
  f.report_for(2, 0.42);  // the next comparison replaces node3, the one named
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped.count(2) == 0);
  CHECK(f.out.dropped[3].code == "drained");
  CHECK(f.out.dropped[3].message.find("as a straggler (node node3") != std::string::npos);
  REQUIRE(f.out.of("node_drained").size() == 1);
  CHECK(f.out.of("node_drained")[0]->cause == "straggler");
  REQUIRE(f.out.of(1, "restart").size() == 1);
  CHECK(f.out.of(1, "restart")[0]["counted"] == false);
  CHECK(f.out.of("restart")[0]->cause == "straggler");
  f.sm.join(1, spec("node1", 3, "replace"));
  f.sm.join(2, spec("node2", 3, "replace"));
  CHECK(f.out.round(4).group_world_size == 3);  // the spare took its place

  // The new round is judged afresh: node2, slow before it too, is named (and replaced by a second
  // spare) only once it has been slow for a whole window of this round.
  NodeSpec spare5 = spec("node5", 3, "replace");
  spare5.spare = true;
  f.sm.join(5, spare5);
  f.out.clear();
  f.out.events.clear();
  auto round = [&] {
    f.sm.progress(2, busy(0.5));
    f.sm.progress(1, busy(0.2));
    f.sm.progress(4, busy(0.2));
  };
  for (int t = 0; t <= 60; t += 2, f.clock.advance(2)) round();  // judged from 2 s on: 58 s slow
  CHECK(f.out.of("straggler").empty());
  CHECK(f.out.dropped.empty());
  round();
  REQUIRE(f.out.of("straggler").size() == 1);
  CHECK(f.out.dropped.count(2) == 1);
}

TEST_CASE("every node of a job gives the same straggler policy") {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm{clock, out};
  sm.join(1, spec("node1", 2));
  NodeSpec other = spec("node2", 2);
  other.straggler.factor = 2;
  sm.join(2, other);
  REQUIRE(out.dropped.count(2) == 1);
  CHECK(out.dropped[2].code == "policy_mismatch");
  CHECK(out.dropped[2].message.find("--straggler_factor 2.0 differs from job job's 1.5") != std::string::npos);
}
