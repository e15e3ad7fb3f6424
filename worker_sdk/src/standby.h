// Standby workers for SDK programs (docs/agent.md, "Standby workers"). With
// `--standby=on`, ddplaunch starts a program that links this SDK before the round it will serve
// exists, with DDPLAUNCH_STANDBY_FD naming one end of a Unix socket. The program loads (libtorch,
// its own start-up) and runs until it first reads the worker environment; there, the SDK waits
// for the agent's assignment (contracts/standby_assignment.h: the whole environment, the working directory, and
// stdout/stderr as descriptors), applies it, and goes on as a freshly started worker would.
// Private to the SDK: WorkerEnv::from_environment() and Progress call it.
//
// The same socket, or a fresh one for a worker that started cold, stays the worker's channel to
// its agent when in-memory restart is on (DDPLAUNCH_WORKER_FD; contracts/worker_channel.h): the
// Trainer says there whether it can restart in memory, parks on it after an abandoned round, and
// takes the next round's assignment from it.
#pragma once

#include <cstdint>

namespace ddp::detail {

// When this process is a standby (DDPLAUNCH_STANDBY_FD is set), blocks until its assignment
// came and is applied; otherwise returns at once. Runs once per process (later calls return at
// once); thread-safe. A socket closed before an assignment came (the agent is stopping) ends
// the process with exit code 0, an assignment that is not valid with 1 and a line on stderr:
// in neither case does anything after this call run.
void take_standby_assignment();

// The worker's channel to its agent (DDPLAUNCH_WORKER_FD, checked to be a socket), or -1 when
// ddplaunch gave none (in-memory restart off, another launcher, a run by hand).
int worker_channel();

// Tells the agent whether, at its next restart, it may leave this worker alive to park (true)
// or must stop it as any worker (false). False when there is no channel or the agent is gone.
bool tell_restartable(bool value);

// Tells the agent that this worker holds its training state at `step` (-1: none) and waits for
// the next round's assignment on the channel, then applies it as a standby applies its first
// (environment, working directory, stdout and stderr). SIGTERM, the agent's way of stopping a
// parked worker, ends the process while it waits; so does an agent that is gone (exit code 0)
// and an assignment that is not valid (exit code 1, with a line on stderr).
// REQUIRES: worker_channel() >= 0.
void park(int64_t step);

// While on (the Trainer's rounds, when it can restart in memory), a collective that finds its
// round abandoned by the agent throws RoundAbandoned instead of ending the process. Any thread.
void allow_parking(bool on);
bool parking_allowed();

}  // namespace ddp::detail
