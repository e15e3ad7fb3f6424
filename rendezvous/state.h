// The rendezvous state machine: every job's members, rounds, deadlines and restart budget.
//
// Pure logic: no sockets, no Boost.Asio, time from an injected Clock. The Asio server feeds it
// what connections say (join, heartbeat, failure, success, leave, close) and calls tick()
// periodically; it answers through an Outbox. Owned by the Server (or a test); called on one
// thread only (the server's io_context thread), so it holds no locks.
//
// Semantics (docs/architecture.md "Lifecycle of a rendezvous round", decisions in docs/rendezvous.md):
//  - A round completes at MAX waiting nodes; at MIN once last_call_timeout has passed since MIN
//    was reached; and, after the first round, as soon as every connected node of the job has
//    rejoined (at least MIN), because nobody else is expected.
//  - Fewer than MIN nodes for join_timeout since the job started gathering: the nodes get an
//    error (join_timeout) and the job is dropped.
//  - A lost node (closed connection, heartbeat_timeout of silence, or leave) ends a running round:
//    the others get restart(counted=false) and rejoin.
//  - A new node while the round runs with fewer than MAX nodes ends the round (restart, not
//    counted); at MAX it waits as a standby and enters the next round.
//  - A worker failure ends the round with restart(counted=true) while restarts_used <
//    max_restarts. Else the job is *failing*: the round ends (restart, not counted) so that
//    every node stops its workers and reports what it saw; once every node of the round has
//    rejoined or is gone, the job fails everywhere (job_failed) with the root cause: the
//    round's failure that explains the others (rdzv::explains: deaths by signal first, then
//    the earliest). So the verdict never depends on which agent's report arrived first.
//  - A *fatal* failure report (WorkerFailure::fatal: --no_restart_exit_codes, a crash loop)
//    makes the job failing at once, whatever the budget, from a node of the running round or
//    one whose round just ended (an agent decides on a crash loop when it hears the counted
//    restart); the verdict, given the same way, carries the fatal reason.
//  - A node whose workers stalled says so (stall); the nodes of its running round not heard
//    from since the stall began are probed, and one that does not answer within probe_timeout,
//    and whose host has not even acknowledged the probe (PeerCheck), is lost like a silent one,
//    without waiting for heartbeat_timeout (docs/rendezvous.md, "Silent nodes"). A stall report
//    names only its sender: it can cost probes, never a node.
//  - A drained node (drain(), an operator's request) is dropped with error "drained"; its
//    round ends like after a node left, and a waiting node takes its place in the next one.
//  - When every node of the round reported success the job succeeded everywhere.
//  - A job is dropped when its last node leaves; memory is bounded by the live connections.
//  - While a job gathers, its waiting nodes that asked for it (NodeSpec::progress) get
//    `waiting` (counts, seconds left) when the counts change, at most once a second per job
//    (agents show the progress).
//  - resume: an agent that lost its connection gives back what it knows; a server
//    that does not know the job rebuilds it, and the round goes on unchanged once every node
//    of its generation resumed within the grace period (heartbeat_timeout after the first
//    resume). The rules for late, missing, stale or disagreeing resumes are in resume() below
//    and in docs/rendezvous.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "metrics/event.h"
#include "rendezvous/clock.h"
#include "rendezvous/fingerprint_table.h"
#include "rendezvous/goodput.h"
#include "rendezvous/job_record.h"
#include "rendezvous/protocol.h"
#include "rendezvous/resume.h"
#include "rendezvous/types.h"

namespace ddp::rdzv {

// Identifies one client connection; the server numbers them, never reusing a number.
using ConnId = std::uint64_t;

// What the state machine says to the world. Implemented by the server (or a test recorder).
// Calls happen synchronously from inside the state machine; implementations must not call
// back into it (the server closes sockets asynchronously).
class Outbox {
 public:
  virtual ~Outbox() = default;
  // Queues `frame` for the connection.
  virtual void send(ConnId to, const Frame& frame) = 0;
  // Queues one `frame` for every connection of `to` (a job-wide restart). The server writes a
  // large one from several threads (rendezvous/fanout.h). Default: send() to each.
  virtual void broadcast(const std::vector<ConnId>& to, const Frame& frame) {
    for (ConnId conn : to) send(conn, frame);
  }
  // Sends an error message (code, message) to the connection, then closes it. The state machine
  // has already forgotten the connection when it calls this.
  virtual void drop(ConnId conn, const std::string& code, const std::string& message) = 0;
  // One line per membership event (join, round, lost, restart, failure, success), no timestamp.
  virtual void log(const std::string& line) = 0;
  // The same events as records (the event log and the metrics consume them); `time` is
  // 0 (the receiver stamps it) and durations are in `fields` on the state machine's clock.
  // Default: ignored.
  virtual void event(const metrics::Event& event) {}
};

// How long a finished job stays in status() after its last node went, and how many
// such jobs are kept at most (the oldest goes first). docs/rendezvous.md "Finished jobs".
struct Retention {
  double keep_finished = 600;      // seconds; 0 = forget at once (the old behaviour)
  std::size_t max_finished = 256;  // finished jobs kept at most
};

// What the metrics read at each scrape: counts only, O(nodes) to compute.
struct Gauges {
  std::map<std::string, std::size_t> jobs_by_state;   // every state name, 0 when none
  std::map<std::string, std::size_t> nodes_by_state;  // every node state name
  std::map<std::string, double> oldest_heartbeat_age;  // per live job: the silence of its most silent node (s)
  std::map<std::string, std::size_t> spares;  // per live job: nodes waiting beside its running round
  std::map<std::string, std::size_t> stragglers;  // per live job: nodes named stragglers
  std::map<std::string, GoodputTotals> goodput;  // per live job: where its wall time went
  std::size_t finished_jobs_kept = 0;
};

// Checks the members of a round before it completes (the environment check plugs
// in here). Returns an error message to refuse the round; every member then gets error
// "round_refused" with it and leaves the job. Empty function = every round is accepted.
// Jobs with at most this many nodes list each node's fingerprint in status().
constexpr std::size_t kStatusFingerprintNodes = 64;

// A member as a RoundCheck sees it: what it said when it joined, and its fingerprint (kept apart
// from the spec by the state machine: one copy for every node whose fingerprint is identical).
struct CheckedNode {
  const NodeSpec* spec = nullptr;
  const nlohmann::json* fingerprint = nullptr;  // an empty object when it sent none
};
using RoundCheck =
    std::function<std::optional<std::string>(const std::string& job_id, const std::vector<CheckedNode>& members)>;

// The environment check as a RoundCheck: compares the members' fingerprints
// (members without one are not compared) under the first member's --env_check mode; refuses on
// a breaking difference in strict mode, and passes `warn` lines to `log` in warn mode (or for
// differences that break nothing).
RoundCheck make_env_round_check(std::function<void(const std::string&)> log);

// Makes the per-node secret a resuming node proves itself with (hex, kMinSecretChars or more).
// The default reads OpenSSL's generator; tests may inject a deterministic one.
using SecretSource = std::function<std::string()>;
std::string random_secret();
// Whether the host at the other end of connection `conn` has acknowledged everything the server
// sent it (the server asks its TCP stack): a probe that is not answered by a host that
// acknowledged it means a busy or stopped process, not a lost host. Empty function = never
// (tests; every unanswered probe is then a loss).
using PeerCheck = std::function<bool(ConnId conn)>;
// The port connection `conn` comes from on its host: a port with no listener, which the host
// refuses a connection to (or accepts) within milliseconds when it is up; other agents of the
// job try it for the server (check_peer). Empty function or 0 = no indirect check.
using PeerPort = std::function<int(ConnId conn)>;
// What a round carries of a node's secret for connection `conn`: the server seals it under that
// connection's key (auth.h, seal_hex), so that it never crosses the wire in clear. Empty
// function = the secret as it is (tests, a server without secrets).
using SecretSeal = std::function<std::string(ConnId conn, const std::string& secret)>;
// A duration in the state machine's messages: "2.5 s" (state.cpp and state_resume.cpp).
std::string seconds_text(double s);
// Natural order of host names, the order new nodes take group ranks in: runs of digits compare
// as numbers ("node7" before "node66"), the rest byte by byte; equal names by length.
bool natural_less(std::string_view a, std::string_view b);

// What drain() did: `code` is empty when the node was drained, else why not (unknown_job,
// unknown_node, drain_refused) with `message`; `node` describes the drained node.
struct DrainResult {
  std::string code;
  std::string message;
  std::string node;
};

class StateMachine {
 public:
  // REQUIRES: clock and out outlive the state machine.
  StateMachine(const Clock& clock, Outbox& out, RoundCheck round_check = {}, SecretSource secrets = {});
  void set_secret_seal(SecretSeal seal) { seal_ = std::move(seal); }
  void set_peer_check(PeerCheck check) { peer_check_ = std::move(check); }
  void set_peer_port(PeerPort port) { peer_port_ = std::move(port); }

  // The connection joins (or rejoins) spec.job_id. Invalid specs, an --nnodes mismatch with the
  // job, a taken --node_rank or a finished job drop the connection with a clear error.
  void join(ConnId conn, NodeSpec spec);
  // The connection resumes a round it ran before its rendezvous went away (REQUIRES: `r` passed
  // decode_resume). A job this server does not know is rebuilt from the resumes: the round
  // goes on (every resumed node gets `resumed`) once every group rank of its generation
  // resumed, or ends like after a lost node (restart, not counted) when the grace period passes
  // first. The newest generation wins; the restart count is the highest any resume gives (never
  // lowered). A rank already resumed or held with another secret is refused (resume_refused).
  // A job this server knows and runs: the node's new connection replaces its old one when the
  // secret matches a member; when the node's round has ended, it gets `restart` and joins.
  void resume(ConnId conn, const ResumeRequest& r);
  // Any message from a connection counts as a heartbeat.
  void touch(ConnId conn);
  // What the node's workers reported (its heartbeat's progress): kept for status().
  void progress(ConnId conn, const NodeProgress& progress);
  // The node's workers made no progress for `stalled_for` seconds: probe the job's silent nodes.
  void stall(ConnId conn, double stalled_for);
  // The node reached the host of the node check `id` asked about (check_peer): that node is not
  // lost at its probe's verdict. Ignored unless this node was asked.
  void peer_alive(ConnId conn, std::uint64_t id);
  // A worker of this node failed.
  void report_failure(ConnId conn, const WorkerFailure& failure);
  // Every worker of this node exited 0.
  void report_success(ConnId conn);
  // The node leaves the job on purpose (agent shutting down). Ends a running round like a loss.
  void leave(ConnId conn);
  // The connection closed. A node in a running round is lost; a finished node just goes.
  void disconnected(ConnId conn, const std::string& why);
  // An operator takes `node` (its host or its group rank, as status shows it) out of job `job_id`
  // (docs/maintenance.md): it is dropped with error "drained", and a running round ends
  // (restart, not counted) so that the next one takes a waiting node in its place. Refused when
  // it would leave fewer than MIN nodes, unless `force` (state_drain.cpp).
  DrainResult drain(const std::string& job_id, const std::string& node, bool force);
  // Checks every deadline against the clock. The server calls it every few milliseconds.
  void tick();
  // The server did not run for `seconds` (stopped, starved, a paused VM): the heartbeats nodes
  // sent meanwhile wait unread in its sockets. Every node's silence is counted as if that time
  // had not passed, so that the next tick drops no node for the server's own stall; a node that
  // really went silent is dropped that much later.
  void stalled(double seconds);

  // Every job: state, generation, restarts, nodes with their last heartbeat age; then the
  // finished jobs still kept (Retention), marked "finished": true with "ended_seconds_ago".
  nlohmann::json status() const;
  void set_retention(Retention retention) { retention_ = retention; }
  Gauges gauges() const;
  std::size_t finished_count() const { return finished_.size(); }
  bool is_member(ConnId conn) const { return conn_job_.count(conn) != 0; }
  std::size_t job_count() const { return jobs_.size(); }
  std::size_t node_count() const { return conn_job_.size(); }
  // Distinct fingerprints held for the live nodes (identical ones are kept once).
  std::size_t fingerprint_copies() const { return fingerprints_.size(); }

  // Job records (docs/etcd.md "Job records"): a replicated leader writes each job's record to etcd
  // before its agents hear of the change. With recording on, the jobs whose record changed (a
  // round formed, a restart, a verdict, the job forgotten) are collected for take_changed().
  void set_recording(bool on) { recording_ = on; }
  // The jobs changed since the last call, each once (sorted by id).
  std::vector<std::string> take_changed();
  // The job's record as it stands; nullopt when the job is gone (its record is deleted).
  std::optional<JobRecord> record(const std::string& job_id) const;
  // A new leader carries a job on from its record (REQUIRES: it passed decode_record). A running
  // round is restored from its agents' resumes, each checked against the secret of its rank; a
  // job between rounds waits for its nodes to join; a finished job refuses them. A job with no
  // node is kept kLoadedHoldSeconds for its agents to come back. Returns false (and logs) when
  // the job is already known here.
  bool load(const JobRecord& record);
  static constexpr double kLoadedHoldSeconds = 60.0;  // agents' default reconnect_timeout

 private:
  enum class NodeState { Waiting, Running, Succeeded, Rejoining, Finished, kCount };
  // Restoring: rebuilt from resumes, waiting for the rest of the round's nodes.
  enum class JobState { Gathering, Running, Succeeded, Failed, Restoring };

  struct Node {
    NodeSpec spec;  // its fingerprint is moved to `fingerprint` (spec.fingerprint stays null)
    FingerprintTable::Ref fingerprint;  // shared with the nodes whose fingerprint is identical
    const nlohmann::json& fingerprint_json() const { return FingerprintTable::read(fingerprint); }
    CheckedNode checked() const { return {&spec, &fingerprint_json()}; }
    // Takes a join's or a resume's spec, its fingerprint kept once in `table` (shared).
    void take_spec(NodeSpec&& from, FingerprintTable& table) {
      fingerprint = table.intern(std::move(from.fingerprint));
      spec = std::move(from);
      spec.fingerprint = nullptr;
    }
    NodeState state = NodeState::Waiting;
    int group_rank = -1;     // in the last round this node was part of; -1 = never
    double last_seen = 0;
    // Every message from the node: it is alive now, and answered any probe out to it.
    void heard(double now) {
      last_seen = now;
      answered_probe = true;
    }
    std::uint64_t join_seq = 0;
    std::string secret;                  // issued with the first round; proves a resume
    std::uint64_t resumed_generation = 0;  // while restoring: the generation it resumed
    bool success_pending = false;        // while restoring: reported success, applied after
    std::optional<NodeProgress> progress;  // the last its heartbeats carried
    // The last probe sent to it (stall(); -1: never), whether its answer is still awaited and
    // whether the node spoke since it was sent (a flag, not last_seen >= probed_at: the server's
    // own stall moves last_seen forward without the node saying a word); the indirect check of
    // that probe (check_peer; 0: none), and the node that reached its host for it (0: none did).
    double probed_at = -1;
    bool probe_out = false;
    bool answered_probe = false;
    std::uint64_t check_id = 0;
    ConnId vouched_by = 0;
    // Stragglers (state_straggler.cpp): since when its busy time stands at --straggler_factor x
    // the median of the others' or more (-1: it does not), whether it is named a straggler, and
    // since when it stands below the factor (a named one: below the line that clears it); the
    // last comparison.
    double slow_since = -1;
    double fast_since = -1;
    bool straggler = false;
    double busy_ratio = 0;
    double busy_median = 0;
    // The step its heartbeats carried when its round formed: a report of it is the last
    // round's, sent before the node heard of this one (goodput counts fresh steps only).
    std::int64_t stale_step = -1;
    bool fresh_step = false;
  };

  struct Job {
    std::string id;
    int min_nodes = 1;
    int max_nodes = 1;
    int max_restarts = 0;
    Timeouts timeouts;
    StragglerPolicy straggler;
    double next_straggler_judgement = 0;  // the busy times are compared again from then
    bool straggler_unreplaced_said = false;  // "no spare to replace it" was said for this round
    JobState state = JobState::Gathering;
    std::uint64_t generation = 0;
    int restarts_used = 0;
    std::unordered_map<ConnId, Node> nodes;
    std::size_t counts[static_cast<int>(NodeState::kCount)] = {};
    std::size_t spares[static_cast<int>(NodeState::kCount)] = {};  // of counts: nodes that are --spare
    std::unordered_map<int, ConnId> requested_ranks;
    double gather_since = 0;
    std::optional<double> min_reached_at;
    std::size_t round_size = 0;
    std::size_t round_succeeded = 0;
    std::size_t last_round_size = 0;  // nodes of the last round that ran (spares fill up to it)
    // Every failure reported for the current round (the first one acts; a failing job collects
    // the rest until its nodes have stopped). Cleared when a round completes.
    std::vector<WorkerFailure> round_failures;
    bool failing = false;  // the budget is spent: the job fails once its nodes have stopped
    std::optional<WorkerFailure> fatal;  // the first fatal report: the job fails with its reason
    double next_heartbeat_check = 0;  // no node can be silent too long before this
    // The probes out (stall()): each node and when its answer is due, in the order sent (one
    // probe_timeout for all, so the first is due first); the indirect checks out, by id: the node
    // checked and the agents asked.
    std::deque<std::pair<ConnId, double>> probes;
    struct IndirectCheck {
      ConnId node = 0;
      std::vector<ConnId> helpers;
    };
    std::unordered_map<std::uint64_t, IndirectCheck> checks;
    // Stall reports are weighed at most once per kStallScanGap (a scan visits every node, and
    // when one node of 10,000 dies, 9,999 report): the ones between wait for the next tick, as
    // one: the reporter whose report suspects the most (the latest `since`).
    struct StallReport {
      ConnId reporter = 0;
      double since = 0;
      double stalled_for = 0;
    };
    std::optional<StallReport> pending_stall;
    double next_stall_scan = 0;
    // Rebuilt from resumes (when, on the clock), and the restore in progress.
    std::optional<double> rebuilt_at;
    double restore_deadline = 0;
    Assignment restore_round;          // the round the first resume of the newest generation ran
    bool restore_conflict = false;     // resumes of one generation disagree on the round
    std::optional<WorkerFailure> pending_failure;  // reported while restoring; counted after
    std::unordered_map<int, ConnId> restore_holders;  // group rank -> node that resumed it
    // Back-off of restarts caused by joining nodes (admit_newcomers).
    int join_restarts = 0;            // within kChurnWindow of each other
    double last_join_restart = -1e300;
    double admit_at = 0;              // no join-caused restart before this
    bool admit_pending = false;       // a newcomer waits for admit_at
    // The waiting nodes hear the counts (tell_waiting) when they change, from tick().
    bool waiting_changed = false;
    double next_waiting_notice = 0;   // at most one `waiting` broadcast a second per job
    // When the round that ends now ended for a failure or a loss (failure-to-restart
    // time), and when the job ended with its summary and last nodes (kept in status).
    std::optional<double> restart_since;
    double ended_at = 0;
    std::string end_summary;
    nlohmann::json end_nodes;
    nlohmann::json end_env;  // the environment check's verdict when it ended (kept in status)
    std::size_t end_nodes_omitted = 0;
    // The running round as its record describes it (set when it forms or is loaded).
    std::vector<RecordMember> round_members;
    int round_world_size = 0;
    std::string round_master_addr;
    int round_master_port = 0;
    // Where its wall time went (goodput.h), told by the state machine as the job goes.
    GoodputAccount goodput{0.0, 1.0};
    bool goodput_adopted = false;  // carried on from a resume (a server rebuilt from them)
    bool loaded = false;    // loaded from etcd by this replica when it became the leader
    double hold_until = 0;  // a loaded job with no node is not forgotten before this
  };
  static constexpr std::size_t kKeptNodeRows = 64;  // node rows of a kept finished job
  // A finished job kept for status() after its last node went.
  struct FinishedJob {
    double ended_at = 0;
    double forgotten_at = 0;
    nlohmann::json status;  // as status() listed it when it ended
  };
  static constexpr double kWaitingNoticeInterval = 1.0;  // s
  static constexpr double kChurnWindow = 60.0;    // s without a join-caused restart resets the back-off
  static constexpr double kChurnMaxDelay = 30.0;  // s, the longest a newcomer waits

  Job* job_of(ConnId conn);
  // A new goodput account for a job with these timeouts: steps are seen every heartbeat, and
  // at most every kProgressReportSeconds.
  static GoodputAccount new_account(double now, const Timeouts& t) {
    return GoodputAccount(now, std::max(t.heartbeat_interval, kProgressReportSeconds));
  }
  // A node enters (in) or leaves the counts of its state: counts[], and spares[] for a --spare.
  static void tally(Job& job, const Node& node, bool in) {
    const int s = static_cast<int>(node.state);
    job.counts[s] = in ? job.counts[s] + 1 : job.counts[s] - 1;
    if (node.spec.spare) job.spares[s] = in ? job.spares[s] + 1 : job.spares[s] - 1;
  }
  static void set_state(Job& job, Node& node, NodeState state) {
    tally(job, node, false);
    node.state = state;
    tally(job, node, true);
  }
  void remove_node(Job& job, ConnId conn);
  void node_gone(Job& job, ConnId conn, const std::string& why, bool left);
  // `cause` labels the restart in events and metrics; "" = worker_failure when counted, else
  // membership.
  void end_round(Job& job, const std::string& reason, bool counted, const std::string& cause = "");
  // join()'s steps: the job a join names (created on first use); why it is refused (an error
  // code and message), if it is; the node entered into the job, Waiting for a new one.
  Job& job_for(const NodeSpec& spec, double now);
  std::optional<std::pair<std::string, std::string>> join_refusal(const Job& job, ConnId conn,
                                                                  const NodeSpec& spec) const;
  Node& enter(Job& job, ConnId conn, NodeSpec spec, double now);
  void admit_newcomers(Job& job, const std::string& reason);
  std::optional<std::string> policy_mismatch(const Job& job, const NodeSpec& spec) const;
  void maybe_complete(Job& job);
  // The waiting nodes a round can have now: every waiting node that is not a --spare, and spares
  // up to the size of the last round (they only take the place of nodes it lost).
  std::size_t eligible(const Job& job) const;
  // A spare, as status, gauges and events show it: a node that waits beside a running round, or
  // a --spare node that waits for one.
  static bool is_spare(const Job& job, const Node& node) {
    return node.state == NodeState::Waiting && (job.state == JobState::Running || node.spec.spare);
  }
  // A straggler, as status and gauges show it: named, in the round that runs now.
  static bool shows_straggler(const Job& job, const Node& node) {
    return node.straggler && node.state == NodeState::Running && job.state == JobState::Running;
  }
  void tell_waiting(Job& job);
  // complete_round()'s steps: the waiting nodes that make the round (--node_rank first, then
  // survivors, then by arrival; at most MAX); the same in group-rank order (--node_rank as asked,
  // survivors keep theirs when it still fits, everyone else the lowest free ranks in natural
  // host order, then by arrival: always 0..n-1); each told its round, which is returned (with
  // the last node's rank).
  std::vector<std::pair<ConnId, Node*>> round_members(Job& job);
  static std::vector<std::pair<ConnId, Node*>> in_rank_order(const std::vector<std::pair<ConnId, Node*>>& members);
  Assignment send_round(Job& job, const std::vector<std::pair<ConnId, Node*>>& by_rank);
  void complete_round(Job& job);
  void fail_job(Job& job, const WorkerFailure& failure, const std::string& summary);
  void finish_failing(Job& job);
  bool report_fatal(Job& job, Node& node, const WorkerFailure& failure);
  void drop_all(Job& job, const std::string& code, const std::string& message);
  void erase_if_empty(const std::string& job_id);
  bool report_pending_failure(Job& job, const WorkerFailure& failure);
  void restore_job(ConnId conn, const ResumeRequest& r);
  // Carries the job's goodput account on from a resume of its round (once per job).
  void adopt_goodput(Job& job, const ResumeRequest& r);
  void resume_restoring(Job& job, ConnId conn, const ResumeRequest& r);
  void resume_live(Job& job, ConnId conn, const ResumeRequest& r);
  void add_resumed(Job& job, ConnId conn, const ResumeRequest& r, NodeState state);
  void rebind(Job& job, ConnId old_conn, ConnId conn);
  void conclude_restore(Job& job);
  std::size_t count(const Job& job, NodeState s) const { return job.counts[static_cast<int>(s)]; }
  static std::string describe(const Node& node);
  // The group rank of the node that ran global rank `rank` in the last round (-1: not known).
  static int group_rank_of(const Job& job, int rank);
  nlohmann::json job_status(const Job& job, double now) const;
  void job_ended(Job& job, const std::string& summary);
  // Of `among`, the node that says a restart's reason or the job's verdict and goodput line in
  // full for the whole job (the others are quiet): the node of `root`'s rank when it is among
  // them, else the lowest group rank (state_status.cpp); 0 when `among` is empty. And the line:
  // "job J: goodput 97.4% of ...".
  static ConnId speaker_of(const Job& job, const std::vector<ConnId>& among, const WorkerFailure* root);
  // The same of all the job's nodes.
  static ConnId speaker_of(const Job& job, const WorkerFailure* root);
  static std::string goodput_line(const Job& job) {
    return "job " + job.id + ": " + job.goodput.totals(job.ended_at).summary();
  }
  void emit(const Job& job, const char* type, const std::string& cause, const std::string& node = "",
            std::vector<int> ranks = {}, nlohmann::json fields = nlohmann::json::object(),
            const std::string& message = "");
  void prune_finished(double now);
  // Takes a node out of its job for good (drain and straggler replacement): its agent hears
  // `drained` with `why` and exits 0; a running round restarts without it (not counted), with a
  // waiting spare in its place when there is one. Returns what follows, in words.
  std::string take_out(Job& job, ConnId conn, const std::string& cause, const std::string& why, bool force);
  // The nodes the next round can have once one is taken out: the round's others and those waiting.
  std::size_t left_without_one(const Job& job) const {
    return count(job, NodeState::Running) + count(job, NodeState::Waiting) + count(job, NodeState::Rejoining) - 1;
  }
  // Compares the busy times of a running job's nodes and names, clears or replaces stragglers
  // (state_straggler.cpp). `job` may be gone when it returns.
  void judge_stragglers(Job& job, double now);
  // One node's comparison (its busy_ratio and busy_median set): true while it is named.
  bool judge_straggler(Job& job, Node& node, double now);
  // --straggler=replace: drains a named straggler onto a waiting spare, or says once that none waits.
  void replace_straggler(Job& job, ConnId conn, double now);
  // The global rank of each running group rank's local rank 0, by group rank; one node's.
  static std::vector<int> first_ranks(const Job& job);
  static int first_rank_of(const std::vector<int>& first_ranks, const Node& node);
  // "node B: 1.8x the median busy time for 60 s (rank 5: 412 ms vs 230 ms)"
  static std::string straggler_line(const Node& node, int first_rank, double now);
  static constexpr double kStallScanGap = 0.05;  // s between two scans of a job for silent nodes
  static constexpr std::size_t kCheckHelpers = 2;  // agents asked to reach each probed node
  static constexpr double kStragglerJudgementEvery = 1.0;  // s
  static constexpr double kStragglerDipSeconds = 3.0;  // the shortest dip that restarts a slow count
  static constexpr double kStragglerMinExcessSeconds = 0.005;  // slow: also this much above the median
  // The stall reports held back, then the verdict on the probes whose answers are due: a probed
  // node not heard from since is lost (state_probe.cpp).
  void tick_probes(Job& job, double now);
  void conclude_probes(Job& job, double now);
  // Probes the nodes of `job` not heard from since `report.since`, but its reporter.
  void scan_for_silent(Job& job, const Job::StallReport& report, double now);
  // Asks up to kCheckHelpers of `helpers` to reach the host of `node` (probed now).
  void ask_to_check(Job& job, ConnId node, const std::vector<ConnId>& helpers, std::size_t turn);
  void changed(const Job& job);
  void describe_round(Job& job);
  static const char* state_name(NodeState s);
  static const char* state_name(JobState s);

  const Clock& clock_;
  Outbox& out_;
  RoundCheck round_check_;
  SecretSource secrets_;
  SecretSeal seal_;
  PeerCheck peer_check_;
  PeerPort peer_port_;
  std::uint64_t next_check_id_ = 0;
  // One table for every job: the jobs of a cluster usually share one image, and an entry is
  // immutable, so sharing it lets no node change what another node's fingerprint reads. Declared
  // before jobs_ (destroyed after them); an entry goes with the last node that holds it.
  FingerprintTable fingerprints_;
  std::map<std::string, Job> jobs_;
  std::unordered_map<ConnId, std::string> conn_job_;
  std::uint64_t next_join_seq_ = 0;
  Retention retention_;
  std::deque<FinishedJob> finished_;  // oldest first
  bool recording_ = false;
  std::set<std::string> changed_;
};

}  // namespace ddp::rdzv
