#include "agent/file_timer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "rendezvous/error.h"

namespace asio = boost::asio;

namespace ddp::agent {

namespace {

double wall_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

bool is_int(const nlohmann::json& v) { return v.is_number_integer() || v.is_number_unsigned(); }

}  // namespace

std::variant<TimerRequest, std::string> parse_timer_request(std::string_view line) {
  if (line.size() > kMaxTimerLine) return std::string("longer than 4096 bytes");
  // Depth is bounded by the size above; nothing here recurses further than the parser itself.
  nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::string("not a JSON object");
  auto field = [&](const char* name) -> const nlohmann::json* {
    auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  };
  const auto* version = field("version");
  const auto* pid = field("pid");
  const auto* scope = field("scope_id");
  const auto* expiration = field("expiration_time");
  const auto* signal = field("signal");
  if (!version || !is_int(*version) || version->get<long long>() != 1) return std::string("\"version\" is not 1");
  if (!pid || !is_int(*pid)) return std::string("\"pid\" is not an integer");
  const long long p = pid->get<long long>();
  if (p <= 0 || p > std::numeric_limits<int>::max()) return std::string("\"pid\" is out of range");
  if (!scope || !scope->is_string()) return std::string("\"scope_id\" is not a string");
  if (!expiration || !expiration->is_number()) return std::string("\"expiration_time\" is not a number");
  const double t = expiration->get<double>();
  if (!std::isfinite(t)) return std::string("\"expiration_time\" is not finite");
  if (!signal || !is_int(*signal)) return std::string("\"signal\" is not an integer");
  const long long s = signal->get<long long>();
  if (s < -64 || s > 64) return std::string("\"signal\" is out of range");
  TimerRequest r;
  r.pid = static_cast<int>(p);
  r.scope_id = scope->get<std::string>();
  r.expiration_time = t;
  r.signal = static_cast<int>(s);
  return r;
}

bool FileTimers::apply(const TimerRequest& request) {
  auto key = std::make_pair(request.pid, request.scope_id);
  if (request.expiration_time < 0) {
    timers_.erase(key);
    return true;
  }
  auto it = timers_.find(key);
  if (it == timers_.end() && timers_.size() >= kMaxTimers) return false;
  timers_[key] = request;
  return true;
}

std::vector<TimerRequest> FileTimers::take_expired(double now) {
  std::map<int, std::vector<TimerRequest>> by_pid;
  for (const auto& [key, r] : timers_) {
    if (r.expiration_time <= now) by_pid[key.first].push_back(r);
  }
  std::vector<TimerRequest> out;
  for (auto& [pid, list] : by_pid) {
    std::sort(list.begin(), list.end(),
              [](const TimerRequest& a, const TimerRequest& b) { return a.expiration_time < b.expiration_time; });
    // torch: the first expired timer with a signal > 0 reaps the worker; without one, the
    // timers are dropped and the worker is left alone.
    auto with_signal = std::find_if(list.begin(), list.end(), [](const TimerRequest& r) { return r.signal > 0; });
    out.push_back(with_signal != list.end() ? *with_signal : list.front());
    forget_pid(pid);
  }
  std::sort(out.begin(), out.end(),
            [](const TimerRequest& a, const TimerRequest& b) { return a.expiration_time < b.expiration_time; });
  return out;
}

void FileTimers::forget_pid(int pid) {
  for (auto it = timers_.begin(); it != timers_.end();) {
    it = it->first.first == pid ? timers_.erase(it) : std::next(it);
  }
}

double FileTimers::next_expiration() const {
  double next = -1;
  for (const auto& [key, r] : timers_) {
    if (next < 0 || r.expiration_time < next) next = r.expiration_time;
  }
  return next;
}

FileTimerServer::FileTimerServer(asio::io_context& io, std::string path, Callbacks callbacks)
    : fifo_(io), expiry_(io), path_(std::move(path)), callbacks_(std::move(callbacks)) {
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    if (!S_ISFIFO(st.st_mode)) {
      throw LaunchError(ExitCode::kUsage, "TORCHELASTIC_TIMER_FILE=" + path_ +
                               " exists and is not a FIFO; remove it or name another path");
    }
  } else if (::mkfifo(path_.c_str(), 0600) != 0) {
    throw LaunchError(ExitCode::kUsage, "TORCHELASTIC_TIMER_FILE=" + path_ + ": cannot create the FIFO: " +
                             std::strerror(errno));
  } else {
    created_ = true;
  }
  // Read and write: the FIFO then always has a writer, so a client closing it is no end of
  // file, and clients (which open it O_NONBLOCK for writing) always find a reader.
  const int fd = ::open(path_.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const std::string err = std::strerror(errno);
    if (created_) ::unlink(path_.c_str());
    throw LaunchError(ExitCode::kUsage, "TORCHELASTIC_TIMER_FILE=" + path_ + ": cannot open the FIFO: " + err);
  }
  fifo_.assign(fd);
  wait_readable();
}

FileTimerServer::~FileTimerServer() {
  *alive_ = false;
  boost::system::error_code ignored;
  fifo_.close(ignored);
  expiry_.cancel();
  if (created_) ::unlink(path_.c_str());
}

void FileTimerServer::clear() {
  timers_.clear();
  expiry_.cancel();
}

void FileTimerServer::wait_readable() {
  fifo_.async_wait(asio::posix::descriptor_base::wait_read,
                   [this, alive = alive_](const boost::system::error_code& ec) {
                     if (!*alive || ec) return;
                     read_available();
                     wait_readable();
                   });
}

// Reads at most 16 buffers per wake-up: a client writing without pause must not keep the event
// loop from its other work.
void FileTimerServer::read_available() {
  std::array<char, 16384> buffer;
  for (int reads = 0; reads < 16; ++reads) {
    const ssize_t n = ::read(fifo_.native_handle(), buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    std::string_view data(buffer.data(), static_cast<std::size_t>(n));
    while (!data.empty()) {
      const auto nl = data.find('\n');
      const std::string_view piece = data.substr(0, nl);
      if (!discarding_) {
        if (partial_.size() + piece.size() > kMaxTimerLine) {
          partial_.clear();
          discarding_ = true;
          handle_line(std::string(kMaxTimerLine + 1, ' '));  // refused for its size
        } else {
          partial_.append(piece);
        }
      }
      if (nl == std::string_view::npos) break;
      if (!discarding_) handle_line(partial_);
      partial_.clear();
      discarding_ = false;
      data.remove_prefix(nl + 1);
    }
  }
  schedule();
}

void FileTimerServer::handle_line(std::string_view line) {
  if (line.empty()) return;
  auto parsed = parse_timer_request(line);
  std::string problem;
  if (auto* p = std::get_if<std::string>(&parsed)) {
    problem = *p;
  } else {
    const auto& r = std::get<TimerRequest>(parsed);
    if (!callbacks_.is_worker || !callbacks_.is_worker(r.pid)) {
      problem = "pid " + std::to_string(r.pid) + " is not one of this node's workers";
    } else if (!timers_.apply(r)) {
      problem = "too many timers";
    }
  }
  if (problem.empty()) return;
  ++refused_;
  if (refused_ <= 5 && callbacks_.say) {
    callbacks_.say(path_ + ": ignored a timer request: " + problem +
                   (refused_ == 5 ? " (further ones are ignored silently)" : ""));
  }
}

void FileTimerServer::schedule() {
  const double next = timers_.next_expiration();
  if (next < 0) {
    expiry_.cancel();
    return;
  }
  const double delay = std::max(0.0, next - wall_now());
  expiry_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(std::min(delay, 3600.0))));
  expiry_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
    if (!*alive || ec) return;
    fire();
  });
}

void FileTimerServer::fire() {
  for (const auto& r : timers_.take_expired(wall_now())) {
    if (r.signal > 0 && callbacks_.is_worker && callbacks_.is_worker(r.pid)) {
      if (callbacks_.on_expired) callbacks_.on_expired(r);
    } else if (callbacks_.say && r.signal <= 0) {
      callbacks_.say("timer '" + r.scope_id + "' of pid " + std::to_string(r.pid) +
                     " expired; it asked for no signal, so the worker is left alone");
    }
  }
  schedule();
}

}  // namespace ddp::agent
