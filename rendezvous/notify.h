// systemd's readiness protocol (sd_notify) without libsystemd: when a service runs with
// Type=notify, systemd puts the path of a unix datagram socket in $NOTIFY_SOCKET and waits for
// "READY=1" on it before it counts the service as started (and starts what is ordered after it).
// One datagram per call, newline-separated KEY=VALUE lines ("READY=1\nSTATUS=..."). Stateless;
// any thread.
#pragma once

#include <string>

namespace ddp::rdzv {

// Sends `state` to $NOTIFY_SOCKET: an absolute path, or an abstract socket name written with a
// leading '@'. Returns "" when sent or when NOTIFY_SOCKET is unset or empty (not under systemd:
// nothing to do); otherwise what went wrong ("NOTIFY_SOCKET=x: ..."), for the caller to log.
// Never throws, never blocks (a full socket buffer is an error, not a wait).
std::string notify_systemd(const std::string& state);

}  // namespace ddp::rdzv
