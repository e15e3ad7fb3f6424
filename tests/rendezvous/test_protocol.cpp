// Protocol unit tests: framing, size limits, first-message checks, message round trips.
#include <doctest/doctest.h>

#include "rendezvous/protocol.h"

using namespace ddp::rdzv;

TEST_CASE("a frame is a 4-byte big-endian length followed by the JSON payload") {
  Frame f = encode_frame({{"type", "heartbeat"}});
  std::string payload = R"({"type":"heartbeat"})";
  REQUIRE(f->size() == 4 + payload.size());
  CHECK(read_frame_header(reinterpret_cast<const unsigned char*>(f->data())) == payload.size());
  CHECK(f->substr(4) == payload);
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

TEST_CASE("malformed JSON and messages without a type are refused") {
  CHECK(parse_message("{not json")
            .error->code == "bad_json");
  CHECK(parse_message("[1,2]").error->code == "bad_message");
  CHECK(parse_message(R"({"type":3})").error->code == "bad_message");
  CHECK_FALSE(parse_message(R"({"type":"join"})").error);
}

TEST_CASE("the first message must be hello or status with our version and the token") {
  CHECK_FALSE(check_first_message(make_hello("job", ""), ""));
  CHECK_FALSE(check_first_message(make_hello("job", "tok"), "tok"));
  CHECK_FALSE(check_first_message(make_status_request("tok"), "tok"));
  CHECK(check_first_message(make_hello("job", "bad"), "tok")->code == "bad_token");
  CHECK(check_first_message(make_hello("job", ""), "tok")->code == "bad_token");
  auto old = make_hello("job", "");
  old["protocol_version"] = 99;
  auto err = check_first_message(old, "");
  REQUIRE(err);
  CHECK(err->code == "version_mismatch");
  CHECK(err->message.find("99") != std::string::npos);
  CHECK(check_first_message(make_join(NodeSpec{}), "")->code == "bad_message");
  CHECK(check_first_message(make_hello("", ""), "")->code == "bad_message");
}

TEST_CASE("round, restart and job_failed messages carry their data") {
  Assignment a;
  a.generation = 7;
  a.group_rank = 2;
  a.rank_offset = 16;
  a.master_addr = "10.1.2.3";
  auto back = make_round(a)["assignment"].get<Assignment>();
  CHECK(back.generation == 7);
  CHECK(back.rank_offset == 16);
  CHECK(back.master_addr == "10.1.2.3");
  auto r = make_restart("node x lost", false, 2, 3);
  CHECK(r["counted"] == false);
  CHECK(r["restart_count"] == 2);
  WorkerFailure w;
  w.host = "h";
  w.exit_code = 3;
  auto jf = make_job_failed(w, "summary");
  CHECK(jf["failure"].get<WorkerFailure>().exit_code == 3);
  CHECK(jf["summary"] == "summary");
}
