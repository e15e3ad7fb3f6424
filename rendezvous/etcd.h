// A small etcd v3 client over etcd's JSON gateway (HTTP/1.1, Boost.Beast): the key-value range,
// put and transaction calls, leases, and user authentication (docs/etcd.md).
//
// Synchronous: every call blocks its caller until it has an answer or its deadline passed
// (`EtcdOptions::call_timeout`), and never longer. Each call runs on a private io_context, so an
// EtcdClient may be used from any thread, but from one thread at a time (it is not
// thread-safe). The daemon calls it from its election thread, never from the server's event
// loop (rendezvous/election.*). Owned by its caller; holds no connection between calls.
//
// Every endpoint of the list is tried in turn within the deadline, starting at the last one that
// answered: a member that is down, refuses, times out, answers 5xx or says it is unavailable
// ("no leader") costs one attempt, then the next is asked. Answers are validated like any wire
// input (size, JSON depth, types, base64); nothing here throws, every error is a `EtcdStatus`.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp::rdzv {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // "http://HOST:PORT", "https://HOST:PORT" or "HOST:PORT"
                                       // (http); tried in turn
  std::string user;                    // etcd user; "" = no authentication
  std::string password;                // its password
  double call_timeout = 2.0;           // seconds one call may take, all endpoints together
  std::size_t max_response_bytes = 4u << 20;  // a larger answer is an error (4 MiB)
  // TLS, for https:// endpoints (PEM files): the server's certificate must be signed by ca_file
  // ("" = the system's trusted CAs) and name the endpoint's host; cert_file and key_file, both or
  // neither, are this client's certificate, for an etcd started with --client-cert-auth. Set by
  // ddp-rendezvous --etcd_cacert/--etcd_cert/--etcd_key, or by the launcher from --rdzv_conf
  // cacert/cert/key.
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
};

// The outcome of a call. `code` is etcd's gRPC code when etcd answered with an error (3 invalid
// argument, 7 permission denied, 14 unavailable, 16 unauthenticated, ...), 0 otherwise.
struct EtcdStatus {
  std::string error;  // "" = ok; otherwise what failed, naming the endpoint(s)
  int code = 0;
  bool ok() const { return error.empty(); }
};

struct EtcdKeyValue {
  std::string key;
  std::string value;
  std::int64_t create_revision = 0;
  std::int64_t mod_revision = 0;
  std::int64_t version = 0;
  std::int64_t lease = 0;
};

struct EtcdRange {
  EtcdStatus status;
  std::int64_t revision = 0;  // the store's revision when it answered
  std::vector<EtcdKeyValue> kvs;
};

struct EtcdCompare {
  enum class Target { version, create_revision, mod_revision, value, lease };
  enum class Result { equal, greater, less, not_equal };
  std::string key;
  Target target = Target::create_revision;
  Result result = Result::equal;
  std::int64_t number = 0;  // for version, revisions and lease
  std::string value;        // for value
};

struct EtcdOp {
  enum class Kind { put, range, del };
  Kind kind = Kind::range;
  std::string key;
  std::string value;      // put
  std::string range_end;  // range, del: "" = the key only
  std::int64_t lease = 0; // put: 0 = none
};

struct EtcdTxn {
  std::vector<EtcdCompare> compare;
  std::vector<EtcdOp> success;
  std::vector<EtcdOp> failure;
};

struct EtcdTxnResult {
  EtcdStatus status;
  bool succeeded = false;
  std::int64_t revision = 0;
  std::vector<EtcdRange> ranges;  // the answers of the executed branch's range ops, in order
};

struct EtcdLease {
  EtcdStatus status;
  std::int64_t id = 0;
  std::int64_t ttl = 0;  // seconds; keepalive: 0 = the lease no longer exists
};

// One change of a watched key.
struct EtcdWatchEvent {
  enum class Type { put, del };
  Type type = Type::put;
  EtcdKeyValue kv;  // a deletion carries the key and its mod_revision only
};

// One answer of a watch stream (etcd's WatchResponse).
struct EtcdWatchResponse {
  std::int64_t revision = 0;  // the store's revision when it was sent
  bool created = false;       // the first answer: the watch exists from here on
  bool canceled = false;      // etcd ended the watch (compacted, no permission, ...)
  std::int64_t compact_revision = 0;
  std::string cancel_reason;
  std::vector<EtcdWatchEvent> events;
};

struct EtcdWatchRequest {
  std::string key;
  std::string range_end;            // "" = the key only
  std::int64_t start_revision = 0;  // 0 = changes from now on
  double establish_timeout = 2.0;   // seconds to connect and hear `created`, all endpoints together
  // Liveness: TCP keepalive probes after this many seconds of silence (3 probes, 1 s apart), so a
  // member that vanished from the network ends the stream; and etcd itself ends it when its
  // member loses the cluster's leader (the gateway's "hasleader" metadata, as clientv3's
  // WithRequireLeader), so a member cut off from the quorum does not stay silent forever.
  double keepalive_idle = 2.0;
};

// Ends a watch (EtcdClient::watch) from another thread. Owned by the caller of watch(); it must
// outlive the call. Thread-safe.
class EtcdWatchStop {
 public:
  void stop();
  bool stopped() const;

 private:
  friend class EtcdClient;
  mutable std::mutex mu_;
  bool stopped_ = false;             // guarded by mu_
  std::function<void()> interrupt_;  // guarded by mu_: stops the watch's private io_context
};

// Splits a watch stream's body (the gateway writes one JSON object a line) into answers, each
// validated like any wire input. Socket-free; one per stream.
class EtcdWatchParser {
 public:
  explicit EtcdWatchParser(std::size_t max_line_bytes) : max_line_(max_line_bytes) {}
  // Consumes `bytes`; appends every complete answer to `out`. Returns "" or what is wrong, after
  // which the stream must be dropped.
  std::string feed(std::string_view bytes, std::vector<EtcdWatchResponse>& out);
  // etcd's gRPC code when the stream ended with an error line (16: the token expired), else 0.
  int error_code() const { return code_; }

 private:
  std::size_t max_line_;
  int code_ = 0;
  std::string pending_;  // an incomplete line
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options);

  EtcdRange range(const std::string& key, const std::string& range_end = "");
  EtcdStatus put(const std::string& key, const std::string& value, std::int64_t lease = 0);
  EtcdTxnResult txn(const EtcdTxn& txn);
  EtcdLease lease_grant(std::int64_t ttl_seconds);
  EtcdLease lease_keepalive(std::int64_t id);
  EtcdStatus lease_revoke(std::int64_t id);

  // Opens a watch stream (endpoints in turn, starting at the last that answered, until
  // one has created the watch within request.establish_timeout), then calls `on_response` on
  // this thread for every answer (the first has `created` set) until the stream breaks, etcd
  // cancels the watch, or `stop` is stopped. Blocks all that time; always returns an error saying
  // why it ended ("stopped" after stop()). Each answer is validated before `on_response` sees it;
  // a malformed one ends the stream.
  EtcdStatus watch(const EtcdWatchRequest& request, const std::function<void(const EtcdWatchResponse&)>& on_response,
                   EtcdWatchStop& stop);

  // What is wrong with options.endpoints ("" when every one is usable); every call fails with it.
  const std::string& config_error() const { return bad_endpoints_; }
  // The endpoint that answered last ("" before any answer).
  std::string last_endpoint() const;
  const EtcdOptions& options() const { return options_; }

  // One HTTP POST of `body` to `path`, endpoints in turn, authenticating when needed. Returns the
  // parsed answer object or an error. Public for tests.
  EtcdStatus call(const std::string& path, const nlohmann::json& body, nlohmann::json& answer);

 private:
  struct Endpoint {
    std::string host;
    std::string port;
    std::string text;
    bool tls = false;  // https://
  };
  struct Tls;  // the loaded certificates (an OpenSSL context), shared by copies of the client
  EtcdStatus call_until(const std::string& path, const std::string& body, nlohmann::json& answer,
                        std::chrono::steady_clock::time_point deadline);
  EtcdStatus authenticate(std::chrono::steady_clock::time_point deadline);

  EtcdOptions options_;
  std::vector<Endpoint> endpoints_;
  std::string bad_endpoints_;  // parse errors of options.endpoints, reported by every call
  std::size_t preferred_ = 0;  // the endpoint that answered last
  bool answered_ = false;
  std::string token_;          // from /v3/auth/authenticate; "" = none yet
  std::shared_ptr<Tls> tls_;   // null = no https:// endpoint
};

// Socket-free pieces, shared with the tests.
std::string base64_encode(std::string_view bytes);
// Strict: the standard alphabet with '=' padding, length a multiple of 4. nullopt when invalid.
std::optional<std::string> base64_decode(std::string_view text);
// The prefix end for a range over every key starting with `prefix` (etcd's convention).
std::string prefix_range_end(const std::string& prefix);
// Parses an answer body: JSON within depth limits, an object. Sets `error` when it is not.
EtcdStatus parse_answer(std::string_view body, nlohmann::json& answer);
// Reads etcd's protobuf-JSON int64 (a decimal string, or a number); absent = 0.
bool read_int64(const nlohmann::json& object, const char* field, std::int64_t& out);
// The body of a range answer (also a txn's response_range) into `out`; "" or what is wrong.
std::string read_range(const nlohmann::json& answer, EtcdRange& out);
std::string read_txn(const nlohmann::json& answer, EtcdTxnResult& out);
std::string read_lease(const nlohmann::json& answer, EtcdLease& out);
// One line of a watch stream: {"result": WatchResponse} or {"error": {...}}; "" or what is wrong.
// `code` gets etcd's gRPC code of an error line.
std::string read_watch_response(const nlohmann::json& line, EtcdWatchResponse& out, int* code = nullptr);
nlohmann::json txn_to_json(const EtcdTxn& txn);

}  // namespace ddp::rdzv
