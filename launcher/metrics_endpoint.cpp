#include "launcher/metrics_endpoint.h"

#include <cstdio>

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "agent/metrics.h"
#include "agent/remote_rendezvous.h"
#include "metrics/exposition.h"
#include "rendezvous/server.h"

namespace ddp::launcher {

namespace {

// What `/` says on an agent without a rendezvous server of its own.
std::string dashboard_elsewhere(const LaunchConfig& config) {
  const std::string own = " This agent's own metrics are at /metrics.";
  if (config.rdzv_backend == RendezvousBackend::kEtcd || config.rdzv_backend == RendezvousBackend::kEtcdV2) {
    return "No dashboard here: with --rdzv_backend=etcd the job's rendezvous is a replica among its agents, "
           "and replicas serve no dashboard (docs/dashboard.md)." + own;
  }
  if (!config.rdzv_endpoint) {
    return "No dashboard here: this single-node job runs on ddplaunch's embedded rendezvous, which keeps no job "
           "status. Run it with --standalone (which hosts a rendezvous server) to get a dashboard at / "
           "(docs/dashboard.md)." + own;
  }
  return "No dashboard here: this agent does not host the rendezvous server at " + config.rdzv_endpoint->text() +
         ". The dashboard is served at / of the metrics endpoint of whoever hosts it: ddp-rendezvous "
         "--metrics_port=PORT, or the ddplaunch that hosts it in-process, started with --metrics_port "
         "(docs/dashboard.md)." + own;
}

}  // namespace

HostedEvents hosted_events(const LaunchConfig& config) {
  HostedEvents h;
  if (!config.metrics_port) return h;
  h.recent = std::make_shared<metrics::EventRing>();
  h.bus = std::make_shared<metrics::EventBus>();
  h.bus->add(h.recent);
  return h;
}

std::unique_ptr<metrics::HttpServer> serve_metrics(boost::asio::io_context& io, const LaunchConfig& config,
                                                   metrics::EventBus& bus, agent::AgentOptions& options,
                                                   const agent::RendezvousHandler& rendezvous,
                                                   const HostedEvents& hosted) {
  if (!config.metrics_port) return nullptr;
  auto agent_metrics = std::make_shared<agent::AgentMetrics>();
  bus.add(agent_metrics);
  std::unique_ptr<metrics::HttpServer> http;
  boost::system::error_code ec;
  const auto addr = boost::asio::ip::make_address(config.metrics_addr, ec);
  if (ec) throw LaunchError(ExitCode::kUsage, "ddplaunch: --metrics_addr " + config.metrics_addr + ": not an IP address");
  try {
    http = std::make_unique<metrics::HttpServer>(
        io, boost::asio::ip::tcp::endpoint(addr, static_cast<unsigned short>(*config.metrics_port)));
  } catch (const boost::system::system_error& e) {
    throw LaunchError(ExitCode::kUsage, "ddplaunch: --metrics_port: cannot listen on " + config.metrics_addr + ":" +
                     std::to_string(*config.metrics_port) + ": " + e.code().message());
  }
  http->route("/metrics", [agent_metrics] {
    return metrics::HttpResponse{200, metrics::kExpositionContentType, agent_metrics->render()};
  });
  http->route("/healthz", [] { return metrics::HttpResponse{200, "text/plain; charset=utf-8", "ok\n"}; });
  http->route("/readyz", [agent_metrics] {
    return agent_metrics->running() > 0
               ? metrics::HttpResponse{200, "text/plain; charset=utf-8", "workers running\n"}
               : metrics::HttpResponse{503, "text/plain; charset=utf-8", "no worker running\n"};
  });
  const auto* remote = dynamic_cast<const agent::RemoteRendezvous*>(&rendezvous);
  const rdzv::Server* server = remote ? remote->hosted_server() : nullptr;
  if (server) {
    metrics::serve_dashboard(*http, {[server] { return server->status(); }, hosted.recent});
  } else {
    metrics::serve_dashboard_elsewhere(*http, dashboard_elsewhere(config));
  }
  options.on_progress = [agent_metrics](int local_rank, int64_t step, double time) {
    agent_metrics->set_progress(local_rank, static_cast<double>(step), time);
  };
  std::fprintf(stderr, "ddplaunch: metrics on http://%s:%u/metrics%s\n", config.metrics_addr.c_str(),
               static_cast<unsigned>(http->port()), server ? " (dashboard of the hosted rendezvous at /)" : "");
  return http;
}

}  // namespace ddp::launcher
