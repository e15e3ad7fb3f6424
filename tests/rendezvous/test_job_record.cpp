// Job records. What a replicated leader writes (StateMachine::record) carries a job to
// the next leader (StateMachine::load): policy, restart count, generation, the round and its
// secrets; only a round, a restart or a verdict changes a record (not each join); and a corrupt
// record is refused with its reason by decode_record, never thrown. Manual clock, no sockets.
#include <doctest/doctest.h>

#include <variant>

#include "rendezvous/job_record.h"
#include "rendezvous/resume.h"
#include "rendezvous/state.h"
#include "tests/rendezvous/recording_outbox.h"

using namespace ddp::rdzv;
using ddp::rdzv::test::RecordingOutbox;
using nlohmann::json;

namespace {

NodeSpec spec(int i, int nodes, int max_restarts) {
  NodeSpec s;
  s.job_id = "job";
  s.host = "node" + std::to_string(i);
  s.addr = "10.0.0." + std::to_string(i);
  s.local_world_size = 2;
  s.min_nodes = nodes;
  s.max_nodes = nodes;
  s.max_restarts = max_restarts;
  s.master_port = 30000 + i;
  s.timeouts.join_timeout = 60;
  s.timeouts.last_call_timeout = 5;
  s.timeouts.heartbeat_timeout = 5;
  return s;
}

WorkerFailure failure(const std::string& host) {
  WorkerFailure f;
  f.host = host;
  f.rank = 0;
  f.exit_code = 1;
  return f;
}

// One replica's state machine with recording on.
struct Replica {
  ManualClock clock;
  RecordingOutbox out;
  StateMachine sm{clock, out};
  Replica() { sm.set_recording(true); }
  json job() const {
    auto jobs = sm.status()["jobs"];
    REQUIRE(jobs.size() == 1);
    return jobs[0];
  }
  // The record as it would go through etcd: encoded, then decoded as input.
  JobRecord through_etcd(const std::string& id = "job") const {
    auto r = sm.record(id);
    REQUIRE(r.has_value());
    auto decoded = decode_record(encode_record(*r));
    if (auto* e = std::get_if<std::string>(&decoded)) FAIL(*e);
    return std::get<JobRecord>(decoded);
  }
};

ResumeRequest resume_of(const Replica& old, ConnId conn, int i, int nodes, int max_restarts) {
  auto rounds = old.out.of(conn, "round");
  REQUIRE_FALSE(rounds.empty());
  Assignment a = rounds.back()["assignment"].get<Assignment>();
  return ResumeRequest{"job", rounds.back()["assignment"]["secret"].get<std::string>(), spec(i, nodes, max_restarts),
                       a};
}

}  // namespace

TEST_CASE("a record written by one leader gives the next the same policy, restart count, generation and round") {
  Replica a;
  a.sm.join(1, spec(1, 2, 3));
  a.sm.join(2, spec(2, 2, 3));
  a.sm.report_failure(1, failure("node1"));  // counted: 1/3
  a.sm.join(1, spec(1, 2, 3));
  a.sm.join(2, spec(2, 2, 3));
  CHECK(a.job()["generation"] == 2);
  JobRecord r = a.through_etcd();
  CHECK(r.state == JobRecord::State::running);
  CHECK(r.generation == 2);
  CHECK(r.restarts_used == 1);
  CHECK(r.max_restarts == 3);
  CHECK(r.min_nodes == 2);
  CHECK(r.timeouts.heartbeat_timeout == 5);
  REQUIRE(r.members.size() == 2);
  CHECK(r.world_size == 4);

  Replica b;
  REQUIRE(b.sm.load(r));
  CHECK(b.job()["state"] == "restoring");
  CHECK(b.job()["restarts_used"] == 1);
  CHECK(b.job()["generation"] == 2);
  CHECK(b.sm.take_changed().empty());  // loading writes nothing back
  b.sm.resume(11, resume_of(a, 1, 1, 2, 3));
  b.sm.resume(12, resume_of(a, 2, 2, 2, 3));
  for (ConnId c : {11, 12}) {
    auto resumed = b.out.of(c, "resumed");
    REQUIRE(resumed.size() == 1);
    CHECK(resumed[0]["generation"] == 2);
    CHECK(resumed[0]["restart_count"] == 1);
  }
  CHECK(b.job()["state"] == "running");
  // The budget goes on from where it was: two more failures restart, the third fails the job.
  b.sm.report_failure(11, failure("node1"));
  CHECK(b.out.of(11, "restart").back()["restart_count"] == 2);
}

TEST_CASE("the goodput account goes with the record and the running round's resumes to the next leader") {
  Replica a;
  a.sm.join(1, spec(1, 2, 3));
  a.clock.advance(4);  // waiting for node2
  a.sm.join(2, spec(2, 2, 3));
  a.clock.advance(10);
  JobRecord r = a.through_etcd();
  REQUIRE(r.goodput.size() == GoodputTotals::kArraySize);
  CHECK(r.goodput[0] == doctest::Approx(14));  // written now: 14 s of wall time

  // A job between rounds: the next leader goes on from the record's account.
  a.sm.report_failure(1, failure("node1"));
  a.clock.advance(1);
  Replica b;
  REQUIRE(b.sm.load(a.through_etcd()));
  b.clock.advance(2);
  const json g = b.job()["goodput"];
  CHECK(g["wall_seconds"].get<double>() == doctest::Approx(15 + 2));
  CHECK(g["restarts"] == 1);
  CHECK(g["seconds"]["waiting"].get<double>() == doctest::Approx(4));
  CHECK(g["seconds"]["recovery"].get<double>() == doctest::Approx(1 + 2));

  // A running round: the resumes say how long it has run.
  Replica c;
  REQUIRE(c.sm.load(r));
  for (int i : {1, 2}) {
    ResumeRequest req = resume_of(a, static_cast<ConnId>(i), i, 2, 3);
    req.assignment.round_age = 30;
    c.sm.resume(static_cast<ConnId>(10 + i), req);
  }
  CHECK(c.job()["state"] == "running");
  CHECK(c.job()["goodput"]["wall_seconds"].get<double>() == doctest::Approx(4 + 30));
  CHECK(c.job()["goodput"]["seconds"]["productive"].get<double>() == doctest::Approx(30));
}

TEST_CASE("a resume with another secret than the record holds for its rank is refused") {
  Replica a;
  a.sm.join(1, spec(1, 2, 0));
  a.sm.join(2, spec(2, 2, 0));
  Replica b;
  REQUIRE(b.sm.load(a.through_etcd()));
  ResumeRequest forged = resume_of(a, 1, 1, 2, 0);
  forged.secret = std::string(32, 'a');
  b.sm.resume(11, forged);
  REQUIRE(b.out.dropped.count(11) == 1);
  CHECK(b.out.dropped[11].code == "resume_refused");
  // The real node still resumes its rank.
  b.sm.resume(12, resume_of(a, 1, 1, 2, 0));
  b.sm.resume(13, resume_of(a, 2, 2, 2, 0));
  CHECK(b.out.of(12, "resumed").size() == 1);
}

TEST_CASE("a job between rounds keeps its restart count on the next leader: the budget is not reset") {
  Replica a;
  a.sm.join(1, spec(1, 2, 1));
  a.sm.join(2, spec(2, 2, 1));
  a.sm.take_changed();
  a.sm.report_failure(1, failure("node1"));  // counted: 1/1; both nodes now rejoin
  CHECK(a.sm.take_changed() == std::vector<std::string>{"job"});
  a.sm.join(1, spec(1, 2, 1));  // node2 has not rejoined yet: the leader dies between rounds
  JobRecord r = a.through_etcd();
  CHECK(r.state == JobRecord::State::gathering);
  CHECK(r.restarts_used == 1);
  CHECK(r.generation == 1);

  Replica b;
  REQUIRE(b.sm.load(r));
  b.sm.join(11, spec(1, 2, 1));
  b.sm.join(12, spec(2, 2, 1));
  Assignment round = b.out.round(11);
  CHECK(round.generation == 2);  // monotonic across leaders
  CHECK(round.restart_count == 1);
  b.sm.report_failure(11, failure("node1"));  // the budget is spent: the job fails
  b.sm.join(11, spec(1, 2, 1));
  b.sm.join(12, spec(2, 2, 1));
  CHECK(b.out.of(11, "job_failed").size() == 1);
  CHECK(b.out.of(12, "job_failed").size() == 1);
  CHECK(b.job()["state"] == "failed");
}

TEST_CASE("a failing job stays failing on the next leader and fails its nodes when they come back") {
  Replica a;
  a.sm.join(1, spec(1, 2, 0));
  a.sm.join(2, spec(2, 2, 0));
  a.sm.report_failure(2, failure("node2"));  // budget 0: failing, the nodes stop and rejoin
  JobRecord r = a.through_etcd();
  CHECK(r.failing);
  REQUIRE(r.failures.size() == 1);
  Replica b;
  REQUIRE(b.sm.load(r));
  b.sm.join(11, spec(1, 2, 0));
  auto failed = b.out.of(11, "job_failed");
  REQUIRE(failed.size() == 1);
  CHECK(failed[0]["summary"].get<std::string>().find("node2") != std::string::npos);
}

TEST_CASE("only rounds, restarts and verdicts change a record: one per round of many joins") {
  Replica a;
  const int n = 200;
  for (int i = 1; i <= n; ++i) {
    a.sm.join(static_cast<ConnId>(i), spec(i, n, 0));
    if (i < n) CHECK(a.sm.take_changed().empty());
  }
  CHECK(a.sm.take_changed() == std::vector<std::string>{"job"});
  for (int i = 1; i <= n; ++i) a.sm.touch(static_cast<ConnId>(i));
  a.sm.tick();
  CHECK(a.sm.take_changed().empty());
  JobRecord r = a.through_etcd();
  CHECK(r.members.size() == static_cast<std::size_t>(n));
  CHECK(encode_record(*a.sm.record("job")).size() < kMaxRecordBytes / 16);
  // The job gone: its record is deleted (record() is empty).
  for (int i = 1; i <= n; ++i) a.sm.report_success(static_cast<ConnId>(i));
  a.sm.take_changed();
  for (int i = 1; i <= n; ++i) a.sm.leave(static_cast<ConnId>(i));
  CHECK(a.sm.take_changed() == std::vector<std::string>{"job"});
  CHECK_FALSE(a.sm.record("job").has_value());
}

TEST_CASE("a loaded job whose nodes never come back is forgotten after the hold, and its record deleted") {
  Replica a;
  a.sm.join(1, spec(1, 1, 0));
  Replica b;
  REQUIRE(b.sm.load(a.through_etcd()));
  CHECK_FALSE(b.sm.load(a.through_etcd()));  // loaded once
  b.clock.advance(StateMachine::kLoadedHoldSeconds - 1);
  b.sm.tick();
  CHECK(b.sm.job_count() == 1);
  b.clock.advance(2);
  b.sm.tick();
  CHECK(b.sm.job_count() == 0);
  CHECK(b.sm.take_changed() == std::vector<std::string>{"job"});
}

TEST_CASE("a corrupt record is refused with what is wrong, never thrown") {
  Replica a;
  a.sm.join(1, spec(1, 2, 2));
  a.sm.join(2, spec(2, 2, 2));
  const json good = json::parse(encode_record(*a.sm.record("job")));
  auto refused = [](const std::string& text, const std::string& words) {
    auto d = decode_record(text);
    REQUIRE_MESSAGE(std::holds_alternative<std::string>(d), text.substr(0, 200));
    CHECK_MESSAGE(std::get<std::string>(d).find(words) != std::string::npos, std::get<std::string>(d));
  };
  auto with = [&](const std::function<void(json&)>& change) {
    json j = good;
    change(j);
    return j.dump();
  };
  refused("", "not a JSON object");
  refused("{\"job_id\":", "not a JSON object");
  refused("[1,2]", "not a JSON object");
  refused(std::string(100, '[') + std::string(100, ']'), "deeper");
  refused(std::string(kMaxRecordBytes + 1, ' '), "over the limit");
  refused(with([](json& j) { j.erase("job_id"); }), "job_id");
  refused(with([](json& j) { j["version"] = 2; }), "version");
  refused(with([](json& j) { j["state"] = "dancing"; }), "state");
  refused(with([](json& j) { j["restarts_used"] = 3; }), "restarts_used");
  refused(with([](json& j) { j["restarts_used"] = "1"; }), "restarts_used");
  refused(with([](json& j) { j["generation"] = -1; }), "generation");
  refused(with([](json& j) { j["max_nodes"] = 1; }), "max_nodes");
  refused(with([](json& j) { j["timeouts"]["heartbeat_timeout"] = -5; }), "heartbeat_timeout");
  refused(with([](json& j) { j["timeouts"] = 7; }), "timeouts");
  refused(with([](json& j) { j["failing"] = true; }), "failing job without any failure");
  refused(with([](json& j) { j["goodput"] = json::array({1, 2}); }), "goodput");
  refused(with([](json& j) { j["goodput"] = json::array({1, 2, 3, 4, 5, 6, 7, -8, 0}); }), "goodput");
  refused(with([](json& j) { j["goodput"] = "97%"; }), "goodput");
  refused(with([](json& j) { j["failures"] = json::array({json{{"rank", "x"}}}); }), "rank");
  refused(with([](json& j) { j.erase("round"); }), "round");
  refused(with([](json& j) { j["round"]["members"].erase(1); }), "lists 1 nodes for a round of 2");
  refused(with([](json& j) { j["round"]["members"][1]["group_rank"] = 0; }), "listed twice");
  refused(with([](json& j) { j["round"]["members"][0]["secret"] = "XYZ"; }), "secret");
  refused(with([](json& j) { j["round"]["world_size"] = 5; }), "sum");
  refused(with([](json& j) { j["round"]["master_port"] = 70000; }), "master_port");
  refused(with([](json& j) { j["round"]["members"] = "all"; }), "members");
  // And the untouched record decodes.
  CHECK(std::holds_alternative<JobRecord>(decode_record(good.dump())));
}
