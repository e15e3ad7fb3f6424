#include "agent/health_schedule.h"

#include <algorithm>
#include <utility>

#include "agent/failure.h"
#include "agent/policy.h"

namespace ddp::agent {

HealthSchedule::HealthSchedule(std::string check, double interval, double timeout)
    : check_(std::move(check)), interval_(interval), timeout_(timeout) {}

std::string HealthSchedule::command(int visible_gpus, const std::vector<int>& previous_pids, std::string& say) {
  std::string gpu;
  if (visible_gpus > 0) {
    std::string pids;
    for (int pid : previous_pids) pids += (pids.empty() ? "" : "|") + std::to_string(pid);
    gpu = "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader >/dev/null 2>&1 || "
          "{ echo 'built-in GPU check: nvidia-smi gets no answer from every GPU'; exit 1; }; ";
    if (!pids.empty()) {
      gpu += "held=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -Ex '" + pids +
             "'); [ -z \"$held\" ] || { echo \"built-in GPU check: GPU memory still held by the last "
             "round's workers (pids $held)\"; exit 1; }; ";
    }
  } else if (!gpu_skip_said_) {
    gpu_skip_said_ = true;
    say = "built-in GPU health check skipped: no GPU is visible on this node";
  }
  if (check_ == "gpu") return gpu.empty() ? "true" : gpu + "true";
  return gpu + check_;
}

int HealthSchedule::supersede() {
  const int pid = pid_;
  if (pid != 0) stale_.push_back(pid);
  pid_ = 0;
  return pid;
}

double HealthSchedule::started(int pid, HealthPurpose purpose, double now) {
  pid_ = pid;
  purpose_ = purpose;
  timed_out_ = false;
  return now + timeout_;
}

int HealthSchedule::deadline_passed() {
  if (pid_ == 0) return 0;
  timed_out_ = true;
  return pid_;
}

HealthSchedule::Exit HealthSchedule::exited(int pid) {
  if (pid == 0) return Exit::kNotOurs;
  if (pid == pid_) {
    pid_ = 0;
    return Exit::kCheck;
  }
  auto it = std::find(stale_.begin(), stale_.end(), pid);
  if (it == stale_.end()) return Exit::kNotOurs;
  stale_.erase(it);
  return Exit::kStale;
}

std::string HealthSchedule::why_failed(int exit_code, int signal, const std::string& log_tail) const {
  if (exit_code == 0 && signal == 0) return {};
  std::string why = "`" + check_ + "` ";
  why += timed_out_ ? "ran longer than " + seconds_text(timeout_) + " s (killed)"
         : signal   ? "was killed by " + signal_name(signal)
                    : "exited with code " + std::to_string(exit_code);
  if (!log_tail.empty()) why += ": " + log_tail;
  while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
  return why;
}

HealthStep HealthSchedule::result(HealthPurpose purpose, bool ok, const std::string& why, const std::string& host,
                                  double wall, double now) {
  HealthStep step;
  step.at = now + interval_;
  if (purpose == HealthPurpose::kBeforeJoin) {
    step.action = ok ? HealthStep::Do::kJoin : HealthStep::Do::kRetry;
    if (ok && failing_) step.message = "health check passes again; this node joins the job";
    if (!ok && !failing_) {
      step.message = "health check failed: " + why + "; this node stays out of the job and checks again every " +
                     seconds_text(interval_) + " s";
    }
    failing_ = !ok;
    return step;
  }
  if (ok) {
    step.action = HealthStep::Do::kNext;
    return step;
  }
  step.action = HealthStep::Do::kLeave;
  step.message = "health check failed: " + why +
                 "; this node leaves the round: its failure is reported and its workers stopped, and it joins "
                 "again once the check passes";
  auto& f = step.failure;
  f.host = host;
  f.rank = -1;
  f.local_rank = -1;
  f.exit_code = 1;
  f.timestamp = wall;
  f.error_file_message = "health check failed on " + host + ": " + why;
  return step;
}

}  // namespace ddp::agent
