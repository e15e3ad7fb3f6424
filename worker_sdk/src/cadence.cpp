#include "cadence.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <system_error>

#include "ddp/error.h"

namespace ddp::cadence {

// --- the policy --------------------------------------------------------------------------------

double prior_mtbf(const char* text) {
  if (text == nullptr || *text == '\0') return kPriorMtbf;
  const std::string s(text);
  char* end = nullptr;
  double value = std::strtod(s.c_str(), &end);
  while (end != nullptr && *end != '\0' && std::isspace(static_cast<unsigned char>(*end))) ++end;
  // As Python's float(): a whole decimal number (no hexadecimal).
  if (end == s.c_str() || *end != '\0' || s.find_first_of("xX") != std::string::npos) value = NAN;
  if (!std::isfinite(value) || value <= 0) {
    throw EnvError(std::string(kMtbfVariable) + "='" + s +
                   "': the prior mean time between failures must be a positive number of seconds (e.g. " +
                   kMtbfVariable + "=7200 for two hours)");
  }
  return value;
}

double mtbf_estimate(int64_t failures, double exposure_s, double prior_mtbf_s) {
  return (kPriorWeight + std::max(0.0, exposure_s)) /
         (kPriorWeight / prior_mtbf_s + static_cast<double>(std::max<int64_t>(0, failures)));
}

std::pair<double, double> bounds(double stall_s) {
  return {std::min(std::max(kMinInterval, kMinIntervalStalls * stall_s), kMaxInterval), kMaxInterval};
}

Decision decide(std::optional<double> stall_s, int64_t failures, double exposure_s, double prior_mtbf_s) {
  Decision d;
  d.stall = stall_s;
  d.failures = failures;
  d.exposure = exposure_s;
  d.mtbf = mtbf_estimate(failures, exposure_s, prior_mtbf_s);
  const double c = stall_s.value_or(0.0);
  const auto [lo, hi] = bounds(c);
  const double ideal = std::sqrt(2.0 * c * d.mtbf);
  d.bound = ideal < lo ? Bound::kLower : ideal > hi ? Bound::kUpper : Bound::kNone;
  d.interval = std::min(std::max(ideal, lo), hi);
  return d;
}

namespace {

std::string format(const char* spec, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, spec, value);
  return buffer;
}

std::string human(double seconds) {
  if (seconds < 120) return format("%.0f s", seconds);
  if (seconds < 7200) return format("%.0f min", seconds / 60);
  return format("%.1f h", seconds / 3600);
}

}  // namespace

std::string describe(const Decision& d, double prior_mtbf_s) {
  const char* bound = d.bound == Bound::kLower ? ", the lower bound" : d.bound == Bound::kUpper ? ", the upper bound" : "";
  return "checkpoint every " + human(d.interval) + bound + " (save stall " + format("%.2f", d.stall.value_or(0.0)) +
         " s, MTBF estimate " + human(d.mtbf) + " from " + std::to_string(d.failures) + " failure" +
         (d.failures == 1 ? "" : "s") + " in " + human(d.exposure) + " and a prior of " + human(prior_mtbf_s) + ")";
}

Record fresh(double now, int64_t restarts, std::optional<std::string> run_id) {
  Record r;
  r.run_id = std::move(run_id);
  r.start = r.seen = now;
  r.restarts = restarts;
  return r;
}

Record advance(std::optional<Record> record, double now, int64_t restarts, const std::optional<std::string>& run_id) {
  if (!record) return fresh(now, restarts, run_id);
  Record r = std::move(*record);
  if (run_id == r.run_id && restarts > r.restarts) {
    r.restarts = restarts;
    r.seen = now;
    r.ended = false;
    return r;
  }
  r.launches += 1;
  r.failures += r.restarts + (r.ended ? 0 : 1);
  r.exposure += std::max(0.0, r.seen - r.start);
  r.run_id = run_id;
  r.start = r.seen = now;
  r.restarts = restarts;
  r.ended = false;
  return r;
}

std::pair<int64_t, double> failures_and_exposure(const Record& record, double now) {
  return {record.failures + record.restarts, record.exposure + std::max(0.0, now - record.start)};
}

// --- cadence.json: the Python side's format (cadence.py: fresh, _valid) ---------------------------

std::string to_json(const Record& r) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["past"] = {{"launches", r.launches}, {"failures", r.failures}, {"exposure", r.exposure}};
  j["stall"] = r.stall ? nlohmann::json(*r.stall) : nlohmann::json(nullptr);
  j["current"] = {{"run_id", r.run_id ? nlohmann::json(*r.run_id) : nlohmann::json(nullptr)},
                  {"start", r.start},
                  {"seen", r.seen},
                  {"restarts", r.restarts},
                  {"ended", r.ended}};
  return j.dump(1) + "\n";  // std::map keys: sorted, as json.dump(sort_keys=True)
}

std::optional<Record> from_json(const std::string& text, std::string* why) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    if (why) *why = e.what();
    return std::nullopt;
  }
  if (why) why->clear();
  auto number = [](const nlohmann::json& o, const char* key) { return o.is_object() && o.contains(key) && o[key].is_number(); };
  if (!j.is_object() || !number(j, "format") || j["format"].get<double>() != kFormat) return std::nullopt;
  if (!j.contains("past") || !j.contains("current")) return std::nullopt;
  const nlohmann::json &past = j["past"], &current = j["current"];
  for (const char* key : {"launches", "failures", "exposure"}) {
    if (!number(past, key) || past[key].get<double>() < 0) return std::nullopt;
  }
  if (!current.is_object() || !current.contains("restarts") || !current["restarts"].is_number_integer()) return std::nullopt;
  if (!current.contains("ended") || !current["ended"].is_boolean()) return std::nullopt;
  if (!current.contains("run_id") || !(current["run_id"].is_null() || current["run_id"].is_string())) return std::nullopt;
  if (!number(current, "start") || !number(current, "seen")) return std::nullopt;
  if (j.contains("stall") && !(j["stall"].is_null() || j["stall"].is_number())) return std::nullopt;
  Record r;
  r.launches = static_cast<int64_t>(past["launches"].get<double>());
  r.failures = static_cast<int64_t>(past["failures"].get<double>());
  r.exposure = past["exposure"].get<double>();
  if (j.contains("stall") && j["stall"].is_number()) r.stall = j["stall"].get<double>();
  if (current["run_id"].is_string()) r.run_id = current["run_id"].get<std::string>();
  r.start = current["start"].get<double>();
  r.seen = current["seen"].get<double>();
  r.restarts = current["restarts"].get<int64_t>();
  r.ended = current["ended"].get<bool>();
  return r;
}

// --- one directory's state ----------------------------------------------------------------------

namespace {

double seconds_of(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

}  // namespace

Cadence::Cadence(std::string dir, double prior_mtbf_s, Hooks hooks)
    : dir_(std::move(dir)), file_((std::filesystem::path(dir_) / kRecord).string()), prior_(prior_mtbf_s),
      hooks_(std::move(hooks)) {
  if (!hooks_.clock) hooks_.clock = [] { return seconds_of(std::chrono::steady_clock::now()); };
  if (!hooks_.wall) {
    hooks_.wall = [] { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); };
  }
  if (!hooks_.say) hooks_.say = [](const std::string& line) { std::cerr << "[ddp] " << line << std::endl; };
  if (!hooks_.report) hooks_.report = [](double) {};
}

std::optional<Record> Cadence::read() {
  std::ifstream in(file_);
  if (!in) {
    std::error_code ec;
    if (std::filesystem::exists(file_, ec)) {
      hooks_.say("cannot read " + file_ + " (cannot open it): starting the job's failure history afresh");
    }
    return std::nullopt;
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string why;
  auto record = from_json(text.str(), &why);
  if (!record) {
    hooks_.say(why.empty() ? file_ + " is not a checkpoint cadence record: starting the job's failure history afresh"
                           : "cannot read " + file_ + " (" + why + "): starting the job's failure history afresh");
  }
  return record;
}

void Cadence::write(const Who& who) {
  if (!who.writer()) return;
  const std::string tmp = (std::filesystem::path(dir_) / ("." + std::string(kRecord) + ".tmp-" + std::to_string(::getpid()))).string();
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << to_json(*record_);
    out.close();
    if (!out) {
      hooks_.say("cannot write " + file_ + ": cannot write " + tmp);
      std::filesystem::remove(tmp, ec);
      return;
    }
  }
  std::filesystem::rename(tmp, file_, ec);
  if (ec) {
    hooks_.say("cannot write " + file_ + ": " + ec.message());
    std::filesystem::remove(tmp, ec);
  }
}

void Cadence::refresh(const Who& who) {
  if (!record_) {
    record_ = advance(read(), hooks_.wall(), who.restarts, who.run_id);
  } else if (who.restarts != restarts_) {  // this process went through an in-memory restart
    record_ = advance(std::move(record_), hooks_.wall(), who.restarts, who.run_id);
  } else {
    return;
  }
  restarts_ = who.restarts;
  write(who);
}

Decision Cadence::decision(const Who& who) {
  refresh(who);
  const auto [failures, exposure] = failures_and_exposure(*record_, hooks_.wall());
  const Decision d = decide(record_->stall, failures, exposure, prior_);
  if (d.stall && who.writer() && (!printed_ || !(*printed_ / 2 <= d.interval && d.interval <= *printed_ * 2))) {
    printed_ = d.interval;
    hooks_.say(describe(d, prior_));
  }
  follow(d.interval);
  return d;
}

bool Cadence::due(const Who& who) {
  const double interval = decision(who).interval;
  if (!started_) started_ = hooks_.clock();
  return hooks_.clock() - last_save_.value_or(*started_) >= interval;
}

void Cadence::follow(double interval) {
  if (interval <= 0 || interval == reported_) return;
  reported_ = interval;
  hooks_.report(interval);
}

void Cadence::saved(double stall_s, const Who& who) {
  refresh(who);
  record_->stall = record_->stall ? (1 - kStallWeight) * *record_->stall + kStallWeight * stall_s : stall_s;
  record_->seen = hooks_.wall();
  last_save_ = hooks_.clock();
  write(who);
}

void Cadence::exited(const Who& who) {
  if (!record_ || !who.writer()) return;
  record_->seen = hooks_.wall();
  record_->ended = true;
  write(who);
}

}  // namespace ddp::cadence
