// HOST[:PORT]: the one parser of a rendezvous endpoint, shared by ddplaunch's command line
// (--rdzv_endpoint, the static backend's master address, etcd's endpoints), the agent's
// rendezvous client and `ddp-rendezvous status`. An endpoint is parsed once, where the text
// enters (a flag, the environment), and travels as an Endpoint value from there on.
//
// Pure (no Boost.Asio, no name resolution); any thread.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "rendezvous/error.h"

namespace ddp::rdzv {

// The port of the rendezvous when an endpoint names none, the daemon's default --port, and
// torchrun's c10d default.
inline constexpr int kDefaultRendezvousPort = 29400;

// What parse_endpoint accepts, for messages.
inline constexpr const char* kEndpointSyntax = "HOST[:PORT] or [IPv6][:PORT], PORT in 0..65535";

struct Endpoint {
  std::string host;  // a name or an address; an IPv6 address without its brackets
  int port = -1;     // 0..65535; -1 when the text named none and no default was given
  // "host:port", "[v6]:port", or the host alone when port < 0. parse_endpoint(text()) gives
  // this endpoint back.
  std::string text() const;
  bool operator==(const Endpoint& o) const { return host == o.host && port == o.port; }
  bool operator!=(const Endpoint& o) const { return !(*this == o); }
};

// Parses HOST[:PORT], [IPv6][:PORT] or a bare IPv6 address (which cannot carry a port: "::1"
// is the host ::1, and "fe80::1:29400" is refused as no address). Blanks around the text are
// ignored. HOST is letters, digits and . - _ (at most 255 bytes), or an IPv6 address with an
// optional %zone; PORT is decimal, 0..65535. `default_port` fills a missing port (-1:
// leave it missing). Port 0 is accepted here: it means "a free port" to a node that hosts the
// rendezvous; connect_error() refuses it for an endpoint to connect to. A refused text's reason
// says why ("missing ']'", "empty port", ...) without repeating the text, so that the caller
// names the flag it came from.
Expected<Endpoint> parse_endpoint(std::string_view text, int default_port = kDefaultRendezvousPort);

// A comma-separated list of endpoints, each parsed as above (blank items are skipped). Refused,
// naming the item, when one is bad, or when none is given.
Expected<std::vector<Endpoint>> parse_endpoint_list(std::string_view text, int default_port = kDefaultRendezvousPort);

// "" when a client can connect to `endpoint`, else why not (no port, port 0).
std::string connect_error(const Endpoint& endpoint);

}  // namespace ddp::rdzv
