#include "metrics/http.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <sstream>

#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>

namespace ddp::metrics {

namespace http = boost::beast::http;

namespace {

// "HTTP/d.d": a version of HTTP, as opposed to something that is not HTTP at all.
bool looks_like_http_version(std::string_view v) {
  return v.size() == 8 && v.substr(0, 5) == "HTTP/" && std::isdigit(static_cast<unsigned char>(v[5])) &&
         v[6] == '.' && std::isdigit(static_cast<unsigned char>(v[7]));
}

}  // namespace

HttpRequestParser::HttpRequestParser(std::size_t max_head_bytes) : max_(max_head_bytes) {
  parser_.header_limit(static_cast<std::uint32_t>(max_head_bytes));
  parser_.body_limit(0);  // GET and HEAD have no body: a request that announces one is refused
}

HttpRequestParser::Result HttpRequestParser::fail(int status, std::string why) {
  status_ = status;
  error_ = std::move(why);
  result_ = Result::error;
  return result_;
}

HttpRequestParser::Result HttpRequestParser::feed(std::string_view bytes) {
  if (result_ != Result::need_more) return result_;
  take(bytes);
  if (!line_checked_) {
    // Beast judges a request line that arrives whole in one call at once, but one that arrives
    // in pieces only at the end of the head: it gets the line only once it is whole.
    const std::size_t eol = pending_.find('\n');
    if (eol == std::string::npos) {
      if (taken_ >= max_) return fail(431, "request head larger than " + std::to_string(max_) + " bytes");
      return result_;
    }
    first_line_ = pending_.substr(0, eol > 0 ? eol - 1 : 0);  // without its CRLF
  }
  return put();
}

// Copies what can still belong to the head: never past the limit. RFC 9112 lets a server take a
// bare LF as a line end (some tools send them); Beast does not, so it gets CRLF.
void HttpRequestParser::take(std::string_view bytes) {
  for (char c : bytes) {
    const bool bare_lf = c == '\n' && !last_was_cr_;
    if (taken_ + (bare_lf ? 2 : 1) > max_) {
      taken_ = max_;
      return;
    }
    if (bare_lf) pending_ += '\r';
    pending_ += c;
    taken_ += bare_lf ? 2 : 1;
    last_was_cr_ = c == '\r';
  }
}

HttpRequestParser::Result HttpRequestParser::put() {
  boost::beast::error_code ec;
  const std::size_t used = parser_.put(boost::asio::buffer(pending_), ec);
  pending_.erase(0, used);
  if (ec && ec != http::error::need_more) return refuse(ec);
  if (!line_checked_) {
    line_checked_ = true;
    if (check_request_line() == Result::error) return result_;
  }
  if (parser_.is_header_done()) {
    if (!parser_.is_done()) return fail(413, "a request body is not accepted (GET and HEAD have none)");
    result_ = Result::complete;
    return result_;
  }
  if (taken_ >= max_) return fail(431, "request head larger than " + std::to_string(max_) + " bytes");
  return result_;
}

// Beast parsed the request line (it was whole); what it allows beyond what is served is refused
// here, before the rest of the head arrives.
HttpRequestParser::Result HttpRequestParser::check_request_line() {
  const auto& head = parser_.get();
  const std::string_view method(head.method_string().data(), head.method_string().size());
  const std::string_view target(head.target().data(), head.target().size());
  for (char c : method) {
    if (!std::isupper(static_cast<unsigned char>(c))) return fail(400, "bad method");
  }
  if (method != "GET" && method != "HEAD") return fail(405, "only GET and HEAD are served");
  if (target.empty() || target.front() != '/') return fail(400, "the target must be a path");
  for (char c : target) {
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      return fail(400, "bad character in the target");
    }
  }
  request_.method = std::string(method);
  request_.path = std::string(target.substr(0, target.find('?')));
  return Result::need_more;
}

HttpRequestParser::Result HttpRequestParser::refuse(const boost::beast::error_code& ec) {
  if (ec == http::error::header_limit) {
    return fail(431, "request head larger than " + std::to_string(max_) + " bytes");
  }
  if (ec == http::error::body_limit) return fail(413, "a request body is not accepted (GET and HEAD have none)");
  if (ec == http::error::bad_version) {
    // Beast refuses every version but 1.0 and 1.1 alike; another HTTP version gets 505.
    const std::string_view line(first_line_);
    const std::size_t sp = line.rfind(' ');
    const bool three_parts = std::count(line.begin(), line.end(), ' ') == 2;
    if (three_parts && looks_like_http_version(line.substr(sp + 1))) {
      return fail(505, "only HTTP/1.0 and HTTP/1.1 are served");
    }
  }
  return fail(400, "not an HTTP request: " + ec.message());
}

std::string serialize(const HttpResponse& r, bool head_only) {
  http::response<http::string_body> response{static_cast<http::status>(r.status), 11};
  response.set(http::field::content_type, r.content_type);
  response.content_length(r.body.size());  // HEAD too: the length of what GET would send
  if (r.status == 405) response.set(http::field::allow, "GET, HEAD");
  response.set(http::field::cache_control, "no-store");
  response.set(http::field::connection, "close");
  if (!head_only) response.body() = r.body;
  std::ostringstream out;
  out << response;
  return out.str();
}

}  // namespace ddp::metrics
