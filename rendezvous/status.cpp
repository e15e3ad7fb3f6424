#include "rendezvous/status.h"

#include <algorithm>
#include <ctime>

#include <cstdio>
#include <sstream>
#include <functional>
#include <stdexcept>
#include <vector>

#include <boost/asio.hpp>

#include "rendezvous/auth.h"
#include "rendezvous/client.h"
#include "rendezvous/protocol.h"

namespace ddp::rdzv {

namespace asio = boost::asio;
using asio::ip::tcp;

StatusResult query_status(const std::string& endpoint, const std::string& token, double timeout_s,
                          const std::string& job_id, const std::shared_ptr<TlsContext>& tls) {
  StatusResult result;
  std::string host;
  unsigned short port = 0;
  try {
    std::tie(host, port) = parse_endpoint(endpoint);
  } catch (const std::invalid_argument& e) {
    result.error = e.what();
    result.usage_error = true;
    return result;
  }
  asio::io_context io(1);
  tcp::resolver resolver(io);
  tcp::socket socket(io);
  std::unique_ptr<Stream> stream;  // the connection once connected (plain or TLS)
  const auto close_connection = [&] {
    boost::system::error_code ignored;
    if (stream) {
      stream->close();
    } else {
      socket.close(ignored);
    }
  };
  asio::steady_timer timer(io);
  FrameReader reader(256u << 20);  // a status reply of 10,000 nodes is large
  std::vector<char> buf(65536);
  std::string payload;
  Frame request;
  const std::string where = "rendezvous " + host + ":" + std::to_string(port);
  // Until the peer proved to be a rendezvous server (check_server_start): what it sent so far.
  bool connected = false;
  bool identified = false;
  std::string start_bytes;
  const Frame greeting = encode_greeting();

  timer.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(timeout_s)));
  timer.async_wait([&](boost::system::error_code ec) {
    if (ec) return;
    if (result.error.empty() && result.status.is_null()) {
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g s", timeout_s);
      result.error = !connected    ? "connect to " + where + ": no answer within " + secs
                     : !identified ? where + " accepted the connection but sent no ddp-rendezvous challenge within " +
                                         secs + ": is another service listening there?"
                                   : where + ": no status reply within " + secs;
    }
    resolver.cancel();
    close_connection();
  });
  auto finish = [&](const std::string& error) {
    if (result.error.empty()) result.error = error;
    timer.cancel();
    close_connection();
  };
  // Handles one message; returns false when the query is over.
  auto on_message = [&](Message& m) -> bool {
    switch (m.type) {
      case MessageType::challenge: {
        Hello h;
        h.job_id = job_id;
        h.client_nonce = random_hex();
        if (!token.empty()) h.proof = auth_proof(token, "status", std::get<Challenge>(m.body).nonce, h.client_nonce, job_id);
        request = encode(make_status_request(h));
        stream->async_write(asio::buffer(*request), [&](const boost::system::error_code& ec, std::size_t) {
          if (ec) finish("send to " + where + ": " + ec.message());
        });
        return true;
      }
      case MessageType::error: {
        const auto& e = std::get<ErrorMessage>(m.body);
        finish(where + " refused: " + e.message + " [" + e.code + "]");
        return false;
      }
      case MessageType::status_reply:
        result.status = std::move(std::get<StatusReply>(m.body).status);
        finish("");
        return false;
      default:
        finish(where + ": unexpected \"" + std::string(to_string(m.type)) + "\" message");
        return false;
    }
  };
  std::function<void()> read_more = [&]() {
    stream->async_read_some(asio::buffer(buf), [&](const boost::system::error_code& ec, std::size_t n) {
      if (!identified && (!ec || ec == asio::error::eof || !start_bytes.empty())) {
        if (!ec) start_bytes.append(buf.data(), std::min(n, kFrameHeaderBytes + kMaxChallengeBytes + 1));
        const ServerCheck check = check_server_start(start_bytes, static_cast<bool>(ec));
        if (check.verdict == ServerCheck::Verdict::refuse) return finish(where + " " + check.reason);
        identified = check.verdict == ServerCheck::Verdict::rendezvous;
      }
      if (ec) return finish("read from " + where + ": " + ec.message());
      reader.feed(buf.data(), n);
      while (true) {
        const FrameReader::Result r = reader.next(payload);
        if (r == FrameReader::Result::need_more) break;
        if (r == FrameReader::Result::error) return finish(where + ": " + reader.error().message);
        Decoded decoded = decode(payload);
        if (decoded.error) return finish(where + ": " + decoded.error->message);
        if (!on_message(*decoded.message)) return;
      }
      read_more();
    });
  };
  resolver.async_resolve(host, std::to_string(port), [&](boost::system::error_code ec, tcp::resolver::results_type r) {
    if (ec) return finish("resolve " + host + " (for " + where + "): " + ec.message());
    asio::async_connect(socket, r, [&](boost::system::error_code ec2, const tcp::endpoint&) {
      if (ec2) return finish("connect to " + where + ": " + ec2.message());
      connected = true;
      stream = make_client_stream(std::move(socket), tls, host);
      stream->async_handshake([&](const boost::system::error_code& ec3) {
        if (ec3) return finish(where + ": " + describe_tls_failure(ec3, true));
        // Said at once, so that a service that is not a rendezvous server answers (and is named).
        // Read once it is written (a failed write shows in the read): writes never overlap.
        stream->async_write(asio::buffer(*greeting), [&](const boost::system::error_code&, std::size_t) { read_more(); });
      });
    });
  });
  io.run();
  if (!result.error.empty()) result.status = nullptr;
  return result;
}

namespace {

// The job's "env" field (issue 6) as text: whether its nodes' software agrees, and where not.
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

}  // namespace

std::string format_status(const nlohmann::json& status) {
  std::ostringstream os;
  const auto& jobs = status.at("jobs");
  if (jobs.empty()) {
    os << "no jobs\n";
    return os.str();
  }
  for (const auto& job : jobs) {
    os << "job " << job.at("job_id").get<std::string>() << ": " << job.at("state").get<std::string>()
       << ", generation " << job.at("generation").get<std::uint64_t>() << ", nnodes " << job.at("min_nodes").get<int>()
       << ":" << job.at("max_nodes").get<int>() << ", restarts used " << job.at("restarts_used").get<int>() << "/"
       << job.at("max_restarts").get<int>() << ", " << job.at("nodes").size() << " nodes\n";
    if (job.contains("env")) os << environment_lines(job.at("env"));
    // Issue 10: a job this daemon learned from its agents' resumes after a restart or failover.
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
    std::snprintf(line, sizeof line, "  %-10s %-24s %-40s %-7s %-10s %s\n", "group_rank", "host", "address", "workers",
                  "state", "last_heartbeat");
    os << line;
    for (const auto& n : job.at("nodes")) {
      int rank = n.at("group_rank").get<int>();
      std::string r = rank >= 0 ? std::to_string(rank) : "-";
      char age[32];
      std::snprintf(age, sizeof age, "%.1f s ago", n.at("last_heartbeat_age").get<double>());
      std::snprintf(line, sizeof line, "  %-10s %-24s %-40s %-7d %-10s %s\n", r.c_str(),
                    n.at("host").get<std::string>().c_str(), n.at("addr").get<std::string>().c_str(),
                    n.at("workers").get<int>(), n.at("state").get<std::string>().c_str(), age);
      os << line;
    }
  }
  return os.str();
}

}  // namespace ddp::rdzv
