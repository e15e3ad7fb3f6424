#include "rendezvous/election.h"

#include <algorithm>

namespace ddp::rdzv {

using Clock = std::chrono::steady_clock;

namespace {
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

void Election::run() {
  EtcdClient etcd(options_.etcd);
  const double ttl = options_.lease_ttl;
  const auto interval = seconds(ttl / 4);
  Leadership now_;              // what was last reported
  bool reported = false;
  std::int64_t lease = 0;
  std::string last_error;
  auto report = [&](const Leadership& l) {
    const bool changed = !reported || l.leading != now_.leading || l.leader != now_.leader;
    now_ = l;
    reported = true;
    if (changed) {
      say(l.leading ? "leading (etcd key " + options_.key + ", lease " + std::to_string(lease) + ", TTL " +
                          std::to_string(options_.lease_ttl) + " s)"
                    : l.leader.empty() ? "following: no replica leads at the moment"
                                       : "following: the leader is " + l.leader);
    }
    if (options_.on_change) options_.on_change(l);
  };
  auto error = [&](const std::string& e) {
    if (e != last_error) say(e);
    last_error = e;
  };
  auto next = Clock::now();
  while (!sleep_until(next)) {
    next = Clock::now() + interval;
    if (now_.leading) {
      const auto sent = Clock::now();
      EtcdLease k = etcd.lease_keepalive(lease);
      if (k.status.ok() && k.ttl > 0) {
        last_error.clear();
        report({true, options_.me, sent + seconds(std::min<double>(ttl, k.ttl) * 3 / 4)});
        continue;
      }
      if (k.status.ok()) {
        error("the etcd lease " + std::to_string(lease) + " expired: no longer leading");
      } else {
        error("cannot renew the etcd lease: " + k.status.error);
        if (Clock::now() < now_.valid_until) {
          next = Clock::now() + std::chrono::milliseconds(100);  // again soon: still valid a while
          continue;
        }
        error("the etcd lease could not be renewed in time: no longer leading");
      }
      lease = 0;
      report({false, "", {}});
      next = Clock::now();
      continue;
    }
    EtcdRange r = etcd.range(options_.key);
    if (!r.status.ok()) {
      error("cannot read the leader from etcd: " + r.status.error);
      if (!reported || !now_.leader.empty()) report({false, "", {}});
      continue;
    }
    last_error.clear();
    if (!r.kvs.empty()) {
      if (!reported || now_.leader != r.kvs[0].value) report({false, r.kvs[0].value, {}});
      continue;
    }
    // Nobody leads: campaign with a fresh lease.
    const auto granted = Clock::now();
    EtcdLease g = etcd.lease_grant(options_.lease_ttl);
    if (!g.status.ok()) {
      error("cannot get an etcd lease: " + g.status.error);
      continue;
    }
    lease = g.id;
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
    put.lease = lease;
    txn.success.push_back(put);
    EtcdOp get;
    get.key = options_.key;
    txn.failure.push_back(get);
    EtcdTxnResult t = etcd.txn(txn);
    if (t.status.ok() && t.succeeded) {
      report({true, options_.me, granted + seconds(std::min<double>(ttl, g.ttl) * 3 / 4)});
      continue;
    }
    // Lost the race (or the call failed: the lease expires by itself, unused).
    lease = 0;
    if (!t.status.ok()) {
      error("cannot campaign for leadership: " + t.status.error);
    } else if (!t.ranges.empty() && !t.ranges[0].kvs.empty()) {
      report({false, t.ranges[0].kvs[0].value, {}});
    }
  }
  if (now_.leading && lease != 0) {
    EtcdStatus s = etcd.lease_revoke(lease);
    say(s.ok() ? "stepped down: revoked the etcd lease" : "stepping down: cannot revoke the etcd lease (" + s.error +
                                                              "); another replica leads once it expires");
  }
}

}  // namespace ddp::rdzv
