// The etcd v3 JSON gateway's codec: base64, ranges, the answers' validating readers, the
// transaction body and the watch stream's line parser. Pure: no sockets, any thread.
#include "rendezvous/etcd.h"

#include <charconv>
#include <limits>

#include "rendezvous/protocol.h"  // json_depth

namespace ddp::rdzv {

namespace {

constexpr int kMaxAnswerDepth = 16;   // etcd's answers nest 5 deep at most (txn > responses > kvs)

const char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

const char* target_name(EtcdCompare::Target t) {
  switch (t) {
    case EtcdCompare::Target::version: return "VERSION";
    case EtcdCompare::Target::create_revision: return "CREATE";
    case EtcdCompare::Target::mod_revision: return "MOD";
    case EtcdCompare::Target::value: return "VALUE";
    case EtcdCompare::Target::lease: return "LEASE";
  }
  return "CREATE";
}

const char* target_field(EtcdCompare::Target t) {
  switch (t) {
    case EtcdCompare::Target::version: return "version";
    case EtcdCompare::Target::create_revision: return "create_revision";
    case EtcdCompare::Target::mod_revision: return "mod_revision";
    case EtcdCompare::Target::value: return "value";
    case EtcdCompare::Target::lease: return "lease";
  }
  return "create_revision";
}

const char* result_name(EtcdCompare::Result r) {
  switch (r) {
    case EtcdCompare::Result::equal: return "EQUAL";
    case EtcdCompare::Result::greater: return "GREATER";
    case EtcdCompare::Result::less: return "LESS";
    case EtcdCompare::Result::not_equal: return "NOT_EQUAL";
  }
  return "EQUAL";
}

nlohmann::json op_to_json(const EtcdOp& op) {
  nlohmann::json body = {{"key", base64_encode(op.key)}};
  switch (op.kind) {
    case EtcdOp::Kind::put:
      body["value"] = base64_encode(op.value);
      if (op.lease != 0) body["lease"] = std::to_string(op.lease);
      return {{"request_put", body}};
    case EtcdOp::Kind::range:
      if (!op.range_end.empty()) body["range_end"] = base64_encode(op.range_end);
      return {{"request_range", body}};
    case EtcdOp::Kind::del:
      if (!op.range_end.empty()) body["range_end"] = base64_encode(op.range_end);
      return {{"request_delete_range", body}};
  }
  return {};
}

// Reads a base64 field (absent = ""); false when it is there but not a base64 string.
bool read_bytes(const nlohmann::json& object, const char* field, std::string& out) {
  auto it = object.find(field);
  if (it == object.end()) {
    out.clear();
    return true;
  }
  if (!it->is_string()) return false;
  auto decoded = base64_decode(it->get_ref<const std::string&>());
  if (!decoded) return false;
  out = std::move(*decoded);
  return true;
}

std::string read_header_revision(const nlohmann::json& answer, std::int64_t& revision) {
  auto header = answer.find("header");
  if (header == answer.end()) return "";  // etcd omits empty messages
  if (!header->is_object()) return "\"header\" is not an object";
  if (!read_int64(*header, "revision", revision)) return "\"header.revision\" is not an integer";
  return "";
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const unsigned v = (static_cast<unsigned char>(bytes[i]) << 16) | (static_cast<unsigned char>(bytes[i + 1]) << 8) |
                       static_cast<unsigned char>(bytes[i + 2]);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i + 1 == bytes.size()) {
    const unsigned v = static_cast<unsigned char>(bytes[i]) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const unsigned v = (static_cast<unsigned char>(bytes[i]) << 16) | (static_cast<unsigned char>(bytes[i + 1]) << 8);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int v[4];
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = text[i + j];
      if (c == '=' && last && j >= 2) {
        v[j] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return std::nullopt;  // data after padding
      v[j] = base64_value(c);
      if (v[j] < 0) return std::nullopt;
    }
    const unsigned bits = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out += static_cast<char>((bits >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((bits >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(bits & 0xff);
  }
  return out;
}

std::string prefix_range_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdStatus parse_answer(std::string_view body, nlohmann::json& answer) {
  if (json_depth(body, kMaxAnswerDepth) > kMaxAnswerDepth) return {"answer nested deeper than 16 levels", 0};
  answer = nlohmann::json::parse(body, nullptr, false);
  if (answer.is_discarded()) return {"answer is not JSON", 0};
  if (!answer.is_object()) return {"answer is not a JSON object", 0};
  return {};
}

bool read_int64(const nlohmann::json& object, const char* field, std::int64_t& out) {
  auto it = object.find(field);
  if (it == object.end()) {
    out = 0;
    return true;
  }
  if (it->is_number_integer()) {
    out = it->get<std::int64_t>();
    return true;
  }
  if (!it->is_string()) return false;
  const std::string& s = it->get_ref<const std::string&>();
  if (s.empty() || s.size() > 20) return false;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && ptr == end;
}

std::string read_range(const nlohmann::json& answer, EtcdRange& out) {
  if (auto e = read_header_revision(answer, out.revision); !e.empty()) return e;
  out.kvs.clear();
  auto kvs = answer.find("kvs");
  if (kvs == answer.end()) return "";
  if (!kvs->is_array()) return "\"kvs\" is not an array";
  for (const auto& item : *kvs) {
    if (!item.is_object()) return "an entry of \"kvs\" is not an object";
    EtcdKeyValue kv;
    if (!read_bytes(item, "key", kv.key) || kv.key.empty()) return "a key is missing or not base64";
    if (!read_bytes(item, "value", kv.value)) return "the value of a key is not base64";
    if (!read_int64(item, "create_revision", kv.create_revision) || !read_int64(item, "mod_revision", kv.mod_revision) ||
        !read_int64(item, "version", kv.version) || !read_int64(item, "lease", kv.lease)) {
      return "a revision, version or lease of a key is not an integer";
    }
    out.kvs.push_back(std::move(kv));
  }
  return "";
}

std::string read_txn(const nlohmann::json& answer, EtcdTxnResult& out) {
  if (auto e = read_header_revision(answer, out.revision); !e.empty()) return e;
  out.succeeded = false;
  if (auto s = answer.find("succeeded"); s != answer.end()) {
    if (!s->is_boolean()) return "\"succeeded\" is not a boolean";
    out.succeeded = s->get<bool>();
  }
  out.ranges.clear();
  auto responses = answer.find("responses");
  if (responses == answer.end()) return "";
  if (!responses->is_array()) return "\"responses\" is not an array";
  for (const auto& r : *responses) {
    if (!r.is_object()) return "a txn response is not an object";
    auto range = r.find("response_range");
    if (range == r.end()) continue;
    if (!range->is_object()) return "\"response_range\" is not an object";
    EtcdRange one;
    if (auto e = read_range(*range, one); !e.empty()) return e;
    out.ranges.push_back(std::move(one));
  }
  return "";
}

std::string read_lease(const nlohmann::json& answer, EtcdLease& out) {
  const nlohmann::json* body = &answer;
  if (auto result = answer.find("result"); result != answer.end()) {  // keepalive: a stream of results
    if (!result->is_object()) return "\"result\" is not an object";
    body = &*result;
  }
  if (!read_int64(*body, "ID", out.id) || !read_int64(*body, "TTL", out.ttl)) return "\"ID\" or \"TTL\" is not an integer";
  if (out.ttl < 0) out.ttl = 0;
  return "";
}

std::string read_watch_response(const nlohmann::json& line, EtcdWatchResponse& out, int* code) {
  out = EtcdWatchResponse{};
  if (!line.is_object()) return "a watch answer is not a JSON object";
  if (auto error = line.find("error"); error != line.end()) {
    // The gateway's stream error: {"error": {"grpc_code": 16, "message": "...", ...}}.
    std::string text = "etcd ended the watch with an error";
    if (error->is_object()) {
      for (const char* field : {"grpc_code", "code"}) {
        if (auto c = error->find(field); c != error->end() && c->is_number_integer()) {
          const auto v = c->get<std::int64_t>();
          if (v > 0 && v < 64 && code) *code = static_cast<int>(v);
          if (v > 0 && v < 64) text += " (code " + std::to_string(v) + ")";
          break;
        }
      }
      if (auto m = error->find("message"); m != error->end() && m->is_string()) {
        std::string message = m->get<std::string>();
        if (message.size() > 512) message = message.substr(0, 512) + "...";
        text += ": " + message;
      }
    }
    return text;
  }
  auto result = line.find("result");
  if (result == line.end() || !result->is_object()) return "a watch answer has no \"result\" object";
  const nlohmann::json& r = *result;
  if (auto e = read_header_revision(r, out.revision); !e.empty()) return e;
  for (auto [field, flag] : {std::pair<const char*, bool*>{"created", &out.created}, {"canceled", &out.canceled}}) {
    if (auto f = r.find(field); f != r.end()) {
      if (!f->is_boolean()) return std::string("\"") + field + "\" is not a boolean";
      *flag = f->get<bool>();
    }
  }
  if (!read_int64(r, "compact_revision", out.compact_revision)) return "\"compact_revision\" is not an integer";
  if (auto reason = r.find("cancel_reason"); reason != r.end()) {
    if (!reason->is_string()) return "\"cancel_reason\" is not a string";
    out.cancel_reason = reason->get<std::string>().substr(0, 512);
  }
  auto events = r.find("events");
  if (events == r.end()) return "";
  if (!events->is_array()) return "\"events\" is not an array";
  for (const auto& item : *events) {
    if (!item.is_object()) return "a watch event is not an object";
    EtcdWatchEvent ev;
    if (auto type = item.find("type"); type != item.end()) {  // PUT (0) is omitted
      if (*type == "DELETE") ev.type = EtcdWatchEvent::Type::del;
      else if (*type != "PUT") return "a watch event's \"type\" is neither PUT nor DELETE";
    }
    auto kv = item.find("kv");
    if (kv == item.end() || !kv->is_object()) return "a watch event has no \"kv\" object";
    if (!read_bytes(*kv, "key", ev.kv.key) || ev.kv.key.empty()) return "a watch event's key is missing or not base64";
    if (!read_bytes(*kv, "value", ev.kv.value)) return "a watch event's value is not base64";
    if (!read_int64(*kv, "create_revision", ev.kv.create_revision) ||
        !read_int64(*kv, "mod_revision", ev.kv.mod_revision) || !read_int64(*kv, "version", ev.kv.version) ||
        !read_int64(*kv, "lease", ev.kv.lease)) {
      return "a watch event's revision, version or lease is not an integer";
    }
    out.events.push_back(std::move(ev));
  }
  return "";
}

std::string EtcdWatchParser::feed(std::string_view bytes, std::vector<EtcdWatchResponse>& out) {
  while (!bytes.empty()) {
    const auto newline = bytes.find('\n');
    const std::size_t take = newline == std::string_view::npos ? bytes.size() : newline;
    if (pending_.size() + take > max_line_) {
      return "a watch answer is larger than " + std::to_string(max_line_) + " bytes";
    }
    pending_.append(bytes.substr(0, take));
    if (newline == std::string_view::npos) break;
    bytes.remove_prefix(newline + 1);
    std::string line;
    line.swap(pending_);
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // an empty line
    nlohmann::json parsed;
    if (auto p = parse_answer(line, parsed); !p.ok()) return "a watch answer: " + p.error;
    EtcdWatchResponse r;
    if (auto e = read_watch_response(parsed, r, &code_); !e.empty()) return e;
    out.push_back(std::move(r));
  }
  return "";
}

nlohmann::json txn_to_json(const EtcdTxn& txn) {
  nlohmann::json body = nlohmann::json::object();
  auto& compare = body["compare"] = nlohmann::json::array();
  for (const auto& c : txn.compare) {
    nlohmann::json j = {{"key", base64_encode(c.key)}, {"target", target_name(c.target)}, {"result", result_name(c.result)}};
    if (c.target == EtcdCompare::Target::value) j["value"] = base64_encode(c.value);
    else j[target_field(c.target)] = std::to_string(c.number);
    compare.push_back(std::move(j));
  }
  auto& success = body["success"] = nlohmann::json::array();
  for (const auto& op : txn.success) success.push_back(op_to_json(op));
  auto& failure = body["failure"] = nlohmann::json::array();
  for (const auto& op : txn.failure) failure.push_back(op_to_json(op));
  return body;
}

}  // namespace ddp::rdzv
