// `ddp-rendezvous status`: ask a server for its jobs (blocking, with a deadline) and print them.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "rendezvous/stream.h"

namespace ddp::rdzv {

struct StatusResult {
  nlohmann::json status;   // {"jobs": [...]} as documented in docs/protocol.md
  std::string error;       // empty on success
  bool usage_error = false;  // the endpoint text itself was bad
};

// Connects to HOST:PORT, answers the server's challenge with a status request (proving `token`
// when not empty; `job_id` selects that job's secret and shows that job only) and waits for the
// reply for at most timeout_s seconds. Runs its own io_context on the calling thread.
// `tls` (not null): speak TLS and check the server's certificate with it (docs/security.md).
StatusResult query_status(const std::string& endpoint, const std::string& token, double timeout_s,
                          const std::string& job_id = "", const std::shared_ptr<TlsContext>& tls = nullptr);

// One block per job: generation, state, restarts, then a table of nodes by group rank.
std::string format_status(const nlohmann::json& status);

}  // namespace ddp::rdzv
