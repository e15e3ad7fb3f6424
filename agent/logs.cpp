#include "agent/logs.h"

#include "agent/progress_line.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace ddp::agent {

std::string worker_log_dir(const std::string& log_dir, const std::string& run_id, int attempt,
                           int local_rank) {
  std::string dir = log_dir;
  if (!dir.empty() && dir.back() != '/') dir += '/';
  return dir + run_id + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank);
}

std::string line_prefix(const std::string& templ, const std::string& role, int rank, int local_rank,
                        const std::string& hostname) {
  if (templ.empty()) return "[" + role + std::to_string(local_rank) + "]:";
  const std::pair<std::string, std::string> vars[] = {{"${role_name}", role},
                                                      {"${rank}", std::to_string(rank)},
                                                      {"${local_rank}", std::to_string(local_rank)},
                                                      {"${hostname}", hostname}};
  std::string out;
  for (std::size_t i = 0; i < templ.size();) {
    bool replaced = false;
    for (const auto& [name, value] : vars) {
      if (templ.compare(i, name.size(), name) == 0) {
        out += value;
        i += name.size();
        replaced = true;
        break;
      }
    }
    if (!replaced) out += templ[i++];
  }
  return out;
}

void LineSplitter::feed(std::string_view data) {
  while (!data.empty()) {
    auto nl = data.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(data);
      while (partial_.size() >= max_line_) {
        on_line_(std::string_view(partial_).substr(0, max_line_));
        partial_.erase(0, max_line_);
      }
      return;
    }
    if (partial_.empty()) {
      on_line_(data.substr(0, nl + 1));  // the common case: no copy
    } else {
      partial_.append(data.substr(0, nl + 1));
      on_line_(partial_);
      partial_.clear();
    }
    data.remove_prefix(nl + 1);
  }
}

void LineSplitter::finish() {
  if (!partial_.empty()) {
    on_line_(partial_);
    partial_.clear();
  }
}

bool matches_any(std::string_view line, const std::vector<std::string>& filters) {
  for (const auto& f : filters) {
    if (line.find(f) != std::string_view::npos) return true;
  }
  return false;
}

void LineTail::add(std::string_view line) {
  if (line.size() > max_bytes_) line = line.substr(line.size() - max_bytes_);  // keep its end
  std::string kept(line);
  if (kept.empty() || kept.back() != '\n') kept += '\n';
  bytes_ += kept.size();
  lines_.push_back(std::move(kept));
  while (!lines_.empty() && (lines_.size() > max_lines_ || bytes_ > max_bytes_)) {
    bytes_ -= lines_.front().size();
    lines_.pop_front();
  }
}

std::string LineTail::text() const {
  std::string out;
  for (const auto& l : lines_) out += l;
  return out;
}

std::string tail_of_file(const std::string& path, std::size_t max_lines, std::size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  struct stat st {};
  std::string data;
  if (::fstat(fd, &st) == 0) {
    const off_t start = st.st_size > static_cast<off_t>(max_bytes) ? st.st_size - static_cast<off_t>(max_bytes) : 0;
    data.resize(static_cast<std::size_t>(st.st_size - start));
    const ssize_t n = ::pread(fd, data.data(), data.size(), start);
    data.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    // A partial first line (we started mid-file) is dropped.
    if (start > 0) {
      const auto nl = data.find('\n');
      data.erase(0, nl == std::string::npos ? data.size() : nl + 1);
    }
  }
  ::close(fd);
  LineTail tail(max_lines, max_bytes);
  LineSplitter split([&](std::string_view line) { tail.add(line); });
  split.feed(data);
  split.finish();
  return tail.text();
}

// ---- OutputQueue ---------------------------------------------------------------------------

struct OutputQueue::State {
  struct Entry {
    int fd;
    bool close;
    std::string data;
  };
  const std::string what;
  const std::size_t capacity;
  std::mutex mu;
  std::condition_variable work;  // GUARDED_BY(mu): entries arrived, or stop
  std::condition_variable idle;  // GUARDED_BY(mu): the queue became empty
  std::deque<Entry> entries;     // GUARDED_BY(mu)
  std::size_t bytes = 0;         // GUARDED_BY(mu): data waiting in `entries`
  bool busy = false;             // GUARDED_BY(mu): the writer holds an entry
  bool started = false;          // GUARDED_BY(mu)
  bool stop = false;             // GUARDED_BY(mu)
  std::uint64_t dropped = 0;     // GUARDED_BY(mu)
  std::uint64_t unreported = 0;  // GUARDED_BY(mu): dropped since the last notice

  State(std::string w, std::size_t c) : what(std::move(w)), capacity(c) {}

  static void write_all(int fd, std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::write(fd, data.data(), data.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        return;  // destination gone (EPIPE, closed): nothing sensible to do with the output
      }
      data.remove_prefix(static_cast<std::size_t>(n));
    }
  }

  static void run(std::shared_ptr<State> self) {
    std::unique_lock lock(self->mu);
    for (;;) {
      self->work.wait(lock, [&] { return self->stop || !self->entries.empty(); });
      if (self->entries.empty()) return;  // stopped and drained
      Entry e = std::move(self->entries.front());
      self->entries.pop_front();
      self->busy = true;
      lock.unlock();
      if (e.close) {
        ::close(e.fd);
      } else {
        write_all(e.fd, e.data);
      }
      lock.lock();
      self->busy = false;
      self->bytes -= e.data.size();
      if (self->entries.empty()) self->idle.notify_all();
    }
  }

  // REQUIRES: mu held.
  void push(Entry e) {
    bytes += e.data.size();
    entries.push_back(std::move(e));
    if (!started) {
      started = true;
      std::thread(run, shared_from_this_()).detach();
    }
    work.notify_one();
  }

  std::weak_ptr<State> self_;
  std::shared_ptr<State> shared_from_this_() { return self_.lock(); }
};

OutputQueue::OutputQueue(std::string what, std::size_t capacity)
    : state_(std::make_shared<State>(std::move(what), capacity)) {
  state_->self_ = state_;
}

OutputQueue::~OutputQueue() {
  std::lock_guard lock(state_->mu);
  state_->stop = true;
  state_->work.notify_one();
}

bool OutputQueue::write(int fd, std::string data) {
  auto& s = *state_;
  std::lock_guard lock(s.mu);
  std::string notice;
  if (s.unreported > 0) {
    notice = "ddplaunch: dropped " + std::to_string(s.unreported) + " line(s) of output because " + s.what +
             " did not keep up\n";
  }
  if (s.bytes + notice.size() + data.size() > s.capacity) {
    ++s.dropped;
    ++s.unreported;
    return false;
  }
  if (!notice.empty()) {
    s.unreported = 0;
    s.push({fd, false, std::move(notice)});
  }
  s.push({fd, false, std::move(data)});
  return true;
}

void OutputQueue::close_after(int fd) {
  std::lock_guard lock(state_->mu);
  state_->push({fd, true, {}});
}

bool OutputQueue::flush(std::chrono::milliseconds timeout) {
  auto& s = *state_;
  std::unique_lock lock(s.mu);
  return s.idle.wait_for(lock, timeout, [&] { return s.entries.empty() && !s.busy; });
}

std::uint64_t OutputQueue::dropped() const {
  std::lock_guard lock(state_->mu);
  return state_->dropped;
}

OutputQueue& OutputQueue::console() {
  // 4 MiB: a burst of tee'd output or a long traceback fits; a console that has stopped
  // reading costs at most this much memory.
  static OutputQueue* queue = new OutputQueue("the console", 4 << 20);
  return *queue;
}

// The console's progress line lives here, beside the console's queue it writes through.
ProgressLine& ProgressLine::console() {
  static ProgressLine* line = [] {
    const char* term = std::getenv("TERM");
    const bool tty = ::isatty(STDERR_FILENO) == 1 && !(term != nullptr && std::strcmp(term, "dumb") == 0);
    std::size_t width = 100;
    winsize ws{};
    if (tty && ::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) width = ws.ws_col;
    return new ProgressLine([](std::string chunk) { OutputQueue::console().write(STDERR_FILENO, std::move(chunk)); },
                            tty, 5.0, width);
  }();
  return *line;
}


// Through the progress line, which erases itself before the line and draws itself again after.
void say(const std::string& line) { ProgressLine::console().line("ddplaunch: " + line + "\n"); }

}  // namespace ddp::agent
