// Typed reads of the fields of a JSON object that came from outside (a resume message, a job
// record in etcd): each names the field and what was wrong when it is missing, of the wrong type
// or out of range, by throwing FieldError, which the decoder catches at its top and turns into
// its refusal. Header-only; used by resume.cpp and job_record.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace ddp::rdzv::json_fields {

// A field check failed: `what` names the field and what was expected.
struct FieldError {
  std::string what;
};

inline const nlohmann::json& field(const nlohmann::json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) throw FieldError{std::string("missing \"") + key + "\""};
  return *it;
}

inline long long integer(const nlohmann::json& obj, const char* key, long long lo, long long hi) {
  const nlohmann::json& v = field(obj, key);
  if (!v.is_number_integer()) throw FieldError{std::string("\"") + key + "\" must be an integer"};
  const bool huge = v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi);
  const long long n = huge ? hi : v.get<long long>();
  if (huge || n < lo || n > hi) {
    throw FieldError{std::string("\"") + key + "\" = " + v.dump() + " is out of range " + std::to_string(lo) + ".." +
                     std::to_string(hi)};
  }
  return n;
}

inline std::string text(const nlohmann::json& obj, const char* key, bool allow_empty, std::size_t max) {
  const nlohmann::json& v = field(obj, key);
  if (!v.is_string()) throw FieldError{std::string("\"") + key + "\" must be a string"};
  const std::string& s = v.get_ref<const std::string&>();
  if (!allow_empty && s.empty()) throw FieldError{std::string("\"") + key + "\" must not be empty"};
  if (s.size() > max) throw FieldError{std::string("\"") + key + "\" is longer than " + std::to_string(max) + " bytes"};
  return s;
}

inline bool boolean(const nlohmann::json& obj, const char* key) {
  const nlohmann::json& v = field(obj, key);
  if (!v.is_boolean()) throw FieldError{std::string("\"") + key + "\" must be true or false"};
  return v.get<bool>();
}

}  // namespace ddp::rdzv::json_fields
