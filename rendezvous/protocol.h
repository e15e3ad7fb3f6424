// The rendezvous wire protocol: one typed codec shared by the server, the client and `status`
// (docs/protocol.md describes every message). A frame is a 4-byte big-endian length followed by
// that many bytes of UTF-8 JSON, one message per frame. No Boost.Asio here: the codec is tested
// (and fuzzed) without sockets, and the state machine builds its outgoing frames with it.
//
// Adding a message: one MessageType value, one typed struct in Message::Body, one case in
// decode_body() and one in to_json() (protocol.cpp), and one case where it is dispatched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "contracts/json_depth.h"
#include "rendezvous/resume.h"  // ResumeRequest
#include "rendezvous/types.h"

namespace ddp::rdzv {

// The nesting check before any parse, shared with the agent-worker messages.
using contracts::json_depth;

// Bumped on every incompatible change of a message; the first message of a connection names it.
// Version 2: the server speaks first (challenge) and hello/status carry an HMAC proof.
// Version 3: both sides name the protocol at once (kMagic in the client's greeting and in the
// server's challenge), so a client that reached some other service says so within a second.
// Version 4: node secrets sealed (docs/security.md). Version 5: stall and probe (a silent node).
inline constexpr int kProtocolVersion = 5;
// The magic both sides send first: the client in its greeting, the server in its challenge.
inline constexpr std::string_view kMagic = "ddp-rendezvous";
// The server's challenge is small: a first frame longer than this is not a rendezvous server's.
inline constexpr std::size_t kMaxChallengeBytes = 4096;
// Default size limit of one frame's payload; checked before any buffer is allocated.
inline constexpr std::size_t kDefaultMaxFrameBytes = 1 << 20;
inline constexpr std::size_t kFrameHeaderBytes = 4;
// A connection's read buffers keep at most this much capacity between frames: none, so that an
// idle connection holds no read buffer at all. (Keeping a heartbeat's 512 bytes kept a join's
// two buffers, about 1 KB per agent, for the whole job; allocating them again costs a heartbeat
// less than parsing it.)
inline constexpr std::size_t kKeptBufferBytes = 0;

// Limits every decoded message is held to before it touches any state (docs/protocol.md).
inline constexpr int kMaxJsonDepth = 16;                    // nesting of arrays and objects
inline constexpr std::size_t kMaxIdBytes = 128;             // job ids
inline constexpr std::size_t kMaxHostBytes = 255;           // host names and addresses
inline constexpr std::size_t kMaxNonceBytes = 128;          // nonces and proofs (hex)
inline constexpr std::size_t kMaxFailureMessageBytes = 4096;  // error_file_message, fatal: then truncated
inline constexpr std::size_t kMaxReasonBytes = 64 * 1024;     // restart reasons, summaries, errors
inline constexpr int kMaxLocalWorldSize = 4096;             // --nproc_per_node
inline constexpr int kMaxNodes = 100000;                    // --nnodes MAX
inline constexpr int kMaxRestarts = 1000000;                // --max_restarts
inline constexpr double kMaxTimeoutSeconds = 1e7;           // any rdzv timeout (~115 days)
// A fingerprint is an object of sections, each an object of scalar facts, arrays of scalars, or
// one more level of named scalars (program.libraries); its encoding is bounded in size.
inline constexpr int kMaxFingerprintDepth = 3;
inline constexpr std::size_t kMaxFingerprintBytes = 128 * 1024;
inline constexpr std::size_t kMaxFingerprintEntries = 4096;
// The marker appended to a string cut at its limit.
inline constexpr std::string_view kTruncatedMarker = " [truncated by the rendezvous server]";

// An encoded frame (header + payload), shared between the sessions it is broadcast to.
using Frame = std::shared_ptr<const std::string>;

// Why a frame or message was rejected; sent to the peer in an `error` message before closing.
struct ProtocolError {
  std::string code;     // machine-readable: bad_frame, too_large, bad_json, bad_message,
                        // version_mismatch, bad_token, ...
  std::string message;  // one sentence naming what was wrong and what to do
};

// Writes `length` as the 4-byte big-endian frame header.
void write_frame_header(std::uint32_t length, unsigned char out[kFrameHeaderBytes]);
// Reads the payload length from a 4-byte header.
std::uint32_t read_frame_header(const unsigned char in[kFrameHeaderBytes]);
// Checks a frame length against the limit before the payload buffer exists.
std::optional<ProtocolError> check_frame_length(std::uint32_t length, std::size_t max_frame_bytes);
// Frames any JSON value as is (tests use it to send what the typed encoder never would).
Frame encode_frame(const nlohmann::json& payload);

// Splits a byte stream into frame payloads, socket-free and incremental (like asio's
// request_parser): feed it whatever the socket returned, then take complete payloads with next().
// Sizes are checked from the header before the payload is buffered. Owned by one connection.
class FrameReader {
 public:
  explicit FrameReader(std::size_t max_frame_bytes = kDefaultMaxFrameBytes) : max_frame_bytes_(max_frame_bytes) {}
  enum class Result { need_more, frame, error };
  // Appends bytes read from the peer.
  void feed(const char* data, std::size_t size);
  // The next complete payload into `payload`, or need_more, or error (then error() says why and
  // the stream is unusable: the connection must close).
  Result next(std::string& payload);
  // REQUIRES: next() returned error.
  const ProtocolError& error() const { return *error_; }
  std::size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::size_t max_frame_bytes_;
  std::string buf_;
  std::size_t pos_ = 0;  // start of the unparsed bytes in buf_
  std::unique_ptr<ProtocolError> error_;  // set once, by the error; 8 bytes per connection until then
  bool failed_ = false;
};

enum class MessageType : std::uint8_t {
  // client -> server
  greeting,
  hello,
  status,
  join,
  heartbeat,
  failure,
  success,
  leave,
  resume,
  stall,
  drain,
  peer_alive,
  // server -> client
  challenge,
  welcome,
  error,
  round,
  restart,
  job_succeeded,
  job_failed,
  heartbeat_ack,
  status_reply,
  resumed,
  waiting,
  not_leader,
  probe,
  drained,
  check_peer,
};
const char* to_string(MessageType type);
bool is_client_message(MessageType type);

// hello (an agent) and status (a status query): the first message a client sends after the
// server's challenge. `proof` is auth_proof(secret, "hello" or "status", ...) (rendezvous/auth.h).
struct Hello {
  int protocol_version = kProtocolVersion;
  std::string job_id;        // --rdzv_id; optional for status (selects a per-job secret)
  std::string client_nonce;  // hex; the server proves it knows the secret over it in welcome
  std::string proof;         // hex HMAC-SHA256; empty when the client has no secret
};
struct Challenge {
  int protocol_version = kProtocolVersion;
  std::string nonce;  // hex, fresh per connection
  std::string magic{kMagic};  // "" from servers older than version 3
};
// greeting: what a client sends the moment it connects, before the challenge has arrived, so that
// a service that is not a rendezvous server answers at once (an HTTP server answers the line with
// an error) and the client can name it. Optional for the server: hello may come without it.
struct Greeting {
  int protocol_version = kProtocolVersion;
  std::string magic{kMagic};
};
struct Welcome {
  int protocol_version = kProtocolVersion;
  std::string proof;  // hex HMAC-SHA256 of the server over the client's nonce; empty without secret
};
struct ErrorMessage {
  std::string code;
  std::string message;
};
struct Restart {
  std::string reason;
  bool counted = false;
  bool failing = false;  // the job is failing: the workers stop for its verdict, no round follows
  int restart_count = 0;
  int max_restarts = 0;
  // The round ended because something failed (a worker, a lost node, a failing job), not for a
  // change of membership: the workers' collectives may never complete, so they must not wait to
  // finish their step (docs/worker-sdk.md, "An abandoned round"). Absent on the wire: false.
  bool failure = false;
  // Another node of the job says the reason in full (the failed one, else the lowest group rank):
  // an agent with --log_dedup says one short line. Absent on the wire: false.
  bool quiet = false;
};
// job_succeeded and job_failed carry the job's goodput line ("goodput 97.4% of ...",
// docs/goodput.md) to one node only (the one that is not quiet), which prints it for the job; absent
// (empty) for the others and from servers that predate it.
struct JobSucceeded {
  std::string job_id;
  std::string goodput;
};
struct JobFailed {
  WorkerFailure failure;
  std::string summary;
  std::string goodput;
  bool quiet = false;  // another node prints the job's failure summary (as in Restart)
};
struct StatusReply {
  nlohmann::json status;
};
// resumed: the round goes on as it was (no restart).
struct Resumed {
  std::uint64_t generation = 0;
  int restart_count = 0;
  bool rebuilt = false;  // the server rebuilt the job from its agents' resumes
};
// waiting: what the waiting nodes of a gathering job wait for. Sent when the counts
// change, at most once a second per job (the agent counts the seconds down itself).
struct Waiting {
  std::string job_id;
  int waiting = 0;        // nodes waiting for the next round (standbys included)
  int rejoining = 0;      // nodes of the last round not back yet
  int min_nodes = 1;      // --nnodes MIN
  int max_nodes = 1;      // --nnodes MAX
  std::optional<double> join_left;       // s until join_timeout fails the job (fewer than MIN)
  std::optional<double> last_call_left;  // s until the round completes below MAX (MIN reached)
};
// not_leader: a follower replica of a replicated daemon (--etcd, docs/etcd.md) sends
// it after its welcome (so a token-holding client knows it is genuine) and closes. `leader` is the
// leader's HOST:PORT, or "" when no replica leads at the moment (the client tries its other
// endpoints).
struct NotLeader {
  std::string leader;
};
inline constexpr std::size_t kMaxEndpointBytes = 262;  // a 253-byte host name, ':' and a port
struct Empty {};  // success, leave, heartbeat_ack, probe
struct Heartbeat {
  std::optional<NodeProgress> progress;  // absent from agents whose workers reported nothing
};
// stall: the node's workers made no progress for `stalled_for` seconds (the agent's judgement,
// agent/stall_watch.h). The server then probes the job's nodes it has not heard from since the
// stall began (docs/rendezvous.md, "Silent nodes"); a probe is answered with a heartbeat. It
// names only its sender: no client can say that another node is dead.
struct Stall {
  double stalled_for = 0;
};
// check_peer: a node of the job did not answer a probe; the server asks one or two other agents
// of the job (whose join said `peer_checks: true`) to reach its host: a TCP connection to
// addr:port, a port with no listener, that the host either refuses or accepts. Either answer
// proves the host is up, and the agent says so with peer_alive and the same id; no answer within
// `within` seconds, and the agent says nothing. An answer can only spare a node, never convict
// one (docs/rendezvous.md, "Silent nodes").
inline constexpr std::uint64_t kMaxCheckId = 1ULL << 53;  // exact as a JSON number anywhere
struct CheckPeer {
  std::uint64_t id = 0;
  std::string addr;
  int port = 0;
  double within = 0;
};
struct PeerAlive {
  std::uint64_t id = 0;
};
// drain: an operator's request (`ddp-rendezvous drain`), a first message like status: the hello
// part proves the secret (role "drain"); a job's own secret may drain that job only. `node` is
// the node as status shows it: its host, or its group rank in decimal. `force` allows leaving
// fewer than MIN nodes. The server answers `drained` or an error, and closes.
struct Drain {
  Hello hello;
  std::string job;
  std::string node;
  bool force = false;
};
// drained: the node left the job's round; `node` describes it, `message` says what follows.
struct Drained {
  std::string job_id;
  std::string node;
  std::string message;
};

struct Message {
  MessageType type = MessageType::heartbeat;
  std::variant<Empty, Heartbeat, Greeting, Hello, Challenge, Welcome, ErrorMessage, NodeSpec, WorkerFailure, Assignment, Restart,
               JobSucceeded, JobFailed, StatusReply, ResumeRequest, Resumed, Waiting, NotLeader, Stall, Drain,
               Drained, CheckPeer, PeerAlive>
      body;
};
// The hello part of a first message (hello, status, drain). REQUIRES: one of those types.
const Hello& first_hello(const Message& message);

// Decodes one payload: JSON no deeper than kMaxJsonDepth (checked before parsing), an object
// with a known string "type", and a body whose fields have the right types and ranges. Strings
// over their limit are refused, except failure messages and reasons, which are truncated with
// kTruncatedMarker. Unknown fields are ignored; absent ones keep their defaults. Never throws.
struct Decoded {
  std::optional<Message> message;
  std::optional<ProtocolError> error;
};
Decoded decode(std::string_view payload);
// The field checks of messages, for other input of the same shape (job records in etcd): the
// timeouts object and a failure report. nullopt = valid; else what is wrong. Never throw.
std::optional<std::string> decode_timeouts(const nlohmann::json& j, Timeouts& t);
std::optional<std::string> decode_straggler(const nlohmann::json& j, StragglerPolicy& p);
std::optional<std::string> decode_failure(const nlohmann::json& j, WorkerFailure& w);

nlohmann::json to_json(const Message& message);
Frame encode(const Message& message);

// The frames of one round's messages. The nodes' messages differ only in their group_rank,
// rank_offset and secret, so the message is dumped once and each node's frame is spliced from
// that text and its three values: the same bytes as encode(make_round(a)) with the node's fields
// set, without a JSON tree built and dumped per node (a round of 100,000 nodes).
class RoundFrames {
 public:
  // `shared`'s group_rank, rank_offset and secret are not used.
  explicit RoundFrames(Assignment shared);
  Frame frame(int group_rank, int rank_offset, const std::string& secret) const;

 private:
  enum class Slot { group_rank, rank_offset, secret, none };
  struct Piece {
    std::string text;  // copied as is
    Slot then;         // the value written after it
  };
  std::vector<Piece> pieces_;
  std::size_t bytes_ = 0;
};

// Checks a NodeSpec's ranges (sizes, ranks, timeouts, fingerprint shape). Empty when valid.
std::optional<std::string> validate_node_spec(const NodeSpec& spec);

// Message builders (server -> client).
Message make_challenge(const std::string& nonce);
Message make_welcome(const std::string& proof = "");
Message make_error(const std::string& code, const std::string& message);
Message make_round(const Assignment& assignment);
Message make_restart(const std::string& reason, bool counted, int restart_count, int max_restarts,
                     bool failing = false, bool failure = false);
Message make_job_succeeded(const std::string& job_id, const std::string& goodput = "");
Message make_job_failed(const WorkerFailure& first_failure, const std::string& summary, const std::string& goodput = "",
                        bool quiet = false);
Message make_heartbeat_ack();
Message make_status_reply(nlohmann::json status);
Message make_waiting(const Waiting& waiting);
Message make_not_leader(const std::string& leader);
Message make_probe();
Message make_check_peer(const CheckPeer& check);
Message make_drained(const Drained& drained);
// "" (no leader known) or an endpoint to connect to, HOST:PORT or [V6]:PORT, written as
// Endpoint::text() writes it (rendezvous/endpoint.h).
bool valid_leader_endpoint(std::string_view text);

// Message builders (client -> server).
// The greeting frame, its JSON followed by "\r\n" (inside the frame) so that line-based services
// answer it.
Frame encode_greeting();
Message make_hello(const Hello& hello);
Message make_status_request(const Hello& hello);
Message make_join(const NodeSpec& spec);
Message make_heartbeat(std::optional<NodeProgress> progress = std::nullopt);
Message make_failure(const WorkerFailure& failure);
Message make_success();
Message make_leave();
Message make_stall(double stalled_for);
Message make_peer_alive(std::uint64_t id);
Message make_drain(const Drain& drain);
Message make_resume_message(const ResumeRequest& request);
Message make_resumed_message(std::uint64_t generation, int restart_count, bool rebuilt);

// Checks the version of a client's first message (hello, status or drain) and that hello names a
// job.
std::optional<ProtocolError> check_first_message(const Message& message);
// Checks a client's greeting: the magic and the protocol version.
std::optional<ProtocolError> check_greeting(const Greeting& greeting);

// The client's side of the identification (docs/protocol.md, "Handshake"): what the first bytes
// received on a connection say about the peer. Socket-free; the client, `status` and the tests
// share it. `bytes` is everything received so far; `closed` when the peer closed after them.
struct ServerCheck {
  enum class Verdict { need_more, rendezvous, refuse } verdict = Verdict::need_more;
  // For refuse: what the peer is, to follow "HOST:PORT " ("is not a ddp-rendezvous server (it
  // answered 'HTTP/1.0 400 Bad request')", "is a ddp-rendezvous server of protocol version 2, ...").
  std::string reason;
};
ServerCheck check_server_start(std::string_view bytes, bool closed = false);
// Up to `max` bytes as printable text for a message: control and non-ASCII bytes as \xNN, the
// rest cut with "...".
std::string printable_excerpt(std::string_view bytes, std::size_t max = 64);

}  // namespace ddp::rdzv
