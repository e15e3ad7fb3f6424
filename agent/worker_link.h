// The agent's end of one worker's channel (in-memory restart, contracts/worker_channel.h): reads
// the worker's frames as they come and sends it a standby assignment (agent/standby.h) when it is
// parked. A bad frame or a read error closes the link and is reported once; nothing is thrown.
//
// Owned by the agent's Worker (a shared_ptr: a pending read keeps it alive); lives as long as
// the worker, across rounds, until close(). Every call and handler runs on the agent's
// io_context thread.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include "contracts/worker_channel.h"

namespace ddp::agent {

// The agent's code names the contract's types as its own.
using contracts::kWorkerFdVariable;
using contracts::kWorkerHeaderSize;
using contracts::WorkerChannelDecoder;
using contracts::WorkerMessage;

class WorkerLink : public std::enable_shared_from_this<WorkerLink> {
 public:
  struct Handlers {
    std::function<void(const WorkerMessage&)> on_message;
    // A frame broke the rules, or reading failed; the link is closed when this runs.
    std::function<void(const std::string& problem)> on_error;
    // The worker's end was closed (it exited); the link is closed when this runs.
    std::function<void()> on_closed;
  };

  // Takes `fd`, the agent's end (close-on-exec). `worker_fd` is the number of the worker's end
  // in the worker (DDPLAUNCH_WORKER_FD).
  WorkerLink(boost::asio::io_context& io, int fd, int worker_fd);
  ~WorkerLink();
  WorkerLink(const WorkerLink&) = delete;
  WorkerLink& operator=(const WorkerLink&) = delete;

  void start(Handlers handlers);
  // Sends an assignment (`message`, from encode_assignment) with the worker's stdout and stderr
  // attached; the part the socket does not take at once follows when it is writable. False with
  // `why` when nothing could be sent (the worker is gone).
  bool send(const std::string& message, int stdout_fd, int stderr_fd, std::string& why);
  // Stops reading and closes the agent's end; no handler runs after this.
  void close();
  bool is_open() const { return open_; }
  int worker_fd() const { return worker_fd_; }

 private:
  void wait_readable();
  void read_available();
  void fail(const std::string& problem);

  boost::asio::posix::stream_descriptor socket_;
  int worker_fd_;
  bool open_ = true;
  Handlers handlers_;
  WorkerChannelDecoder decoder_;
};

}  // namespace ddp::agent
