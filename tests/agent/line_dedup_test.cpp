// --log_dedup's pure unit (agent/line_dedup.h): identical lines of several ranks are written once,
// naming the ranks; each rank's lines keep their order; a line waits at most its window.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include "agent/line_dedup.h"

using ddp::agent::ConsoleLine;
using ddp::agent::LineDedup;
using ddp::agent::rank_ranges;
using namespace std::chrono_literals;

namespace {

constexpr int kOut = 1;
constexpr int kErr = 2;
const LineDedup::Time t0{};

std::string prefix(int rank) { return "[default" + std::to_string(rank) + "]:"; }

// A dedup of three ranks on both streams, with a 250 ms window.
LineDedup three_ranks(std::size_t max_line = 4096, std::size_t max_bytes = std::size_t{4} << 20) {
  LineDedup d(250ms, max_line, max_bytes);
  d.expect(kOut, {0, 1, 2});
  d.expect(kErr, {0, 1, 2});
  return d;
}

void add(LineDedup& d, int rank, const std::string& line, LineDedup::Time at, int fd = kOut) {
  d.add(fd, rank, prefix(rank), line + "\n", at);
}

std::vector<std::string> texts(const std::vector<ConsoleLine>& lines) {
  std::vector<std::string> out;
  for (const auto& l : lines) out.push_back(l.text);
  return out;
}

}  // namespace

TEST_SUITE("identical lines of several ranks are written once and each rank keeps its order") {
  TEST_CASE("ranks are named as ranges") {
    CHECK(rank_ranges({0, 1, 2, 3}) == "0-3");
    CHECK(rank_ranges({0, 2, 5, 6, 7}) == "0,2,5-7");
    CHECK(rank_ranges({4}) == "4");
    CHECK(rank_ranges({3, 4}) == "3-4");
  }

  TEST_CASE("a line every rank prints is written once, as soon as the last rank prints it") {
    LineDedup d = three_ranks();
    add(d, 0, "epoch 1 loss 0.5", t0);
    add(d, 2, "epoch 1 loss 0.5", t0 + 5ms);
    CHECK(d.take(t0 + 5ms).empty());  // rank 1 may still print it
    add(d, 1, "epoch 1 loss 0.5", t0 + 9ms);
    CHECK(texts(d.take(t0 + 9ms)) == std::vector<std::string>{"[ranks 0-2] epoch 1 loss 0.5\n"});
    CHECK(d.held() == 0);
    CHECK_FALSE(d.next_deadline(t0 + 9ms).has_value());
  }

  TEST_CASE("a line fewer ranks print waits out its window, then names them or carries its prefix") {
    LineDedup d = three_ranks();
    add(d, 1, "only rank 1", t0);
    add(d, 0, "ranks 0 and 2", t0 + 1ms);
    add(d, 2, "ranks 0 and 2", t0 + 2ms);
    CHECK(d.next_deadline(t0 + 2ms) == t0 + 250ms);
    CHECK(d.take(t0 + 249ms).empty());
    CHECK(texts(d.take(t0 + 250ms)) == std::vector<std::string>{"[default1]:only rank 1\n"});
    CHECK(d.next_deadline(t0 + 250ms) == t0 + 251ms);
    CHECK(texts(d.take(t0 + 251ms)) == std::vector<std::string>{"[ranks 0,2] ranks 0 and 2\n"});
  }

  TEST_CASE("lines that differ between ranks do not keep the lines after them from collapsing") {
    LineDedup d = three_ranks();
    for (int rank : {0, 1, 2}) add(d, rank, "hello from everyone", t0 + 1ms * rank);
    for (int rank : {0, 1, 2}) {
      add(d, rank, "only rank " + std::to_string(rank), t0 + 10ms);
      add(d, rank, "epoch 1 loss 0.5", t0 + 11ms);
    }
    // The shared line is written at once; the rest waits for the unique lines' window.
    CHECK(texts(d.take(t0 + 11ms)) == std::vector<std::string>{"[ranks 0-2] hello from everyone\n"});
    CHECK(texts(d.take(t0 + 260ms)) == std::vector<std::string>{"[default0]:only rank 0\n", "[default1]:only rank 1\n",
                                                                "[default2]:only rank 2\n",
                                                                "[ranks 0-2] epoch 1 loss 0.5\n"});
  }

  TEST_CASE("a rank never joins a line it must print after: each rank's order is kept") {
    LineDedup d = three_ranks();
    add(d, 0, "A", t0);
    add(d, 0, "B", t0);
    add(d, 1, "B", t0 + 1ms);
    add(d, 1, "A", t0 + 2ms);  // joining rank 0's A would put it before rank 1's B
    CHECK(texts(d.take_all()) == std::vector<std::string>{"[default0]:A\n", "[ranks 0-1] B\n", "[default1]:A\n"});
  }

  TEST_CASE("a rank that prints the same line twice is in two lines") {
    LineDedup d = three_ranks();
    for (int i = 0; i < 2; ++i) {
      for (int rank : {0, 1, 2}) add(d, rank, "tick", t0);
    }
    CHECK(texts(d.take(t0)) == std::vector<std::string>{"[ranks 0-2] tick\n", "[ranks 0-2] tick\n"});
  }

  TEST_CASE("stdout and stderr are kept apart, and a rank's lines on both keep their order") {
    LineDedup d = three_ranks();
    add(d, 0, "same", t0, kOut);
    add(d, 1, "same", t0, kErr);
    add(d, 0, "next", t0, kErr);
    auto out = d.take_all();
    REQUIRE(out.size() == 3);
    CHECK(out[0] == ConsoleLine{kOut, "[default0]:same\n"});
    CHECK(out[1] == ConsoleLine{kErr, "[default1]:same\n"});
    CHECK(out[2] == ConsoleLine{kErr, "[default0]:next\n"});
  }

  TEST_CASE("the expected ranks are those whose lines come here: two of them complete a line") {
    LineDedup d(250ms);
    d.expect(kOut, {4, 5});  // a second node's local ranks, by global rank
    add(d, 5, "x", t0);
    add(d, 4, "x", t0);
    CHECK(texts(d.take(t0)) == std::vector<std::string>{"[ranks 4-5] x\n"});
    add(d, 4, "y", t0, kErr);  // no rank is expected on stderr: nothing to wait for
    CHECK(texts(d.take(t0)) == std::vector<std::string>{"[default4]:y\n"});
  }

  TEST_CASE("a long line is written alone at once, in its rank's order") {
    LineDedup d = three_ranks(/*max_line=*/8);
    add(d, 0, std::string(20, 'x'), t0);
    CHECK(texts(d.take(t0)) == std::vector<std::string>{"[default0]:" + std::string(20, 'x') + "\n"});
    add(d, 1, "short", t0);
    add(d, 1, std::string(20, 'y'), t0);
    CHECK(d.take(t0).empty());  // behind rank 1's short line, which waits for the others
    CHECK(d.take(t0 + 250ms).size() == 2);
  }

  TEST_CASE("held lines stay within the byte bound: past it the oldest are written at once") {
    LineDedup d = three_ranks(4096, /*max_bytes=*/300);
    add(d, 0, "first", t0);
    add(d, 0, "second", t0);
    CHECK(d.take(t0).empty());
    add(d, 0, std::string(200, 'z'), t0);
    const auto out = texts(d.take(t0));
    REQUIRE_FALSE(out.empty());
    CHECK(out.front() == "[default0]:first\n");
  }

  TEST_CASE("take_all writes every held line, each rank's in its order") {
    LineDedup d = three_ranks();
    add(d, 2, "a", t0);
    add(d, 0, "b", t0);
    add(d, 2, "b", t0);
    add(d, 1, "c", t0);
    CHECK(texts(d.take_all()) == std::vector<std::string>{"[default2]:a\n", "[ranks 0,2] b\n", "[default1]:c\n"});
    CHECK(d.held() == 0);
    CHECK(d.take_all().empty());
  }
}
