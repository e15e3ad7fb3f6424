// Where worker output goes: log file layout, the console line prefix of tee'd output, and the
// splitter that turns pipe reads into whole lines. Pure functions and a small value class.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace ddp::agent {

// torchrun's Std bits: 1 stdout, 2 stderr, 3 both.
enum StdBits : int { kStdNone = 0, kStdOut = 1, kStdErr = 2, kStdAll = 3 };

// <log_dir>/<run_id>/attempt_<attempt>/<local_rank>: the directory of one worker's
// stdout.log, stderr.log and error.json.
std::string worker_log_dir(const std::string& log_dir, const std::string& run_id, int attempt,
                           int local_rank);

// The console prefix of a tee'd line: "[<role><local_rank>]:" by default, or `templ`
// (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE) with ${role_name}, ${rank}, ${local_rank} replaced.
std::string line_prefix(const std::string& templ, const std::string& role, int rank, int local_rank);

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
