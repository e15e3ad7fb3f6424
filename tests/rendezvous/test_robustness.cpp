// Bad input: each case checks the offender gets a clear error or is dropped,
// and that another session and another job on the same server keep working.
#include <doctest/doctest.h>

#include <atomic>
#include <fstream>
#include <future>
#include <thread>

#include "rendezvous/server.h"
#include "tests/rendezvous/loopback.h"
#include "tests/rendezvous/raw_conn.h"

using namespace ddp::rdzv;
using namespace ddp::rdzv::test;
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

// A server on its own io_context thread, like the daemon.
struct ServerThread {
  asio::io_context io{1};
  std::unique_ptr<Server> server;
  std::thread thread;

  explicit ServerThread(ServerOptions options) {
    server = std::make_unique<Server>(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0), options);
    thread = std::thread([this] { io.run(); });
  }
  ~ServerThread() {
    asio::post(io, [this] { server->stop(); io.stop(); });
    thread.join();
  }
  unsigned short port() const { return server->port(); }
  // Reads a server value on its own thread (no data race).
  template <typename F>
  auto on_server(F f) {
    std::packaged_task<decltype(f())()> task(f);
    auto fut = task.get_future();
    asio::post(io, [&task] { task(); });
    return fut.get();
  }
};

// Polls `done` (a thread that runs no io_context meanwhile) until it holds or the deadline passes.
bool wait_until(const std::function<bool()>& done, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

NodeSpec one_node(const std::string& job) {
  NodeSpec s = node_spec(job, "healthy", 1, 1);
  s.timeouts.heartbeat_timeout = 30;
  return s;
}

// A healthy agent already in a running round on the server.
struct Healthy {
  RawConn conn;
  Healthy(unsigned short port, const std::string& token = "") : conn(port) {
    REQUIRE(conn.connected());
    conn.say_hello("healthy-job", token);
    REQUIRE(conn.recv_type("welcome"));
    conn.send(make_join(one_node("healthy-job")));
    REQUIRE(conn.recv_type("round"));
  }
  // The existing session still answers, and a brand-new job still forms a round.
  void check_server_still_serves(unsigned short port, const std::string& token = "") {
    conn.send(make_heartbeat());
    CHECK(conn.recv_type("heartbeat_ack"));
    RawConn fresh(port);
    REQUIRE(fresh.connected());
    fresh.say_hello("other-job", token);
    CHECK(fresh.recv_type("welcome"));
    fresh.send(make_join(one_node("other-job")));
    auto round = fresh.recv_type("round");
    REQUIRE(round);
    CHECK((*round)["assignment"]["group_rank"] == 0);
  }
};

std::size_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

TEST_CASE("a wrong token gets a bad_token error and that connection closes; others go on") {
  ServerOptions o;
  o.token = "s3cret";
  ServerThread st(o);
  Healthy healthy(st.port(), "s3cret");
  RawConn bad(st.port());
  bad.say_hello("healthy-job", "guess");
  auto err = bad.recv_type("error");
  REQUIRE(err);
  CHECK((*err)["code"] == "bad_token");
  CHECK((*err)["message"].get<std::string>().find("token_file") != std::string::npos);
  CHECK(bad.wait_closed());
  healthy.check_server_still_serves(st.port(), "s3cret");
}

TEST_CASE("a message before a valid hello is refused even with the right job id") {
  ServerOptions o;
  o.token = "s3cret";
  ServerThread st(o);
  Healthy healthy(st.port(), "s3cret");
  RawConn bad(st.port());
  bad.send(make_join(one_node("healthy-job")));
  auto err = bad.recv_type("error");
  REQUIRE(err);
  CHECK((*err)["code"] == "bad_message");
  CHECK(bad.wait_closed());
  healthy.check_server_still_serves(st.port(), "s3cret");
}

TEST_CASE("a client that sends the server's waiting message, or a forged one, is refused; others go on") {
  ServerThread st({});
  Healthy healthy(st.port());
  for (nlohmann::json forged : {to_json(make_waiting(Waiting{"healthy-job", 5, 0, 1, 9, 1.0, std::nullopt})),
                                nlohmann::json{{"type", "waiting"}, {"waiting", -7}, {"job_id", 42}}}) {
    CHECK(refusal_after_welcome(st.port(), "healthy-job", forged) == "bad_message");
  }
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("a member's heartbeat with bad progress is refused and closes only its connection; good progress shows in status") {
  ServerThread st({});
  Healthy healthy(st.port());
  for (const nlohmann::json& bad : {nlohmann::json{{"type", "heartbeat"}, {"step", "lots"}},
                                    nlohmann::json{{"type", "heartbeat"}, {"step", -5}},
                                    nlohmann::json{{"type", "heartbeat"}, {"checkpoint_step", 1e30}},
                                    nlohmann::json{{"type", "heartbeat"}, {"checkpoint_interval", -1}},
                                    nlohmann::json{{"type", "heartbeat"}, {"checkpoint_interval", {{"s", 1}}}},
                                    nlohmann::json{{"type", "heartbeat"}, {"busy", 0.2}},  // without its rank
                                    nlohmann::json{{"type", "heartbeat"}, {"busy", -0.2}, {"busy_rank", 0}},
                                    nlohmann::json{{"type", "heartbeat"}, {"busy", 1e300}, {"busy_rank", 0}},
                                    nlohmann::json{{"type", "heartbeat"}, {"busy", 0.2}, {"busy_rank", -1}},
                                    nlohmann::json{{"type", "heartbeat"}, {"busy", 0.2}, {"busy_rank", 1 << 30}},
                                    nlohmann::json{{"type", "heartbeat"}, {"busy", "slow"}, {"busy_rank", 0}}}) {
    CAPTURE(bad.dump());
    RawConn member(st.port());
    member.say_hello("progress-job", "");
    REQUIRE(member.recv_type("welcome"));
    member.send(make_join(one_node("progress-job")));
    REQUIRE(member.recv_type("round"));
    member.send(bad);
    auto err = member.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_message");
    CHECK(member.wait_closed());
  }
  // What an honest agent says is kept: the server's status has it.
  NodeProgress p;
  p.step = 77;
  p.checkpoint_step = 70;
  p.checkpoint_interval = 42;
  p.busy = 0.25;
  p.busy_local_rank = 0;
  healthy.conn.send(make_heartbeat(p));
  REQUIRE(healthy.conn.recv_type("heartbeat_ack"));
  const nlohmann::json status = st.on_server([&] { return st.server->state().status(); });
  bool seen = false;
  for (const auto& job : status["jobs"]) {
    if (job["job_id"] != "healthy-job") continue;
    seen = true;
    CHECK(job["checkpoint_interval"] == 42.0);
    CHECK(job["nodes"][0]["last_step"] == 77);
    CHECK(job["nodes"][0]["last_checkpoint"] == 70);
    CHECK(job["nodes"][0]["busy"] == 0.25);
    CHECK(job["nodes"][0]["busy_rank"] == 0);
  }
  CHECK(seen);
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("a join with a malformed straggler policy is refused and joins nothing; a member's absurd busy rank is ignored") {
  ServerThread st({});
  Healthy healthy(st.port());
  for (const nlohmann::json& bad : {nlohmann::json{{"mode", "evict"}}, nlohmann::json{{"factor", -1}},
                                    nlohmann::json{{"window", 1e300}}, nlohmann::json{{"mode", {{"a", 1}}}},
                                    nlohmann::json::array({1, 2})}) {
    CAPTURE(bad.dump());
    RawConn joiner(st.port());
    joiner.say_hello("straggler-job", "");
    REQUIRE(joiner.recv_type("welcome"));
    nlohmann::json join = to_json(make_join(one_node("straggler-job")));
    join["node"]["straggler"] = bad;
    joiner.send(join);
    auto err = joiner.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_join");
    CHECK(joiner.wait_closed());
  }
  // A busy rank beyond the member's workers (one here) is well-formed on the wire, but the
  // server does not believe it: status shows no busy time for the node.
  NodeProgress p;
  p.step = 5;
  p.busy = 0.5;
  p.busy_local_rank = 3;
  healthy.conn.send(make_heartbeat(p));
  REQUIRE(healthy.conn.recv_type("heartbeat_ack"));
  const nlohmann::json status = st.on_server([&] { return st.server->state().status(); });
  for (const auto& job : status["jobs"]) {
    if (job["job_id"] == "healthy-job") CHECK_FALSE(job["nodes"][0].contains("busy"));
    CHECK(job["job_id"] != "straggler-job");  // no refused join made a job
  }
  healthy.check_server_still_serves(st.port());
}

namespace {

// A client of `job` that said hello but never joined, and the member of a job of its own.
struct Strangers {
  RawConn outsider;
  RawConn other;
  Strangers(unsigned short port, const std::string& job, const std::string& other_job) : outsider(port), other(port) {
    outsider.say_hello(job, "");
    REQUIRE(outsider.recv_type("welcome"));
    other.say_hello(other_job, "");
    REQUIRE(other.recv_type("welcome"));
    other.send(make_join(one_node(other_job)));
    REQUIRE(other.recv_type("round"));
  }
  // Both still served, still open.
  void check_still_served() {
    outsider.send(make_heartbeat());
    CHECK(outsider.recv_type("heartbeat_ack"));
    other.send(make_heartbeat());
    CHECK(other.recv_type("heartbeat_ack"));
  }
};

}  // namespace

TEST_CASE("stall reports: malformed ones are refused; one from a non-member or another job's member probes nobody") {
  ServerThread st({});
  Healthy healthy(st.port());
  for (const nlohmann::json& bad : {nlohmann::json{{"type", "stall"}},
                                    nlohmann::json{{"type", "stall"}, {"stalled_for", "long"}},
                                    nlohmann::json{{"type", "stall"}, {"stalled_for", -1}},
                                    nlohmann::json{{"type", "stall"}, {"stalled_for", 1e30}},
                                    nlohmann::json{{"type", "stall"}, {"stalled_for", {{"s", 1}}}},
                                    nlohmann::json{{"type", "probe"}}}) {
    CAPTURE(bad.dump());
    CHECK(refusal_after_welcome(st.port(), "healthy-job", bad) == "bad_message");
  }
  // A client of the same job that never joined, and the member of a job of its own, report
  // stalls as fast as they can: neither names the healthy node, so nothing probes or drops it.
  Strangers s(st.port(), "healthy-job", "attack-job");
  for (int i = 0; i < 200; ++i) {
    s.outsider.send(make_stall(1000));
    s.other.send(make_stall(1000));
  }
  s.check_still_served();
  healthy.conn.send(make_heartbeat());
  auto next = healthy.conn.recv();
  REQUIRE(next);
  CHECK((*next)["type"] == "heartbeat_ack");  // no probe came first
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("peer_alive: malformed ones are refused; forged ones, from anyone, change nothing") {
  ServerThread st({});
  Healthy healthy(st.port());
  for (const nlohmann::json& bad :
       {nlohmann::json{{"type", "peer_alive"}}, nlohmann::json{{"type", "peer_alive"}, {"id", 0}},
        nlohmann::json{{"type", "peer_alive"}, {"id", "1"}}, nlohmann::json{{"type", "peer_alive"}, {"id", 1e30}},
        nlohmann::json{{"type", "peer_alive"}, {"id", {{"id", 1}}}},
        nlohmann::json{{"type", "check_peer"}, {"id", 1}, {"addr", "127.0.0.1"}, {"port", 1}, {"within", 1}}}) {
    CAPTURE(bad.dump());
    CHECK(refusal_after_welcome(st.port(), "healthy-job", bad) == "bad_message");
  }
  // A client of the job that never joined, and the member of a job of its own, vouch for ids
  // nobody asked about, as fast as they can.
  Strangers s(st.port(), "healthy-job", "vouch-job");
  for (std::uint64_t id = 1; id <= 200; ++id) {
    s.outsider.send(make_peer_alive(id));
    s.other.send(make_peer_alive(kMaxCheckId - id));
  }
  s.check_still_served();
  healthy.check_server_still_serves(st.port());
}

namespace {

// What the server answers an operator's drain sent on a fresh connection (hello.job_id = the
// job whose secret is proven): "drained", or the error's code.
std::string drain_answer(unsigned short port, const std::string& secret_job, const std::string& secret,
                         const std::string& job, const std::string& node, bool force = false) {
  RawConn c(port);
  REQUIRE(c.connected());
  Drain d;
  d.hello.job_id = secret_job;
  d.hello.client_nonce = random_hex(16);
  auto challenge = c.recv_type("challenge");
  REQUIRE(challenge);
  if (!secret.empty()) {
    d.hello.proof = auth_proof(secret, "drain", (*challenge)["nonce"].get<std::string>(), d.hello.client_nonce,
                               secret_job);
  }
  d.job = job;
  d.node = node;
  d.force = force;
  c.send(make_drain(d));
  auto answer = c.recv();
  CHECK(c.wait_closed());
  if (!answer) return "no answer";
  if ((*answer)["type"] == "drained") return "drained";
  return (*answer).value("code", std::string("?"));
}

}  // namespace

TEST_CASE("drain: no secret, a wrong one, another job's own, or an unknown job or node is refused, and the job runs on") {
  ServerOptions o;
  o.secrets.set_cluster("s3cret");
  o.secrets.set_job("side-job", "side");
  ServerThread st(o);
  Healthy healthy(st.port(), "s3cret");
  CHECK(drain_answer(st.port(), "healthy-job", "", "healthy-job", "0", true) == "bad_token");
  CHECK(drain_answer(st.port(), "healthy-job", "guess", "healthy-job", "0", true) == "bad_token");
  CHECK(drain_answer(st.port(), "side-job", "side", "healthy-job", "0", true) == "bad_token");
  CHECK(drain_answer(st.port(), "nojob", "s3cret", "nojob", "0", true) == "unknown_job");
  CHECK(drain_answer(st.port(), "healthy-job", "s3cret", "healthy-job", "3", true) == "unknown_node");
  CHECK(drain_answer(st.port(), "healthy-job", "s3cret", "healthy-job", "0") == "drain_refused");  // MIN is 1
  // Malformed drains, and a drain inside an agent's connection.
  for (const nlohmann::json& bad : {nlohmann::json{{"type", "drain"}, {"protocol_version", kProtocolVersion}},
                                    nlohmann::json{{"type", "drain"}, {"protocol_version", kProtocolVersion},
                                                   {"job", "healthy-job"}, {"node", 0}},
                                    nlohmann::json{{"type", "drain"}, {"protocol_version", kProtocolVersion},
                                                   {"job", "healthy-job"}, {"node", "0"}, {"force", 1}}}) {
    CAPTURE(bad.dump());
    RawConn c(st.port());
    REQUIRE(c.recv_type("challenge"));
    c.send(bad);
    auto err = c.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_message");
  }
  healthy.conn.send(make_heartbeat());
  auto next = healthy.conn.recv();
  REQUIRE(next);
  CHECK((*next)["type"] == "heartbeat_ack");  // no restart, no drop came first
  healthy.check_server_still_serves(st.port(), "s3cret");
}

TEST_CASE("drain with the secret: the node hears it was drained and closes; --force may leave fewer than MIN") {
  ServerOptions o;
  o.token = "s3cret";
  ServerThread st(o);
  Healthy healthy(st.port(), "s3cret");
  CHECK(drain_answer(st.port(), "healthy-job", "s3cret", "healthy-job", "healthy", true) == "drained");
  auto err = healthy.conn.recv_type("error");
  REQUIRE(err);
  CHECK((*err)["code"] == "drained");
  CHECK(healthy.conn.wait_closed());
  RawConn fresh(st.port());
  fresh.say_hello("other-job", "s3cret");
  CHECK(fresh.recv_type("welcome"));
}

TEST_CASE("a drain inside an agent's connection is refused and drains nothing") {
  ServerThread st({});
  Healthy healthy(st.port());
  CHECK(refusal_after_welcome(st.port(), "healthy-job", to_json(make_drain(Drain{{}, "healthy-job", "0", true}))) ==
        "bad_message");
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("a member's stall reports cannot cost a node that answers its probes its place") {
  ServerThread st({});
  NodeSpec s = node_spec("probe-job", "honest", 2, 2);
  s.timeouts.heartbeat_timeout = 30;
  s.timeouts.heartbeat_interval = 1.0;
  s.timeouts.probe_timeout = 1.0;  // generous: the honest node answers from this loop
  RawConn honest(st.port()), liar(st.port());
  honest.say_hello("probe-job", "");
  liar.say_hello("probe-job", "");
  REQUIRE(honest.recv_type("welcome"));
  REQUIRE(liar.recv_type("welcome"));
  honest.send(make_join(s));
  s.host = "liar";
  liar.send(make_join(s));
  REQUIRE(honest.recv_type("round"));
  REQUIRE(liar.recv_type("round"));
  // The liar says its workers stalled, again and again; the honest node answers each probe.
  int probes = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < until) {
    liar.send(make_stall(0.001));
    if (auto m = honest.recv(0.05)) {
      if ((*m)["type"] == "probe") {
        ++probes;
        honest.send(make_heartbeat());
      }
      CHECK((*m)["type"] != "error");
      CHECK((*m)["type"] != "restart");
    }
  }
  CHECK(probes >= 1);
  CHECK(probes <= 2);  // a node that answered is not probed again within a heartbeat_interval (1 s)
  honest.send(make_heartbeat());
  CHECK(honest.recv_type("heartbeat_ack"));
}

TEST_CASE("a wrong protocol version gets a version_mismatch error naming both versions") {
  ServerThread st({});
  Healthy healthy(st.port());
  RawConn bad(st.port());
  REQUIRE(bad.recv_type("challenge"));
  bad.send(nlohmann::json{{"type", "hello"}, {"protocol_version", 42}, {"job_id", "x"}});
  auto err = bad.recv_type("error");
  REQUIRE(err);
  CHECK((*err)["code"] == "version_mismatch");
  std::string m = (*err)["message"];
  CHECK(m.find("42") != std::string::npos);
  CHECK(m.find("version " + std::to_string(kProtocolVersion)) != std::string::npos);
  CHECK(bad.wait_closed());
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("malformed JSON gets a bad_json error, before and after hello") {
  ServerThread st({});
  Healthy healthy(st.port());
  {
    RawConn bad(st.port());
    bad.send_raw_payload("{\"type\": \"hello\", ");
    auto err = bad.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_json");
    CHECK(bad.wait_closed());
  }
  {
    RawConn bad(st.port());
    bad.say_hello("j", "");
    REQUIRE(bad.recv_type("welcome"));
    bad.send_raw_payload("\xff\xfe garbage");
    auto err = bad.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_json");
    CHECK(bad.wait_closed());
  }
  {
    RawConn bad(st.port());
    bad.say_hello("j", "");
    REQUIRE(bad.recv_type("welcome"));
    bad.send({{"type", "join"}, {"node", {{"local_world_size", "four"}}}});
    auto err = bad.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_join");
    CHECK((*err)["message"].get<std::string>().find("local_world_size") != std::string::npos);
  }
  {
    RawConn bad(st.port());
    bad.say_hello("j", "");
    REQUIRE(bad.recv_type("welcome"));
    bad.send({{"type", "launch_missiles"}});
    auto err = bad.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["message"].get<std::string>().find("launch_missiles") != std::string::npos);
  }
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("a failure report's fatal mark must be a string; an oversized one is truncated, and ends only its own job") {
  ServerThread st({});
  Healthy healthy(st.port());
  for (const nlohmann::json& bad_mark : {nlohmann::json(42), nlohmann::json(true), nlohmann::json::array({"x"}),
                                         nlohmann::json({{"reason", "x"}})}) {
    RawConn bad(st.port());
    bad.say_hello("fatal-job", "");
    REQUIRE(bad.recv_type("welcome"));
    bad.send(make_join(one_node("fatal-job")));
    REQUIRE(bad.recv_type("round"));
    bad.send({{"type", "failure"}, {"failure", {{"host", "h"}, {"rank", 0}, {"exit_code", 3}, {"fatal", bad_mark}}}});
    auto err = bad.recv_type("error");
    REQUIRE(err);
    CHECK((*err)["code"] == "bad_message");
    CHECK((*err)["message"].get<std::string>().find("\"fatal\" must be a string") != std::string::npos);
    CHECK(bad.wait_closed());
  }
  {
    // A reason far over the cap: the job fails with it cut to the cap, the server is unharmed.
    RawConn loud(st.port());
    loud.say_hello("fatal-job", "");
    REQUIRE(loud.recv_type("welcome"));
    loud.send(make_join(one_node("fatal-job")));
    REQUIRE(loud.recv_type("round"));
    loud.send({{"type", "failure"},
               {"failure", {{"host", "h"}, {"rank", 0}, {"exit_code", 3}, {"fatal", std::string(500000, 'r')}}}});
    REQUIRE(loud.recv_type("restart"));
    loud.send(make_join(one_node("fatal-job")));
    auto failed = loud.recv_type("job_failed");
    REQUIRE(failed);
    const std::string summary = (*failed)["summary"];
    CHECK(summary.size() < kMaxFailureMessageBytes + 200);
    CHECK(summary.find(kTruncatedMarker) != std::string::npos);
  }
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("an oversized frame is refused from its header without allocating it") {
  ServerThread st({});
  Healthy healthy(st.port());
  const std::size_t before = rss_bytes();
  RawConn bad(st.port());
  unsigned char h[4];
  write_frame_header(0xF0000000u, h);  // 3.75 GiB announced
  bad.send_bytes(std::string(reinterpret_cast<char*>(h), 4) + "{\"type\":");
  auto err = bad.recv_type("error");
  REQUIRE(err);
  CHECK((*err)["code"] == "too_large");
  CHECK((*err)["message"].get<std::string>().find("4026531840") != std::string::npos);
  CHECK(bad.wait_closed());
  // Had the server allocated (and zero-filled) the frame, this process would have grown by GiBs.
  CHECK(rss_bytes() < before + (64u << 20));
  // Just over the default limit: refused too.
  RawConn bad2(st.port());
  bad2.say_hello("j", "");
  REQUIRE(bad2.recv_type("welcome"));
  bad2.send_raw_payload("{\"type\":\"heartbeat\",\"pad\":\"" + std::string(kDefaultMaxFrameBytes, 'x') + "\"}");
  auto err2 = bad2.recv_type("error");
  REQUIRE(err2);
  CHECK((*err2)["code"] == "too_large");
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("a half-open connection that never says hello is dropped at the hello deadline") {
  ServerOptions o;
  o.hello_timeout = 0.3;
  ServerThread st(o);
  Healthy healthy(st.port());
  RawConn silent(st.port());
  RawConn partial(st.port());
  partial.send_bytes(std::string("\0\0", 2));  // half a header, then nothing
  auto err = silent.recv_type("error", 5);
  REQUIRE(err);
  CHECK((*err)["code"] == "hello_timeout");
  CHECK(silent.wait_closed());
  CHECK(partial.wait_closed());
  CHECK(st.on_server([&] { return st.server->unauthenticated_count(); }) == 0);
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("a flood of connections is capped and the server keeps serving") {
  ServerOptions o;
  o.max_connections = 40;
  o.max_unauthenticated = 10;
  o.hello_timeout = 0.5;
  ServerThread st(o);
  Healthy healthy(st.port());
  std::vector<std::unique_ptr<RawConn>> flood;
  std::size_t max_seen = 0, max_unauth = 0;
  for (int i = 0; i < 200; ++i) {
    flood.push_back(std::make_unique<RawConn>(st.port()));  // the kernel backlog takes them
    if (i % 20 == 0) {
      max_seen = std::max(max_seen, st.on_server([&] { return st.server->connection_count(); }));
      max_unauth = std::max(max_unauth, st.on_server([&] { return st.server->unauthenticated_count(); }));
    }
  }
  // Authenticated sessions beyond the limit are answered "busy".
  std::vector<std::unique_ptr<RawConn>> authed;
  for (int i = 0; i < 60; ++i) {
    auto c = std::make_unique<RawConn>(st.port());
    Hello h;  // no secret on this server: hello needs no answer to the challenge
    h.job_id = "flood-" + std::to_string(i);
    c->send(make_hello(h));
    authed.push_back(std::move(c));
  }
  // The existing session is unaffected while the flood sits there.
  healthy.conn.send(make_heartbeat());
  CHECK(healthy.conn.recv_type("heartbeat_ack"));
  for (int i = 0; i < 20; ++i) {
    max_seen = std::max(max_seen, st.on_server([&] { return st.server->connection_count(); }));
    max_unauth = std::max(max_unauth, st.on_server([&] { return st.server->unauthenticated_count(); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // sampling, not a timing assertion
  }
  CHECK(max_unauth <= o.max_unauthenticated);
  CHECK(max_seen <= o.max_connections + 1);  // +1: the one being told "busy"
  // The silent flood is dropped at the hello deadline, in batches; then we are back to normal.
  flood.clear();
  authed.clear();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (st.on_server([&] { return st.server->connection_count(); }) > 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(st.on_server([&] { return st.server->connection_count(); }) == 1);
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("connections that never say hello cannot keep an honest client out: the oldest of them is closed") {
  ServerOptions o;
  o.max_unauthenticated = 10;
  o.hello_timeout = 600;  // only eviction can free a place within this test's deadlines
  ServerThread st(o);
  Healthy healthy(st.port());
  std::vector<std::unique_ptr<RawConn>> flood;
  for (int i = 0; i < 50; ++i) flood.push_back(std::make_unique<RawConn>(st.port()));
  // Accepting never paused: the honest client, behind 50 silent ones, is served.
  RawConn honest(st.port());
  REQUIRE(honest.connected());
  honest.say_hello("honest-job", "");
  REQUIRE(honest.recv_type("welcome"));
  honest.send(make_join(one_node("honest-job")));
  CHECK(honest.recv_type("round"));
  // The oldest silent connections were closed, the newest are still held, within the budget.
  CHECK(flood.front()->wait_closed());
  CHECK(st.on_server([&] { return st.server->unauthenticated_count(); }) <= o.max_unauthenticated);
  CHECK(st.on_server([&] { return st.server->unauthenticated_count(); }) >= 1);
  healthy.conn.send(make_heartbeat());
  CHECK(healthy.conn.recv_type("heartbeat_ack"));
  healthy.check_server_still_serves(st.port());
}

TEST_CASE("an agent that did not run for longer than heartbeat_timeout reads what the server said before blaming it") {
  // The agent's process stalls (SIGSTOP, a starved machine, a paused VM) while the server drops
  // it for silence. When it runs again, its heartbeat timer and its socket are ready at once; the
  // server's word ("dropped this node") must win over "the server was silent". The stall here is
  // a handler that runs just before the client's heartbeat, in the same batch of expired timers,
  // and waits for the server's drop: the heartbeat's handler is then queued before the socket's
  // data is even seen, the order in which a stopped process can wake.
  ServerThread st(ServerOptions{});
  for (int i = 0; i < 6; ++i) {
    CAPTURE(i);
    asio::io_context io;
    NodeSpec spec = node_spec("stall-" + std::to_string(i), "h", 1, 1);
    spec.timeouts.heartbeat_interval = 0.05;
    spec.timeouts.heartbeat_timeout = 0.3;
    std::vector<std::string> lost;
    std::size_t rounds = 0;
    ClientEvents e;
    e.on_round = [&](const Assignment&) { ++rounds; };
    e.on_disconnected = [&](const std::string& m) { lost.push_back(m); };
    e.on_error = [&](const std::string& m) { lost.push_back("error: " + m); };
    ClientOptions o;
    o.job_id = spec.job_id;
    auto client = Client::create(io, o, e);
    client->connect(Endpoint{"127.0.0.1", st.port()}, 10.0);
    client->join(spec);
    REQUIRE(run_until(io, [&] { return rounds == 1; }));
    bool dropped = false;
    asio::steady_timer stall(io);
    stall.expires_at(asio::steady_timer::clock_type::now() - std::chrono::hours(1));  // the first to run
    stall.async_wait([&](boost::system::error_code) {
      dropped = wait_until([&] { return st.on_server([&] { return st.server->connection_count(); }) == 0; }, 10.0);
    });
    // Not running the io_context meanwhile: the client's next heartbeat expires too, unrun.
    std::this_thread::sleep_for(std::chrono::duration<double>(4 * spec.timeouts.heartbeat_interval));
    REQUIRE(run_until(io, [&] { return !lost.empty(); }));
    REQUIRE(dropped);
    CHECK(lost[0].find("dropped this node") != std::string::npos);
    CHECK(lost[0].find("silent for") == std::string::npos);
  }
}

TEST_CASE("a server that did not run for longer than heartbeat_timeout drops none of the nodes that kept sending") {
  // The server's process stalls while a member keeps heartbeating. When it runs again, its
  // deadline check may run before it reads the heartbeats that waited: here a handler queued just
  // before an expired tick holds the server's thread, the order in which a stopped process wakes.
  ServerThread st(ServerOptions{});
  RawConn member(st.port());
  REQUIRE(member.connected());
  member.say_hello("stalled-server", "");
  REQUIRE(member.recv_type("welcome"));
  NodeSpec spec = node_spec("stalled-server", "h", 1, 1);
  spec.timeouts.heartbeat_interval = 0.05;
  spec.timeouts.heartbeat_timeout = 0.5;
  member.send(make_join(spec));
  REQUIRE(member.recv_type("round"));
  std::atomic<bool> stalling{false};
  asio::post(st.io, [&] {
    // Busy long enough for the next tick to expire; the stall is armed to run just before it.
    auto stall = std::make_shared<asio::steady_timer>(st.io);
    stall->expires_at(asio::steady_timer::clock_type::now() - std::chrono::hours(1));
    stall->async_wait([&, stall](boost::system::error_code) {
      stalling = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the stall, not a measurement
      stalling = false;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  });
  REQUIRE(wait_until([&] { return stalling.load(); }, 10.0));
  member.send(make_heartbeat());  // read only after the stall
  REQUIRE(wait_until([&] { return !stalling.load(); }, 10.0));
  member.send(make_heartbeat());
  auto ack = member.recv_type("heartbeat_ack");
  CHECK(ack);
  CHECK(st.on_server([&] { return st.server->state().node_count(); }) == 1);
}

TEST_CASE("a busy server tells an extra connection why it is refused") {
  ServerOptions o;
  o.max_connections = 2;
  ServerThread st(o);
  Healthy healthy(st.port());
  RawConn second(st.port());
  second.say_hello("j", "");
  REQUIRE(second.recv_type("welcome"));
  RawConn third(st.port());
  auto err = third.recv_type("error");
  REQUIRE(err);
  CHECK((*err)["code"] == "busy");
  CHECK((*err)["message"].get<std::string>().find("limit of 2 connections") != std::string::npos);
  healthy.conn.send(make_heartbeat());
  CHECK(healthy.conn.recv_type("heartbeat_ack"));
}

TEST_CASE("a client that never reads cannot make the server grow without bound") {
  ServerOptions o;
  o.max_queued_bytes = 64 << 10;
  ServerThread st(o);
  Healthy healthy(st.port());
  RawConn hog(st.port());
  hog.say_hello("hog", "");
  // Thousands of heartbeats whose acks are never read: the kernel buffers fill, then the
  // server's queue limit cuts the connection rather than growing.
  std::string burst;
  for (int i = 0; i < 2000; ++i) burst += *encode(make_heartbeat());
  for (int i = 0; i < 1000; ++i) {
    if (!hog.send_bytes(burst)) break;
  }
  // The server cut it off once its unread answers passed the queue limit.
  CHECK(hog.wait_closed(10));
  healthy.check_server_still_serves(st.port());
}

// The server's reactor is edge-triggered (epoll): a frame and the FIN that came with it are one
// arrival when the server's thread is held while both come. A session that reads once and then
// waits must still see the close at once (asio re-arms the descriptor when a wait starts), or
// the node would be lost only at heartbeat_timeout, 30 s here. The node half-closes, so the round
// the server then writes to it is accepted: no RST gives the close away.
TEST_CASE("a member whose last frame and close arrive together is lost at once, not at heartbeat_timeout") {
  ServerThread st(ServerOptions{});
  NodeSpec spec = node_spec("together", "a", 2, 2);
  spec.timeouts.heartbeat_timeout = 30;
  RawConn a(st.port());
  REQUIRE(a.connected());
  a.say_hello("together");
  REQUIRE(a.recv_type("welcome"));
  REQUIRE(a.send(make_join(spec)));
  RawConn b(st.port());
  REQUIRE(b.connected());
  b.say_hello("together");
  REQUIRE(b.recv_type("welcome"));
  std::promise<void> release;
  std::promise<void> held;
  asio::post(st.io, [&] {
    held.set_value();
    release.get_future().wait();  // the server's thread waits here while b sends and closes
  });
  held.get_future().wait();
  spec.host = "b";
  REQUIRE(b.send(make_join(spec)));
  b.shutdown_write();  // on loopback the frame and the FIN are in the server's socket at once
  release.set_value();
  REQUIRE(a.recv_type("round"));
  auto restart = a.recv_type("restart", 5);  // at once; heartbeat_timeout would take 30 s
  REQUIRE(restart);
}

// A join larger than the server's read buffer, arriving at once (one edge), is read whole:
// nothing of it waits for the client's next message.
TEST_CASE("a join larger than the read buffer, arriving at once, is handled without another message") {
  ServerThread st(ServerOptions{});
  NodeSpec spec = node_spec("bigjoin", "big", 1, 1);
  for (int i = 0; i < 260; ++i) spec.fingerprint["component" + std::to_string(i)] = std::string(300, 'x');
  RawConn c(st.port());
  REQUIRE(c.connected());
  c.say_hello("bigjoin");
  REQUIRE(c.recv_type("welcome"));
  std::promise<void> release, held;
  asio::post(st.io, [&] {
    held.set_value();
    release.get_future().wait();
  });
  held.get_future().wait();
  const Frame join = encode(make_join(spec));
  REQUIRE(join->size() > 64 * 1024);
  REQUIRE(c.send_bytes(*join));
  release.set_value();
  CHECK(c.recv_type("round", 5));
}
