#include "rendezvous/protocol.h"

namespace ddp::rdzv {

using nlohmann::json;

void write_frame_header(std::uint32_t length, unsigned char out[kFrameHeaderBytes]) {
  out[0] = static_cast<unsigned char>(length >> 24);
  out[1] = static_cast<unsigned char>(length >> 16);
  out[2] = static_cast<unsigned char>(length >> 8);
  out[3] = static_cast<unsigned char>(length);
}

std::uint32_t read_frame_header(const unsigned char in[kFrameHeaderBytes]) {
  return (std::uint32_t{in[0]} << 24) | (std::uint32_t{in[1]} << 16) |
         (std::uint32_t{in[2]} << 8) | std::uint32_t{in[3]};
}

Frame encode_frame(const json& message) {
  std::string payload = message.dump();
  std::string frame(kFrameHeaderBytes, '\0');
  write_frame_header(static_cast<std::uint32_t>(payload.size()),
                     reinterpret_cast<unsigned char*>(frame.data()));
  frame += payload;
  return std::make_shared<const std::string>(std::move(frame));
}

std::optional<ProtocolError> check_frame_length(std::uint32_t length, std::size_t max_frame_bytes) {
  if (length == 0) return ProtocolError{"bad_frame", "empty frame: every frame must carry one JSON message"};
  if (length > max_frame_bytes) {
    return ProtocolError{"too_large", "frame of " + std::to_string(length) + " bytes exceeds the limit of " +
                                          std::to_string(max_frame_bytes) + " bytes"};
  }
  return std::nullopt;
}

Parsed parse_message(const std::string& payload) { return parse_message(payload.data(), payload.size()); }

Parsed parse_message(const char* data, std::size_t size) {
  Parsed out;
  out.message = json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (out.message.is_discarded()) {
    out.error = ProtocolError{"bad_json", "malformed JSON in frame of " + std::to_string(size) +
                                              " bytes: the rendezvous protocol sends one JSON object per frame"};
  } else if (!out.message.is_object() || !out.message.contains("type") || !out.message["type"].is_string()) {
    out.error = ProtocolError{"bad_message", "message is not a JSON object with a string \"type\""};
  }
  return out;
}

json make_welcome() { return {{"type", "welcome"}, {"protocol_version", kProtocolVersion}}; }
json make_error(const std::string& code, const std::string& message) {
  return {{"type", "error"}, {"code", code}, {"message", message}};
}
json make_round(const Assignment& assignment) { return {{"type", "round"}, {"assignment", assignment}}; }
json make_restart(const std::string& reason, bool counted, int restart_count, int max_restarts) {
  return {{"type", "restart"}, {"reason", reason}, {"counted", counted},
          {"restart_count", restart_count}, {"max_restarts", max_restarts}};
}
json make_job_succeeded(const std::string& job_id) { return {{"type", "job_succeeded"}, {"job_id", job_id}}; }
json make_job_failed(const WorkerFailure& first_failure, const std::string& summary) {
  return {{"type", "job_failed"}, {"failure", first_failure}, {"summary", summary}};
}
json make_heartbeat_ack() { return {{"type", "heartbeat_ack"}}; }

json make_hello(const std::string& job_id, const std::string& token) {
  return {{"type", "hello"}, {"protocol_version", kProtocolVersion}, {"job_id", job_id}, {"token", token}};
}
json make_status_request(const std::string& token) {
  return {{"type", "status"}, {"protocol_version", kProtocolVersion}, {"token", token}};
}
json make_join(const NodeSpec& spec) { return {{"type", "join"}, {"node", spec}}; }
json make_heartbeat() { return {{"type", "heartbeat"}}; }
json make_failure(const WorkerFailure& failure) { return {{"type", "failure"}, {"failure", failure}}; }
json make_success() { return {{"type", "success"}}; }
json make_leave() { return {{"type", "leave"}}; }

bool tokens_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

std::optional<ProtocolError> check_first_message(const json& message, const std::string& expected_token) {
  const std::string type = message.value("type", "");
  if (type != "hello" && type != "status") {
    return ProtocolError{"bad_message", "the first message must be \"hello\" or \"status\", got \"" + type + "\""};
  }
  auto version = message.find("protocol_version");
  if (version == message.end() || !version->is_number_integer()) {
    return ProtocolError{"version_mismatch", "the first message carries no integer protocol_version; this server speaks "
                                             "version " + std::to_string(kProtocolVersion)};
  }
  if (version->get<long long>() != kProtocolVersion) {
    return ProtocolError{"version_mismatch", "protocol version " + version->dump() + " is not supported; this server "
                         "speaks version " + std::to_string(kProtocolVersion) +
                         ": run the same ddplaunch version on every node and the rendezvous server"};
  }
  if (type == "hello") {
    auto job = message.find("job_id");
    if (job == message.end() || !job->is_string() || job->get_ref<const std::string&>().empty()) {
      return ProtocolError{"bad_message", "hello carries no job_id (--rdzv_id)"};
    }
  }
  if (!expected_token.empty()) {
    auto token = message.find("token");
    if (token == message.end() || !token->is_string() ||
        !tokens_equal(token->get_ref<const std::string&>(), expected_token)) {
      return ProtocolError{"bad_token", "wrong or missing rendezvous token: pass the server's token with "
                                        "--rdzv_conf token_file=PATH"};
    }
  }
  return std::nullopt;
}

}  // namespace ddp::rdzv
