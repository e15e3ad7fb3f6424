#include "rendezvous/etcd.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <limits>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <openssl/ssl.h>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "rendezvous/cloexec.h"
#include "rendezvous/protocol.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = boost::asio::ssl;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using TlsStream = beast::ssl_stream<beast::tcp_stream>;

namespace {

constexpr int kCodeUnavailable = 14;
constexpr int kCodeUnauthenticated = 16;
constexpr double kAuthenticateSeconds = 5.0;  // the least time a login gets (authenticate)

std::string secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
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

// A transport error's text; a TLS one says what usually causes it.
std::string io_error(const char* step, const beast::error_code& ec) {
  std::string text = std::string(step) + ": " + ec.message();
  if (ec.category() == asio::error::get_ssl_category() || ec == ssl::error::stream_truncated) {
    text += " (TLS: if etcd requires client certificates (--client-cert-auth), give a certificate and key its "
            "trusted CA signed: --etcd_cert, --etcd_key)";
  }
  return text;
}

// The handshake that turns a connected socket into the stream HTTP is spoken on: none for plain
// TCP; for TLS, the server's certificate checked against the CA and the host of the endpoint.
template <class Done>
void handshake(beast::tcp_stream&, const std::string&, Done done) {
  done(std::string());
}

template <class Done>
void handshake(TlsStream& stream, const std::string& host, Done done) {
  stream.set_verify_mode(ssl::verify_peer);
  stream.set_verify_callback(ssl::host_name_verification(host));
  boost::system::error_code ec;
  asio::ip::make_address(host, ec);
  if (ec) SSL_set_tlsext_host_name(stream.native_handle(), host.c_str());  // SNI: names only
  stream.async_handshake(ssl::stream_base::client, [done](const beast::error_code& e) {
    if (!e) return done(std::string());
    if (e == beast::error::timeout) return done(std::string("TLS handshake timed out"));
    const std::string what = e.message();
    if (what.find("certificate verify failed") != std::string::npos) {
      return done("TLS handshake: the server's certificate is not trusted (" + what +
                  "): the CA file (--etcd_cacert) must be the CA that signed it, and the certificate must name "
                  "the host of the endpoint");
    }
    if (what.find("wrong version number") != std::string::npos || what.find("packet length too long") != std::string::npos) {
      return done("TLS handshake: the server does not speak TLS (" + what + "): use http:// for it");
    }
    done(io_error("TLS handshake", e));
  });
}

// One POST on a private io_context, bounded by `deadline`: the whole exchange (resolve, connect,
// write, read) is cancelled when it passes.
struct Exchange {
  unsigned status = 0;
  std::string body;
  std::string error;  // transport error ("" = an HTTP answer arrived)
};

template <class Stream>
Exchange post_on(asio::io_context& io, Stream& stream, const std::string& host, const std::string& port,
                 const std::string& target, const std::string& body, const std::string& token, std::size_t max_bytes,
                 Clock::time_point deadline) {
  Exchange result;
  tcp::resolver resolver(io);
  auto& lowest = beast::get_lowest_layer(stream);
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
    lowest.socket().shutdown(tcp::socket::shutdown_both, ignored);
    lowest.close();
  };
  lowest.expires_at(deadline);
  resolver.async_resolve(host, port, [&](const beast::error_code& ec, const tcp::resolver::results_type& results) {
    if (ec) return finish("resolve " + host + ": " + ec.message());
    lowest.async_connect(results, [&](const beast::error_code& ec2, const tcp::endpoint&) {
      if (ec2) return finish(ec2 == beast::error::timeout ? "connect timed out" : "connect: " + ec2.message());
      close_on_exec(lowest.socket().native_handle());
      handshake(stream, host, [&](const std::string& tls_error) {
      if (!tls_error.empty()) return finish(tls_error);
      http::async_write(stream, request, [&](const beast::error_code& ec3, std::size_t) {
        if (ec3) return finish(ec3 == beast::error::timeout ? "send timed out" : io_error("send", ec3));
        auto read_failed = [&, max_bytes](const beast::error_code& ec4) {
          finish(ec4 == beast::error::timeout       ? "no answer in time"
                 : ec4 == http::error::body_limit ? "answer larger than " + std::to_string(max_bytes) + " bytes"
                                                  : io_error("read", ec4));
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

// One POST, on TLS when `tls` is given.
Exchange post(ssl::context* tls, const std::string& host, const std::string& port, const std::string& target,
              const std::string& body, const std::string& token, std::size_t max_bytes, Clock::time_point deadline) {
  asio::io_context io(1);
  if (tls) {
    TlsStream stream(io, *tls);
    return post_on(io, stream, host, port, target, body, token, max_bytes, deadline);
  }
  beast::tcp_stream stream(io);
  return post_on(io, stream, host, port, target, body, token, max_bytes, deadline);
}

// TCP keepalive on a watch's socket: a peer that vanished (host down, cable cut) ends the stream
// after `idle` seconds of silence and 3 unanswered probes a second apart.
void keep_alive(tcp::socket& socket, double idle) {
  const int on = 1, probes = 3, interval = 1;
  const int idle_s = std::max(1, static_cast<int>(idle));
  const int fd = socket.native_handle();
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
}

// One watch stream on a private io_context. `established` once etcd said `created`; until then
// everything is bounded by `deadline`, afterwards only by the stream's liveness and `stop`.
struct WatchOutcome {
  bool established = false;
  unsigned status = 0;  // the HTTP status when it was not 200
  std::string body;     // its body (an etcd error object), at most 64 KiB
  std::string error;    // why the stream ended (always set)
  int code = 0;         // etcd's gRPC code, from an error line in the stream
};

using WatchCallback = std::function<void(const EtcdWatchResponse&)>;
using SetInterrupt = std::function<void(std::function<void()>)>;

// One watch stream while it runs: the request, the parser, the buffers and how it ended. It lives
// on watch_on's stack and its handlers hold `this`, so it never moves. Every handler first checks
// `done_`: once finish() has run, the cancelled operations still complete and must start nothing.
template <class Stream>
class WatchSession {
 public:
  WatchSession(asio::io_context& io, Stream& stream, const std::string& host, const std::string& port,
               const std::string& body, const std::string& token, std::size_t max_bytes, double keepalive_idle,
               const WatchCallback& on_response)
      : io_(io), stream_(stream), host_(host), port_(port), keepalive_idle_(keepalive_idle),
        on_response_(on_response), resolver_(io), lowest_(beast::get_lowest_layer(stream)),
        establish_timer_(io), request_{http::verb::post, "/v3/watch", 11}, lines_(max_bytes) {
    request_.set(http::field::host, host + ":" + port);
    request_.set(http::field::content_type, "application/json");
    // The gateway passes Grpc-Metadata-* headers on as gRPC metadata: "hasleader" makes etcd end
    // the stream when its member has lost the cluster's leader (a partitioned member would
    // otherwise keep the stream open and silent).
    request_.set("Grpc-Metadata-hasleader", "true");
    if (!token.empty()) request_.set(http::field::authorization, token);
    request_.body() = body;
    request_.prepare_payload();
    parser_.header_limit(16 * 1024);
    parser_.body_limit((std::numeric_limits<std::uint64_t>::max)());  // a stream; each line is bounded below
  }

  // Runs the stream until it ends, `stop` is stopped, or (before `created`) `deadline` passes.
  WatchOutcome run(Clock::time_point deadline, EtcdWatchStop& stop, const SetInterrupt& set_interrupt) {
    establish_timer_.expires_at(deadline);
    establish_timer_.async_wait([this](const beast::error_code& ec) {
      if (!ec && !result_.established) finish("watch not created in time");
    });
    lowest_.expires_at(deadline);
    resolver_.async_resolve(host_, port_,
                            [this](const beast::error_code& ec, const tcp::resolver::results_type& results) {
                              if (done_) return;
                              if (ec) return finish("resolve " + host_ + ": " + ec.message());
                              connect(results);
                            });
    set_interrupt([this] { io_.stop(); });
    if (!stop.stopped()) io_.run();
    set_interrupt(nullptr);
    if (!done_) {
      finish("stopped");
      io_.restart();
      io_.run();  // the cancelled handlers, which only see `done_`
    }
    return std::move(result_);
  }

 private:
  void finish(const std::string& error) {
    if (done_) return;
    done_ = true;
    result_.error = error;
    establish_timer_.cancel();
    resolver_.cancel();
    beast::error_code ignored;
    lowest_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    lowest_.close();
  }

  void connect(const tcp::resolver::results_type& results) {
    lowest_.async_connect(results, [this](const beast::error_code& ec, const tcp::endpoint&) {
      if (done_) return;
      if (ec) return finish(ec == beast::error::timeout ? "connect timed out" : "connect: " + ec.message());
      close_on_exec(lowest_.socket().native_handle());
      keep_alive(lowest_.socket(), keepalive_idle_);
      handshake(stream_, host_, [this](const std::string& tls_error) {
        if (done_) return;
        if (!tls_error.empty()) return finish(tls_error);
        send_request();
      });
    });
  }

  void send_request() {
    http::async_write(stream_, request_, [this](const beast::error_code& ec, std::size_t) {
      if (done_) return;
      if (ec) return finish(ec == beast::error::timeout ? "send timed out" : io_error("send", ec));
      read_head();
    });
  }

  void read_head() {
    http::async_read_header(stream_, buffer_, parser_, [this](const beast::error_code& ec, std::size_t) {
      if (done_) return;
      if (ec) return finish(ec == beast::error::timeout ? "watch not created in time" : io_error("read", ec));
      if (parser_.get().result_int() != 200) {
        result_.status = parser_.get().result_int();
        return read_error_body();
      }
      read_lines();
    });
  }

  // The next piece of the body into `chunk_`, handed to `on_read`.
  template <class OnRead>
  void read_chunk(OnRead on_read) {
    parser_.get().body().data = chunk_.data();
    parser_.get().body().size = chunk_.size();
    http::async_read_some(stream_, buffer_, parser_, on_read);
  }

  std::size_t chunk_bytes() { return chunk_.size() - parser_.get().body().size; }

  void read_lines() {
    read_chunk([this](beast::error_code ec, std::size_t) { on_lines(ec); });
  }

  void on_lines(beast::error_code ec) {
    if (done_) return;
    if (ec == http::error::need_buffer) ec = {};
    if (ec) {
      return finish(ec == beast::error::timeout ? "watch not created in time"
                    : ec == http::error::end_of_stream || ec == http::error::partial_message || ec == asio::error::eof
                        ? "the watch stream was closed"
                        : io_error("watch stream", ec));
    }
    answers_.clear();
    if (auto e = lines_.feed(std::string_view(chunk_.data(), chunk_bytes()), answers_); !e.empty()) {
      result_.code = lines_.error_code();
      return finish(e);
    }
    for (const EtcdWatchResponse& r : answers_) {
      if (!deliver(r)) return;
    }
    if (parser_.is_done()) return finish("the watch stream ended");
    read_lines();
  }

  // One answer from etcd: the first must say `created`, which ends the establishing deadline.
  // False when it ended the stream.
  bool deliver(const EtcdWatchResponse& r) {
    if (!result_.established) {
      if (!r.created) {
        finish("the watch stream did not start with \"created\"");
        return false;
      }
      result_.established = true;
      establish_timer_.cancel();
      lowest_.expires_never();
    }
    if (r.canceled) {
      finish("etcd canceled the watch" + (r.cancel_reason.empty() ? "" : ": " + r.cancel_reason) +
             (r.compact_revision ? " (compacted at revision " + std::to_string(r.compact_revision) + ")" : ""));
      return false;
    }
    on_response_(r);
    return true;
  }

  // An error answer (not 200): its body, bounded, for the caller to read etcd's error from.
  void read_error_body() {
    read_chunk([this](beast::error_code ec, std::size_t) { on_error_body(ec); });
  }

  void on_error_body(beast::error_code ec) {
    if (done_) return;
    if (ec == http::error::need_buffer) ec = {};
    result_.body.append(chunk_.data(), chunk_bytes());
    if (ec || parser_.is_done() || result_.body.size() > 64 * 1024) {
      if (result_.body.size() > 64 * 1024) result_.body.clear();
      return finish("HTTP " + std::to_string(result_.status));
    }
    read_error_body();
  }

  asio::io_context& io_;
  Stream& stream_;
  const std::string& host_;
  const std::string& port_;
  const double keepalive_idle_;
  const WatchCallback& on_response_;
  WatchOutcome result_;
  tcp::resolver resolver_;
  beast::tcp_stream& lowest_;
  asio::steady_timer establish_timer_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  http::response_parser<http::buffer_body> parser_;
  EtcdWatchParser lines_;
  std::array<char, 16 * 1024> chunk_;
  std::vector<EtcdWatchResponse> answers_;
  bool done_ = false;
};

template <class Stream>
WatchOutcome watch_on(asio::io_context& io, Stream& stream, const std::string& host, const std::string& port,
                      const std::string& body, const std::string& token, std::size_t max_bytes, double keepalive_idle,
                      Clock::time_point deadline, const WatchCallback& on_response, EtcdWatchStop& stop,
                      const SetInterrupt& set_interrupt) {
  WatchSession<Stream> session(io, stream, host, port, body, token, max_bytes, keepalive_idle, on_response);
  return session.run(deadline, stop, set_interrupt);
}

WatchOutcome watch_stream(ssl::context* tls, const std::string& host, const std::string& port, const std::string& body,
                          const std::string& token, std::size_t max_bytes, double keepalive_idle,
                          Clock::time_point deadline, const WatchCallback& on_response, EtcdWatchStop& stop,
                          const SetInterrupt& set_interrupt) {
  asio::io_context io(1);
  if (tls) {
    TlsStream stream(io, *tls);
    return watch_on(io, stream, host, port, body, token, max_bytes, keepalive_idle, deadline, on_response, stop,
                    set_interrupt);
  }
  beast::tcp_stream stream(io);
  return watch_on(io, stream, host, port, body, token, max_bytes, keepalive_idle, deadline, on_response, stop,
                  set_interrupt);
}

bool retryable(const EtcdStatus& s, unsigned http_status) {
  return http_status >= 500 || s.code == kCodeUnavailable;
}

}  // namespace

void EtcdWatchStop::stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
  if (interrupt_) interrupt_();
}

bool EtcdWatchStop::stopped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped_;
}

struct EtcdClient::Tls {
  ssl::context context{ssl::context::tls_client};
};

namespace {

// TLS 1.2 or later, no compression; the files loaded once. "" or what is wrong, naming the file.
std::string load_tls(ssl::context& c, const EtcdOptions& o) {
  c.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::no_compression);
  boost::system::error_code ec;
  auto bad = [&](const char* what, const std::string& path) {
    return std::string("etcd TLS: ") + what + " " + path + ": cannot use it: " + ec.message() +
           " (expected a readable PEM file)";
  };
  if (o.ca_file.empty()) {
    c.set_default_verify_paths(ec);
    if (ec) return std::string("etcd TLS: the system's trusted CAs cannot be loaded: ") + ec.message();
  } else if (c.load_verify_file(o.ca_file, ec); ec) {
    return bad("CA file", o.ca_file);
  }
  if (o.cert_file.empty() != o.key_file.empty()) {
    return o.cert_file.empty() ? "etcd TLS: a client key file needs its certificate file too"
                               : "etcd TLS: a client certificate file needs its key file too";
  }
  if (o.cert_file.empty()) return "";
  if (c.use_certificate_chain_file(o.cert_file, ec); ec) return bad("client certificate file", o.cert_file);
  if (c.use_private_key_file(o.key_file, ssl::context::pem, ec); ec || SSL_CTX_check_private_key(c.native_handle()) != 1) {
    if (ec && ec.message().find("key values mismatch") == std::string::npos) return bad("client key file", o.key_file);
    return "etcd TLS: the client key file " + o.key_file + " is not the key of the certificate " + o.cert_file;
  }
  return "";
}

}  // namespace

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {
  for (std::string text : options_.endpoints) {
    std::string rest = text;
    bool tls = false;
    if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
    else if (rest.rfind("https://", 0) == 0) {
      rest = rest.substr(8);
      tls = true;
    } else if (rest.find("://") != std::string::npos) {
      bad_endpoints_ += (bad_endpoints_.empty() ? "" : "; ") + text + ": only http:// and https:// are supported";
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
    endpoints_.push_back({host, port,
                          std::string(tls ? "https://" : "http://") +
                              (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + port,
                          tls});
  }
  if (endpoints_.empty() && bad_endpoints_.empty()) bad_endpoints_ = "no etcd endpoint given";
  const bool any_tls = std::any_of(endpoints_.begin(), endpoints_.end(), [](const Endpoint& e) { return e.tls; });
  if (any_tls || !options_.ca_file.empty() || !options_.cert_file.empty() || !options_.key_file.empty()) {
    auto tls = std::make_shared<Tls>();
    if (auto e = load_tls(tls->context, options_); !e.empty()) {
      bad_endpoints_ += (bad_endpoints_.empty() ? "" : "; ") + e;
    } else {
      tls_ = std::move(tls);
    }
  }
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
  // etcd checks the password with bcrypt (cost 10: ~0.1 s of a member's CPU, seconds on a loaded
  // machine), so a login gets at least kAuthenticateSeconds, however short the call it precedes:
  // with TTL 2 s a replica's calls have 0.5 s for every endpoint together, and under load it
  // could never log in. A leader's deadline is its event loop's timer, not this call's.
  deadline = std::max(deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(kAuthenticateSeconds)));
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
    Exchange x = post(ep.tls ? &tls_->context : nullptr, ep.host, ep.port, path, body, token_,
                      options_.max_response_bytes, now + share);
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

EtcdStatus EtcdClient::watch(const EtcdWatchRequest& w,
                              const std::function<void(const EtcdWatchResponse&)>& on_response, EtcdWatchStop& stop) {
  if (!bad_endpoints_.empty()) return {"etcd endpoints: " + bad_endpoints_, 0};
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(w.establish_timeout));
  nlohmann::json create = {{"key", base64_encode(w.key)}};
  if (!w.range_end.empty()) create["range_end"] = base64_encode(w.range_end);
  if (w.start_revision > 0) create["start_revision"] = std::to_string(w.start_revision);
  const std::string body = nlohmann::json{{"create_request", create}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (!options_.user.empty() && token_.empty()) {
    if (auto s = authenticate(deadline); !s.ok()) return s;
  }
  auto set_interrupt = [&stop](std::function<void()> f) {
    std::lock_guard<std::mutex> lock(stop.mu_);
    stop.interrupt_ = std::move(f);
  };
  // The caller's function must not throw out of the io_context: a throw ends the stream.
  std::string thrown;
  auto deliver = [&](const EtcdWatchResponse& r) {
    if (!thrown.empty()) return;
    try {
      on_response(r);
    } catch (const std::exception& e) {
      thrown = e.what();
    }
  };
  std::string errors;
  int last_code = 0;
  bool reauthenticated = false;
  const std::size_t n = endpoints_.size();
  for (std::size_t tried = 0; tried < n; ++tried) {
    if (stop.stopped()) return {"stopped", 0};
    const auto now = Clock::now();
    if (now >= deadline) break;
    const auto share = (deadline - now) / static_cast<int>(n - tried);
    const std::size_t index = (preferred_ + tried) % n;
    const Endpoint& ep = endpoints_[index];
    WatchOutcome x = watch_stream(ep.tls ? &tls_->context : nullptr, ep.host, ep.port, body, token_, options_.max_response_bytes, w.keepalive_idle,
                                  now + share, deliver, stop, set_interrupt);
    const std::string where = ep.text + "/v3/watch";
    if (x.established) {
      preferred_ = index;
      answered_ = true;
      if (!thrown.empty()) return {where + ": internal error: " + thrown, 0};
      return {where + ": " + x.error, x.code};
    }
    if (x.error == "stopped") return {"stopped", 0};
    EtcdStatus s{where + ": " + x.error, x.code};
    if (x.status != 0) {
      nlohmann::json parsed;
      s = error_answer(where, x.status, parse_answer(x.body, parsed).ok() ? parsed : nlohmann::json());
    }
    if (s.code == kCodeUnauthenticated && !options_.user.empty() && !reauthenticated) {
      reauthenticated = true;
      token_.clear();
      if (auto a = authenticate(deadline); !a.ok()) return a;
      --tried;  // the same endpoint once more, with the new token
      continue;
    }
    if (x.status != 0 && !retryable(s, x.status)) return s;
    errors += (errors.empty() ? "" : "; ") + s.error;
    last_code = s.code;
  }
  if (errors.empty()) errors = "no time left";
  return {"etcd watch failed within " + secs(w.establish_timeout) + ": " + errors, last_code};
}

EtcdStatus EtcdClient::lease_revoke(std::int64_t id) {
  nlohmann::json answer;
  return call("/v3/lease/revoke", {{"ID", std::to_string(id)}}, answer);
}

}  // namespace ddp::rdzv
