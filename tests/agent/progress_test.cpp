// Progress heartbeats, the hang decision and torch's file-timer protocol (agent/progress.h,
// agent/file_timer.h): pure parts, the clock given to every call.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>
#include <variant>

#include "agent/file_timer.h"
#include "agent/progress.h"

using namespace ddp::agent;

namespace {

ProgressSample beat(uint64_t beats, int64_t step, std::string phase = "", int64_t checkpoint = -1) {
  ProgressSample s;
  s.beats = beats;
  s.step = step;
  s.phase = std::move(phase);
  s.checkpoint_step = checkpoint;
  return s;
}

// The golden slot of contracts/fixtures/ (README.md there): beats 7, step 1234, checkpoint 1200,
// phase "forward/backward", abandoned, a checkpoint interval of 90.5 s, final.
std::string golden_slot() {
  std::ifstream in(std::string(DDP_CONTRACTS_FIXTURES) + "/progress_slot.bin", std::ios::binary);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Slot `slot` of `board`, read through the path a worker opens.
std::string slot_bytes(const ProgressBoard& board, int slot) {
  const int fd = ::open(board.path().c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  std::string out(ProgressBoard::kSlotSize, '\0');
  const auto n = ::pread(fd, out.data(), out.size(), static_cast<off_t>(ProgressBoard::kSlotSize) * slot);
  ::close(fd);
  REQUIRE(n == static_cast<ssize_t>(out.size()));
  return out;
}

HangPolicy fixed(double seconds) {
  HangPolicy p;
  p.timeout = seconds;
  return p;
}

}  // namespace

TEST_SUITE("progress heartbeats decide when a rank hangs") {
  TEST_CASE("the board round-trips a slot and starts each round from nothing") {
    ProgressBoard board(3);
    CHECK(board.path().rfind("/proc/", 0) == 0);
    board.write(2, beat(7, 41, "forward", 40));
    const auto s = board.read(2);
    CHECK(s.beats == 7);
    CHECK(s.step == 41);
    CHECK(s.checkpoint_step == 40);
    CHECK(s.phase == "forward");
    CHECK(board.read(0).beats == 0);
    board.reset();
    CHECK(board.read(2).beats == 0);
    CHECK(board.read(2).checkpoint_step == -1);
  }

  TEST_CASE("the board reads the golden slot a worker wrote, and writes the same bytes") {
    const std::string golden = golden_slot();
    REQUIRE(golden.size() == ProgressBoard::kSlotSize);
    ProgressBoard board(2);
    const int fd = ::open(board.path().c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(::pwrite(fd, golden.data(), golden.size(), static_cast<off_t>(ProgressBoard::kSlotSize)) ==
            static_cast<ssize_t>(golden.size()));
    ::close(fd);
    const auto s = board.read(1);
    CHECK(s.beats == 7);
    CHECK(s.step == 1234);
    CHECK(s.checkpoint_step == 1200);
    CHECK(s.phase == "forward/backward");
    CHECK(s.checkpoint_interval_ms == 90500);
    CHECK(s.final);
    CHECK(s.busy_us == 412000);
    CHECK(s.checkpoint_stall_us == 2500000);
    CHECK(s.first_step == 1228);
    CHECK(board.abandoned(1));

    board.reset();
    CHECK(board.read(1).checkpoint_interval_ms == 0);
    CHECK_FALSE(board.read(1).final);
    auto written = beat(7, 1234, "forward/backward", 1200);
    written.checkpoint_interval_ms = 90500;
    written.final = true;
    written.busy_us = 412000;
    written.checkpoint_stall_us = 2500000;
    written.first_step = 1228;
    board.write(1, written);
    board.abandon_slot(1);
    CHECK(slot_bytes(board, 1) == golden);
  }

  TEST_CASE("a node's progress for the rendezvous: the highest step and checkpoint, the longest interval") {
    struct Row {
      const char* name;
      std::vector<ProgressSample> samples;
      bool reported;
      int64_t step, checkpoint;
      double interval;
    };
    auto sample = [](uint64_t beats, int64_t step, int64_t checkpoint, int64_t interval_ms) {
      ProgressSample s;
      s.beats = beats;
      s.step = step;
      s.checkpoint_step = checkpoint;
      s.checkpoint_interval_ms = interval_ms;
      return s;
    };
    const std::vector<Row> rows = {
        {"no worker stepped", {sample(0, 0, -1, 0), sample(0, 0, -1, 0)}, false, -1, -1, 0},
        {"two ranks stepped", {sample(5, 41, -1, 0), sample(6, 42, -1, 0)}, true, 42, -1, 0},
        {"a checkpoint and an interval", {sample(5, 41, 40, 90500), sample(6, 42, 40, 0)}, true, 42, 40, 90.5},
        {"a finished rank keeps its step", {sample(ddp::contracts::kDoneBeats, 100, 100, 0)}, true, 100, 100, 0},
        {"a resumed worker's checkpoint before its first step", {sample(0, 0, 300, 0)}, true, -1, 300, 0},
        {"a worker's absurd numbers are bounded",
         {sample(1, std::numeric_limits<int64_t>::max(), -7, std::numeric_limits<int64_t>::max())},
         true, ddp::rdzv::kMaxReportedStep, -1, 1e7},
        {"a negative interval is none", {sample(1, 3, -1, -5)}, true, 3, -1, 0},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      const auto got = summarize(row.samples);
      REQUIRE(got.has_value() == row.reported);
      if (!got) continue;
      CHECK(got->step == row.step);
      CHECK(got->checkpoint_step == row.checkpoint);
      CHECK(got->checkpoint_interval == doctest::Approx(row.interval));
    }
  }

  TEST_CASE("a node's busy time for the rendezvous: its slowest stepping rank's, with that local rank") {
    auto sample = [](uint64_t beats, uint64_t busy_us) {
      ProgressSample s;
      s.beats = beats;
      s.step = 10;
      s.busy_us = busy_us;
      return s;
    };
    auto got = summarize({sample(5, 200000), sample(5, 412000), sample(5, 230000)});
    REQUIRE(got);
    CHECK(got->busy == doctest::Approx(0.412));
    CHECK(got->busy_local_rank == 1);
    got = summarize({sample(5, 0), sample(5, 0)});  // measured by nobody: not said
    REQUIRE(got);
    CHECK(got->busy_local_rank == -1);
    got = summarize({sample(0, 999000), sample(5, 100000)});  // a rank that never stepped: stale
    CHECK(got->busy_local_rank == 1);
    got = summarize({sample(5, std::numeric_limits<uint64_t>::max())});  // bounded as the wire bounds it
    CHECK(got->busy == doctest::Approx(1e7));
  }

  TEST_CASE("a node's checkpoint stall for the goodput account: the most of any local rank, bounded") {
    ProgressSample a, b;
    a.beats = b.beats = 3;
    a.checkpoint_stall_us = 1500000;
    b.checkpoint_stall_us = 2500000;
    auto got = summarize({a, b});
    REQUIRE(got);
    CHECK(got->checkpoint_stall == doctest::Approx(2.5));
    b.checkpoint_stall_us = std::numeric_limits<uint64_t>::max();  // a worker's garbage, bounded as the wire bounds it
    CHECK(summarize({a, b})->checkpoint_stall == doctest::Approx(1e7));
  }

  TEST_CASE("a node's first step of the round: the earliest of its stepping ranks, where the round resumed") {
    ProgressSample a, b, idle;
    a.beats = b.beats = 3;
    a.step = 130;
    b.step = 128;
    a.first_step = 111;
    b.first_step = 110;
    idle.first_step = 5;  // never stepped (beats 0): stale
    CHECK(summarize({a, b, idle})->first_step == 110);
    a.first_step = b.first_step = -1;
    CHECK(summarize({a, b})->first_step == -1);
  }

  TEST_CASE("an abandoned round is seen in every slot, survives the workers' writes, and ends with the round") {
    ProgressBoard board(2);
    CHECK_FALSE(board.abandoned(0));
    board.abandon_round();
    CHECK(board.abandoned(0));
    CHECK(board.abandoned(1));
    // A worker writing the longest phase it may write does not reach the agent's word.
    board.write(1, beat(3, 3, std::string(ProgressBoard::kPhaseSize + 10, 'x')));
    CHECK(board.abandoned(1));
    CHECK(board.read(1).phase.size() == ProgressBoard::kPhaseSize - 1);
    board.reset();
    CHECK_FALSE(board.abandoned(0));
    CHECK_FALSE(board.abandoned(1));
  }

  TEST_CASE("one slot can be abandoned alone (a worker asked to park), until the round ends") {
    ProgressBoard board(3);
    board.abandon_slot(1);
    CHECK_FALSE(board.abandoned(0));
    CHECK(board.abandoned(1));
    CHECK_FALSE(board.abandoned(2));
    board.reset();
    CHECK_FALSE(board.abandoned(1));
  }

  TEST_CASE("a phase with bytes a terminal would interpret is shown with question marks") {
    ProgressBoard board(1);
    board.write(0, beat(1, 1, std::string("a\x1b[2Jb")));
    CHECK(board.read(0).phase == "a?[2Jb");
  }

  TEST_CASE("a rank that stops beating hangs once the fixed timeout has passed, not before") {
    HangMonitor m(fixed(5), 2);
    m.reset(100);
    m.observe(0, beat(1, 1), 101);
    m.observe(0, beat(2, 2, "allreduce"), 102);
    CHECK(m.check(106.9).empty());
    auto hangs = m.check(107.0);
    REQUIRE(hangs.size() == 1);
    CHECK(hangs[0].slot == 0);
    CHECK(hangs[0].step == 2);
    CHECK(hangs[0].phase == "allreduce");
    CHECK(hangs[0].stalled_for == doctest::Approx(5.0));
  }

  TEST_CASE("the ranks that stopped beating with a hung one are declared with it; a stepping rank is not") {
    // Rank 1 blocks forever; rank 0, blocked in its collective, was sampled 0.3 s later;
    // rank 2 still steps.
    HangMonitor m(fixed(5), 3);
    m.reset(100);
    m.observe(0, beat(4, 4, "forward/backward"), 101.3);
    m.observe(1, beat(4, 4, "data"), 101.0);
    m.observe(2, beat(4, 4), 101.0);
    m.observe(2, beat(9, 9), 105.9);
    CHECK(m.check(105.9).empty());  // nobody has reached the timeout yet
    auto hangs = m.check(106.0);
    REQUIRE(hangs.size() == 2);
    CHECK(hangs[0].slot == 0);
    CHECK(hangs[0].stalled_for == doctest::Approx(4.7));
    CHECK(hangs[1].slot == 1);
    CHECK(hangs[1].phase == "data");
    // Under 90% of the timeout: a rank that stalled later is not part of this hang.
    m.observe(0, beat(5, 5), 101.6);
    REQUIRE(m.check(106.0).size() == 1);
  }

  TEST_CASE("a rank that never beat is not watched") {
    HangMonitor m(fixed(5), 2);
    m.reset(0);
    m.observe(1, beat(0, 0), 1);
    CHECK(m.check(1000).empty());
  }

  TEST_CASE("a rank that said it is done is not watched, until it beats again") {
    HangMonitor m(fixed(5), 1);
    m.reset(0);
    m.observe(0, beat(3, 3), 1);
    m.observe(0, beat(ddp::contracts::kDoneBeats, 3), 2);
    CHECK(m.check(100).empty());
    CHECK(m.best_step() == 3);
    m.observe(0, beat(4, 4), 200);
    CHECK(m.check(204.9).empty());
    CHECK(m.check(205).size() == 1);
  }

  TEST_CASE("a new round forgets the beats of the last one") {
    HangMonitor m(fixed(5), 1);
    m.reset(0);
    m.observe(0, beat(3, 3), 1);
    m.reset(50);
    CHECK(m.check(100).empty());
    CHECK(m.best_step() == -1);
  }

  TEST_CASE("auto: no rank is watched during warm-up, then 5 x the slowest step with a 60 s floor") {
    HangPolicy p;
    p.automatic = true;
    HangMonitor m(p, 1);
    m.reset(0);
    // Steps 1 and 2 (compilation, first batches) are slow and not counted; then 20 s per step.
    m.observe(0, beat(1, 1), 100);
    m.observe(0, beat(2, 2), 300);
    for (int i = 3; i <= 6; ++i) m.observe(0, beat(i, i), 300 + 20.0 * (i - 2));
    CHECK(m.timeout_for(0) == 0);  // 4 counted intervals: still warming up
    CHECK(m.check(10000).empty());
    m.observe(0, beat(7, 7), 400);
    CHECK(m.timeout_for(0) == doctest::Approx(100.0));  // 5 x 20 s
    CHECK(m.check(499).empty());
    CHECK(m.check(500).size() == 1);
  }

  TEST_CASE("auto: fast steps get the 60 s floor") {
    HangPolicy p;
    p.automatic = true;
    HangMonitor m(p, 1);
    m.reset(0);
    for (int i = 1; i <= 10; ++i) m.observe(0, beat(i, i), 0.1 * i);
    CHECK(m.timeout_for(0) == doctest::Approx(60.0));
  }

  TEST_CASE("the best step and checkpoint of a round are kept for crash-loop detection") {
    HangMonitor m(HangPolicy{}, 2);
    m.reset(0);
    CHECK_FALSE(m.any_beat());
    m.observe(0, beat(5, 5, "", 4), 1);
    m.observe(1, beat(3, 3), 1);
    CHECK(m.best_step() == 5);
    CHECK(m.best_checkpoint() == 4);
    CHECK(m.any_beat());
    CHECK(m.check(1e9).empty());  // no --hang_timeout: never a hang
  }
}

TEST_SUITE("torch's file timer requests are validated before they touch state") {
  TEST_CASE("torch's FileTimerClient line is accepted") {
    auto r = parse_timer_request(
        R"({"version": 1, "pid": 4242, "scope_id": "step", "expiration_time": 1700000000.5, "signal": 9})");
    REQUIRE(std::holds_alternative<TimerRequest>(r));
    const auto& t = std::get<TimerRequest>(r);
    CHECK(t.pid == 4242);
    CHECK(t.scope_id == "step");
    CHECK(t.expiration_time == doctest::Approx(1700000000.5));
    CHECK(t.signal == 9);
  }

  TEST_CASE("hostile lines are refused with a reason") {
    const char* bad[] = {
        "not json",
        "[1, 2]",
        R"({"version": 2, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 9})",
        R"({"version": 1, "pid": "1", "scope_id": "s", "expiration_time": 1, "signal": 9})",
        R"({"version": 1, "pid": -5, "scope_id": "s", "expiration_time": 1, "signal": 9})",
        R"({"version": 1, "pid": 99999999999, "scope_id": "s", "expiration_time": 1, "signal": 9})",
        R"({"version": 1, "pid": 1, "scope_id": 7, "expiration_time": 1, "signal": 9})",
        R"({"version": 1, "pid": 1, "scope_id": "s", "expiration_time": "soon", "signal": 9})",
        R"({"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 65})",
        R"({"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 1.5})",
        R"({"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 1})",
        R"({"version": 1, "pid": 1, "scope_id": {"a": [[[[]]]]}, "expiration_time": 1, "signal": 9})",
    };
    for (const char* line : bad) {
      CAPTURE(line);
      auto r = parse_timer_request(line);
      REQUIRE(std::holds_alternative<std::string>(r));
      CHECK_FALSE(std::get<std::string>(r).empty());
    }
    const std::string huge = R"({"version": 1, "pid": 1, "scope_id": ")" + std::string(5000, 'x') +
                             R"(", "expiration_time": 1, "signal": 9})";
    CHECK(std::holds_alternative<std::string>(parse_timer_request(huge)));
    const std::string deep(4000, '[');
    CHECK(std::holds_alternative<std::string>(parse_timer_request(deep)));
  }

  TEST_CASE("a timer expires at its time, and a release removes it") {
    FileTimers t;
    CHECK(t.apply(TimerRequest{10, "a", 100, 9}));
    CHECK(t.apply(TimerRequest{11, "b", 200, 15}));
    CHECK(t.next_expiration() == doctest::Approx(100));
    CHECK(t.take_expired(99.9).empty());
    auto expired = t.take_expired(100);
    REQUIRE(expired.size() == 1);
    CHECK(expired[0].pid == 10);
    CHECK(expired[0].signal == 9);
    CHECK(t.apply(TimerRequest{11, "b", -1, 0}));  // release
    CHECK(t.size() == 0);
    CHECK(t.next_expiration() < 0);
  }

  TEST_CASE("of a worker's expired timers, the earliest with a signal reaps it, once") {
    FileTimers t;
    t.apply(TimerRequest{10, "no-signal", 50, 0});
    t.apply(TimerRequest{10, "term", 60, 15});
    t.apply(TimerRequest{10, "kill", 70, 9});
    auto expired = t.take_expired(100);
    REQUIRE(expired.size() == 1);
    CHECK(expired[0].scope_id == "term");
    CHECK(t.size() == 0);
  }

  TEST_CASE("the number of timers is bounded") {
    FileTimers t;
    for (std::size_t i = 0; i < FileTimers::kMaxTimers; ++i) {
      REQUIRE(t.apply(TimerRequest{1, std::to_string(i), 1e12, 9}));
    }
    CHECK_FALSE(t.apply(TimerRequest{1, "one too many", 1e12, 9}));
    CHECK(t.apply(TimerRequest{1, "0", 5, 9}));  // an existing scope may still be renewed
  }
}
