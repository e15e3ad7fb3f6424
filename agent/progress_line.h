// The progress line of ddplaunch's waits: what a wait waits for and how long is
// left ("job j: 1 of 2 nodes joined; join_timeout in 587 s"). On a terminal it is one line
// redrawn in place; in a log (stderr is a file or a pipe) it is a line at most every
// `log_interval` seconds, and at once when the wait changes (its key: counts, phase).
//
// Every other line of the agent goes through line() (say() does), which erases a drawn progress
// line first and draws it again after, so that lines never mix. The process-wide one writes to
// stderr through OutputQueue::console(). Not thread-safe: the agent's thread only (and main's
// before the agent runs, which is the same thread).
#pragma once

#include <functional>
#include <string>

namespace ddp::agent {

class ProgressLine {
 public:
  // `write` takes each chunk for the console; `terminal`: redraw in place; `width`: the
  // terminal's columns (a longer line is cut, or it would wrap and break the redraw).
  ProgressLine(std::function<void(std::string)> write, bool terminal, double log_interval = 5.0,
               std::size_t width = 100);

  // Shows `text` for the wait `key` at `now` (seconds on any steady clock). In a log a line is
  // written when the key changed or log_interval has passed since the last one. With
  // `in_place` false (workers are running and write to the same terminal) a terminal is treated
  // like a log.
  void show(const std::string& key, const std::string& text, double now, bool in_place = true);
  // The wait is over: erases a drawn line. The next show() writes at once, whatever its key.
  void clear();
  // Writes `text` (whole lines, ending in '\n') as a line of its own.
  void line(const std::string& text);
  // While held, lines wait, and release() writes them in order: the stacks that hung workers
  // write to a console they share are not cut by the agent's own lines.
  void hold() { held_ = true; }
  void release();

  bool terminal() const { return terminal_; }

  // The one for stderr: a terminal when stderr is a tty and TERM is not "dumb".
  static ProgressLine& console();

 private:
  void erase();

  std::function<void(std::string)> write_;
  bool terminal_;
  double log_interval_;
  std::size_t width_;
  std::string key_;       // of the wait shown last ("" after clear())
  std::string drawn_;     // the text on the terminal's last line ("" when none)
  double last_logged_ = -1e300;
  bool held_ = false;
  std::string held_lines_;
};

}  // namespace ddp::agent
