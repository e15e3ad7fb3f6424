// An endpoint given on ddplaunch's command line (--rdzv_endpoint, and with the static backend
// the master address): the rendezvous' one parser (rendezvous/endpoint.h), with refusals that
// name the flag and where its value came from. Pure; any thread.
#pragma once

#include "launcher/values.h"
#include "rendezvous/endpoint.h"

namespace ddp::launcher {

using rdzv::Endpoint;

// Parses `g`'s value as rdzv::parse_endpoint does; `default_port` fills a missing port (-1:
// leave it missing). Throws LaunchError naming `g`.
Endpoint parse_endpoint(const Given& g, int default_port);

}  // namespace ddp::launcher
