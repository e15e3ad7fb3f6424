// Resume. The state machine rebuilds a job from its agents' resumes (manual clock, no
// sockets), the decoder refuses every malformed or absurd resume, and a hostile client on a real
// loopback server is refused without disturbing a healthy job.
#include <doctest/doctest.h>

#include <future>
#include <thread>

#include "rendezvous/resume.h"
#include "rendezvous/server.h"
#include "rendezvous/state.h"
#include "tests/rendezvous/raw_conn.h"
#include "tests/rendezvous/recording_outbox.h"

using namespace ddp::rdzv;
using ddp::rdzv::test::RawConn;
using ddp::rdzv::test::RecordingOutbox;

namespace {

NodeSpec spec(const std::string& host, int min_nodes, int max_nodes, int max_restarts = 3) {
  NodeSpec s;
  s.job_id = "job";
  s.host = host;
  s.addr = "10.0.0." + host.substr(host.size() - 1);
  s.local_world_size = 2;
  s.min_nodes = min_nodes;
  s.max_nodes = max_nodes;
  s.max_restarts = max_restarts;
  s.master_port = 30000 + (host.back() - '0');
  s.timeouts.join_timeout = 60;
  s.timeouts.last_call_timeout = 5;
  s.timeouts.heartbeat_timeout = 5;  // also the restore grace period
  return s;
}

WorkerFailure failure(const std::string& host, int rank) {
  WorkerFailure f;
  f.host = host;
  f.rank = rank;
  f.exit_code = 1;
  return f;
}

// What an agent knows after its round: the request it would send on reconnect.
struct Known {
  NodeSpec node;
  Assignment round;
  std::string secret;
  ResumeRequest request() const { return ResumeRequest{node.job_id, secret, node, round}; }
};

// A job of `n` nodes (nnodes MIN:n) run to its first round on a first server, whose state is
// then thrown away (the daemon was killed). Returns what each node knows.
std::vector<Known> run_first_round(int n, int min_nodes, int restarts_before = 0) {
  ManualClock clock;
  RecordingOutbox out;
  StateMachine sm{clock, out};
  std::vector<Known> known;
  for (int i = 1; i <= n; ++i) sm.join(static_cast<ConnId>(i), spec("node" + std::to_string(i), min_nodes, n));
  for (int r = 0; r < restarts_before; ++r) {
    sm.report_failure(1, failure("node1", 0));
    for (int i = 1; i <= n; ++i) sm.join(static_cast<ConnId>(i), spec("node" + std::to_string(i), min_nodes, n));
  }
  for (int i = 1; i <= n; ++i) {
    auto rounds = out.of(static_cast<ConnId>(i), "round");
    REQUIRE_FALSE(rounds.empty());
    Known k;
    k.node = spec("node" + std::to_string(i), min_nodes, n);
    k.round = rounds.back()["assignment"].get<Assignment>();
    k.secret = rounds.back()["assignment"]["secret"].get<std::string>();
    CHECK(k.secret.size() >= kMinSecretChars);
    known.push_back(k);
  }
  return known;
}

// The fresh daemon that comes back.
struct Fresh {
  ManualClock clock;
  RecordingOutbox out;
  StateMachine sm{clock, out};
  nlohmann::json job() const {
    auto jobs = sm.status()["jobs"];
    REQUIRE(jobs.size() == 1);
    return jobs[0];
  }
};

}  // namespace

TEST_CASE("a restarted daemon rebuilds the job from every node's resume and the round goes on unchanged") {
  auto known = run_first_round(3, 3, /*restarts_before=*/1);
  Fresh f;
  for (int i = 0; i < 3; ++i) {
    CHECK(f.out.of(100 + i, "resumed").empty());
    f.sm.resume(100 + i, known[i].request());
    f.clock.advance(0.1);
  }
  for (int i = 0; i < 3; ++i) {
    auto resumed = f.out.of(100 + i, "resumed");
    REQUIRE(resumed.size() == 1);
    CHECK(resumed[0]["generation"] == known[i].round.generation);
    CHECK(resumed[0]["restart_count"] == 1);
    CHECK(f.out.of(100 + i, "restart").empty());
    CHECK(f.out.of(100 + i, "round").empty());
  }
  auto job = f.job();
  CHECK(job["state"] == "running");
  CHECK(job["generation"] == known[0].round.generation);
  CHECK(job["restarts_used"] == 1);
  CHECK(job["rebuilt_from_resumes"] == true);
  CHECK(job["rebuilt_seconds_ago"].get<double>() == doctest::Approx(0.3));
  // The rebuilt job works like any other: every node succeeds, the job succeeds.
  for (int i = 0; i < 3; ++i) f.sm.report_success(100 + i);
  CHECK(f.out.of(100, "job_succeeded").size() == 1);
}

TEST_CASE("a restarted daemon carries the job's goodput account on from the resumes; one node hears the line") {
  auto known = run_first_round(3, 3, /*restarts_before=*/1);
  for (auto& k : known) {
    REQUIRE(k.round.goodput.size() == GoodputTotals::kArraySize);  // the account when the round formed
    CHECK(k.round.goodput.back() == 1);                              // one restart so far
    k.round.round_age = 40;  // the round ran 40 s before the daemon died
  }
  Fresh f;
  for (int i = 0; i < 3; ++i) {
    f.sm.resume(100 + i, known[i].request());
    f.clock.advance(0.1);
  }
  const nlohmann::json g = f.job()["goodput"];
  CHECK(g["wall_seconds"].get<double>() == doctest::Approx(40.3));
  CHECK(g["seconds"]["productive"].get<double>() == doctest::Approx(40.3));
  CHECK(g["restarts"] == 1);
  for (int i = 0; i < 3; ++i) f.sm.report_success(100 + i);
  int told = 0;
  for (int i = 0; i < 3; ++i) {
    auto ends = f.out.of(100 + i, "job_succeeded");
    REQUIRE(ends.size() == 1);
    if (ends[0].contains("goodput")) {
      ++told;
      CHECK(ends[0]["goodput"].get<std::string>().rfind("job job: goodput 100.0% of 40.3 s", 0) == 0);
      CHECK(i == 0);  // group rank 0's node
    }
  }
  CHECK(told == 1);
}

TEST_CASE("a node that does not resume within the grace period is lost: the others form a smaller round") {
  auto known = run_first_round(3, 2);
  Fresh f;
  f.sm.resume(100, known[0].request());
  f.sm.resume(101, known[1].request());
  f.clock.advance(4.9);
  f.sm.tick();
  CHECK(f.out.of(100, "restart").empty());
  f.sm.touch(100);  // the resumed agents heartbeat meanwhile
  f.sm.touch(101);
  f.clock.advance(0.2);
  f.sm.tick();
  auto restart = f.out.of(100, "restart");
  REQUIRE(restart.size() == 1);
  CHECK(restart[0]["counted"] == false);
  CHECK(restart[0]["reason"].get<std::string>().find("did not resume") != std::string::npos);
  f.sm.join(100, known[0].node);
  f.sm.join(101, known[1].node);
  Assignment a = f.out.round(100);
  CHECK(a.group_world_size == 2);
  CHECK(a.generation == known[0].round.generation + 1);
  CHECK(a.restart_count == 0);
  CHECK(f.out.round(101).group_rank != a.group_rank);
}

TEST_CASE("a worker failure reported while restoring is counted exactly once after the restore") {
  auto known = run_first_round(2, 2);
  Fresh f;
  f.sm.resume(100, known[0].request());
  f.sm.report_failure(100, failure("node1", 0));
  f.sm.report_failure(100, failure("node1", 1));  // a second local failure of the same round
  CHECK(f.out.of(100, "restart").empty());
  f.sm.resume(101, known[1].request());
  for (ConnId c : {100, 101}) {
    auto restart = f.out.of(c, "restart");
    REQUIRE(restart.size() == 1);
    CHECK(restart[0]["counted"] == true);
    CHECK(restart[0]["restart_count"] == 1);
  }
  CHECK(f.job()["restarts_used"] == 1);
}

TEST_CASE("a failure while restoring still counts when a node never comes back") {
  auto known = run_first_round(2, 1);
  Fresh f;
  f.sm.resume(100, known[0].request());
  f.sm.report_failure(100, failure("node1", 0));
  f.clock.advance(4);
  f.sm.touch(100);
  f.clock.advance(1.1);
  f.sm.tick();
  auto restart = f.out.of(100, "restart");
  REQUIRE(restart.size() == 1);
  CHECK(restart[0]["counted"] == true);
  CHECK(f.job()["restarts_used"] == 1);
}

TEST_CASE("disagreeing resumes: the newest generation wins and the restart count is never lowered") {
  auto known = run_first_round(2, 2);
  Known old0 = known[0], new0 = known[0], new1 = known[1];
  new0.round.generation = new1.round.generation = known[0].round.generation + 1;
  new1.round.restart_count = 2;  // this node heard of two more counted restarts
  Fresh f;
  f.sm.resume(100, old0.request());  // a node that missed the newer round
  f.sm.resume(101, new1.request());
  auto stale = f.out.of(100, "restart");
  REQUIRE(stale.size() == 1);
  CHECK(stale[0]["counted"] == false);
  f.sm.resume(102, new0.request());  // node1 again, from the newer round (new connection)
  CHECK(f.out.of(101, "resumed").size() == 1);
  CHECK(f.out.of(102, "resumed").size() == 1);
  auto job = f.job();
  CHECK(job["generation"] == new0.round.generation);
  CHECK(job["restarts_used"] == 2);
  // A later resume with a lower count does not lower it either.
  Fresh g;
  Known low = known[0], high = known[1];
  high.round.restart_count = 3;
  g.sm.resume(100, high.request());
  g.sm.resume(101, low.request());
  CHECK(g.job()["restarts_used"] == 3);
  CHECK(g.out.of(100, "resumed")[0]["restart_count"] == 3);
}

TEST_CASE("a stranger with another node's job id and rank but not its secret is refused") {
  auto known = run_first_round(2, 2);
  SUBCASE("on a rebuilt daemon, after the node resumed") {
    Fresh f;
    f.sm.resume(100, known[0].request());
    Known thief = known[0];
    thief.secret = std::string(32, 'a');
    f.sm.resume(200, thief.request());
    REQUIRE(f.out.dropped.count(200));
    CHECK(f.out.dropped[200].code == "resume_refused");
    CHECK_FALSE(f.sm.is_member(200));
    f.sm.resume(101, known[1].request());
    CHECK(f.out.of(100, "resumed").size() == 1);  // the real nodes go on
  }
  SUBCASE("on the daemon that issued the secrets") {
    ManualClock clock;
    RecordingOutbox out;
    StateMachine sm{clock, out};
    sm.join(1, spec("node1", 2, 2));
    sm.join(2, spec("node2", 2, 2));
    Known thief;
    thief.node = spec("node9", 2, 2);
    thief.round = out.round(2);
    thief.secret = std::string(40, 'b');
    sm.resume(200, thief.request());
    REQUIRE(out.dropped.count(200));
    CHECK(out.dropped[200].code == "resume_refused");
    CHECK(out.of(1, "restart").empty());
    CHECK(out.of(2, "restart").empty());
  }
}

TEST_CASE("on a daemon that never went away, a node's new connection replaces its old one without a restart") {
  ManualClock clock;
  RecordingOutbox out;
  StateMachine sm{clock, out};
  sm.join(1, spec("node1", 2, 2));
  sm.join(2, spec("node2", 2, 2));
  Known k{spec("node2", 2, 2), out.round(2), out.of(2, "round").back()["assignment"]["secret"].get<std::string>()};
  sm.resume(20, k.request());
  CHECK(out.of(20, "resumed").size() == 1);
  CHECK(out.dropped.count(2));  // the old connection is closed as replaced
  CHECK(out.of(1, "restart").empty());
  CHECK(sm.is_member(20));
  CHECK_FALSE(sm.is_member(2));
  sm.disconnected(2, "old socket closed");  // its close is no loss any more
  CHECK(out.of(1, "restart").empty());
}

TEST_CASE("a node resuming a round that has ended is told to restart and can join the next round") {
  ManualClock clock;
  RecordingOutbox out;
  StateMachine sm{clock, out};
  sm.join(1, spec("node1", 1, 2));
  sm.join(2, spec("node2", 1, 2));
  Known k{spec("node2", 1, 2), out.round(2), out.of(2, "round").back()["assignment"]["secret"].get<std::string>()};
  sm.disconnected(2, "network cut");  // lost: node1 restarts and runs alone
  sm.join(1, spec("node1", 1, 2));
  REQUIRE(out.round(1).group_world_size == 1);
  sm.resume(20, k.request());
  auto restart = out.of(20, "restart");
  REQUIRE(restart.size() == 1);
  CHECK(restart[0]["counted"] == false);
  sm.join(20, spec("node2", 1, 2));
  sm.join(1, spec("node1", 1, 2));
  CHECK(out.round(20).group_world_size == 2);
}

TEST_CASE("decode_resume refuses garbage, wrong types and absurd values with bad_resume") {
  auto known = run_first_round(2, 2);
  const nlohmann::json good = make_resume(known[1].request());
  auto decoded = decode_resume(good);
  REQUIRE(std::holds_alternative<ResumeRequest>(decoded));
  CHECK(std::get<ResumeRequest>(decoded).assignment.group_rank == 1);

  // A resume message goes through the codec, as the server decodes it: every refusal is
  // bad_resume. What is not even a resume message is refused by decode_resume itself.
  auto refused = [](const nlohmann::json& m) {
    if (!m.is_object() || !m.contains("type")) return std::holds_alternative<std::string>(decode_resume(m));
    const Decoded d = decode(m.dump());
    if (!d.error) return false;
    CHECK(d.error->code == "bad_resume");
    return true;
  };
  auto with = [&](const std::string& pointer, const nlohmann::json& value) {
    nlohmann::json m = good;
    m[nlohmann::json::json_pointer(pointer)] = value;
    return m;
  };
  CHECK(refused(nlohmann::json::array()));
  CHECK(refused({{"type", "resume"}}));
  CHECK(refused({{"type", "resume"}, {"resume", "x"}}));
  CHECK(refused(with("/resume/secret", "short")));
  CHECK(refused(with("/resume/secret", std::string(64, 'Z'))));
  CHECK(refused(with("/resume/secret", std::string(4096, 'a'))));
  CHECK(refused(with("/resume/secret", 42)));
  CHECK(refused(with("/resume/job_id", "")));
  CHECK(refused(with("/resume/job_id", "another-job")));
  CHECK(refused(with("/resume/assignment/generation", 0)));
  CHECK(refused(with("/resume/assignment/generation", -1)));
  CHECK(refused(with("/resume/assignment/generation", 18446744073709551615ULL)));
  CHECK(refused(with("/resume/assignment/generation", 1.5)));
  CHECK(refused(with("/resume/assignment/generation", "1")));
  CHECK(refused(with("/resume/assignment/group_rank", 2)));
  CHECK(refused(with("/resume/assignment/group_rank", -1)));
  CHECK(refused(with("/resume/assignment/group_world_size", 3)));  // above nnodes MAX
  CHECK(refused(with("/resume/assignment/world_size", 1)));        // below local_world_size
  CHECK(refused(with("/resume/assignment/world_size", 1e30)));
  CHECK(refused(with("/resume/assignment/rank_offset", 1000)));
  CHECK(refused(with("/resume/assignment/restart_count", 4)));     // above the budget
  CHECK(refused(with("/resume/assignment/restart_count", -2)));
  CHECK(refused(with("/resume/assignment/max_restarts", 99)));     // differs from the policy
  CHECK(refused(with("/resume/assignment/master_port", 70000)));
  CHECK(refused(with("/resume/assignment/master_addr", nullptr)));
  CHECK(refused(with("/resume/node/min_nodes", 0)));
  CHECK(refused(with("/resume/node/max_nodes", 2147483647)));
  CHECK(refused(with("/resume/node/local_world_size", 0)));
  CHECK(refused(with("/resume/node/timeouts/heartbeat_timeout", -1)));
  CHECK(refused(with("/resume/node/timeouts/join_timeout", 1e300)));
  CHECK(refused(with("/resume/node/timeouts", "soon")));
  CHECK(refused(with("/resume/node/env_check", "lenient")));
  CHECK(refused(with("/resume/node/fingerprint", 7)));
  CHECK(refused(with("/resume/node/host", std::string(5000, 'h'))));
  CHECK(refused(with("/resume/node", nlohmann::json::array({1, 2}))));
  CHECK(refused(with("/resume/assignment", nullptr)));
  CHECK(refused(with("/resume/assignment/goodput", nlohmann::json::array({1, 2}))));
  CHECK(refused(with("/resume/assignment/goodput", nlohmann::json::array({1, 2, 3, 4, 5, 6, 7, -8, 0}))));
  CHECK(refused(with("/resume/assignment/goodput", nlohmann::json::array({1, 2, 3, 4, 5, 6, 7, 8, 0.5}))));
  CHECK(refused(with("/resume/assignment/goodput", nlohmann::json::array({1e300, 0, 0, 0, 0, 0, 0, 0, 0}))));
  CHECK(refused(with("/resume/assignment/goodput", "97%")));
  CHECK(refused(with("/resume/assignment/round_age", -1)));
  CHECK(refused(with("/resume/assignment/round_age", 1e300)));
  CHECK(refused(with("/resume/assignment/round_age", "old")));
}

namespace {

struct ServerThread {
  boost::asio::io_context io{1};
  std::unique_ptr<Server> server;
  std::thread thread;
  explicit ServerThread(ServerOptions options) {
    server = std::make_unique<Server>(
        io, boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0), options);
    thread = std::thread([this] { io.run(); });
  }
  ~ServerThread() {
    boost::asio::post(io, [this] { server->stop(); io.stop(); });
    thread.join();
  }
  unsigned short port() const { return server->port(); }
};

// A one-node job's node, watched loosely enough for a test's pauses.
NodeSpec one_node() {
  NodeSpec s = spec("node1", 1, 1);
  s.timeouts.heartbeat_timeout = 30;
  return s;
}

// Says hello on `conn` (proving `token` when not empty), joins `s` and returns its round.
nlohmann::json first_round(RawConn& conn, const NodeSpec& s, const std::string& token = "") {
  REQUIRE(conn.connected());
  REQUIRE(conn.say_hello("job", token));
  REQUIRE(conn.recv_type("welcome"));
  conn.send(make_join(s));
  auto round = conn.recv_type("round");
  REQUIRE(round);
  return *round;
}

}  // namespace

TEST_CASE("a hostile client's resume is refused on a real server and a healthy job goes on") {
  ServerThread st({});
  // A healthy one-node job with its round.
  RawConn healthy(st.port());
  const NodeSpec s = one_node();
  const auto round = first_round(healthy, s);
  Known k{s, round["assignment"].get<Assignment>(), round["assignment"]["secret"].get<std::string>()};

  auto expect_refused = [&](const nlohmann::json& message, const std::string& code) {
    RawConn bad(st.port());
    REQUIRE(bad.connected());
    bad.say_hello("job");
    REQUIRE(bad.recv_type("welcome"));
    bad.send(message);
    auto err = bad.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == code);
    CHECK(bad.wait_closed());
  };
  expect_refused({{"type", "resume"}, {"resume", {{"job_id", 1}}}}, "bad_resume");
  expect_refused({{"type", "resume"}, {"resume", nlohmann::json::array({nullptr, 1e308})}}, "bad_resume");
  nlohmann::json absurd = make_resume(k.request());
  absurd["resume"]["assignment"]["generation"] = -7;
  expect_refused(absurd, "bad_resume");
  absurd = make_resume(k.request());
  absurd["resume"]["node"]["max_nodes"] = 1e12;
  expect_refused(absurd, "bad_resume");
  Known thief = k;
  thief.secret = std::string(32, 'f');
  expect_refused(make_resume(thief.request()), "resume_refused");
  Known other_job = k;
  other_job.node.job_id = other_job.round.master_addr = "other";
  nlohmann::json m = make_resume(other_job.request());
  m["resume"]["job_id"] = "other";
  expect_refused(m, "bad_resume");  // hello named "job"

  // The healthy node is untouched: still a member, heartbeats answered, no restart.
  healthy.send(make_heartbeat());
  auto next = healthy.recv(5.0);
  REQUIRE(next);
  CHECK((*next)["type"] == "heartbeat_ack");
}

TEST_CASE("with a secret a node secret crosses the wire sealed per connection and a replayed sealed value is refused") {
  ServerOptions options;
  options.token = "cluster-secret";
  ServerThread st(options);
  RawConn node(st.port());
  const NodeSpec s = one_node();
  const auto round = first_round(node, s, options.token);
  const std::string on_the_wire = round["assignment"]["secret"].get<std::string>();
  const std::string secret = seal_hex(node.seal_key, on_the_wire);
  CHECK(secret != on_the_wire);
  CHECK(secret.size() == on_the_wire.size());

  // Someone who captured the round and holds the cluster secret replays the value as it was sent:
  // on their own connection it opens to something else, and the rank is not theirs.
  Known k{s, round["assignment"].get<Assignment>(), on_the_wire};
  k.round.secret.clear();
  {
    RawConn replay(st.port());
    REQUIRE(replay.say_hello("job", options.token));
    REQUIRE(replay.recv_type("welcome"));
    replay.send(make_resume(k.request()));
    auto err = replay.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "resume_refused");
  }
  // The node itself, on a new connection, seals its secret under that connection's key: resumed.
  RawConn again(st.port());
  REQUIRE(again.say_hello("job", options.token));
  REQUIRE(again.recv_type("welcome"));
  k.secret = seal_hex(again.seal_key, secret);
  CHECK(k.secret != on_the_wire);
  again.send(make_resume(k.request()));
  CHECK(again.recv_type("resumed"));
}
