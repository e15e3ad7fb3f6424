// A replica that does not lead (Server::set_leadership, ServerOptions::replicated),
// the not_leader message on both ends, and what a hostile peer can do with it. One io_context on
// the test thread drives the server and the clients (waits have deadlines, no sleeps). Etcd
// job records: the server holds what it says until its records are written (a recorder here).
#include <doctest/doctest.h>

#include <algorithm>

#include "rendezvous/job_record.h"
#include "rendezvous/server.h"
#include "rendezvous/status.h"
#include "tests/rendezvous/loopback.h"
#include "tests/rendezvous/raw_conn.h"

using namespace ddp::rdzv;
using namespace ddp::rdzv::test;
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

const tcp::endpoint kLoopback(asio::ip::make_address("127.0.0.1"), 0);

// A client with on_redirect set, recording what it heard.
struct Redirected {
  std::shared_ptr<Client> client;
  std::optional<std::string> leader;
  std::vector<std::string> lost;
  std::vector<std::string> errors;
  bool welcomed_then_redirected = false;

  Redirected(asio::io_context& io, unsigned short port, const std::string& token = "",
             const std::string& job = "job") {
    ClientOptions o;
    o.job_id = job;
    o.token = token;
    ClientEvents e;
    e.on_redirect = [this](const std::string& l, const std::string& why) {
      leader = l;
      welcomed_then_redirected = why.find("follower replica") != std::string::npos;
    };
    e.on_disconnected = [this](const std::string& m) { lost.push_back(m); };
    e.on_error = [this](const std::string& m) { errors.push_back(m); };
    client = Client::create(io, o, e);
    client->connect(Endpoint{"127.0.0.1", port}, 5);
    client->join(node_spec(job, "h", 1, 1));
  }
};

}  // namespace

TEST_CASE("a follower welcomes an agent, names the leader in not_leader and forms no round") {
  asio::io_context io;
  ServerOptions o;
  o.replicated = true;
  o.token = "s3cret";
  Server follower(io, kLoopback, o);
  CHECK_FALSE(follower.leading());
  follower.set_leadership(false, "10.0.0.7:29400");
  Redirected agent(io, follower.port(), "s3cret");
  REQUIRE(run_until(io, [&] { return agent.leader.has_value(); }, 10));
  CHECK(*agent.leader == "10.0.0.7:29400");
  CHECK(agent.welcomed_then_redirected);
  CHECK(agent.errors.empty());
  CHECK(follower.state().status()["jobs"].empty());  // the join that followed the welcome was ignored
}

TEST_CASE("a leader that loses leadership tells every agent not_leader and forgets its jobs") {
  asio::io_context io;
  ServerOptions o;
  o.replicated = true;
  Server server(io, kLoopback, o);
  server.set_leadership(true, "");
  REQUIRE(server.leading());
  auto a = TestAgent::make(io, server.port(), node_spec("job", "a", 2, 2));
  auto b = TestAgent::make(io, server.port(), node_spec("job", "b", 2, 2));
  REQUIRE(run_until(io, [&] { return a->rounds.size() == 1 && b->rounds.size() == 1; }));
  // A client that follows redirects (the agent's RemoteRendezvous sets on_redirect).
  Redirected c(io, server.port(), "", "other-job");
  REQUIRE(run_until(io, [&] { return c.client->connected(); }));
  server.set_leadership(false, "");
  CHECK(server.state().status()["jobs"].empty());
  REQUIRE(run_until(io, [&] { return c.leader.has_value(); }));
  CHECK(c.leader->empty());  // nobody leads yet: try the other endpoints
  // Clients without on_redirect see a lost connection (not a refusal): they reconnect and resume.
  REQUIRE(run_until(io, [&] { return !a->errors.empty() || !a->client->connected(); }));
  CHECK(a->rounds.size() == 1);
  CHECK(a->restarts.empty());
}

TEST_CASE("status on a replica says whether it leads and who does") {
  asio::io_context io;
  ServerOptions o;
  o.replicated = true;
  Server server(io, kLoopback, o);
  server.set_leadership(false, "head-2:29400");
  auto work = asio::make_work_guard(io);
  std::thread t([&] { io.run(); });
  RawConn conn(server.port());
  conn.send(make_status_request(Hello{}));
  auto reply = conn.recv_type("status_reply");
  asio::post(io, [&] { io.stop(); });
  t.join();
  REQUIRE(reply);
  CHECK((*reply)["status"]["replica"]["leading"] == false);
  CHECK((*reply)["status"]["replica"]["leader"] == "head-2:29400");
}

TEST_CASE("a drain sent to a follower is passed on to the leader it names, and drains there") {
  asio::io_context io;
  Server leader(io, kLoopback, ServerOptions{});
  ServerOptions fo;
  fo.replicated = true;
  Server follower(io, kLoopback, fo);
  follower.set_leadership(false, "127.0.0.1:" + std::to_string(leader.port()));
  auto work = asio::make_work_guard(io);
  std::thread t([&] { io.run(); });
  RawConn agent(leader.port());
  agent.say_hello("job");
  REQUIRE(agent.recv_type("welcome"));
  agent.send(make_join(node_spec("job", "h", 1, 1)));
  REQUIRE(agent.recv_type("round"));
  Drain d;
  d.job = "job";
  d.node = "0";
  d.force = true;
  const StatusResult result = drain_node(Endpoint{"127.0.0.1", follower.port()}, "", 5, d);
  auto dropped = agent.recv_type("error");
  asio::post(io, [&] { io.stop(); });
  t.join();
  CHECK(result.error == "");
  CHECK(result.status.value("job_id", "") == "job");
  REQUIRE(dropped);
  CHECK((*dropped)["code"] == "drained");
}

TEST_CASE("a client that sends not_leader, or a forged one, is refused; the server goes on") {
  asio::io_context io;
  Server server(io, kLoopback, {});
  auto work = asio::make_work_guard(io);
  std::thread t([&] { io.run(); });
  for (nlohmann::json forged : {to_json(make_not_leader("10.0.0.1:1")),
                                nlohmann::json{{"type", "not_leader"}, {"leader", "evil\nhost:1"}},
                                nlohmann::json{{"type", "not_leader"}, {"leader", nlohmann::json::object()}}}) {
    CHECK(refusal_after_welcome(server.port(), "job", forged) == "bad_message");
  }
  RawConn fresh(server.port());
  fresh.say_hello("job");
  CHECK(fresh.recv_type("welcome"));
  asio::post(io, [&] { io.stop(); });
  t.join();
}

TEST_CASE("a peer that sends not_leader before any welcome, or a malformed one, redirects nobody") {
  asio::io_context io;
  // A hostile "server": the real challenge, then a redirect without the welcome that proves it
  // knows the job's secret; a second one sends a leader that is not HOST:PORT.
  for (std::string leader_json : {std::string(R"({"type":"not_leader","leader":"10.6.6.6:29400"})"),
                                  std::string(R"({"type":"not_leader","leader":"10.6.6.6"})")}) {
    tcp::acceptor acceptor(io, kLoopback);
    std::shared_ptr<tcp::socket> peer;
    acceptor.async_accept([&](boost::system::error_code ec, tcp::socket s) {
      if (ec) return;
      peer = std::make_shared<tcp::socket>(std::move(s));
      std::string bytes = *encode(make_challenge("abcd"));
      std::string payload = leader_json;
      std::string header(4, '\0');
      const auto n = static_cast<std::uint32_t>(payload.size());
      header[0] = static_cast<char>(n >> 24);
      header[1] = static_cast<char>(n >> 16);
      header[2] = static_cast<char>(n >> 8);
      header[3] = static_cast<char>(n);
      bytes += header + payload;
      auto buf = std::make_shared<std::string>(bytes);
      asio::async_write(*peer, asio::buffer(*buf), [buf](boost::system::error_code, std::size_t) {});
    });
    Redirected agent(io, acceptor.local_endpoint().port(), "s3cret");
    REQUIRE(run_until(io, [&] { return !agent.lost.empty() || !agent.errors.empty() || agent.leader; }));
    CHECK_FALSE(agent.leader.has_value());
    CHECK_FALSE(agent.client->connected());
  }
}

// Job records: the server's side of "written before agents are told". The writes go to
// a recorder here (the transaction itself is tested on a real etcd by tests/agent/test_etcd_records.py).
TEST_CASE("a leader holds a round's messages until its job records are written, one write per round") {
  asio::io_context io;
  ServerOptions o;
  o.replicated = true;
  std::vector<RecordWrite> writes;
  o.write_records = [&](RecordWrite w) { writes.push_back(std::move(w)); };
  Server server(io, kLoopback, o);
  server.set_leadership(true, "");
  std::vector<std::shared_ptr<TestAgent>> agents;
  for (int i = 0; i < 8; ++i) {
    agents.push_back(TestAgent::make(io, server.port(), node_spec("job", "h" + std::to_string(i), 8, 8)));
  }
  REQUIRE(run_until(io, [&] { return writes.size() == 1; }));
  REQUIRE(writes[0].puts.size() == 1);
  CHECK(writes[0].puts[0].first == "job");
  auto record = std::get<JobRecord>(decode_record(writes[0].puts[0].second));
  CHECK(record.generation == 1);
  CHECK(record.members.size() == 8);
  // Nothing reached the agents before the write commits (the loop ran meanwhile).
  CHECK_FALSE(run_until(io, [&] { return !agents[0]->rounds.empty(); }, 0.3));
  server.records_written(writes[0].seq, "");
  REQUIRE(run_until(io, [&] {
    for (auto& a : agents) {
      if (a->rounds.size() != 1) return false;
    }
    return true;
  }));
  CHECK(writes.size() == 1);  // one transaction for the round of 8 agents
  CHECK(server.record_transactions() == 1);
}

TEST_CASE("a leader whose record write fails tells no agent and steps down") {
  asio::io_context io;
  ServerOptions o;
  o.replicated = true;
  std::vector<RecordWrite> writes;
  o.write_records = [&](RecordWrite w) { writes.push_back(std::move(w)); };
  std::vector<std::string> lines;
  o.log = [&](const std::string& l) { lines.push_back(l); };
  Server server(io, kLoopback, o);
  server.set_leadership(true, "");
  auto a = TestAgent::make(io, server.port(), node_spec("job", "a", 1, 1));
  REQUIRE(run_until(io, [&] { return writes.size() == 1; }));
  server.records_written(writes[0].seq, "deposed");
  CHECK_FALSE(server.leading());
  CHECK(server.state().status()["jobs"].empty());
  REQUIRE(run_until(io, [&] { return !a->client->connected() || !a->errors.empty(); }));
  CHECK(a->rounds.empty());
  CHECK(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("the job records were not written (deposed): stepping down") != std::string::npos;
  }));
  server.records_written(writes[0].seq, "");  // a late answer of the old term changes nothing
  CHECK(a->rounds.empty());
}

TEST_CASE("a new leader loads valid job records and refuses a corrupt one with its reason") {
  asio::io_context io;
  ServerOptions o;
  o.replicated = true;
  o.write_records = [](RecordWrite) {};
  std::vector<std::string> lines;
  o.log = [&](const std::string& l) { lines.push_back(l); };
  Server server(io, kLoopback, o);
  JobRecord r;
  r.job_id = "kept";
  r.min_nodes = r.max_nodes = 2;
  r.max_restarts = 3;
  r.generation = 4;
  r.restarts_used = 2;
  std::vector<std::pair<std::string, std::string>> records = {
      {"/p/jobs/kept", encode_record(r)}, {"/p/jobs/bad", "{\"job_id\": 7}"}, {"/p/jobs/deep", std::string(64, '[')}};
  server.set_leadership(true, "", &records);
  auto jobs = server.state().status()["jobs"];
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["job_id"] == "kept");
  CHECK(jobs[0]["restarts_used"] == 2);
  CHECK(jobs[0]["generation"] == 4);
  auto logged = [&](const std::string& words) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(words) != std::string::npos; });
  };
  CHECK(logged("refused the job record /p/jobs/bad: a job record: \"job_id\" must be a string"));
  CHECK(logged("refused the job record /p/jobs/deep: a job record nested deeper than 8 levels"));
  CHECK(logged("1 job(s) loaded from 3 record(s) before serving"));
}
