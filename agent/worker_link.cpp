#include "agent/worker_link.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <boost/asio/write.hpp>

#include "agent/standby.h"

namespace asio = boost::asio;

namespace ddp::agent {

WorkerLink::WorkerLink(asio::io_context& io, int fd, int worker_fd) : socket_(io, fd), worker_fd_(worker_fd) {
  boost::system::error_code ignored;
  socket_.non_blocking(true, ignored);
}

WorkerLink::~WorkerLink() { close(); }

void WorkerLink::start(Handlers handlers) {
  handlers_ = std::move(handlers);
  wait_readable();
}

void WorkerLink::wait_readable() {
  socket_.async_wait(asio::posix::descriptor_base::wait_read, [self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || !self->open_) return;
    self->read_available();
  });
}

void WorkerLink::read_available() {
  char buffer[4096];
  std::vector<WorkerMessage> messages;
  std::string problem;
  bool eof = false;
  // Bounded: a worker that writes without pause does not hold the event loop.
  for (int reads = 0; reads < 16; ++reads) {
    const ssize_t n = ::read(socket_.native_handle(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0) {
      problem = std::string("read: ") + std::strerror(errno);
      break;
    }
    if (n == 0) {
      eof = true;
      break;
    }
    if (!decoder_.feed(std::string_view(buffer, static_cast<std::size_t>(n)), messages)) {
      problem = decoder_.error();
      break;
    }
  }
  // A handler may close the link, and the agent drop it: hold it, and call copies.
  auto self = shared_from_this();
  const auto on_message = handlers_.on_message;
  for (const auto& m : messages) {
    if (!open_) return;
    if (on_message) on_message(m);
  }
  if (!open_) return;
  if (!problem.empty()) {
    fail(problem);
  } else if (eof) {
    auto closed = std::move(handlers_.on_closed);
    close();
    if (closed) closed();
  } else {
    wait_readable();
  }
}

void WorkerLink::fail(const std::string& problem) {
  auto on_error = std::move(handlers_.on_error);
  close();
  if (on_error) on_error(problem);
}

bool WorkerLink::send(const std::string& message, int stdout_fd, int stderr_fd, std::string& why) {
  if (!open_) {
    why = "its channel is closed";
    return false;
  }
  const long sent = send_assignment(socket_.native_handle(), message, stdout_fd, stderr_fd);
  if (sent < 0) {
    why = errno == EPIPE || errno == ECONNRESET ? "it has exited" : std::strerror(errno);
    return false;
  }
  if (static_cast<std::size_t>(sent) == message.size()) return true;
  auto rest = std::make_shared<std::string>(message.substr(static_cast<std::size_t>(sent)));
  asio::async_write(socket_, asio::buffer(*rest), [self = shared_from_this(), rest](const boost::system::error_code&, std::size_t) {
    // A worker that does not read its assignment is gone or broken: its exit (or the park
    // deadline of its next restart) deals with it.
  });
  return true;
}

void WorkerLink::close() {
  if (!open_) return;
  open_ = false;
  handlers_ = {};
  boost::system::error_code ignored;
  socket_.cancel(ignored);
  socket_.close(ignored);
}

}  // namespace ddp::agent
