// One TCP connection attempt that says whether a host answers at a port. A connection made means
// something listens there; a refused one (ECONNREFUSED) that the host is up and nothing listens
// on the port; no answer within the time says nothing. A probe's peer check (client.cpp: a
// refusal or a connection proves the peer's host is up) and a follower's check of its leader
// (election.cpp: a refusal proves the leader's process is gone) both ask it.
#pragma once

#include <functional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

namespace ddp::rdzv {

enum class Reach { made, refused, silent };

// Starts one connection to `target` on `io`; `done` gets the verdict once, on `io`'s thread,
// within `within` seconds (silent when the socket cannot even be opened). The connection is
// closed at once either way.
void knock(boost::asio::io_context& io, const boost::asio::ip::tcp::endpoint& target, double within,
           std::function<void(Reach)> done);

// The same from a thread with no loop of its own (the election's), blocking for at most `within`
// seconds after resolving HOST:PORT (an address or a name; the first address found is tried).
// Unparsable or unresolvable: silent.
Reach knock(const std::string& host_port, double within);

}  // namespace ddp::rdzv
