// Leader election of replicated ddp-rendezvous daemons on etcd (docs/etcd.md).
//
// One Election per daemon, owned by its main; it runs its own thread (started by start(),
// joined by stop() or the destructor) that makes every etcd call, so a slow or unreachable etcd
// never blocks the server's event loop. It reports through `on_change`, called on that thread;
// the owner posts the news to its event loop. The only state shared between the threads is the
// stop flag and the queue of job-record writes (write()), guarded by `mu_`; `on_written`
// answers each write on the election thread.
//
// A replica leads while it holds the leader key (PREFIX + "leader", value: its HOST:PORT),
// created with a lease in a transaction that succeeds only if the key does not exist
// (create_revision == 0). The leader renews the lease every TTL/4; each renewal sent at time t
// makes leadership valid until t + 3/4 TTL (the lease lives at least TTL from when etcd received
// it, which is after t), so a leader that cannot renew stops leading a quarter TTL before etcd can
// let another replica take the key. A second thread (the watch thread) holds an etcd watch on the
// leader key and wakes the election thread on every change, so a follower campaigns as soon as
// the key is deleted; followers also read the key every TTL while the watch lives, every TTL/4
// while it does not (etcd down, stream broken), so correctness never depends on the watch.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rendezvous/etcd.h"
#include "rendezvous/job_record.h"

namespace ddp::rdzv {

struct Leadership {
  bool leading = false;
  std::string leader;  // the leader's HOST:PORT (this replica's own when leading); "" = unknown
  std::chrono::steady_clock::time_point valid_until{};  // leading: stop leading at this time
  // Set in the report that starts a term of leadership (and only then): every job record under
  // the prefix, as (key, value), read after the leader key was taken and before serving.
  std::optional<std::vector<std::pair<std::string, std::string>>> records;
};

struct ElectionOptions {
  EtcdOptions etcd;
  std::string key;     // the leader key, e.g. "/ddplaunch/rendezvous/leader"
  std::string me;      // this replica's HOST:PORT, as agents reach it
  int lease_ttl = 5;   // seconds (etcd leases are whole seconds); at least 2
  bool watch = true;   // watch the leader key (else: only the TTL/4 reads)
  std::string records_prefix;  // job records live under this prefix (PREFIX + "jobs/")
  std::function<void(const Leadership&)> on_change;   // on the election thread; every renewal too
  std::function<void(const std::string&)> log;        // on the election thread
  // The outcome of write(): error "" = committed; else it was not written (this replica lost
  // leadership, or etcd refused it) and leadership is given up. `txns` counts the transactions
  // written so far. On the election thread.
  std::function<void(std::uint64_t seq, const std::string& error, std::uint64_t txns)> on_written;
};

class Election {
 public:
  explicit Election(ElectionOptions options);
  ~Election();
  Election(const Election&) = delete;
  Election& operator=(const Election&) = delete;

  void start();
  // Stops the thread; a leader revokes its lease first (one call's deadline at most), so that a
  // follower takes over at once instead of after the TTL.
  void stop();
  // A follower redirected an agent to `leader` (the server's thread; any thread). The agent came
  // here, so it may have lost that leader: the election thread reads the leader key and, if that
  // leader still holds it, tries a connection to it. A refused one means nothing listens there,
  // so its process is gone: its lease is revoked and this replica campaigns at once instead of
  // waiting up to a TTL for etcd to expire it. At most one check every kLeaderCheckGap; only with
  // the watch on, which makes a leader deposed by mistake (a firewall that rejects replicas but
  // not agents) step down within moments.
  void redirected(const std::string& leader);
  static constexpr double kLeaderCheckGap = 0.1;     // s between two checks of the leader
  static constexpr double kLeaderCheckTimeout = 0.2;  // s: a connection neither made nor refused

  // Queues job records for one transaction that succeeds only while the leader key is the one
  // this replica created (its create revision): a deposed leader's write fails. Any thread.
  void write(RecordWrite records);

 private:
  using Clock = std::chrono::steady_clock;
  void run();
  // One step of the loop each; they return when to take the next step.
  Clock::time_point renew();
  Clock::time_point follow_or_campaign();
  void campaign();
  void say(const std::string& line);
  void report(const Leadership& now);
  void error(const std::string& message);  // logged when it differs from the last one
  std::string leader_named(const std::string& value);
  bool load_records(Leadership& l);
  void write_records(RecordWrite& w);
  void fail_writes(const std::string& why);
  void give_up(const std::string& why);
  void watch_loop();  // the watch thread
  void check_still_mine();  // leading, after the watch saw the leader key change
  // Following: the key names `kv`'s leader, which an agent may have lost; true when its lease was
  // revoked because nothing listens at its address any more.
  bool depose_if_gone(const EtcdKeyValue& kv);
  ElectionOptions options_;
  // The election thread's own state (no other thread touches it).
  std::unique_ptr<EtcdClient> etcd_;
  std::int64_t lease_ = 0;      // the lease of the leader key (leading) or of a campaign
  Leadership last_;             // what was last reported
  bool reported_ = false;
  std::string last_error_;
  std::int64_t leader_revision_ = 0;  // the create revision of the leader key this replica holds
  std::uint64_t txns_ = 0;            // record transactions committed
  Clock::time_point write_retry_at_{};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::deque<RecordWrite> writes_;  // guarded by mu_
  // The watch thread's news for the election thread.
  bool nudged_ = false;                  // guarded by mu_: the leader key changed (or may have)
  std::string suspect_;                  // guarded by mu_: a leader an agent was redirected to
  Clock::time_point next_leader_check_{};  // guarded by mu_
  std::string alive_said_;               // the last leader found listening (said once)
  bool watch_live_ = false;              // guarded by mu_: the watch stream is established
  std::vector<std::string> watch_lines_;  // guarded by mu_: log lines, said by the election thread
  EtcdWatchStop watch_stop_;             // thread-safe itself
  std::thread thread_;
  std::thread watch_thread_;
};

}  // namespace ddp::rdzv
