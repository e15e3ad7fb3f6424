#include "agent/tee_pipe.h"

#include <unistd.h>

#include <cerrno>

namespace asio = boost::asio;

namespace ddp::agent {

TeePipe::TeePipe(asio::io_context& io, int read_fd, int file_fd, std::shared_ptr<OutputQueue> files, LineSinks sinks)
    : pipe_(io, read_fd),
      file_fd_(file_fd),
      files_(std::move(files)),
      sinks_(std::move(sinks)),
      splitter_([this](std::string_view line) { emit_line(line); }) {}

void TeePipe::start() {
  boost::system::error_code ignored;
  pipe_.non_blocking(true, ignored);
  wait_readable();
}

void TeePipe::drain_and_close() {
  if (closed_) return;
  read_available(64);  // bounded: a grandchild may write forever
  close();
}

// We wait for readability and read ourselves (rather than async_read_some) so that a drain
// never races with a read the reactor already performed into our buffer.
void TeePipe::wait_readable() {
  pipe_.async_wait(asio::posix::descriptor_base::wait_read,
                   [self = shared_from_this()](const boost::system::error_code& ec) {
                     if (self->closed_ || ec) return;
                     if (self->read_available()) self->wait_readable();
                   });
}

// Reads until the pipe is empty, or at most `max_reads` buffers: a worker that writes without
// pause must not keep the event loop (heartbeats) from its other work; the next wait fires at
// once for the rest. Returns false at end of file (and closes).
bool TeePipe::read_available(int max_reads) {
  const int fd = pipe_.native_handle();
  for (int reads = 0; reads < max_reads; ++reads) {
    ssize_t n = ::read(fd, buffer_.data(), buffer_.size());
    if (n > 0) {
      consume(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    close();  // end of file, or an error we cannot recover from
    return false;
  }
  return true;
}

void TeePipe::consume(std::size_t n) {
  if (file_fd_ >= 0) files_->write(file_fd_, std::string(buffer_.data(), n));
  splitter_.feed(std::string_view(buffer_.data(), n));
}

void TeePipe::emit_line(std::string_view line) {
  if (sinks_.tail) sinks_.tail->add(line);
  if (sinks_.console_fd < 0 && sinks_.filtered_fd < 0) return;
  if (sinks_.dedup && sinks_.console_fd >= 0) {
    sinks_.dedup->add(sinks_.console_fd, sinks_.rank, sinks_.prefix, line);
    if (sinks_.filtered_fd < 0) return;
  }
  std::string out;
  out.reserve(sinks_.prefix.size() + line.size() + 1);
  out += sinks_.prefix;
  out += line;
  if (out.back() != '\n') out += '\n';
  if (sinks_.filtered_fd >= 0 && matches_any(line, sinks_.filters)) files_->write(sinks_.filtered_fd, out);
  // One write per line: lines never interleave mid-line.
  if (sinks_.console_fd >= 0 && !sinks_.dedup) OutputQueue::console().write(sinks_.console_fd, std::move(out));
}

void TeePipe::close() {
  if (closed_) return;
  closed_ = true;
  splitter_.finish();
  boost::system::error_code ignored;
  pipe_.close(ignored);
  if (file_fd_ >= 0) files_->close_after(file_fd_);
  file_fd_ = -1;
}

}  // namespace ddp::agent
