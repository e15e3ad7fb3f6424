// Protocol unit tests: the typed codec (framing, limits, decoding, encoding) and the HMAC proofs.
#include <doctest/doctest.h>

#include <set>
#include <tuple>

#include "rendezvous/auth.h"
#include "rendezvous/protocol.h"

using namespace ddp::rdzv;
using nlohmann::json;

namespace {
std::string payload_of(const Frame& f) { return f->substr(kFrameHeaderBytes); }
Decoded decode_json(const json& j) { return decode(j.dump()); }
}  // namespace

TEST_CASE("a frame is a 4-byte big-endian length followed by the JSON payload") {
  Frame f = encode(make_heartbeat());
  std::string payload = R"({"type":"heartbeat"})";
  REQUIRE(f->size() == 4 + payload.size());
  CHECK(read_frame_header(reinterpret_cast<const unsigned char*>(f->data())) == payload.size());
  CHECK(payload_of(f) == payload);
  unsigned char h[4];
  write_frame_header(0x01020304u, h);
  CHECK(h[0] == 1);
  CHECK(h[3] == 4);
}

TEST_CASE("frame lengths past the limit or zero are refused before any allocation") {
  CHECK_FALSE(check_frame_length(100, 1 << 20));
  auto big = check_frame_length(0x40000000u, 1 << 20);
  REQUIRE(big);
  CHECK(big->code == "too_large");
  CHECK(big->message.find("1073741824") != std::string::npos);
  REQUIRE(check_frame_length(0, 1 << 20));
  CHECK(check_frame_length(0, 1 << 20)->code == "bad_frame");
}

TEST_CASE("the frame reader splits a byte stream fed one byte at a time or all at once") {
  std::string stream = *encode(make_heartbeat()) + *encode(make_success()) + *encode(make_leave());
  for (std::size_t chunk : {std::size_t{1}, std::size_t{3}, stream.size()}) {
    FrameReader reader;
    std::vector<std::string> got;
    std::string payload;
    for (std::size_t i = 0; i < stream.size(); i += chunk) {
      reader.feed(stream.data() + i, std::min(chunk, stream.size() - i));
      while (reader.next(payload) == FrameReader::Result::frame) got.push_back(payload);
    }
    REQUIRE(got.size() == 3);
    CHECK(decode(got[0]).message->type == MessageType::heartbeat);
    CHECK(decode(got[1]).message->type == MessageType::success);
    CHECK(decode(got[2]).message->type == MessageType::leave);
    CHECK(reader.buffered() == 0);
  }
}

TEST_CASE("the frame reader refuses an oversized frame from its header and stays failed") {
  FrameReader reader(1024);
  unsigned char h[4];
  write_frame_header(4096, h);
  reader.feed(reinterpret_cast<char*>(h), 4);
  std::string payload;
  CHECK(reader.next(payload) == FrameReader::Result::error);
  CHECK(reader.error().code == "too_large");
  reader.feed("more", 4);
  CHECK(reader.next(payload) == FrameReader::Result::error);
  CHECK(reader.buffered() == 0);
}

TEST_CASE("malformed JSON, messages without a type and unknown types are refused") {
  CHECK(decode("{not json").error->code == "bad_json");
  CHECK(decode("[1,2]").error->code == "bad_message");
  CHECK(decode(R"({"type":3})").error->code == "bad_message");
  auto unknown = decode(R"({"type":"launch_missiles"})");
  REQUIRE(unknown.error);
  CHECK(unknown.error->message.find("launch_missiles") != std::string::npos);
  CHECK_FALSE(decode(R"({"type":"heartbeat","future_field":1})").error);
}

TEST_CASE("JSON nested deeper than the limit is refused before it is parsed") {
  std::string deep = R"({"type":"join","node":{"fingerprint":)";
  for (int i = 0; i < 150000; ++i) deep += "{\"a\":";
  deep += "1";
  for (int i = 0; i < 150000; ++i) deep += "}";
  deep += "}}";
  auto d = decode(deep);
  REQUIRE(d.error);
  CHECK(d.error->code == "bad_json");
  CHECK(d.error->message.find("deeper than " + std::to_string(kMaxJsonDepth)) != std::string::npos);
  // Brackets inside strings do not count.
  CHECK(json_depth(R"({"a":"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"{{{{{{{{{"})", kMaxJsonDepth) == 1);
  CHECK(json_depth("[[[]]]", kMaxJsonDepth) == 3);
}

TEST_CASE("a join's fingerprint must be an object of bounded shape and size") {
  NodeSpec spec;
  spec.job_id = "j";
  spec.fingerprint = {{"python", {{"version", "3.11"}}}, {"program", {{"libraries", {{"libc", "abc"}}}}},
                      {"gpu", {{"models", {"A100", "A100"}}}}};
  CHECK_FALSE(decode(payload_of(encode(make_join(spec)))).error);
  json join = to_json(make_join(spec));
  join["node"]["fingerprint"] = json::array({1});
  CHECK(decode_json(join).error->message.find("fingerprint") != std::string::npos);
  join["node"]["fingerprint"] = {{"a", {{"b", {{"c", {{"d", 1}}}}}}}};
  CHECK(decode_json(join).error->message.find("deeper than 3") != std::string::npos);
  join["node"]["fingerprint"] = {{"a", json::array({json::object()})}};
  CHECK(decode_json(join).error);
  join["node"]["fingerprint"] = {{"a", std::string(kMaxFingerprintBytes, 'x')}};
  CHECK(decode_json(join).error->message.find("limit") != std::string::npos);
  CHECK(decode_json(join).error->code == "bad_join");
}

TEST_CASE("a join's straggler policy travels whole, and its mode and ranges are checked") {
  NodeSpec spec;
  spec.job_id = "j";
  spec.straggler = StragglerPolicy{"replace", 1.8, 120};
  auto d = decode(payload_of(encode(make_join(spec))));
  REQUIRE_FALSE(d.error);
  CHECK(std::get<NodeSpec>(d.message->body).straggler == spec.straggler);
  json join = to_json(make_join(spec));
  join["node"].erase("straggler");  // an agent that predates it: the defaults
  d = decode_json(join);
  REQUIRE_FALSE(d.error);
  CHECK(std::get<NodeSpec>(d.message->body).straggler == StragglerPolicy{});
  for (json bad : {json{{"mode", "evict"}}, json{{"mode", 3}}, json{{"factor", 1.0}}, json{{"factor", 1e9}},
                   json{{"window", 0.5}}, json{{"window", "60"}}, json::array({1})}) {
    CAPTURE(bad.dump());
    json j = join;
    j["node"]["straggler"] = bad;
    auto r = decode_json(j);
    REQUIRE(r.error);
    CHECK(r.error->code == "bad_join");
  }
  spec.straggler.mode = "sometimes";  // a spec built in-process is checked the same way
  CHECK(validate_node_spec(spec));
}

TEST_CASE("a join's sizes and ranks are range-checked so no sum can overflow") {
  NodeSpec spec;
  spec.job_id = "j";
  json join = to_json(make_join(spec));
  auto refused = [&](const char* field, json value) {
    json j = join;
    j["node"][field] = value;
    auto d = decode_json(j);
    return d.error && d.error->message.find(field) != std::string::npos;
  };
  CHECK(refused("local_world_size", 2147483647));
  CHECK(refused("local_world_size", 0));
  CHECK(refused("local_world_size", "4"));
  CHECK(refused("local_world_size", 2.5));
  CHECK(refused("local_world_size", 18446744073709551615ull));
  CHECK(refused("max_nodes", kMaxNodes + 1));
  CHECK(refused("requested_rank", -2));
  CHECK(refused("master_port", 70000));
  CHECK(refused("max_restarts", -1));
  CHECK(refused("job_id", std::string(kMaxIdBytes + 1, 'j')));
  CHECK(refused("host", std::string(kMaxHostBytes + 1, 'h')));
  CHECK(refused("addr", std::string(kMaxHostBytes + 1, 'a')));
  json t = join;
  t["node"]["timeouts"]["join_timeout"] = 1e300;
  CHECK(decode_json(t).error->message.find("join_timeout") != std::string::npos);
  // The largest job the limits allow still has a world size that fits an int.
  CHECK(static_cast<long long>(kMaxLocalWorldSize) * kMaxNodes < 2147483647LL);
}

TEST_CASE("a failure's message over the cap is truncated with a marker, not refused") {
  WorkerFailure w;
  w.host = std::string(1000, 'h');
  w.error_file_message = std::string(100000, 'e');
  auto d = decode(payload_of(encode(make_failure(w))));
  REQUIRE_FALSE(d.error);
  const auto& got = std::get<WorkerFailure>(d.message->body);
  CHECK(got.error_file_message.size() < kMaxFailureMessageBytes + 100);
  CHECK(got.error_file_message.find(kTruncatedMarker) != std::string::npos);
  CHECK(got.host.size() < kMaxHostBytes + 100);
}

TEST_CASE("a failure's fatal reason survives the codec, is absent when empty, and is capped like messages") {
  WorkerFailure w;
  w.rank = 2;
  auto plain = decode(payload_of(encode(make_failure(w))));
  REQUIRE_FALSE(plain.error);
  CHECK(std::get<WorkerFailure>(plain.message->body).fatal.empty());
  CHECK(payload_of(encode(make_failure(w))).find("fatal") == std::string::npos);
  w.fatal = "3 restart(s) in a row made no progress";
  auto d = decode(payload_of(encode(make_failure(w))));
  REQUIRE_FALSE(d.error);
  CHECK(std::get<WorkerFailure>(d.message->body).fatal == w.fatal);
  w.fatal = std::string(100000, 'f');
  auto big = decode(payload_of(encode(make_failure(w))));
  REQUIRE_FALSE(big.error);
  const auto& got = std::get<WorkerFailure>(big.message->body).fatal;
  CHECK(got.size() < kMaxFailureMessageBytes + 100);
  CHECK(got.find(kTruncatedMarker) != std::string::npos);
}

TEST_CASE("every message survives encode then decode with its data") {
  Assignment a;
  a.generation = 7;
  a.group_rank = 2;
  a.group_world_size = 3;
  a.world_size = 24;
  a.rank_offset = 16;
  a.master_addr = "10.1.2.3";
  auto round = decode(payload_of(encode(make_round(a))));
  REQUIRE_FALSE(round.error);
  CHECK(round.message->type == MessageType::round);
  const auto& back = std::get<Assignment>(round.message->body);
  CHECK(back.generation == 7);
  CHECK(back.rank_offset == 16);
  CHECK(back.master_addr == "10.1.2.3");
  auto r = decode(payload_of(encode(make_restart("node x lost", false, 2, 3))));
  REQUIRE_FALSE(r.error);
  CHECK(std::get<Restart>(r.message->body).restart_count == 2);
  CHECK(std::get<Restart>(r.message->body).reason == "node x lost");
  CHECK_FALSE(std::get<Restart>(r.message->body).failing);
  CHECK(payload_of(encode(make_restart("node x lost", false, 2, 3))).find("failing") == std::string::npos);
  auto failing = decode(payload_of(encode(make_restart("the job is failing", false, 3, 3, true))));
  REQUIRE_FALSE(failing.error);
  CHECK(std::get<Restart>(failing.message->body).failing);
  CHECK_FALSE(std::get<Restart>(r.message->body).failure);  // absent: false (older daemons)
  auto lost = decode(payload_of(encode(make_restart("node x lost", false, 2, 3, false, true))));
  REQUIRE_FALSE(lost.error);
  CHECK(std::get<Restart>(lost.message->body).failure);
  auto not_bool = decode(R"({"type":"restart","reason":"x","counted":false,"failure":"yes","restart_count":1,"max_restarts":1})");
  REQUIRE(not_bool.error);
  CHECK(not_bool.error->message.find("failure") != std::string::npos);
  WorkerFailure w;
  w.host = "h";
  w.exit_code = 3;
  auto jf = decode(payload_of(encode(make_job_failed(w, "summary"))));
  REQUIRE_FALSE(jf.error);
  CHECK(std::get<JobFailed>(jf.message->body).failure.exit_code == 3);
  CHECK(std::get<JobFailed>(jf.message->body).summary == "summary");
  auto e = decode(payload_of(encode(make_error("bad_token", "wrong"))));
  CHECK(std::get<ErrorMessage>(e.message->body).code == "bad_token");
  auto c = decode(payload_of(encode(make_challenge("abcd"))));
  CHECK(std::get<Challenge>(c.message->body).nonce == "abcd");
  auto s = decode(payload_of(encode(make_status_reply({{"jobs", json::array()}}))));
  CHECK(std::get<StatusReply>(s.message->body).status["jobs"].is_array());
  // A round whose ranks contradict each other is refused by the client's decoder.
  json bad = to_json(make_round(a));
  bad["assignment"]["group_rank"] = 5;
  CHECK(decode_json(bad).error);
}

TEST_CASE("a round's frames spliced per node are byte for byte the node's own encoding") {
  Assignment plain;
  plain.generation = 3;
  plain.group_world_size = 100000;
  plain.world_size = 800000;
  plain.master_addr = "10.1.2.3";
  plain.master_port = 29400;
  Assignment rich = plain;
  rich.goodput = {60.25, 50, 4, 3, 1, 0, 2, 0, 1};
  rich.round_age = 1.5;
  rich.restart_count = 2;
  rich.max_restarts = 7;
  Assignment tricky = plain;  // an address holding the very text the splice looks for
  tricky.master_addr = R"("group_rank":0,"rank_offset":0,"secret":"0" é)";
  for (const Assignment& shared : {plain, rich, tricky}) {
    const RoundFrames frames(shared);
    for (const auto& [rank, offset, secret] :
         {std::tuple{0, 0, std::string()}, std::tuple{1, 8, std::string("0123abcdef")},
          std::tuple{99999, 799992, std::string(64, 'f')}, std::tuple{-5, 2147483647, std::string("sealed\"x\n")},
          std::tuple{7, 56, std::string("0")}, std::tuple{3, 24, std::string("caf\xc3\xa9 \xff")}}) {
      Assignment own = shared;
      own.group_rank = rank;
      own.rank_offset = offset;
      own.secret = secret;
      CAPTURE(rank);
      CHECK(*frames.frame(rank, offset, secret) == *encode(make_round(own)));
    }
  }
}

TEST_CASE("the goodput account travels with a round and a verdict, checked like every other field") {
  Assignment a;
  a.master_addr = "10.1.2.3";
  a.goodput = {60, 50, 4, 3, 1, 0, 2, 0, 1};
  auto round = decode(payload_of(encode(make_round(a))));
  REQUIRE_FALSE(round.error);
  CHECK(std::get<Assignment>(round.message->body).goodput == a.goodput);
  for (const json& garbage : {json::array({1, 2}), json("97%"), json::array({1, 2, 3, 4, 5, 6, 7, 8, -1}),
                              json::array({1, 2, 3, 4, 5, 6, 7, 8, nullptr}),
                              json::array({1e300, 0, 0, 0, 0, 0, 0, 0, 0})}) {
    json bad = to_json(make_round(a));
    bad["assignment"]["goodput"] = garbage;
    auto d = decode_json(bad);
    REQUIRE(d.error);
    CHECK(d.error->message.find("goodput") != std::string::npos);
  }
  const std::string line = "job j: goodput 83.3% of 1m 0s: 4.0 s lost to 1 restart";
  auto ok = decode(payload_of(encode(make_job_succeeded("j", line))));
  REQUIRE_FALSE(ok.error);
  CHECK(std::get<JobSucceeded>(ok.message->body).goodput == line);
  CHECK(payload_of(encode(make_job_succeeded("j"))).find("goodput") == std::string::npos);  // the others' verdict
  auto failed = decode(payload_of(encode(make_job_failed(WorkerFailure{}, "summary", line))));
  REQUIRE_FALSE(failed.error);
  CHECK(std::get<JobFailed>(failed.message->body).goodput == line);
  CHECK(decode(R"({"type":"job_succeeded","job_id":"j","goodput":7})").error);
  auto long_line = decode(R"({"type":"job_succeeded","job_id":"j","goodput":")" + std::string(1 << 17, 'x') + "\"}");
  REQUIRE_FALSE(long_line.error);  // cut with a marker, like a summary
  CHECK(std::get<JobSucceeded>(long_line.message->body).goodput.size() < (1u << 17));
}

TEST_CASE("quiet on a restart or a verdict: absent is false, and it must be a boolean") {
  Message m = make_restart("node x lost", false, 1, 3);
  CHECK(payload_of(encode(m)).find("quiet") == std::string::npos);
  std::get<Restart>(m.body).quiet = true;
  auto r = decode(payload_of(encode(m)));
  REQUIRE_FALSE(r.error);
  CHECK(std::get<Restart>(r.message->body).quiet);
  auto v = decode(payload_of(encode(make_job_failed(WorkerFailure{}, "s", "", true))));
  REQUIRE_FALSE(v.error);
  CHECK(std::get<JobFailed>(v.message->body).quiet);
  CHECK(decode(R"({"type":"restart","reason":"x","counted":false,"quiet":"yes","restart_count":1,"max_restarts":1})").error);
}

TEST_CASE("a heartbeat's checkpoint stall is optional, and range-checked") {
  NodeProgress p;
  p.step = 5;
  p.checkpoint_stall = 2.5;
  auto hb = decode(payload_of(encode(make_heartbeat(p))));
  REQUIRE_FALSE(hb.error);
  CHECK(std::get<Heartbeat>(hb.message->body).progress->checkpoint_stall == 2.5);
  CHECK(payload_of(encode(make_heartbeat(NodeProgress{}))).find("checkpoint_stall") == std::string::npos);
  CHECK(decode(R"({"type":"heartbeat","checkpoint_stall":-1})").error);
  CHECK(decode(R"({"type":"heartbeat","checkpoint_stall":1e300})").error);
  CHECK(decode(R"({"type":"heartbeat","checkpoint_stall":"long"})").error);
  CHECK(std::get<Heartbeat>(decode(R"({"type":"heartbeat","checkpoint_stall":3})").message->body).progress->checkpoint_stall == 3);
  p.first_step = 3;
  auto first = decode(payload_of(encode(make_heartbeat(p))));
  REQUIRE_FALSE(first.error);
  CHECK(std::get<Heartbeat>(first.message->body).progress->first_step == 3);
  CHECK(decode(R"({"type":"heartbeat","step":5,"first_step":-2})").error);
  CHECK(decode(R"({"type":"heartbeat","step":5,"first_step":1e30})").error);
}

TEST_CASE("waiting carries the counts and the seconds left, and its ranges are checked") {
  Waiting w;
  w.job_id = "j";
  w.waiting = 1;
  w.rejoining = 2;
  w.min_nodes = 2;
  w.max_nodes = 4;
  w.join_left = 587.5;
  auto d = decode(payload_of(encode(make_waiting(w))));
  REQUIRE_FALSE(d.error);
  CHECK(d.message->type == MessageType::waiting);
  CHECK_FALSE(is_client_message(MessageType::waiting));
  const auto& back = std::get<Waiting>(d.message->body);
  CHECK(back.job_id == "j");
  CHECK(back.waiting == 1);
  CHECK(back.rejoining == 2);
  CHECK(back.max_nodes == 4);
  REQUIRE(back.join_left);
  CHECK(*back.join_left == doctest::Approx(587.5));
  CHECK_FALSE(back.last_call_left);
  for (json bad : {json{{"type", "waiting"}, {"waiting", -1}},
                   json{{"type", "waiting"}, {"waiting", "2"}},
                   json{{"type", "waiting"}, {"min_nodes", 3}, {"max_nodes", 2}},
                   json{{"type", "waiting"}, {"max_nodes", kMaxNodes + 1}},
                   json{{"type", "waiting"}, {"join_left", -5}},
                   json{{"type", "waiting"}, {"last_call_left", 1e300}},
                   json{{"type", "waiting"}, {"job_id", std::string(kMaxIdBytes + 1, 'x')}}}) {
    CAPTURE(bad.dump());
    auto r = decode_json(bad);
    REQUIRE(r.error);
    CHECK(r.error->code == "bad_message");
  }  // A join asks for these with a boolean, and nothing else.
  NodeSpec spec;
  spec.job_id = "j";
  spec.progress = true;
  auto join = decode(payload_of(encode(make_join(spec))));
  REQUIRE_FALSE(join.error);
  CHECK(std::get<NodeSpec>(join.message->body).progress);
  json bad_join = to_json(make_join(spec));
  bad_join["node"]["progress"] = "yes";
  auto refused = decode_json(bad_join);
  REQUIRE(refused.error);
  CHECK(refused.error->code == "bad_join");
}

TEST_CASE("a heartbeat carries its node's progress when there is some, and its ranges are checked") {
  auto plain = decode(payload_of(encode(make_heartbeat())));
  REQUIRE_FALSE(plain.error);
  CHECK_FALSE(std::get<Heartbeat>(plain.message->body).progress);

  NodeProgress p;
  p.step = 1234;
  p.checkpoint_step = 1200;
  p.checkpoint_interval = 90.5;
  p.busy = 0.412;
  p.busy_local_rank = 3;
  auto d = decode(payload_of(encode(make_heartbeat(p))));
  REQUIRE_FALSE(d.error);
  CHECK(is_client_message(MessageType::heartbeat));
  const auto& back = std::get<Heartbeat>(d.message->body).progress;
  REQUIRE(back);
  CHECK(*back == p);
  // A node whose workers saved nothing and chose no interval yet.
  auto partial = decode_json(json{{"type", "heartbeat"}, {"step", 7}});
  REQUIRE_FALSE(partial.error);
  REQUIRE(std::get<Heartbeat>(partial.message->body).progress);
  CHECK(std::get<Heartbeat>(partial.message->body).progress->checkpoint_step == -1);
  CHECK(std::get<Heartbeat>(partial.message->body).progress->checkpoint_interval == 0);

  for (json bad : {json{{"type", "heartbeat"}, {"step", -2}},
                   json{{"type", "heartbeat"}, {"step", "7"}},
                   json{{"type", "heartbeat"}, {"step", 1.5}},
                   json{{"type", "heartbeat"}, {"step", kMaxReportedStep + 1}},
                   json{{"type", "heartbeat"}, {"step", std::numeric_limits<std::uint64_t>::max()}},
                   json{{"type", "heartbeat"}, {"checkpoint_step", json::array({1})}},
                   json{{"type", "heartbeat"}, {"checkpoint_interval", -1}},
                   json{{"type", "heartbeat"}, {"checkpoint_interval", 1e300}},
                   json{{"type", "heartbeat"}, {"checkpoint_interval", "90"}},
                   json{{"type", "heartbeat"}, {"busy", 0.2}},
                   json{{"type", "heartbeat"}, {"busy", 0.2}, {"busy_rank", kMaxLocalWorldSize}},
                   json{{"type", "heartbeat"}, {"busy", -1}, {"busy_rank", 0}},
                   json{{"type", "heartbeat"}, {"busy", true}, {"busy_rank", 0}}}) {
    CAPTURE(bad.dump());
    auto r = decode_json(bad);
    REQUIRE(r.error);
    CHECK(r.error->code == "bad_message");
  }
}

TEST_CASE("stall carries how long the workers were silent; probe carries nothing; both are range-checked") {
  auto d = decode(payload_of(encode(make_stall(0.25))));
  REQUIRE_FALSE(d.error);
  CHECK(d.message->type == MessageType::stall);
  CHECK(std::get<Stall>(d.message->body).stalled_for == 0.25);
  CHECK(is_client_message(MessageType::stall));
  auto p = decode(payload_of(encode(make_probe())));
  REQUIRE_FALSE(p.error);
  CHECK(p.message->type == MessageType::probe);
  CHECK_FALSE(is_client_message(MessageType::probe));
  for (json bad : {json{{"type", "stall"}},
                   json{{"type", "stall"}, {"stalled_for", -0.1}},
                   json{{"type", "stall"}, {"stalled_for", "1"}},
                   json{{"type", "stall"}, {"stalled_for", 1e300}},
                   json{{"type", "stall"}, {"stalled_for", json::array({1})}}}) {
    CAPTURE(bad.dump());
    auto r = decode_json(bad);
    REQUIRE(r.error);
    CHECK(r.error->code == "bad_message");
  }
}

TEST_CASE("check_peer names an id, an address, a port and a time; peer_alive the id; both are range-checked") {
  auto c = decode(payload_of(encode(make_check_peer({7, "10.1.2.3", 40001, 0.15}))));
  REQUIRE_FALSE(c.error);
  CHECK(c.message->type == MessageType::check_peer);
  const auto& check = std::get<CheckPeer>(c.message->body);
  CHECK(check.id == 7);
  CHECK(check.addr == "10.1.2.3");
  CHECK(check.port == 40001);
  CHECK(check.within == 0.15);
  CHECK_FALSE(is_client_message(MessageType::check_peer));
  auto a = decode(payload_of(encode(make_peer_alive(kMaxCheckId))));
  REQUIRE_FALSE(a.error);
  CHECK(std::get<PeerAlive>(a.message->body).id == kMaxCheckId);
  CHECK(is_client_message(MessageType::peer_alive));
  const json good = {{"type", "check_peer"}, {"id", 1}, {"addr", "::1"}, {"port", 1}, {"within", 0.1}};
  std::vector<json> bad = {json{{"type", "peer_alive"}},
                           json{{"type", "peer_alive"}, {"id", 0}},
                           json{{"type", "peer_alive"}, {"id", -1}},
                           json{{"type", "peer_alive"}, {"id", kMaxCheckId + 1}},
                           json{{"type", "peer_alive"}, {"id", "7"}},
                           json{{"type", "peer_alive"}, {"id", 1.5}}};
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{{"id", 0},
                                                                            {"id", kMaxCheckId + 1},
                                                                            {"addr", ""},
                                                                            {"addr", std::string(256, 'a')},
                                                                            {"addr", 10},
                                                                            {"port", 0},
                                                                            {"port", 65536},
                                                                            {"within", 0},
                                                                            {"within", 61},
                                                                            {"within", "1"}}) {
    json j = good;
    j[key] = value;
    bad.push_back(j);
  }
  for (const char* missing : {"id", "addr", "port", "within"}) {
    json j = good;
    j.erase(missing);
    bad.push_back(j);
  }
  REQUIRE_FALSE(decode_json(good).error);
  for (const json& b : bad) {
    CAPTURE(b.dump());
    auto r = decode_json(b);
    REQUIRE(r.error);
    CHECK(r.error->code == "bad_message");
  }
}

TEST_CASE("drain carries its proof, the job, the node and force; drained answers it; both are checked") {
  Drain d;
  d.hello.job_id = "job";
  d.hello.client_nonce = "ab";
  d.hello.proof = "cd";
  d.job = "job";
  d.node = "node7";
  d.force = true;
  auto r = decode(payload_of(encode(make_drain(d))));
  REQUIRE_FALSE(r.error);
  CHECK(r.message->type == MessageType::drain);
  CHECK(is_client_message(MessageType::drain));
  const Drain& got = std::get<Drain>(r.message->body);
  CHECK(got.hello.protocol_version == kProtocolVersion);
  CHECK(got.hello.client_nonce == "ab");
  CHECK(got.hello.proof == "cd");
  CHECK(got.job == "job");
  CHECK(got.node == "node7");
  CHECK(got.force);
  CHECK_FALSE(check_first_message(*r.message));
  CHECK(&first_hello(*r.message) == &got.hello);
  auto reply = decode(payload_of(encode(make_drained(Drained{"job", "node7 [group rank 1]", "drained it"}))));
  REQUIRE_FALSE(reply.error);
  CHECK(reply.message->type == MessageType::drained);
  CHECK_FALSE(is_client_message(MessageType::drained));
  CHECK(std::get<Drained>(reply.message->body).node == "node7 [group rank 1]");
  const json good = to_json(make_drain(d));
  auto with = [&](const char* key, json value) {
    json j = good;
    if (value.is_null()) {
      j.erase(key);
    } else {
      j[key] = std::move(value);
    }
    return j;
  };
  for (json bad : {with("job", nullptr), with("node", nullptr), with("job", ""), with("node", ""),
                   with("job", 7), with("node", json::array({"a"})), with("force", "yes"),
                   with("job", std::string(kMaxIdBytes + 1, 'j')), with("node", std::string(kMaxHostBytes + 1, 'n')),
                   with("protocol_version", nullptr), with("proof", std::string(kMaxNonceBytes + 1, 'a'))}) {
    CAPTURE(bad.dump());
    auto e = decode_json(bad);
    REQUIRE(e.error);
    CHECK(e.error->code == "bad_message");
  }
  Drain old = d;
  old.hello.protocol_version = 1;
  CHECK(check_first_message(make_drain(old))->code == "version_mismatch");
}

TEST_CASE("probe_timeout travels with the timeouts and is range-checked like them") {
  NodeSpec s;
  s.job_id = "j";
  s.host = "h";
  s.timeouts.probe_timeout = 0.7;
  auto d = decode(payload_of(encode(make_join(s))));
  REQUIRE_FALSE(d.error);
  CHECK(std::get<NodeSpec>(d.message->body).timeouts.probe_timeout == 0.7);
  json j = to_json(make_join(s));
  j["node"]["timeouts"]["probe_timeout"] = -1;
  REQUIRE(decode_json(j).error);
  j["node"]["timeouts"].erase("probe_timeout");  // an absent key keeps the default
  auto absent = decode_json(j);
  REQUIRE_FALSE(absent.error);
  CHECK(std::get<NodeSpec>(absent.message->body).timeouts.probe_timeout == Timeouts{}.probe_timeout);
}

TEST_CASE("the first message must be hello or status with our version and, for hello, a job") {
  Hello h;
  h.job_id = "job";
  CHECK_FALSE(check_first_message(make_hello(h)));
  CHECK_FALSE(check_first_message(make_status_request(Hello{})));
  Hello old = h;
  old.protocol_version = 1;
  auto err = check_first_message(make_hello(old));
  REQUIRE(err);
  CHECK(err->code == "version_mismatch");
  CHECK(err->message.find("version 1 ") != std::string::npos);
  CHECK(check_first_message(make_join(NodeSpec{}))->code == "bad_message");
  CHECK(check_first_message(make_hello(Hello{}))->code == "bad_message");
}

TEST_CASE("the greeting carries the magic and our version in one frame that ends a line") {
  const Frame g = encode_greeting();
  FrameReader reader;
  reader.feed(g->data(), g->size());
  std::string payload;
  REQUIRE(reader.next(payload) == FrameReader::Result::frame);
  CHECK(payload.substr(payload.size() - 2) == "\r\n");  // line-based services answer it
  Decoded d = decode(payload);
  REQUIRE_FALSE(d.error);
  REQUIRE(d.message->type == MessageType::greeting);
  CHECK_FALSE(check_greeting(std::get<Greeting>(d.message->body)));
  Greeting old;
  old.protocol_version = 2;
  REQUIRE(check_greeting(old));
  CHECK(check_greeting(old)->code == "version_mismatch");
  Greeting other;
  other.magic = "redis";
  CHECK(check_greeting(other)->code == "bad_message");
  CHECK(is_client_message(MessageType::greeting));
}

TEST_CASE("a client names a peer that is not a rendezvous server from its first bytes") {
  using V = ServerCheck::Verdict;
  // A rendezvous server's challenge, fed a byte at a time: undecided until it is whole.
  const Frame challenge = encode(make_challenge("abcd"));
  for (std::size_t n = 1; n < challenge->size(); ++n) {
    INFO("after " << n << " bytes");
    CHECK(check_server_start(std::string_view(*challenge).substr(0, n)).verdict == V::need_more);
  }
  CHECK(check_server_start(*challenge).verdict == V::rendezvous);
  // HTTP answers (status line or an HTML page) are refused from their first byte, and quoted.
  ServerCheck http = check_server_start("HTTP/1.0 400 Bad request\r\nServer: x\r\n");
  CHECK(http.verdict == V::refuse);
  CHECK(http.reason == "is not a ddp-rendezvous server (it answered 'HTTP/1.0 400 Bad request Server: x ')");
  CHECK(check_server_start("<").verdict == V::refuse);
  // A framed answer that is not a challenge, or too long to be one, or not JSON.
  CHECK(check_server_start(*encode(make_welcome())).verdict == V::refuse);
  CHECK(check_server_start(std::string("\0\1\0\0", 4)).verdict == V::refuse);
  CHECK(check_server_start(std::string("\0\0\0\5hello", 9)).verdict == V::refuse);
  // A challenge without the magic, of an older protocol: named as an older rendezvous server.
  json old = to_json(make_challenge("abcd"));
  old.erase("magic");
  old["protocol_version"] = 2;
  ServerCheck older = check_server_start(*encode_frame(old));
  CHECK(older.verdict == V::refuse);
  CHECK(older.reason.find("ddp-rendezvous server of protocol version 2; this program speaks version " + std::to_string(kProtocolVersion)) !=
        std::string::npos);
  json nomagic = to_json(make_challenge("abcd"));
  nomagic["magic"] = "other";
  CHECK(check_server_start(*encode_frame(nomagic)).verdict == V::refuse);
  // A rendezvous server refusing at once (a TLS-only server to a plaintext client) is quoted.
  ServerCheck refused = check_server_start(*encode(make_error("tls_required", "speaks TLS only")));
  CHECK(refused.verdict == V::refuse);
  CHECK(refused.reason == "refused the connection: speaks TLS only [tls_required]");
  // A TLS record (a TLS server's alert) is named as TLS.
  CHECK(check_server_start(std::string("\x15\x03\x03\x00\x02\x02\x46", 7)).reason.find("speaks TLS") == 0);
  // Closed: before a word, or after part of something else.
  CHECK(check_server_start("", true).verdict == V::refuse);
  CHECK(check_server_start("", false).verdict == V::need_more);
  CHECK(check_server_start(std::string("\0\0", 2), true).verdict == V::refuse);
}

TEST_CASE("excerpts of a peer's answer are printable, short and single-spaced") {
  CHECK(printable_excerpt("a\r\n  b\tc") == "a b c");
  CHECK(printable_excerpt(std::string("\0\x7f\\", 3)) == "\\x00\\x7f\\x5c");
  CHECK(printable_excerpt(std::string(100, 'x'), 10) == std::string(10, 'x') + "...");
}

TEST_CASE("proofs depend on the secret, the role, both nonces and the job") {
  const std::string p = auth_proof("s3cret", "hello", "n1", "c1", "job");
  CHECK(p.size() == 64);
  CHECK(proofs_equal(p, auth_proof("s3cret", "hello", "n1", "c1", "job")));
  CHECK_FALSE(proofs_equal(p, auth_proof("s3creT", "hello", "n1", "c1", "job")));
  CHECK_FALSE(proofs_equal(p, auth_proof("s3cret", "server", "n1", "c1", "job")));
  CHECK_FALSE(proofs_equal(p, auth_proof("s3cret", "hello", "n2", "c1", "job")));
  CHECK_FALSE(proofs_equal(p, auth_proof("s3cret", "hello", "n1", "c2", "job")));
  CHECK_FALSE(proofs_equal(p, auth_proof("s3cret", "hello", "n1", "c1", "job2")));
  CHECK_FALSE(proofs_equal("", ""));
  CHECK(random_hex(32).size() == 64);
}

TEST_CASE("pooled random hex: fresh hex of the size asked, never repeated across the pool's refills") {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {  // 16 bytes each: almost four refills of the 4 KiB pool
    const std::string h = pooled_random_hex(16);
    CHECK(h.size() == 32);
    CHECK(h.find_first_not_of("0123456789abcdef") == std::string::npos);
    CHECK(seen.insert(h).second);
  }
  CHECK(pooled_random_hex(3000).size() == 6000);  // larger than what is left of the pool
  CHECK(pooled_random_hex(5000).size() == 10000);  // larger than the pool: drawn directly
}

TEST_CASE("a node secret sealed under one connection key opens with that key only") {
  const std::string secret = random_hex(16) + random_hex(40);  // past one 64-digit keystream block
  const std::string key = seal_key("s3cret", "n1", "c1", "job");
  CHECK(key.size() == 64);
  CHECK(key != auth_proof("s3cret", "hello", "n1", "c1", "job"));  // never a proof that was sent
  const std::string sealed = seal_hex(key, secret);
  CHECK(sealed.size() == secret.size());
  CHECK(sealed.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(sealed != secret);
  CHECK(sealed.substr(64) != secret.substr(64));
  CHECK(seal_hex(key, sealed) == secret);
  CHECK(seal_hex(seal_key("s3cret", "n2", "c1", "job"), sealed) != secret);
  CHECK(seal_hex(seal_key("s3cret", "n1", "c1", "job2"), sealed) != secret);
  CHECK(seal_hex(seal_key("other", "n1", "c1", "job"), sealed) != secret);
  // No secret, no key: the value goes as it is (a server without secrets accepts anyone anyway).
  CHECK(seal_key("", "n1", "c1", "job").empty());
  CHECK(seal_hex("", secret) == secret);
  CHECK(seal_hex(key, "zz-xy!") == "zz-xy!");
  CHECK(random_hex() != random_hex());
}

TEST_CASE("secrets: a job's own secret wins over the cluster's; with only job secrets others are refused") {
  Secrets open;
  CHECK(open.open());
  CHECK(open.for_job("any") == std::string());
  Secrets s("cluster");
  s.set_job("a", "sa");
  CHECK(s.for_job("a") == std::string("sa"));
  CHECK(s.for_job("b") == std::string("cluster"));
  CHECK(s.for_job("") == std::string("cluster"));
  CHECK_FALSE(s.is_cluster_secret("a"));
  Secrets jobs_only;
  jobs_only.set_job("a", "sa");
  CHECK_FALSE(jobs_only.for_job("b"));
  CHECK_FALSE(jobs_only.for_job(""));
}

TEST_CASE("not_leader names the leader as HOST:PORT or nobody, and anything else is refused") {
  for (const char* leader : {"", "10.0.0.1:29400", "head-2.example.org:1", "[fe80::1]:65535"}) {
    auto d = decode(payload_of(encode(make_not_leader(leader))));
    REQUIRE_MESSAGE(!d.error, leader);
    CHECK(d.message->type == MessageType::not_leader);
    CHECK(std::get<NotLeader>(d.message->body).leader == leader);
  }
  CHECK_FALSE(is_client_message(MessageType::not_leader));
  const json hostile[] = {
      {{"type", "not_leader"}, {"leader", 5}},
      {{"type", "not_leader"}, {"leader", json::array()}},
      {{"type", "not_leader"}, {"leader", "host"}},             // no port
      {{"type", "not_leader"}, {"leader", "host:0"}},
      {{"type", "not_leader"}, {"leader", "host:65536"}},
      {{"type", "not_leader"}, {"leader", "host:12ab"}},
      {{"type", "not_leader"}, {"leader", "fe80::1:29400"}},    // IPv6 without brackets
      {{"type", "not_leader"}, {"leader", "ho st:1"}},
      {{"type", "not_leader"}, {"leader", "evil\nhost:1"}},
      {{"type", "not_leader"}, {"leader", ":29400"}},
      {{"type", "not_leader"}, {"leader", std::string(300, 'a') + ":1"}},
  };
  for (const json& j : hostile) {
    auto d = decode_json(j);
    CHECK_MESSAGE(d.error, j.dump().substr(0, 80));
  }
}
