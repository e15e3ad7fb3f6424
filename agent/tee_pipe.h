// One stream of one worker that passes through the agent (--tee, or --log_dedup): raw bytes to
// its log file when it has one, whole prefixed lines to the console (both through bounded
// queues: a stalled destination never blocks the event loop; with --log_dedup through
// ConsoleDedup first), matching lines to the attempt's filtered file, the last lines to the
// failure summary's tail.
//
// Created by Agent::Impl when it starts a worker whose stream passes through it; shared by the pending
// read (which keeps it alive) and the worker that owns it, so it may outlive the agent's state.
// Used on the agent's io_context thread only.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include "agent/console_dedup.h"
#include "agent/logs.h"

namespace ddp::agent {

// Where the lines of one tee'd stream go besides its log file. Shared with the TeePipe, so it
// stays valid however long the pipe outlives the agent's state.
struct LineSinks {
  int console_fd = -1;                 // STDOUT/STDERR, or -1 when not shown (--local_ranks_filter)
  std::string prefix;                  // of console lines and of filtered lines
  int filtered_fd = -1;                // <attempt dir>/filtered_<stream>.log, or -1
  std::vector<std::string> filters;    // --duplicate-<stream>-filters
  std::shared_ptr<LineTail> tail;      // the stderr tail of the failure summary, or null
  std::shared_ptr<ConsoleDedup> dedup; // --log_dedup: console lines go through it, or null
  int rank = -1;                       // the worker's global rank, for dedup
};

class TeePipe : public std::enable_shared_from_this<TeePipe> {
 public:
  // Takes `read_fd` (the pipe's read end) and `file_fd` (the log file, closed through `files`).
  TeePipe(boost::asio::io_context& io, int read_fd, int file_fd, std::shared_ptr<OutputQueue> files, LineSinks sinks);
  ~TeePipe() { close(); }

  void start();
  // Reads what the pipe already holds without waiting, then closes it. Called when the
  // worker has exited: its last output is in the pipe even if our wait has not fired yet, but
  // a grandchild may keep the pipe open, so we do not wait for end of file.
  void drain_and_close();

 private:
  void wait_readable();
  bool read_available(int max_reads = 16);
  void consume(std::size_t n);
  void emit_line(std::string_view line);
  void close();

  boost::asio::posix::stream_descriptor pipe_;
  int file_fd_;
  std::shared_ptr<OutputQueue> files_;
  LineSinks sinks_;
  LineSplitter splitter_;
  std::array<char, 32768> buffer_{};
  bool closed_ = false;
};

}  // namespace ddp::agent
