// ddplaunch --metrics_port: the agent's HTTP endpoint (docs/metrics.md): its metrics, health
// and readiness, and at `/` the dashboard (docs/dashboard.md) of the rendezvous server this
// agent hosts in-process, or, when it hosts none, a note saying where the dashboard is.
// Built by launch() on the agent's io_context; everything it serves is read on that thread.
#pragma once

#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "agent/agent.h"
#include "agent/rendezvous_handler.h"
#include "launcher/config.h"
#include "metrics/dashboard.h"
#include "metrics/event.h"
#include "metrics/http_server.h"

namespace ddp::launcher {

// The recent events of a server the agent may host: made before the rendezvous (which hands
// them to its hosted server, stamped by an EventBus), read by the dashboard. Null without
// --metrics_port.
struct HostedEvents {
  std::shared_ptr<metrics::EventRing> recent;
  std::shared_ptr<metrics::EventBus> bus;  // stamps each event's time, then records it in `recent`
};
HostedEvents hosted_events(const LaunchConfig& config);

// Serves the agent's endpoint on `io` (null without --metrics_port): adds its metrics to `bus`,
// its progress hook to `options`, and the dashboard of `rendezvous`'s hosted server, if any.
// REQUIRES: `rendezvous` outlives the returned server's use on `io` (both live in launch()).
// Throws LaunchError (exit 2) when the address or port cannot be used.
std::unique_ptr<metrics::HttpServer> serve_metrics(boost::asio::io_context& io, const LaunchConfig& config,
                                                   metrics::EventBus& bus, agent::AgentOptions& options,
                                                   const agent::RendezvousHandler& rendezvous,
                                                   const HostedEvents& hosted);

}  // namespace ddp::launcher
