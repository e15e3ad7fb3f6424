// A bare blocking TCP connection speaking (or abusing) the wire protocol, for tests that need
// to misbehave: crash without leaving, stay silent, send garbage. POSIX sockets, loopback only.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "rendezvous/protocol.h"

namespace ddp::rdzv::test {

class RawConn {
 public:
  explicit RawConn(unsigned short port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~RawConn() { close(); }
  RawConn(const RawConn&) = delete;
  RawConn& operator=(const RawConn&) = delete;

  bool connected() const { return connected_; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool send_bytes(const std::string& bytes) {
    std::size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<std::size_t>(n);
    }
    return true;
  }
  bool send(const nlohmann::json& message) { return send_bytes(*encode_frame(message)); }
  bool send_raw_payload(const std::string& payload) {
    unsigned char h[4];
    write_frame_header(static_cast<std::uint32_t>(payload.size()), h);
    return send_bytes(std::string(reinterpret_cast<char*>(h), 4) + payload);
  }

  // The next message, or nullopt on close/timeout (closed() then says which).
  std::optional<nlohmann::json> recv(double timeout_s = 5.0) {
    unsigned char h[4];
    if (!read_exact(reinterpret_cast<char*>(h), 4, timeout_s)) return std::nullopt;
    std::string body(read_frame_header(h), '\0');
    if (!read_exact(body.data(), body.size(), timeout_s)) return std::nullopt;
    return nlohmann::json::parse(body);
  }
  // Receives until a message of `type` (skipping heartbeat acks and others).
  std::optional<nlohmann::json> recv_type(const std::string& type, double timeout_s = 5.0) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (true) {
      double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) return std::nullopt;
      auto m = recv(left);
      if (!m) return std::nullopt;
      if ((*m)["type"] == type) return m;
    }
  }
  // True when the server closed the connection within the timeout.
  bool wait_closed(double timeout_s = 5.0) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    char buf[4096];
    while (true) {
      int left = static_cast<int>(
          std::chrono::duration<double, std::milli>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) continue;
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return true;
    }
  }
  bool closed_by_peer() const { return eof_; }

 private:
  bool read_exact(char* out, std::size_t n, double timeout_s) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    std::size_t got = 0;
    while (got < n) {
      int left = static_cast<int>(
          std::chrono::duration<double, std::milli>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) continue;
      ssize_t r = ::recv(fd_, out + got, n - got, 0);
      if (r <= 0) {
        eof_ = true;
        return false;
      }
      got += static_cast<std::size_t>(r);
    }
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  bool eof_ = false;
};

}  // namespace ddp::rdzv::test
