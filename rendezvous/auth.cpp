#include "rendezvous/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace ddp::rdzv {
namespace {

std::string hex(const unsigned char* data, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[data[i] >> 4];
    out[2 * i + 1] = digits[data[i] & 15];
  }
  return out;
}

std::string trim(std::string s) {
  const char* space = " \t\r\n";
  s.erase(0, s.find_first_not_of(space) == std::string::npos ? s.size() : s.find_first_not_of(space));
  s.erase(s.find_last_not_of(space) + 1);
  return s;
}

Expected<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return unexpected("cannot read the token file " + path + ": " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string random_hex(std::size_t bytes) {
  std::string raw(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1) {
    throw std::runtime_error("OpenSSL RAND_bytes failed: no randomness for the rendezvous nonce");
  }
  return hex(reinterpret_cast<const unsigned char*>(raw.data()), raw.size());
}

std::string pooled_random_hex(std::size_t bytes) {
  thread_local std::array<unsigned char, 4096> pool;
  thread_local std::size_t next = pool.size();
  if (bytes > pool.size()) return random_hex(bytes);
  if (pool.size() - next < bytes) {
    if (RAND_bytes(pool.data(), static_cast<int>(pool.size())) != 1) {
      throw std::runtime_error("OpenSSL RAND_bytes failed: no randomness for a node secret");
    }
    next = 0;
  }
  std::string out = hex(pool.data() + next, bytes);
  OPENSSL_cleanse(pool.data() + next, bytes);
  next += bytes;
  return out;
}

std::string auth_proof(std::string_view secret, std::string_view role, std::string_view server_nonce,
                       std::string_view client_nonce, std::string_view job_id) {
  std::string text = "ddplaunch-rdzv-2\n";
  text.append(role).append("\n").append(server_nonce).append("\n").append(client_nonce).append("\n").append(job_id);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const unsigned char*>(text.data()),
       text.size(), mac, &len);
  return hex(mac, len);
}

std::string seal_key(std::string_view secret, std::string_view server_nonce, std::string_view client_nonce,
                     std::string_view job_id) {
  if (secret.empty()) return {};
  // A role no message carries: the key is never a proof that was sent.
  return auth_proof(secret, "seal", server_nonce, client_nonce, job_id);
}

std::string seal_hex(std::string_view key, std::string_view value) {
  std::string out(value);
  if (key.empty()) return out;
  unsigned char block[EVP_MAX_MD_SIZE];
  unsigned int block_len = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::size_t nibble = i % 64;  // 32 bytes of keystream per block, two digits a byte
    if (nibble == 0) {
      const std::string counter = "ddplaunch-seal-1\n" + std::to_string(i / 64);
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(counter.data()), counter.size(), block, &block_len);
    }
    const char c = out[i];
    int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (v < 0) continue;
    const int k = nibble % 2 == 0 ? block[nibble / 2] >> 4 : block[nibble / 2] & 0xF;
    v ^= k;
    out[i] = "0123456789abcdef"[v];
  }
  return out;
}

bool proofs_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size() || a.empty()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Expected<Secrets> Secrets::load(const std::string& path) {
  Expected<std::string> text = read_file(path);
  if (!text) return unexpected(text.error());
  Secrets s;
  std::istringstream lines(*text);
  std::string line;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::istringstream words(line);
    std::string first, second, extra;
    words >> first >> second >> extra;
    if (!extra.empty()) {
      return unexpected("token file " + path + " line " + std::to_string(number) +
                        ": expected SECRET or JOB_ID SECRET, got more words");
    }
    if (second.empty()) {
      if (!s.cluster_.empty()) {
        return unexpected("token file " + path + " line " + std::to_string(number) +
                          ": a second cluster secret (one-word line); per-job secrets are written JOB_ID SECRET");
      }
      s.cluster_ = first;
    } else {
      s.jobs_[first] = second;
    }
  }
  if (s.open()) return unexpected("token file " + path + " holds no secret");
  return s;
}

std::optional<std::string> Secrets::for_job(const std::string& job_id) const {
  if (!job_id.empty()) {
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) return it->second;
  }
  if (!cluster_.empty()) return cluster_;
  if (open()) return std::string();
  return std::nullopt;
}

bool Secrets::is_cluster_secret(const std::string& job_id) const {
  return open() || job_id.empty() || jobs_.count(job_id) == 0;
}

Expected<std::string> read_secret_file(const std::string& path) {
  Expected<std::string> text = read_file(path);
  if (!text) return text;
  std::string secret = trim(*text);
  if (secret.empty()) return unexpected("the token file " + path + " is empty: write the shared secret into it");
  return secret;
}

}  // namespace ddp::rdzv
