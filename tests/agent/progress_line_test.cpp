// The progress line of ddplaunch's waits (agent/progress.h): redrawn in place on a terminal, a
// line at most every log_interval seconds in a log, and never mixed with the agent's other lines.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "agent/progress_line.h"

using ddp::agent::ProgressLine;

namespace {

struct Console {
  std::vector<std::string> chunks;
  std::string all() const {
    std::string out;
    for (const auto& c : chunks) out += c;
    return out;
  }
};

}  // namespace

TEST_SUITE("a wait shows its progress in place on a terminal and sparingly in a log") {
  TEST_CASE("on a terminal each update erases the line and draws the new text, without a newline") {
    Console console;
    ProgressLine line([&](std::string c) { console.chunks.push_back(std::move(c)); }, /*terminal=*/true, 5.0, 80);
    line.show("wait 1", "1 of 2 nodes joined; join_timeout in 600 s", 0.0);
    line.show("wait 1", "1 of 2 nodes joined; join_timeout in 599 s", 1.0);
    line.show("wait 1", "1 of 2 nodes joined; join_timeout in 599 s", 1.5);  // unchanged: nothing drawn
    REQUIRE(console.chunks.size() == 2);
    CHECK(console.chunks[0] == "\r\033[Kddplaunch: 1 of 2 nodes joined; join_timeout in 600 s");
    CHECK(console.chunks[1] == "\r\033[Kddplaunch: 1 of 2 nodes joined; join_timeout in 599 s");
    CHECK(console.all().find('\n') == std::string::npos);
  }

  TEST_CASE("on a terminal another line erases the progress line first and draws it again after") {
    Console console;
    ProgressLine line([&](std::string c) { console.chunks.push_back(std::move(c)); }, true, 5.0, 80);
    line.show("connect", "connecting", 0.0);
    console.chunks.clear();
    line.line("ddplaunch: something happened\n");
    REQUIRE(console.chunks.size() == 3);
    CHECK(console.chunks[0] == "\r\033[K");
    CHECK(console.chunks[1] == "ddplaunch: something happened\n");
    CHECK(console.chunks[2] == "ddplaunch: connecting");
    console.chunks.clear();
    line.clear();
    CHECK(console.chunks == std::vector<std::string>{"\r\033[K"});
    console.chunks.clear();
    line.line("after\n");  // nothing drawn any more: the line alone
    CHECK(console.chunks == std::vector<std::string>{"after\n"});
  }

  TEST_CASE("a line longer than the terminal is cut so that it never wraps") {
    Console console;
    ProgressLine line([&](std::string c) { console.chunks.push_back(std::move(c)); }, true, 5.0, 40);
    line.show("k", std::string(100, 'x'), 0.0);
    REQUIRE(console.chunks.size() == 1);
    CHECK(console.chunks[0].size() - 4 < 40);  // minus the erase sequence
    CHECK(console.chunks[0].substr(console.chunks[0].size() - 3) == "...");
  }

  TEST_CASE("in a log a wait writes a line at once, then at most one per interval, and at once when it changes") {
    Console console;
    ProgressLine line([&](std::string c) { console.chunks.push_back(std::move(c)); }, /*terminal=*/false, 5.0);
    line.show("wait 1", "1 of 3 joined; 600 s left", 0.0);
    line.show("wait 1", "1 of 3 joined; 599 s left", 1.0);
    line.show("wait 1", "1 of 3 joined; 596 s left", 4.9);
    line.show("wait 1", "1 of 3 joined; 595 s left", 5.0);
    line.show("wait 2", "2 of 3 joined; 594 s left", 6.0);  // the count changed: at once
    CHECK(console.chunks == std::vector<std::string>{"ddplaunch: 1 of 3 joined; 600 s left\n",
                                                     "ddplaunch: 1 of 3 joined; 595 s left\n",
                                                     "ddplaunch: 2 of 3 joined; 594 s left\n"});
    line.clear();
    line.show("wait 2", "2 of 3 joined; 590 s left", 7.0);  // a new wait after clear(): at once
    CHECK(console.chunks.back() == "ddplaunch: 2 of 3 joined; 590 s left\n");
  }

  TEST_CASE("a wait shown not in place on a terminal (workers write there too) is written like a log") {
    Console console;
    ProgressLine line([&](std::string c) { console.chunks.push_back(std::move(c)); }, true, 5.0, 80);
    line.show("reconnect", "reconnecting, attempt 1", 0.0, /*in_place=*/false);
    line.show("reconnect", "reconnecting, attempt 2", 1.0, false);
    CHECK(console.chunks == std::vector<std::string>{"ddplaunch: reconnecting, attempt 1\n"});
  }

  TEST_CASE("held lines wait and come out in order on release, after which lines go out at once") {
    Console console;
    ProgressLine line([&](std::string c) { console.chunks.push_back(std::move(c)); }, false, 5.0, 80);
    line.line("ddplaunch: before\n");
    line.hold();
    line.line("ddplaunch: one\n");
    line.line("ddplaunch: two\n");
    CHECK(console.all() == "ddplaunch: before\n");
    line.release();
    CHECK(console.all() == "ddplaunch: before\nddplaunch: one\nddplaunch: two\n");
    line.line("ddplaunch: after\n");
    CHECK(console.all() == "ddplaunch: before\nddplaunch: one\nddplaunch: two\nddplaunch: after\n");
    line.release();  // nothing held: nothing written
    CHECK(console.chunks.size() == 3);
  }
}
