#include "contracts/standby_assignment.h"

#include <stdexcept>

#include <nlohmann/json.hpp>

#include "contracts/json_depth.h"

namespace ddp::contracts {

namespace {

// Why `name=value` cannot be an environment entry; empty when it can.
std::string entry_problem(const std::string& name, const std::string& value) {
  if (name.empty()) return "an empty variable name";
  if (name.find('=') != std::string::npos) return "variable name '" + name + "' holds '='";
  if (name.find('\0') != std::string::npos) return "a variable name holds a NUL byte";
  if (value.find('\0') != std::string::npos) return "the value of " + name + " holds a NUL byte";
  return {};
}

}  // namespace

std::string encode_assignment(const StandbyAssignment& a) {
  if (a.cwd.empty() || a.cwd[0] != '/' || a.cwd.find('\0') != std::string::npos) {
    throw std::invalid_argument("standby assignment: the working directory must be an absolute path");
  }
  nlohmann::json env = nlohmann::json::object();
  for (const auto& [name, value] : a.env) {
    const std::string problem = entry_problem(name, value);
    if (!problem.empty()) throw std::invalid_argument("standby assignment: " + problem);
    env[name] = value;
  }
  std::string payload;
  try {
    payload = nlohmann::json{{"env", env}, {"cwd", a.cwd}}.dump();
  } catch (const nlohmann::json::exception&) {
    // The environment is bytes; JSON is UTF-8. Such a worker starts cold, with its bytes intact.
    throw std::invalid_argument("standby assignment: the environment or the working directory is not UTF-8");
  }
  if (payload.size() > kMaxStandbyPayload) {
    throw std::invalid_argument("standby assignment: " + std::to_string(payload.size()) + " bytes, over the limit of " +
                                std::to_string(kMaxStandbyPayload));
  }
  std::string out = frame_header(kStandbyMagic, kStandbyVersion, static_cast<std::uint32_t>(payload.size()));
  return out + payload;
}

std::optional<StandbyAssignment> decode_assignment(std::string_view message, std::string& error) {
  if (message.size() < kStandbyHeaderSize) {
    error = "short header: " + std::to_string(message.size()) + " of " + std::to_string(kStandbyHeaderSize) + " bytes";
    return std::nullopt;
  }
  if (message.substr(0, 4) != kStandbyMagic) {
    error = "bad magic (not a ddplaunch standby assignment)";
    return std::nullopt;
  }
  if (const std::uint32_t version = get_u32_le(message, 4); version != kStandbyVersion) {
    error = "version " + std::to_string(version) + ", expected " + std::to_string(kStandbyVersion) +
            " (ddplaunch and its Python bootstrap come from different installs)";
    return std::nullopt;
  }
  const std::uint32_t length = get_u32_le(message, 8);
  if (length < 2 || length > kMaxStandbyPayload) {
    error = "payload length " + std::to_string(length) + " outside 2.." + std::to_string(kMaxStandbyPayload);
    return std::nullopt;
  }
  if (message.size() - kStandbyHeaderSize != length) {
    error = "payload of " + std::to_string(message.size() - kStandbyHeaderSize) + " bytes, header says " +
            std::to_string(length);
    return std::nullopt;
  }
  const std::string_view payload = message.substr(kStandbyHeaderSize);
  if (json_depth(payload, kMaxAssignmentDepth) > kMaxAssignmentDepth) {
    error = "the payload is nested deeper than an object of objects";
    return std::nullopt;
  }
  nlohmann::json doc = nlohmann::json::parse(payload, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    error = "the payload is not a JSON object";
    return std::nullopt;
  }
  if (doc.size() != 2 || !doc.contains("env") || !doc.contains("cwd")) {
    error = "the payload must hold exactly the keys env and cwd";
    return std::nullopt;
  }
  const auto& env = doc["env"];
  const auto& cwd = doc["cwd"];
  if (!env.is_object()) {
    error = "env is not an object";
    return std::nullopt;
  }
  if (!cwd.is_string() || cwd.get_ref<const std::string&>().empty() || cwd.get_ref<const std::string&>()[0] != '/') {
    error = "cwd is not an absolute path";
    return std::nullopt;
  }
  StandbyAssignment a;
  a.cwd = cwd.get<std::string>();
  if (a.cwd.find('\0') != std::string::npos) {
    error = "cwd holds a NUL byte";
    return std::nullopt;
  }
  for (const auto& [name, value] : env.items()) {
    if (!value.is_string()) {
      error = "the value of " + name + " is not a string";
      return std::nullopt;
    }
    const std::string problem = entry_problem(name, value.get_ref<const std::string&>());
    if (!problem.empty()) {
      error = problem;
      return std::nullopt;
    }
    a.env[name] = value.get<std::string>();
  }
  return a;
}

std::optional<std::uint32_t> announced_length(std::string_view header) {
  if (header.size() < kStandbyHeaderSize || header.substr(0, 4) != kStandbyMagic) return std::nullopt;
  return get_u32_le(header, 8);
}

}  // namespace ddp::contracts
