// The etcd client's socket-free parts (rendezvous/etcd.*): base64, answers validated like any
// wire input, the txn encoding; and the deadline on a call to endpoints that do not answer.
#include <chrono>
#include <string>

#include <boost/asio.hpp>
#include <doctest/doctest.h>

#include "rendezvous/etcd.h"

using namespace ddp::rdzv;

TEST_CASE("base64 round-trips every byte and refuses malformed text") {
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (std::size_t n : {0u, 1u, 2u, 3u, 4u, 255u, 256u}) {
    const std::string bytes = all.substr(0, n);
    auto back = base64_decode(base64_encode(bytes));
    REQUIRE(back.has_value());
    CHECK(*back == bytes);
  }
  CHECK(base64_encode("foo") == "Zm9v");
  CHECK(base64_encode("bar!") == "YmFyIQ==");
  CHECK_FALSE(base64_decode("Zm9").has_value());       // not a multiple of 4
  CHECK_FALSE(base64_decode("Zm9v!A==").has_value());  // outside the alphabet
  CHECK_FALSE(base64_decode("Z=9v").has_value());      // padding in the middle
  CHECK_FALSE(base64_decode("Zm=v").has_value());      // data after padding
  CHECK_FALSE(base64_decode("====").has_value());
}

TEST_CASE("a prefix's range end is the prefix with its last byte incremented") {
  CHECK(prefix_range_end("/ddp/") == "/ddp0");
  CHECK(prefix_range_end(std::string("a\xff", 2)) == "b");
  CHECK(prefix_range_end("") == std::string(1, '\0'));
}

TEST_CASE("a range answer from etcd 3.4 is read with its revisions") {
  nlohmann::json answer;
  REQUIRE(parse_answer(R"({"header":{"revision":"7"},"kvs":[{"key":"Zm9v","create_revision":"2",
      "mod_revision":"5","version":"3","value":"YmFy","lease":"694d7a1b2c3d"}],"count":"1"})", answer).ok());
  // 694d7a1b2c3d is not decimal: refused below; a decimal lease is read.
  EtcdRange r;
  CHECK_FALSE(read_range(answer, r).empty());
  REQUIRE(parse_answer(R"({"header":{"revision":"7"},"kvs":[{"key":"Zm9v","create_revision":"2",
      "mod_revision":"5","version":"3","value":"YmFy","lease":"7587869512345"}],"count":"1"})", answer).ok());
  REQUIRE(read_range(answer, r) == "");
  CHECK(r.revision == 7);
  REQUIRE(r.kvs.size() == 1);
  CHECK(r.kvs[0].key == "foo");
  CHECK(r.kvs[0].value == "bar");
  CHECK(r.kvs[0].create_revision == 2);
  CHECK(r.kvs[0].mod_revision == 5);
  CHECK(r.kvs[0].version == 3);
  CHECK(r.kvs[0].lease == 7587869512345);
  // etcd omits empty fields: no kvs, no header.
  REQUIRE(parse_answer(R"({})", answer).ok());
  CHECK(read_range(answer, r) == "");
  CHECK(r.kvs.empty());
}

TEST_CASE("hostile answers are errors, never exceptions") {
  const char* bad[] = {
      R"({"kvs":{}})",                               // kvs not an array
      R"({"kvs":[1]})",                              // entry not an object
      R"({"kvs":[{"value":"YmFy"}]})",               // no key
      R"({"kvs":[{"key":"Zm9v!"}]})",                // key not base64
      R"({"kvs":[{"key":"Zm9v","value":7}]})",       // value not a string
      R"({"kvs":[{"key":"Zm9v","mod_revision":"1e3"}]})",
      R"({"kvs":[{"key":"Zm9v","version":"99999999999999999999999"}]})",
      R"({"kvs":[{"key":"Zm9v","lease":[]}]})",
      R"({"header":[]})",
      R"({"header":{"revision":true}})",
  };
  for (const char* text : bad) {
    nlohmann::json answer;
    REQUIRE(parse_answer(text, answer).ok());
    EtcdRange r;
    CHECK_MESSAGE(!read_range(answer, r).empty(), text);
  }
  nlohmann::json answer;
  CHECK_FALSE(parse_answer("[]", answer).ok());
  CHECK_FALSE(parse_answer("{\"a\":", answer).ok());
  CHECK_FALSE(parse_answer("", answer).ok());
  CHECK_FALSE(parse_answer(std::string(100000, '[') + std::string(100000, ']'), answer).ok());  // depth
  EtcdTxnResult t;
  REQUIRE(parse_answer(R"({"succeeded":"yes"})", answer).ok());
  CHECK_FALSE(read_txn(answer, t).empty());
  REQUIRE(parse_answer(R"({"responses":[{"response_range":[]}]})", answer).ok());
  CHECK_FALSE(read_txn(answer, t).empty());
  REQUIRE(parse_answer(R"({"succeeded":true,"responses":[{"response_put":{}},{"response_range":{"kvs":[]}}]})",
                       answer).ok());
  CHECK(read_txn(answer, t) == "");
  CHECK(t.succeeded);
  CHECK(t.ranges.size() == 1);
  EtcdLease l;
  REQUIRE(parse_answer(R"({"result":{"ID":"12","TTL":"5"}})", answer).ok());
  CHECK(read_lease(answer, l) == "");
  CHECK(l.id == 12);
  CHECK(l.ttl == 5);
  REQUIRE(parse_answer(R"({"result":{"ID":"12"}})", answer).ok());  // keepalive of an expired lease
  CHECK(read_lease(answer, l) == "");
  CHECK(l.ttl == 0);
  REQUIRE(parse_answer(R"({"result":"x"})", answer).ok());
  CHECK_FALSE(read_lease(answer, l).empty());
}

TEST_CASE("a txn is encoded as the gateway expects: base64 keys, int64 as strings") {
  EtcdTxn txn;
  EtcdCompare c;
  c.key = "/k";
  c.target = EtcdCompare::Target::mod_revision;
  c.number = 42;
  txn.compare.push_back(c);
  EtcdOp put;
  put.kind = EtcdOp::Kind::put;
  put.key = "/k";
  put.value = "v";
  put.lease = 9;
  txn.success.push_back(put);
  const auto j = txn_to_json(txn);
  CHECK(j["compare"][0]["key"] == base64_encode("/k"));
  CHECK(j["compare"][0]["target"] == "MOD");
  CHECK(j["compare"][0]["mod_revision"] == "42");
  CHECK(j["success"][0]["request_put"]["lease"] == "9");
  CHECK(j["failure"].is_array());
}

TEST_CASE("a call to endpoints that refuse or never answer fails within its deadline, naming each") {
  namespace asio = boost::asio;
  asio::io_context io;
  // One endpoint accepts and never answers (its backlog holds the connection), one refuses.
  asio::ip::tcp::acceptor silent(io, {asio::ip::make_address("127.0.0.1"), 0});
  asio::ip::tcp::acceptor closed(io, {asio::ip::make_address("127.0.0.1"), 0});
  const auto refused_port = closed.local_endpoint().port();
  closed.close();
  EtcdOptions o;
  o.endpoints = {"http://127.0.0.1:" + std::to_string(silent.local_endpoint().port()),
                 "127.0.0.1:" + std::to_string(refused_port)};
  o.call_timeout = 0.5;
  EtcdClient client(o);
  const auto start = std::chrono::steady_clock::now();
  auto r = client.range("/k");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK_FALSE(r.status.ok());
  CHECK(took < 3.0);  // the deadline (0.5 s) bounds it; the margin is for a loaded machine
  CHECK(r.status.error.find(o.endpoints[0]) != std::string::npos);
  CHECK(r.status.error.find(std::to_string(refused_port)) != std::string::npos);
}

TEST_CASE("bad endpoint text is reported by every call") {
  EtcdOptions o;
  o.endpoints = {"ftp://x:1", "http://:2379", "http://h:99999"};
  EtcdClient client(o);
  auto r = client.range("/k");
  CHECK(r.status.error.find("only http:// and https://") != std::string::npos);
  CHECK(r.status.error.find("expected http://HOST:PORT") != std::string::npos);
}

TEST_CASE("a watch stream's lines are read into answers: created, a put, a deletion") {
  EtcdWatchParser parser(1 << 20);
  std::vector<EtcdWatchResponse> out;
  const std::string stream =
      R"({"result":{"header":{"revision":"1"},"created":true}})"
      "\n"
      R"({"result":{"header":{"revision":"2"},"events":[{"kv":{"key":"L3cvbGVhZGVy","create_revision":"2",)"
      R"("mod_revision":"2","version":"1","value":"YTox"}}]}})"
      "\n"
      R"({"result":{"header":{"revision":"3"},"events":[{"type":"DELETE","kv":{"key":"L3cvbGVhZGVy","mod_revision":"3"}}]}})"
      "\n";
  // Fed in pieces of every size: a line split anywhere is joined.
  for (std::size_t piece : {1u, 7u, 64u, 100000u}) {
    out.clear();
    for (std::size_t i = 0; i < stream.size(); i += piece) {
      REQUIRE(parser.feed(std::string_view(stream).substr(i, piece), out) == "");
    }
    REQUIRE(out.size() == 3);
    CHECK(out[0].created);
    CHECK(out[0].revision == 1);
    CHECK(out[0].events.empty());
    REQUIRE(out[1].events.size() == 1);
    CHECK(out[1].events[0].type == EtcdWatchEvent::Type::put);
    CHECK(out[1].events[0].kv.key == "/w/leader");
    CHECK(out[1].events[0].kv.value == "a:1");
    CHECK(out[1].events[0].kv.create_revision == 2);
    REQUIRE(out[2].events.size() == 1);
    CHECK(out[2].events[0].type == EtcdWatchEvent::Type::del);
    CHECK(out[2].events[0].kv.mod_revision == 3);
  }
  // A cancellation is an answer; the caller ends the stream on it.
  out.clear();
  REQUIRE(parser.feed("{\"result\":{\"canceled\":true,\"compact_revision\":\"9\",\"cancel_reason\":\"compacted\"}}\n",
                      out) == "");
  REQUIRE(out.size() == 1);
  CHECK(out[0].canceled);
  CHECK(out[0].compact_revision == 9);
  CHECK(out[0].cancel_reason == "compacted");
}

TEST_CASE("hostile watch lines are errors, never exceptions, and a line has a size limit") {
  const char* bad[] = {
      "[]",
      "not json",
      R"({"result":[]})",
      R"({})",
      R"({"result":{"created":"yes"}})",
      R"({"result":{"canceled":1}})",
      R"({"result":{"header":{"revision":[]}}})",
      R"({"result":{"compact_revision":"x"}})",
      R"({"result":{"cancel_reason":{}}})",
      R"({"result":{"events":{}}})",
      R"({"result":{"events":[1]}})",
      R"({"result":{"events":[{"type":"EXPIRE","kv":{"key":"eA=="}}]}})",
      R"({"result":{"events":[{"type":0,"kv":{"key":"eA=="}}]}})",
      R"({"result":{"events":[{}]}})",
      R"({"result":{"events":[{"kv":{"value":"eA=="}}]}})",
      R"({"result":{"events":[{"kv":{"key":"!!"}}]}})",
      R"({"result":{"events":[{"kv":{"key":"eA==","mod_revision":1.5}}]}})",
      R"({"error":{"grpc_code":16,"message":"etcdserver: invalid auth token"}})",
  };
  for (const char* line : bad) {
    EtcdWatchParser parser(1 << 20);
    std::vector<EtcdWatchResponse> out;
    CHECK_MESSAGE(!parser.feed(std::string(line) + "\n", out).empty(), line);
    CHECK(out.empty());
  }
  {
    EtcdWatchParser parser(1 << 20);
    std::vector<EtcdWatchResponse> out;
    CHECK(parser.feed(R"({"error":{"grpc_code":16,"message":"token"}})" "\n", out).find("code 16") != std::string::npos);
    CHECK(parser.error_code() == 16);
  }
  {
    EtcdWatchParser parser(1 << 20);
    std::vector<EtcdWatchResponse> out;
    CHECK(parser.feed(std::string(100000, '[') + "\n", out).find("deeper") != std::string::npos);
  }
  {
    // A line that never ends is refused once it passes the limit, before it is buffered further.
    EtcdWatchParser parser(1000);
    std::vector<EtcdWatchResponse> out;
    CHECK(parser.feed(std::string(600, ' '), out) == "");
    CHECK(parser.feed(std::string(600, ' '), out).find("larger than 1000 bytes") != std::string::npos);
  }
  {
    EtcdWatchParser parser(1000);
    std::vector<EtcdWatchResponse> out;
    CHECK(parser.feed("\n\r\n  \n", out) == "");  // empty lines are skipped
    CHECK(out.empty());
  }
}

TEST_CASE("a watch on endpoints that refuse or never answer fails within its deadline; stop() ends it") {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::acceptor silent(io, {asio::ip::make_address("127.0.0.1"), 0});
  EtcdOptions o;
  o.endpoints = {"http://127.0.0.1:" + std::to_string(silent.local_endpoint().port())};
  EtcdClient client(o);
  EtcdWatchRequest request;
  request.key = "/k";
  request.establish_timeout = 0.5;
  EtcdWatchStop stop;
  int answers = 0;
  auto start = std::chrono::steady_clock::now();
  EtcdStatus s = client.watch(request, [&](const EtcdWatchResponse&) { ++answers; }, stop);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK_FALSE(s.ok());
  CHECK(answers == 0);
  CHECK(took < 3.0);
  CHECK(s.error.find(o.endpoints[0]) != std::string::npos);
  CHECK(s.error.find("not created in time") != std::string::npos);
  // Stopped before it starts: it returns at once, saying so.
  stop.stop();
  request.establish_timeout = 30;
  start = std::chrono::steady_clock::now();
  s = client.watch(request, [&](const EtcdWatchResponse&) { ++answers; }, stop);
  took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(s.error == "stopped");
  CHECK(took < 3.0);
}

TEST_CASE("unusable TLS files are configuration errors naming the file") {
  EtcdOptions o;
  o.endpoints = {"https://127.0.0.1:2379"};
  o.ca_file = "/nonexistent/ca.pem";
  CHECK(EtcdClient(o).config_error().find("CA file /nonexistent/ca.pem: cannot use it") != std::string::npos);
  o.ca_file.clear();
  o.cert_file = "/nonexistent/client.pem";
  CHECK(EtcdClient(o).config_error().find("needs its key file too") != std::string::npos);
  o.key_file = "/nonexistent/client.key";
  CHECK(EtcdClient(o).config_error().find("client certificate file /nonexistent/client.pem") != std::string::npos);
  // Every call fails with it, at once.
  EtcdClient client(o);
  CHECK(client.range("/k").status.error.find("etcd TLS") != std::string::npos);
  // https:// with the system's CAs and no client certificate is a usable configuration.
  EtcdOptions plain;
  plain.endpoints = {"https://127.0.0.1:2379", "http://127.0.0.1:2380"};
  CHECK(EtcdClient(plain).config_error() == "");
}
