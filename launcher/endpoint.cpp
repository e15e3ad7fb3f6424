// HOST[:PORT] (launcher/endpoint.h).
#include "launcher/endpoint.h"

namespace ddp::launcher {

std::string Endpoint::text() const {
  const std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return port < 0 ? shown : shown + ":" + std::to_string(port);
}

Endpoint parse_endpoint(const Given& g, int default_port) {
  const char* accepted = "HOST[:PORT] or [IPv6][:PORT], PORT in 0..65535";
  const std::string s = trim(g.value);
  std::string host;
  std::string port;
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string::npos) refuse(g.shown() + ": missing ']'; accepted: " + accepted);
    host = s.substr(1, close - 1);
    const std::string rest = s.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') refuse(g.shown() + ": junk after ']'; accepted: " + accepted);
      port = rest.substr(1);
      if (port.empty()) refuse(g.shown() + ": empty port; accepted: " + accepted);
    }
  } else {
    const auto colon = s.rfind(':');
    const bool bare_ipv6 = colon != std::string::npos && s.find(':') != colon;
    if (colon == std::string::npos || bare_ipv6) {
      host = s;
    } else {
      host = s.substr(0, colon);
      port = s.substr(colon + 1);
      if (port.empty()) refuse(g.shown() + ": empty port; accepted: " + accepted);
    }
  }
  if (!valid_host(host)) refuse(g.shown() + ": not a host name or address; accepted: " + accepted);
  Endpoint endpoint{host, default_port};
  if (!port.empty()) {
    auto n = to_integer(port);
    if (!n || *n < 0 || *n > 65535) refuse(g.shown() + ": bad port; accepted: " + accepted);
    endpoint.port = static_cast<int>(*n);
  }
  return endpoint;
}

}  // namespace ddp::launcher
