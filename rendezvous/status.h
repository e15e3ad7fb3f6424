// `ddp-rendezvous status`: ask a server for its jobs (blocking, with a deadline) and print them.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "rendezvous/endpoint.h"
#include "rendezvous/protocol.h"
#include "rendezvous/stream.h"

namespace ddp::rdzv {

struct StatusResult {
  nlohmann::json status;   // {"jobs": [...]} as documented in docs/protocol.md
  std::string error;       // empty on success
  std::string code;        // the server's error code when it refused (bad_token, unknown_job, ...)
  std::string leader;      // a follower replica named this leader (drain_node follows it)
};

// Connects to `endpoint`, answers the server's challenge with a status request (proving `token`
// when not empty; `job_id` selects that job's secret and shows that job only) and waits for the
// reply for at most timeout_s seconds. Runs its own io_context on the calling thread.
// `tls` (not null): speak TLS and check the server's certificate with it (docs/security.md).
// An endpoint that cannot be connected to (rdzv::connect_error) is an error of the result.
StatusResult query_status(const Endpoint& endpoint, const std::string& token, double timeout_s,
                          const std::string& job_id = "", const std::shared_ptr<TlsContext>& tls = nullptr);

// `ddp-rendezvous drain`: asks the server to drain drain.node from job drain.job (the hello part
// is filled in here; the secret is proven for drain.job). A follower replica's not_leader is
// followed to the leader. On success `status` is {"job_id", "node", "message"}; a refusal is
// an error with the server's `code`.
StatusResult drain_node(const Endpoint& endpoint, const std::string& token, double timeout_s, const Drain& drain,
                        const std::shared_ptr<TlsContext>& tls = nullptr);

// One block per job: generation, state, restarts, then a table of nodes by group rank. A finished
// job still kept by the daemon says so, with its end time (now - ended_seconds_ago, UTC).
std::string format_status(const nlohmann::json& status);

// The live view's table: one line per job (state, generation, restarts, nodes, end),
// under it one line per node (group rank, host, state, heartbeat age, last step when the status
// carries one). `header` is the first line. Pure: tested without a terminal.
std::string format_watch(const nlohmann::json& status, const std::string& header);

// `status --watch`: queries every `interval_s` seconds and redraws until SIGINT or SIGTERM, then
// returns 0. On a terminal each frame replaces the last (ANSI clear); otherwise frames follow each
// other. With `as_json`, one JSON document per line instead. A query that fails is shown in the
// frame and retried at the next interval (a daemon that restarts comes back into view).
int watch_status(const Endpoint& endpoint, const std::string& token, double timeout_s, const std::string& job_id,
                 double interval_s, bool as_json, const std::shared_ptr<TlsContext>& tls = nullptr);

}  // namespace ddp::rdzv
