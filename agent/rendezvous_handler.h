// The agent's view of a rendezvous: join a round, report what the workers did, hear what the
// job decided. Two implementations: LocalRendezvous (single node, in-process, no sockets) and
// the TCP client of rendezvous/ (multi-node), adapted in agent/remote_rendezvous.*.
//
// Owned by the Agent; lives as long as the agent run. All calls and all callbacks happen on the
// agent's io_context thread.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "rendezvous/types.h"

namespace ddp::agent {

// What the job decided, pushed to the agent (never polled).
struct RendezvousEvents {
  // A round completed: start the workers with this assignment.
  std::function<void(const rdzv::Assignment&)> on_round;
  // The current round ended (a worker failed somewhere, a node was lost or joined): stop the
  // workers and call join() again. `counted` says whether it used up one failure restart.
  // `failing`: not a restart; the job is failing and every node stops for its verdict.
  std::function<void(const std::string& reason, bool counted, bool failing, bool failure)> on_restart;
  // The job succeeded on every node: exit 0.
  std::function<void()> on_job_succeeded;
  // The job failed for good (restart budget spent): exit 1 with this first failure.
  std::function<void(const rdzv::WorkerFailure& first_failure, const std::string& summary)> on_job_failed;
  // The rendezvous itself failed (timeout, closed, refused, version or environment mismatch):
  // exit 3 with this message.
  std::function<void(const std::string& message)> on_rendezvous_error;
  // An operator drained this node (ddp-rendezvous drain): stop the workers and exit 0.
  std::function<void(const std::string& message)> on_drained;
};

class RendezvousHandler {
 public:
  virtual ~RendezvousHandler() = default;
  // Installs the callbacks. REQUIRES: called once, before join().
  virtual void set_events(RendezvousEvents events) = 0;
  // Joins the next round with this node's spec; on_round fires when it completes.
  virtual void join(const rdzv::NodeSpec& spec) = 0;
  // A local worker failed: the rendezvous decides restart (on_restart, counted) or final failure.
  // A failure marked fatal (WorkerFailure::fatal) fails the job on every node with its reason;
  // the agent then stops its workers and joins once more to say so (no round follows).
  virtual void report_failure(const rdzv::WorkerFailure& failure) = 0;
  // Every local worker exited 0.
  virtual void report_success() = 0;
  // Leave the job (agent shutting down on a signal). Must not be taken as a lost node to restart.
  virtual void close() = 0;
  // What the workers reported, read when the rendezvous wants it (the remote one: with each
  // heartbeat, for `ddp-rendezvous status`). The in-process rendezvous has no one to tell.
  virtual void set_progress_source(std::function<std::optional<rdzv::NodeProgress>()> source) { (void)source; }
  // Whether report_stall() reaches anyone: only a rendezvous shared with other nodes can find a
  // silent one among them (agent/stall_watch.h).
  virtual bool hears_stalls() const { return false; }
  // The local workers made no progress for `stalled_for` seconds.
  virtual void report_stall(double stalled_for) { (void)stalled_for; }
  // Whether another node of the job prints the reason of the restart or failure just heard in
  // full (the daemon names one node for the whole job; --log_dedup then says one short line).
  virtual bool said_elsewhere() const { return false; }
};

}  // namespace ddp::agent
