#include "agent/progress_line.h"

#include <string>

namespace ddp::agent {

namespace {
// Erases the terminal's current line: back to its start, then clear to its end.
constexpr const char* kEraseLine = "\r\033[K";
}  // namespace

ProgressLine::ProgressLine(std::function<void(std::string)> write, bool terminal, double log_interval,
                           std::size_t width)
    : write_(std::move(write)), terminal_(terminal), log_interval_(log_interval), width_(width < 20 ? 20 : width) {}

void ProgressLine::show(const std::string& key, const std::string& text, double now, bool in_place) {
  const bool changed = key != key_;
  key_ = key;
  if (terminal_ && in_place) {
    std::string shown = "ddplaunch: " + text;
    if (shown.size() > width_ - 1) shown = shown.substr(0, width_ - 4) + "...";
    if (shown == drawn_) return;
    write_(kEraseLine + shown);
    drawn_ = shown;
    return;
  }
  erase();
  if (!changed && now - last_logged_ < log_interval_) return;
  last_logged_ = now;
  write_("ddplaunch: " + text + "\n");
}

void ProgressLine::clear() {
  erase();
  key_.clear();
  last_logged_ = -1e300;
}

void ProgressLine::erase() {
  if (drawn_.empty()) return;
  write_(kEraseLine);
  drawn_.clear();
}

void ProgressLine::line(const std::string& text) {
  if (held_) {
    held_lines_ += text;
    return;
  }
  const std::string drawn = drawn_;
  erase();
  write_(text);
  if (!drawn.empty()) {  // the wait goes on: draw it again below the line
    write_(drawn);
    drawn_ = drawn;
  }
}

void ProgressLine::release() {
  held_ = false;
  if (held_lines_.empty()) return;
  std::string lines;
  lines.swap(held_lines_);
  line(lines);
}

}  // namespace ddp::agent
