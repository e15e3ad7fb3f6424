// The one endpoint parser (rendezvous/endpoint.h) that ddplaunch's command line, the agent's
// rendezvous client and `ddp-rendezvous status` share: table-driven, no sockets.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "rendezvous/endpoint.h"
#include "rendezvous/protocol.h"

using namespace ddp::rdzv;

namespace {

struct Accepted {
  const char* text;
  int default_port;
  const char* host;
  int port;
  const char* shown;  // Endpoint::text()
};

struct Refused {
  const char* text;
  const char* why;  // a part of the message
};

}  // namespace

TEST_CASE("host names, IPv4 and IPv6 addresses parse into host and port, with the default port when none is named") {
  const Accepted table[] = {
      {"head", kDefaultRendezvousPort, "head", 29400, "head:29400"},
      {"head:29401", kDefaultRendezvousPort, "head", 29401, "head:29401"},
      {"  head.example.org:1  ", kDefaultRendezvousPort, "head.example.org", 1, "head.example.org:1"},
      {"node_7-a:65535", kDefaultRendezvousPort, "node_7-a", 65535, "node_7-a:65535"},
      {"10.0.0.1", kDefaultRendezvousPort, "10.0.0.1", 29400, "10.0.0.1:29400"},
      {"10.0.0.1:5000", kDefaultRendezvousPort, "10.0.0.1", 5000, "10.0.0.1:5000"},
      {"[::1]:29400", kDefaultRendezvousPort, "::1", 29400, "[::1]:29400"},
      {"[::1]", kDefaultRendezvousPort, "::1", 29400, "[::1]:29400"},
      {"::1", kDefaultRendezvousPort, "::1", 29400, "[::1]:29400"},  // bare IPv6: no port in it
      {"fe80::1%eth0", kDefaultRendezvousPort, "fe80::1%eth0", 29400, "[fe80::1%eth0]:29400"},
      {"[fe80::1]:65535", kDefaultRendezvousPort, "fe80::1", 65535, "[fe80::1]:65535"},
      {"head", -1, "head", -1, "head"},  // no default: the port stays missing
      {"[::1]", -1, "::1", -1, "[::1]"},
      {"e1", 2379, "e1", 2379, "e1:2379"},  // etcd's default, as the launcher gives it
      {"localhost:0", kDefaultRendezvousPort, "localhost", 0, "localhost:0"},  // a free port to host on
      {"[::1]:0", kDefaultRendezvousPort, "::1", 0, "[::1]:0"},
  };
  for (const Accepted& row : table) {
    CAPTURE(row.text);
    const Endpoint e = parse_endpoint(row.text, row.default_port).value();
    CHECK(e.host == row.host);
    CHECK(e.port == row.port);
    CHECK(e.text() == row.shown);
    CHECK(parse_endpoint(e.text(), row.default_port).value() == e);  // printed, it parses back the same
  }
}

TEST_CASE("missing, empty and out-of-range ports, bad hosts and broken brackets are refused saying why") {
  const Refused table[] = {
      {"", "no host"},
      {"   ", "no host"},
      {":29400", "no host"},
      {"[]:29400", "no host"},
      {"head:", "empty port"},
      {"[::1]:", "empty port"},
      {"head:65536", "port must be a number in 0..65535"},
      {"head:99999", "port must be a number in 0..65535"},
      {"head:123456", "port must be a number in 0..65535"},
      {"head:-1", "port must be a number in 0..65535"},
      {"head:+1", "port must be a number in 0..65535"},
      {"head:12ab", "port must be a number in 0..65535"},
      {"127.0.0.1:notaport", "port must be a number in 0..65535"},
      {"head: 1", "port must be a number in 0..65535"},
      {"[::1", "missing ']'"},
      {"[::1]x", "junk after ']'"},
      {"[::1]29400", "junk after ']'"},
      {"bad host", "not a host name or address"},
      {"evil\nhost:1", "not a host name or address"},
      {"fe80::1:29400", "[ADDRESS]:PORT"},  // a bare IPv6 address never carries a port
      {"[head]:1", "not an IPv6 address"},  // brackets are for IPv6 addresses
      {"[1.2.3.4::]", "not an IPv6 address"},
  };
  for (const Refused& row : table) {
    CAPTURE(row.text);
    const ddp::Expected<Endpoint> e = parse_endpoint(row.text);
    REQUIRE_FALSE(e);
    CHECK(e.error().find(row.why) != std::string::npos);
  }
  CHECK_FALSE(parse_endpoint(std::string(300, 'a')));  // longer than a DNS name
}

TEST_CASE("port 0 parses, but an endpoint to connect to needs a port other than 0") {
  CHECK(connect_error(parse_endpoint("head:29400").value()).empty());
  CHECK(connect_error(parse_endpoint("[::1]").value()).empty());  // the default port
  const std::string zero = connect_error(parse_endpoint("head:0").value());
  CHECK(zero.find("head:0") != std::string::npos);
  CHECK(zero.find("port 0") != std::string::npos);
  CHECK(zero.find("cannot be connected to") != std::string::npos);
  CHECK(connect_error(parse_endpoint("[::1]:0").value()).find("[::1]:0: port 0") != std::string::npos);
  CHECK(connect_error(parse_endpoint("head", -1).value()).find("names no port") != std::string::npos);
}

TEST_CASE("a list of endpoints parses item by item, skipping blanks, and names the bad item") {
  const std::vector<Endpoint> list = parse_endpoint_list(" head:29401, standby ,,[::1]:7 ").value();
  REQUIRE(list.size() == 3);
  CHECK(list[0] == Endpoint{"head", 29401});
  CHECK(list[1] == Endpoint{"standby", kDefaultRendezvousPort});
  CHECK(list[2] == Endpoint{"::1", 7});
  CHECK(parse_endpoint_list("a", 2379).value() == std::vector<Endpoint>{Endpoint{"a", 2379}});
  CHECK(parse_endpoint_list("head:29401,standby:99999").error() == "standby:99999: port must be a number in 0..65535");
  CHECK(parse_endpoint_list(" , ").error() == "no endpoint given");
}

TEST_CASE("a leader on the wire is an endpoint to connect to, in the form Endpoint::text() writes") {
  for (const char* good : {"", "head:1", "10.0.0.1:29400", "[fe80::1]:65535"}) {
    CHECK_MESSAGE(valid_leader_endpoint(good), good);
  }
  for (const char* bad : {"head", "head:0", " head:1", "head:01", "[head]:1", "fe80::1:29400", "::1", "[::1]"}) {
    CHECK_FALSE_MESSAGE(valid_leader_endpoint(bad), bad);
  }
}
