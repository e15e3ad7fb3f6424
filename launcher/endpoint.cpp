// An endpoint given on the command line (launcher/endpoint.h).
#include "launcher/endpoint.h"

namespace ddp::launcher {

Endpoint parse_endpoint(const Given& g, int default_port) {
  try {
    return rdzv::parse_endpoint(g.value, default_port);
  } catch (const rdzv::EndpointError& e) {
    refuse(g.shown() + ": " + e.what() + "; accepted: " + rdzv::kEndpointSyntax);
  }
}

}  // namespace ddp::launcher
