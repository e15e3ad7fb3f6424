// The header the agent's socket messages to and from its workers share (the standby assignment,
// agent/standby.h; the worker channel, agent/worker_channel.h): a 4-byte magic, then a version
// and the payload's length, each an unsigned 32-bit little-endian number. Header-only: the worker
// SDK compiles the codecs too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::agent {

inline void put_u32_le(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// REQUIRES: at + 4 <= in.size().
inline std::uint32_t get_u32_le(std::string_view in, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return v;
}

// `magic` (4 bytes), `version`, `length`: 12 bytes.
inline std::string frame_header(std::string_view magic, std::uint32_t version, std::uint32_t length) {
  std::string out(magic.substr(0, 4));
  put_u32_le(out, version);
  put_u32_le(out, length);
  return out;
}

}  // namespace ddp::agent
