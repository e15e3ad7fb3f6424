// The HTTP/1.1 subset of the metrics endpoint, socket-free (tested without sockets): an
// incremental, bounded request parser and the response writer.
//
// One request per connection: the server answers and closes (Connection: close), so there is no
// keep-alive, no pipelining and no request body to frame. Only GET and HEAD exist. A request whose
// head (request line and headers) exceeds the limit, or that is not HTTP, is an error with the
// status code to answer; nothing a client sends throws.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ddp::metrics {

struct HttpRequest {
  std::string method;  // "GET" or "HEAD"
  std::string path;    // the target without its query string, e.g. "/metrics"
};

class HttpRequestParser {
 public:
  enum class Result { need_more, complete, error };
  // REQUIRES: max_head_bytes > 0. Default 8 KiB, as common servers allow for a request head.
  explicit HttpRequestParser(std::size_t max_head_bytes = 8192) : max_(max_head_bytes) {}
  // Adds bytes received. After complete or error, further bytes are ignored.
  Result feed(std::string_view bytes);
  const HttpRequest& request() const { return request_; }
  int error_status() const { return status_; }        // 400, 405, 431 or 505 after error
  const std::string& error() const { return error_; }  // why, for the response body

 private:
  Result fail(int status, std::string why);
  Result parse_head();
  Result parse_request_line(std::string line);  // complete = valid (the head may go on)

  std::size_t max_;
  std::string head_;
  bool line_checked_ = false;
  Result result_ = Result::need_more;
  HttpRequest request_;
  int status_ = 0;
  std::string error_;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// The whole response: status line, Content-Type, Content-Length, Connection: close, body (none
// for HEAD, which still gives the length).
std::string serialize(const HttpResponse& response, bool head_only);

const char* reason_phrase(int status);

}  // namespace ddp::metrics
