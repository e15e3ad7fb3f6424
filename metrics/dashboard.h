// The live dashboard (docs/dashboard.md): one self-contained HTML page at `/` (its CSS and script
// inline, compiled into the binary from metrics/dashboard.html; nothing fetched from elsewhere)
// that polls two JSON routes of the same server:
//   /api/status  the rendezvous' status, the JSON `ddp-rendezvous status --json` prints;
//   /api/events  the last events of every job (EventRing below), for the timeline.
// Read-only: the routes only read. They ride on the metrics HttpServer, so they have its bounds
// (GET and HEAD, request head size, deadline, connection cap) and its address (--metrics_addr).
//
// The page puts text from the status and events (job ids, hosts, failure messages that carry
// workers' error text) into the page as text nodes only, never as markup.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "metrics/event.h"
#include "metrics/http_server.h"

namespace ddp::metrics {

// The last `capacity` events recorded, oldest first: the dashboard's timeline. A sink of the
// daemon's (or a hosting agent's) EventBus; owned by that bus and the dashboard's routes; called
// on the io_context thread that records events and serves HTTP, so it takes no lock.
class EventRing : public EventSink {
 public:
  // REQUIRES: capacity > 0. Default 512: a few restarts of many jobs, and at most ~2 MiB of JSON
  // (a failure message is at most 4 KiB).
  explicit EventRing(std::size_t capacity = 512) : capacity_(capacity) {}
  void record(const Event& event) override;
  // {"capacity": N, "recorded": events recorded since start, "events": [to_json(event), ...]}.
  nlohmann::json json() const;

 private:
  std::size_t capacity_;
  std::deque<Event> events_;
  std::uint64_t recorded_ = 0;
};

// What the dashboard shows. `status` is called on the server's thread for each /api/status.
struct DashboardSource {
  std::function<nlohmann::json()> status;  // {"jobs": [...]}, as `status --json` prints it
  std::shared_ptr<const EventRing> events;  // may be null: the timeline then stays empty
};

// Serves `/` (the page), `/api/status` and `/api/events` on `http`.
void serve_dashboard(HttpServer& http, DashboardSource source);

// Serves `/` as a short plain-text note saying where the dashboard is instead (`where`): an agent
// that does not host the rendezvous has no job status of its own to show.
void serve_dashboard_elsewhere(HttpServer& http, const std::string& where);

// The page itself (metrics/dashboard.html, embedded at build time).
std::string_view dashboard_page();

}  // namespace ddp::metrics
