// Descriptor hygiene between fork and exec. The first two are async-signal-safe: they run in a
// child of the (possibly multi-threaded) agent, applying the spawner's rules (agent/spawn.h).
#pragma once

namespace ddp::agent {

// Marks every descriptor >= `first` close-on-exec, so that exec closes whatever the agent
// holds (sockets of the rendezvous, pipes, log files) however it was opened; descriptors
// stay usable until exec (the spawner reports an exec's failure through one of them).
void cloexec_fds_from(int first);

// Closes every descriptor >= `first` except `keep` (-1: none).
void close_fds_from(int first, int keep);

// In the agent itself (not async-signal-safe): marks every open descriptor >= 3 close-on-exec,
// so that none leaks into anything the agent process executes, whoever opened it (Asio opens
// sockets without SOCK_CLOEXEC; ddplaunch may have inherited descriptors from its parent).
void mark_open_fds_cloexec();

}  // namespace ddp::agent
