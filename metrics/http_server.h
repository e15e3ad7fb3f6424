// The metrics HTTP server: /metrics, /healthz, /readyz (docs/metrics.md) on the owner's
// io_context, next to the daemon or the agent it describes.
//
// Owned by the daemon's main or by the launcher; lives until stop() or destruction. Every handler
// runs on the io_context's single thread, the same thread as the state it reports, so the
// routes read that state without locks. Bounded: at most max_connections at once (more are
// closed at accept), a request head of max_head_bytes, request_timeout seconds from accept to the
// last byte of the answer (a slow or silent client is cut off). One request per connection.
// Nothing a client sends can throw out of a handler: errors close that connection only.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <boost/asio.hpp>

#include "metrics/http.h"

namespace ddp::metrics {

struct HttpServerOptions {
  std::size_t max_connections = 64;    // concurrent; Prometheus uses one per target
  std::size_t max_head_bytes = 8192;   // request line and headers
  double request_timeout = 10.0;       // seconds from accept until the answer is sent
};

class HttpServer {
 public:
  using Route = std::function<HttpResponse()>;
  // Binds and listens (port 0 = any free port). Throws boost::system::system_error when it cannot.
  HttpServer(boost::asio::io_context& io, const boost::asio::ip::tcp::endpoint& endpoint,
             HttpServerOptions options = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Serves GET/HEAD `path` with `route` (called on the io_context thread for each request; a
  // route that throws is answered with 500). Unknown paths get 404.
  void route(const std::string& path, Route route) { routes_[path] = std::move(route); }
  unsigned short port() const { return port_; }
  std::size_t connection_count() const { return *live_; }
  // Closes the acceptor and every open connection.
  void stop();

 private:
  class Connection;
  void accept();
  HttpResponse answer(const HttpRequest& request) const;

  boost::asio::io_context& io_;
  HttpServerOptions options_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;  // after an accept error such as EMFILE
  unsigned short port_ = 0;
  std::map<std::string, Route> routes_;
  std::shared_ptr<std::size_t> live_ = std::make_shared<std::size_t>(0);
  std::map<Connection*, std::weak_ptr<Connection>> open_;
  bool stopped_ = false;
};

}  // namespace ddp::metrics
