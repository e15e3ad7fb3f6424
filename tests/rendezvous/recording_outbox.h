// A test Outbox: records what the state machine sends, decoded back to JSON.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "rendezvous/protocol.h"
#include "rendezvous/state.h"

namespace ddp::rdzv::test {

struct RecordingOutbox : Outbox {
  struct Drop {
    std::string code;
    std::string message;
  };
  std::map<ConnId, std::vector<nlohmann::json>> sent;
  std::map<ConnId, Drop> dropped;
  std::vector<std::string> lines;

  void send(ConnId to, const Frame& frame) override {
    sent[to].push_back(nlohmann::json::parse(frame->substr(kFrameHeaderBytes)));
  }
  void drop(ConnId conn, const std::string& code, const std::string& message) override {
    dropped[conn] = Drop{code, message};
  }
  void log(const std::string& line) override { lines.push_back(line); }

  // Messages of `type` sent to `conn` since the last clear().
  std::vector<nlohmann::json> of(ConnId conn, const std::string& type) const {
    std::vector<nlohmann::json> out;
    auto it = sent.find(conn);
    if (it == sent.end()) return out;
    for (const auto& m : it->second) {
      if (m["type"] == type) out.push_back(m);
    }
    return out;
  }
  // The last round assignment sent to `conn`; REQUIRES one was sent.
  Assignment round(ConnId conn) const {
    auto rounds = of(conn, "round");
    REQUIRE_FALSE(rounds.empty());
    return rounds.back()["assignment"].get<Assignment>();
  }
  void clear() {
    sent.clear();
    dropped.clear();
  }
};

// Also records the events the state machine emits.
struct EventOutbox : RecordingOutbox {
  using RecordingOutbox::of;  // of(conn, type): messages sent
  std::vector<ddp::metrics::Event> events;
  void event(const ddp::metrics::Event& e) override { events.push_back(e); }
  std::vector<const ddp::metrics::Event*> of(const std::string& type) const {
    std::vector<const ddp::metrics::Event*> out;
    for (const auto& e : events) {
      if (e.type == type) out.push_back(&e);
    }
    return out;
  }
};

}  // namespace ddp::rdzv::test
