// An endpoint given on the command line (launcher/endpoint.h).
#include "launcher/endpoint.h"

namespace ddp::launcher {

Endpoint parse_endpoint(const Given& g, int default_port) {
  Expected<Endpoint> endpoint = rdzv::parse_endpoint(g.value, default_port);
  if (!endpoint) refuse(g.shown() + ": " + endpoint.error() + "; accepted: " + rdzv::kEndpointSyntax);
  return std::move(*endpoint);
}

}  // namespace ddp::launcher
