#include "agent/remote_rendezvous.h"

#include <algorithm>

#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>

#include <boost/asio.hpp>

#include "metrics/event.h"
#include "rendezvous/client.h"
#include "rendezvous/replica.h"
#include "rendezvous/server.h"
#include "rendezvous/state.h"

namespace ddp::agent {
namespace {

using boost::asio::ip::tcp;

std::vector<boost::asio::ip::address> interface_addresses() {
  std::vector<boost::asio::ip::address> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr) continue;
    if (it->ifa_addr->sa_family == AF_INET) {
      auto* sin = reinterpret_cast<sockaddr_in*>(it->ifa_addr);
      boost::asio::ip::address_v4::bytes_type b;
      std::memcpy(b.data(), &sin->sin_addr, 4);
      out.emplace_back(boost::asio::ip::address_v4(b));
    } else if (it->ifa_addr->sa_family == AF_INET6) {
      auto* sin6 = reinterpret_cast<sockaddr_in6*>(it->ifa_addr);
      boost::asio::ip::address_v6::bytes_type b;
      std::memcpy(b.data(), &sin6->sin6_addr, 16);
      out.emplace_back(boost::asio::ip::address_v6(b, sin6->sin6_scope_id));
    }
  }
  freeifaddrs(list);
  return out;
}

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string secs(double s) {
  std::ostringstream os;
  os.precision(3);
  os << s << " s";
  return os.str();
}

// Seconds one endpoint of a list gets before the next is tried (a single endpoint gets all).
constexpr double kEndpointSlice = 2.0;
// The leader a follower named gets this long: a follower may name a leader that just
// died (until its lease expires), and the agent must not wait a whole slice on it; a live
// leader answers hello well within it.
constexpr double kRedirectSlice = 0.5;
// Cap of the jittered backoff while reconnecting. For the first kFastReconnectWindow seconds
// after a loss (a daemon restarted by systemd is back within about a second) agents retry every
// 25..75 ms, so every agent of a job resumes well within 100 ms of the daemon's return
// (bench/rendezvous_restart); later they back off to about 1 s to spare a head that stays down.
constexpr double kFastReconnectDelay = 0.05;
constexpr double kFastReconnectWindow = 5.0;
constexpr double kSlowReconnectDelay = 1.0;
// How often a wait's progress line counts down.
constexpr double kProgressPeriod = 1.0;
// A wait shorter than this says nothing until the server tells the counts (the usual connect
// and join take milliseconds: no line for them).
constexpr double kQuietWait = 1.0;

// Whole seconds left, rounded up ("587 s"): a countdown that says 0 s has ended.
std::string seconds_left(double s) {
  return std::to_string(static_cast<long long>(std::ceil(std::max(0.0, s)))) + " s";
}

// Where a hosted server listens for an endpoint naming `host` (docs/agent.md): the
// address itself when the endpoint gives one (a loopback endpoint is not reachable from other
// machines), loopback for "localhost", and every address for another name, which other nodes
// may resolve to an address this machine does not (/etc/hosts often maps its own name to
// 127.0.1.1).
tcp::endpoint listen_endpoint(const std::string& host, unsigned short port) {
  if (host == "localhost") return tcp::endpoint(boost::asio::ip::address_v4::loopback(), port);
  boost::system::error_code ec;
  const auto address = boost::asio::ip::make_address(host, ec);
  if (!ec) return tcp::endpoint(address, port);
  return tcp::endpoint(tcp::v4(), port);
}

// The in-process server on a port the command line leaves to this node (`flag` says which).
std::unique_ptr<rdzv::Server> host_server(boost::asio::io_context& io, const tcp::endpoint& listen,
                                          const rdzv::ServerOptions& options, const std::string& flag) {
  try {
    return std::make_unique<rdzv::Server>(io, listen, options);
  } catch (const boost::system::system_error& e) {  // Asio's constructors refuse by throwing
    throw LaunchError(ExitCode::kUsage, "ddplaunch: " + flag + ": cannot listen for the rendezvous on " +
                                            listen.address().to_string() + ": " + e.code().message());
  }
}

}  // namespace

bool is_local_host(const std::string& host) {
  if (host.empty() || host == "localhost") return true;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && host == name) return true;
  boost::system::error_code ec;
  auto addr = boost::asio::ip::make_address(host, ec);
  if (ec) {
    // A name: resolve it forwards (never reverse DNS) and compare every address it gives.
    boost::asio::io_context io;
    tcp::resolver resolver(io);
    auto results = resolver.resolve(host, "", ec);
    if (ec) return false;
    for (const auto& entry : results) {
      auto a = entry.endpoint().address();
      if (a.is_loopback()) return true;
      for (const auto& mine : interface_addresses()) {
        if (mine == a) return true;
      }
    }
    return false;
  }
  if (addr.is_loopback()) return true;
  for (const auto& mine : interface_addresses()) {
    if (mine == addr) return true;
  }
  return false;
}

RemoteRendezvous::RemoteRendezvous(boost::asio::io_context& io, RemoteRendezvousOptions options)
    : io_(io), options_(std::move(options)), backoff_timer_(io), progress_timer_(io) {
  rdzv::ServerOptions server_options;
  server_options.token = options_.token;
  if (options_.echo_server_log) {
    server_options.log = [this](const std::string& line) { log("rendezvous server: " + line); };
  }
  // Differences that --env_check=warn lets through are the user's business even when quiet.
  server_options.round_check = rdzv::make_env_round_check([this](const std::string& line) { log(line); });
  if (options_.hosted_events) {
    server_options.on_event = [sink = options_.hosted_events](const metrics::Event& e) { sink->record(e); };
  }
  if (options_.etcd_replica) {
    start_replica(std::move(server_options));
    return;
  }
  if (options_.standalone) {
    // A free port on loopback: the whole job is on this node.
    server_ = host_server(io_, tcp::endpoint(boost::asio::ip::address_v4::loopback(), 0), server_options, "--standalone");
    endpoints_ = {rdzv::Endpoint{"127.0.0.1", server_->port()}};
    return;
  }
  endpoints_ = options_.endpoints;
  // What the command line gave, for a refusal: "ddplaunch: --rdzv_endpoint=GIVEN: WHY; ...".
  const auto refuse = [this](const std::string& why) {
    std::string given;
    for (const rdzv::Endpoint& endpoint : options_.endpoints) given += (given.empty() ? "" : ",") + endpoint.text();
    return LaunchError(ExitCode::kUsage, "ddplaunch: --rdzv_endpoint=" + given + ": " + why + "; expected HOST:PORT");
  };
  if (endpoints_.empty()) throw refuse("no endpoint given");
  if (endpoints_.size() == 1 && endpoints_[0].port == 0) {
    // Port 0: a free port, on a server only this node can host (nobody else can know the port);
    // torch 2.x writes --standalone as --rdzv_endpoint=localhost:0.
    const std::string host = endpoints_[0].host;
    if (!is_local_host(host) || !options_.host_if_local) {
      throw refuse("port 0 means a free port on a rendezvous this node hosts, so HOST must be this machine (e.g. "
                   "localhost:0, as torch 2.x writes --standalone); give the port of the rendezvous at " + host);
    }
    server_ = host_server(io_, listen_endpoint(host, 0), server_options, "--rdzv_endpoint=" + endpoints_[0].text());
    endpoints_[0].port = server_->port();
    log("hosting the rendezvous server in-process on " + endpoints_[0].text() + " (port 0: a free one)");
    return;
  }
  for (const rdzv::Endpoint& e : endpoints_) {
    if (const std::string error = rdzv::connect_error(e); !error.empty()) throw refuse(error);
  }
  if (!options_.host_if_local) return;
  for (const auto& [host, port] : endpoints_) {
    if (!is_local_host(host)) continue;
    // The in-process server speaks plain TCP only: with TLS the endpoint must be ddp-rendezvous.
    if (options_.tls) return;
    // Nothing listening there yet: this agent becomes the host (of the first local endpoint
    // that is free; later ones in the list are standbys for when that host dies). Someone
    // already bound it (the daemon, or an agent of this host that came first): try the next.
    try {
      const tcp::endpoint listen = listen_endpoint(host, static_cast<unsigned short>(port));
      server_ = std::make_unique<rdzv::Server>(io_, listen, server_options);
      log("hosting the rendezvous server in-process on port " + std::to_string(port) + " (listening on " +
          (listen.address().is_unspecified() ? std::string("every address") : listen.address().to_string()) + ")");
      return;
    } catch (const boost::system::system_error&) {
      server_.reset();
    }
  }
}

// A replica of the job's rendezvous on a free port of this node's address, following
// until its election wins; this agent's only endpoint (it redirects to the leader).
void RemoteRendezvous::start_replica(rdzv::ServerOptions server_options) {
  const EtcdReplicaOptions& r = *options_.etcd_replica;
  rdzv::ReplicaOptions o;
  o.server = std::move(server_options);
  o.etcd = r.etcd;
  o.prefix = r.prefix;
  o.lease_ttl = r.lease_ttl;
  o.advertise_host = r.advertise_host;
  o.log = [this](const std::string& line) { log("rendezvous replica: " + line); };
  boost::system::error_code ec;
  const auto address = boost::asio::ip::make_address(r.listen_addr, ec);
  if (ec) {
    throw LaunchError(ExitCode::kUsage,
                      "ddplaunch: --local_addr: cannot listen on " + r.listen_addr + ": not an IP address");
  }
  try {
    replica_ = std::make_unique<rdzv::Replica>(io_, tcp::endpoint(address, 0), std::move(o));
  } catch (const boost::system::system_error& e) {  // Asio's constructors refuse by throwing
    throw LaunchError(ExitCode::kUsage, "ddplaunch: cannot listen for the rendezvous replica on " + r.listen_addr +
                                            ": " + e.code().message() + "; give --local_addr=ADDRESS of this node");
  }
  endpoints_ = {replica_->endpoint()};
  log("hosting a replica of job " + options_.job_id + "'s rendezvous on " + replica_->endpoint().text() +
      " (etcd key prefix " +
      r.prefix + ", lease TTL " + std::to_string(r.lease_ttl) + " s); the replicas elect their leader through etcd");
}

// Once the job has ended (every node was told), its records in etcd are of no use and
// must not be found by a later job of the same --rdzv_id (a finished job refuses its nodes). Each
// agent deletes them as it leaves (idempotent; one etcd call's deadline at most).
void RemoteRendezvous::forget_job_records() {
  const EtcdReplicaOptions& r = *options_.etcd_replica;
  rdzv::EtcdClient etcd(r.etcd);
  rdzv::EtcdTxn txn;
  rdzv::EtcdOp del;
  del.kind = rdzv::EtcdOp::Kind::del;
  del.key = r.prefix + "jobs/";
  del.range_end = rdzv::prefix_range_end(del.key);
  txn.success.push_back(del);
  const auto result = etcd.txn(txn);
  if (!result.status.ok()) log("the job ended; could not delete its records in etcd: " + result.status.error);
}

RemoteRendezvous::~RemoteRendezvous() {
  closed_ = true;
  backoff_timer_.cancel();
  progress_timer_.cancel();
  if (client_) client_->close();
  if (server_) server_->stop();
  if (replica_) {
    replica_->stop();  // a leader revokes its lease: another replica could take over at once
    if (finished_) forget_job_records();
  }
}

void RemoteRendezvous::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "ddplaunch: %s\n", line.c_str());
  }
}

std::string RemoteRendezvous::endpoint_list() const {
  std::string out;
  for (const auto& e : endpoints_) out += (out.empty() ? "" : ", ") + e.text();
  return out;
}

void RemoteRendezvous::set_events(RendezvousEvents events) { events_ = std::move(events); }

bool RemoteRendezvous::said_elsewhere() const { return client_ && client_->quiet(); }

void RemoteRendezvous::set_progress_source(std::function<std::optional<rdzv::NodeProgress>()> source) {
  progress_source_ = std::move(source);
}

// One connection attempt to endpoints_[current_], until deadline_ (or a slice of it when there
// are other endpoints to try).
rdzv::ClientOptions RemoteRendezvous::client_options() const {
  rdzv::ClientOptions client_options;
  client_options.job_id = options_.job_id;
  client_options.token = options_.token;
  client_options.tls = options_.standalone ? nullptr : options_.tls;  // standalone: our own loopback server
  if (reconnecting_) {
    client_options.max_retry_delay =
        since(lost_at_) < kFastReconnectWindow ? kFastReconnectDelay : kSlowReconnectDelay;
  }
  // A leader named by a follower that refuses connections has died; the followers name
  // its successor as soon as one is elected, so the agent goes back to them instead of knocking
  // on the dead leader for the rest of its slice.
  client_options.give_up_when_refused = redirected_;
  return client_options;
}

// What the client tells this handler, turned into the agent's events and the progress line.
rdzv::ClientEvents RemoteRendezvous::client_events() {
  rdzv::ClientEvents ev;
  ev.progress = [this]() -> std::optional<rdzv::NodeProgress> {
    return progress_source_ ? progress_source_() : std::nullopt;
  };
  ev.on_round = [this](const rdzv::Assignment& a) {
    joining_.reset();
    end_progress();
    round_ = a;
    round_at_ = std::chrono::steady_clock::now();
    secret_ = client_->secret();
    reported_failure_.reset();
    reported_success_ = false;
    if (events_.on_round) events_.on_round(a);
  };
  ev.on_restart = [this](const std::string& reason, bool counted, bool failing, bool failure) {
    round_.reset();
    if (events_.on_restart) events_.on_restart(reason, counted, failing, failure);
  };
  ev.on_resumed = [this](std::uint64_t generation, int restart_count) {
    end_progress();
    log("resumed generation " + std::to_string(generation) + " (restart count " + std::to_string(restart_count) +
        ") at " + endpoints_[current_].text() + ", " + secs(since(lost_at_)) +
        " after losing the rendezvous; no worker was restarted");
  };
  // The job's goodput line comes to one node of the job (the failed one, else the lowest group
  // rank's), which says it for all.
  ev.on_job_succeeded = [this] {
    finished_ = true;
    end_progress();
    round_.reset();
    if (!client_->goodput().empty()) log(client_->goodput());
    if (events_.on_job_succeeded) events_.on_job_succeeded();
  };
  ev.on_job_failed = [this](const rdzv::WorkerFailure& f, const std::string& summary) {
    finished_ = true;
    end_progress();
    round_.reset();
    if (!client_->goodput().empty()) log(client_->goodput());
    if (events_.on_job_failed) events_.on_job_failed(f, summary);
  };
  ev.on_error = [this](const std::string& message) {
    end_progress();
    if (events_.on_rendezvous_error) events_.on_rendezvous_error(message);
  };
  ev.on_drained = [this](const std::string& message) {
    finished_ = true;
    end_progress();
    round_.reset();
    if (events_.on_drained) events_.on_drained(message);
  };
  ev.on_disconnected = [this](const std::string& message) { on_lost(message); };
  ev.on_redirect = [this](const std::string& leader, const std::string& why) { on_redirect(leader, why); };
  // The connect retries are in the progress line when there is one.
  ev.on_log = [this](const std::string& message) {
    if (!options_.progress) log(message);
  };
  ev.on_waiting = [this](const rdzv::Waiting& w) {
    waiting_ = std::make_unique<rdzv::Waiting>(w);
    waiting_at_ = std::chrono::steady_clock::now();
    show_progress();
  };
  return ev;
}

void RemoteRendezvous::start_client() {
  if (reconnecting_) ++reconnect_attempts_;
  client_ = rdzv::Client::create(io_, client_options(), client_events());
  double left = std::chrono::duration<double>(deadline_ - std::chrono::steady_clock::now()).count();
  // Several endpoints, or a reconnect (whose backoff cap changes with time): a slice at a time.
  if (endpoints_.size() > 1 || reconnecting_) left = std::min(left, redirected_ ? kRedirectSlice : kEndpointSlice);
  redirect_attempt_ = redirected_;
  redirected_ = false;
  client_->connect(endpoints_[current_], std::max(left, 0.0));
  if (round_) {
    // Give the round back: the server continues it, or tells us to restart.
    rdzv::ResumeRequest r;
    r.job_id = spec_.job_id.empty() ? options_.job_id : spec_.job_id;
    r.secret = secret_;
    r.node = spec_;
    r.node.job_id = r.job_id;
    r.assignment = *round_;
    r.assignment.round_age = since(round_at_);  // the server carries the job's goodput on from it
    client_->resume(std::move(r));
    if (reported_failure_) client_->report_failure(*reported_failure_);
    if (reported_success_) client_->report_success();
  } else if (joining_) {
    client_->join(*joining_);
  }
  show_progress();
}

// One line for the wait in progress, counted down every kProgressPeriod.
void RemoteRendezvous::show_progress() {
  if (!options_.progress || closed_ || finished_) return;
  const bool connected = client_ && client_->connected();
  const auto now = std::chrono::steady_clock::now();
  const double left = std::chrono::duration<double>(deadline_ - now).count();
  const std::string job = options_.job_id.empty() ? spec_.job_id : options_.job_id;
  std::string key, text;
  bool in_place = true;
  if (!connected && reconnecting_) {
    // The workers keep running and write to the same terminal: lines, not a redrawn one.
    in_place = false;
    const std::string& error = client_ ? client_->last_connect_error() : std::string();
    key = "reconnect";
    // The loss itself was said once, when it happened (on_lost): this line counts the attempts.
    text = "reconnecting to the rendezvous through " + endpoint_list() + ", attempt " +
           std::to_string(reconnect_attempts_) + (error.empty() ? "" : " (" + error + ")") +
           "; the workers keep running; giving up in " + seconds_left(left) + " (reconnect_timeout)";
  } else if (!connected) {
    const int attempts = client_ ? client_->attempts() : 0;
    const std::string& error = client_ ? client_->last_connect_error() : std::string();
    if (error.empty() && now - joined_at_ < seconds(kQuietWait)) return arm_progress_timer();
    key = "connect";
    if (client_ && !client_->resolve_error().empty()) {
      // A name that does not resolve is most often a typo or a missing DNS entry: said first.
      text = "the rendezvous host " + endpoints_[current_].host + " does not resolve (" + client_->resolve_error() +
             "); check --rdzv_endpoint and this node's DNS; retrying" +
             (attempts > 1 ? ", attempt " + std::to_string(attempts) : std::string()) + "; giving up in " +
             seconds_left(left) + " (join_timeout)";
    } else {
      text = "connecting to the rendezvous at " + endpoints_[current_].text() +
             (attempts > 1 ? ", attempt " + std::to_string(attempts) : std::string()) +
             (error.empty() ? "" : " (" + error + ")") + "; giving up in " + seconds_left(left) + " (join_timeout)";
    }
  } else if (!joining_) {
    end_progress();  // connected, and the round runs (a resume went through)
    return;
  } else if (!waiting_) {
    if (now - joined_at_ < seconds(kQuietWait)) return arm_progress_timer();
    key = "joined";
    text = "joined job " + job + " at " + endpoints_[current_].text() + "; waiting for the other nodes";
  } else {
    const rdzv::Waiting& w = *waiting_;
    const double elapsed = std::chrono::duration<double>(now - waiting_at_).count();
    text = "job " + job + " at " + endpoints_[current_].text() + ": ";
    if (w.min_nodes == w.max_nodes) {
      text += std::to_string(w.waiting) + " of " + std::to_string(w.max_nodes) + " nodes joined";
    } else {
      text += std::to_string(w.waiting) + (w.waiting == 1 ? " node" : " nodes") + " joined (MIN " +
              std::to_string(w.min_nodes) + ", MAX " + std::to_string(w.max_nodes) + ")";
    }
    if (w.rejoining > 0) text += ", " + std::to_string(w.rejoining) + " of the last round not back yet";
    if (w.join_left) {
      text += "; join_timeout in " + seconds_left(*w.join_left - elapsed);
    } else if (w.last_call_left) {
      text += "; the round starts in " + seconds_left(*w.last_call_left - elapsed) + " (last_call_timeout) or when " +
              std::to_string(w.max_nodes) + " have joined";
    }
    key = "wait " + std::to_string(w.waiting) + " " + std::to_string(w.rejoining) +
          (w.join_left ? " join" : w.last_call_left ? " last_call" : "");
  }
  options_.progress->show(key, text, std::chrono::duration<double>(now.time_since_epoch()).count(), in_place);
  arm_progress_timer();
}

void RemoteRendezvous::arm_progress_timer() {
  progress_timer_.expires_after(seconds(kProgressPeriod));
  progress_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) show_progress();
  });
}

void RemoteRendezvous::end_progress() {
  progress_timer_.cancel();
  waiting_.reset();
  if (options_.progress) options_.progress->clear();
}

// The connection is gone (or an attempt failed): try the next endpoint until the deadline.
void RemoteRendezvous::on_lost(const std::string& why) {
  if (closed_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const bool was_connected = client_ && client_->connected();
  if (was_connected) {
    // We had a rendezvous: a fresh reconnect_timeout starts now; the workers keep running.
    reconnecting_ = true;
    lost_at_ = now;
    lost_endpoint_ = endpoints_[current_].text();
    deadline_ = now + seconds(options_.reconnect_timeout);
    log("lost the rendezvous at " + lost_endpoint_ + " (" + why + "); the workers keep running while this node "
        "reconnects through " + endpoint_list() + " for up to " + secs(options_.reconnect_timeout) +
        " (reconnect_timeout)");
    reconnect_attempts_ = 0;
  }
  waiting_.reset();  // a new connection hears the counts again
  if (now >= deadline_) {
    std::string message;
    if (reconnecting_) {
      message = "lost the rendezvous at " + lost_endpoint_ + " and none of " + endpoint_list() + " answered for " +
                secs(since(lost_at_)) + " (reconnect_timeout " + secs(options_.reconnect_timeout) +
                "); last error: " + why + ". Start ddp-rendezvous again or give a standby endpoint in "
                "--rdzv_endpoint, and raise --rdzv_conf reconnect_timeout to wait longer";
    } else {
      message = why + (endpoints_.size() > 1 ? " (tried " + endpoint_list() + ")" : "");
    }
    end_progress();
    if (events_.on_rendezvous_error) events_.on_rendezvous_error(message);
    return;
  }
  // Preference follows the list: after a loss start again at the first endpoint (a blip must
  // not move one node to a standby while the others stay), after a failed attempt try the next.
  current_ = was_connected ? 0 : (current_ + 1) % endpoints_.size();
  // A short jittered pause: the client itself backs off on a refused endpoint. After a redirect
  // to a dead leader a little longer: the followers keep naming it until its lease expires, and
  // the agents of a large job must not hammer them meanwhile.
  static thread_local std::minstd_rand jitter(std::random_device{}());
  const double pause = redirect_attempt_ && !was_connected ? std::uniform_real_distribution<double>(0.05, 0.1)(jitter)
                                         : std::uniform_real_distribution<double>(0.01, 0.05)(jitter);
  redirect_attempt_ = false;
  backoff_timer_.expires_after(seconds(pause));
  backoff_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && !closed_) start_client();
  });
}

// A follower replica named the leader: go there at once, within the same deadline (a
// redirect is not a reconnect). A leader missing from --rdzv_endpoint is added to the list.
void RemoteRendezvous::on_redirect(const std::string& leader, const std::string& why) {
  if (closed_ || finished_) return;
  constexpr std::size_t kMaxEndpoints = 64;
  // The decoder let only HOST:PORT through (valid_leader_endpoint); a leader that still does not
  // parse is no leader known.
  rdzv::Endpoint to;
  if (!leader.empty()) {
    if (Expected<rdzv::Endpoint> parsed = rdzv::parse_endpoint(leader, -1)) to = std::move(*parsed);
  }
  auto it = std::find(endpoints_.begin(), endpoints_.end(), to);
  if (!rdzv::connect_error(to).empty() || std::chrono::steady_clock::now() >= deadline_ ||
      (it == endpoints_.end() && endpoints_.size() >= kMaxEndpoints) ||
      (it != endpoints_.end() && static_cast<std::size_t>(it - endpoints_.begin()) == current_)) {
    on_lost(why);  // the next endpoint of the list, as after a failed attempt
    return;
  }
  if (it == endpoints_.end()) it = endpoints_.insert(endpoints_.end(), to);
  current_ = static_cast<std::size_t>(it - endpoints_.begin());
  if (leader != redirected_to_) log(why + ": going there");
  redirected_to_ = leader;
  redirected_ = true;
  backoff_timer_.expires_after(std::chrono::milliseconds(0));
  backoff_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && !closed_) start_client();
  });
}

void RemoteRendezvous::join(const rdzv::NodeSpec& spec) {
  joined_at_ = std::chrono::steady_clock::now();
  spec_ = spec;
  joining_ = spec;
  round_.reset();
  if (!client_) {
    deadline_ = std::chrono::steady_clock::now() + seconds(options_.connect_timeout);
    start_client();
    return;
  }
  client_->join(spec);  // queued by a client that is still connecting
  show_progress();
}

void RemoteRendezvous::report_failure(const rdzv::WorkerFailure& failure) {
  // Re-sent after a resume; a fatal report (the job must end) replaces an ordinary one.
  if (!reported_failure_ || (reported_failure_->fatal.empty() && !failure.fatal.empty())) reported_failure_ = failure;
  if (client_) client_->report_failure(failure);        // queued while reconnecting
}

void RemoteRendezvous::report_stall(double stalled_for) {
  if (client_) client_->report_stall(stalled_for);  // news only while connected
}

void RemoteRendezvous::report_success() {
  reported_success_ = true;
  if (client_) client_->report_success();
}

void RemoteRendezvous::close() {
  end_progress();
  closed_ = true;
  backoff_timer_.cancel();
  if (client_) client_->close();
}

}  // namespace ddp::agent
