#include "rendezvous/status.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <ctime>

#include <cstdio>
#include <sstream>
#include <functional>
#include <stdexcept>
#include <vector>

#include <boost/asio.hpp>

#include "rendezvous/auth.h"
#include "rendezvous/client.h"
#include "rendezvous/goodput.h"
#include "rendezvous/protocol.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

// One status query: connect (plain or TLS), greet, answer the challenge with a status request,
// read the reply. Lives on the caller's stack for one query_status() call; every handler runs
// inside io.run() on that thread. Each step that fails finishes the query with its error.
class StatusQuery {
 public:
  StatusQuery(const Endpoint& endpoint, const std::string& token, double timeout_s, const std::string& job_id,
              const std::shared_ptr<TlsContext>& tls, const Drain* drain = nullptr)
      : endpoint_(endpoint), token_(token), timeout_s_(timeout_s), job_id_(job_id), tls_(tls), drain_(drain),
        where_("rendezvous " + endpoint.text()) {}

  StatusResult run() {
    timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(timeout_s_)));
    timer_.async_wait([this](boost::system::error_code ec) {
      if (!ec) on_timeout();
    });
    resolver_.async_resolve(endpoint_.host, std::to_string(endpoint_.port),
                            [this](boost::system::error_code ec, tcp::resolver::results_type r) {
                              if (ec) return finish("resolve " + endpoint_.host + " (for " + where_ + "): " + ec.message());
                              connect(r);
                            });
    io_.run();
    if (!result_.error.empty()) result_.status = nullptr;
    return std::move(result_);
  }

 private:
  void on_timeout() {
    if (result_.error.empty() && result_.status.is_null()) {
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g s", timeout_s_);
      result_.error = !connected_    ? "connect to " + where_ + ": no answer within " + secs
                      : !identified_ ? where_ + " accepted the connection but sent no ddp-rendezvous challenge within " +
                                           secs + ": is another service listening there?"
                                     : where_ + ": no " + (drain_ ? "answer to the drain" : "status reply") +
                                           " within " + secs;
    }
    resolver_.cancel();
    close_connection();
  }

  void connect(const tcp::resolver::results_type& r) {
    asio::async_connect(socket_, r, [this](boost::system::error_code ec, const tcp::endpoint&) {
      if (ec) return finish("connect to " + where_ + ": " + ec.message());
      connected_ = true;
      stream_ = make_client_stream(std::move(socket_), tls_, endpoint_.host);
      stream_->async_handshake([this](const boost::system::error_code& ec2) {
        if (ec2) return finish(where_ + ": " + describe_tls_failure(ec2, true));
        // Said at once, so that a service that is not a rendezvous server answers (and is named).
        // Read once it is written (a failed write shows in the read): writes never overlap.
        stream_->async_write(asio::buffer(*greeting_), [this](const boost::system::error_code&, std::size_t) {
          read_more();
        });
      });
    });
  }

  void read_more() {
    stream_->async_read_some(asio::buffer(buf_), [this](const boost::system::error_code& ec, std::size_t n) {
      if (!identified_ && (!ec || ec == asio::error::eof || !start_bytes_.empty())) {
        if (!ec) start_bytes_.append(buf_.data(), std::min(n, kFrameHeaderBytes + kMaxChallengeBytes + 1));
        const ServerCheck check = check_server_start(start_bytes_, static_cast<bool>(ec));
        if (check.verdict == ServerCheck::Verdict::refuse) return finish(where_ + " " + check.reason);
        identified_ = check.verdict == ServerCheck::Verdict::rendezvous;
      }
      if (ec) return finish("read from " + where_ + ": " + ec.message());
      reader_.feed(buf_.data(), n);
      while (true) {
        const FrameReader::Result r = reader_.next(payload_);
        if (r == FrameReader::Result::need_more) break;
        if (r == FrameReader::Result::error) return finish(where_ + ": " + reader_.error().message);
        Decoded decoded = decode(payload_);
        if (decoded.error) return finish(where_ + ": " + decoded.error->message);
        if (!on_message(*decoded.message)) return;
      }
      read_more();
    });
  }

  // Handles one message; returns false when the query is over.
  bool on_message(Message& m) {
    switch (m.type) {
      case MessageType::challenge: {
        Hello h;
        h.job_id = job_id_;
        h.client_nonce = random_hex();
        if (!token_.empty()) {
          h.proof = auth_proof(token_, drain_ ? "drain" : "status", std::get<Challenge>(m.body).nonce, h.client_nonce,
                               job_id_);
        }
        if (drain_) {
          Drain d = *drain_;
          d.hello = h;
          request_ = encode(make_drain(d));
        } else {
          request_ = encode(make_status_request(h));
        }
        stream_->async_write(asio::buffer(*request_), [this](const boost::system::error_code& ec, std::size_t) {
          if (ec) finish("send to " + where_ + ": " + ec.message());
        });
        return true;
      }
      case MessageType::error: {
        const auto& e = std::get<ErrorMessage>(m.body);
        result_.code = e.code;
        finish(where_ + " refused: " + e.message + " [" + e.code + "]");
        return false;
      }
      case MessageType::drained: {
        const auto& d = std::get<Drained>(m.body);
        result_.status = {{"job_id", d.job_id}, {"node", d.node}, {"message", d.message}};
        finish("");
        return false;
      }
      case MessageType::not_leader: {
        // A follower replica (docs/etcd.md): the caller asks the leader instead.
        result_.leader = std::get<NotLeader>(m.body).leader;
        finish(result_.leader.empty() ? where_ + " is a follower replica and no replica leads at the moment; try again"
                                      : "");
        return false;
      }
      case MessageType::status_reply:
        result_.status = std::move(std::get<StatusReply>(m.body).status);
        finish("");
        return false;
      default:
        finish(where_ + ": unexpected \"" + std::string(to_string(m.type)) + "\" message");
        return false;
    }
  }

  void finish(const std::string& error) {
    if (result_.error.empty()) result_.error = error;
    timer_.cancel();
    close_connection();
  }

  void close_connection() {
    boost::system::error_code ignored;
    if (stream_) {
      stream_->close();
    } else {
      socket_.close(ignored);
    }
  }

  const Endpoint& endpoint_;
  const std::string& token_;
  const double timeout_s_;
  const std::string& job_id_;
  const std::shared_ptr<TlsContext>& tls_;
  const Drain* drain_;  // null: a status query
  const std::string where_;
  StatusResult result_;
  asio::io_context io_{1};
  tcp::resolver resolver_{io_};
  tcp::socket socket_{io_};
  std::unique_ptr<Stream> stream_;  // the connection once connected (plain or TLS)
  asio::steady_timer timer_{io_};
  FrameReader reader_{256u << 20};  // a status reply of 10,000 nodes is large
  std::vector<char> buf_ = std::vector<char>(65536);
  std::string payload_;
  Frame request_;
  // Until the peer proved to be a rendezvous server (check_server_start): what it sent so far.
  bool connected_ = false;
  bool identified_ = false;
  std::string start_bytes_;
  const Frame greeting_ = encode_greeting();
};

}  // namespace

StatusResult query_status(const Endpoint& endpoint, const std::string& token, double timeout_s,
                          const std::string& job_id, const std::shared_ptr<TlsContext>& tls) {
  if (std::string error = connect_error(endpoint); !error.empty()) {
    StatusResult result;
    result.error = "rendezvous endpoint " + error;
    return result;
  }
  return StatusQuery(endpoint, token, timeout_s, job_id, tls).run();
}

StatusResult drain_node(const Endpoint& endpoint, const std::string& token, double timeout_s, const Drain& drain,
                        const std::shared_ptr<TlsContext>& tls) {
  Endpoint at = endpoint;
  StatusResult result;
  // A follower names its leader; a leader changing meanwhile may take one more hop.
  for (int hop = 0; hop < 3; ++hop) {
    if (std::string error = connect_error(at); !error.empty()) {
      result.error = "rendezvous endpoint " + error;
      return result;
    }
    result = StatusQuery(at, token, timeout_s, drain.job, tls, &drain).run();
    if (result.leader.empty() || !result.error.empty()) return result;
    Expected<Endpoint> leader = parse_endpoint(result.leader);
    if (!leader) {
      result.error = "rendezvous " + at.text() + " named its leader " + result.leader + ": " + leader.error();
      return result;
    }
    at = *leader;
  }
  result.error = "rendezvous " + endpoint.text() + ": the leader kept moving (3 redirects); try again";
  return result;
}

namespace {

// The job's "env" field (the environment check) as text: whether its nodes' software agrees, and where not.
std::string environment_lines(const nlohmann::json& env) {
  const std::size_t checked = env.value("checked_nodes", std::size_t{0});
  std::ostringstream os;
  os << "  environment: ";
  if (checked == 0) {
    os << "not checked (no node sent a fingerprint: --env_check=off, or nodes older than the check)\n";
  } else if (checked == 1) {
    os << "1 node fingerprinted, nothing to compare yet\n";
  } else if (env.value("agree", true)) {
    os << "the " << checked << " nodes agree\n";
  } else {
    os << "the " << checked << " nodes DIFFER"
       << (env.value("breaking", false) ? " (breaks a job: --env_check=strict refuses such a round)"
                                        : " (informational only)")
       << ":\n";
    std::istringstream lines(env.value("message", std::string()));
    std::string line;
    while (std::getline(lines, line)) os << "    " << line << "\n";
  }
  return os.str();
}

// The wall-clock time `ago` seconds before now, as "2026-12-01 12:00:00 UTC".
std::string utc_stamp(double ago) {
  const std::time_t when = std::time(nullptr) - static_cast<std::time_t>(ago);
  char stamp[32];
  std::tm tm{};
  gmtime_r(&when, &tm);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return stamp;
}

std::string text_of(const nlohmann::json& j, const char* key, const char* missing = "-") {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return missing;
  if (it->is_string()) return it->get<std::string>();
  return it->dump();
}

// "straggler: node B: 1.8x the median busy time for 60 s (rank 5: 412 ms vs 230 ms)", one line
// for each node the server named a straggler (docs/maintenance.md, "Stragglers").
void write_stragglers(std::ostream& os, const nlohmann::json& job, const char* indent) {
  auto lines = job.find("stragglers");
  if (lines == job.end() || !lines->is_array()) return;
  for (const auto& line : *lines) {
    if (line.is_string()) os << indent << "straggler: " << line.get<std::string>() << "\n";
  }
}

// "goodput 97.4% of 5m 2s: 12.1 s lost to 3 restarts, ..." (docs/goodput.md), when the daemon
// keeps the job's account.
void write_goodput(std::ostream& os, const nlohmann::json& job, const char* indent) {
  auto it = job.find("goodput");
  if (it == job.end()) return;
  if (auto totals = GoodputTotals::from_json(*it)) os << indent << totals->summary() << "\n";
}

// A node's state as the tables show it: a node waiting beside a running round is a spare.
std::string node_state(const nlohmann::json& n) {
  auto spare = n.find("spare");
  if (spare != n.end() && spare->is_boolean() && spare->get<bool>()) return "spare";
  return text_of(n, "state");
}

// An interval as the workers' cadence line writes it (python/ddplaunch/cadence.py).
std::string interval_text(double seconds) {
  char text[32];
  if (seconds < 120) {
    std::snprintf(text, sizeof text, "%.0f s", seconds);
  } else if (seconds < 7200) {
    std::snprintf(text, sizeof text, "%.0f min", seconds / 60);
  } else {
    std::snprintf(text, sizeof text, "%.1f h", seconds / 3600);
  }
  return text;
}

volatile std::sig_atomic_t g_watch_stop = 0;
extern "C" void on_watch_signal(int) { g_watch_stop = 1; }

}  // namespace

std::string format_watch(const nlohmann::json& status, const std::string& header) {
  std::ostringstream os;
  os << header << "\n\n";
  const auto& jobs = status.at("jobs");
  if (jobs.empty()) {
    os << "no jobs\n";
    return os.str();
  }
  char line[512];
  std::snprintf(line, sizeof line, "%-24s %-10s %5s %-9s %-7s %s\n", "JOB", "STATE", "GEN", "RESTARTS", "NODES", "ENDED");
  os << line;
  bool any_finished = false;
  for (const auto& job : jobs) {
    const std::string restarts = text_of(job, "restarts_used") + "/" + text_of(job, "max_restarts");
    const std::size_t listed = job.value("nodes", nlohmann::json::array()).size();
    const std::size_t omitted = job.contains("nodes_omitted") && job.at("nodes_omitted").is_number_unsigned()
                                    ? job.at("nodes_omitted").get<std::size_t>()
                                    : 0;
    const std::string nodes = std::to_string(listed + omitted) + "/" + text_of(job, "max_nodes");
    std::string ended;
    if (job.value("finished", false) && job.contains("ended_seconds_ago") && job.at("ended_seconds_ago").is_number()) {
      char text[96];
      std::snprintf(text, sizeof text, "%s (%.0f s ago)", utc_stamp(job.at("ended_seconds_ago").get<double>()).c_str(),
                    job.at("ended_seconds_ago").get<double>());
      ended = text;
    }
    std::string state = text_of(job, "state");
    if (job.value("finished", false)) {
      state += "*";
      any_finished = true;
    }
    std::snprintf(line, sizeof line, "%-24s %-10s %5s %-9s %-7s %s\n", text_of(job, "job_id").c_str(), state.c_str(),
                  text_of(job, "generation").c_str(), restarts.c_str(), nodes.c_str(), ended.c_str());
    os << line;
    if (job.contains("checkpoint_interval") && job.at("checkpoint_interval").is_number()) {
      os << "    checkpoints every " << interval_text(job.at("checkpoint_interval").get<double>())
         << " (the workers' automatic cadence)\n";
    }
    write_goodput(os, job, "    ");
    write_stragglers(os, job, "    ");
    std::snprintf(line, sizeof line, "    %-5s %-24s %-10s %-11s %-10s %s\n", "RANK", "HOST", "STATE", "HEARTBEAT",
                  "LAST STEP", "CHECKPOINT");
    os << line;
    for (const auto& n : job.value("nodes", nlohmann::json::array())) {
      const int rank = n.value("group_rank", -1);
      char age[32] = "-";
      if (n.contains("last_heartbeat_age") && n.at("last_heartbeat_age").is_number()) {
        std::snprintf(age, sizeof age, "%.1f s", n.at("last_heartbeat_age").get<double>());
      }
      const std::string step = text_of(n, "last_step");
      const std::string checkpoint = text_of(n, "last_checkpoint");
      std::snprintf(line, sizeof line, "    %-5s %-24s %-10s %-11s %-10s %s\n",
                    rank >= 0 ? std::to_string(rank).c_str() : "-", text_of(n, "host").c_str(),
                    node_state(n).c_str(), age, step.c_str(), checkpoint.c_str());
      os << line;
    }
  }
  // The legend says what a mark means, when the table shows one.
  if (any_finished) os << "\n(* finished: kept for a while after its nodes left, see --keep_finished)\n";
  return os.str();
}

int watch_status(const Endpoint& endpoint, const std::string& token, double timeout_s, const std::string& job_id,
                 double interval_s, bool as_json,
                 const std::shared_ptr<TlsContext>& tls) {
  if (const std::string error = connect_error(endpoint); !error.empty()) {
    std::fprintf(stderr, "ddp-rendezvous status: rendezvous endpoint %s\n", error.c_str());
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = on_watch_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the sleep below ends at once
  struct sigaction old_int {}, old_term {};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  while (!g_watch_stop) {
    StatusResult r = query_status(endpoint, token, std::min(timeout_s, std::max(1.0, interval_s * 2)), job_id, tls);
    if (g_watch_stop) break;
    std::string frame;
    if (as_json) {
      nlohmann::json j = r.error.empty() ? r.status : nlohmann::json{{"error", r.error}};
      j["time"] = static_cast<double>(std::time(nullptr));
      frame = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    } else {
      const std::string header = "ddp-rendezvous status " + endpoint.text() + "   " + utc_stamp(0) + "   every " +
                                 [&] { std::ostringstream o; o << interval_s; return o.str(); }() +
                                 " s (Ctrl-C to stop)";
      try {
        frame = r.error.empty() ? format_watch(r.status, header) : header + "\n\n" + r.error + "\n(retrying)\n";
      } catch (const nlohmann::json::exception& e) {
        frame = header + "\n\n" + endpoint.text() + " sent a malformed status: " + e.what() + "\n";
      }
      frame = tty ? "\x1b[H\x1b[2J" + frame : frame + "\n";
    }
    std::fwrite(frame.data(), 1, frame.size(), stdout);
    std::fflush(stdout);
    // Sleep in short steps so that Ctrl-C ends the view at once.
    for (double slept = 0; slept < interval_s && !g_watch_stop; slept += 0.05) ::usleep(50000);
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  return 0;
}

std::string format_status(const nlohmann::json& status) {
  std::ostringstream os;
  // A replica of --etcd says whether it leads, and who does (docs/etcd.md).
  if (auto r = status.find("replica"); r != status.end() && r->is_object()) {
    const bool leading = r->value("leading", false);
    const std::string leader = r->contains("leader") && r->at("leader").is_string() ? r->at("leader").get<std::string>()
                                                                                     : "";
    os << (leading ? "replica: leading\n"
                   : leader.empty() ? "replica: following; no replica leads at the moment\n"
                                    : "replica: following; the leader is " + leader + "\n");
  }
  const auto& jobs = status.at("jobs");
  if (jobs.empty()) {
    os << "no jobs\n";
    return os.str();
  }
  for (const auto& job : jobs) {
    if (job.value("finished", false) && job.contains("ended_seconds_ago") && job.at("ended_seconds_ago").is_number()) {
      os << "job " << job.at("job_id").get<std::string>() << ": FINISHED (" << job.at("state").get<std::string>()
         << ") at " << utc_stamp(job.at("ended_seconds_ago").get<double>()) << "\n";
      if (job.contains("summary") && job.at("summary").is_string()) {
        os << "  " << job.at("summary").get<std::string>() << "\n";
      }
    }
    os << "job " << job.at("job_id").get<std::string>() << ": " << job.at("state").get<std::string>()
       << ", generation " << job.at("generation").get<std::uint64_t>() << ", nnodes " << job.at("min_nodes").get<int>()
       << ":" << job.at("max_nodes").get<int>() << ", restarts used " << job.at("restarts_used").get<int>() << "/"
       << job.at("max_restarts").get<int>() << ", " << job.at("nodes").size() << " nodes\n";
    if (job.contains("env")) os << environment_lines(job.at("env"));
    // A job this daemon learned from its agents' resumes after a restart or failover.
    if (job.value("rebuilt_from_resumes", false) && job.contains("rebuilt_seconds_ago") &&
        job.at("rebuilt_seconds_ago").is_number()) {
      const double ago = job.at("rebuilt_seconds_ago").get<double>();
      const std::time_t when = std::time(nullptr) - static_cast<std::time_t>(ago);
      char stamp[32];
      std::tm tm{};
      gmtime_r(&when, &tm);
      std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S UTC", &tm);
      char text[160];
      std::snprintf(text, sizeof text, "  rebuilt from its agents' resumes %.1f s ago (%s)\n", ago, stamp);
      os << text;
    }
    char line[512];
    if (job.contains("checkpoint_interval") && job.at("checkpoint_interval").is_number()) {
      os << "  checkpoints every " << interval_text(job.at("checkpoint_interval").get<double>())
         << " (the workers' automatic cadence)\n";
    }
    write_goodput(os, job, "  ");
    write_stragglers(os, job, "  ");
    std::snprintf(line, sizeof line, "  %-10s %-24s %-40s %-7s %-10s %-14s %-10s %s\n", "group_rank", "host", "address",
                  "workers", "state", "last_heartbeat", "last_step", "checkpoint");
    os << line;
    for (const auto& n : job.at("nodes")) {
      int rank = n.at("group_rank").get<int>();
      std::string r = rank >= 0 ? std::to_string(rank) : "-";
      char age[32] = "-";
      if (n.at("last_heartbeat_age").is_number()) {
        std::snprintf(age, sizeof age, "%.1f s ago", n.at("last_heartbeat_age").get<double>());
      }
      std::snprintf(line, sizeof line, "  %-10s %-24s %-40s %-7d %-10s %-14s %-10s %s\n", r.c_str(),
                    n.at("host").get<std::string>().c_str(), n.at("addr").get<std::string>().c_str(),
                    n.at("workers").get<int>(), node_state(n).c_str(), age,
                    text_of(n, "last_step").c_str(), text_of(n, "last_checkpoint").c_str());
      os << line;
    }
  }
  return os.str();
}

}  // namespace ddp::rdzv
