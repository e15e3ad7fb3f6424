#include "metrics/http_server.h"

#include <fcntl.h>

#include <array>
#include <chrono>
#include <exception>

namespace ddp::metrics {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

// Boost.Asio's socket() and accept() (Boost 1.74) do not ask for SOCK_CLOEXEC: marked here, as
// rendezvous/cloexec.h does for the rendezvous' sockets.
void close_on_exec(int fd) {
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0 && !(flags & FD_CLOEXEC)) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

}  // namespace

// One client: read a request head (bounded), answer, close. Kept alive by its pending handlers.
class HttpServer::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpServer& server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), timer_(socket_.get_executor()),
        parser_(server.options_.max_head_bytes), live_(server.live_) {
    ++*live_;
  }
  ~Connection() { --*live_; }

  void start() {
    timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(server_.options_.request_timeout)));
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->close();  // too slow: cut off, whatever it was doing
    });
    read();
  }

  void close() {
    boost::system::error_code ignored;
    timer_.cancel();
    socket_.close(ignored);
  }

 private:
  void read() {
    socket_.async_read_some(asio::buffer(buf_), [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
      if (ec) return self->close();
      switch (self->parser_.feed(std::string_view(self->buf_.data(), n))) {
        case HttpRequestParser::Result::need_more: return self->read();
        case HttpRequestParser::Result::complete: {
          const HttpRequest& req = self->parser_.request();
          return self->respond(self->server_.answer(req), req.method == "HEAD");
        }
        case HttpRequestParser::Result::error: {
          HttpResponse r;
          r.status = self->parser_.error_status();
          r.body = self->parser_.error() + "\n";
          return self->respond(r, false);
        }
      }
    });
  }

  void respond(const HttpResponse& response, bool head_only) {
    out_ = serialize(response, head_only);
    asio::async_write(socket_, asio::buffer(out_), [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
      boost::system::error_code ignored;
      if (!ec) self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
      self->close();
    });
  }

  HttpServer& server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  HttpRequestParser parser_;
  std::array<char, 4096> buf_{};
  std::string out_;
  std::shared_ptr<std::size_t> live_;
};

HttpServer::HttpServer(asio::io_context& io, const tcp::endpoint& endpoint, HttpServerOptions options)
    : io_(io), options_(options), acceptor_(io), retry_timer_(io) {
  acceptor_.open(endpoint.protocol());
  close_on_exec(acceptor_.native_handle());
  acceptor_.set_option(tcp::acceptor::reuse_address(true));
  acceptor_.bind(endpoint);
  acceptor_.listen();
  port_ = acceptor_.local_endpoint().port();
  accept();
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  retry_timer_.cancel();
  for (auto& [raw, weak] : open_) {
    if (auto c = weak.lock()) c->close();
  }
  open_.clear();
}

void HttpServer::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (stopped_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of descriptors (EMFILE) or similar: try again shortly instead of spinning.
      retry_timer_.expires_after(std::chrono::milliseconds(100));
      retry_timer_.async_wait([this](boost::system::error_code e) {
        if (!e && !stopped_) accept();
      });
      return;
    }
    {
      if (*live_ >= options_.max_connections) {
        boost::system::error_code ignored;
        socket.close(ignored);  // full: the client retries at its next scrape
      } else {
        close_on_exec(socket.native_handle());
        auto c = std::make_shared<Connection>(*this, std::move(socket));
        // Forget connections that are gone, so that the table stays bounded by max_connections.
        for (auto it = open_.begin(); it != open_.end();) it = it->second.expired() ? open_.erase(it) : std::next(it);
        open_[c.get()] = c;
        c->start();
      }
    }
    accept();
  });
}

HttpResponse HttpServer::answer(const HttpRequest& request) const {
  auto it = routes_.find(request.path);
  if (it == routes_.end()) {
    HttpResponse r;
    r.status = 404;
    std::string served;
    for (const auto& [path, route] : routes_) served += (served.empty() ? "" : ", ") + path;
    r.body = "not found: " + request.path + " (served: " + served + ")\n";
    return r;
  }
  try {
    return it->second();
  } catch (const std::exception& e) {
    HttpResponse r;
    r.status = 500;
    r.body = std::string("error: ") + e.what() + "\n";
    return r;
  }
}

}  // namespace ddp::metrics
