#include "rendezvous/stream.h"

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>

namespace ddp::rdzv {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using asio::ip::tcp;

struct TlsContext::Impl {
  ssl::context context{ssl::context::tls};
};

TlsContext::TlsContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TlsContext::~TlsContext() = default;

namespace {

// TLS 1.2 or later, no compression, no renegotiation.
void harden(ssl::context& c) {
  c.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::no_compression);
}

Expected<Ok> load(const std::string& option, const std::string& path,
                  const std::function<void(boost::system::error_code&)>& f) {
  boost::system::error_code ec;
  f(ec);
  if (!ec) return Ok{};
  return unexpected(option + "=" + path + ": cannot use it: " + ec.message() +
                    " (expected a readable PEM file; docs/security.md shows how to make one with openssl)");
}

Expected<Ok> load_identity(ssl::context& c, const TlsFiles& files, const char* cert_option, const char* key_option) {
  if (files.cert.empty() != files.key.empty()) {
    return unexpected(std::string(files.cert.empty() ? key_option : cert_option) + " needs " +
                      (files.cert.empty() ? cert_option : key_option) + " too");
  }
  if (files.cert.empty()) return Ok{};
  Expected<Ok> done = load(cert_option, files.cert, [&](auto& ec) { c.use_certificate_chain_file(files.cert, ec); });
  if (done) done = load(key_option, files.key, [&](auto& ec) { c.use_private_key_file(files.key, ssl::context::pem, ec); });
  if (!done) return done;
  if (SSL_CTX_check_private_key(c.native_handle()) != 1) {
    return unexpected(std::string(key_option) + "=" + files.key + " is not the key of " + cert_option + "=" + files.cert);
  }
  return Ok{};
}

class PlainStream final : public Stream {
 public:
  explicit PlainStream(tcp::socket socket) : socket_(std::move(socket)) {}
  void async_handshake(DoneHandler done) override {
    asio::post(socket_.get_executor(), [done = std::move(done)] { done({}); });
  }
  void async_read_some(asio::mutable_buffer buffer, IoHandler handler) override {
    socket_.async_read_some(buffer, std::move(handler));
  }
  void async_write(asio::const_buffer buffer, IoHandler handler) override {
    asio::async_write(socket_, buffer, std::move(handler));
  }
  std::size_t write_now(asio::const_buffer buffer, boost::system::error_code& ec) override {
    return socket_.send(buffer, 0, ec);
  }
  void close() override {
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }
  tcp::socket& socket() override { return socket_; }
  bool tls() const override { return false; }

 private:
  tcp::socket socket_;
};

class TlsStream final : public Stream {
 public:
  TlsStream(tcp::socket socket, std::shared_ptr<TlsContext> context, bool server, const std::string& host)
      : context_(std::move(context)), stream_(std::move(socket), context_->impl().context), server_(server) {
    if (!server) {
      stream_.set_verify_mode(ssl::verify_peer);
      stream_.set_verify_callback(ssl::host_name_verification(host));
      boost::system::error_code ec;
      asio::ip::make_address(host, ec);
      if (ec) SSL_set_tlsext_host_name(stream_.native_handle(), host.c_str());  // SNI: names only
    }
  }
  void async_handshake(DoneHandler done) override {
    stream_.async_handshake(server_ ? ssl::stream_base::server : ssl::stream_base::client,
                            [done = std::move(done)](const boost::system::error_code& ec) { done(ec); });
  }
  void async_read_some(asio::mutable_buffer buffer, IoHandler handler) override {
    stream_.async_read_some(buffer, std::move(handler));
  }
  void async_write(asio::const_buffer buffer, IoHandler handler) override {
    asio::async_write(stream_, buffer, std::move(handler));
  }
  std::size_t write_now(asio::const_buffer, boost::system::error_code& ec) override {
    ec = asio::error::would_block;
    return 0;
  }
  void close() override {
    boost::system::error_code ignored;
    stream_.lowest_layer().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.lowest_layer().close(ignored);
  }
  tcp::socket& socket() override { return stream_.next_layer(); }
  bool tls() const override { return true; }

 private:
  std::shared_ptr<TlsContext> context_;  // outlives the stream that uses its SSL_CTX
  ssl::stream<tcp::socket> stream_;
  bool server_;
};

}  // namespace

Expected<std::shared_ptr<TlsContext>> TlsContext::for_server(const TlsFiles& files) {
  auto impl = std::make_unique<Impl>();
  ssl::context& c = impl->context;
  harden(c);
  if (files.cert.empty()) return unexpected("--tls_key needs --tls_cert too");
  Expected<Ok> done = load_identity(c, files, "--tls_cert", "--tls_key");
  if (done && !files.ca.empty()) {
    done = load("--tls_client_ca", files.ca, [&](auto& ec) { c.load_verify_file(files.ca, ec); });
    c.set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  }
  if (!done) return unexpected(done.error());
  return std::shared_ptr<TlsContext>(new TlsContext(std::move(impl)));
}

Expected<std::shared_ptr<TlsContext>> TlsContext::for_client(const TlsFiles& files) {
  auto impl = std::make_unique<Impl>();
  ssl::context& c = impl->context;
  harden(c);
  if (files.ca.empty()) return unexpected("tls_cert needs tls_ca too: the server's certificate is always checked");
  Expected<Ok> done = load("tls_ca", files.ca, [&](auto& ec) { c.load_verify_file(files.ca, ec); });
  if (done) done = load_identity(c, files, "tls_cert", "tls_key");
  if (!done) return unexpected(done.error());
  return std::shared_ptr<TlsContext>(new TlsContext(std::move(impl)));
}

std::unique_ptr<Stream> make_server_stream(tcp::socket socket, const std::shared_ptr<TlsContext>& tls) {
  if (!tls) return std::make_unique<PlainStream>(std::move(socket));
  return std::make_unique<TlsStream>(std::move(socket), tls, true, "");
}

std::unique_ptr<Stream> make_client_stream(tcp::socket socket, const std::shared_ptr<TlsContext>& tls,
                                           const std::string& host) {
  if (!tls) return std::make_unique<PlainStream>(std::move(socket));
  return std::make_unique<TlsStream>(std::move(socket), tls, false, host);
}

std::string describe_tls_failure(const boost::system::error_code& ec, bool client) {
  const std::string what = ec.message();
  if (ec == asio::error::eof || ec == asio::error::connection_reset || ec == ssl::error::stream_truncated) {
    return client ? "the server closed the connection during the TLS handshake (" + what +
                        "): it may not speak TLS, or it requires a client certificate (tls_cert, tls_key)"
                  : "the client closed the connection during the TLS handshake (" + what + ")";
  }
  if (what.find("certificate verify failed") != std::string::npos) {
    return client ? "the server's certificate is not trusted (" + what +
                        "): tls_ca must be the CA that signed it, and the certificate must name the host in the "
                        "endpoint"
                  : "the client's certificate is not signed by --tls_client_ca (" + what + ")";
  }
  if (what.find("wrong version number") != std::string::npos || what.find("packet length too long") != std::string::npos ||
      what.find("http request") != std::string::npos || what.find("record layer failure") != std::string::npos) {
    return "the peer does not speak TLS (" + what + ")" +
           (client ? ": is the server started without --tls_cert? Then drop tls_ca" : "");
  }
  if (what.find("peer did not return a certificate") != std::string::npos) {
    return "the client sent no certificate, and --tls_client_ca requires one (" + what + ")";
  }
  if (what.find("alert") != std::string::npos && client) {
    return "the server refused the TLS handshake (" + what + "): if it requires a client certificate, give tls_cert "
           "and tls_key";
  }
  return "TLS handshake failed: " + what;
}

}  // namespace ddp::rdzv
