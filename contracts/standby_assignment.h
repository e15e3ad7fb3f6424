// The standby assignment: the message that turns a waiting process (a standby, or a worker parked
// after an abandoned round) into a worker of a round. The agent writes it (agent/standby.h sends
// it); the worker SDK (worker_sdk/src/standby.cpp) and the Python bootstrap
// (python/ddplaunch_standby.py, decode) read it. contracts/fixtures/assignment.bin is one, and
// both the C++ and the Python tests decode it.
//
// The message, on a SOCK_STREAM Unix socket:
//   bytes 0-3   magic "DDPS"
//   bytes 4-7   version, unsigned 32-bit little endian (kStandbyVersion)
//   bytes 8-11  payload length N, unsigned 32-bit little endian, 2 <= N <= kMaxStandbyPayload
//   N bytes     JSON object {"env": {NAME: VALUE, ...}, "cwd": "/absolute/dir"}: the worker's
//               whole environment and working directory (no other key), nested no deeper than
//               kMaxAssignmentDepth
// and with the first byte, in SCM_RIGHTS, exactly two descriptors: the worker's stdout and
// stderr. Names are non-empty, without '=' or NUL; values without NUL (execve's rules).
// Pure functions, no state, any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "contracts/frame_header.h"

namespace ddp::contracts {

constexpr std::string_view kStandbyMagic = "DDPS";
constexpr std::uint32_t kStandbyVersion = 1;
constexpr std::size_t kStandbyHeaderSize = kFrameHeaderSize;
// Linux caps one environment string at 128 KiB and argv + environment at about 2 MiB (a quarter
// of the stack limit); 4 MiB of JSON holds any environment execve would take.
constexpr std::size_t kMaxStandbyPayload = 4u << 20;
// An object of objects: the payload, then env.
constexpr int kMaxAssignmentDepth = 2;
// The variable that names the standby's end of the socket (a decimal descriptor number).
constexpr const char* kStandbyFdVariable = "DDPLAUNCH_STANDBY_FD";

struct StandbyAssignment {
  std::map<std::string, std::string> env;  // the complete environment of the worker
  std::string cwd;                          // absolute
};

// The message for `a` (header and payload). Throws std::invalid_argument when `a` breaks the
// rules above (a name with '=', a NUL, a relative cwd, a payload over the limit).
std::string encode_assignment(const StandbyAssignment& a);

// Decodes a whole message; nullopt with `error` saying what was wrong.
std::optional<StandbyAssignment> decode_assignment(std::string_view message, std::string& error);

// The payload length a message's first kStandbyHeaderSize bytes announce, when they start with
// the magic; nullopt otherwise (decode_assignment then says what is wrong). For a reader that
// takes the header first and must bound what it reads next.
std::optional<std::uint32_t> announced_length(std::string_view header);

}  // namespace ddp::contracts
