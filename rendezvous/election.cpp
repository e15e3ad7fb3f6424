#include "rendezvous/election.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <utility>
#include <vector>

#include "rendezvous/protocol.h"
#include "rendezvous/reach.h"

namespace ddp::rdzv {

namespace {
using Clock = std::chrono::steady_clock;
Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}
}  // namespace

Election::Election(ElectionOptions options) : options_(std::move(options)) {
  options_.lease_ttl = std::max(options_.lease_ttl, 2);
  // A renewal must fit between two renewals: each call gets at most a quarter of the TTL.
  options_.etcd.call_timeout = std::min(options_.etcd.call_timeout, options_.lease_ttl / 4.0);
}

Election::~Election() { stop(); }

void Election::start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { run(); });
  if (options_.watch) watch_thread_ = std::thread([this] { watch_loop(); });
}

void Election::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  watch_stop_.stop();
  cv_.notify_all();
  if (watch_thread_.joinable()) watch_thread_.join();
  if (thread_.joinable()) thread_.join();
}

// The watch thread: one watch stream on the leader key at a time; every answer (its creation, a
// put, a deletion) and every end of a stream wakes the election thread, which reads the key and
// campaigns (following) or checks that the key is still its own (leading). A broken stream is
// opened again after TTL/4; meanwhile the election thread reads the key every TTL/4.
void Election::watch_loop() {
  EtcdOptions o = options_.etcd;
  EtcdClient etcd(o);
  EtcdWatchRequest request;
  request.key = options_.key;
  request.establish_timeout = std::max(1.0, options_.lease_ttl / 4.0);
  request.keepalive_idle = std::max(1.0, options_.lease_ttl / 2.0);
  const auto pause = seconds(options_.lease_ttl / 4.0);
  std::string last_error;
  bool live = false;
  auto tell = [this](bool is_live, std::vector<std::string> lines) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      nudged_ = true;
      watch_live_ = is_live;
      for (auto& l : lines) watch_lines_.push_back(std::move(l));
    }
    cv_.notify_all();
  };
  while (!watch_stop_.stopped()) {
    EtcdStatus s = etcd.watch(
        request,
        [&](const EtcdWatchResponse& r) {
          std::vector<std::string> lines;
          if (r.created && !live) {
            lines.push_back("watching the leader key " + options_.key + " (a follower campaigns when it is deleted)");
            last_error.clear();
          }
          live = true;
          for (const EtcdWatchEvent& ev : r.events) {
            if (ev.type == EtcdWatchEvent::Type::del) {
              lines.push_back("the leader key was deleted (watch, revision " + std::to_string(ev.kv.mod_revision) + ")");
            }
          }
          tell(true, std::move(lines));
        },
        watch_stop_);
    if (watch_stop_.stopped()) break;
    std::vector<std::string> lines;
    if (s.error != last_error || live) {
      char every[32];
      std::snprintf(every, sizeof every, "%g s", options_.lease_ttl / 4.0);
      lines.push_back("the watch on the leader key ended (" + s.error + "): reading the key every " + every +
                      " until the watch is back");
    }
    last_error = s.error;
    live = false;
    tell(false, std::move(lines));
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, pause, [&] { return stopping_; });
  }
}

void Election::say(const std::string& line) {
  if (options_.log) options_.log(line);
}

// The leader key's value is input from etcd: agents get it in not_leader, whose decoder refuses
// anything but HOST:PORT, so a malformed value is reported as "no leader known", never passed on.
std::string Election::leader_named(const std::string& value) {
  if (valid_leader_endpoint(value)) return value;
  error("the etcd key " + options_.key + " does not hold a HOST:PORT (" + std::to_string(value.size()) +
        " bytes): ignored");
  return "";
}

void Election::report(const Leadership& l) {
  const bool changed = !reported_ || l.leading != last_.leading || l.leader != last_.leader;
  last_ = l;
  last_.records.reset();  // handed over once
  reported_ = true;
  if (changed) {
    say(l.leading ? "leading (etcd key " + options_.key + ", lease " + std::to_string(lease_) + ", TTL " +
                        std::to_string(options_.lease_ttl) + " s)"
        : l.leader.empty() ? "following: no replica leads at the moment"
                           : "following: the leader is " + l.leader);
  }
  if (options_.on_change) options_.on_change(l);
}

void Election::error(const std::string& message) {
  if (message != last_error_) say(message);
  last_error_ = message;
}

void Election::write(RecordWrite records) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    writes_.push_back(std::move(records));
  }
  cv_.notify_all();
}

void Election::redirected(const std::string& leader) {
  if (!options_.watch || leader.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    if (now < next_leader_check_) return;
    next_leader_check_ = now + seconds(kLeaderCheckGap);
    suspect_ = leader;
    nudged_ = true;
  }
  cv_.notify_all();
}

bool Election::depose_if_gone(const EtcdKeyValue& kv) {
  std::string suspect;
  {
    std::lock_guard<std::mutex> lock(mu_);
    suspect.swap(suspect_);
  }
  if (suspect.empty() || suspect != kv.value || kv.lease == 0) return false;
  // The key was read first: while its lease lives no other replica can take it, so a refusal
  // now is that leader's, not a successor's at the same address.
  if (knock(kv.value, kLeaderCheckTimeout) != Reach::refused) {
    if (alive_said_ != kv.value) say("an agent was redirected to the leader " + kv.value + ", which accepts connections");
    alive_said_ = kv.value;
    return false;
  }
  EtcdStatus s = etcd_->lease_revoke(kv.lease);
  if (!s.ok()) {
    error("the leader " + kv.value + " refuses connections, but its lease cannot be revoked (" + s.error +
          "): waiting for it to expire");
    return false;
  }
  say("the leader " + kv.value + " refuses connections (nothing listens there: its process is gone): revoked its "
      "lease " + std::to_string(kv.lease) + " instead of waiting up to " + std::to_string(options_.lease_ttl) +
      " s for it to expire");
  return true;
}

void Election::fail_writes(const std::string& why) {
  std::deque<RecordWrite> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed.swap(writes_);
  }
  for (const RecordWrite& w : failed) {
    if (options_.on_written) options_.on_written(w.seq, why, txns_);
  }
}

// Leadership is given up at once (the lease revoked, so that another replica can take over
// without waiting for the TTL), and every queued write fails with `why`.
void Election::give_up(const std::string& why) {
  error(why);
  if (lease_ != 0) etcd_->lease_revoke(lease_);
  lease_ = 0;
  if (!reported_ || last_.leading) report({false, "", {}, std::nullopt});
  fail_writes(why);
}

void Election::run() {
  etcd_ = std::make_unique<EtcdClient>(options_.etcd);
  auto next = Clock::now();
  for (;;) {
    std::optional<RecordWrite> w;
    bool nudged = false;
    std::vector<std::string> watch_lines;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto wake = writes_.empty() ? next : std::min(next, std::max(write_retry_at_, Clock::now()));
      cv_.wait_until(lock, wake, [&] {
        return stopping_ || nudged_ || (!writes_.empty() && Clock::now() >= write_retry_at_);
      });
      if (stopping_) break;
      nudged = std::exchange(nudged_, false);
      watch_lines.swap(watch_lines_);
      // Renewals first: a stream of writes must not starve the lease.
      if (!nudged && Clock::now() < next && !writes_.empty() && Clock::now() >= write_retry_at_) {
        w = std::move(writes_.front());
        writes_.pop_front();
      }
    }
    for (const std::string& line : watch_lines) say(line);
    try {
      if (w) {
        write_records(*w);
        continue;
      }
      if (nudged) {
        if (last_.leading) {
          check_still_mine();
          if (!last_.leading) next = Clock::now() + seconds(options_.lease_ttl / 4.0);
          continue;
        }
        next = Clock::now();  // following: read the key (and campaign) now
      }
      if (Clock::now() < next) continue;
      next = last_.leading ? renew() : follow_or_campaign();
      if (!last_.leading) fail_writes("this replica does not lead");
    } catch (const std::exception& e) {  // a bug, not input: never leave the thread by an exception
      error(std::string("internal error in the election: ") + e.what());
      lease_ = 0;
      report({false, "", {}, std::nullopt});
      fail_writes("internal error in the election");
      next = Clock::now() + seconds(options_.lease_ttl / 4.0);
    }
  }
  if (last_.leading && lease_ != 0) {
    EtcdStatus s = etcd_->lease_revoke(lease_);
    say(s.ok() ? "stepped down: revoked the etcd lease"
               : "stepping down: cannot revoke the etcd lease (" + s.error + "); another replica leads once it expires");
  }
}

// Leading: one keepalive. Each success sent at `sent` makes leadership valid until
// sent + 3/4 TTL; a failure is retried soon while that lasts, then leadership is given up.
Clock::time_point Election::renew() {
  const double ttl = options_.lease_ttl;
  const auto sent = Clock::now();
  EtcdLease k = etcd_->lease_keepalive(lease_);
  if (k.status.ok() && k.ttl > 0) {
    last_error_.clear();
    Leadership l{true, options_.me, sent + seconds(std::min<double>(ttl, k.ttl) * 3 / 4), std::nullopt};
    // Renewed after leadership had lapsed: the server stepped down and forgot its jobs, so this
    // is a new term for it, which starts from the records like the first.
    if (sent > last_.valid_until && !load_records(l)) {
      give_up("no longer leading: cannot read the job records from etcd");
      return Clock::now() + seconds(ttl / 4);
    }
    report(l);
    return sent + seconds(ttl / 4);
  }
  if (k.status.ok()) {
    error("the etcd lease " + std::to_string(lease_) + " expired: no longer leading");
  } else {
    error("cannot renew the etcd lease: " + k.status.error);
    if (Clock::now() < last_.valid_until) return Clock::now() + std::chrono::milliseconds(100);
    error("the etcd lease could not be renewed in time: no longer leading");
  }
  lease_ = 0;
  report({false, "", {}, std::nullopt});
  return Clock::now();
}

// Following: read the leader key; campaign when it is gone. The next read comes after TTL/4, or
// after a TTL while the watch lives (it wakes this thread at once on a change; the read is the
// fallback should the stream have died silently).
Clock::time_point Election::follow_or_campaign() {
  bool live = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live = watch_live_;
  }
  const auto next = Clock::now() + seconds(live ? options_.lease_ttl : options_.lease_ttl / 4.0);
  EtcdRange r = etcd_->range(options_.key);
  if (!r.status.ok()) {
    error("cannot read the leader from etcd: " + r.status.error);
    if (!reported_ || !last_.leader.empty()) report({false, "", {}, std::nullopt});
    return next;
  }
  last_error_.clear();
  if (!r.kvs.empty() && !depose_if_gone(r.kvs[0])) {
    const std::string leader = leader_named(r.kvs[0].value);
    if (!reported_ || last_.leader != leader) report({false, leader, {}, std::nullopt});
    return next;
  }
  campaign();
  return last_.leading ? Clock::now() + seconds(options_.lease_ttl / 4.0) : next;
}

// Leading, and the watch saw the leader key change: a deletion (the lease expired or was revoked
// behind this replica's back) or another replica's key means this one no longer leads.
void Election::check_still_mine() {
  EtcdRange r = etcd_->range(options_.key);
  if (!r.status.ok()) return;  // renewals decide, as without the watch
  if (!r.kvs.empty() && r.kvs[0].create_revision == leader_revision_) return;
  give_up(r.kvs.empty() ? "deposed: the leader key was deleted (its lease expired or was revoked)"
                        : "deposed: the leader key is another replica's (revision " +
                              std::to_string(r.kvs[0].create_revision) + ")");
  if (!r.kvs.empty()) report({false, leader_named(r.kvs[0].value), {}, std::nullopt});
}

// A fresh lease, then a transaction that puts the leader key only if it does not exist.
void Election::campaign() {
  const auto granted = Clock::now();
  EtcdLease g = etcd_->lease_grant(options_.lease_ttl);
  if (!g.status.ok()) {
    error("cannot get an etcd lease: " + g.status.error);
    return;
  }
  lease_ = g.id;
  EtcdTxn txn;
  EtcdCompare absent;
  absent.key = options_.key;
  absent.target = EtcdCompare::Target::create_revision;
  absent.number = 0;
  txn.compare.push_back(absent);
  EtcdOp put;
  put.kind = EtcdOp::Kind::put;
  put.key = options_.key;
  put.value = options_.me;
  put.lease = lease_;
  txn.success.push_back(put);
  EtcdOp get;
  get.key = options_.key;
  txn.failure.push_back(get);
  EtcdTxnResult t = etcd_->txn(txn);
  if (t.status.ok() && t.succeeded) {
    leader_revision_ = t.revision;  // the transaction created the key: its create revision
    Leadership l{true, options_.me, granted + seconds(std::min<double>(options_.lease_ttl, g.ttl) * 3 / 4),
                 std::nullopt};
    if (!load_records(l)) {
      give_up("took the leader key but cannot read the job records from etcd: giving it back");
      return;
    }
    report(l);
    return;
  }
  lease_ = 0;  // lost the race, or the call failed: the unused lease expires by itself
  if (!t.status.ok()) {
    error("cannot campaign for leadership: " + t.status.error);
  } else if (!t.ranges.empty() && !t.ranges[0].kvs.empty()) {
    report({false, leader_named(t.ranges[0].kvs[0].value), {}, std::nullopt});
  }
}

// Every job record under the prefix, for the server to load before it serves.
bool Election::load_records(Leadership& l) {
  if (options_.records_prefix.empty()) {
    l.records.emplace();
    return true;
  }
  EtcdRange r = etcd_->range(options_.records_prefix, prefix_range_end(options_.records_prefix));
  if (!r.status.ok()) {
    error("cannot read the job records under " + options_.records_prefix + ": " + r.status.error);
    return false;
  }
  l.records.emplace();
  for (EtcdKeyValue& kv : r.kvs) l.records->emplace_back(std::move(kv.key), std::move(kv.value));
  return true;
}

// One transaction: every put and delete of `w`, if the leader key is still the one this replica
// created. etcd unreachable: retried every 100 ms while leadership lasts (the server holds the
// frames meanwhile). The compare failing means another replica leads (or none does): this one
// is deposed. Anything else etcd refuses (a record over its request limit, no permission) gives
// leadership up, since a leader that cannot write its records must not drive jobs.
void Election::write_records(RecordWrite& w) {
  if (!last_.leading) {
    if (options_.on_written) options_.on_written(w.seq, "this replica does not lead", txns_);
    return;
  }
  EtcdTxn txn;
  EtcdCompare mine;
  mine.key = options_.key;
  mine.target = EtcdCompare::Target::create_revision;
  mine.number = leader_revision_;
  txn.compare.push_back(mine);
  for (auto& [id, value] : w.puts) {
    EtcdOp put;
    put.kind = EtcdOp::Kind::put;
    put.key = options_.records_prefix + id;
    put.value = value;
    txn.success.push_back(std::move(put));
  }
  for (const std::string& id : w.deletes) {
    EtcdOp del;
    del.kind = EtcdOp::Kind::del;
    del.key = options_.records_prefix + id;
    txn.success.push_back(std::move(del));
  }
  EtcdTxnResult t = etcd_->txn(txn);
  if (t.status.ok() && t.succeeded) {
    ++txns_;
    if (options_.on_written) options_.on_written(w.seq, "", txns_);
    return;
  }
  // The failed write is answered first, so the server says why it steps down.
  if (t.status.ok()) {
    if (options_.on_written) options_.on_written(w.seq, "deposed", txns_);
    give_up("deposed: the leader key is no longer the one this replica created (revision " +
            std::to_string(leader_revision_) + "); the job records were not written and no agent is told");
    return;
  }
  const bool transient = t.status.code == 0 || t.status.code == 14;
  if (transient && Clock::now() < last_.valid_until) {
    error("cannot write the job records (retrying while the lease lasts): " + t.status.error);
    {
      std::lock_guard<std::mutex> lock(mu_);
      writes_.push_front(std::move(w));
    }
    write_retry_at_ = Clock::now() + std::chrono::milliseconds(100);
    return;
  }
  if (options_.on_written) options_.on_written(w.seq, t.status.error, txns_);
  give_up("no longer leading: cannot write the job records: " + t.status.error);
}

}  // namespace ddp::rdzv
