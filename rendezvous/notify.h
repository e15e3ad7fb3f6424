// systemd's service protocol (sd_notify) without libsystemd: when a service runs with
// Type=notify, systemd puts the path of a unix datagram socket in $NOTIFY_SOCKET and waits for
// "READY=1" on it before it counts the service as started (and starts what is ordered after it).
// One datagram per call, newline-separated KEY=VALUE lines ("READY=1\nSTATUS=..."). With
// WatchdogSec= systemd also sets $WATCHDOG_USEC and restarts the service when no "WATCHDOG=1"
// arrives within that interval.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

namespace ddp::rdzv {

// Sends `state` to $NOTIFY_SOCKET: an absolute path, or an abstract socket name written with a
// leading '@'. Returns "" when sent or when NOTIFY_SOCKET is unset or empty (not under systemd:
// nothing to do); otherwise what went wrong ("NOTIFY_SOCKET=x: ..."), for the caller to log.
// Never throws, never blocks (a full socket buffer is an error, not a wait). Any thread.
std::string notify_systemd(const std::string& state);

// The watchdog interval systemd asks for: $WATCHDOG_USEC, when set, positive, and meant for this
// process ($WATCHDOG_PID unset or equal to getpid()); zero otherwise.
std::chrono::microseconds systemd_watchdog_interval();

// Sends "WATCHDOG=1" every half interval from the io_context's own thread, so systemd restarts
// the daemon when its event loop stops turning (a hang), not only when the process dies. Does
// nothing when systemd_watchdog_interval() is zero. Owned by main() for the daemon's lifetime;
// runs on the io_context thread; stop() (or the destructor) cancels it.
class SystemdWatchdog {
 public:
  SystemdWatchdog(boost::asio::io_context& io, std::function<void(const std::string&)> log);
  ~SystemdWatchdog() { stop(); }
  SystemdWatchdog(const SystemdWatchdog&) = delete;
  SystemdWatchdog& operator=(const SystemdWatchdog&) = delete;
  void stop();

 private:
  void schedule();
  boost::asio::steady_timer timer_;
  std::chrono::microseconds period_;
  std::function<void(const std::string&)> log_;
  bool error_logged_ = false;
};

}  // namespace ddp::rdzv
