// The goodput account (rendezvous/goodput.h) on a manual clock: each category from the moments
// that define it, the categories adding up to the wall time, and the state machine telling the
// account what its job does (status, gauges, the job_end event); one node of the job hears the
// goodput line, a restart's reason and the verdict in full (the others: quiet).
#include <doctest/doctest.h>

#include <cstdio>
#include <numeric>
#include <utility>

#include "rendezvous/goodput.h"
#include "rendezvous/state.h"
#include "tests/rendezvous/recording_outbox.h"

using namespace ddp::rdzv;
using ddp::rdzv::test::EventOutbox;

namespace {

double sum(const GoodputTotals& t) { return std::accumulate(std::begin(t.seconds), std::end(t.seconds), 0.0); }

// Steps every `per` seconds from `from` (exclusive) to `to`, starting at step `first`; returns the
// next step.
std::int64_t train(GoodputAccount& a, double from, double to, std::int64_t first, double per = 1.0) {
  std::int64_t s = first;
  for (double t = from + per; t <= to + 1e-9; t += per) a.step(t, s++, 0);
  return s;
}

}  // namespace

TEST_CASE("a job that waits, starts and trains: waiting, recovery (its start-up), productive") {
  GoodputAccount a(100, 1.0);
  a.between_rounds(104, true);     // four seconds waiting for nodes
  a.round_formed(110, 2, 2);       // ... ten in all
  a.step(113, 0, 0);               // three seconds starting
  train(a, 113, 150, 1);           // 37 s of training
  a.ended(150);
  const GoodputTotals t = a.totals(500);  // frozen at the end
  CHECK(t.wall == doctest::Approx(50));
  CHECK(t[Spent::waiting] == doctest::Approx(10));
  CHECK(t[Spent::recovery] == doctest::Approx(3));
  CHECK(t[Spent::productive] == doctest::Approx(37));
  CHECK(t.percent() == doctest::Approx(74));
  CHECK(sum(t) == doctest::Approx(t.wall));
  CHECK(t.restarts == 0);
}

TEST_CASE("a restart: the training the next round does again is lost, the gap is recovery") {
  GoodputAccount a(0, 1.0);
  a.round_formed(0, 2, 2);
  a.step(2, 0, 0);
  train(a, 2, 30, 1);     // steps 1..28 at t = 3..30
  a.round_ended(30);      // a crash at 30; the last step at 30: no hang
  a.between_rounds(30, false);
  a.round_formed(33, 2, 2);
  a.step(36, 19, 0);      // resumed from the checkpoint of step 19, reached at t = 21
  train(a, 36, 40, 20);
  a.ended(40);
  const GoodputTotals t = a.totals(40);
  CHECK(t[Spent::lost] == doctest::Approx(9));       // 21..30
  CHECK(t[Spent::recovery] == doctest::Approx(2 + 3 + 3));
  CHECK(t[Spent::productive] == doctest::Approx(28 - 9 + 4));
  CHECK(t.restarts == 1);
  CHECK(sum(t) == doctest::Approx(40));
  CHECK(t.summary() == "goodput 57.5% of 40.0 s: 9.0 s lost to 1 restart, 8.0 s recovering");
}

TEST_CASE("reports every 2 s: the moment a resumed step was reached is extrapolated at the round's rate") {
  GoodputAccount a(0, 2.0);
  a.round_formed(0, 1, 1);
  a.step(2, 0, 0);
  a.step(4, 100, 0);    // 0.02 s a step
  a.round_ended(5.4);   // the crash: 1.4 s after the last report, at about step 170
  a.round_formed(6, 1, 1);
  a.step(8, 150, 0);    // resumed at step 150, reached at 4 + 50 x 0.02 = 5.0
  CHECK(a.totals(8)[Spent::lost] == doctest::Approx(0.4));
  CHECK(a.totals(8)[Spent::hang] == 0);

  // A round too short for a rate of its own: the next round's rate, once it has one.
  GoodputAccount b(0, 2.0);
  b.round_formed(0, 1, 1);
  b.step(2, 13, 0);
  b.round_ended(3.4);
  b.round_formed(4, 1, 1);
  b.step(6, 61, 0);
  CHECK(b.totals(6)[Spent::lost] == 0);  // not known yet
  b.step(8, 161, 0);                     // 0.02 s a step: step 61 was reached at 2 + 48 x 0.02
  CHECK(b.totals(8)[Spent::lost] == doctest::Approx(3.4 - 2.96));
}

TEST_CASE("the first report names the step the round resumed at; its training began that many steps ago") {
  GoodputAccount a(0, 2.0);
  a.round_formed(0, 1, 1);
  a.step(2, 0, 0);
  a.step(4, 100, 0);       // 0.02 s a step
  a.round_ended(5);        // at about step 150
  a.round_formed(6, 1, 1);
  a.step(9, 160, 0, 110);  // resumed at 110 (its checkpoint), 50 steps ago: training began at 8.0
  const GoodputTotals t = a.totals(9);
  CHECK(t[Spent::lost] == doctest::Approx(5 - (4 + 10 * 0.02)));  // 110 was reached at 4.2
  CHECK(t[Spent::recovery] == doctest::Approx(2 + 1 + 2));         // start-up, between rounds, 6 -> 8
  CHECK(t[Spent::productive] == doctest::Approx(3 - (5 - 4.2) + 1));
  CHECK(sum(t) == doctest::Approx(9));
}

TEST_CASE("a round that resumes beyond where the last one ended (in-memory state) lost nothing") {
  GoodputAccount a(0, 1.0);
  a.round_formed(0, 1, 1);
  a.step(1, 0, 0);
  train(a, 1, 10, 1);  // up to step 9
  a.round_ended(10);
  a.round_formed(10.5, 1, 1);
  a.step(11, 10, 0);
  CHECK(a.totals(11)[Spent::lost] == 0);
  CHECK(a.totals(11)[Spent::recovery] == doctest::Approx(1 + 1));
}

TEST_CASE("a silence longer than a step and two heartbeats before a restart is a hang; a short one is not") {
  GoodputAccount a(0, 1.0);
  a.round_formed(0, 1, 1);
  a.step(1, 0, 0);
  train(a, 1, 20, 1);  // one step a second up to t = 20
  a.round_ended(50);   // nothing since t = 20: the hang detector fired at 50
  CHECK(a.totals(50)[Spent::hang] == doctest::Approx(30));
  CHECK(a.totals(50)[Spent::productive] == doctest::Approx(19));

  GoodputAccount b(0, 1.0);
  b.round_formed(0, 1, 1);
  b.step(1, 0, 0);
  train(b, 1, 20, 1);
  b.round_ended(23.5);  // 3.5 s: within a step and two heartbeats (1 + 2 x 1 ... is 4)
  CHECK(b.totals(23.5)[Spent::hang] == 0);
  CHECK(b.totals(23.5)[Spent::productive] == doctest::Approx(22.5));
}

TEST_CASE("checkpoint stalls come out of training; running below MAX is reduced capacity") {
  GoodputAccount a(0, 1.0);
  a.round_formed(0, 3, 4);  // three of four nodes
  a.step(2, 0, 0.7);        // a stall before the first step is the start-up's
  a.step(12, 10, 0.7);
  a.step(22, 20, 2.7);      // two seconds of checkpoint stall since
  const GoodputTotals t = a.totals(22);
  CHECK(t[Spent::recovery] == doctest::Approx(2));
  CHECK(t[Spent::checkpoint] == doctest::Approx(2));
  CHECK(t[Spent::reduced_capacity] == doctest::Approx(20 * 0.25));
  CHECK(t[Spent::productive] == doctest::Approx(20 * 0.75 - 2));
  CHECK(sum(t) == doctest::Approx(22));
}

TEST_CASE("a job whose workers report no steps: its running time is training") {
  GoodputAccount a(0, 1.0);
  a.round_formed(5, 2, 2);
  CHECK(a.totals(25)[Spent::productive] == doctest::Approx(20));
  a.ended(30);
  CHECK(a.totals(30)[Spent::productive] == doctest::Approx(25));
  CHECK(a.totals(30)[Spent::waiting] == doctest::Approx(5));
}

TEST_CASE("totals round-trip through JSON; malformed or unbelievable records are refused") {
  GoodputAccount a(0, 1.0);
  a.round_formed(1, 2, 2);
  a.step(2, 0, 0);
  a.round_ended(10);
  const GoodputTotals t = a.totals(12);
  const auto back = GoodputTotals::from_json(t.to_json());
  REQUIRE(back);
  CHECK(back->wall == doctest::Approx(12));
  CHECK(back->restarts == 1);
  CHECK((*back)[Spent::recovery] == doctest::Approx(t[Spent::recovery]));
  nlohmann::json bad = t.to_json();
  bad["seconds"]["lost"] = -1;
  CHECK_FALSE(GoodputTotals::from_json(bad));
  bad = t.to_json();
  bad["seconds"].erase("hang");
  CHECK_FALSE(GoodputTotals::from_json(bad));
  bad = t.to_json();
  bad["wall_seconds"] = "12";
  CHECK_FALSE(GoodputTotals::from_json(bad));
  CHECK_FALSE(GoodputTotals::from_json(nlohmann::json::array()));

  // Where rounding tips the percent (4.005 s of 10 s: 40.05 %; 5.9175 s of 14.776 s: 40.0 % of
  // the exact seconds, 40.1 % of the milliseconds), the JSON, the line made from the exact totals
  // and a status made from the JSON alone still show one figure.
  for (const auto& [wall, productive] : {std::pair{10.0, 4.005}, std::pair{14.776, 5.9175}}) {
    CAPTURE(productive);
    GoodputTotals tipped;
    tipped.wall = wall;
    tipped.seconds[static_cast<int>(Spent::productive)] = productive;
    tipped.seconds[static_cast<int>(Spent::recovery)] = wall - productive;
    const auto reread = GoodputTotals::from_json(tipped.to_json());
    REQUIRE(reread);
    CHECK(reread->summary() == tipped.summary());
    char json_percent[32];
    std::snprintf(json_percent, sizeof json_percent, "%.1f", tipped.to_json()["percent"].get<double>());
    CHECK(tipped.summary().rfind("goodput " + std::string(json_percent) + "% of ", 0) == 0);
  }

  GoodputAccount restored(1000, 1.0);
  restored.restore(1000, *back, false, 0, 2);
  CHECK(restored.totals(1003).wall == doctest::Approx(15));
  CHECK(restored.totals(1003)[Spent::recovery] == doctest::Approx(t[Spent::recovery] + 3));
}

namespace {

NodeSpec spec(const std::string& host) {
  NodeSpec s;
  s.job_id = "job";
  s.host = host;
  s.addr = "10.0.0." + host.substr(host.size() - 1);
  s.min_nodes = 2;
  s.max_nodes = 2;
  s.max_restarts = 3;
  s.master_port = 30000;
  s.timeouts.heartbeat_timeout = 1000;
  return s;
}

NodeProgress at(std::int64_t step) {
  NodeProgress p;
  p.step = step;
  return p;
}

}  // namespace

TEST_CASE("the state machine keeps each job's account: status, gauges and the job_end event") {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm(clock, out);
  sm.join(1, spec("node1"));
  clock.advance(2);  // waiting for the second node
  sm.join(2, spec("node2"));
  clock.advance(1);
  for (int s = 0; s < 10; ++s) {  // a step a second, both nodes reporting
    sm.progress(1, at(s));
    sm.progress(2, at(s));
    clock.advance(1);
  }
  WorkerFailure f;
  f.host = "node1";
  f.rank = 0;
  f.exit_code = 1;
  sm.report_failure(1, f);
  // node2's heartbeat, sent before it heard of the restart, must not count for the next round.
  sm.progress(2, at(9));
  clock.advance(1);
  sm.join(1, spec("node1"));
  sm.join(2, spec("node2"));
  sm.progress(2, at(9));  // still the old round's figure
  clock.advance(1);
  sm.progress(1, at(5));  // resumed from step 5
  clock.advance(3);
  sm.report_success(1);
  sm.report_success(2);
  const nlohmann::json job = sm.status()["jobs"][0];
  const nlohmann::json& g = job["goodput"];
  CHECK(g["wall_seconds"].get<double>() == doctest::Approx(18));
  CHECK(g["seconds"]["waiting"].get<double>() == doctest::Approx(2));
  // Start-up until the first report (1 s, at t = 3); the first round reached step 5 at t = 8 and
  // ended at 13: 5 s lost; 1 s between the rounds and 1 s to the next round's first report.
  CHECK(g["seconds"]["lost"].get<double>() == doctest::Approx(5));
  CHECK(g["seconds"]["recovery"].get<double>() == doctest::Approx(1 + 1 + 1));
  CHECK(g["seconds"]["productive"].get<double>() == doctest::Approx(10 - 5 + 3));
  CHECK(g["restarts"] == 1);
  double total = 0;
  for (const auto& [name, s] : g["seconds"].items()) total += s.get<double>();
  CHECK(total == doctest::Approx(18));
  const auto ends = out.of("job_end");
  REQUIRE(ends.size() == 1);
  CHECK(ends[0]->fields["goodput"] == g);
  bool said = false;
  for (const auto& line : out.lines) said = said || line.find("job job: goodput 44.4% of 18.0 s") == 0;
  CHECK(said);
}

TEST_CASE("the node whose worker failed speaks for the job: restart and verdict in full, the others quiet") {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm(clock, out);
  NodeSpec a = spec("node1"), b = spec("node2");
  a.max_restarts = b.max_restarts = 1;
  sm.join(1, a);
  sm.join(2, b);
  WorkerFailure f;
  f.host = "node2";
  f.rank = 1;  // node2 runs group rank 1 (one worker per node)
  f.exit_code = 1;
  sm.report_failure(2, f);
  REQUIRE(out.of(1, "restart").size() == 1);
  REQUIRE(out.of(2, "restart").size() == 1);
  CHECK(out.of(1, "restart")[0].value("quiet", false));
  CHECK_FALSE(out.of(2, "restart")[0].contains("quiet"));
  sm.join(1, a);
  sm.join(2, b);
  sm.report_failure(2, f);  // the budget is spent: the job fails once both nodes stopped
  CHECK(out.of(1, "restart").back().value("quiet", false));
  CHECK_FALSE(out.of(2, "restart").back().contains("quiet"));
  sm.join(1, a);
  sm.join(2, b);
  const auto v1 = out.of(1, "job_failed"), v2 = out.of(2, "job_failed");
  REQUIRE(v1.size() == 1);
  REQUIRE(v2.size() == 1);
  CHECK(v1[0].value("quiet", false));
  CHECK_FALSE(v1[0].contains("goodput"));
  CHECK_FALSE(v2[0].contains("quiet"));
  CHECK(v2[0]["goodput"].get<std::string>().rfind("job job: goodput ", 0) == 0);
}
