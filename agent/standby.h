// Standby workers (issue 13, part 1): a process per local rank that is started, and has loaded
// what it can (`import torch`), before the round it will serve exists, and waits for its
// assignment on a socket it was given (DDPLAUNCH_STANDBY_FD). This file holds the assignment
// message (its codec, shared with python/ddplaunch_standby.py) and the sending side; the agent
// decides when standbys start and which one a worker becomes (agent.cpp).
//
// The message, on a SOCK_STREAM Unix socket, sent once, after which the agent closes its end
// (with in-memory restart, an SDK standby's socket stays open as its worker's channel, and a
// parked worker gets the same message there for each later round: agent/worker_channel.h):
//   bytes 0-3   magic "DDPS"
//   bytes 4-7   version, unsigned 32-bit little endian (kStandbyVersion)
//   bytes 8-11  payload length N, unsigned 32-bit little endian, 2 <= N <= kMaxStandbyPayload
//   N bytes     JSON object {"env": {NAME: VALUE, ...}, "cwd": "/absolute/dir"}: the worker's
//               whole environment and working directory (no other key)
// and with the first byte, in SCM_RIGHTS, exactly two descriptors: the worker's stdout and
// stderr. Names are non-empty, without '=' or NUL; values without NUL (execve's rules).
// Pure functions and one blocking-free send; no state.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace ddp::agent {

constexpr std::uint32_t kStandbyVersion = 1;
constexpr std::size_t kStandbyHeaderSize = 12;
// Linux caps one environment string at 128 KiB and argv + environment at about 2 MiB (a quarter
// of the stack limit); 4 MiB of JSON holds any environment execve would take.
constexpr std::size_t kMaxStandbyPayload = 4u << 20;
// The variable that names the standby's end of the socket (a decimal descriptor number).
constexpr const char* kStandbyFdVariable = "DDPLAUNCH_STANDBY_FD";

struct StandbyAssignment {
  std::map<std::string, std::string> env;  // the complete environment of the worker
  std::string cwd;                          // absolute
};

// The message for `a` (header and payload). Throws std::invalid_argument when `a` breaks the
// rules above (a name with '=', a NUL, a relative cwd, a payload over the limit).
std::string encode_assignment(const StandbyAssignment& a);

// Decodes a whole message; nullopt with `error` saying what was wrong (the standby side's rules,
// written down once in C++ for tests and for the SDK's standby).
std::optional<StandbyAssignment> decode_assignment(std::string_view message, std::string& error);

// The payload length a message's first kStandbyHeaderSize bytes announce, when they start with
// the magic; nullopt otherwise (decode_assignment then says what is wrong). For a reader that
// takes the header first and must bound what it reads next.
std::optional<std::uint32_t> announced_length(std::string_view header);

// Sends `message` with `stdout_fd` and `stderr_fd` attached on `socket_fd` without blocking.
// Returns how many bytes went (>= 1: the descriptors went with the first), or -1 with errno
// (EPIPE/ECONNRESET: the standby is gone; EAGAIN cannot happen on a fresh socket's first byte).
// The caller writes the rest, if any, when the socket is writable.
long send_assignment(int socket_fd, const std::string& message, int stdout_fd, int stderr_fd);

}  // namespace ddp::agent
