#include "metrics/event.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace ddp::metrics {

double wall_time() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

nlohmann::json to_json(const Event& e) {
  nlohmann::json j = {{"time", e.time},           {"type", e.type},   {"job", e.job},
                      {"node", e.node},           {"generation", e.generation},
                      {"ranks", e.ranks},         {"cause", e.cause}};
  if (!e.message.empty()) j["message"] = e.message;
  if (e.fields.is_object()) {
    for (auto it = e.fields.begin(); it != e.fields.end(); ++it) {
      if (!j.contains(it.key())) j[it.key()] = it.value();  // the common keys cannot be overridden
    }
  }
  return j;
}

std::string to_json_line(const Event& e) {
  // Text from workers and peers may be invalid UTF-8: replace, never throw.
  return to_json(e).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void EventBus::record(const Event& event) {
  if (sinks_.empty()) return;
  if (event.time != 0) {
    for (auto& s : sinks_) s->record(event);
    return;
  }
  Event stamped = event;
  stamped.time = wall_time();
  for (auto& s : sinks_) s->record(stamped);
}

EventLog::EventLog(const std::string& path) : path_(path) {
  if (path == "-") {
    file_ = stderr;
    return;
  }
  file_ = std::fopen(path.c_str(), "ae");
  if (!file_) throw std::runtime_error("open event log " + path + ": " + std::strerror(errno));
  owned_ = true;
}

EventLog::~EventLog() {
  if (owned_ && file_) std::fclose(file_);
}

void EventLog::record(const Event& event) {
  if (!file_) return;
  std::string line = to_json_line(event);
  line += '\n';
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    if (!failed_) std::fprintf(stderr, "event log %s: write failed: %s (events are dropped from now on)\n",
                               path_.c_str(), std::strerror(errno));
    failed_ = true;
  }
}

}  // namespace ddp::metrics
