#include "rendezvous/replica.h"

#include <chrono>
#include <utility>

#include <boost/asio/post.hpp>

namespace ddp::rdzv {

namespace asio = boost::asio;

Replica::Replica(asio::io_context& io, const asio::ip::tcp::endpoint& listen, ReplicaOptions options)
    : io_(io), log_(std::move(options.log)), leadership_timer_(io) {
  ServerOptions server_options = std::move(options.server);
  server_options.replicated = true;
  server_options.write_records = [this](RecordWrite w) {
    if (election_) election_->write(std::move(w));
  };
  server_options.on_redirect = [this](const std::string& leader) {
    if (election_) election_->redirected(leader);
  };
  server_ = std::make_unique<Server>(io_, listen, std::move(server_options));
  std::string host = options.advertise_host;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  endpoint_ = Endpoint{host, server_->port()};

  ElectionOptions e;
  e.etcd = std::move(options.etcd);
  e.key = options.prefix + "leader";
  e.records_prefix = options.prefix + "jobs/";
  e.me = endpoint_.text();
  e.lease_ttl = options.lease_ttl;
  std::weak_ptr<bool> alive = alive_;
  // Every callback runs on the election thread: it posts to the io_context and does nothing there
  // once this replica is gone.
  e.log = [this, alive](const std::string& line) {
    asio::post(io_, [this, alive, line] {
      if (alive.lock() && log_) log_("etcd: " + line);
    });
  };
  e.on_written = [this, alive](std::uint64_t seq, const std::string& error, std::uint64_t) {
    asio::post(io_, [this, alive, seq, error] {
      if (alive.lock() && server_->serving()) server_->records_written(seq, error);
    });
  };
  e.on_change = [this, alive](const Leadership& l) {
    asio::post(io_, [this, alive, l] {
      if (alive.lock()) on_change(l);
    });
  };
  election_ = std::make_unique<Election>(std::move(e));
  election_->start();
}

Replica::~Replica() { stop(); }

void Replica::on_change(const Leadership& l) {
  if (stopped_ || !server_->serving()) return;
  const bool leading = l.leading && std::chrono::steady_clock::now() < l.valid_until;
  server_->set_leadership(leading, l.leader, l.records ? &*l.records : nullptr);
  if (!leading) return;
  // A leader steps down at valid_until by this loop's own timer, even while the election thread
  // is stuck in an etcd call: etcd frees the key at the earliest a quarter TTL later.
  leadership_timer_.expires_at(l.valid_until);
  leadership_timer_.async_wait([this, alive = std::weak_ptr<bool>(alive_)](const boost::system::error_code& ec) {
    if (ec || !alive.lock() || stopped_ || !server_->leading()) return;
    if (log_) log_("etcd: the lease was not renewed in time: stepping down before it can expire");
    server_->set_leadership(false, "");
  });
}

void Replica::stop() {
  if (stopped_) return;
  stopped_ = true;
  leadership_timer_.cancel();
  server_->stop();
  election_->stop();  // a leader revokes its lease
}

}  // namespace ddp::rdzv
