// HOST[:PORT] as ddplaunch's command line writes an endpoint (--rdzv_endpoint, and with the
// static backend the master address). One parser for every flag that takes one. Pure; any
// thread.
#pragma once

#include <string>

#include "launcher/values.h"

namespace ddp::launcher {

struct Endpoint {
  std::string host;  // a name or address; IPv6 without brackets
  int port = -1;     // -1 when the text names none and no default was given
  // "host:port", "[v6]:port", or the host alone when port < 0.
  std::string text() const;
};

// Parses HOST[:PORT] or [IPV6][:PORT] (a bare IPv6 address without a port is accepted too).
// `default_port` fills a missing port (-1: leave it missing). Throws UsageError naming `g`.
Endpoint parse_endpoint(const Given& g, int default_port);

}  // namespace ddp::launcher
