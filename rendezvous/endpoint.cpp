// HOST[:PORT] (rendezvous/endpoint.h).
#include "rendezvous/endpoint.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

namespace ddp::rdzv {

namespace {

constexpr std::size_t kMaxHostBytes = 255;  // as DNS allows

std::string_view trim(std::string_view s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string_view::npos) return {};
  const auto end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

bool valid_host(std::string_view host) {
  if (host.empty() || host.size() > kMaxHostBytes) return false;
  return std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == ':' || c == '%';
  });
}

// A host in brackets or with a ':' is an IPv6 address (with an optional %zone).
bool valid_ipv6(std::string_view host) {
  const std::string address(host.substr(0, host.find('%')));
  in6_addr parsed{};
  return inet_pton(AF_INET6, address.c_str(), &parsed) == 1;
}

Expected<int> parse_port(std::string_view port) {
  if (port.empty()) return unexpected("empty port");
  if (port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return unexpected("port must be a number in 0..65535");
  }
  int value = 0;
  for (char c : port) value = value * 10 + (c - '0');
  if (value > 65535) return unexpected("port must be a number in 0..65535");
  return value;
}

}  // namespace

std::string Endpoint::text() const {
  const std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return port < 0 ? shown : shown + ":" + std::to_string(port);
}

Expected<Endpoint> parse_endpoint(std::string_view text, int default_port) {
  const std::string_view s = trim(text);
  std::string_view host = s;
  std::string_view port;
  bool has_port = false;
  const bool bracketed = !s.empty() && s.front() == '[';
  if (bracketed) {
    const auto close = s.find(']');
    if (close == std::string_view::npos) return unexpected("missing ']'");
    host = s.substr(1, close - 1);
    const std::string_view rest = s.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return unexpected("junk after ']'");
      port = rest.substr(1);
      has_port = true;
    }
  } else if (const auto colon = s.rfind(':'); colon != std::string_view::npos && s.find(':') == colon) {
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
    has_port = true;
  }  // else no colon (a host alone), or several: a bare IPv6 address, which has no port
  if (host.empty()) return unexpected("no host");
  if (!valid_host(host)) return unexpected("not a host name or address");
  if ((bracketed || host.find(':') != std::string_view::npos) && !valid_ipv6(host)) {
    return unexpected("not an IPv6 address (an IPv6 address with a port is written [ADDRESS]:PORT)");
  }
  Endpoint endpoint{std::string(host), default_port};
  if (!has_port) return endpoint;
  const Expected<int> number = parse_port(port);
  if (!number) return unexpected(number.error());
  endpoint.port = *number;
  return endpoint;
}

Expected<std::vector<Endpoint>> parse_endpoint_list(std::string_view text, int default_port) {
  std::vector<Endpoint> out;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    const std::string_view item = trim(text.substr(begin, comma - begin));
    if (!item.empty()) {
      Expected<Endpoint> endpoint = parse_endpoint(item, default_port);
      if (!endpoint) return unexpected(std::string(item) + ": " + endpoint.error());
      out.push_back(std::move(*endpoint));
    }
    begin = comma + 1;
  }
  if (out.empty()) return unexpected("no endpoint given");
  return out;
}

std::string connect_error(const Endpoint& endpoint) {
  if (endpoint.port < 0) return endpoint.text() + " names no port";
  if (endpoint.port == 0) {
    return endpoint.text() + ": port 0 (a free port) cannot be connected to; give the port the rendezvous "
           "listens on";
  }
  return "";
}

}  // namespace ddp::rdzv
