// SHA-256 (FIPS 180-4), for the lineage that checkpoints record (ddp/lineage.h: the running
// program's hash). Portable C++; the SDK links no crypto library.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ddp {

// An incremental hash: update() any number of times, then hex_digest() once. Not thread-safe;
// one user at a time.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  // The digest as 64 lowercase hex digits. REQUIRES: called once; no update() after it.
  std::string hex_digest();

 private:
  void compress(const unsigned char* block);

  std::array<uint32_t, 8> state_;
  std::array<unsigned char, 64> block_{};
  size_t used_ = 0;     // bytes of block_ filled
  uint64_t length_ = 0;  // bytes hashed in total
};

std::string sha256_hex(const void* data, size_t size);
inline std::string sha256_hex(const std::string& data) { return sha256_hex(data.data(), data.size()); }

// The hash of a file's contents, read in 1 MiB chunks. Throws ddp::Error naming the path and
// the system error.
std::string sha256_file(const std::string& path);

}  // namespace ddp
