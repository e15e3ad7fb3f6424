// State-machine unit tests: every transition and deadline, on a manual clock (no sockets, no sleep).
#include <doctest/doctest.h>

#include <algorithm>

#include "rendezvous/env_check.h"
#include "rendezvous/state.h"
#include "tests/rendezvous/recording_outbox.h"

using namespace ddp::rdzv;
using ddp::rdzv::test::EventOutbox;
using ddp::rdzv::test::RecordingOutbox;

namespace {

NodeSpec spec(const std::string& host, int min_nodes, int max_nodes, int workers = 1, const std::string& job = "job") {
  NodeSpec s;
  s.job_id = job;
  s.host = host;
  s.addr = "10.0.0." + host.substr(host.size() - 1);
  s.local_world_size = workers;
  s.min_nodes = min_nodes;
  s.max_nodes = max_nodes;
  s.master_port = 30000 + (host.back() - '0');
  s.timeouts.join_timeout = 60;
  s.timeouts.last_call_timeout = 5;
  s.timeouts.heartbeat_timeout = 1000;  // the heartbeat tests set their own
  return s;
}

struct Fixture {
  ManualClock clock;
  RecordingOutbox out;
  StateMachine sm{clock, out};
};

WorkerFailure failure(const std::string& host, int rank, int code) {
  WorkerFailure f;
  f.host = host;
  f.rank = rank;
  f.local_rank = 0;
  f.exit_code = code;
  return f;
}

}  // namespace

TEST_CASE("a round completes at MAX nodes with ranks 0..n-1, rank offsets and rank 0 as master") {
  Fixture f;
  f.sm.join(1, spec("node1", 3, 3, 2));
  f.sm.join(2, spec("node2", 3, 3, 4));
  CHECK(f.out.of(1, "round").empty());
  f.sm.join(3, spec("node3", 3, 3, 1));
  Assignment a1 = f.out.round(1), a2 = f.out.round(2), a3 = f.out.round(3);
  CHECK(a1.generation == 1);
  CHECK(a1.group_rank == 0);
  CHECK(a2.group_rank == 1);
  CHECK(a3.group_rank == 2);
  CHECK(a1.rank_offset == 0);
  CHECK(a2.rank_offset == 2);
  CHECK(a3.rank_offset == 6);
  for (const Assignment& a : {a1, a2, a3}) {
    CHECK(a.world_size == 7);
    CHECK(a.group_world_size == 3);
    CHECK(a.master_addr == "10.0.0.1");
    CHECK(a.master_port == 30001);
    CHECK(a.restart_count == 0);
  }
}

TEST_CASE("each node's round message is its own assignment, with nothing left from the node before") {
  Fixture f;
  // Connection 2 has no key to seal under (a server leaves the secret out then); 1 and 3 do.
  f.sm.set_secret_seal([](ConnId conn, const std::string& secret) {
    return conn == 2 ? std::string() : "sealed" + std::to_string(conn) + ":" + secret;
  });
  f.sm.join(1, spec("node1", 3, 3, 2));
  f.sm.join(2, spec("node2", 3, 3, 4));
  f.sm.join(3, spec("node3", 3, 3, 1));
  const Assignment a1 = f.out.round(1), a2 = f.out.round(2), a3 = f.out.round(3);
  CHECK(a1.secret.rfind("sealed1:", 0) == 0);
  CHECK(f.out.of(2, "round").at(0)["assignment"].count("secret") == 0);
  CHECK(a3.secret.rfind("sealed3:", 0) == 0);
  CHECK(a1.secret.substr(8) != a3.secret.substr(8));
  for (const Assignment& a : {a1, a2, a3}) {
    // The same message as encoding the node's assignment on its own.
    CHECK(f.out.of(static_cast<ConnId>(a.group_rank + 1), "round").at(0) == to_json(make_round(a)));
  }
  CHECK(a3.group_rank == 2);
  CHECK(a3.rank_offset == 6);
}

TEST_CASE("with MIN:MAX a round completes at MIN only after last_call_timeout") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 4));
  f.sm.join(2, spec("node2", 2, 4));
  f.clock.advance(4.9);
  f.sm.tick();
  CHECK(f.out.of(1, "round").empty());
  f.clock.advance(0.2);
  f.sm.tick();
  CHECK(f.out.round(1).group_world_size == 2);
  CHECK(f.out.round(2).group_world_size == 2);
}

TEST_CASE("waiting nodes hear how many joined and how long is left, at most once a second") {
  Fixture f;
  auto spec = [](const std::string& host, int min_nodes, int max_nodes) {
    NodeSpec s = ::spec(host, min_nodes, max_nodes);
    s.progress = true;
    return s;
  };
  f.sm.join(1, spec("node1", 2, 3));
  CHECK(f.out.of(1, "waiting").empty());  // from tick(), not from inside join()
  f.clock.advance(0.5);
  f.sm.tick();
  auto w = f.out.of(1, "waiting");
  REQUIRE(w.size() == 1);
  CHECK(w[0]["waiting"] == 1);
  CHECK(w[0]["min_nodes"] == 2);
  CHECK(w[0]["max_nodes"] == 3);
  CHECK(w[0]["join_left"].get<double>() == doctest::Approx(59.5));
  CHECK_FALSE(w[0].contains("last_call_left"));
  f.sm.tick();  // nothing changed: nothing sent
  CHECK(f.out.of(1, "waiting").size() == 1);
  f.sm.join(2, spec("node2", 2, 3));  // MIN reached: the last call runs
  f.clock.advance(0.2);
  f.sm.tick();  // within a second of the last notice: held back
  CHECK(f.out.of(2, "waiting").empty());
  f.clock.advance(1.0);
  f.sm.tick();
  for (ConnId c : {1, 2}) {
    auto last = f.out.of(c, "waiting");
    REQUIRE_FALSE(last.empty());
    CHECK(last.back()["waiting"] == 2);
    CHECK_FALSE(last.back().contains("join_left"));
    CHECK(last.back()["last_call_left"].get<double>() == doctest::Approx(5.0 - 1.2));
  }
  f.out.clear();
  f.sm.join(3, spec("node3", 2, 3));  // MAX: the round completes, no more waiting notices
  f.clock.advance(2);
  f.sm.tick();
  CHECK(f.out.round(3).group_world_size == 3);
  for (ConnId c : {1, 2, 3}) CHECK(f.out.of(c, "waiting").empty());
}

TEST_CASE("a node that did not ask for waiting notices (an older agent) gets none") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));  // progress false, as an agent before sends it
  NodeSpec asks = spec("node2", 2, 2);
  asks.progress = true;
  f.clock.advance(0.5);
  f.sm.tick();
  CHECK(f.out.of(1, "waiting").empty());
  f.sm.leave(1);
  f.sm.join(3, asks);
  f.clock.advance(0.5);
  f.sm.tick();
  CHECK(f.out.of(3, "waiting").size() == 1);
}

TEST_CASE("a node arriving during last call is included in the round") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 4));
  f.sm.join(2, spec("node2", 2, 4));
  f.clock.advance(3);
  f.sm.join(3, spec("node3", 2, 4));
  f.clock.advance(2.1);
  f.sm.tick();
  CHECK(f.out.round(3).group_world_size == 3);
}

TEST_CASE("fewer than MIN nodes for join_timeout fails the waiting nodes and forgets the job") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  f.clock.advance(30);
  f.sm.touch(1);
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  f.clock.advance(2);
  f.sm.touch(1);
  f.clock.advance(29);
  f.sm.touch(1);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(1) == 1);
  CHECK(f.out.dropped[1].code == "join_timeout");
  CHECK(f.out.dropped[1].message.find("1 of MIN 2") != std::string::npos);
  CHECK(f.sm.job_count() == 0);
  CHECK(f.sm.node_count() == 0);
}

TEST_CASE("a closed connection ends the round; survivors restart uncounted and keep their ranks") {
  Fixture f;
  for (ConnId c = 1; c <= 3; ++c) f.sm.join(c, spec("node" + std::to_string(c), 2, 3));
  REQUIRE(f.out.round(2).group_rank == 1);
  f.out.clear();
  f.sm.disconnected(1, "connection closed by peer");
  for (ConnId c : {2, 3}) {
    auto restarts = f.out.of(c, "restart");
    REQUIRE(restarts.size() == 1);
    CHECK(restarts[0]["counted"] == false);
    CHECK(restarts[0]["reason"].get<std::string>().find("node1") != std::string::npos);
  }
  f.sm.join(2, spec("node2", 2, 3));
  CHECK(f.out.of(2, "round").empty());  // node3 has not rejoined yet
  f.sm.join(3, spec("node3", 2, 3));
  // Every surviving node is back: no last call needed after the first round.
  Assignment a2 = f.out.round(2), a3 = f.out.round(3);
  CHECK(a2.generation == 2);
  CHECK(a2.group_rank == 1);  // survivor kept its rank
  CHECK(a3.group_rank == 0);  // rank 2 no longer fits in 2 nodes: lowest free rank
  CHECK(a3.rank_offset == 0);
  CHECK(a2.rank_offset == 1);
  CHECK(a2.master_addr == "10.0.0.3");
  CHECK(a2.restart_count == 0);
}

TEST_CASE("a node that stops heartbeating is dropped after heartbeat_timeout and the others restart") {
  Fixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  s1.timeouts.heartbeat_timeout = s2.timeouts.heartbeat_timeout = 3;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.out.clear();
  f.clock.advance(2);
  f.sm.touch(1);
  f.clock.advance(1.0);  // node2 silent for 3.0 s: not yet past the timeout
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  f.clock.advance(0.05);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(2) == 1);
  CHECK(f.out.dropped[2].code == "heartbeat_timeout");
  REQUIRE(f.out.of(1, "restart").size() == 1);
  CHECK(f.out.of(1, "restart")[0]["counted"] == false);
  f.sm.join(1, s1);
  CHECK(f.out.round(1).group_world_size == 1);
}

TEST_CASE("a stall of the server itself costs no node its place; a node silent beyond it is dropped that much later") {
  Fixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  s1.timeouts.heartbeat_timeout = s2.timeouts.heartbeat_timeout = 3;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.out.clear();
  f.clock.advance(1);
  f.sm.touch(1);
  f.sm.touch(2);
  f.clock.advance(10);  // the server did not run: both nodes' heartbeats wait unread
  f.sm.stalled(10);
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  f.sm.touch(1);  // node1's waiting heartbeats are read; node2 really went silent
  f.clock.advance(2.9);
  f.sm.tick();
  CHECK(f.out.dropped.empty());  // node2: 3.0 s of silence while the server ran, not past the timeout
  f.sm.touch(1);
  f.clock.advance(0.2);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(2) == 1);
  CHECK(f.out.dropped[2].code == "heartbeat_timeout");
  CHECK(f.out.dropped.count(1) == 0);
}

TEST_CASE("when fewer than MIN survive, the survivors wait for nodes until join_timeout") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  f.sm.join(2, spec("node2", 2, 2));
  f.sm.disconnected(2, "closed");
  f.sm.join(1, spec("node1", 2, 2));
  f.clock.advance(59);
  f.sm.touch(1);
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  SUBCASE("a new node arrives in time") {
    f.sm.join(3, spec("node3", 2, 2));
    CHECK(f.out.round(1).generation == 2);
    CHECK(f.out.round(1).group_rank == 0);
    CHECK(f.out.round(3).group_rank == 1);
  }
  SUBCASE("nobody comes") {
    f.clock.advance(1.5);
    f.sm.touch(1);
    f.sm.tick();
    REQUIRE(f.out.dropped.count(1) == 1);
    CHECK(f.out.dropped[1].code == "join_timeout");
  }
}

TEST_CASE("a new node while fewer than MAX run restarts the round uncounted and joins the next one") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 3));
  f.sm.join(2, spec("node2", 2, 3));
  f.clock.advance(5);
  f.sm.tick();
  REQUIRE(f.out.round(1).generation == 1);
  f.out.clear();
  f.sm.join(3, spec("node3", 2, 3));
  for (ConnId c : {1, 2}) {
    REQUIRE(f.out.of(c, "restart").size() == 1);
    CHECK(f.out.of(c, "restart")[0]["counted"] == false);
  }
  f.sm.join(1, spec("node1", 2, 3));
  f.sm.join(2, spec("node2", 2, 3));
  CHECK(f.out.round(3).group_rank == 2);
  CHECK(f.out.round(1).group_rank == 0);
  CHECK(f.out.round(2).group_rank == 1);
  CHECK(f.out.round(1).generation == 2);
  CHECK(f.out.round(1).restart_count == 0);
}

TEST_CASE("a new node while MAX run waits as a standby and enters after a loss") {
  Fixture f;
  f.sm.join(1, spec("node1", 1, 2));
  f.sm.join(2, spec("node2", 1, 2));
  f.out.clear();
  f.sm.join(3, spec("node3", 1, 2));
  CHECK(f.out.of(1, "restart").empty());
  CHECK(f.out.of(3, "round").empty());
  f.sm.disconnected(2, "closed");
  f.sm.join(1, spec("node1", 1, 2));
  CHECK(f.out.round(1).group_rank == 0);
  CHECK(f.out.round(3).group_rank == 1);
  CHECK(f.out.round(3).generation == 2);
}

TEST_CASE("a worker failure within budget restarts every node, counted once per job") {
  Fixture f;
  NodeSpec s1 = spec("node1", 2, 2), s2 = spec("node2", 2, 2);
  s1.max_restarts = s2.max_restarts = 3;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.out.clear();
  f.sm.report_failure(2, failure("node2", 1, 7));
  f.sm.report_failure(1, failure("node1", 0, 1));  // the same round's second failure: ignored
  for (ConnId c : {1, 2}) {
    auto r = f.out.of(c, "restart");
    REQUIRE(r.size() == 1);
    CHECK(r[0]["counted"] == true);
    CHECK(r[0]["restart_count"] == 1);
    // Two nodes of one host are told apart by their group rank.
    const std::string reason = r[0]["reason"];
    CHECK(reason.find("on host node2 [group rank ") != std::string::npos);
    CHECK(reason.find("] exited with code 7") != std::string::npos);
  }
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  CHECK(f.out.round(1).restart_count == 1);
  CHECK(f.out.round(2).restart_count == 1);
  CHECK(f.out.round(1).max_restarts == 3);
}

TEST_CASE("a worker failure with the budget spent fails the job everywhere with the first failure") {
  Fixture f;
  NodeSpec s1 = spec("node1", 2, 3), s2 = spec("node2", 2, 3), s3 = spec("node3", 2, 3);
  s1.max_restarts = s2.max_restarts = s3.max_restarts = 1;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.clock.advance(5);
  f.sm.tick();
  f.sm.report_failure(1, failure("node1", 0, 1));
  f.sm.join(3, s3);  // arrives while gathering: part of the next round
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  REQUIRE(f.out.round(3).restart_count == 1);
  f.out.clear();
  WorkerFailure w = failure("node2", 1, 0);
  w.signal = 9;
  f.sm.report_failure(2, w);
  // The verdict waits until every node of the failing round has stopped its workers (rejoined).
  for (ConnId c : {1, 2, 3}) {
    auto r = f.out.of(c, "restart");
    REQUIRE(r.size() == 1);
    CHECK(r[0]["counted"] == false);
    CHECK(f.out.of(c, "job_failed").empty());
  }
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  CHECK(f.out.of(1, "job_failed").empty());
  f.sm.join(3, s3);
  for (ConnId c : {1, 2, 3}) {
    auto failed = f.out.of(c, "job_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0]["failure"]["host"] == "node2");
    CHECK(failed[0]["failure"]["signal"] == 9);
    std::string summary = failed[0]["summary"];
    CHECK(summary.find("signal 9") != std::string::npos);
    CHECK(summary.find("1 of 1 restarts") != std::string::npos);
    CHECK(summary.find("on host node2 [group rank 1]") != std::string::npos);  // rank 1 ran there
  }
  // Finished nodes leaving are not losses, and the job is then forgotten.
  f.out.clear();
  f.sm.disconnected(1, "closed");
  CHECK(f.out.of(2, "restart").empty());
  f.sm.disconnected(2, "closed");
  f.sm.disconnected(3, "closed");
  CHECK(f.sm.job_count() == 0);
}

TEST_CASE("when every node of the round succeeded the job succeeded everywhere") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  f.sm.join(2, spec("node2", 2, 2));
  f.sm.report_success(1);
  CHECK(f.out.of(1, "job_succeeded").empty());
  f.sm.disconnected(1, "closed");  // done: not a loss
  CHECK(f.out.of(2, "restart").empty());
  f.sm.report_success(2);
  CHECK(f.out.of(2, "job_succeeded").size() == 1);
  f.sm.join(3, spec("node3", 2, 2));
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped[3].code == "job_closed");
  f.sm.disconnected(2, "closed");
  CHECK(f.sm.job_count() == 0);
}

TEST_CASE("host names compare in natural order: numbers as numbers") {
  CHECK(natural_less("node7", "node66"));
  CHECK_FALSE(natural_less("node66", "node7"));
  CHECK(natural_less("node9", "node10"));
  CHECK(natural_less("gpu-2-rack1", "gpu-10-rack1"));
  CHECK(natural_less("gpu-2-rack1", "gpu-2-rack3"));
  CHECK(natural_less("a", "b"));
  CHECK(natural_less("node", "node1"));
  CHECK(natural_less("node1", "node1a"));
  CHECK_FALSE(natural_less("node7", "node7"));
  CHECK(natural_less("node07", "node7") != natural_less("node7", "node07"));  // a total order
  CHECK(natural_less("node7", "node008"));
}

TEST_CASE("new nodes take group ranks in natural host order; survivors keep theirs") {
  Fixture f;
  f.sm.join(1, spec("node66", 3, 4));
  f.sm.join(2, spec("node7", 3, 4));
  f.sm.join(3, spec("node10", 3, 4));
  f.clock.advance(5);
  f.sm.tick();  // last call ends: a round of 3
  CHECK(f.out.round(2).group_rank == 0);
  CHECK(f.out.round(3).group_rank == 1);
  CHECK(f.out.round(1).group_rank == 2);
  // node1 joins later: the running nodes keep their ranks, it takes the free one.
  f.out.clear();
  f.sm.join(4, spec("node1", 3, 4));
  for (ConnId c : {1, 2, 3}) f.sm.join(c, spec(c == 1 ? "node66" : c == 2 ? "node7" : "node10", 3, 4));
  CHECK(f.out.round(2).group_rank == 0);
  CHECK(f.out.round(3).group_rank == 1);
  CHECK(f.out.round(1).group_rank == 2);
  CHECK(f.out.round(4).group_rank == 3);
}

TEST_CASE("--node_rank is honoured; a taken or out-of-range rank is refused clearly") {
  Fixture f;
  NodeSpec a = spec("node1", 3, 3), b = spec("node2", 3, 3), c = spec("node3", 3, 3);
  a.requested_rank = 2;
  b.requested_rank = 0;
  f.sm.join(1, a);
  NodeSpec dup = spec("node4", 3, 3);
  dup.requested_rank = 2;
  f.sm.join(4, dup);
  REQUIRE(f.out.dropped.count(4) == 1);
  CHECK(f.out.dropped[4].code == "rank_conflict");
  CHECK(f.out.dropped[4].message.find("node1") != std::string::npos);
  NodeSpec far = spec("node5", 3, 3);
  far.requested_rank = 3;
  f.sm.join(5, far);
  REQUIRE(f.out.dropped.count(5) == 1);
  CHECK(f.out.dropped[5].code == "bad_join");
  f.sm.join(2, b);
  f.sm.join(3, c);
  CHECK(f.out.round(1).group_rank == 2);
  CHECK(f.out.round(2).group_rank == 0);
  CHECK(f.out.round(3).group_rank == 1);
}

TEST_CASE("--node_rank is bounded by MAX nodes; in a round too small for it the node takes a free rank") {
  Fixture f;
  NodeSpec a = spec("node1", 1, 3), b = spec("node2", 1, 3);
  a.requested_rank = 2;  // >= MIN, < MAX: accepted (the launcher bounds it the same way)
  f.sm.join(1, a);
  f.sm.join(2, b);
  CHECK(f.out.dropped.count(1) == 0);
  f.clock.advance(5);
  f.sm.tick();  // last call: a round of 2 cannot have group rank 2
  CHECK(f.out.round(1).group_rank == 0);
  CHECK(f.out.round(2).group_rank == 1);
  NodeSpec c = spec("node3", 1, 3);
  c.requested_rank = 3;
  f.sm.join(3, c);
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped[3].message.find("0..2") != std::string::npos);
}

TEST_CASE("a join with another --nnodes than the job's is refused") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  f.sm.join(2, spec("node2", 3, 3));
  REQUIRE(f.out.dropped.count(2) == 1);
  CHECK(f.out.dropped[2].code == "nnodes_mismatch");
  CHECK(f.sm.node_count() == 1);
}

TEST_CASE("a node leaving on purpose ends the round uncounted and the job goes on smaller") {
  Fixture f;
  f.sm.join(1, spec("node1", 1, 2));
  f.sm.join(2, spec("node2", 1, 2));
  f.out.clear();
  f.sm.leave(2);
  REQUIRE(f.out.of(1, "restart").size() == 1);
  CHECK(f.out.of(1, "restart")[0]["counted"] == false);
  CHECK(f.out.of(1, "restart")[0]["reason"].get<std::string>().find("left") != std::string::npos);
  f.sm.join(1, spec("node1", 1, 2));
  CHECK(f.out.round(1).group_world_size == 1);
}

TEST_CASE("the round check can refuse a round and every member hears why") {
  ManualClock clock;
  RecordingOutbox out;
  std::size_t checked = 0;
  StateMachine sm(clock, out, [&](const std::string& job, const std::vector<CheckedNode>& members) {
    checked = members.size();
    return std::optional<std::string>("torch 1.13 on node1 differs from torch 2.1 on node2");
  });
  sm.join(1, spec("node1", 2, 2));
  sm.join(2, spec("node2", 2, 2));
  CHECK(checked == 2);
  for (ConnId c : {1, 2}) {
    REQUIRE(out.dropped.count(c) == 1);
    CHECK(out.dropped[c].code == "round_refused");
    CHECK(out.dropped[c].message.find("torch 1.13") != std::string::npos);
  }
  CHECK(sm.job_count() == 0);
}

TEST_CASE("jobs are independent: a failure in one job does not touch another") {
  Fixture f;
  f.sm.join(1, spec("node1", 1, 1, 1, "a"));
  f.sm.join(2, spec("node2", 1, 1, 1, "b"));
  f.out.clear();
  f.sm.report_failure(1, failure("node1", 0, 1));
  f.sm.join(1, spec("node1", 1, 1, 1, "a"));  // stopped its workers: the verdict comes
  CHECK(f.out.of(1, "job_failed").size() == 1);
  CHECK(f.out.sent.count(2) == 0);
  auto status = f.sm.status();
  REQUIRE(status["jobs"].size() == 2);
  CHECK(status["jobs"][0]["state"] == "failed");
  CHECK(status["jobs"][1]["state"] == "running");
  CHECK(status["jobs"][1]["nodes"][0]["group_rank"] == 0);
  CHECK(status["jobs"][1]["nodes"][0]["host"] == "node2");
}

TEST_CASE("the root cause of a failed job is the failure that explains the others, not the first report") {
  // Node 2's worker is killed by SIGKILL; its peer on node 1 fails in the next collective and
  // node 1's report arrives first. Every node must hear of the SIGKILL.
  Fixture f;
  NodeSpec s1 = spec("node1", 2, 2), s2 = spec("node2", 2, 2);
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.out.clear();
  WorkerFailure peer = failure("node1", 0, 1);
  peer.timestamp = 100.2;
  WorkerFailure victim = failure("node2", 1, 0);
  victim.signal = 9;
  victim.timestamp = 100.5;  // reaped late: its agent was busy
  f.sm.report_failure(1, peer);
  f.sm.join(1, s1);             // node 1 stopped and rejoined: no verdict while node 2 runs on
  CHECK(f.out.of(1, "job_failed").empty());
  f.sm.report_failure(2, victim);
  f.sm.join(2, s2);
  for (ConnId c : {1, 2}) {
    auto failed = f.out.of(c, "job_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0]["failure"]["host"] == "node2");
    CHECK(failed[0]["failure"]["signal"] == 9);
  }
  CHECK(f.sm.status()["jobs"][0]["state"] == "failed");
}

TEST_CASE("among failures of one kind the earliest is the root cause; a node lost while failing is not waited for") {
  Fixture f;
  NodeSpec s1 = spec("node1", 3, 3), s2 = spec("node2", 3, 3), s3 = spec("node3", 3, 3);
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.sm.join(3, s3);
  WorkerFailure late = failure("node1", 0, 1), early = failure("node2", 1, 3);
  late.timestamp = 50;
  early.timestamp = 40;
  f.sm.report_failure(1, late);
  f.sm.report_failure(2, early);
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  CHECK(f.out.of(1, "job_failed").empty());
  f.sm.disconnected(3, "closed");  // crashed while stopping: the verdict does not wait for it
  for (ConnId c : {1, 2}) {
    auto failed = f.out.of(c, "job_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0]["failure"]["host"] == "node2");
    CHECK(failed[0]["failure"]["exit_code"] == 3);
  }
}

TEST_CASE("a node joining a failing job does not start a round") {
  Fixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  f.sm.join(1, s1);
  f.clock.advance(5);
  f.sm.tick();
  REQUIRE(f.out.round(1).generation == 1);
  f.sm.report_failure(1, failure("node1", 0, 1));
  f.sm.join(2, s2);  // a newcomer while node 1 is still stopping
  f.clock.advance(10);
  f.sm.tick();
  CHECK(f.out.of(2, "round").empty());
  f.sm.join(1, s1);
  CHECK(f.out.of(1, "job_failed").size() == 1);
  CHECK(f.out.of(2, "job_failed").size() == 1);
  CHECK(f.out.of(2, "round").empty());
}

TEST_CASE("a fatal failure report fails an elastic job everywhere with its reason, whatever the budget") {
  Fixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  s1.max_restarts = s2.max_restarts = 5;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  REQUIRE(f.out.round(1).generation == 1);
  f.out.clear();
  WorkerFailure w = failure("node2", 1, 3);
  w.fatal = "worker 1 exited with code 3, which --no_restart_exit_codes lists: not restarting";
  f.sm.report_failure(2, w);
  // Every node stops its workers (an uncounted restart); the verdict waits for them, and the
  // surviving node alone (MIN is 1) is not given a new round.
  for (ConnId c : {1, 2}) {
    auto r = f.out.of(c, "restart");
    REQUIRE(r.size() == 1);
    CHECK(r[0]["counted"] == false);
    CHECK(r[0]["reason"].get<std::string>().find("--no_restart_exit_codes") != std::string::npos);
  }
  f.sm.join(1, s1);
  f.clock.advance(60);
  f.sm.tick();
  CHECK(f.out.of(1, "round").empty());
  CHECK(f.out.of(1, "job_failed").empty());
  f.sm.join(2, s2);
  for (ConnId c : {1, 2}) {
    auto failed = f.out.of(c, "job_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0]["failure"]["host"] == "node2");
    CHECK(failed[0]["failure"]["exit_code"] == 3);
    CHECK(failed[0]["summary"] == "job job failed: " + w.fatal);
  }
  CHECK(f.sm.status()["jobs"][0]["restarts_used"] == 0);
}

TEST_CASE("a fatal report from a node whose round just ended (a crash loop) fails the job with its reason") {
  Fixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  s1.max_restarts = s2.max_restarts = 5;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.sm.report_failure(1, failure("node1", 0, 1));  // counted restart: both nodes rejoin
  f.out.clear();
  f.sm.join(1, s1);  // node 1 is back; node 2 finds its crash loop on hearing the restart
  WorkerFailure loop;
  loop.host = "node2";
  loop.exit_code = 1;
  loop.timestamp = 100;
  loop.fatal = "2 restart(s) in a row made no progress; --crash_loop_limit=2";
  f.sm.report_failure(2, loop);
  CHECK(f.out.of(1, "job_failed").empty());  // node 2 is still stopping its workers
  f.sm.join(2, s2);
  for (ConnId c : {1, 2}) {
    CHECK(f.out.of(c, "round").empty());
    auto failed = f.out.of(c, "job_failed");
    REQUIRE(failed.size() == 1);
    // The report names no worker: the round's root cause stands in for it.
    CHECK(failed[0]["failure"]["host"] == "node1");
    CHECK(failed[0]["failure"]["rank"] == 0);
    CHECK(failed[0]["summary"] == "job job failed: " + loop.fatal);
  }
}

TEST_CASE("a fatal report from a node left out of a new round ends that round and fails the job") {
  Fixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  s1.max_restarts = s2.max_restarts = 5;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.sm.report_failure(1, failure("node1", 0, 1));
  f.sm.join(1, s1);
  f.clock.advance(5);  // last call passes: node 1 runs alone
  f.sm.tick();
  REQUIRE(f.out.round(1).generation == 2);
  f.out.clear();
  WorkerFailure loop = failure("node2", 1, 1);
  loop.fatal = "crash loop";
  f.sm.report_failure(2, loop);
  REQUIRE(f.out.of(1, "restart").size() == 1);
  f.sm.join(1, s1);
  CHECK(f.out.of(1, "job_failed").empty());
  f.sm.join(2, s2);
  CHECK(f.out.of(1, "job_failed").at(0)["summary"] == "job job failed: crash loop");
  CHECK(f.out.of(2, "job_failed").at(0)["summary"] == "job job failed: crash loop");
}

TEST_CASE("a fatal report from a node that never ran a round, or after the verdict, changes nothing") {
  Fixture f;
  NodeSpec s1 = spec("node1", 2, 2), s2 = spec("node2", 2, 2);
  f.sm.join(1, s1);
  WorkerFailure w = failure("node1", 0, 3);
  w.fatal = "no";
  f.sm.report_failure(1, w);
  CHECK(f.out.of(1, "job_failed").empty());
  f.sm.join(2, s2);
  REQUIRE(f.out.round(1).generation == 1);
  f.sm.report_success(1);
  f.sm.report_success(2);
  REQUIRE(f.out.of(1, "job_succeeded").size() == 1);
  f.sm.report_failure(2, w);
  CHECK(f.out.of(2, "job_failed").empty());
}

TEST_CASE("a stale failure report after the round ended is not counted twice") {
  Fixture f;
  NodeSpec s1 = spec("node1", 2, 2), s2 = spec("node2", 2, 2);
  s1.max_restarts = s2.max_restarts = 5;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  f.sm.report_failure(1, failure("node1", 0, 1));
  f.sm.report_failure(2, failure("node2", 1, 1));  // raced the restart
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  CHECK(f.out.round(1).restart_count == 1);
}

TEST_CASE("an invalid join is refused with the reason") {
  Fixture f;
  NodeSpec s = spec("node1", 3, 2);
  f.sm.join(1, s);
  REQUIRE(f.out.dropped.count(1) == 1);
  CHECK(f.out.dropped[1].message.find("MIN <= MAX") != std::string::npos);
  CHECK(f.sm.job_count() == 0);
}

// ---- The environment check at rendezvous: make_env_round_check in the state machine.

namespace {

nlohmann::json node_fingerprint(const std::string& torch, const std::string& nccl_ifname = "eth0") {
  return {
      {"machine", {{"arch", "x86_64"}, {"os", "Debian GNU/Linux 12 (bookworm)"}, {"glibc", "2.36"}}},
      {"gpu", {{"count", 8}, {"models", std::vector<std::string>(8, "NVIDIA H100 80GB HBM3")}, {"driver", "535.104.05"}}},
      {"python",
       {{"version", "3.11.2"}, {"implementation", "CPython"}, {"executable", "/usr/bin/python3"}, {"torch", torch},
        {"torch_cuda", "12.1"}, {"nccl", "2.18.1"}, {"cudnn", "8902"}}},
      {"program", {{"path", "/job/train.py"}, {"sha256", std::string(64, 'a')}}},
      {"env", {{"NCCL_SOCKET_IFNAME", nccl_ifname}}},
  };
}

NodeSpec env_spec(const std::string& host, int min_nodes, int max_nodes, const std::string& torch,
                  const std::string& mode = "strict") {
  NodeSpec s = spec(host, min_nodes, max_nodes);
  s.env_check = mode;
  s.fingerprint = node_fingerprint(torch);
  return s;
}

// A state machine with the environment check the server installs, and the lines it logs.
struct EnvFixture {
  ManualClock clock;
  RecordingOutbox out;
  std::vector<std::string> env_log;
  StateMachine sm{clock, out, make_env_round_check([this](const std::string& line) { env_log.push_back(line); })};
};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("env check: a first round whose nodes differ in torch is refused for every member, side by side") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 3, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 3, 3, "2.1.0+cu118"));
  f.sm.join(3, env_spec("node3", 3, 3, "2.1.0+cu121"));
  for (ConnId c : {1, 2, 3}) {
    CHECK(f.out.of(c, "round").empty());  // nothing starts anywhere
    REQUIRE(f.out.dropped.count(c) == 1);
    CHECK(f.out.dropped[c].code == "round_refused");
    const std::string& m = f.out.dropped[c].message;
    CHECK(contains(m, "node node2 (10.0.0.2) has torch 2.1.0+cu118; nodes node1, node3 have 2.1.0+cu121"));
    CHECK(contains(m, "--env_check=warn"));
  }
  CHECK(f.sm.job_count() == 0);
  CHECK(f.sm.node_count() == 0);
  CHECK(f.env_log.empty());
}

TEST_CASE("env check: nodes on one host are told apart by address in the refusal") {
  EnvFixture f;
  NodeSpec a = env_spec("node1", 3, 3, "2.1.0+cu121"), b = env_spec("node2", 3, 3, "2.1.0+cu118"),
           c = env_spec("node3", 3, 3, "2.1.0+cu121");
  a.host = b.host = c.host = "box";
  f.sm.join(1, a);
  f.sm.join(2, b);
  f.sm.join(3, c);
  REQUIRE(f.out.dropped.count(1) == 1);
  CHECK(contains(f.out.dropped[1].message,
                 "node box (10.0.0.2) has torch 2.1.0+cu118; nodes box (10.0.0.1), box (10.0.0.3) have 2.1.0+cu121"));
}

TEST_CASE("env check: warn mode logs the difference and the round runs") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 2, 2, "2.1.0+cu121", "warn"));
  f.sm.join(2, env_spec("node2", 2, 2, "2.1.0+cu118", "warn"));
  CHECK(f.out.dropped.empty());
  CHECK(f.out.round(1).group_world_size == 2);
  CHECK(f.out.round(2).group_world_size == 2);
  REQUIRE(f.env_log.size() == 1);
  CHECK(contains(f.env_log[0], "--env_check=warn"));
  CHECK(contains(f.env_log[0], "node node1 (10.0.0.1) has torch 2.1.0+cu121; node node2 has 2.1.0+cu118"));
  // The status reply shows the disagreement while the job runs.
  auto env = f.sm.status()["jobs"][0]["env"];
  CHECK(env["agree"] == false);
  CHECK(env["breaking"] == true);
  CHECK(env["checked_nodes"] == 2);
  CHECK(contains(env["message"].get<std::string>(), "node node1 (10.0.0.1) has torch 2.1.0+cu121; node node2 has 2.1.0+cu118"));
}

TEST_CASE("env check: a finished job keeps the verdict on the nodes it ended with") {
  EnvFixture f;
  f.sm.set_retention({30, 10});
  f.sm.join(1, env_spec("node1", 2, 2, "2.1.0+cu121", "warn"));
  f.sm.join(2, env_spec("node2", 2, 2, "2.1.0+cu118", "warn"));
  f.sm.report_success(1);
  f.sm.report_success(2);
  f.sm.disconnected(1, "closed");
  f.sm.disconnected(2, "closed");
  auto jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["finished"] == true);
  CHECK(jobs[0]["env"]["checked_nodes"] == 2);  // not the 0 nodes left after the end
  CHECK(jobs[0]["env"]["agree"] == false);
  CHECK(contains(jobs[0]["env"]["message"].get<std::string>(), "node node2 has 2.1.0+cu118"));
}

TEST_CASE("env check: strict mode runs a round whose nodes differ only in informational fields, and logs it") {
  EnvFixture f;
  NodeSpec a = env_spec("node1", 2, 2, "2.1.0+cu121"), b = env_spec("node2", 2, 2, "2.1.0+cu121");
  b.fingerprint["env"]["NCCL_SOCKET_IFNAME"] = "ib0";
  f.sm.join(1, a);
  f.sm.join(2, b);
  CHECK(f.out.dropped.empty());
  CHECK(f.out.round(1).generation == 1);
  REQUIRE(f.env_log.size() == 1);
  CHECK(contains(f.env_log[0], "NCCL_SOCKET_IFNAME"));
  CHECK(f.sm.status()["jobs"][0]["env"]["breaking"] == false);
}

TEST_CASE("env check: off skips the comparison entirely") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 2, 2, "2.1.0+cu121", "off"));
  f.sm.join(2, env_spec("node2", 2, 2, "2.1.0+cu118", "off"));
  CHECK(f.out.dropped.empty());
  CHECK(f.out.round(1).group_world_size == 2);
  CHECK(f.env_log.empty());
}

TEST_CASE("env check: identical nodes pass silently and the status says they agree") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 2, 2, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 2, 2, "2.1.0+cu121"));
  CHECK(f.out.round(1).group_world_size == 2);
  CHECK(f.env_log.empty());
  auto env = f.sm.status()["jobs"][0]["env"];
  CHECK(env["agree"] == true);
  CHECK(env["checked_nodes"] == 2);
  CHECK_FALSE(env.contains("message"));
}

TEST_CASE("env check: a mismatched node joining a running elastic job is refused alone, the round goes on") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 1, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 1, 3, "2.1.0+cu121"));
  f.clock.advance(5.1);  // last call
  f.sm.tick();
  REQUIRE(f.out.round(1).generation == 1);
  REQUIRE(f.out.round(2).group_world_size == 2);
  f.out.clear();

  f.sm.join(3, env_spec("node3", 1, 3, "2.1.0+cu118"));
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped[3].code == "round_refused");
  CHECK(contains(f.out.dropped[3].message, "node node3 (10.0.0.3) has torch 2.1.0+cu118; nodes node1, node2 have 2.1.0+cu121"));
  // The running nodes hear nothing: no restart, no new round.
  CHECK(f.out.sent.count(1) == 0);
  CHECK(f.out.sent.count(2) == 0);
  CHECK(f.out.dropped.count(1) == 0);
  auto job = f.sm.status()["jobs"][0];
  CHECK(job["state"] == "running");
  CHECK(job["generation"] == 1);
  CHECK(job["nodes"].size() == 2);
  CHECK(job["env"]["agree"] == true);
  // The round still finishes normally.
  f.sm.report_success(1);
  f.sm.report_success(2);
  CHECK(f.out.of(1, "job_succeeded").size() == 1);
  CHECK(f.out.of(2, "job_succeeded").size() == 1);
}

TEST_CASE("env check: a matching node joining a running elastic job is let in (the round restarts with it)") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 1, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 1, 3, "2.1.0+cu121"));
  f.clock.advance(5.1);
  f.sm.tick();
  f.out.clear();
  f.sm.join(3, env_spec("node3", 1, 3, "2.1.0+cu121"));
  CHECK(f.out.dropped.empty());
  REQUIRE(f.out.of(1, "restart").size() == 1);
  CHECK(f.out.of(1, "restart")[0]["counted"] == false);
  f.sm.join(1, env_spec("node1", 1, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 1, 3, "2.1.0+cu121"));
  CHECK(f.out.round(3).generation == 2);
  CHECK(f.out.round(3).group_world_size == 3);
}

TEST_CASE("env check: a mismatched replacement after a restart is refused while the survivors regroup") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 1, 2, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 1, 2, "2.1.0+cu121"));
  REQUIRE(f.out.round(1).generation == 1);
  f.sm.disconnected(2, "connection reset");
  REQUIRE(f.out.of(1, "restart").size() == 1);
  f.out.clear();
  f.sm.join(4, env_spec("node4", 1, 2, "2.1.0+cu118"));
  REQUIRE(f.out.dropped.count(4) == 1);
  CHECK(f.out.dropped[4].code == "round_refused");
  CHECK(contains(f.out.dropped[4].message, "node node4 (10.0.0.4) has torch 2.1.0+cu118"));
  f.sm.join(1, env_spec("node1", 1, 2, "2.1.0+cu121"));
  CHECK(f.out.round(1).generation == 2);
  CHECK(f.out.round(1).group_world_size == 1);
}

TEST_CASE("env check: the strictest mode any node asked for applies, whoever came first") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 2, 2, "2.1.0+cu121", "warn"));
  f.sm.join(2, env_spec("node2", 2, 2, "2.1.0+cu118", "strict"));
  REQUIRE(f.out.dropped.count(1) == 1);
  CHECK(f.out.dropped[1].code == "round_refused");
  CHECK(f.out.dropped.count(2) == 1);
}

TEST_CASE("env check: a node without a fingerprint (--env_check=off on it) is not compared") {
  EnvFixture f;
  NodeSpec off = env_spec("node3", 3, 3, "2.1.0+cu118", "off");
  off.fingerprint = nlohmann::json::object();  // what ddplaunch --env_check=off sends
  f.sm.join(1, env_spec("node1", 3, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 3, 3, "2.1.0+cu121"));
  f.sm.join(3, off);
  CHECK(f.out.dropped.empty());
  CHECK(f.out.round(3).group_world_size == 3);
  CHECK(f.sm.status()["jobs"][0]["env"]["checked_nodes"] == 2);
}

TEST_CASE("env check: a lock file named on one node only is a breaking difference") {
  EnvFixture f;
  NodeSpec a = env_spec("node1", 2, 2, "2.1.0+cu121"), b = env_spec("node2", 2, 2, "2.1.0+cu121");
  b.fingerprint["env_lock"] = {{"source", "requirements.txt"}, {"sha256", std::string(64, 'b')}};
  f.sm.join(1, a);
  f.sm.join(2, b);
  REQUIRE(f.out.dropped.count(1) == 1);
  CHECK(f.out.dropped[1].code == "round_refused");
  CHECK(contains(f.out.dropped[1].message, "node node1 (10.0.0.1) has lock file sha256 (none); node node2 has bbbbbbbbbbbb"));
}

// ---- refused rounds at a deadline, join churn, policy, input the codec would refuse.

TEST_CASE("a round refused at the last-call deadline forgets the job without touching it again") {
  // The round completes from tick() (the last-call timer), the check refuses it and every member
  // leaves: the job must be erased only once tick() is done with it (run under scripts/test
  // --sanitize, a use after free here is a failure).
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 2, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 2, 3, "2.1.0+cu118"));
  CHECK(f.out.dropped.empty());
  f.clock.advance(5.1);
  f.sm.tick();
  CHECK(f.out.dropped.count(1) == 1);
  CHECK(f.out.dropped.count(2) == 1);
  CHECK(f.sm.job_count() == 0);
  CHECK(f.sm.node_count() == 0);
  f.sm.tick();  // nothing left to touch
  CHECK(f.sm.job_count() == 0);
}

TEST_CASE("restarts caused by a node that keeps joining and leaving back off") {
  Fixture f;
  f.sm.join(1, spec("node1", 1, 2));
  f.clock.advance(5);
  f.sm.tick();
  REQUIRE(f.out.of(1, "round").size() == 1);
  auto churn = [&](ConnId conn) {  // a newcomer joins the running round, then leaves again
    f.sm.join(conn, spec("node2", 1, 2));
  };
  auto rejoin_all = [&](std::initializer_list<ConnId> conns) {
    for (ConnId c : conns) f.sm.join(c, spec(c == 1 ? "node1" : "node2", 1, 2));
  };
  // First and second join-caused restarts are immediate.
  churn(2);
  CHECK(f.out.of(1, "restart").size() == 1);
  rejoin_all({1});
  REQUIRE(f.out.of(1, "round").size() == 2);
  f.sm.leave(2);
  CHECK(f.out.of(1, "restart").size() == 2);  // a leave is never delayed
  rejoin_all({1});
  REQUIRE(f.out.of(1, "round").size() == 3);
  churn(3);
  CHECK(f.out.of(1, "restart").size() == 3);
  rejoin_all({1});
  f.sm.join(3, spec("node3", 1, 2));
  REQUIRE(f.out.of(1, "round").size() == 4);
  f.sm.leave(3);
  rejoin_all({1});
  REQUIRE(f.out.of(1, "round").size() == 5);
  // The third within the window waits: the newcomer does not restart the running round at once.
  f.sm.join(4, spec("node4", 1, 2));
  CHECK(f.out.of(1, "restart").size() == 4);  // only the leave of node3 since
  CHECK(f.out.of(4, "round").empty());
  f.clock.advance(0.5);
  f.sm.tick();
  CHECK(f.out.of(1, "restart").size() == 4);
  f.clock.advance(0.6);  // 1 s after the last join-caused restart
  f.sm.tick();
  CHECK(f.out.of(1, "restart").size() == 5);
  rejoin_all({1});
  REQUIRE(f.out.of(4, "round").size() == 1);
  CHECK(f.out.round(4).group_world_size == 2);
}

TEST_CASE("a node asking for another max_restarts or timeout than the job's is refused naming both") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  NodeSpec other = spec("node2", 2, 2);
  other.max_restarts = 7;
  f.sm.join(2, other);
  REQUIRE(f.out.dropped.count(2) == 1);
  CHECK(f.out.dropped[2].code == "policy_mismatch");
  CHECK(f.out.dropped[2].message.find("--max_restarts 7") != std::string::npos);
  CHECK(f.out.dropped[2].message.find("job's 0") != std::string::npos);
  NodeSpec slow = spec("node3", 2, 2);
  slow.timeouts.join_timeout = 61;
  f.sm.join(3, slow);
  CHECK(f.out.dropped[3].message.find("join_timeout 61 s differs from job job's 60 s") != std::string::npos);
  f.sm.join(4, spec("node4", 2, 2));
  CHECK(f.out.of(1, "round").size() == 1);  // the job itself is undisturbed
}

TEST_CASE("specs the codec would refuse are refused by the state machine too") {
  Fixture f;
  NodeSpec wide = spec("node1", 2, 2);
  wide.local_world_size = 2147483647;
  f.sm.join(1, wide);
  CHECK(f.out.dropped[1].code == "bad_join");
  NodeSpec flat = spec("node2", 1, 1);
  flat.fingerprint = nlohmann::json::array({1});
  f.sm.join(2, flat);
  CHECK(f.out.dropped[2].message.find("fingerprint") != std::string::npos);
  CHECK(f.sm.job_count() == 0);
}

// ---- finished jobs stay in status for a while; lifecycle events ----------

namespace {

struct EventFixture {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm{clock, out};
};

}  // namespace

TEST_CASE("a finished job stays in status, marked with its end, for keep_finished seconds") {
  Fixture f;
  f.sm.set_retention({30, 10});
  f.sm.join(1, spec("node1", 1, 1));
  f.sm.report_success(1);
  f.clock.advance(2);
  f.sm.disconnected(1, "closed");
  CHECK(f.sm.job_count() == 0);  // no live job: a new one under this id may start
  auto jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["job_id"] == "job");
  CHECK(jobs[0]["state"] == "succeeded");
  CHECK(jobs[0]["finished"] == true);
  CHECK(jobs[0]["ended_seconds_ago"].get<double>() == doctest::Approx(2.0));
  REQUIRE(jobs[0]["nodes"].size() == 1);
  CHECK(jobs[0]["nodes"][0]["host"] == "node1");
  CHECK(jobs[0]["nodes"][0]["group_rank"] == 0);  // the rank of its last round
  CHECK(jobs[0]["nodes"][0]["last_heartbeat_age"].is_null());
  f.clock.advance(29.9);
  f.sm.tick();
  CHECK(f.sm.status()["jobs"].size() == 1);
  f.clock.advance(0.2);  // 30 s after the last node went
  f.sm.tick();
  CHECK(f.sm.status()["jobs"].empty());
  CHECK(f.sm.finished_count() == 0);
}

TEST_CASE("status shows each node's last step and checkpoint, and the job's checkpoint interval, and keeps them at the end") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  f.sm.join(2, spec("node2", 2, 2));
  auto jobs = f.sm.status()["jobs"];
  CHECK(jobs[0]["checkpoint_interval"].is_null());
  CHECK_FALSE(jobs[0]["nodes"][0].contains("last_step"));
  NodeProgress p1;
  p1.step = 40;
  p1.checkpoint_step = 30;
  p1.checkpoint_interval = 12.5;
  f.sm.progress(1, p1);
  NodeProgress p2;
  p2.step = 41;  // no checkpoint, no interval yet
  f.sm.progress(2, p2);
  f.sm.progress(99, p1);  // not a member: nothing
  jobs = f.sm.status()["jobs"];
  CHECK(jobs[0]["checkpoint_interval"].get<double>() == doctest::Approx(12.5));
  REQUIRE(jobs[0]["nodes"].size() == 2);
  CHECK(jobs[0]["nodes"][0]["last_step"] == 40);
  CHECK(jobs[0]["nodes"][0]["last_checkpoint"] == 30);
  CHECK(jobs[0]["nodes"][0]["checkpoint_interval"].get<double>() == doctest::Approx(12.5));
  CHECK(jobs[0]["nodes"][1]["last_step"] == 41);
  CHECK_FALSE(jobs[0]["nodes"][1].contains("last_checkpoint"));
  CHECK_FALSE(jobs[0]["nodes"][1].contains("checkpoint_interval"));
  f.sm.report_success(1);
  f.sm.report_success(2);
  f.sm.disconnected(1, "closed");
  f.sm.disconnected(2, "closed");
  jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["finished"] == true);
  CHECK(jobs[0]["nodes"][0]["last_step"] == 40);
  CHECK(jobs[0]["nodes"][1]["last_step"] == 41);
}

TEST_CASE("a failed job is kept with its summary; a new job under its id replaces it") {
  Fixture f;
  f.sm.join(1, spec("node1", 1, 1));
  f.sm.report_failure(1, failure("node1", 0, 3));  // max_restarts 0: the job fails
  f.sm.disconnected(1, "closed");
  auto jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["state"] == "failed");
  CHECK(jobs[0]["finished"] == true);
  CHECK(jobs[0]["summary"].get<std::string>().find("exited with code 3") != std::string::npos);
  f.sm.join(2, spec("node2", 2, 2));  // same id, a new job
  jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["state"] == "gathering");
  CHECK(jobs[0].value("finished", false) == false);
}

TEST_CASE("finished jobs kept are bounded in count, the oldest going first") {
  Fixture f;
  f.sm.set_retention({600, 3});
  for (int i = 0; i < 5; ++i) {
    const std::string id = "job" + std::to_string(i);
    const ConnId c = static_cast<ConnId>(10 + i);
    f.sm.join(c, spec("node1", 1, 1, 1, id));
    f.sm.report_success(c);
    f.sm.disconnected(c, "closed");
    f.clock.advance(1);
  }
  CHECK(f.sm.finished_count() == 3);
  auto jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 3);
  CHECK(jobs[0]["job_id"] == "job4");  // newest first
  CHECK(jobs[2]["job_id"] == "job2");
}

TEST_CASE("keep_finished 0 forgets a finished job at once, as before") {
  Fixture f;
  f.sm.set_retention({0, 10});
  f.sm.join(1, spec("node1", 1, 1));
  f.sm.report_success(1);
  f.sm.disconnected(1, "closed");
  CHECK(f.sm.status()["jobs"].empty());
}

TEST_CASE("events: a round's formation time and the failure-to-restart time come from the clock") {
  EventFixture f;
  NodeSpec a = spec("node1", 2, 2), b = spec("node2", 2, 2);
  a.max_restarts = b.max_restarts = 1;
  f.sm.join(1, a);
  f.clock.advance(1.5);
  f.sm.join(2, b);
  auto rounds = f.out.of("round");
  REQUIRE(rounds.size() == 1);
  CHECK(rounds[0]->generation == 1);
  CHECK(rounds[0]->job == "job");
  CHECK(rounds[0]->fields["formation_seconds"].get<double>() == doctest::Approx(1.5));
  CHECK(rounds[0]->fields["world_size"] == 2);
  CHECK_FALSE(rounds[0]->fields.contains("failure_to_restart_seconds"));
  f.clock.advance(10);
  f.sm.report_failure(2, failure("node2", 1, 7));
  auto failures = f.out.of("failure");
  REQUIRE(failures.size() == 1);
  CHECK(failures[0]->cause == "exit_code");
  CHECK(failures[0]->node == "node2");
  CHECK(failures[0]->ranks == std::vector<int>{1});
  CHECK(failures[0]->generation == 1);
  auto restarts = f.out.of("restart");
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0]->cause == "worker_failure");
  CHECK(restarts[0]->fields["counted"] == true);
  f.clock.advance(0.25);
  f.sm.join(1, a);
  f.sm.join(2, b);
  rounds = f.out.of("round");
  REQUIRE(rounds.size() == 2);
  CHECK(rounds[1]->generation == 2);
  CHECK(rounds[1]->fields["failure_to_restart_seconds"].get<double>() == doctest::Approx(0.25));
  CHECK(rounds[1]->fields["formation_seconds"].get<double>() == doctest::Approx(0.25));
}

TEST_CASE("events: a lost node, its cause, and the job's end") {
  EventFixture f;
  f.sm.join(1, spec("node1", 1, 2));
  f.sm.join(2, spec("node2", 1, 2));
  f.sm.disconnected(2, "connection reset");
  auto lost = f.out.of("node_lost");
  REQUIRE(lost.size() == 1);
  CHECK(lost[0]->cause == "connection_closed");
  CHECK(lost[0]->node.find("node2") != std::string::npos);
  auto restarts = f.out.of("restart");
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0]->cause == "node_lost");
  CHECK(restarts[0]->fields["counted"] == false);
  f.sm.join(1, spec("node1", 1, 2));
  f.clock.advance(6);  // last_call_timeout 5 s at MIN
  f.sm.tick();
  f.sm.report_success(1);
  auto ends = f.out.of("job_end");
  REQUIRE(ends.size() == 1);
  CHECK(ends[0]->cause == "succeeded");
  CHECK(ends[0]->generation == 2);
}

TEST_CASE("gauges count jobs and nodes by state and each job's most silent node") {
  Fixture f;
  f.sm.join(1, spec("node1", 2, 2));
  f.clock.advance(3);
  f.sm.join(2, spec("node2", 2, 2));
  f.clock.advance(1);
  Gauges g = f.sm.gauges();
  CHECK(g.jobs_by_state["running"] == 1);
  CHECK(g.jobs_by_state["gathering"] == 0);
  CHECK(g.nodes_by_state["running"] == 2);
  CHECK(g.oldest_heartbeat_age["job"] == doctest::Approx(4.0));
}

TEST_CASE("a kept finished job holds at most 64 node rows, without fingerprints") {
  Fixture f;
  const int n = 70;
  for (int i = 0; i < n; ++i) {
    NodeSpec s = spec("node" + std::to_string(i % 10), n, n);
    s.fingerprint = {{"python", "3.11"}};
    f.sm.join(static_cast<ConnId>(i + 1), s);
  }
  for (int i = 0; i < n; ++i) f.sm.report_success(static_cast<ConnId>(i + 1));
  for (int i = 0; i < n; ++i) f.sm.disconnected(static_cast<ConnId>(i + 1), "closed");
  auto jobs = f.sm.status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["finished"] == true);
  CHECK(jobs[0]["nodes"].size() == 64);
  CHECK(jobs[0]["nodes_omitted"] == 6);
  CHECK(jobs[0]["nodes"][0]["group_rank"] == 0);
  CHECK_FALSE(jobs[0]["nodes"][0].contains("fingerprint"));
}

TEST_CASE("a fatal report is a failure event with cause fatal and its reason, then a job_failing restart") {
  EventFixture f;
  NodeSpec s1 = spec("node1", 1, 2), s2 = spec("node2", 1, 2);
  s1.max_restarts = s2.max_restarts = 5;
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  WorkerFailure w;
  w.host = "node2";
  w.rank = 1;
  w.exit_code = 3;
  w.fatal = "worker 1 exited with code 3, which --no_restart_exit_codes lists: not restarting";
  f.sm.report_failure(2, w);
  auto failures = f.out.of("failure");
  REQUIRE(failures.size() == 1);
  CHECK(failures[0]->cause == "fatal");
  CHECK(failures[0]->message == w.fatal);
  CHECK(failures[0]->ranks == std::vector<int>{1});
  auto restarts = f.out.of("restart");
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0]->cause == "job_failing");
  f.sm.join(1, s1);
  f.sm.join(2, s2);
  auto ends = f.out.of("job_end");
  REQUIRE(ends.size() == 1);
  CHECK(ends[0]->cause == "failed");
}

// ---- silent nodes: a stall report, probes, and the probe's verdict ------------------------------

namespace {

// Three nodes in a running round, heartbeats every second, heartbeat_timeout 5 s, probe_timeout
// 0.3 s. Each heartbeat touches the node, as the server does with every message.
struct ProbeFixture {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm{clock, out};
  // `peer_checks`: the agents answer check_peer, and each connection comes from port 40000 + its id.
  explicit ProbeFixture(double probe_timeout = 0.3, bool peer_checks = false) {
    if (peer_checks) sm.set_peer_port([](ConnId c) { return static_cast<int>(40000 + c); });
    for (int n = 1; n <= 3; ++n) {
      NodeSpec s = spec("node" + std::to_string(n), 3, 3);
      s.timeouts.heartbeat_timeout = 5;
      s.timeouts.probe_timeout = probe_timeout;
      s.peer_checks = peer_checks;
      sm.join(n, s);
    }
    REQUIRE(out.of(1, "round").size() == 1);
    out.clear();
  }
  // A probe of `silent` went out now: nothing is dropped just before probe_timeout (0.3 s), and
  // `silent` alone is dropped, for probe_timeout, just after it.
  void expect_lost_to_probe(ConnId silent) {
    clock.advance(0.29);
    sm.tick();
    CHECK(out.dropped.empty());
    clock.advance(0.02);
    sm.tick();
    REQUIRE(out.dropped.count(silent) == 1);
    CHECK(out.dropped[silent].code == "probe_timeout");
    CHECK(out.dropped.size() == 1);
  }
};

}  // namespace

TEST_CASE("a node silent while the others stall is probed and lost after probe_timeout, long before heartbeat_timeout") {
  ProbeFixture f;
  f.clock.advance(0.5);
  for (ConnId c : {1, 2, 3}) f.sm.touch(c);  // the last heartbeats before node3 goes silent
  f.clock.advance(0.4);
  f.sm.touch(1);  // node1's next heartbeat comes; node2's and node3's are not due yet
  f.clock.advance(0.2);
  // node2's workers stalled 0.25 s ago: node1 was heard from since, node3 was not.
  f.sm.touch(2);
  f.sm.stall(2, 0.25);
  CHECK(f.out.of(3, "probe").size() == 1);
  CHECK(f.out.of(1, "probe").empty());
  CHECK(f.out.of(2, "probe").empty());
  auto probes = f.out.of("probe");
  REQUIRE(probes.size() == 1);
  CHECK(probes[0]->cause == "stall");
  CHECK(probes[0]->fields["probed"] == 1);
  f.expect_lost_to_probe(3);
  CHECK(f.out.dropped[3].message.find("no answer to a probe within 0.3 s") != std::string::npos);
  auto lost = f.out.of("node_lost");
  REQUIRE(lost.size() == 1);
  CHECK(lost[0]->cause == "probe_timeout");
  for (ConnId c : {1, 2}) {
    REQUIRE(f.out.of(c, "restart").size() == 1);
    CHECK(f.out.of(c, "restart")[0]["counted"] == false);
  }
}

TEST_CASE("a probed node whose host acknowledged the probe is not lost: a busy or stopped agent waits for heartbeat_timeout") {
  ProbeFixture f;
  f.sm.set_peer_check([](ConnId c) { return c == 3; });  // node3's host is up, its agent silent
  f.clock.advance(1.0);
  f.sm.touch(1);
  f.clock.advance(0.5);
  f.sm.stall(1, 0.4);
  REQUIRE(f.out.of(3, "probe").size() == 1);
  f.sm.touch(2);
  f.clock.advance(0.31);
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  CHECK(std::any_of(f.out.lines.begin(), f.out.lines.end(), [](const std::string& l) {
    return l.find("its host acknowledged it: left to heartbeat_timeout") != std::string::npos;
  }));
  f.clock.advance(5.0 - 1.81);  // node3 silent since its join, 5 s ago
  for (ConnId c : {1, 2}) f.sm.touch(c);
  f.clock.advance(0.05);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped[3].code == "heartbeat_timeout");
}

TEST_CASE("a probed node that answers is cleared, and is not probed again within a heartbeat_interval") {
  ProbeFixture f;
  f.clock.advance(1.0);
  f.sm.touch(1);
  f.clock.advance(0.5);
  f.sm.stall(1, 0.4);  // node2 and node3 were last heard 1.5 s ago
  CHECK(f.out.of(2, "probe").size() == 1);
  CHECK(f.out.of(3, "probe").size() == 1);
  f.clock.advance(0.01);
  f.sm.touch(2);  // both answer (any message does)
  f.sm.touch(3);
  f.clock.advance(0.5);
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  CHECK(f.out.of("node_lost").empty());
  // Still stalled (a long checkpoint, a slow step): no new round within heartbeat_interval.
  f.out.clear();
  f.clock.advance(0.3);
  f.sm.stall(1, 0.5);  // node2 was last heard before that stall began
  CHECK(f.out.of(2, "probe").empty());
  f.clock.advance(1.0);
  f.sm.stall(1, 1.5);
  CHECK(f.out.of(2, "probe").size() == 1);
}

TEST_CASE("a stall of the server while a probe is out is not the probed node's answer") {
  // The server did not run for 0.2 s after it probed node3 (a loaded machine): every node's
  // silence is counted 0.2 s shorter, which moves node3's last message past the probe. Only a
  // message from node3 answers it.
  ProbeFixture f;
  f.clock.advance(1.0);
  for (ConnId c : {1, 2, 3}) f.sm.touch(c);
  f.clock.advance(0.1);
  f.sm.touch(1);
  f.sm.touch(2);
  f.sm.stall(1, 0.05);
  REQUIRE(f.out.of(3, "probe").size() == 1);
  CHECK(f.out.of(2, "probe").empty());
  f.clock.advance(0.2);
  f.sm.stalled(0.2);
  f.sm.touch(1);  // their heartbeats, read once the server runs again
  f.sm.touch(2);
  f.expect_lost_to_probe(3);  // the probe's 0.3 s, counted without the stall
}

TEST_CASE("a node that spoke after the stall began, then went silent, is probed at a survivor's next report") {
  // node3's own stall report reaches the server as its link goes down: it was heard from after
  // the stall began, so the first reports do not suspect it; once it has missed a heartbeat, the
  // next report does, though the probes that cleared node1 and node2 concluded only just before.
  ProbeFixture f;
  f.clock.advance(0.5);
  for (ConnId c : {1, 2, 3}) f.sm.touch(c);
  f.clock.advance(0.5);
  f.sm.touch(3);
  f.sm.stall(3, 0.2);  // t = 1.0
  REQUIRE(f.out.of(1, "probe").size() == 1);
  REQUIRE(f.out.of(2, "probe").size() == 1);
  f.clock.advance(0.01);
  f.sm.touch(1);
  f.sm.touch(2);
  f.clock.advance(0.09);
  f.sm.touch(1);
  f.sm.stall(1, 0.3);  // t = 1.1: node3 was heard from at 1.0, after this stall began
  CHECK(f.out.of(3, "probe").empty());
  f.clock.advance(0.3);
  f.sm.tick();  // node1's and node2's answers are in: cleared
  CHECK(f.out.dropped.empty());
  f.clock.advance(0.1);
  for (ConnId c : {1, 2}) f.sm.touch(c);  // t = 1.5: their heartbeats; node3's never comes
  f.clock.advance(0.1);
  f.sm.touch(1);
  f.sm.stall(1, 0.8);  // t = 1.6: node3 silent for 0.6 s, under a heartbeat_interval
  CHECK(f.out.of(3, "probe").empty());
  f.clock.advance(0.5);
  f.sm.touch(1);
  f.sm.stall(1, 1.3);  // t = 2.1: node3 missed its heartbeat
  REQUIRE(f.out.of(3, "probe").size() == 1);
  CHECK(f.out.of(2, "probe").size() == 1);  // node2 was heard from within the interval
  f.clock.advance(0.31);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(3) == 1);  // at 2.41 s, not at heartbeat_timeout (6 s)
  CHECK(f.out.dropped[3].code == "probe_timeout");
}

TEST_CASE("stall reports within a moment of each other are weighed together at the next tick") {
  ProbeFixture f;
  f.clock.advance(0.5);
  for (ConnId c : {1, 2, 3}) f.sm.touch(c);
  f.clock.advance(0.5);
  f.sm.touch(3);
  f.sm.stall(3, 0.6);  // began before anyone's last word: nobody to probe, but a scan was made
  CHECK(f.out.sent.empty());
  f.clock.advance(0.02);
  f.sm.touch(1);
  f.sm.stall(1, 0.3);  // node2 was silent since this one began: it waits for the next tick
  CHECK(f.out.of(2, "probe").empty());
  f.clock.advance(0.04);
  f.sm.tick();
  CHECK(f.out.of(2, "probe").size() == 1);
  CHECK(f.out.of(3, "probe").empty());
}

TEST_CASE("stall reports as fast as a client can send them probe a healthy node no more than its heartbeats") {
  ProbeFixture f;
  std::size_t answered[4] = {};
  for (int i = 1; i <= 300; ++i) {  // 3 s of reports every 10 ms, each claiming a fresh stall
    f.clock.advance(0.01);
    f.sm.touch(1);
    f.sm.stall(1, 0.001);
    for (ConnId c : {2, 3}) {
      const std::size_t probes = f.out.of(c, "probe").size();
      if (probes > answered[c]) f.sm.touch(c);  // answers at once, like an agent
      answered[c] = probes;
    }
    f.sm.tick();
  }
  for (ConnId c : {2, 3}) {
    CHECK(answered[c] >= 1);
    CHECK(answered[c] <= 3);  // once per heartbeat_interval at most
  }
  CHECK(f.out.dropped.empty());
}

TEST_CASE("a probed node is checked through two peers; one that a peer reaches is left to heartbeat_timeout") {
  ProbeFixture f(0.3, true);
  f.clock.advance(1.0);
  f.sm.touch(1);
  f.sm.touch(2);
  f.clock.advance(0.2);
  f.sm.stall(2, 0.4);  // node3 silent since it joined
  REQUIRE(f.out.of(3, "probe").size() == 1);
  // The reporter and the other node heard from since the stall began are asked to reach node3's
  // host at its address, at the port its connection comes from, within half probe_timeout.
  for (ConnId helper : {1, 2}) {
    auto checks = f.out.of(helper, "check_peer");
    REQUIRE(checks.size() == 1);
    CHECK(checks[0]["addr"] == "10.0.0.3");
    CHECK(checks[0]["port"] == 40003);
    CHECK(checks[0]["within"] == doctest::Approx(0.15));
  }
  CHECK(f.out.of(3, "check_peer").empty());
  const std::uint64_t id = f.out.of(1, "check_peer")[0]["id"];
  f.clock.advance(0.01);
  f.sm.peer_alive(1, id);  // node1 reached it: only node3's path to the server is lossy
  f.clock.advance(0.3);
  f.sm.tick();
  CHECK(f.out.dropped.empty());
  CHECK(std::any_of(f.out.lines.begin(), f.out.lines.end(), [](const std::string& l) {
    return l.find("but node1 (10.0.0.1) [group rank 0] reached its host: left to heartbeat_timeout") !=
           std::string::npos;
  }));
  f.clock.advance(5.0 - 1.51 + 0.05);  // still silent: heartbeat_timeout bounds it, as before
  for (ConnId c : {1, 2}) f.sm.touch(c);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped[3].code == "heartbeat_timeout");
}

TEST_CASE("a peer_alive that was not asked for spares nobody: another id, the suspect itself, or after the verdict") {
  ProbeFixture f(0.3, true);
  f.clock.advance(1.0);
  f.sm.touch(1);
  f.sm.touch(2);
  f.clock.advance(0.2);
  f.sm.stall(2, 0.4);
  REQUIRE(f.out.of(1, "check_peer").size() == 1);
  const std::uint64_t id = f.out.of(1, "check_peer")[0]["id"];
  f.sm.peer_alive(1, id + 1);  // an id nobody was given
  f.sm.peer_alive(1, 0);
  f.sm.peer_alive(3, id);   // the silent node cannot vouch for itself (nor did it speak)
  f.sm.peer_alive(99, id);  // not a member
  f.clock.advance(0.31);
  f.sm.tick();
  REQUIRE(f.out.dropped.count(3) == 1);
  CHECK(f.out.dropped[3].code == "probe_timeout");
  f.sm.peer_alive(1, id);  // too late: the check is over
  f.sm.tick();
  CHECK(f.out.dropped.size() == 1);
}

TEST_CASE("agents that do not answer check_peer, or a server that cannot name the port, get no check") {
  SUBCASE("old agents") {
    ProbeFixture f(0.3, false);
    f.sm.set_peer_port([](ConnId c) { return static_cast<int>(40000 + c); });
    f.clock.advance(1.0);
    f.sm.touch(1);
    f.sm.stall(1, 0.4);
    REQUIRE(f.out.of(3, "probe").size() == 1);
    for (ConnId c : {1, 2, 3}) CHECK(f.out.of(c, "check_peer").empty());
  }
  SUBCASE("no port") {
    ProbeFixture f(0.3, true);
    f.sm.set_peer_port([](ConnId) { return 0; });
    f.clock.advance(1.0);
    f.sm.touch(1);
    f.sm.stall(1, 0.4);
    REQUIRE(f.out.of(3, "probe").size() == 1);
    for (ConnId c : {1, 2, 3}) CHECK(f.out.of(c, "check_peer").empty());
  }
}

TEST_CASE("a stall report from a node that is not running, or with probe_timeout 0, probes nobody") {
  SUBCASE("probe_timeout 0: only heartbeat_timeout finds a silent node") {
    ProbeFixture f(0);
    f.clock.advance(2);
    f.sm.touch(1);
    f.sm.stall(1, 1.0);
    CHECK(f.out.of(2, "probe").empty());
    CHECK(f.out.of(3, "probe").empty());
  }
  SUBCASE("an unknown connection changes nothing") {
    ProbeFixture f;
    f.clock.advance(2);
    f.sm.stall(99, 1.0);
    CHECK(f.out.sent.empty());
    f.clock.advance(1);
    f.sm.tick();
    CHECK(f.out.dropped.empty());
  }
  SUBCASE("a node of a round that ended") {
    ProbeFixture f;
    f.sm.disconnected(3, "reset");
    f.out.clear();
    f.clock.advance(2);
    f.sm.stall(1, 1.0);
    CHECK(f.out.of(2, "probe").empty());
  }
}

TEST_CASE("a round that ends while its probes are out convicts nobody; the rejoined node is not lost") {
  ProbeFixture f;
  f.clock.advance(2);
  f.sm.touch(1);
  f.sm.stall(1, 1.0);
  REQUIRE(f.out.of(3, "probe").size() == 1);
  f.sm.report_failure(2, failure("node2", 1, 1));  // the round ends for another reason
  f.clock.advance(1);
  f.sm.tick();
  CHECK(f.out.dropped.count(3) == 0);
}

// ---- drain ---------------------------------------------------------------------------------

namespace {

// Two nodes in a running round at MAX 2, a third waiting beside it as a spare.
struct DrainFixture {
  ManualClock clock;
  EventOutbox out;
  StateMachine sm{clock, out};
  explicit DrainFixture(int min_nodes = 2, int max_nodes = 2, bool spare = true) {
    sm.join(1, spec("node1", min_nodes, max_nodes));
    sm.join(2, spec("node2", min_nodes, max_nodes));
    if (max_nodes > 2) {
      clock.advance(5.1);
      sm.tick();
    }
    REQUIRE(out.of(1, "round").size() == 1);
    if (spare) sm.join(3, spec("node3", min_nodes, max_nodes));
    out.clear();
  }
};

}  // namespace

TEST_CASE("a node beyond MAX is a spare: status, gauges and events say so") {
  DrainFixture f(2, 2, false);
  f.sm.join(3, spec("node3", 2, 2));
  CHECK(f.out.of(1, "restart").empty());  // a spare never ends the round by arriving
  REQUIRE(f.out.of("node_spare").size() == 1);
  CHECK(f.out.of("node_spare")[0]->fields["spares"] == 1);
  CHECK(f.out.of("node_spare")[0]->cause == "max_nodes");
  const auto nodes = f.sm.status()["jobs"][0]["nodes"];
  REQUIRE(nodes.size() == 3);
  CHECK(nodes[0]["spare"] == false);
  CHECK(nodes[2]["spare"] == true);  // listed last, without a group rank
  CHECK(nodes[2]["group_rank"] == -1);
  CHECK(f.sm.gauges().spares.at("job") == 1);
}

TEST_CASE("a drained node is dropped, the round restarts uncounted, and the spare takes its place") {
  DrainFixture f;
  const DrainResult r = f.sm.drain("job", "1", false);  // group rank 1: node2
  CHECK(r.code.empty());
  CHECK(r.node.find("node2") != std::string::npos);
  CHECK(r.message.find("a waiting node in its place") != std::string::npos);
  REQUIRE(f.out.dropped.count(2) == 1);
  CHECK(f.out.dropped[2].code == "drained");
  REQUIRE(f.out.of(1, "restart").size() == 1);
  CHECK(f.out.of(1, "restart")[0]["counted"] == false);
  CHECK_FALSE(f.out.of(1, "restart")[0].value("failure", false));  // survivors finish or park their step
  auto drained = f.out.of("node_drained");
  REQUIRE(drained.size() == 1);
  CHECK(drained[0]->cause == "drain");
  CHECK(drained[0]->fields["spares"] == 1);
  REQUIRE(f.out.of("restart").size() == 1);
  CHECK(f.out.of("restart")[0]->cause == "drain");
  f.sm.join(1, spec("node1", 2, 2));  // the survivor rejoins: with the spare, the round is full
  const Assignment a1 = f.out.round(1), a3 = f.out.round(3);
  CHECK(a1.generation == 2);
  CHECK(a1.group_world_size == 2);
  CHECK(a1.group_rank == 0);  // the survivor keeps its rank
  CHECK(a3.group_rank == 1);  // the spare takes the drained one's
  CHECK(f.sm.status()["jobs"][0]["restarts_used"] == 0);
}

TEST_CASE("drain names a node by host or address too, refuses an ambiguous host, and drains a spare without a restart") {
  DrainFixture f;
  CHECK(f.sm.drain("job", "10.0.0.3", false).code.empty());  // the spare, by its address
  CHECK(f.out.dropped.count(3) == 1);
  CHECK(f.out.of(1, "restart").empty());
  CHECK(f.out.of(2, "restart").empty());
  DrainFixture g(1, 3, false);  // node1 and node2 run at MIN 1
  NodeSpec twin = spec("node1", 1, 3);
  twin.addr = "10.0.0.9";
  g.sm.join(4, twin);  // a second agent on node1's host joins (and restarts the round below MAX)
  const DrainResult ambiguous = g.sm.drain("job", "node1", false);
  CHECK(ambiguous.code == "unknown_node");
  CHECK(ambiguous.message.find("give the group rank") != std::string::npos);
  CHECK(g.out.dropped.empty());
  CHECK(g.sm.drain("job", "node2", false).code.empty());
  CHECK(g.out.dropped.count(2) == 1);
}

TEST_CASE("a drain that would leave fewer than MIN nodes is refused unless forced; unknown jobs and nodes are named") {
  DrainFixture f(2, 2, false);
  const DrainResult below = f.sm.drain("job", "0", false);
  CHECK(below.code == "drain_refused");
  CHECK(below.message.find("minimum of 2") != std::string::npos);
  CHECK(below.message.find("--force") != std::string::npos);
  CHECK(f.sm.drain("nojob", "0", false).code == "unknown_job");
  CHECK(f.sm.drain("job", "7", false).code == "unknown_node");
  CHECK(f.sm.drain("job", "nosuchhost", false).code == "unknown_node");
  CHECK(f.out.dropped.empty());  // the job is untouched by every refusal
  CHECK(f.out.of(1, "restart").empty());
  CHECK(f.out.of(2, "restart").empty());
  CHECK(f.sm.status()["jobs"][0]["generation"] == 1);
  const DrainResult forced = f.sm.drain("job", "0", true);
  CHECK(forced.code.empty());
  CHECK(forced.message.find("waits join_timeout for 1 more node") != std::string::npos);
  CHECK(f.out.dropped.count(1) == 1);
  REQUIRE(f.out.of(2, "restart").size() == 1);
  f.sm.join(2, spec("node2", 2, 2));  // alone below MIN: it waits (join_timeout) for a node
  CHECK(f.out.of(2, "round").empty());
}

TEST_CASE("a --spare node never counts toward MIN or MAX, never ends a round, and fills in for a lost node only") {
  Fixture f;
  auto spare = [](const std::string& host, int min_nodes, int max_nodes) {
    NodeSpec s = spec(host, min_nodes, max_nodes);
    s.spare = true;
    return s;
  };
  f.sm.join(1, spec("node1", 2, 3));
  f.sm.join(7, spare("node7", 2, 3));  // two waiting, MIN 2: a spare does not make MIN
  f.sm.join(8, spare("node8", 2, 3));
  f.clock.advance(10);
  f.sm.tick();
  CHECK(f.out.of(1, "round").empty());
  CHECK(f.sm.status()["jobs"][0]["nodes"][1]["spare"] == true);
  f.sm.join(2, spec("node2", 2, 3));
  f.clock.advance(5.1);  // last_call_timeout: the round forms with the two regular nodes
  f.sm.tick();
  REQUIRE(f.out.of(1, "round").size() == 1);
  CHECK(f.out.round(1).group_world_size == 2);
  CHECK(f.out.of(7, "round").empty());
  CHECK(f.out.of(8, "round").empty());
  CHECK(f.sm.gauges().spares.at("job") == 2);
  f.out.clear();
  f.sm.join(9, spare("node9", 2, 3));  // below MAX, but a spare: the round goes on
  CHECK(f.out.of(1, "restart").empty());
  f.sm.disconnected(2, "connection closed");  // node2 is lost: one spare takes its place
  REQUIRE(f.out.of(1, "restart").size() == 1);
  f.sm.join(1, spec("node1", 2, 3));
  const Assignment a = f.out.round(1);
  CHECK(a.generation == 2);
  CHECK(a.group_world_size == 2);  // the size of the last round, not MAX
  CHECK(f.out.round(7).group_rank == 1);  // the first spare to arrive
  CHECK(f.out.of(8, "round").empty());
  CHECK(f.out.of(9, "round").empty());
  CHECK(f.sm.gauges().spares.at("job") == 2);
}

// ---- Interned fingerprints (rendezvous/fingerprint_table.h): one copy per distinct fingerprint.

TEST_CASE("env check: many joins with the same fingerprint hold one interned copy; status shows it on every node") {
  EnvFixture f;
  const int n = 40;
  for (int i = 10; i < 10 + n; ++i) {
    f.sm.join(static_cast<ConnId>(i), env_spec("node" + std::to_string(i), n, n, "2.1.0+cu121"));
  }
  CHECK(f.sm.node_count() == static_cast<std::size_t>(n));
  CHECK(f.sm.fingerprint_copies() == 1);
  CHECK(f.out.dropped.empty());
  nlohmann::json job = f.sm.status()["jobs"][0];
  REQUIRE(job["nodes"].size() == static_cast<std::size_t>(n));
  for (const nlohmann::json& node : job["nodes"]) CHECK(node["fingerprint"] == node_fingerprint("2.1.0+cu121"));
  CHECK(job["env"]["agree"] == true);
  CHECK(job["env"]["checked_nodes"] == n);
  for (int i = 10; i < 10 + n; ++i) f.sm.leave(static_cast<ConnId>(i));
  CHECK(f.sm.job_count() == 0);
  CHECK(f.sm.fingerprint_copies() == 0);  // the job ended: its entry went with its last node
}

TEST_CASE("env check: interned fingerprints that differ give the verdict of comparing them directly") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 3, 3, "2.1.0+cu121"));
  f.sm.join(2, env_spec("node2", 3, 3, "2.1.0+cu118"));
  CHECK(f.sm.fingerprint_copies() == 2);
  f.sm.join(3, env_spec("node3", 3, 3, "2.1.0+cu121"));
  const EnvCheckResult direct = compare_fingerprints({{"node1", "10.0.0.1", node_fingerprint("2.1.0+cu121")},
                                                      {"node2", "10.0.0.2", node_fingerprint("2.1.0+cu118")},
                                                      {"node3", "10.0.0.3", node_fingerprint("2.1.0+cu121")}});
  REQUIRE(direct.has_breaking());
  for (ConnId c : {1, 2, 3}) {
    REQUIRE(f.out.dropped.count(c) == 1);
    CHECK(f.out.dropped[c].message == "job job: " + refusal_message(direct));
  }
  CHECK(f.sm.fingerprint_copies() == 0);  // the refused members are gone, and their entries
}

TEST_CASE("env check: in warn mode status diffs interned fingerprints; a leaving node takes its entry") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 3, 3, "2.1.0", "warn"));
  f.sm.join(2, env_spec("node2", 3, 3, "2.2.0", "warn"));
  f.sm.join(3, env_spec("node3", 3, 3, "2.1.0", "warn"));
  CHECK(f.out.dropped.empty());
  CHECK(f.sm.fingerprint_copies() == 2);
  const nlohmann::json env = f.sm.status()["jobs"][0]["env"];
  CHECK(env["agree"] == false);
  CHECK(env["message"] == compare_fingerprints({{"node1", "10.0.0.1", node_fingerprint("2.1.0")},
                                                {"node2", "10.0.0.2", node_fingerprint("2.2.0")},
                                                {"node3", "10.0.0.3", node_fingerprint("2.1.0")}})
                              .message());
  f.sm.leave(2);
  CHECK(f.sm.fingerprint_copies() == 1);
}

TEST_CASE("env check: a node that rejoins with another fingerprint does not change what its peers read") {
  EnvFixture f;
  f.sm.join(1, env_spec("node1", 1, 1, "2.1.0", "warn"));
  f.sm.join(3, env_spec("node3", 1, 1, "2.1.0", "warn"));  // waits beside the running round
  CHECK(f.sm.fingerprint_copies() == 1);
  NodeSpec changed = env_spec("node3", 1, 1, "2.1.0", "warn");
  changed.fingerprint["python"]["torch"] = "9.9.9";
  f.sm.join(3, changed);
  CHECK(f.sm.fingerprint_copies() == 2);
  const nlohmann::json nodes = f.sm.status()["jobs"][0]["nodes"];
  REQUIRE(nodes.size() == 2);
  for (const nlohmann::json& node : nodes) {
    CHECK(node["fingerprint"]["python"]["torch"] == (node["host"] == "node3" ? "9.9.9" : "2.1.0"));
  }
}
