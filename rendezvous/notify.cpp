// systemd's service protocol: readiness and the watchdog (rendezvous/notify.h).
#include "rendezvous/notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

namespace ddp::rdzv {

std::string notify_systemd(const std::string& state) {
  const char* name = std::getenv("NOTIFY_SOCKET");
  if (name == nullptr || *name == '\0') return "";
  const std::string path = name;
  const std::string where = "NOTIFY_SOCKET=" + path + ": ";
  if (path[0] != '/' && path[0] != '@') {
    // systemd also knows vsock:CID:PORT (virtual machines); a daemon in a VM guest has no use
    // for it here.
    return where + "not a unix socket path (expected /PATH or @ABSTRACT)";
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() > sizeof addr.sun_path - (path[0] == '/' ? 1 : 0)) {
    return where + "name longer than " + std::to_string(sizeof addr.sun_path - 1) + " bytes";
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  // An abstract name starts with a NUL byte and is exactly as long as given (no terminator).
  if (path[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + (path[0] == '/' ? 1 : 0));

  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return where + "socket: " + std::strerror(errno);
  ssize_t sent;
  do {
    sent = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&addr), length);
  } while (sent < 0 && errno == EINTR);
  const int error = errno;
  ::close(fd);
  if (sent < 0) return where + "send: " + std::strerror(error);
  if (static_cast<std::size_t>(sent) != state.size()) return where + "send: the message was cut short";
  return "";
}

std::chrono::microseconds systemd_watchdog_interval() {
  const char* usec = std::getenv("WATCHDOG_USEC");
  if (usec == nullptr || *usec == '\0') return std::chrono::microseconds(0);
  if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && *pid != '\0') {
    char* end = nullptr;
    const long long value = std::strtoll(pid, &end, 10);
    if (*end != '\0' || value != static_cast<long long>(::getpid())) return std::chrono::microseconds(0);
  }
  char* end = nullptr;
  const long long value = std::strtoll(usec, &end, 10);
  if (*end != '\0' || value <= 0) return std::chrono::microseconds(0);
  return std::chrono::microseconds(value);
}

SystemdWatchdog::SystemdWatchdog(boost::asio::io_context& io, std::function<void(const std::string&)> log)
    : timer_(io), period_(systemd_watchdog_interval() / 2), log_(std::move(log)) {
  if (period_.count() > 0) schedule();
}

void SystemdWatchdog::stop() { timer_.cancel(); }

void SystemdWatchdog::schedule() {
  timer_.expires_after(period_);
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;  // operation_aborted: stopping
    if (auto error = notify_systemd("WATCHDOG=1"); !error.empty() && !error_logged_) {
      error_logged_ = true;  // once: a broken socket would otherwise log at every beat
      if (log_) log_("cannot send the systemd watchdog keep-alive: " + error);
    }
    schedule();
  });
}

}  // namespace ddp::rdzv
