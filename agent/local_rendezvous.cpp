#include "agent/local_rendezvous.h"

#include <boost/asio/post.hpp>

namespace ddp::agent {

LocalRendezvous::LocalRendezvous(boost::asio::io_context& io, LocalRendezvousOptions options)
    : io_(io), options_(std::move(options)) {}

void LocalRendezvous::set_events(RendezvousEvents events) { events_ = std::move(events); }

void LocalRendezvous::join(const rdzv::NodeSpec& spec) {
  if (failed_) return;  // the agent rejoins after a fatal report only to say it has stopped
  rdzv::Assignment a;
  a.generation = ++generation_;
  a.group_rank = options_.node_rank;
  a.group_world_size = options_.nnodes;
  a.world_size = options_.nnodes * spec.local_world_size;
  a.rank_offset = options_.node_rank * spec.local_world_size;
  a.master_addr = options_.master_addr;
  a.master_port = options_.master_port != 0 ? options_.master_port : spec.master_port;
  a.restart_count = restart_count_;
  a.max_restarts = options_.max_restarts;
  boost::asio::post(io_, [this, a] {
    if (!closed_ && events_.on_round) events_.on_round(a);
  });
}

void LocalRendezvous::report_failure(const rdzv::WorkerFailure& failure) {
  if (failed_) return;
  if (!failure.fatal.empty()) {
    // The agent decided that the job ends (--no_restart_exit_codes, a crash loop): no restart.
    failed_ = true;
    boost::asio::post(io_, [this, failure] {
      if (!closed_ && events_.on_job_failed) events_.on_job_failed(failure, failure.fatal);
    });
    return;
  }
  if (restart_count_ < options_.max_restarts) {
    ++restart_count_;
    std::string reason = "worker " + std::to_string(failure.rank) + " failed; restart " +
                         std::to_string(restart_count_) + " of " + std::to_string(options_.max_restarts);
    boost::asio::post(io_, [this, reason] {
      if (!closed_ && events_.on_restart) events_.on_restart(reason, true, false, true);
    });
  } else {
    failed_ = true;
    std::string summary = "restart budget spent (--max_restarts=" + std::to_string(options_.max_restarts) + ")";
    boost::asio::post(io_, [this, failure, summary] {
      if (!closed_ && events_.on_job_failed) events_.on_job_failed(failure, summary);
    });
  }
}

void LocalRendezvous::report_success() {
  boost::asio::post(io_, [this] {
    if (!closed_ && events_.on_job_succeeded) events_.on_job_succeeded();
  });
}

void LocalRendezvous::close() { closed_ = true; }

}  // namespace ddp::agent
