// The `resume` message (issue 10): what an agent that lost its rendezvous connection tells the
// server it reconnects to, so that a restarted, crashed or standby daemon can rebuild the job
// from its agents and let the round go on without restarting a single worker.
//
// Kept apart from rendezvous/protocol.* on purpose: its own encoder, its own validating decoder
// and its own server handler. No Boost.Asio here; the decoder is tested without sockets.
// docs/protocol.md describes the message, docs/rendezvous.md the rules that apply it.
#pragma once

#include <string>
#include <variant>

#include <nlohmann/json.hpp>

#include "rendezvous/protocol.h"
#include "rendezvous/types.h"

namespace ddp::rdzv {

// Limits checked by decode_resume before anything reaches the state machine.
inline constexpr std::size_t kMaxResumeStringBytes = 1024;  // host, addr, job id, master address
inline constexpr std::size_t kMinSecretChars = 32;          // hex characters of a node secret
inline constexpr std::size_t kMaxSecretChars = 128;
inline constexpr int kMaxResumeNodes = 1 << 20;             // nnodes MAX, group world size
inline constexpr int kMaxResumeRestarts = 1 << 20;          // --max_restarts
inline constexpr double kMaxResumeSeconds = 1e7;            // any timeout (about 115 days)

// What a resuming agent knows: the round it runs and the job's policy.
struct ResumeRequest {
  std::string job_id;        // --rdzv_id; equals node.job_id
  std::string secret;        // the per-node secret the server issued with the round (hex)
  NodeSpec node;             // this node's spec: nnodes, budget, timeouts, fingerprint (policy)
  Assignment assignment;     // the round it runs: generation, group rank, world, master,
                             // restart count and budget
};

// client -> server: {"type": "resume", "resume": {...}}.
nlohmann::json make_resume(const ResumeRequest& request);
// server -> client: the round goes on as it was (no restart); {"type": "resumed", ...}.
nlohmann::json make_resumed(std::uint64_t generation, int restart_count, bool rebuilt);

// Decodes and validates a resume message: every field's type, size and range, and the
// consistency of the assignment with the policy (rank within the group, offset within the
// world, restart count within the budget). Never throws.
std::variant<ResumeRequest, ProtocolError> decode_resume(const nlohmann::json& message);

}  // namespace ddp::rdzv
