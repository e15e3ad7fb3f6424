// libFuzzer target: arbitrary bytes through the rendezvous codec and the state machine.
//
// The input is a conversation of up to four connections with a server, with time passing:
//   repeat { tag (1 byte): connection = tag & 3, then the clock advances (tag >> 2) * 0.1 s;
//            length (2 bytes, big-endian); that many bytes of the connection's byte stream }
// Each connection splits its stream with the server's FrameReader and decode(); what decodes is
// dispatched as the server does (an optional greeting, hello/status, then join, failure, ...). Every
// frame the state machine sends back must decode cleanly, and every round must be consistent:
// a violation aborts (a crash for libFuzzer). Built with clang + -fsanitize=fuzzer for fuzzing,
// and with the normal compiler into the corpus replay test (replay_main.cpp).
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <string>

#include "rendezvous/clock.h"
#include "rendezvous/protocol.h"
#include "rendezvous/state.h"

namespace {

using namespace ddp::rdzv;

[[noreturn]] void violated(const char* what, const std::string& detail) {
  std::fprintf(stderr, "rdzv_fuzz: invariant violated: %s: %s\n", what, detail.c_str());
  std::abort();
}

// Decodes every frame the state machine emits, as a client would, and checks rounds.
class CheckingOutbox : public Outbox {
 public:
  std::map<ConnId, bool> dropped;
  void send(ConnId to, const Frame& frame) override {
    FrameReader reader(256u << 20);
    reader.feed(frame->data(), frame->size());
    std::string payload;
    if (reader.next(payload) != FrameReader::Result::frame) violated("server frame", "does not split");
    Decoded d = decode(payload);
    if (d.error) violated("server message does not decode", d.error->message + ": " + payload.substr(0, 300));
    if (d.message->type == MessageType::round) {
      const Assignment& a = std::get<Assignment>(d.message->body);
      if (a.world_size < a.group_world_size || a.rank_offset >= a.world_size || a.group_rank >= a.group_world_size) {
        violated("inconsistent round", payload);
      }
    }
  }
  void drop(ConnId conn, const std::string& code, const std::string& message) override {
    dropped[conn] = true;
    send(conn, encode(make_error(code, message)));
  }
  void log(const std::string&) override {}
};

struct Conn {
  FrameReader reader{64 * 1024};
  bool said_greeting = false;
  bool greeted = false;
  bool closed = false;
  std::string job_id;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ManualClock clock;
  CheckingOutbox out;
  StateMachine sm(clock, out, make_env_round_check({}));
  Conn conns[4];
  std::string payload;
  std::size_t pos = 0;
  while (pos + 3 <= size) {
    const std::uint8_t tag = data[pos];
    const std::size_t len = (std::size_t{data[pos + 1]} << 8) | data[pos + 2];
    pos += 3;
    const std::size_t n = std::min(len, size - pos);
    const ConnId id = tag & 3u;
    Conn& c = conns[id];
    clock.advance((tag >> 2) * 0.1);
    sm.tick();
    if (out.dropped[id]) c.closed = true;
    if (!c.closed) c.reader.feed(reinterpret_cast<const char*>(data + pos), n);
    pos += n;
    while (!c.closed) {
      const auto r = c.reader.next(payload);
      if (r == FrameReader::Result::need_more) break;
      if (r == FrameReader::Result::error) {
        c.closed = true;
        break;
      }
      Decoded d = decode(payload);
      if (d.error) {  // the server closes the connection; a member is lost
        sm.disconnected(id, "bad message");
        c.closed = true;
        break;
      }
      Message& m = *d.message;
      if (!c.greeted) {
        if (m.type == MessageType::greeting && !c.said_greeting) {  // optional, before hello
          c.said_greeting = true;
          if (check_greeting(std::get<Greeting>(m.body))) {
            c.closed = true;
            break;
          }
          continue;
        }
        if (check_first_message(m)) {
          c.closed = true;
          break;
        }
        c.greeted = true;
        c.job_id = first_hello(m).job_id;
        if (m.type == MessageType::status) (void)sm.status().dump();
        if (m.type == MessageType::drain) {  // an operator's connection: one drain, then closed
          const Drain& d = std::get<Drain>(m.body);
          (void)sm.drain(d.job, d.node, d.force);
          c.closed = true;
          break;
        }
        continue;
      }
      sm.touch(id);
      switch (m.type) {
        case MessageType::join: {
          NodeSpec spec = std::get<NodeSpec>(m.body);
          if (spec.job_id.empty()) spec.job_id = c.job_id;
          if (spec.job_id != c.job_id) {
            c.closed = true;
            sm.disconnected(id, "bad join");
            break;
          }
          if (spec.addr.empty()) spec.addr = "127.0.0.1";
          sm.join(id, std::move(spec));
          break;
        }
        case MessageType::failure:
          sm.report_failure(id, std::get<WorkerFailure>(m.body));
          break;
        case MessageType::success:
          sm.report_success(id);
          break;
        case MessageType::leave:
          sm.leave(id);
          c.closed = true;
          break;
        case MessageType::status:
          (void)sm.status().dump();
          break;
        case MessageType::heartbeat:
          break;
        case MessageType::stall:
          sm.stall(id, std::get<Stall>(m.body).stalled_for);
          break;
        case MessageType::peer_alive:
          sm.peer_alive(id, std::get<PeerAlive>(m.body).id);
          break;
        default:
          sm.disconnected(id, "server message from a client");
          c.closed = true;
          break;
      }
      if (out.dropped[id]) c.closed = true;
    }
  }
  // Every connection closes at the end; the state machine forgets everything.
  for (ConnId id = 0; id < 4; ++id) sm.disconnected(id, "end of input");
  if (sm.job_count() != 0 || sm.node_count() != 0) violated("state left behind", std::to_string(sm.job_count()));
  return 0;
}
