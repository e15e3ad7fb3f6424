#include "agent/shutdown_policy.h"

namespace ddp::agent {

ShutdownGrace::ShutdownGrace(double shutdown_timeout, double kill_timeout)
    : shutdown_timeout_(shutdown_timeout), kill_timeout_(kill_timeout) {}

double ShutdownGrace::terminated(double now) { return kill_at_ = now + shutdown_timeout_; }

std::vector<std::string> ShutdownGrace::overdue(const std::vector<WorkerRef>& running) {
  kill_at_ = kNever;
  std::vector<std::string> lines;
  for (const auto& w : running) {
    lines.push_back("worker " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") still runs " +
                    seconds_text(shutdown_timeout_) + " s after it was asked to stop; sending SIGKILL");
  }
  return lines;
}

double ShutdownGrace::killed(double now) { return give_up_at_ = now + kill_timeout_; }

std::vector<std::string> ShutdownGrace::give_up(const std::vector<WorkerRef>& running) {
  give_up_at_ = kNever;
  std::vector<std::string> lines;
  for (const auto& w : running) {
    const std::string pid = std::to_string(w.pid);
    lines.push_back("worker " + std::to_string(w.rank) + " (pid " + pid + ") has not exited " +
                    seconds_text(kill_timeout_) + " s after SIGKILL; it is probably stuck in the kernel (see /proc/" +
                    pid + "/stack and its state in /proc/" + pid +
                    "/status); giving up on it. It may still hold resources such as GPU memory.");
  }
  return lines;
}

void ShutdownGrace::settled() { kill_at_ = give_up_at_ = kNever; }

}  // namespace ddp::agent
