// The rendezvous of a job that needs no daemon: a single node (--standalone, or no rendezvous
// flags) or the static backend (--master_addr/--master_port/--node_rank, each node restarting on
// its own, like torchrun's static rendezvous). No sockets: every answer is posted on the agent's
// io_context. A fatal failure report (WorkerFailure::fatal) fails the job at once with its reason;
// with the static backend that is this node's job only: there is no one to tell the others.
//
// Owned by the Agent; lives as long as the agent run; called on the io_context thread only.
#pragma once

#include <boost/asio/io_context.hpp>

#include "agent/rendezvous_handler.h"

namespace ddp::agent {

struct LocalRendezvousOptions {
  int nnodes = 1;            // GROUP_WORLD_SIZE (static backend: --nnodes)
  int node_rank = 0;         // GROUP_RANK (static backend: --node_rank)
  int max_restarts = 0;      // --max_restarts: failure restarts of this node
  std::string master_addr = "127.0.0.1";
  // MASTER_PORT. 0: take NodeSpec.master_port from join() (the agent picks a free one per round).
  int master_port = 0;
};

class LocalRendezvous final : public RendezvousHandler {
 public:
  LocalRendezvous(boost::asio::io_context& io, LocalRendezvousOptions options);

  void set_events(RendezvousEvents events) override;
  void join(const rdzv::NodeSpec& spec) override;
  void report_failure(const rdzv::WorkerFailure& failure) override;
  void report_success() override;
  void close() override;


 private:
  boost::asio::io_context& io_;
  LocalRendezvousOptions options_;
  RendezvousEvents events_;
  std::uint64_t generation_ = 0;
  int restart_count_ = 0;
  bool closed_ = false;
  bool failed_ = false;  // the job failed (budget spent or a fatal report): no round, no report
};

}  // namespace ddp::agent
