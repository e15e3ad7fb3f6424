// Standby workers for SDK programs (issue 13; docs/agent.md, "Standby workers"). With
// `--standby=on`, ddplaunch starts a program that links this SDK before the round it will serve
// exists, with DDPLAUNCH_STANDBY_FD naming one end of a Unix socket. The program loads (libtorch,
// its own start-up) and runs until it first reads the worker environment; there, the SDK waits
// for the agent's assignment (agent/standby.h: the whole environment, the working directory, and
// stdout/stderr as descriptors), applies it, and goes on as a freshly started worker would.
// Private to the SDK: WorkerEnv::from_environment() and Progress call it.
#pragma once

namespace ddp::detail {

// When this process is a standby (DDPLAUNCH_STANDBY_FD is set), blocks until its assignment
// came and is applied; otherwise returns at once. Runs once per process (later calls return at
// once); thread-safe. A socket closed before an assignment came (the agent is stopping) ends
// the process with exit code 0, an assignment that is not valid with 1 and a line on stderr:
// in neither case does anything after this call run.
void take_standby_assignment();

}  // namespace ddp::detail
