// The metrics component without sockets: the HTTP request parser's bounds, the exposition's
// format rules, bounded label values, event lines, and the daemon's and agent's metrics.
#include <doctest/doctest.h>

#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>

#include "agent/metrics.h"
#include "metrics/dashboard.h"
#include "metrics/event.h"
#include "metrics/exposition.h"
#include "metrics/http.h"
#include "rendezvous/metrics.h"

using namespace ddp::metrics;
using Result = HttpRequestParser::Result;

namespace {

// The value of the sample `series` (name and labels exactly as exposed), or NaN when absent.
double sample(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nan("");
}

}  // namespace

TEST_SUITE("http parser") {
  TEST_CASE("a GET request is complete at the end of its head, in any chunking") {
    const std::string req = "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n";
    for (std::size_t cut = 1; cut < req.size(); ++cut) {
      HttpRequestParser p;
      CHECK(p.feed(req.substr(0, cut)) == Result::need_more);
      REQUIRE(p.feed(req.substr(cut)) == Result::complete);
      CHECK(p.request().method == "GET");
      CHECK(p.request().path == "/metrics");
    }
  }
  TEST_CASE("garbage, other methods, other versions and bad targets get the right status") {
    auto status_of = [](const std::string& text) {
      HttpRequestParser p;
      REQUIRE(p.feed(text) == Result::error);
      return p.error_status();
    };
    CHECK(status_of(std::string("\x16\x03\x01\x02\x00garbage\r\n\r\n", 16)) == 400);  // a TLS hello
    CHECK(status_of("POST /metrics HTTP/1.1\r\n\r\n") == 405);
    CHECK(status_of("GET /metrics HTTP/2.0\r\n\r\n") == 505);
    CHECK(status_of("GET metrics HTTP/1.1\r\n\r\n") == 400);
    CHECK(status_of("GET /a\x01 HTTP/1.1\r\n\r\n") == 400);
    CHECK(status_of("GET  /metrics HTTP/1.1\r\n\r\n") == 400);
  }
  TEST_CASE("a bad request line is refused as soon as it ends, before the rest of the head") {
    HttpRequestParser p;
    REQUIRE(p.feed("garbage\r\n") == Result::error);
    CHECK(p.error_status() == 400);
    HttpRequestParser pieces;  // also when it arrives in pieces
    CHECK(pieces.feed("POST /met") == Result::need_more);
    REQUIRE(pieces.feed("rics HTTP/1.1\r\nHost: a\r\n") == Result::error);
    CHECK(pieces.error_status() == 405);
  }
  TEST_CASE("a head with bare LF line ends is read as if they were CRLF") {
    HttpRequestParser p;
    REQUIRE(p.feed("GET /healthz HTTP/1.0\nHost: a\n\n") == Result::complete);
    CHECK(p.request().path == "/healthz");
  }
  TEST_CASE("a request that announces a body is refused with 413: GET and HEAD have none") {
    auto status_of = [](const std::string& text) {
      HttpRequestParser p;
      REQUIRE(p.feed(text) == Result::error);
      return p.error_status();
    };
    CHECK(status_of("GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello") == 413);
    CHECK(status_of("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") == 413);
    CHECK(status_of("GET /metrics HTTP/1.1\r\nBad Header\r\n\r\n") == 400);
    HttpRequestParser empty;
    CHECK(empty.feed("HEAD /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n") == Result::complete);
    CHECK(empty.request().method == "HEAD");
  }
  TEST_CASE("a head larger than the limit is refused with 431 and never buffered past it") {
    HttpRequestParser p(1024);
    CHECK(p.feed("GET / HTTP/1.1\r\n") == Result::need_more);
    const std::string header = "X-Long: " + std::string(100000, 'a');
    REQUIRE(p.feed(header) == Result::error);
    CHECK(p.error_status() == 431);
    CHECK(p.feed("\r\n\r\n") == Result::error);  // stays an error
  }
  TEST_CASE("a response carries its length and closes; HEAD has no body") {
    HttpResponse r{200, "text/plain", "hello"};
    const std::string full = serialize(r, false);
    CHECK(full.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
    CHECK(full.find("Content-Length: 5\r\n") != std::string::npos);
    CHECK(full.find("Connection: close\r\n") != std::string::npos);
    CHECK(full.substr(full.size() - 9) == "\r\n\r\nhello");
    const std::string head = serialize(r, true);
    CHECK(head.substr(head.size() - 4) == "\r\n\r\n");
  }
}

TEST_SUITE("exposition") {
  TEST_CASE("the text format's rules: HELP and TYPE, escaped label values, histogram buckets up to +Inf") {
    prometheus::Registry r;
    auto& c = prometheus::BuildCounter().Name("ddp_test_total").Help("a help").Register(r);
    c.Add({{"cause", "say \"hi\"\\now\n"}}).Increment(2);
    auto& h = prometheus::BuildHistogram().Name("ddp_test_seconds").Help("h").Register(r);
    auto& hist = h.Add({}, prometheus::Histogram::BucketBoundaries{0.1, 1});
    hist.Observe(0.05);
    hist.Observe(0.5);
    hist.Observe(5);
    const std::string text = exposition({&r});
    // prometheus-cpp 1.0.1 does not escape a newline in HELP: our help texts have none.
    CHECK(text.find("# HELP ddp_test_total a help\n") != std::string::npos);
    CHECK(text.find("# TYPE ddp_test_total counter\n") != std::string::npos);
    CHECK(text.find("ddp_test_total{cause=\"say \\\"hi\\\"\\\\now\\n\"} 2\n") != std::string::npos);
    CHECK(text.find("# TYPE ddp_test_seconds histogram\n") != std::string::npos);
    CHECK(sample(text, "ddp_test_seconds_bucket{le=\"0.1\"}") == 1);
    CHECK(sample(text, "ddp_test_seconds_bucket{le=\"1\"}") == 2);  // cumulative
    CHECK(sample(text, "ddp_test_seconds_bucket{le=\"+Inf\"}") == 3);
    CHECK(sample(text, "ddp_test_seconds_count") == 3);
    CHECK(sample(text, "ddp_test_seconds_sum") == doctest::Approx(5.55));
    // Every sample line is NAME{LABELS} VALUE with a valid metric name.
    const std::regex line_re(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? \S+$)");
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] == '#') continue;
      CHECK_MESSAGE(std::regex_match(line, line_re), line);
    }
  }
  TEST_CASE("label values from outside are bounded in number and length") {
    LabelValues v(3, 8);
    CHECK(v.admit("a") == "a");
    CHECK(v.admit("b") == "b");
    CHECK(v.admit("a very long cause") == "a very l");
    CHECK(v.admit("d") == "other");
    CHECK(v.admit("a") == "a");  // known values stay
    CHECK(v.admit("") == "other");
  }
}

TEST_SUITE("events") {
  TEST_CASE("an event is one JSON line with the common fields first-class and its own fields merged") {
    Event e;
    e.type = "worker_exited";
    e.job = "j1";
    e.node = "host\n1";
    e.generation = 3;
    e.ranks = {4, 5};
    e.cause = "signal";
    e.message = std::string("bad \xff utf8");
    e.fields = {{"signal", 9}, {"type", "ignored: the common key wins"}};
    e.time = 1700000000.5;
    const std::string line = to_json_line(e);
    CHECK(line.find('\n') == std::string::npos);
    auto j = nlohmann::json::parse(line);
    CHECK(j["type"] == "worker_exited");
    CHECK(j["job"] == "j1");
    CHECK(j["node"] == "host\n1");
    CHECK(j["generation"] == 3);
    CHECK(j["ranks"] == nlohmann::json::array({4, 5}));
    CHECK(j["cause"] == "signal");
    CHECK(j["signal"] == 9);
    CHECK(j["time"] == 1700000000.5);
  }
  TEST_CASE("the bus stamps the time and reaches every sink") {
    struct Keep : EventSink {
      std::vector<Event> got;
      void record(const Event& e) override { got.push_back(e); }
    };
    auto a = std::make_shared<Keep>(), b = std::make_shared<Keep>();
    EventBus bus;
    bus.add(a);
    bus.add(b);
    Event e;
    e.type = "hang";
    e.cause = "no progress for 300 s";
    bus.record(e);
    REQUIRE(a->got.size() == 1);
    REQUIRE(b->got.size() == 1);
    CHECK(a->got[0].time > 1e9);
    CHECK(b->got[0].cause == "no progress for 300 s");
  }
  TEST_CASE("the dashboard's ring keeps the last events, oldest first, and counts every one") {
    EventRing ring(3);
    CHECK(ring.json()["events"].empty());
    for (int i = 1; i <= 5; ++i) {
      Event e;
      e.type = "round";
      e.job = "j";
      e.generation = static_cast<std::uint64_t>(i);
      e.message = i == 5 ? std::string("bad \xff utf8 <script>") : "";
      ring.record(e);
    }
    const nlohmann::json j = ring.json();
    CHECK(j["capacity"] == 3);
    CHECK(j["recorded"] == 5);
    REQUIRE(j["events"].size() == 3);
    CHECK(j["events"][0]["generation"] == 3);
    CHECK(j["events"][2]["generation"] == 5);
    // Served as JSON whatever the text holds (invalid UTF-8 replaced, markup kept as text).
    const std::string body = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    CHECK(body.find("<script>") != std::string::npos);
  }
  TEST_CASE("the dashboard page is self-contained: no markup from data, nothing fetched elsewhere") {
    const std::string page(dashboard_page());
    CHECK(page.rfind("<!DOCTYPE html>", 0) == 0);
    CHECK(page.find("/api/status") != std::string::npos);
    CHECK(page.find("/api/events") != std::string::npos);
    for (const char* banned : {"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "http://",
                               "https://", "src=", "href=", "@import"}) {
      INFO(banned);
      CHECK(page.find(banned) == std::string::npos);
    }
  }
}

TEST_SUITE("daemon metrics") {
  TEST_CASE("rounds, restarts and failures by cause, both histograms and the gauges") {
    ddp::rdzv::DaemonMetrics m;
    Event round;
    round.type = "round";
    round.fields = {{"formation_seconds", 0.2}};
    m.record(round);
    Event failure;
    failure.type = "failure";
    failure.cause = "signal";
    m.record(failure);
    Event hang;
    hang.type = "hang";
    hang.cause = "no progress";
    m.record(hang);
    Event restart;
    restart.type = "restart";
    restart.cause = "worker_failure";
    restart.fields = {{"counted", true}};
    m.record(restart);
    round.fields = {{"formation_seconds", 0.02}, {"failure_to_restart_seconds", 3.0}};
    m.record(round);
    ddp::rdzv::Gauges g;
    g.jobs_by_state = {{"running", 1}, {"gathering", 0}};
    g.nodes_by_state = {{"running", 2}};
    g.oldest_heartbeat_age = {{"job1", 0.75}};
    const std::string text = m.render(g, 5);
    CHECK(sample(text, "ddp_rendezvous_rounds_total") == 2);
    CHECK(sample(text, "ddp_rendezvous_failures_total{cause=\"signal\"}") == 1);
    CHECK(sample(text, "ddp_rendezvous_failures_total{cause=\"hang\"}") == 1);
    CHECK(sample(text, "ddp_rendezvous_restarts_total{cause=\"worker_failure\",counted=\"true\"}") == 1);
    CHECK(sample(text, "ddp_rendezvous_round_formation_seconds_count") == 2);
    CHECK(sample(text, "ddp_rendezvous_round_formation_seconds_bucket{le=\"0.025\"}") == 1);
    CHECK(sample(text, "ddp_rendezvous_failure_to_restart_seconds_sum") == 3);
    CHECK(sample(text, "ddp_rendezvous_jobs{state=\"running\"}") == 1);
    CHECK(sample(text, "ddp_rendezvous_nodes{state=\"running\"}") == 2);
    CHECK(sample(text, "ddp_rendezvous_heartbeat_age_seconds{job=\"job1\"}") == 0.75);
    CHECK(sample(text, "ddp_rendezvous_connections") == 5);
  }
}

TEST_SUITE("agent metrics") {
  TEST_CASE("set_progress gives the last step and the steps per second between reports") {
    ddp::agent::AgentMetrics m;
    m.set_progress(0, 100, 10.0);
    std::string text = m.render();
    CHECK(sample(text, "ddp_agent_last_step{local_rank=\"0\"}") == 100);
    CHECK(std::isnan(sample(text, "ddp_agent_steps_per_second{local_rank=\"0\"}")));  // one report: no rate yet
    m.set_progress(0, 150, 12.0);
    m.set_progress(1, 7, 12.0);
    text = m.render();
    CHECK(sample(text, "ddp_agent_last_step{local_rank=\"0\"}") == 150);
    CHECK(sample(text, "ddp_agent_steps_per_second{local_rank=\"0\"}") == 25);
    CHECK(sample(text, "ddp_agent_last_step{local_rank=\"1\"}") == 7);
    m.set_progress(0, 20, 13.0);  // restarted from a checkpoint
    text = m.render();
    CHECK(sample(text, "ddp_agent_last_step{local_rank=\"0\"}") == 20);
    CHECK(sample(text, "ddp_agent_steps_per_second{local_rank=\"0\"}") == 0);
    m.set_progress(0, 30, 14.0);
    CHECK(sample(m.render(), "ddp_agent_steps_per_second{local_rank=\"0\"}") == 10);
  }
  TEST_CASE("worker starts, exits by cause and restarts come from the events") {
    ddp::agent::AgentMetrics m;
    Event e;
    e.type = "worker_started";
    m.record(e);
    m.record(e);
    CHECK(m.running() == 2);
    e.type = "worker_exited";
    e.cause = "exit_code";
    m.record(e);
    e.cause = "stopped";
    m.record(e);
    CHECK(m.running() == 0);
    e.type = "restart";
    e.cause = "worker_failure";
    m.record(e);
    e.type = "round";
    e.generation = 2;
    m.record(e);
    const std::string text = m.render();
    CHECK(sample(text, "ddp_agent_worker_starts_total") == 2);
    CHECK(sample(text, "ddp_agent_worker_exits_total{cause=\"exit_code\"}") == 1);
    CHECK(sample(text, "ddp_agent_worker_exits_total{cause=\"stopped\"}") == 1);
    CHECK(sample(text, "ddp_agent_restarts_total{cause=\"worker_failure\"}") == 1);
    CHECK(sample(text, "ddp_agent_workers_running") == 0);
    CHECK(sample(text, "ddp_agent_generation") == 2);
  }
}
