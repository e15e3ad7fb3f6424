// Where worker output goes: log file layout, the console line prefix of tee'd output, the
// splitter that turns pipe reads into whole lines, the duplicate filters, the tail of a
// worker's stderr, and the bounded output queue that keeps slow destinations off the event
// loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::agent {

// torchrun's Std bits: 1 stdout, 2 stderr, 3 both.
enum StdBits : int { kStdNone = 0, kStdOut = 1, kStdErr = 2, kStdAll = 3 };

// <log_dir>/<run_id>/attempt_<attempt>/<local_rank>: the directory of one worker's
// stdout.log, stderr.log and error.json.
std::string worker_log_dir(const std::string& log_dir, const std::string& run_id, int attempt,
                           int local_rank);

// The console prefix of a tee'd line: "[<role><local_rank>]:" by default, or `templ`
// (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE) with ${role_name}, ${rank}, ${local_rank} replaced,
// and ${hostname} (our addition: the node's name, as the failure summary shows it).
std::string line_prefix(const std::string& templ, const std::string& role, int rank, int local_rank,
                        const std::string& hostname = "");

// Splits a byte stream into whole lines. feed() calls `on_line` with each complete line
// (including its '\n'); finish() hands over what is left (without a newline) at end of stream.
// A line longer than `max_line` is handed over in pieces of that size so memory stays bounded.
class LineSplitter {
 public:
  using LineHandler = std::function<void(std::string_view line)>;
  explicit LineSplitter(LineHandler on_line, std::size_t max_line = 1 << 20)
      : on_line_(std::move(on_line)), max_line_(max_line) {}
  void feed(std::string_view data);
  void finish();
  std::size_t pending() const { return partial_.size(); }

 private:
  LineHandler on_line_;
  std::size_t max_line_;
  std::string partial_;
};

}  // namespace ddp::agent

namespace ddp::agent {

// Lines of worker output copied into <attempt dir>/filtered_{stdout,stderr}.log: those that
// contain any of `filters` as a plain substring (torchrun's --duplicate-*-filters rule).
bool matches_any(std::string_view line, const std::vector<std::string>& filters);

// The last lines of one stream, bounded by line count and by bytes (the oldest go first).
// Kept for each worker's stderr so that a failure summary can show them when the worker
// wrote no error file. A value class, used on the agent's thread.
class LineTail {
 public:
  explicit LineTail(std::size_t max_lines = 20, std::size_t max_bytes = 4096)
      : max_lines_(max_lines), max_bytes_(max_bytes) {}
  void add(std::string_view line);
  // The kept lines, each ending in '\n'; empty when there are none.
  std::string text() const;

 private:
  std::size_t max_lines_, max_bytes_, bytes_ = 0;
  std::deque<std::string> lines_;
};

// The last lines of the file at `path` (reads at most its last `max_bytes`), as LineTail
// keeps them; empty when the file cannot be read.
std::string tail_of_file(const std::string& path, std::size_t max_lines = 20, std::size_t max_bytes = 4096);

// A bounded queue of writes drained by a thread of its own, so that a destination that does
// not keep up (a console pipe nobody reads, a hung file system) never blocks the agent's event
// loop: its heartbeats keep flowing whatever happens to its output. When `capacity` bytes are
// waiting, further writes are dropped and counted; the next write that fits is preceded by a
// line saying how many were dropped. Closing a descriptor is queued behind its writes.
//
// Thread-safe (one mutex guards the queue). The writer thread is started on first use and
// detached: a destination that never takes its data (a pipe nobody reads) must not keep the
// process from exiting; flush() waits with a deadline.
class OutputQueue {
 public:
  // `what` names the destination in the dropped-lines notice ("the console").
  OutputQueue(std::string what, std::size_t capacity);
  ~OutputQueue();
  OutputQueue(const OutputQueue&) = delete;
  OutputQueue& operator=(const OutputQueue&) = delete;

  // Queues `data` (one line, or a chunk of a log file) for `fd`. Returns false when it was
  // dropped because the queue is full.
  bool write(int fd, std::string data);
  // Closes `fd` once everything queued before is written. Never dropped.
  void close_after(int fd);
  // Waits until everything queued is written, at most `timeout`. Returns whether it was.
  bool flush(std::chrono::milliseconds timeout);
  // Writes dropped so far.
  std::uint64_t dropped() const;

  // The process-wide queue of the console (descriptors 1 and 2): the agent's own messages
  // and tee'd worker output. Never destroyed (its thread may be stuck in a write at exit).
  static OutputQueue& console();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Writes "ddplaunch: <line>\n" to stderr through OutputQueue::console(): the agent's voice.
void say(const std::string& line);

}  // namespace ddp::agent
