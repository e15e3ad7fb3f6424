#include "rendezvous/reach.h"

#include <chrono>
#include <memory>
#include <utility>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "rendezvous/cloexec.h"
#include "rendezvous/endpoint.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

void knock(asio::io_context& io, const tcp::endpoint& target, double within, std::function<void(Reach)> done) {
  auto socket = std::make_shared<tcp::socket>(io);
  boost::system::error_code ec;
  socket->open(target.protocol(), ec);
  if (ec) {
    asio::post(io, [done = std::move(done)] { done(Reach::silent); });
    return;
  }
  close_on_exec(socket->native_handle());
  auto timer = std::make_shared<asio::steady_timer>(io);
  timer->expires_after(std::chrono::duration_cast<asio::steady_timer::duration>(std::chrono::duration<double>(within)));
  timer->async_wait([socket](boost::system::error_code e) {
    boost::system::error_code ignored;
    if (!e) socket->close(ignored);  // the connect's handler then sees operation_aborted
  });
  socket->async_connect(target, [socket, timer, done = std::move(done)](boost::system::error_code e) {
    timer->cancel();
    boost::system::error_code ignored;
    socket->close(ignored);
    done(!e ? Reach::made : e == asio::error::connection_refused ? Reach::refused : Reach::silent);
  });
}

Reach knock(const std::string& host_port, double within) {
  Expected<Endpoint> e = parse_endpoint(host_port, -1);
  if (!e || e->port <= 0) return Reach::silent;
  asio::io_context io;
  boost::system::error_code ec;
  const auto found = tcp::resolver(io).resolve(e->host, std::to_string(e->port), tcp::resolver::numeric_service, ec);
  if (ec || found.empty()) return Reach::silent;
  Reach reach = Reach::silent;
  knock(io, found.begin()->endpoint(), within, [&reach](Reach r) { reach = r; });
  io.run();
  return reach;
}

}  // namespace ddp::rdzv
