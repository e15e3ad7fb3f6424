// The worker channel: the socket between a worker and its agent (in-memory restart, standbys).
//
// With in-memory restart on, every worker has a SOCK_STREAM Unix socket to its agent, its
// descriptor number in DDPLAUNCH_WORKER_FD (a cold-started worker gets a fresh one; a worker made
// from a standby keeps the standby's socket). The agent keeps its end for the worker's whole life,
// across rounds, and sends on it the next round's assignment to a parked worker (the standby
// assignment of contracts/standby_assignment.h, unchanged). The worker sends these frames:
//   bytes 0-3   magic "DDPW"
//   bytes 4-7   version, unsigned 32-bit little endian (kWorkerChannelVersion)
//   bytes 8-11  payload length N, unsigned 32-bit little endian, 2 <= N <= kMaxWorkerPayload
//   N bytes     a JSON object (one level deep: kMaxWorkerDepth), exactly one of
//                 {"type": "restartable", "value": true|false}
//                     true: at a restart, do not stop this worker, it will park; false: stop it
//                     as any worker (the SDK says true when Trainer::fit starts, false when it ends)
//                 {"type": "parked", "step": N}   (N an integer, -1 <= N < 2^53)
//                     the worker tore down its process group after its round was abandoned,
//                     holds its training state at step N (-1: none) and waits for its next
//                     assignment on this socket
//                 {"type": "standby_ready"}
//                     sent once by a standby (on its DDPLAUNCH_STANDBY_FD socket, which may
//                     become this channel) when it has loaded and waits for its assignment; an
//                     agent that starts defers its join until its standbys said it (docs/agent.md,
//                     "Standby workers"); on a worker's channel it means nothing
// Anything else is an error: the agent closes the channel, treats the worker as not restartable,
// and says so (docs/agent.md, "In-memory restart: the worker channel"). The encoder writes the
// keys in sorted order, compact; the Python writer (python/ddplaunch_standby.py, encode_frame)
// writes the same bytes, which contracts/fixtures/worker_*.bin hold.
//
// Pure functions and a socket-free incremental decoder (no Boost): the agent reads with it, the
// worker SDK writes with it. Not thread-safe; one decoder per channel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "contracts/frame_header.h"

namespace ddp::contracts {

constexpr std::string_view kWorkerMagic = "DDPW";
constexpr std::uint32_t kWorkerChannelVersion = 1;
constexpr std::size_t kWorkerHeaderSize = kFrameHeaderSize;
constexpr std::size_t kMaxWorkerPayload = 4096;
// A flat object.
constexpr int kMaxWorkerDepth = 1;
// The variable that names the worker's end of its channel (a decimal descriptor number).
constexpr const char* kWorkerFdVariable = "DDPLAUNCH_WORKER_FD";
// The largest step a parked message may carry (exclusive): 2^53, where a JSON number stops
// being an exact integer for every reader.
constexpr std::int64_t kMaxParkedStep = std::int64_t{1} << 53;

struct WorkerMessage {
  enum class Type { kRestartable, kParked, kStandbyReady };
  Type type = Type::kRestartable;
  bool restartable = false;  // kRestartable: the value
  std::int64_t step = -1;    // kParked: the step whose state the worker holds, -1 = none

  static WorkerMessage make_restartable(bool value) { return {Type::kRestartable, value, -1}; }
  static WorkerMessage make_parked(std::int64_t step) { return {Type::kParked, false, step}; }
  static WorkerMessage make_standby_ready() { return {Type::kStandbyReady, false, -1}; }
  bool operator==(const WorkerMessage& o) const {
    if (type != o.type) return false;
    if (type == Type::kRestartable) return restartable == o.restartable;
    return type == Type::kStandbyReady || step == o.step;
  }
};

// The frame for `m` (header and payload). Throws std::invalid_argument for a parked step out of
// -1 <= step < 2^53.
std::string encode_worker_message(const WorkerMessage& m);

// Reads frames from a byte stream in pieces of any size. After the first error it stays failed:
// the stream cannot be resynchronised, and the agent closes the channel.
class WorkerChannelDecoder {
 public:
  // Appends each message completed by `bytes` to `out`. Returns false once the stream broke the
  // rules (error() says how); messages completed before the bad frame are still appended.
  bool feed(std::string_view bytes, std::vector<WorkerMessage>& out);
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }
  // Bytes of an incomplete frame held (0 between frames).
  std::size_t pending() const { return buffer_.size(); }

 private:
  bool fail(std::string why);
  std::string buffer_;  // at most kWorkerHeaderSize + kMaxWorkerPayload bytes
  std::string error_;
};

// Decodes one payload (the JSON object of a frame); false with `error` saying what was wrong.
bool decode_worker_payload(std::string_view payload, WorkerMessage& out, std::string& error);

}  // namespace ddp::contracts
