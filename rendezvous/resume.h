// The `resume` message: what an agent that lost its rendezvous connection tells the server it
// reconnects to, so that a restarted, crashed or standby daemon can rebuild the job from its
// agents and let the round go on without restarting a single worker.
//
// Kept apart from the rest of the codec on purpose: its own encoder, its own validating decoder
// and its own server handler. The dependency points one way: the codec (rendezvous/protocol.*)
// includes this file for ResumeRequest and dispatches `resume` messages here; this file knows
// nothing of the codec. No Boost.Asio here; the decoder is tested without sockets.
// docs/protocol.md describes the message, docs/rendezvous.md the rules that apply it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>

#include <nlohmann/json.hpp>

#include "rendezvous/types.h"

namespace ddp::rdzv {

// What an agent that lost its rendezvous connection knows, so that a restarted, crashed or
// standby daemon can rebuild the job and the round goes on.
struct ResumeRequest {
  std::string job_id;        // --rdzv_id; equals node.job_id
  std::string secret;        // the per-node secret the server issued with the round (hex)
  NodeSpec node;             // this node's spec: nnodes, budget, timeouts, fingerprint (policy)
  Assignment assignment;     // the round it runs: generation, group rank, world, master,
                             // restart count and budget
};

// Limits checked by decode_resume before anything reaches the state machine.
inline constexpr std::size_t kMaxResumeStringBytes = 1024;  // host, addr, job id, master address
inline constexpr std::size_t kMinSecretChars = 32;          // hex characters of a node secret
inline constexpr std::size_t kMaxSecretChars = 128;
inline constexpr int kMaxResumeNodes = 1 << 20;             // nnodes MAX, group world size
inline constexpr int kMaxResumeRestarts = 1 << 20;          // --max_restarts
inline constexpr double kMaxResumeSeconds = 1e7;            // any timeout (about 115 days)
// Whether `s` is lowercase hex digits only, as a node secret is (sealed or not).
bool is_hex(const std::string& s);


// The JSON forms of the typed messages (protocol.h: make_resume_message, make_resumed_message),
// which the codec encodes through these.
// client -> server: {"type": "resume", "resume": {...}}.
nlohmann::json make_resume(const ResumeRequest& request);
// server -> client: the round goes on as it was (no restart); {"type": "resumed", ...}.
nlohmann::json make_resumed(std::uint64_t generation, int restart_count, bool rebuilt);

// Decodes and validates a resume message: every field's type, size and range, and the
// consistency of the assignment with the policy (rank within the group, offset within the
// world, restart count within the budget). Returns the request, or why it is invalid (the
// codec answers that with bad_resume). The node spec's shape (sizes, fingerprint) is the
// codec's check, the same as a join's (validate_node_spec in rendezvous/protocol.h). Never throws.
std::variant<ResumeRequest, std::string> decode_resume(const nlohmann::json& message);

}  // namespace ddp::rdzv
