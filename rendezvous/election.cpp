#include "rendezvous/election.h"

#include <algorithm>
#include <exception>

#include "rendezvous/protocol.h"

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
}

void Election::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Election::sleep_until(Clock::time_point when) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, when, [this] { return stopping_; });
  return stopping_;
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

void Election::run() {
  etcd_ = std::make_unique<EtcdClient>(options_.etcd);
  auto next = Clock::now();
  while (!sleep_until(next)) {
    try {
      next = last_.leading ? renew() : follow_or_campaign();
    } catch (const std::exception& e) {  // a bug, not input: never leave the thread by an exception
      error(std::string("internal error in the election: ") + e.what());
      lease_ = 0;
      report({false, "", {}});
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
    report({true, options_.me, sent + seconds(std::min<double>(ttl, k.ttl) * 3 / 4)});
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
  report({false, "", {}});
  return Clock::now();
}

// Following: read the leader key; campaign when it is gone.
Clock::time_point Election::follow_or_campaign() {
  const auto next = Clock::now() + seconds(options_.lease_ttl / 4.0);
  EtcdRange r = etcd_->range(options_.key);
  if (!r.status.ok()) {
    error("cannot read the leader from etcd: " + r.status.error);
    if (!reported_ || !last_.leader.empty()) report({false, "", {}});
    return next;
  }
  last_error_.clear();
  if (!r.kvs.empty()) {
    const std::string leader = leader_named(r.kvs[0].value);
    if (!reported_ || last_.leader != leader) report({false, leader, {}});
    return next;
  }
  campaign();
  return last_.leading ? Clock::now() + seconds(options_.lease_ttl / 4.0) : next;
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
    report({true, options_.me, granted + seconds(std::min<double>(options_.lease_ttl, g.ttl) * 3 / 4)});
    return;
  }
  lease_ = 0;  // lost the race, or the call failed: the unused lease expires by itself
  if (!t.status.ok()) {
    error("cannot campaign for leadership: " + t.status.error);
  } else if (!t.ranges.empty() && !t.ranges[0].kvs.empty()) {
    report({false, leader_named(t.ranges[0].kvs[0].value), {}});
  }
}

}  // namespace ddp::rdzv
