// The rendezvous wire protocol: frames and messages (docs/protocol.md describes every message).
// A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON, one message
// per frame. No Boost.Asio here: the framing is tested without sockets, and the state machine
// builds its outgoing frames with these functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "rendezvous/types.h"

namespace ddp::rdzv {

// Bumped on every incompatible change of a message; the first message of a connection names it.
inline constexpr int kProtocolVersion = 1;
// Default size limit of one frame's payload; checked before any buffer is allocated.
inline constexpr std::size_t kDefaultMaxFrameBytes = 1 << 20;
inline constexpr std::size_t kFrameHeaderBytes = 4;

// An encoded frame (header + payload), shared between the sessions it is broadcast to.
using Frame = std::shared_ptr<const std::string>;

// Encodes `message` as one frame.
Frame encode_frame(const nlohmann::json& message);
// Writes `length` as the 4-byte big-endian frame header.
void write_frame_header(std::uint32_t length, unsigned char out[kFrameHeaderBytes]);
// Reads the payload length from a 4-byte header.
std::uint32_t read_frame_header(const unsigned char in[kFrameHeaderBytes]);

// Why a frame or message was rejected; sent to the peer in an `error` message before closing.
struct ProtocolError {
  std::string code;     // machine-readable: bad_frame, too_large, bad_json, bad_message,
                        // version_mismatch, bad_token, ...
  std::string message;  // one sentence naming what was wrong and what to do
};

// Checks a frame length against the limit before the payload buffer exists.
std::optional<ProtocolError> check_frame_length(std::uint32_t length, std::size_t max_frame_bytes);

// Parses one payload into a JSON object with a string "type"; anything else is a ProtocolError.
struct Parsed {
  nlohmann::json message;
  std::optional<ProtocolError> error;
};
Parsed parse_message(const std::string& payload);
Parsed parse_message(const char* data, std::size_t size);

// Message builders (server -> client).
nlohmann::json make_welcome();
nlohmann::json make_error(const std::string& code, const std::string& message);
nlohmann::json make_round(const Assignment& assignment);
nlohmann::json make_restart(const std::string& reason, bool counted, int restart_count,
                            int max_restarts);
nlohmann::json make_job_succeeded(const std::string& job_id);
nlohmann::json make_job_failed(const WorkerFailure& first_failure, const std::string& summary);
nlohmann::json make_heartbeat_ack();

// Message builders (client -> server).
nlohmann::json make_hello(const std::string& job_id, const std::string& token);
nlohmann::json make_status_request(const std::string& token);
nlohmann::json make_join(const NodeSpec& spec);
nlohmann::json make_heartbeat();
nlohmann::json make_failure(const WorkerFailure& failure);
nlohmann::json make_success();
nlohmann::json make_leave();

// Checks the first message of a connection (hello or status): version and token.
// `expected_token` empty means no token is required.
std::optional<ProtocolError> check_first_message(const nlohmann::json& message,
                                                 const std::string& expected_token);

// Compares two tokens in time independent of where they differ.
bool tokens_equal(const std::string& a, const std::string& b);

}  // namespace ddp::rdzv
