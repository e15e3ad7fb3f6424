// Standby workers: a process per local rank that is started, and has loaded what it can
// (`import torch`), before the round it will serve exists, and waits for its assignment on a
// socket it was given (DDPLAUNCH_STANDBY_FD). The assignment's format and codec are a contract
// with the workers (contracts/standby_assignment.h); this file holds the agent's sending side.
// The agent decides when standbys start and which one a worker becomes (agent.cpp).
//
// The message is sent once, after which the agent closes its end (with in-memory restart, an SDK
// standby's socket stays open as its worker's channel, and a parked worker gets the same message
// there for each later round: contracts/worker_channel.h). One blocking-free send; no state.
#pragma once

#include <string>

#include "contracts/standby_assignment.h"

namespace ddp::agent {

// The agent's code names the contract's types as its own.
using contracts::encode_assignment;
using contracts::kStandbyFdVariable;
using contracts::StandbyAssignment;

// Sends `message` (from encode_assignment) with `stdout_fd` and `stderr_fd` attached on
// `socket_fd` without blocking. Returns how many bytes went (>= 1: the descriptors went with the
// first), or -1 with errno (EPIPE/ECONNRESET: the standby is gone; EAGAIN cannot happen on a
// fresh socket's first byte). The caller writes the rest, if any, when the socket is writable.
long send_assignment(int socket_fd, const std::string& message, int stdout_fd, int stderr_fd);

}  // namespace ddp::agent
