// The goodput account (goodput.h). Pure arithmetic on the state machine's clock.
#include "rendezvous/goodput.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace ddp::rdzv {

namespace {

constexpr const char* kSpentNames[kSpentCount] = {"productive", "lost",    "recovery",        "checkpoint",
                                                   "hang",       "waiting", "reduced_capacity"};
constexpr double kMaxSeconds = 1e10;  // about 300 years: beyond it a record is not believed

// A number of seconds a record may hold: finite, not negative, at most kMaxSeconds.
bool believable(const nlohmann::json& v) {
  return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0 && v.get<double>() <= kMaxSeconds;
}

// x to 1/scale (10: a tenth), as the nearest double prints: 51.8, not 51.800000000000004.
double rounded(double x, double scale) { return std::round(x * scale) / scale; }

std::string one_decimal(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

std::string wall_text(double s) {
  char buf[48];
  if (s < 60) return one_decimal(s);
  const long total = std::lround(s);
  if (total < 3600) {
    std::snprintf(buf, sizeof buf, "%ldm %lds", total / 60, total % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%ldh %ldm", total / 3600, total % 3600 / 60);
  }
  return buf;
}

}  // namespace

const char* spent_name(Spent s) { return kSpentNames[static_cast<int>(s)]; }

nlohmann::json GoodputTotals::to_json() const {
  nlohmann::json by = nlohmann::json::object();
  for (int i = 0; i < kSpentCount; ++i) by[kSpentNames[i]] = rounded(seconds[i], 1000);
  return {{"wall_seconds", rounded(wall, 1000)},
          {"percent", std::strtod(shown_percent().c_str(), nullptr)},
          {"seconds", std::move(by)},
          {"restarts", restarts}};
}

std::optional<GoodputTotals> GoodputTotals::from_json(const nlohmann::json& j) {
  if (!j.is_object()) return std::nullopt;
  auto wall = j.find("wall_seconds");
  auto by = j.find("seconds");
  auto restarts = j.find("restarts");
  if (wall == j.end() || !believable(*wall) || by == j.end() || !by->is_object() || restarts == j.end() ||
      !restarts->is_number_integer() || restarts->get<std::int64_t>() < 0 || restarts->get<std::int64_t>() > (1 << 30)) {
    return std::nullopt;
  }
  GoodputTotals t;
  t.wall = wall->get<double>();
  t.restarts = restarts->get<int>();
  for (int i = 0; i < kSpentCount; ++i) {
    auto v = by->find(kSpentNames[i]);
    if (v == by->end() || !believable(*v)) return std::nullopt;
    t.seconds[i] = v->get<double>();
  }
  return t;
}

std::vector<double> GoodputTotals::to_array() const {
  std::vector<double> a{rounded(wall, 1000)};
  for (double s : seconds) a.push_back(rounded(s, 1000));
  a.push_back(restarts);
  return a;
}

std::optional<GoodputTotals> GoodputTotals::from_array(const nlohmann::json& j) {
  if (!j.is_array() || j.size() != kArraySize) return std::nullopt;
  for (const auto& v : j) {
    if (!believable(v)) return std::nullopt;
  }
  const double restarts = j.back().get<double>();
  if (restarts != std::floor(restarts) || restarts > (1 << 30)) return std::nullopt;
  GoodputTotals t;
  t.wall = j[0].get<double>();
  for (int i = 0; i < kSpentCount; ++i) t.seconds[i] = j[static_cast<std::size_t>(i) + 1].get<double>();
  t.restarts = static_cast<int>(restarts);
  return t;
}

std::string GoodputTotals::shown_percent() const {
  const double shown_wall = rounded(wall, 1000);
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", shown_wall > 0 ? 100.0 * rounded(seconds[0], 1000) / shown_wall : 0.0);
  return text;
}

std::string GoodputTotals::summary() const {
  std::string text = "goodput " + shown_percent() + "% of " + wall_text(wall);
  const std::pair<Spent, std::string> parts[] = {
      {Spent::lost, " lost to " + std::to_string(restarts) + (restarts == 1 ? " restart" : " restarts")},
      {Spent::recovery, " recovering"},
      {Spent::checkpoint, " in checkpoint stalls"},
      {Spent::hang, " hung"},
      {Spent::waiting, " waiting for nodes"},
      {Spent::reduced_capacity, " at reduced capacity"}};
  const char* sep = ": ";
  for (const auto& [what, words] : parts) {
    if ((*this)[what] < 0.05) continue;
    text += sep + one_decimal((*this)[what]) + words;
    sep = ", ";
  }
  return text;
}

GoodputAccount::GoodputAccount(double now, double report_period)
    : report_period_(report_period), began_(now), since_(now) {}

void GoodputAccount::restore(double now, const GoodputTotals& totals, bool running, std::size_t nodes,
                             std::size_t max_nodes) {
  began_ = now - totals.wall;
  since_ = now;
  std::copy(std::begin(totals.seconds), std::end(totals.seconds), std::begin(spent_));
  restarts_ = totals.restarts;
  round_ = Round{};
  previous_ = Round{};
  rollback_pending_ = false;
  stall_seen_ = 0;
  phase_ = running ? Phase::training : Phase::recovery;
  if (running && max_nodes > 0) round_.capacity = std::min(1.0, static_cast<double>(nodes) / max_nodes);
}

Spent GoodputAccount::open_category() const {
  return phase_ == Phase::waiting ? Spent::waiting : Spent::recovery;
}

void GoodputAccount::add_training(double span, double capacity) {
  spent_[static_cast<int>(Spent::productive)] += span * capacity;
  spent_[static_cast<int>(Spent::reduced_capacity)] += span * (1 - capacity);
}

void GoodputAccount::move(Spent from, Spent to, double seconds) {
  double& source = spent_[static_cast<int>(from)];
  const double x = std::clamp(seconds, 0.0, source);
  source -= x;
  spent_[static_cast<int>(to)] += x;
}

void GoodputAccount::commit(double now) {
  const double span = now - since_;
  since_ = std::max(since_, now);
  if (span <= 0) return;
  if (phase_ == Phase::ended) return;
  if (trains()) {
    add_training(span, round_.capacity);
  } else {
    spent_[static_cast<int>(open_category())] += span;
  }
}

void GoodputAccount::between_rounds(double now, bool waiting) {
  if (phase_ == Phase::ended) return;
  commit(now);
  phase_ = waiting ? Phase::waiting : Phase::recovery;
}

void GoodputAccount::round_formed(double now, std::size_t nodes, std::size_t max_nodes) {
  if (phase_ == Phase::ended) return;
  commit(now);
  phase_ = Phase::start_up;
  round_ = Round{};
  round_.capacity = max_nodes > 0 ? std::min(1.0, static_cast<double>(nodes) / max_nodes) : 1.0;
  stall_seen_ = 0;
}

void GoodputAccount::step(double now, std::int64_t step, double checkpoint_stall, std::int64_t first_step) {
  if (phase_ != Phase::start_up && phase_ != Phase::training) return;
  if (phase_ == Phase::start_up) {
    // The round's first report: it was starting (recovery) until its first step, which the
    // report names with the step it resumed at; training began that many steps ago at the last
    // rate measured (or now, without one).
    const std::int64_t resumed = first_step >= 0 && first_step <= step ? first_step : step;
    double began = now;
    if (per_step_ > 0) began = std::max(since_, now - per_step_ * static_cast<double>(step - resumed));
    if (began > since_) spent_[static_cast<int>(Spent::recovery)] += began - since_;
    since_ = std::max(since_, began);
    phase_ = Phase::training;
    ever_stepped_ = true;
    round_.resumed = resumed;
    if (per_step_ > 0) round_.steps.emplace_back(began, resumed);
    if (round_.steps.empty() || step > resumed) round_.steps.emplace_back(now, step);
    commit(now);
    if (rollback_pending_ && resolve_rollback(resumed)) rollback_pending_ = false;
    // The stall so far is the start-up's (or an earlier round's, in a worker that lived on).
    stall_seen_ = std::max(stall_seen_, checkpoint_stall);
  } else {
    commit(now);
    if (round_.steps.empty() || step > round_.steps.back().second) {
      if (round_.steps.size() >= kMaxSteps) {  // keep every other moment: coarser, still bounded
        std::size_t kept = 0;
        for (std::size_t i = 0; i < round_.steps.size(); i += 2) round_.steps[kept++] = round_.steps[i];
        round_.steps.resize(kept);
      }
      round_.steps.emplace_back(now, step);
      const auto& [first_at, first_seen] = round_.steps.front();
      per_step_ = (now - first_at) / static_cast<double>(step - first_seen);
      if (rollback_pending_ && resolve_rollback(round_.resumed)) rollback_pending_ = false;
    }
  }
  if (checkpoint_stall > stall_seen_) {
    move(Spent::productive, Spent::checkpoint, checkpoint_stall - stall_seen_);
    stall_seen_ = checkpoint_stall;
  }
}

double GoodputAccount::reached(std::int64_t step) const {
  const auto& steps = previous_.steps;
  auto after = std::find_if(steps.begin(), steps.end(), [&](const auto& s) { return s.second >= step; });
  if (after == steps.begin()) return steps.front().first;
  if (after != steps.end()) {  // between two reports
    const auto& [t0, s0] = *(after - 1);
    const auto& [t1, s1] = *after;
    return t0 + (t1 - t0) * static_cast<double>(step - s0) / static_cast<double>(s1 - s0);
  }
  const double rate = previous_.per_step > 0 ? previous_.per_step : per_step_;
  if (rate <= 0) return -1;
  return std::min(previous_.end, steps.back().first + rate * static_cast<double>(step - steps.back().second));
}

bool GoodputAccount::resolve_rollback(std::int64_t resumed_at) {
  if (previous_.steps.empty()) return true;
  const double at = reached(resumed_at);
  if (at < 0) return false;
  move(Spent::productive, Spent::lost, std::max(0.0, previous_.end - at) * previous_.capacity);
  return true;
}

void GoodputAccount::round_ended(double now) {
  if (phase_ == Phase::ended) return;
  commit(now);
  if (phase_ == Phase::training && !round_.steps.empty()) {
    const auto& [first_at, first_step] = round_.steps.front();
    const auto& [last_at, last_step] = round_.steps.back();
    const double per_step = last_step > first_step ? (last_at - first_at) / static_cast<double>(last_step - first_step) : 0;
    const double silence = now - last_at;
    round_.end = now;
    round_.per_step = per_step;
    if (silence > 2 * per_step + 2 * report_period_) {  // hung since its last step
      move(Spent::productive, Spent::hang, silence * round_.capacity);
      move(Spent::reduced_capacity, Spent::hang, silence * (1 - round_.capacity));
      round_.end = last_at;
    }
    previous_ = std::move(round_);
    rollback_pending_ = true;
  }
  round_ = Round{};
  ++restarts_;
  phase_ = Phase::recovery;
}

void GoodputAccount::ended(double now) {
  if (phase_ == Phase::ended) return;
  commit(now);
  phase_ = Phase::ended;
  ended_at_ = now;
}

GoodputTotals GoodputAccount::totals(double now) const {
  GoodputTotals t;
  std::copy(std::begin(spent_), std::end(spent_), std::begin(t.seconds));
  t.restarts = restarts_;
  const double until = phase_ == Phase::ended ? ended_at_ : std::max(now, since_);
  t.wall = std::max(0.0, until - began_);
  const double span = phase_ == Phase::ended ? 0 : until - since_;
  if (span > 0) {
    if (trains()) {
      t.seconds[static_cast<int>(Spent::productive)] += span * round_.capacity;
      t.seconds[static_cast<int>(Spent::reduced_capacity)] += span * (1 - round_.capacity);
    } else {
      t.seconds[static_cast<int>(open_category())] += span;
    }
  }
  return t;
}

}  // namespace ddp::rdzv
