// torchrun's file-timer watchdog, served by the agent: with
// TORCHELASTIC_ENABLE_FILE_TIMER=1 the agent creates the FIFO named by TORCHELASTIC_TIMER_FILE
// (or one of its own, exported to the workers) and reads the JSON lines torch's
// torch.distributed.elastic.timer.FileTimerClient writes to it:
//   {"version": 1, "pid": P, "scope_id": S, "expiration_time": T, "signal": N}
// T is a time.time() deadline; a negative T releases the scope. When a timer expires, worker P
// gets signal N (none when N <= 0, as in torch) and the agent treats its death like any failure.
//
// Every line is untrusted (any local process of the user can write to the FIFO): it is checked
// for size, JSON shape, types and ranges, and P must be one of the agent's live workers, before it
// touches any state. The FIFO is read without blocking on the agent's io_context.
//
// FileTimerServer is owned by the Agent, lives for the whole run, and is used on the agent's
// io_context thread only. FileTimers is its pure part (no files, the clock given), tested alone.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>

namespace ddp::agent {

struct TimerRequest {
  int pid = 0;
  std::string scope_id;
  double expiration_time = 0;  // seconds since the epoch; < 0: release
  int signal = 0;
};

// torch's limit (select.PIPE_BUF): its client refuses longer requests, so a longer line is not
// from it.
constexpr std::size_t kMaxTimerLine = 4096;

// One line (without its newline) -> a request, or why it was refused.
std::variant<TimerRequest, std::string> parse_timer_request(std::string_view line);

// The timers of the live workers, keyed by (pid, scope), as torch's FileTimerServer keeps them.
class FileTimers {
 public:
  static constexpr std::size_t kMaxTimers = 65536;  // beyond that, new scopes are refused
  // Registers or releases. Returns false when refused (too many timers).
  bool apply(const TimerRequest& request);
  // Removes and returns the expired timers at `now`, earliest first; per pid only the first
  // (by expiration) that carries a signal > 0 is returned with it, as torch reaps once per pid.
  std::vector<TimerRequest> take_expired(double now);
  void forget_pid(int pid);
  void clear() { timers_.clear(); }
  // The earliest expiration, or a negative number when there is none.
  double next_expiration() const;
  std::size_t size() const { return timers_.size(); }

 private:
  std::map<std::pair<int, std::string>, TimerRequest> timers_;
};

class FileTimerServer {
 public:
  struct Callbacks {
    std::function<bool(int pid)> is_worker;  // one of our live workers
    // The timer of `request.scope_id` expired with `request.signal` > 0: the callee signals the pid.
    std::function<void(const TimerRequest& request)> on_expired;
    std::function<void(const std::string& line)> say;
  };
  // Creates the FIFO at `path` (mode 0600; an existing FIFO is reused, anything else is an
  // error) and starts reading it. Throws LaunchError naming the path.
  FileTimerServer(boost::asio::io_context& io, std::string path, Callbacks callbacks);
  // Removes the FIFO when this server created it.
  ~FileTimerServer();
  const std::string& path() const { return path_; }
  // A new round: every timer is forgotten (the workers that set them are gone).
  void clear();

 private:
  void wait_readable();
  void read_available();
  void handle_line(std::string_view line);
  void schedule();
  void fire();

  boost::asio::posix::stream_descriptor fifo_;
  boost::asio::steady_timer expiry_;
  std::string path_;
  bool created_ = false;
  Callbacks callbacks_;
  FileTimers timers_;
  std::string partial_;
  bool discarding_ = false;   // inside an over-long line: drop until its newline
  long refused_ = 0;          // lines refused so far; the first few are said
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace ddp::agent
