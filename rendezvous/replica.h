// One replica of an etcd-backed rendezvous (docs/etcd.md): a Server that follows until
// its Election wins the leader key, writes its job records through that election, and steps
// down by its own timer when the lease was not renewed in time. The wiring ddp-rendezvous --etcd
// does in its main, packaged so that an agent can host a replica of its job's rendezvous
// in-process (--rdzv_backend=etcd / etcd-v2: every agent hosts one, no head node).
//
// Owned by its creator (agent/remote_rendezvous.*); lives until stop() or destruction. Every
// call runs on the io_context's thread; the election runs its own thread and posts its news to
// that io_context (a handler posted after destruction does nothing: it holds a weak flag).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "rendezvous/election.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/server.h"

namespace ddp::rdzv {

struct ReplicaOptions {
  ServerOptions server;        // `replicated` and `write_records` are set by the Replica
  EtcdOptions etcd;
  std::string prefix;          // e.g. "/ddplaunch/jobs/JOB/": PREFIX + "leader", PREFIX + "jobs/"
  int lease_ttl = 5;           // seconds of the leader's lease (2..600); default 5
  // HOST of the endpoint advertised in the leader key (HOST:PORT, the port the server bound).
  // REQUIRES: not empty.
  std::string advertise_host;
  std::function<void(const std::string&)> log;  // the election's lines ("etcd: ..."); empty = none
};

class Replica {
 public:
  // Binds `listen` (port 0 = a free one) and starts following; the election starts at once.
  // Throws boost::system::system_error when it cannot bind.
  Replica(boost::asio::io_context& io, const boost::asio::ip::tcp::endpoint& listen, ReplicaOptions options);
  ~Replica();
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;

  // Closes the server and stops the election: a leader revokes its lease (one etcd call's
  // deadline at most), so that another replica takes over at once instead of after the TTL.
  void stop();
  // Where agents reach this replica; the leader key names it as endpoint().text().
  const Endpoint& endpoint() const { return endpoint_; }
  bool leading() const { return server_ && server_->leading(); }

 private:
  void on_change(const Leadership& l);

  boost::asio::io_context& io_;
  std::function<void(const std::string&)> log_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Election> election_;  // declared after server_: stopped before it goes
  boost::asio::steady_timer leadership_timer_;
  Endpoint endpoint_;
  bool stopped_ = false;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace ddp::rdzv
