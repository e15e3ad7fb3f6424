#include "metrics/http.h"

#include <cctype>

namespace ddp::metrics {

HttpRequestParser::Result HttpRequestParser::fail(int status, std::string why) {
  status_ = status;
  error_ = std::move(why);
  result_ = Result::error;
  return result_;
}

HttpRequestParser::Result HttpRequestParser::feed(std::string_view bytes) {
  if (result_ != Result::need_more) return result_;
  // Look for the end of the head only in what can still complete it: never copy past the limit.
  const std::size_t room = max_ - head_.size();
  const std::size_t before = head_.size();
  head_.append(bytes.substr(0, room));
  // Judge the request line as soon as it is whole: garbage is answered without waiting for more.
  if (!line_checked_) {
    const std::size_t eol = head_.find('\n');
    if (eol != std::string::npos) {
      line_checked_ = true;
      if (parse_request_line(head_.substr(0, eol)) == Result::error) return result_;
    }
  }
  const std::size_t from = before >= 3 ? before - 3 : 0;
  const std::size_t end = head_.find("\r\n\r\n", from);
  if (end == std::string::npos) {
    // A bare-LF client (some tools) ends its head with \n\n.
    const std::size_t lf = head_.find("\n\n", before >= 1 ? before - 1 : 0);
    if (lf == std::string::npos) {
      if (head_.size() >= max_) {
        return fail(431, "request head larger than " + std::to_string(max_) + " bytes");
      }
      return result_;
    }
    head_.resize(lf);
  } else {
    head_.resize(end);
  }
  return parse_head();
}

HttpRequestParser::Result HttpRequestParser::parse_head() {
  const Result r = parse_request_line(head_.substr(0, head_.find('\n')));
  if (r != Result::error) result_ = Result::complete;
  return result_;
}

HttpRequestParser::Result HttpRequestParser::parse_request_line(std::string line) {
  if (!line.empty() && line.back() == '\r') line.pop_back();
  const std::size_t sp1 = line.find(' ');
  const std::size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos || line.find(' ', sp2 + 1) != std::string::npos) {
    return fail(400, "not an HTTP request line");
  }
  const std::string method = line.substr(0, sp1);
  const std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string version = line.substr(sp2 + 1);
  if (version.rfind("HTTP/", 0) != 0) return fail(400, "not an HTTP request line");
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return fail(505, "only HTTP/1.0 and HTTP/1.1 are served");
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
  request_.method = method;
  request_.path = target.substr(0, target.find('?'));
  return Result::complete;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

std::string serialize(const HttpResponse& r, bool head_only) {
  std::string out = "HTTP/1.1 " + std::to_string(r.status) + " " + reason_phrase(r.status) + "\r\n";
  out += "Content-Type: " + r.content_type + "\r\n";
  out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  if (r.status == 405) out += "Allow: GET, HEAD\r\n";
  out += "Cache-Control: no-store\r\nConnection: close\r\n\r\n";
  if (!head_only) out += r.body;
  return out;
}

}  // namespace ddp::metrics
