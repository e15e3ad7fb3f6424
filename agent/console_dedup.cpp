#include "agent/console_dedup.h"

#include "agent/logs.h"

namespace asio = boost::asio;

namespace ddp::agent {

ConsoleDedup::ConsoleDedup(asio::io_context& io, std::chrono::milliseconds window) : core_(window), timer_(io) {}

void ConsoleDedup::add(int fd, int rank, std::string_view prefix, std::string_view line) {
  const auto now = std::chrono::steady_clock::now();
  core_.add(fd, rank, prefix, line, now);
  write(core_.take(now));
  arm();
}

void ConsoleDedup::flush() {
  write(core_.take_all());
  timer_.cancel();
  armed_ = false;
}

void ConsoleDedup::write(std::vector<ConsoleLine> lines) {
  for (auto& l : lines) OutputQueue::console().write(l.fd, std::move(l.text));
}

// One timer, set to the end of the earliest window still running; set again when it fires or
// when that changed.
void ConsoleDedup::arm() {
  const auto next = core_.next_deadline(std::chrono::steady_clock::now());
  if (!next) {
    if (armed_) timer_.cancel();
    armed_ = false;
    return;
  }
  if (armed_ && timer_.expiry() == *next) return;
  armed_ = true;
  timer_.expires_at(*next);
  timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (!self || ec) return;
    self->armed_ = false;
    self->write(self->core_.take(std::chrono::steady_clock::now()));
    self->arm();
  });
}

}  // namespace ddp::agent
