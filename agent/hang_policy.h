// Hang detection, the agent's side: how often the progress board is sampled, which workers a
// hang takes (HangMonitor, agent/progress.h, decides which ranks stalled), what each is sent (its
// dump signal: SIGABRT to a Python worker, whose faulthandler prints every thread's stack before
// it dies; SIGKILL to anything else), in which order (DumpQueue), and when the ones that
// survived their dump signal get SIGKILL (kDumpGrace later). A hung worker's exit is then a
// failure like any other, headed by the note said here.
//
// Owned by Agent::Impl for the whole run; pure (the samples and the time are given), used on the
// agent's io_context thread. Impl reads the board, arms its timers at the times said here, and
// sends the signals.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/policy.h"
#include "agent/progress.h"

namespace ddp::agent {

// A live worker as hang detection sees it.
struct WatchedWorker {
  WorkerRef ref;
  bool python = false;  // runs under the Python interpreter: SIGABRT gives its stacks
  bool hung = false;    // declared hung already
};

// A worker a hang takes: send it `signal` (to its process alone); `note` heads its failure.
struct HungWorker {
  int pid = 0;
  int signal = 0;
  std::string note;
  std::string message;  // what the agent says now
};

struct HangVerdict {
  bool hang = false;                 // a hang was seen: sampling stops for this round
  std::vector<HungWorker> declared;  // the workers it takes (not declared before), to signal in order
};

class HangWatch {
 public:
  // Seconds between a dump signal and the SIGKILL of a worker that survived it.
  static constexpr double kDumpGrace = 5.0;
  // The declared workers get their dump signals one at a time, so that two stack dumps never
  // interleave on a console they share: the next when the previous has exited, at the latest
  // this many seconds after it was signalled.
  static constexpr double kDumpStep = 1.0;

  HangWatch(HangPolicy policy, int slots);
  // Seconds between samples: often enough that a hang is declared within 2% of a fixed timeout,
  // at most every second (also without --hang_timeout: the progress metrics).
  double period() const;
  bool enabled() const { return policy_.enabled(); }
  // A new round's workers started at `now`.
  void round_started(double now) {
    monitor_.reset(now);
    round_began_ = now;
  }
  void observe(int slot, const ProgressSample& sample, double now) { monitor_.observe(slot, sample, now); }
  // What the samples say at `now` about `workers` (the live ones). Never a hang when disabled.
  HangVerdict check(const std::vector<WatchedWorker>& workers, double now) const;
  // What this round reported: crash-loop detection compares it across rounds.
  const HangMonitor& monitor() const { return monitor_; }

  // A watch with nothing to watch says so: once per job, when hang detection is on and no rank of
  // the round has reported a step for the timeout (the floor of auto) since the round began,
  // what to say; else nullopt. `python`: the workers are Python programs.
  std::optional<std::string> silence(double now, bool python);

 private:
  HangPolicy policy_;
  HangMonitor monitor_;
  double round_began_ = 0;
  bool said_silence_ = false;
};

// The hung workers' dump signals, one at a time, so that two stack dumps never interleave on a
// console they share: the next is due when the one being dumped has exited, at the latest
// HangWatch::kDumpStep after it was signalled. Pure: the agent sends the signals, arms its timers
// at the times said here, and tells it which workers have exited.
class DumpQueue {
 public:
  struct Dump {
    int pid = 0;
    int signal = 0;
    double next_at = 0;  // the next dump is due then if this worker is still alive
    double kill_at = 0;  // every hung worker still alive then gets SIGKILL (HangWatch::kDumpGrace)
  };

  void add(int pid, int signal) { due_.push_back({pid, signal}); }
  // The dump to send at `now`, skipping workers that ended before their turn (`alive(pid)` is
  // false); nullopt when none is left, and then nothing is being dumped.
  template <class Alive>
  std::optional<Dump> next(double now, Alive alive) {
    dumping_ = 0;
    while (!due_.empty()) {
      const auto [pid, signal] = due_.front();
      due_.erase(due_.begin());
      if (!alive(pid)) continue;
      dumping_ = pid;
      return Dump{pid, signal, now + HangWatch::kDumpStep, now + HangWatch::kDumpGrace};
    }
    return std::nullopt;
  }
  // The worker whose stacks are being written (0: none); its exit makes the next dump due.
  int dumping() const { return dumping_; }
  void clear() {
    due_.clear();
    dumping_ = 0;
  }

 private:
  std::vector<std::pair<int, int>> due_;  // (pid, signal), in the order declared
  int dumping_ = 0;
};

}  // namespace ddp::agent
