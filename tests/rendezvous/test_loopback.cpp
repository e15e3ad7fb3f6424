// Loopback tests: a real Server and real Clients on 127.0.0.1, one io_context on the test thread.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "rendezvous/reach.h"
#include "rendezvous/status.h"
#include "tests/rendezvous/loopback.h"
#include "tests/rendezvous/raw_conn.h"

using namespace ddp::rdzv;
using namespace ddp::rdzv::test;
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

tcp::endpoint loopback_any_port() { return {asio::ip::make_address("127.0.0.1"), 0}; }

bool all_have_rounds(const std::vector<std::shared_ptr<TestAgent>>& agents, std::size_t n) {
  for (auto& a : agents) {
    if (a->rounds.size() < n) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("an embedded server on port 0 reports the port it bound") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  CHECK(server.port() != 0);
  CHECK(server.local_endpoint().address().to_string() == "127.0.0.1");
}

TEST_CASE("four agents form one round with group ranks 0..3, rank offsets and a reachable master") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  std::vector<std::shared_ptr<TestAgent>> agents;
  const int workers[] = {2, 1, 3, 2};
  for (int i = 0; i < 4; ++i) {
    agents.push_back(TestAgent::make(io, server.port(), node_spec("job", "host" + std::to_string(i), 4, 4, workers[i])));
  }
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 1); }));
  std::vector<int> seen(4, 0);
  for (auto& a : agents) {
    const Assignment& r = a->rounds[0];
    CHECK(a->errors.empty());
    CHECK(r.world_size == 8);
    CHECK(r.group_world_size == 4);
    CHECK(r.master_addr == "127.0.0.1");  // filled from the connection's local address
    CHECK(r.master_port == 40000);
    REQUIRE(r.group_rank >= 0);
    REQUIRE(r.group_rank < 4);
    seen[r.group_rank]++;
  }
  CHECK(seen == std::vector<int>{1, 1, 1, 1});
  // Offsets are the sums of the lower ranks' workers.
  std::vector<int> by_rank_workers(4), by_rank_offset(4);
  for (std::size_t i = 0; i < 4; ++i) {
    by_rank_workers[agents[i]->rounds[0].group_rank] = workers[i];
    by_rank_offset[agents[i]->rounds[0].group_rank] = agents[i]->rounds[0].rank_offset;
  }
  int expected = 0;
  for (int r = 0; r < 4; ++r) {
    CHECK(by_rank_offset[r] == expected);
    expected += by_rank_workers[r];
  }
}

TEST_CASE("an agent that dies without leaving is noticed at once: the others restart and continue smaller") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  std::vector<std::shared_ptr<TestAgent>> agents;
  for (int i = 0; i < 2; ++i) agents.push_back(TestAgent::make(io, server.port(), node_spec("job", "h" + std::to_string(i), 2, 3)));
  RawConn victim(server.port());
  REQUIRE(victim.connected());
  victim.say_hello("job", "");
  victim.send(make_join(node_spec("job", "victim", 2, 3)));
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 1); }));
  REQUIRE(agents[0]->rounds[0].group_world_size == 3);
  victim.close();  // like SIGKILL: no leave message
  REQUIRE(run_until(io, [&] { return agents[0]->restarts.size() == 1 && agents[1]->restarts.size() == 1; }, 5));
  for (auto& a : agents) {
    CHECK(a->restarts[0].second == false);
    CHECK(a->restarts[0].first.find("victim") != std::string::npos);
    a->client->join(a->spec);
  }
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 2); }));
  CHECK(agents[0]->rounds[1].group_world_size == 2);
  CHECK(agents[0]->rounds[1].generation == 2);
  CHECK(agents[0]->rounds[1].restart_count == 0);
}

TEST_CASE("a silent agent is dropped after heartbeat_timeout and the others are told") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  NodeSpec s = node_spec("job", "alive", 1, 2);
  s.timeouts.heartbeat_timeout = 0.4;
  auto alive = TestAgent::make(io, server.port(), s);
  RawConn silent(server.port());
  silent.say_hello("job", "");
  NodeSpec ss = s;
  ss.host = "silent";
  silent.send(make_join(ss));  // and then never a heartbeat
  REQUIRE(run_until(io, [&] { return alive->rounds.size() == 1; }));
  REQUIRE(alive->rounds[0].group_world_size == 2);
  REQUIRE(run_until(io, [&] { return alive->restarts.size() == 1; }, 5));
  CHECK(alive->restarts[0].first.find("silent") != std::string::npos);
  CHECK(alive->restarts[0].first.find("no heartbeat") != std::string::npos);
  CHECK(alive->errors.empty());  // the live agent's own heartbeats kept it in
  auto dropped = silent.recv_type("error", 2);
  REQUIRE(dropped);
  CHECK((*dropped)["code"] == "heartbeat_timeout");
}

TEST_CASE("a probed agent whose host acknowledged the probe is left to heartbeat_timeout; one that answers stays") {
  // On loopback every host is up: the silent client's kernel acknowledges the probe although
  // the client never answers it, as the host of a busy or stopped agent does. The loss of a
  // host (no acknowledgement) is tested with a cut link (tests/e2e/test_fault_tolerance.py) and
  // on the state machine (test_state.cpp).
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  NodeSpec s = node_spec("job", "alive", 3, 3);
  s.timeouts.heartbeat_timeout = 2;
  s.timeouts.probe_timeout = 0.3;
  auto alive = TestAgent::make(io, server.port(), s);  // a real client: it answers probes
  RawConn reporter(server.port()), silent(server.port());
  for (auto [conn, host] : {std::pair{&reporter, "reporter"}, std::pair{&silent, "silent"}}) {
    conn->say_hello("job", "");
    NodeSpec spec = s;
    spec.host = host;
    conn->send(make_join(spec));
  }
  REQUIRE(run_until(io, [&] { return alive->rounds.size() == 1; }));
  REQUIRE(alive->rounds[0].group_world_size == 3);
  run_until(io, [] { return false; }, 0.3);  // silence builds up: the silent node said nothing since its join
  reporter.send(make_stall(0.2));
  reporter.send(make_heartbeat());  // the reporter itself stays alive
  // The probe round ends without a loss; the silent node goes only at heartbeat_timeout.
  REQUIRE(run_until(io, [&] { return alive->restarts.size() == 1; }, 10));
  CHECK(alive->restarts[0].first.find("silent") != std::string::npos);
  CHECK(alive->restarts[0].first.find("no heartbeat") != std::string::npos);
  CHECK(alive->errors.empty());
  CHECK(silent.recv_type("probe", 2));
  auto dropped = silent.recv_type("error", 2);
  REQUIRE(dropped);
  CHECK((*dropped)["code"] == "heartbeat_timeout");
}

namespace {

// A listening socket on 127.0.0.1 (port 0: any); its port in `port`.
int listen_loopback(unsigned short& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 8) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  port = ntohs(a.sin_port);
  return fd;
}

}  // namespace

TEST_CASE("an agent asked to check a peer says peer_alive when the host refuses or accepts, nothing for a name") {
  // A fake server (a thread with a blocking socket) welcomes a real client, takes its join, and
  // asks it to reach three hosts: a port that refuses, a port that listens, and a host name.
  unsigned short server_port = 0, refusing_port = 0, listening_port = 0;
  const int server_fd = listen_loopback(server_port);
  ::close(listen_loopback(refusing_port));  // nothing listens there any more
  const int listening_fd = listen_loopback(listening_port);
  std::atomic<bool> done{false};
  std::atomic<bool> joined_with_peer_checks{false};
  std::vector<std::uint64_t> alive;  // written by the server thread before `done`
  std::thread server([&] {
    RawConn conn(RawConn::Accepted{::accept(server_fd, nullptr, nullptr)});
    conn.send(make_challenge(random_hex(16)));
    if (conn.recv_type("hello") && conn.send(make_welcome())) {
      if (auto join = conn.recv_type("join")) joined_with_peer_checks = (*join)["node"].value("peer_checks", false);
      conn.send(make_check_peer({1, "127.0.0.1", refusing_port, 1.0}));
      conn.send(make_check_peer({2, "127.0.0.1", listening_port, 1.0}));
      conn.send(make_check_peer({3, "localhost", refusing_port, 1.0}));
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
      while (std::chrono::steady_clock::now() < until) {
        auto m = conn.recv(0.1);
        if (m && (*m)["type"] == "peer_alive") alive.push_back((*m)["id"].get<std::uint64_t>());
      }
    }
    done = true;
  });
  asio::io_context io;
  auto agent = TestAgent::make(io, server_port, node_spec("job", "checker", 2, 2));
  const bool finished = run_until(io, [&] { return done.load(); }, 10);
  server.join();
  ::close(server_fd);
  ::close(listening_fd);
  REQUIRE(finished);
  CHECK(joined_with_peer_checks);
  std::sort(alive.begin(), alive.end());
  CHECK(alive == std::vector<std::uint64_t>{1, 2});
}

TEST_CASE("knock tells a listening port from a refusing one, by address or name, and says silent for nonsense") {
  unsigned short refusing_port = 0, listening_port = 0;
  ::close(listen_loopback(refusing_port));
  const int listening_fd = listen_loopback(listening_port);
  const std::string refusing = std::to_string(refusing_port), listening = std::to_string(listening_port);
  CHECK(knock("127.0.0.1:" + listening, 1.0) == Reach::made);
  CHECK(knock("127.0.0.1:" + refusing, 1.0) == Reach::refused);
  CHECK(knock("localhost:" + refusing, 1.0) == Reach::refused);
  CHECK(knock("127.0.0.1", 1.0) == Reach::silent);  // no port
  CHECK(knock("no such host.invalid:" + refusing, 1.0) == Reach::silent);
  ::close(listening_fd);
}

TEST_CASE("the restart budget is shared by the job: the same count everywhere, then failure everywhere") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  std::vector<std::shared_ptr<TestAgent>> agents;
  for (int i = 0; i < 2; ++i) {
    NodeSpec s = node_spec("job", "h" + std::to_string(i), 2, 2);
    s.max_restarts = 1;
    agents.push_back(TestAgent::make(io, server.port(), s));
  }
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 1); }));
  WorkerFailure f;
  f.host = "h0";
  f.rank = 0;
  f.exit_code = 1;
  agents[0]->client->report_failure(f);
  REQUIRE(run_until(io, [&] { return agents[0]->restarts.size() == 1 && agents[1]->restarts.size() == 1; }));
  CHECK(agents[1]->restarts[0].second == true);
  for (auto& a : agents) a->client->join(a->spec);
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 2); }));
  CHECK(agents[0]->rounds[1].restart_count == 1);
  CHECK(agents[1]->rounds[1].restart_count == 1);
  f.host = "h1";
  f.rank = 1;
  f.exit_code = 0;
  f.signal = 11;
  agents[1]->client->report_failure(f);
  // The budget is spent: every node is told to stop (uncounted restart), and the verdict comes
  // once every node has stopped its workers and rejoined.
  REQUIRE(run_until(io, [&] { return agents[0]->restarts.size() == 2 && agents[1]->restarts.size() == 2; }));
  CHECK(agents[0]->restarts[1].second == false);
  CHECK_FALSE(agents[0]->failed);
  for (auto& a : agents) a->client->join(a->spec);
  REQUIRE(run_until(io, [&] { return agents[0]->failed && agents[1]->failed; }));
  CHECK(agents[0]->failed->first.host == "h1");
  CHECK(agents[0]->failed->second.find("signal 11") != std::string::npos);
}

TEST_CASE("a late node is absorbed: the running nodes restart uncounted and the next round has it") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  std::vector<std::shared_ptr<TestAgent>> agents;
  for (int i = 0; i < 2; ++i) agents.push_back(TestAgent::make(io, server.port(), node_spec("job", "h" + std::to_string(i), 2, 3)));
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 1); }));
  REQUIRE(agents[0]->rounds[0].group_world_size == 2);
  const int rank0 = agents[0]->rounds[0].group_rank;
  agents.push_back(TestAgent::make(io, server.port(), node_spec("job", "late", 2, 3)));
  REQUIRE(run_until(io, [&] { return agents[0]->restarts.size() == 1 && agents[1]->restarts.size() == 1; }));
  CHECK(agents[0]->restarts[0].second == false);
  agents[0]->client->join(agents[0]->spec);
  agents[1]->client->join(agents[1]->spec);
  REQUIRE(run_until(io, [&] { return agents[0]->rounds.size() == 2 && agents[2]->rounds.size() == 1; }));
  CHECK(agents[2]->rounds[0].group_world_size == 3);
  CHECK(agents[2]->rounds[0].group_rank == 2);
  CHECK(agents[0]->rounds[1].group_rank == rank0);  // survivors keep their ranks
}

TEST_CASE("success on every node reaches every node, and leaving afterwards is not a loss") {
  asio::io_context io;
  Server server(io, loopback_any_port(), {});
  std::vector<std::shared_ptr<TestAgent>> agents;
  for (int i = 0; i < 2; ++i) agents.push_back(TestAgent::make(io, server.port(), node_spec("job", "h" + std::to_string(i), 2, 2)));
  REQUIRE(run_until(io, [&] { return all_have_rounds(agents, 1); }));
  agents[0]->client->report_success();
  agents[1]->client->report_success();
  REQUIRE(run_until(io, [&] { return agents[0]->succeeded && agents[1]->succeeded; }));
  agents[0]->client->close();
  agents[1]->client->close();
  REQUIRE(run_until(io, [&] { return server.state().job_count() == 0; }));
  CHECK(agents[0]->errors.empty());
  CHECK(agents[1]->restarts.empty());
}

TEST_CASE("connect retries until the server listens, with a clear message meanwhile") {
  asio::io_context io;
  // Find a free port, then release it so nothing listens there for a moment.
  unsigned short port;
  {
    tcp::acceptor probe(io, loopback_any_port());
    port = probe.local_endpoint().port();
  }
  auto agent = TestAgent::make(io, port, node_spec("job", "h", 1, 1), "", 10.0);
  REQUIRE(run_until(io, [&] { return !agent->logs.empty(); }));
  CHECK(agent->logs[0].find("connect to rendezvous 127.0.0.1:" + std::to_string(port) + ": Connection refused (retrying for") !=
        std::string::npos);
  Server server(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), {});
  REQUIRE(run_until(io, [&] { return agent->rounds.size() == 1; }));
  CHECK(agent->errors.empty());
}

TEST_CASE("connect gives up at its deadline with the reason") {
  asio::io_context io;
  unsigned short port;
  {
    tcp::acceptor probe(io, loopback_any_port());
    port = probe.local_endpoint().port();
  }
  auto agent = TestAgent::make(io, port, node_spec("job", "h", 1, 1), "", 0.3);
  REQUIRE(run_until(io, [&] { return !agent->errors.empty(); }, 5));
  CHECK(agent->errors[0].find("Connection refused") != std::string::npos);
  CHECK(agent->errors[0].find("gave up") != std::string::npos);
}

TEST_CASE("a client told to give up when refused ends its attempt at the first refusal") {
  asio::io_context io;
  unsigned short port;
  {
    tcp::acceptor probe(io, loopback_any_port());
    port = probe.local_endpoint().port();
  }
  ClientOptions o;
  o.job_id = "job";
  o.give_up_when_refused = true;  // the agent's setting for a leader named by a follower
  std::vector<std::string> lost, errors;
  ClientEvents e;
  e.on_disconnected = [&](const std::string& m) { lost.push_back(m); };
  e.on_error = [&](const std::string& m) { errors.push_back(m); };
  auto client = Client::create(io, o, e);
  client->connect(Endpoint{"127.0.0.1", port}, 30.0);  // a deadline far beyond the wait below
  REQUIRE(run_until(io, [&] { return !lost.empty() || !errors.empty(); }, 5));
  REQUIRE(lost.size() == 1);
  CHECK(errors.empty());
  CHECK(lost[0].find("Connection refused") != std::string::npos);
  CHECK(client->attempts() == 1);
}

TEST_CASE("a wrong token reaches the agent as a clear error") {
  asio::io_context io;
  ServerOptions o;
  o.token = "s3cret";
  Server server(io, loopback_any_port(), o);
  auto bad = TestAgent::make(io, server.port(), node_spec("job", "h", 1, 1), "wrong");
  auto good = TestAgent::make(io, server.port(), node_spec("job2", "h", 1, 1), "s3cret");
  REQUIRE(run_until(io, [&] { return !bad->errors.empty() && good->rounds.size() == 1; }));
  CHECK(bad->errors[0].find("token") != std::string::npos);
}

TEST_CASE("the server going away is an error for its agents") {
  asio::io_context io;
  auto server = std::make_unique<Server>(io, loopback_any_port(), ServerOptions{});
  auto agent = TestAgent::make(io, server->port(), node_spec("job", "h", 1, 1));
  REQUIRE(run_until(io, [&] { return agent->rounds.size() == 1; }));
  server->stop();
  REQUIRE(run_until(io, [&] { return !agent->errors.empty(); }));
  CHECK(agent->errors[0].find("closed") != std::string::npos);
}

TEST_CASE("status lists jobs with generation, state and nodes") {
  asio::io_context io;
  ServerOptions o;
  o.token = "tok";
  Server server(io, loopback_any_port(), o);
  auto agent = TestAgent::make(io, server.port(), node_spec("myjob", "hostA", 1, 1, 3), "tok");
  REQUIRE(run_until(io, [&] { return agent->rounds.size() == 1; }));
  StatusResult result;
  std::atomic<bool> answered{false};  // result is written by t before this turns true
  std::thread t([&] {
    result = query_status(Endpoint{"127.0.0.1", server.port()}, "tok", 5);
    answered = true;
  });
  run_until(io, [&] { return answered.load(); }, 10);
  t.join();
  REQUIRE(result.error.empty());
  const auto& job = result.status["jobs"][0];
  CHECK(job["job_id"] == "myjob");
  CHECK(job["generation"] == 1);
  CHECK(job["state"] == "running");
  CHECK(job["nodes"][0]["host"] == "hostA");
  CHECK(job["nodes"][0]["workers"] == 3);
  CHECK(job["nodes"][0]["addr"] == "127.0.0.1");
  std::string text = format_status(result.status);
  CHECK(text.find("job myjob: running, generation 1") != std::string::npos);
}

TEST_CASE("both status views show a node's last step and checkpoint and the job's checkpoint interval") {
  const nlohmann::json node = {{"group_rank", 0}, {"host", "hostA"}, {"addr", "10.0.0.1"}, {"workers", 2},
                               {"state", "running"}, {"last_heartbeat_age", 0.4}, {"last_step", 1234},
                               {"last_checkpoint", 1200}, {"checkpoint_interval", 150.0}};
  const nlohmann::json quiet = {{"group_rank", 1}, {"host", "hostB"}, {"addr", "10.0.0.2"}, {"workers", 2},
                                {"state", "running"}, {"last_heartbeat_age", 0.2}};
  nlohmann::json job = {{"job_id", "j"}, {"state", "running"}, {"generation", 1}, {"min_nodes", 2},
                        {"max_nodes", 2}, {"restarts_used", 0}, {"max_restarts", 3},
                        {"checkpoint_interval", 150.0}, {"nodes", {node, quiet}}};
  const nlohmann::json status = {{"jobs", {job}}};
  const std::string text = format_status(status);
  CHECK(text.find("  checkpoints every 2 min (the workers' automatic cadence)\n") != std::string::npos);
  CHECK(text.find("last_step  checkpoint\n") != std::string::npos);
  CHECK(text.find("0.4 s ago      1234       1200\n") != std::string::npos);
  CHECK(text.find("0.2 s ago      -          -\n") != std::string::npos);
  const std::string watch = format_watch(status, "header");
  CHECK(watch.find("    checkpoints every 2 min (the workers' automatic cadence)\n") != std::string::npos);
  CHECK(watch.find("LAST STEP  CHECKPOINT\n") != std::string::npos);
  CHECK(watch.find("0.4 s       1234       1200\n") != std::string::npos);
  // No interval said: no line about it.
  job.erase("checkpoint_interval");
  CHECK(format_status({{"jobs", {job}}}).find("checkpoints every") == std::string::npos);
  CHECK(format_watch({{"jobs", {job}}}, "header").find("checkpoints every") == std::string::npos);
}
