// The byte stream under one rendezvous connection: plain TCP, or TLS over it (docs/security.md).
// One interface, so that the server's Session, the agent's Client and `status` are written once
// for both; only stream.cpp includes OpenSSL and Boost.Asio's ssl.
//
// A Stream is owned by the connection object that created it (Session, Client, the status
// query) and used from that object's io_context thread only. A TlsContext is loaded once per
// process (daemon start, agent start) and shared by every stream made from it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/buffer.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "rendezvous/error.h"

namespace ddp::rdzv {

// Where the PEM files are; all empty (default) = plain TCP.
struct TlsFiles {
  std::string cert;  // server: its certificate chain (TLS is on when set); client: optional
                     // client certificate, for servers that require one
  std::string key;   // the private key of `cert`
  std::string ca;    // client: the CA that signed the server's certificate (TLS is on when set);
                     // server: when set, clients must present a certificate this CA signed
};

// The loaded certificates and settings (an OpenSSL SSL_CTX). TLS 1.2 or later.
class TlsContext {
 public:
  // The context, or why not when a file cannot be used (missing, unreadable, not PEM, a key
  // that does not match its certificate, a missing partner file): the reason names the option
  // and the file. A server needs cert and key; a client needs ca (the server is always verified).
  static Expected<std::shared_ptr<TlsContext>> for_server(const TlsFiles& files);
  static Expected<std::shared_ptr<TlsContext>> for_client(const TlsFiles& files);
  ~TlsContext();
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit TlsContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Stream {
 public:
  using IoHandler = std::function<void(const boost::system::error_code&, std::size_t)>;
  using DoneHandler = std::function<void(const boost::system::error_code&)>;
  virtual ~Stream() = default;

  // The TLS handshake (a client also checks the server's certificate against its CA and the
  // host it connected to); plain TCP completes at once. Nothing is read or written before.
  virtual void async_handshake(DoneHandler done) = 0;
  virtual void async_read_some(boost::asio::mutable_buffer buffer, IoHandler handler) = 0;
  // Writes the whole buffer.
  virtual void async_write(boost::asio::const_buffer buffer, IoHandler handler) = 0;
  // Writes what the kernel takes right now without blocking; TLS takes nothing (would_block),
  // so that callers fall back to async_write.
  virtual std::size_t write_now(boost::asio::const_buffer buffer, boost::system::error_code& ec) = 0;
  // Closes the socket (no TLS close_notify: the protocol's own messages say goodbye).
  virtual void close() = 0;
  virtual boost::asio::ip::tcp::socket& socket() = 0;
  virtual bool tls() const = 0;
};

// Wraps a connected socket. `tls` null = plain TCP. `host` (client side) is what the server's
// certificate must name: a DNS name or an IP address, as in the endpoint.
std::unique_ptr<Stream> make_server_stream(boost::asio::ip::tcp::socket socket, const std::shared_ptr<TlsContext>& tls);
std::unique_ptr<Stream> make_client_stream(boost::asio::ip::tcp::socket socket, const std::shared_ptr<TlsContext>& tls,
                                           const std::string& host);

// A TLS handshake failure as a sentence with a hint: "the server's certificate is not signed by
// tls_ca (certificate verify failed)", "the peer does not speak TLS (wrong version number)".
std::string describe_tls_failure(const boost::system::error_code& ec, bool client);

}  // namespace ddp::rdzv
