// The multi-node rendezvous as the agent sees it: the TCP client of rendezvous/ behind the
// agent's RendezvousHandler interface. With `--rdzv_backend=c10d` and an endpoint on this host
// where nothing listens yet, the first agent hosts the server in-process (as torchrun's c10d
// backend does); `--standalone` hosts one on a free loopback port.
//
// Owned by the Agent; lives as long as the agent run; every call and callback on the agent's
// io_context thread. A hosted server lives as long as this object, which is why the hosting
// agent stays until the job has ended on every node (it exits on on_job_succeeded/failed).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "agent/rendezvous_handler.h"

namespace ddp::rdzv {
class Client;
class Server;
}  // namespace ddp::rdzv

namespace ddp::agent {

struct RemoteRendezvousOptions {
  std::string endpoint;          // HOST[:PORT] (port 29400 when absent); empty with `standalone`
  std::string job_id;            // --rdzv_id
  std::string token;             // shared token, empty = none
  double connect_timeout = 600;  // seconds to keep retrying a refused connection (join_timeout)
  bool standalone = false;       // host a server on a free loopback port and use it
  bool host_if_local = true;     // host the server when the endpoint is this host and it is free
  std::function<void(const std::string&)> log;  // progress lines; empty = stderr
};

class RemoteRendezvous final : public RendezvousHandler {
 public:
  RemoteRendezvous(boost::asio::io_context& io, RemoteRendezvousOptions options);
  ~RemoteRendezvous() override;

  void set_events(RendezvousEvents events) override;
  void join(const rdzv::NodeSpec& spec) override;
  void report_failure(const rdzv::WorkerFailure& failure) override;
  void report_success() override;
  void close() override;

  // True when this agent hosts the rendezvous server in-process.
  bool hosting() const { return server_ != nullptr; }
  // The endpoint actually used (the free port with --standalone).
  const std::string& endpoint() const { return endpoint_; }

 private:
  void start_client();
  void log(const std::string& line) const;

  boost::asio::io_context& io_;
  RemoteRendezvousOptions options_;
  RendezvousEvents events_;
  std::string endpoint_;
  std::unique_ptr<rdzv::Server> server_;
  std::shared_ptr<rdzv::Client> client_;
};

// True when `host` names this machine: a loopback address, "localhost", this host's name, or
// an address of one of its interfaces. Never resolves through reverse DNS.
bool is_local_host(const std::string& host);

}  // namespace ddp::agent
