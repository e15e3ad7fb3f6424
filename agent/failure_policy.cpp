#include "agent/failure_policy.h"

#include <algorithm>

namespace ddp::agent {

namespace {

std::string stderr_tail_message(const FailedWorker& w) {
  if (w.stderr_tail.empty()) return {};
  const std::string where = w.stderr_log.empty() ? "" : " (" + w.stderr_log + ")";
  const std::string head = w.signal != 0 ? "Signal " + std::to_string(w.signal) + " (" + signal_name(w.signal) +
                                               ") received by PID " + std::to_string(w.ref.pid)
                                         : "the worker wrote no error file";
  return head + "; the last lines of its stderr" + where + ":\n" + w.stderr_tail;
}

}  // namespace

LocalFailure describe_failure(const FailedWorker& w, const std::string& host, double seen) {
  LocalFailure lf;
  auto& f = lf.failure;
  f.host = host;
  f.rank = w.ref.rank;
  f.local_rank = w.ref.local_rank;
  f.exit_code = w.exit_code;
  f.signal = w.signal;
  f.pid = w.ref.pid;
  f.timestamp = seen;
  if (w.error.present) {
    lf.error_file = w.error_file;
    f.error_file_message = summarise_error_file(w.error);
    if (w.error.timestamp > 0) f.timestamp = w.error.timestamp;
  } else if (!w.error.problem.empty()) {
    lf.error_file = w.error_file;
    f.error_file_message = w.error.problem;
  } else {
    f.error_file_message = stderr_tail_message(w);
  }
  if (!w.note.empty()) {
    f.error_file_message = f.error_file_message.empty() ? w.note : w.note + "\n" + f.error_file_message;
  }
  lf.log_files = w.log_files;
  return lf;
}

const LocalFailure& root_cause(const std::vector<LocalFailure>& failures) {
  return *std::min_element(failures.begin(), failures.end(), [](const LocalFailure& a, const LocalFailure& b) {
    return rdzv::explains(a.failure, b.failure);
  });
}

std::string failure_line(const rdzv::WorkerFailure& f, bool others_park) {
  return "worker " + std::to_string(f.rank) + " (local rank " + std::to_string(f.local_rank) + ", pid " +
         std::to_string(f.pid) + ") " +
         (f.signal ? "was killed by " + signal_name(f.signal) : "exited with code " + std::to_string(f.exit_code)) +
         (others_park ? "; the other workers park, to go on from memory (in-memory restart)"
                      : "; stopped the other workers");
}

rdzv::WorkerFailure fatal_report(const rdzv::WorkerFailure* reported, const std::string& host,
                                 const std::string& reason, double wall) {
  rdzv::WorkerFailure f;
  if (reported != nullptr) {
    f = *reported;
  } else {
    f.host = host;
    f.exit_code = 1;
    f.timestamp = wall;
  }
  f.fatal = reason;
  return f;
}

SummaryParts summary_parts(const std::vector<LocalFailure>& seen, const rdzv::WorkerFailure& root) {
  SummaryParts parts;
  for (const auto& lf : seen) {
    const auto& f = lf.failure;
    if (f.host == root.host && f.pid == root.pid && f.rank == root.rank) {
      parts.error_file = lf.error_file;
      parts.log_files = lf.log_files;
    } else {
      parts.others.push_back(lf);
    }
  }
  return parts;
}

}  // namespace ddp::agent
