#include "rendezvous/etcd.h"

#include <algorithm>
#include <array>
#include <charconv>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "rendezvous/protocol.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxAnswerDepth = 16;   // etcd's answers nest 5 deep at most (txn > responses > kvs)
constexpr int kCodeUnavailable = 14;
constexpr int kCodeUnauthenticated = 16;

const char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::string secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
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

// An etcd error answer: {"error": "...", "message": "...", "code": N}.
EtcdStatus error_answer(const std::string& where, unsigned http_status, const nlohmann::json& answer) {
  EtcdStatus s;
  std::string text;
  if (answer.is_object()) {
    if (auto m = answer.find("message"); m != answer.end() && m->is_string()) text = m->get<std::string>();
    else if (auto e = answer.find("error"); e != answer.end() && e->is_string()) text = e->get<std::string>();
    if (auto c = answer.find("code"); c != answer.end() && c->is_number_integer()) {
      const auto v = c->get<std::int64_t>();
      if (v > 0 && v < 64) s.code = static_cast<int>(v);
    }
  }
  if (text.size() > 512) text = text.substr(0, 512) + "...";
  s.error = where + " answered HTTP " + std::to_string(http_status) + (text.empty() ? "" : ": " + text);
  return s;
}

// One POST on a private io_context, bounded by `deadline`: the whole exchange (resolve, connect,
// write, read) is cancelled when it passes.
struct Exchange {
  unsigned status = 0;
  std::string body;
  std::string error;  // transport error ("" = an HTTP answer arrived)
};

Exchange post(const std::string& host, const std::string& port, const std::string& target, const std::string& body,
              const std::string& token, std::size_t max_bytes, Clock::time_point deadline) {
  Exchange result;
  asio::io_context io(1);
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  beast::flat_buffer buffer;
  http::request<http::string_body> request{http::verb::post, target, 11};
  request.set(http::field::host, host + ":" + port);
  request.set(http::field::content_type, "application/json");
  if (!token.empty()) request.set(http::field::authorization, token);
  request.body() = body;
  request.prepare_payload();
  http::response_parser<http::string_body> parser;
  parser.body_limit(max_bytes);
  parser.header_limit(16 * 1024);
  bool done = false;
  auto finish = [&](const std::string& error) {
    if (done) return;
    done = true;
    result.error = error;
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.close();
  };
  stream.expires_at(deadline);
  resolver.async_resolve(host, port, [&](const beast::error_code& ec, const tcp::resolver::results_type& results) {
    if (ec) return finish("resolve " + host + ": " + ec.message());
    stream.async_connect(results, [&](const beast::error_code& ec2, const tcp::endpoint&) {
      if (ec2) return finish(ec2 == beast::error::timeout ? "connect timed out" : "connect: " + ec2.message());
      http::async_write(stream, request, [&](const beast::error_code& ec3, std::size_t) {
        if (ec3) return finish(ec3 == beast::error::timeout ? "send timed out" : "send: " + ec3.message());
        auto read_failed = [&, max_bytes](const beast::error_code& ec4) {
          finish(ec4 == beast::error::timeout       ? "no answer in time"
                 : ec4 == http::error::body_limit ? "answer larger than " + std::to_string(max_bytes) + " bytes"
                                                  : "read: " + ec4.message());
        };
        http::async_read_header(stream, buffer, parser, [&, read_failed](const beast::error_code& ec4, std::size_t) {
          if (ec4) return read_failed(ec4);
          // Boost 1.74's parser does not apply body_limit to a Content-Length (only to chunks):
          // checked here, before the body is read.
          if (parser.content_length() && *parser.content_length() > max_bytes) {
            return read_failed(http::error::body_limit);
          }
          http::async_read(stream, buffer, parser, [&, read_failed](const beast::error_code& ec5, std::size_t) {
            if (ec5) return read_failed(ec5);
            result.status = parser.get().result_int();
            result.body = std::move(parser.get().body());
            finish("");
          });
        });
      });
    });
  });
  // The resolver is not covered by the stream's timer: bound everything by the deadline.
  io.run_until(deadline);
  if (!done) {
    resolver.cancel();
    finish("no answer in time");
    io.restart();
    io.run();  // the cancelled handlers, which only see `done`
  }
  return result;
}

bool retryable(const EtcdStatus& s, unsigned http_status) {
  return http_status >= 500 || s.code == kCodeUnavailable;
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

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {
  for (std::string text : options_.endpoints) {
    std::string rest = text;
    if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
    else if (rest.find("://") != std::string::npos) {
      bad_endpoints_ += (bad_endpoints_.empty() ? "" : "; ") + text + ": only http:// is supported";
      continue;
    }
    while (!rest.empty() && rest.back() == '/') rest.pop_back();
    std::string host = rest, port = "2379";
    if (!rest.empty() && rest[0] == '[') {
      const auto close = rest.find(']');
      if (close == std::string::npos) {
        bad_endpoints_ += (bad_endpoints_.empty() ? "" : "; ") + text + ": missing ']'";
        continue;
      }
      host = rest.substr(1, close - 1);
      if (close + 1 < rest.size() && rest[close + 1] == ':') port = rest.substr(close + 2);
    } else if (auto colon = rest.rfind(':'); colon != std::string::npos) {
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
    }
    int p = 0;
    auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
    if (host.empty() || ec != std::errc() || ptr != port.data() + port.size() || p < 1 || p > 65535) {
      bad_endpoints_ += (bad_endpoints_.empty() ? "" : "; ") + text + ": expected http://HOST:PORT";
      continue;
    }
    endpoints_.push_back({host, port, "http://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) +
                                          ":" + port});
  }
  if (endpoints_.empty() && bad_endpoints_.empty()) bad_endpoints_ = "no etcd endpoint given";
}

std::string EtcdClient::last_endpoint() const { return answered_ ? endpoints_[preferred_].text : ""; }

EtcdStatus EtcdClient::call(const std::string& path, const nlohmann::json& body, nlohmann::json& answer) {
  if (!bad_endpoints_.empty()) return {"etcd endpoints: " + bad_endpoints_, 0};
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.call_timeout));
  // Replace, not throw, on invalid UTF-8 (a password file's bytes, a caller's key).
  const std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (!options_.user.empty() && token_.empty()) {
    if (auto s = authenticate(deadline); !s.ok()) return s;
  }
  EtcdStatus s = call_until(path, text, answer, deadline);
  if (s.code == kCodeUnauthenticated && !options_.user.empty()) {
    // The token expired (etcd's simple tokens live 5 minutes) or the member restarted: once more.
    token_.clear();
    if (auto a = authenticate(deadline); !a.ok()) return a;
    s = call_until(path, text, answer, deadline);
  }
  return s;
}

EtcdStatus EtcdClient::authenticate(Clock::time_point deadline) {
  nlohmann::json answer;
  const std::string body = nlohmann::json{{"name", options_.user}, {"password", options_.password}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
  token_.clear();
  EtcdStatus s = call_until("/v3/auth/authenticate", body, answer, deadline);
  if (!s.ok()) return {"etcd authentication as user " + options_.user + ": " + s.error, s.code};
  auto token = answer.find("token");
  if (token == answer.end() || !token->is_string() || token->get_ref<const std::string&>().empty() ||
      token->get_ref<const std::string&>().size() > 4096) {
    return {"etcd authentication as user " + options_.user + ": the answer carries no token (is auth enabled?)", 0};
  }
  token_ = token->get<std::string>();
  // A token is a header value: no control characters.
  if (std::any_of(token_.begin(), token_.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; })) {
    token_.clear();
    return {"etcd authentication as user " + options_.user + ": the token holds control characters", 0};
  }
  return {};
}

EtcdStatus EtcdClient::call_until(const std::string& path, const std::string& body, nlohmann::json& answer,
                                  Clock::time_point deadline) {
  std::string errors;
  EtcdStatus last;
  const std::size_t n = endpoints_.size();
  for (std::size_t tried = 0; tried < n; ++tried) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    // Each endpoint left gets an equal share of the time left, so one that hangs cannot take it all.
    const auto share = (deadline - now) / static_cast<int>(n - tried);
    const std::size_t index = (preferred_ + tried) % n;
    const Endpoint& ep = endpoints_[index];
    Exchange x = post(ep.host, ep.port, path, body, token_, options_.max_response_bytes, now + share);
    EtcdStatus s;
    if (!x.error.empty()) {
      s.error = ep.text + path + ": " + x.error;
    } else {
      nlohmann::json parsed;
      EtcdStatus p = parse_answer(x.body, parsed);
      if (x.status != 200) {
        s = error_answer(ep.text + path, x.status, p.ok() ? parsed : nlohmann::json());
        if (!retryable(s, x.status)) return s;
      } else if (!p.ok()) {
        s.error = ep.text + path + ": " + p.error;  // a broken member or proxy: try the next
      } else {
        preferred_ = index;
        answered_ = true;
        answer = std::move(parsed);
        return {};
      }
    }
    errors += (errors.empty() ? "" : "; ") + s.error;
    last = s;
  }
  if (errors.empty()) errors = "no time left";
  return {"etcd call " + path + " failed within " + secs(options_.call_timeout) + ": " + errors, last.code};
}

EtcdRange EtcdClient::range(const std::string& key, const std::string& range_end) {
  EtcdRange out;
  nlohmann::json body = {{"key", base64_encode(key)}};
  if (!range_end.empty()) body["range_end"] = base64_encode(range_end);
  nlohmann::json answer;
  out.status = call("/v3/kv/range", body, answer);
  if (out.status.ok()) {
    if (auto e = read_range(answer, out); !e.empty()) out.status.error = "etcd /v3/kv/range: bad answer: " + e;
  }
  return out;
}

EtcdStatus EtcdClient::put(const std::string& key, const std::string& value, std::int64_t lease) {
  nlohmann::json body = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  nlohmann::json answer;
  return call("/v3/kv/put", body, answer);
}

EtcdTxnResult EtcdClient::txn(const EtcdTxn& txn) {
  EtcdTxnResult out;
  nlohmann::json answer;
  out.status = call("/v3/kv/txn", txn_to_json(txn), answer);
  if (out.status.ok()) {
    if (auto e = read_txn(answer, out); !e.empty()) out.status.error = "etcd /v3/kv/txn: bad answer: " + e;
  }
  return out;
}

EtcdLease EtcdClient::lease_grant(std::int64_t ttl_seconds) {
  EtcdLease out;
  nlohmann::json answer;
  out.status = call("/v3/lease/grant", {{"TTL", std::to_string(ttl_seconds)}, {"ID", "0"}}, answer);
  if (out.status.ok()) {
    if (auto e = read_lease(answer, out); !e.empty()) out.status.error = "etcd /v3/lease/grant: bad answer: " + e;
    else if (out.id == 0 || out.ttl <= 0) out.status.error = "etcd /v3/lease/grant: the answer grants no lease";
  }
  return out;
}

EtcdLease EtcdClient::lease_keepalive(std::int64_t id) {
  EtcdLease out;
  nlohmann::json answer;
  out.status = call("/v3/lease/keepalive", {{"ID", std::to_string(id)}}, answer);
  if (out.status.ok()) {
    if (auto e = read_lease(answer, out); !e.empty()) out.status.error = "etcd /v3/lease/keepalive: bad answer: " + e;
  }
  return out;
}

EtcdStatus EtcdClient::lease_revoke(std::int64_t id) {
  nlohmann::json answer;
  return call("/v3/lease/revoke", {{"ID", std::to_string(id)}}, answer);
}

}  // namespace ddp::rdzv
