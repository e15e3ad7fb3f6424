// Authentication of the rendezvous protocol (docs/security.md): an HMAC-SHA256 challenge-response
// over nonces, so the shared secret never crosses the wire. No Boost.Asio here.
//
// The server sends a fresh random nonce first (challenge). A client proves it knows the secret
// with proof(secret, "hello" or "status", server_nonce, client_nonce, job_id); the server
// answers welcome with proof(secret, "server", ...) so that the agent knows it talks to the
// real server (a fake one would hand out MASTER_ADDR).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "rendezvous/error.h"

namespace ddp::rdzv {

// `bytes` fresh random bytes from OpenSSL's generator, as lowercase hex.
std::string random_hex(std::size_t bytes = 32);
// The same for many small draws on one thread (a round's node secrets): the bytes come from a
// pool of the thread that OpenSSL's generator refills 4 KiB at a time; each byte is handed out
// once and wiped from the pool. (A process that forks must not draw in both parent and child.)
std::string pooled_random_hex(std::size_t bytes);

// Hex HMAC-SHA256 under `secret` of the role, both nonces and the job id.
std::string auth_proof(std::string_view secret, std::string_view role, std::string_view server_nonce,
                       std::string_view client_nonce, std::string_view job_id);

// A node's resume secret never crosses the wire in clear (docs/security.md, "Resume secrets"):
// the round that issues it and the resume that proves it carry it sealed under a key that only
// the two ends of that one connection can make, from the job's secret and both handshake nonces.
// seal_key() is that key (hex; "" when the job has no secret: nothing to seal with);
// seal_hex() XORs each hex digit of `value` with a keystream of HMAC-SHA256 under the key, so
// the result is hex of the same length, and sealing twice gives `value` back. Digits that are
// not hex are left as they are (the codecs refuse them before this).
std::string seal_key(std::string_view secret, std::string_view server_nonce, std::string_view client_nonce,
                     std::string_view job_id);
std::string seal_hex(std::string_view key, std::string_view value);

// Compares two proofs in time independent of where they differ.
bool proofs_equal(std::string_view a, std::string_view b);

// The secrets a server accepts: one for the whole cluster and/or one per job.
//
// File format (--token_file): lines; `#` starts a comment; a line `JOB_ID SECRET` sets the
// secret of one job; a line holding one word is the cluster secret (used by every job without its
// own). A file holding a single line is therefore also what an agent's token_file holds.
class Secrets {
 public:
  Secrets() = default;
  // A cluster secret only (empty = none).
  explicit Secrets(std::string cluster) : cluster_(std::move(cluster)) {}
  // The secrets of a --token_file, or why not (naming the file and the line): missing,
  // unreadable, malformed or empty.
  static Expected<Secrets> load(const std::string& path);

  void set_cluster(std::string secret) { cluster_ = std::move(secret); }
  void set_job(const std::string& job_id, std::string secret) { jobs_[job_id] = std::move(secret); }
  // True when no secret at all is configured: every client is accepted (docs/security.md).
  bool open() const { return cluster_.empty() && jobs_.empty(); }
  // The secret a client of `job_id` must prove ("" = the cluster's); nullopt when secrets are
  // configured but none applies (the client is refused).
  std::optional<std::string> for_job(const std::string& job_id) const;
  // True when the secret proven for a status query grants every job (not one job's only).
  bool is_cluster_secret(const std::string& job_id) const;

 private:
  std::string cluster_;
  std::map<std::string, std::string> jobs_;
};

// An agent's secret file: the whole file, trailing whitespace removed; or why not (missing,
// unreadable, empty).
Expected<std::string> read_secret_file(const std::string& path);

}  // namespace ddp::rdzv
