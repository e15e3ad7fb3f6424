#include "agent/remote_rendezvous.h"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include <boost/asio.hpp>

#include "rendezvous/client.h"
#include "rendezvous/server.h"

namespace ddp::agent {
namespace {

using boost::asio::ip::tcp;

std::vector<boost::asio::ip::address> interface_addresses() {
  std::vector<boost::asio::ip::address> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr) continue;
    if (it->ifa_addr->sa_family == AF_INET) {
      auto* sin = reinterpret_cast<sockaddr_in*>(it->ifa_addr);
      boost::asio::ip::address_v4::bytes_type b;
      std::memcpy(b.data(), &sin->sin_addr, 4);
      out.emplace_back(boost::asio::ip::address_v4(b));
    } else if (it->ifa_addr->sa_family == AF_INET6) {
      auto* sin6 = reinterpret_cast<sockaddr_in6*>(it->ifa_addr);
      boost::asio::ip::address_v6::bytes_type b;
      std::memcpy(b.data(), &sin6->sin6_addr, 16);
      out.emplace_back(boost::asio::ip::address_v6(b, sin6->sin6_scope_id));
    }
  }
  freeifaddrs(list);
  return out;
}

}  // namespace

bool is_local_host(const std::string& host) {
  if (host.empty() || host == "localhost") return true;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && host == name) return true;
  boost::system::error_code ec;
  auto addr = boost::asio::ip::make_address(host, ec);
  if (ec) {
    // A name: resolve it forwards (never reverse DNS) and compare every address it gives.
    boost::asio::io_context io;
    tcp::resolver resolver(io);
    auto results = resolver.resolve(host, "", ec);
    if (ec) return false;
    for (const auto& entry : results) {
      auto a = entry.endpoint().address();
      if (a.is_loopback()) return true;
      for (const auto& mine : interface_addresses()) {
        if (mine == a) return true;
      }
    }
    return false;
  }
  if (addr.is_loopback()) return true;
  for (const auto& mine : interface_addresses()) {
    if (mine == addr) return true;
  }
  return false;
}

RemoteRendezvous::RemoteRendezvous(boost::asio::io_context& io, RemoteRendezvousOptions options)
    : io_(io), options_(std::move(options)) {
  rdzv::ServerOptions server_options;
  server_options.token = options_.token;
  server_options.log = [this](const std::string& line) { log("rendezvous server: " + line); };
  if (options_.standalone) {
    // A free port on loopback: the whole job is on this node.
    server_ = std::make_unique<rdzv::Server>(
        io_, tcp::endpoint(boost::asio::ip::address_v4::loopback(), 0), server_options);
    endpoint_ = "127.0.0.1:" + std::to_string(server_->port());
    return;
  }
  endpoint_ = options_.endpoint;
  auto [host, port] = rdzv::parse_endpoint(options_.endpoint);
  if (options_.host_if_local && is_local_host(host)) {
    // Nothing listening there yet: this agent becomes the host. Someone already bound it (the
    // daemon, or an agent of this host that came first): be a client like everyone else.
    try {
      server_ = std::make_unique<rdzv::Server>(io_, tcp::endpoint(tcp::v4(), port), server_options);
      log("hosting the rendezvous server in-process on port " + std::to_string(port));
    } catch (const boost::system::system_error&) {
      server_.reset();
    }
  }
}

RemoteRendezvous::~RemoteRendezvous() {
  if (client_) client_->close();
  if (server_) server_->stop();
}

void RemoteRendezvous::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "[ddplaunch] %s\n", line.c_str());
  }
}

void RemoteRendezvous::set_events(RendezvousEvents events) { events_ = std::move(events); }

void RemoteRendezvous::start_client() {
  rdzv::ClientOptions client_options;
  client_options.job_id = options_.job_id;
  client_options.token = options_.token;
  rdzv::ClientEvents ev;
  ev.on_round = [this](const rdzv::Assignment& a) {
    if (events_.on_round) events_.on_round(a);
  };
  ev.on_restart = [this](const std::string& reason, bool counted) {
    if (events_.on_restart) events_.on_restart(reason, counted);
  };
  ev.on_job_succeeded = [this] {
    if (events_.on_job_succeeded) events_.on_job_succeeded();
  };
  ev.on_job_failed = [this](const rdzv::WorkerFailure& f, const std::string& summary) {
    if (events_.on_job_failed) events_.on_job_failed(f, summary);
  };
  ev.on_error = [this](const std::string& message) {
    if (events_.on_rendezvous_error) events_.on_rendezvous_error(message);
  };
  ev.on_log = [this](const std::string& message) { log(message); };
  client_ = rdzv::Client::create(io_, std::move(client_options), std::move(ev));
  client_->connect(endpoint_, options_.connect_timeout);
}

void RemoteRendezvous::join(const rdzv::NodeSpec& spec) {
  if (!client_) start_client();
  client_->join(spec);
}

void RemoteRendezvous::report_failure(const rdzv::WorkerFailure& failure) {
  if (client_) client_->report_failure(failure);
}

void RemoteRendezvous::report_success() {
  if (client_) client_->report_success();
}

void RemoteRendezvous::close() {
  if (client_) client_->close();
}

}  // namespace ddp::agent
