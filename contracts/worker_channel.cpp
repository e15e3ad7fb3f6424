#include "contracts/worker_channel.h"

#include <algorithm>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "contracts/json_depth.h"

namespace ddp::contracts {

namespace {

bool step_in_range(std::int64_t step) { return step >= -1 && step < kMaxParkedStep; }

}  // namespace

std::string encode_worker_message(const WorkerMessage& m) {
  nlohmann::json doc;
  if (m.type == WorkerMessage::Type::kRestartable) {
    doc = {{"type", "restartable"}, {"value", m.restartable}};
  } else if (m.type == WorkerMessage::Type::kStandbyReady) {
    doc = {{"type", "standby_ready"}};
  } else {
    if (!step_in_range(m.step)) {
      throw std::invalid_argument("worker channel: parked step " + std::to_string(m.step) + " outside -1..2^53-1");
    }
    doc = {{"type", "parked"}, {"step", m.step}};
  }
  const std::string payload = doc.dump();
  std::string out = frame_header(kWorkerMagic, kWorkerChannelVersion, static_cast<std::uint32_t>(payload.size()));
  return out + payload;
}

bool decode_worker_payload(std::string_view payload, WorkerMessage& out, std::string& error) {
  if (json_depth(payload, kMaxWorkerDepth) > kMaxWorkerDepth) {
    error = "the payload is nested deeper than one object";
    return false;
  }
  const nlohmann::json doc = nlohmann::json::parse(payload, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    error = "the payload is not a JSON object";
    return false;
  }
  const auto type = doc.find("type");
  if (type == doc.end() || !type->is_string()) {
    error = "the payload has no string \"type\"";
    return false;
  }
  const std::string& name = type->get_ref<const std::string&>();
  if (name == "restartable") {
    const auto value = doc.find("value");
    if (doc.size() != 2 || value == doc.end()) {
      error = "a restartable message must hold exactly the keys type and value";
      return false;
    }
    if (!value->is_boolean()) {
      error = "restartable: value is not true or false";
      return false;
    }
    out = WorkerMessage::make_restartable(value->get<bool>());
    return true;
  }
  if (name == "parked") {
    const auto step = doc.find("step");
    if (doc.size() != 2 || step == doc.end()) {
      error = "a parked message must hold exactly the keys type and step";
      return false;
    }
    // An unsigned number is >= 0; one over 2^53 is out of range however it is stored.
    if (step->is_number_unsigned()) {
      const auto v = step->get<std::uint64_t>();
      if (v >= static_cast<std::uint64_t>(kMaxParkedStep)) {
        error = "parked: step " + std::to_string(v) + " outside -1..2^53-1";
        return false;
      }
      out = WorkerMessage::make_parked(static_cast<std::int64_t>(v));
      return true;
    }
    if (!step->is_number_integer()) {
      error = "parked: step is not an integer";
      return false;
    }
    const auto v = step->get<std::int64_t>();
    if (!step_in_range(v)) {
      error = "parked: step " + std::to_string(v) + " outside -1..2^53-1";
      return false;
    }
    out = WorkerMessage::make_parked(v);
    return true;
  }
  if (name == "standby_ready") {
    if (doc.size() != 1) {
      error = "a standby_ready message must hold exactly the key type";
      return false;
    }
    out = WorkerMessage::make_standby_ready();
    return true;
  }
  error = "unknown message type '" + name.substr(0, 64) + "'";
  return false;
}

bool WorkerChannelDecoder::fail(std::string why) {
  error_ = std::move(why);
  buffer_.clear();
  return false;
}

bool WorkerChannelDecoder::feed(std::string_view bytes, std::vector<WorkerMessage>& out) {
  if (failed()) return false;
  while (!bytes.empty()) {
    // Take the header first, check it, then at most the announced payload: the buffer never
    // holds more than one bounded frame.
    std::size_t want = kWorkerHeaderSize;
    if (buffer_.size() >= kWorkerHeaderSize) want += get_u32_le(buffer_, 8);
    const std::size_t take = std::min(bytes.size(), want - buffer_.size());
    buffer_.append(bytes.substr(0, take));
    bytes.remove_prefix(take);
    if (buffer_.size() < kWorkerHeaderSize) break;
    if (buffer_.size() == kWorkerHeaderSize) {
      if (buffer_.compare(0, 4, kWorkerMagic) != 0) return fail("bad magic (not a ddplaunch worker channel frame)");
      if (const std::uint32_t version = get_u32_le(buffer_, 4); version != kWorkerChannelVersion) {
        return fail("version " + std::to_string(version) + ", expected " + std::to_string(kWorkerChannelVersion) +
                    " (the worker SDK and ddplaunch come from different installs)");
      }
      const std::uint32_t length = get_u32_le(buffer_, 8);
      if (length < 2 || length > kMaxWorkerPayload) {
        return fail("payload length " + std::to_string(length) + " outside 2.." + std::to_string(kMaxWorkerPayload));
      }
      continue;
    }
    if (buffer_.size() < kWorkerHeaderSize + get_u32_le(buffer_, 8)) break;
    WorkerMessage m;
    std::string error;
    if (!decode_worker_payload(std::string_view(buffer_).substr(kWorkerHeaderSize), m, error)) return fail(error);
    out.push_back(m);
    buffer_.clear();
  }
  return true;
}

}  // namespace ddp::contracts
