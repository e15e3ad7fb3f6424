// The Trainer's automatic checkpoint cadence (worker_sdk/src/cadence.h): the same tables as the
// Python policy's tests (tests/agent/test_checkpoint_cadence.py), the same inputs giving the same
// intervals, and cadence.json as the Python side writes it. The stateful part runs on a fake clock.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cadence.h"  // the SDK's own (worker_sdk/src), not an installed header
#include "ddp/error.h"

namespace fs = std::filesystem;
using namespace ddp::cadence;

namespace {

constexpr double kHour = 3600.0;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "ddp-cadence-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST_CASE("cadence: the interval is Young/Daly of the stall and the estimated MTBF within bounds") {
  // (stall C, failures, exposure s, prior MTBF s) -> (MTBF estimate, interval (-1: sqrt(2 C M)), bound)
  struct Row {
    std::optional<double> stall;
    int64_t failures;
    double exposure, prior, mtbf, interval;
    Bound bound;
  };
  const Row table[] = {
      {1.0, 0, 0.0, kHour, 3600.0, std::sqrt(7200.0), Bound::kNone},                      // the prior alone: 84.9 s
      {0.5, 3, 2700.0, kHour, 3600.0 / 3.25, std::sqrt(3600.0 / 3.25), Bound::kNone},      // 33.3 s
      {1.0, 10, 300.0, kHour, 1200.0 / 10.25, 15.30, Bound::kNone},                        // a crash every 30 s
      {1.0, 100, 3000.0, kHour, 3900.0 / 100.25, 10.0, Bound::kLower},                     // 8.8 s < 10 s
      {std::nullopt, 0, 0.0, kHour, 3600.0, 10.0, Bound::kLower},                          // no save measured yet
      {0.01, 0, 0.0, kHour, 3600.0, 10.0, Bound::kLower},                                  // sqrt(72) = 8.5 s
      {5.0, 30, 900.0, kHour, 1800.0 / 30.25, 50.0, Bound::kLower},                        // 24.4 s < 10 C
      {10.0, 0, 36000.0, kHour, 147600.0, std::sqrt(2952000.0), Bound::kNone},             // 10 h, no failure
      {100.0, 0, 36000.0, kHour, 147600.0, 3600.0, Bound::kUpper},                         // 5433 s > 1 h
      {1000.0, 1, 0.0, kHour, 900.0 / 1.25, 3600.0, Bound::kLower},                        // 10 C above 1 h: 1 h
      {1.0, 0, 0.0, 7200.0, 7200.0, 120.0, Bound::kNone},                                  // a prior of 2 h
      {1.0, 1, 600.0, 86400.0, 1500.0 / (900.0 / 86400.0 + 1), -1, Bound::kNone},
  };
  for (const Row& row : table) {
    CAPTURE(row.stall.value_or(-1));
    CAPTURE(row.failures);
    CAPTURE(row.exposure);
    CAPTURE(row.prior);
    const Decision d = decide(row.stall, row.failures, row.exposure, row.prior);
    CHECK(d.mtbf == doctest::Approx(row.mtbf).epsilon(1e-9));
    const double interval = row.interval >= 0 ? row.interval : std::sqrt(2 * *row.stall * row.mtbf);
    CHECK(std::abs(d.interval - interval) < 0.005);  // Python's assertAlmostEqual(places=2)
    CHECK(d.bound == row.bound);
  }
}

TEST_CASE("cadence: the line rank 0 says is the Python side's, word for word") {
  // docs/checkpoints.md's example: 3 failures in 40 min, M = 3300 / 3.25 = 1015 s, T = 40.3 s.
  CHECK(describe(decide(0.8, 3, 2400.0)) ==
        "checkpoint every 40 s (save stall 0.80 s, MTBF estimate 17 min from 3 failures in 40 min and a prior of 60 min)");
  CHECK(describe(decide(std::nullopt, 1, 30000.0, 7200.0), 7200.0) ==
        "checkpoint every 10 s, the lower bound (save stall 0.00 s, MTBF estimate 7.6 h from 1 failure in 8.3 h "
        "and a prior of 2.0 h)");
  CHECK(describe(decide(100.0, 0, 36000.0)) ==
        "checkpoint every 60 min, the upper bound (save stall 100.00 s, MTBF estimate 41.0 h from 0 failures in "
        "10.0 h and a prior of 60 min)");
}

TEST_CASE("cadence: the prior comes from DDPLAUNCH_CHECKPOINT_MTBF and a bad one is refused clearly") {
  CHECK(prior_mtbf(nullptr) == kHour);
  CHECK(prior_mtbf("") == kHour);
  CHECK(prior_mtbf("7200") == 7200.0);
  CHECK(prior_mtbf("1.5e3") == 1500.0);
  for (const char* bad : {"abc", "0", "-5", "inf", "nan", "1h", "0x10"}) {
    CAPTURE(bad);
    try {
      prior_mtbf(bad);
      FAIL("accepted");
    } catch (const ddp::EnvError& e) {
      CHECK(std::string(e.what()) ==
            "DDPLAUNCH_CHECKPOINT_MTBF='" + std::string(bad) +
                "': the prior mean time between failures must be a positive number of seconds (e.g. "
                "DDPLAUNCH_CHECKPOINT_MTBF=7200 for two hours)");
    }
  }
}

TEST_CASE("cadence: a new launch closes the last, counting its restarts and an abnormal end") {
  auto record = [](int64_t restarts, bool ended, std::optional<std::string> run_id = std::string("job")) {
    Record r = fresh(100.0, restarts, std::move(run_id));
    r.seen = 160.0;
    r.ended = ended;
    return r;
  };
  // (record, restarts, run id) at now = 1000 -> (failures, exposure at now + 10, launches before this one)
  struct Row {
    std::optional<Record> previous;
    int64_t restarts;
    std::optional<std::string> run_id;
    int64_t failures;
    double exposure;
    int64_t launches;
  };
  const Row table[] = {
      {std::nullopt, 0, "job", 0, 10.0, 0},                          // the first launch in this directory
      {record(1, false), 2, "job", 2, 910.0, 0},                     // a restart of the same launch
      {record(2, false), 0, "job", 3, 70.0, 1},                      // a relaunch after a crash: +1
      {record(2, true), 0, "job", 2, 70.0, 1},                       // after rank 0's normal exit: +0
      {record(0, true, std::nullopt), 0, std::nullopt, 0, 70.0, 1},  // no launcher: each process a launch
      {record(1, false), 3, "other", 2 + 3, 70.0, 1},                // another run id: a new launch
      {record(3, false), 1, "job", 4 + 1, 70.0, 1},                  // its first round's rank 0 not seen
  };
  int row_number = 0;
  for (const Row& row : table) {
    CAPTURE(row_number++);
    const Record r = advance(row.previous, 1000.0, row.restarts, row.run_id);
    const auto [failures, exposure] = failures_and_exposure(r, 1010.0);
    CHECK(failures == row.failures);
    CHECK(exposure == doctest::Approx(row.exposure));
    CHECK(r.launches == row.launches);
  }
}

TEST_CASE("cadence: cadence.json reads as the Python side writes it, and back") {
  // json.dump(record, f, indent=1, sort_keys=True) of cadence.py, after a few launches.
  const std::string python = R"({
 "current": {
  "ended": false,
  "restarts": 2,
  "run_id": "job-7",
  "seen": 1764870123.25,
  "start": 1764870000.5
 },
 "format": 1,
 "past": {
  "exposure": 4321.5,
  "failures": 3,
  "launches": 2
 },
 "stall": 0.42
}
)";
  const auto r = from_json(python);
  REQUIRE(r);
  CHECK((r->launches == 2 && r->failures == 3 && r->exposure == 4321.5));
  CHECK((r->stall == 0.42 && r->run_id == std::string("job-7") && r->restarts == 2 && !r->ended));
  CHECK((r->start == 1764870000.5 && r->seen == 1764870123.25));
  CHECK(to_json(*r) == python);  // byte for byte, with these values

  Record none = fresh(12.0, 0, std::nullopt);
  const std::string text = to_json(none);
  CHECK(text == R"({
 "current": {
  "ended": false,
  "restarts": 0,
  "run_id": null,
  "seen": 12.0,
  "start": 12.0
 },
 "format": 1,
 "past": {
  "exposure": 0.0,
  "failures": 0,
  "launches": 0
 },
 "stall": null
}
)");  // json.dumps(cadence.fresh(12.0, 0, None), indent=1, sort_keys=True)
  const auto back = from_json(text);
  REQUIRE(back);
  CHECK((!back->run_id && !back->stall && back->start == 12.0 && back->exposure == 0.0));

  // What the Python reader refuses (cadence._valid), so does this one.
  std::string why;
  for (const char* bad : {R"({"format": 1, "past": 3})", R"({"format": 99})", "[]",
                          R"({"format": 1, "past": {"launches": 0, "failures": 0, "exposure": 0},
                              "current": {"start": 0, "seen": 0, "restarts": 0, "ended": false}})",
                          R"({"format": 1, "past": {"launches": 0, "failures": -1, "exposure": 0},
                              "current": {"run_id": null, "start": 0, "seen": 0, "restarts": 0, "ended": false}})",
                          R"({"format": 1, "past": {"launches": 0, "failures": 0, "exposure": 0}, "stall": "x",
                              "current": {"run_id": null, "start": 0, "seen": 0, "restarts": 0, "ended": false}})",
                          R"({"format": 1, "past": {"launches": 0, "failures": 0, "exposure": 0},
                              "current": {"run_id": null, "start": 0, "seen": 0, "restarts": 1.5, "ended": false}})"}) {
    CAPTURE(bad);
    CHECK(!from_json(bad, &why));
    CHECK(why.empty());
  }
  CHECK(!from_json("{not json", &why));
  CHECK(!why.empty());
}

namespace {

// A Cadence on a fake clock (wall = 1e9 + clock), its lines and reports kept.
struct Fake {
  TempDir dir;
  double now = 0;
  std::vector<std::string> lines;
  std::vector<double> reports;
  Cadence make(double prior = kPriorMtbf) {
    return Cadence(dir.path.string(), prior,
                   {[this] { return now; }, [this] { return 1e9 + now; },
                    [this](const std::string& line) { lines.push_back(line); },
                    [this](double seconds) { reports.push_back(seconds); }});
  }
  std::optional<Record> history() const { return from_json(slurp(dir.path / kRecord)); }
};

}  // namespace

TEST_CASE("cadence: a save is due at the lower bound until measured, then at the interval") {
  Fake f;
  Cadence c = f.make();
  const Who rank0{0, 0, std::string("job")};
  CHECK(!c.due(rank0));
  f.now = 9.99;
  CHECK(!c.due(rank0));
  f.now = 10.0;  // C unknown: the lower bound, 10 s after the first call
  CHECK(c.due(rank0));
  c.saved(1.0, rank0);
  CHECK(c.decision(rank0).interval == doctest::Approx(std::sqrt(2 * 1.0 * (900 + 10.0) / 0.25)));  // 85.3 s
  // At t = 99 s, T = sqrt(2 (900 + 99) / 0.25) = 89.4 s: not yet 89 s since the save; at 100 s, due.
  f.now = 99.0;
  CHECK(!c.due(rank0));
  f.now = 100.0;
  CHECK(c.due(rank0));
  c.saved(3.0, rank0);  // the moving average: 0.7 * 1 + 0.3 * 3
  CHECK(*c.decision(rank0).stall == doctest::Approx(1.6));
  CHECK(*f.history()->stall == doctest::Approx(1.6));
  CHECK(f.reports.front() == 10.0);  // each interval decided went to the progress slot
  CHECK(f.reports.back() == doctest::Approx(c.interval()));
}

TEST_CASE("cadence: rank 0 says the interval when it changes twofold, and an in-memory restart is a failure") {
  Fake f;
  Cadence c = f.make();
  Who who{0, 0, std::string("job")};
  c.due(who);
  CHECK(f.lines.empty());  // nothing said before the stall is measured
  c.saved(1.0, who);
  c.due(who);
  REQUIRE(f.lines.size() == 1);
  CHECK(f.lines[0] == "checkpoint every 85 s (save stall 1.00 s, MTBF estimate 60 min from 0 failures in 0 s and a "
                      "prior of 60 min)");
  f.now = 600.0;
  c.due(who);
  CHECK(f.lines.size() == 1);  // 85 s -> 100 s: not said
  who.restarts = 3;            // the same process, three rounds later
  CHECK(c.decision(who).failures == 3);
  REQUIRE(f.lines.size() == 2);
  CHECK(f.lines[1] == "checkpoint every 30 s (save stall 1.00 s, MTBF estimate 8 min from 3 failures in 10 min and a "
                      "prior of 60 min)");
  CHECK(f.history()->restarts == 3);
  who = Who{1, 30, std::string("job")};  // another rank: decides alike, says nothing, writes nothing
  fs::remove(f.dir.path / kRecord);
  CHECK(c.decision(who).failures == 30);
  CHECK(f.lines.size() == 2);
  CHECK(!fs::exists(f.dir.path / kRecord));
  c.exited(who);
  CHECK(!fs::exists(f.dir.path / kRecord));
  c.exited(Who{0, 30, std::string("job")});  // rank 0's normal end: a relaunch after it is no failure
  CHECK(f.history()->ended);
}

TEST_CASE("cadence: a damaged history is said and started afresh") {
  for (const char* text : {"{not json", R"({"format": 1, "past": 3})", R"({"format": 99})"}) {
    CAPTURE(text);
    Fake f;
    std::ofstream(f.dir.path / kRecord) << text;
    Cadence c = f.make();
    CHECK(c.decision(Who{0, 2, std::string("job")}).failures == 2);
    REQUIRE(f.lines.size() == 1);
    CHECK(f.lines[0].find("cadence.json") != std::string::npos);
    CHECK(f.lines[0].find("starting the job's failure history afresh") != std::string::npos);
    CHECK(f.history()->restarts == 2);
  }
}
