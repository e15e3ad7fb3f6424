// The Asio shell of LineDedup (line_dedup.h): the tee pipes of a node's workers hand it their
// console lines; it writes what is ready through the console queue and wakes itself when the
// oldest held line's window ends. Used on the agent's io_context thread only; shared by the
// pipes, so it outlives the agent's state as they may.
#pragma once

#include <chrono>
#include <memory>
#include <string_view>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "agent/line_dedup.h"

namespace ddp::agent {

class ConsoleDedup : public std::enable_shared_from_this<ConsoleDedup> {
 public:
  ConsoleDedup(boost::asio::io_context& io, std::chrono::milliseconds window);

  // The ranks whose console lines on `fd` come here from now on (a new round's workers).
  void expect(int fd, std::vector<int> ranks) { core_.expect(fd, std::move(ranks)); }
  void add(int fd, int rank, std::string_view prefix, std::string_view line);
  // Writes every held line now: before the agent's own lines about the workers (a failure, the
  // summary) and at exit, so that a worker's last words come before what the agent says of them.
  void flush();

 private:
  void write(std::vector<ConsoleLine> lines);
  void arm();

  LineDedup core_;
  boost::asio::steady_timer timer_;
  bool armed_ = false;
};

}  // namespace ddp::agent
