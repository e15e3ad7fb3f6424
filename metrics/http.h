// The HTTP/1.1 subset of the metrics endpoint, socket-free (tested without sockets): a bounded
// request reader on Boost.Beast's parser, fed the bytes a connection receives, and the
// response writer.
//
// One request per connection: the server answers and closes (Connection: close), so there is no
// keep-alive and no pipelining. Only GET and HEAD exist, and neither has a body: a request that
// announces one is refused. A request whose head (request line and headers) exceeds the limit,
// or that is not HTTP, is an error with the status code to answer; nothing a client sends throws.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/parser.hpp>

namespace ddp::metrics {

struct HttpRequest {
  std::string method;  // "GET" or "HEAD"
  std::string path;    // the target without its query string, e.g. "/metrics"
};

// One request's reader. Owned by its connection (or a test); lives as long as that request.
// Single-threaded: the owner's thread calls it.
class HttpRequestParser {
 public:
  enum class Result { need_more, complete, error };
  // REQUIRES: max_head_bytes > 0. Default 8 KiB, as common servers allow for a request head.
  explicit HttpRequestParser(std::size_t max_head_bytes = 8192);
  HttpRequestParser(const HttpRequestParser&) = delete;
  HttpRequestParser& operator=(const HttpRequestParser&) = delete;
  // Adds bytes received. A bad request line is judged as soon as it ends, before the rest of
  // the head arrives. At most max_head_bytes are ever buffered. After complete or error,
  // further bytes are ignored.
  Result feed(std::string_view bytes);
  const HttpRequest& request() const { return request_; }
  int error_status() const { return status_; }        // 400, 405, 413, 431 or 505 after error
  const std::string& error() const { return error_; }  // why, for the response body

 private:
  Result fail(int status, std::string why);
  void take(std::string_view bytes);
  Result put();
  Result check_request_line();
  Result refuse(const boost::beast::error_code& ec);

  std::size_t max_;
  std::size_t taken_ = 0;   // bytes of the head taken so far (a bare LF counts as CRLF)
  std::string pending_;     // taken, not yet consumed by the parser
  std::string first_line_;  // the request line, for the status of a bad version
  bool line_checked_ = false;
  bool last_was_cr_ = false;
  boost::beast::http::request_parser<boost::beast::http::empty_body> parser_;
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

}  // namespace ddp::metrics
