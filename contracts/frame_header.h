// The header of every socket message between the agent and its workers (the standby assignment,
// contracts/standby_assignment.h; the worker channel, contracts/worker_channel.h): a 4-byte
// magic, then a version and the payload's length, each an unsigned 32-bit little-endian number.
// Header-only, pure functions. The Python side's copy is FRAME_HEADER in
// python/ddplaunch_standby.py; contracts/fixtures/ holds frames both sides are tested against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::contracts {

// Magic (4 bytes), version, length.
constexpr std::size_t kFrameHeaderSize = 12;

inline void put_u32_le(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// REQUIRES: at + 4 <= in.size().
inline std::uint32_t get_u32_le(std::string_view in, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return v;
}

// REQUIRES: magic.size() == 4.
inline std::string frame_header(std::string_view magic, std::uint32_t version, std::uint32_t length) {
  std::string out(magic.substr(0, 4));
  put_u32_le(out, version);
  put_u32_le(out, length);
  return out;
}

}  // namespace ddp::contracts
