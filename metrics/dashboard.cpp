#include "metrics/dashboard.h"

#include <utility>

namespace ddp::metrics {

extern const char kDashboardPage[];  // generated from dashboard.html (metrics/CMakeLists.txt)

namespace {

constexpr const char* kJson = "application/json; charset=utf-8";

// Text from workers and peers may be invalid UTF-8: replaced, never thrown.
std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace

void EventRing::record(const Event& event) {
  if (events_.size() == capacity_) events_.pop_front();
  events_.push_back(event);
  ++recorded_;
}

nlohmann::json EventRing::json() const {
  nlohmann::json events = nlohmann::json::array();
  for (const Event& e : events_) events.push_back(to_json(e));
  return {{"capacity", capacity_}, {"recorded", recorded_}, {"events", std::move(events)}};
}

std::string_view dashboard_page() { return kDashboardPage; }

void serve_dashboard(HttpServer& http, DashboardSource source) {
  http.route("/", [] { return HttpResponse{200, "text/html; charset=utf-8", std::string(dashboard_page())}; });
  http.route("/api/status", [status = std::move(source.status)] { return HttpResponse{200, kJson, dump(status())}; });
  http.route("/api/events", [events = std::move(source.events)] {
    const nlohmann::json body = events ? events->json()
                                       : nlohmann::json{{"capacity", 0}, {"recorded", 0}, {"events", nlohmann::json::array()}};
    return HttpResponse{200, kJson, dump(body)};
  });
}

void serve_dashboard_elsewhere(HttpServer& http, const std::string& where) {
  http.route("/", [text = where + "\n"] { return HttpResponse{200, "text/plain; charset=utf-8", text}; });
}

}  // namespace ddp::metrics
