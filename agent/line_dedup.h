// --log_dedup: identical console lines of several local ranks, printed within a short window,
// become one line that names the ranks ("[ranks 0-3] epoch 2 loss 0.42"). A pure unit: lines and
// the time come in, lines to write come out; the Asio shell is ConsoleDedup (console_dedup.h).
//
// Each held line is a group: its text and the ranks that printed it. A rank's line joins the
// earliest group with the same text (and stream) that it is not in yet, unless that would put
// the rank's lines out of order: each rank's lines reach the console in the order it printed
// them, stdout and stderr together. So the groups form a graph (a group comes after each of its
// ranks' earlier groups) and are written in an order of that graph, the oldest first where there
// is a choice. A group is ready when every rank that can print it has, or when its window has
// ended, and it is written once its ranks' earlier groups are: a line only one rank prints waits
// out the window (another rank might still print it), and so may the lines after it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ddp::agent {

// One line to write: `fd` is STDOUT_FILENO or STDERR_FILENO, `text` ends with '\n'.
struct ConsoleLine {
  int fd;
  std::string text;
  bool operator==(const ConsoleLine& o) const { return fd == o.fd && text == o.text; }
};

// "0-3", "0,2,5-7": sorted ranks as ranges.
std::string rank_ranges(const std::vector<int>& sorted_ranks);

class LineDedup {
 public:
  using Time = std::chrono::steady_clock::time_point;

  // Lines longer than `max_line` are written alone (nobody collapses a 1 MiB line); the held
  // lines never take more than `max_bytes`: past it, the oldest are written at once.
  explicit LineDedup(std::chrono::milliseconds window, std::size_t max_line = 4096,
                     std::size_t max_bytes = std::size_t{4} << 20);

  // The ranks whose lines on `fd` pass through here: a group holding all of them is ready.
  void expect(int fd, std::vector<int> ranks);

  // A whole line of `rank` on `fd`, with or without its newline; `prefix` is what it carries
  // when it is written alone.
  void add(int fd, int rank, std::string_view prefix, std::string_view line, Time now);

  // The lines that can be written at `now`, in order.
  std::vector<ConsoleLine> take(Time now);
  // Every held line, now (the agent is about to speak of the workers, or to exit).
  std::vector<ConsoleLine> take_all();
  // When take() will have something without a new line: the end of the earliest window still
  // running after `now`; none when nothing waits for one.
  std::optional<Time> next_deadline(Time now) const;
  std::size_t held() const { return groups_.size(); }

 private:
  struct Group {
    int fd;
    std::string text;          // the line, without prefix or newline
    std::string first_prefix;  // the prefix of the first rank, for a line only it printed
    std::vector<int> ranks;    // sorted
    Time deadline;
    bool open;                 // false: takes no other rank (a long line)
  };

  bool ready(std::uint64_t seq, const Group& g, Time now, bool force) const;
  bool after(std::uint64_t later, std::uint64_t earlier) const;
  void emit(std::uint64_t seq, std::vector<ConsoleLine>& out);
  void drain(Time now, bool force, std::vector<ConsoleLine>& out);
  static std::string key(int fd, std::string_view line);
  static std::size_t cost(const Group& g) { return g.text.size() + g.first_prefix.size() + 64; }

  std::chrono::milliseconds window_;
  std::size_t max_line_, max_bytes_;
  std::map<int, std::vector<int>> expected_;   // fd -> sorted ranks
  std::map<std::uint64_t, Group> groups_;      // by seq: the order their first line came
  std::map<int, std::deque<std::uint64_t>> held_;  // rank -> its held groups, in its order
  // fd and text -> the seqs of the held open groups with that line, oldest first.
  std::unordered_map<std::string, std::vector<std::uint64_t>> by_text_;
  std::uint64_t next_seq_ = 1;
  std::size_t bytes_ = 0;
};

}  // namespace ddp::agent
