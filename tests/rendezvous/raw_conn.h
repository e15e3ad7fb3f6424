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

#include "rendezvous/auth.h"
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
  // The server's end of a connection accepted from a listening socket: a fake server.
  struct Accepted {
    int fd;
  };
  explicit RawConn(Accepted accepted) : fd_(accepted.fd), connected_(accepted.fd >= 0) {}
  ~RawConn() { close(); }
  RawConn(const RawConn&) = delete;
  RawConn& operator=(const RawConn&) = delete;

  bool connected() const { return connected_; }
  // This connection's key for node secrets (auth.h), after say_hello with a secret.
  std::string seal_key;
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // Sends FIN and keeps reading: what the server writes later is taken, so no RST tells it.
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }
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
  bool send(const Message& message) { return send_bytes(*encode(message)); }
  // Says hello (answering the server's challenge with a proof of `secret` when not empty), like
  // an agent. The welcome (or error) is left to read.
  bool say_hello(const std::string& job_id, const std::string& secret = "", const char* role = "hello") {
    Hello h;
    h.job_id = job_id;
    h.client_nonce = random_hex(16);
    // Without a secret nothing depends on the nonce: hello goes out at once (the challenge is
    // skipped by recv_type later), so a server on the test's own io_context is not waited for.
    if (!secret.empty()) {
      auto challenge = recv_type("challenge");
      if (!challenge) return false;
      h.proof = auth_proof(secret, role, (*challenge)["nonce"].get<std::string>(), h.client_nonce, job_id);
      seal_key = ddp::rdzv::seal_key(secret, (*challenge)["nonce"].get<std::string>(), h.client_nonce, job_id);
    }
    return send(std::string(role) == "status" ? make_status_request(h) : make_hello(h));
  }
  bool send_raw_payload(const std::string& payload) {
    unsigned char h[4];
    write_frame_header(static_cast<std::uint32_t>(payload.size()), h);
    return send_bytes(std::string(reinterpret_cast<char*>(h), 4) + payload);
  }

  // The next message, or nullopt on close/timeout (closed() then says which). Frames are split
  // by the protocol's own FrameReader.
  std::optional<nlohmann::json> recv(double timeout_s = 5.0) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    std::string payload;
    while (true) {
      auto r = reader_.next(payload);
      if (r == FrameReader::Result::frame) return nlohmann::json::parse(payload, nullptr, false);
      if (r == FrameReader::Result::error) return std::nullopt;
      int left = static_cast<int>(
          std::chrono::duration<double, std::milli>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) continue;
      char buf[65536];
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        eof_ = true;
        return std::nullopt;
      }
      reader_.feed(buf, static_cast<std::size_t>(n));
    }
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
  int fd_ = -1;
  bool connected_ = false;
  bool eof_ = false;
  FrameReader reader_{256u << 20};
};

// A client of `job` that sends `forged` after its welcome: the code of the error the server
// answers with, when it then closes the connection; otherwise what went wrong ("no welcome",
// "no error", "CODE, connection left open"). The hostile-client tests expect "bad_message".
inline std::string refusal_after_welcome(int port, const std::string& job, const nlohmann::json& forged) {
  RawConn bad(port);
  bad.say_hello(job);
  if (!bad.recv_type("welcome")) return "no welcome";
  bad.send(forged);
  auto err = bad.recv_type("error");
  if (!err) return "no error";
  const std::string code = (*err)["code"].is_string() ? (*err)["code"].get<std::string>() : (*err)["code"].dump();
  return bad.wait_closed() ? code : code + ", connection left open";
}

}  // namespace ddp::rdzv::test
