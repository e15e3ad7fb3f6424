// What this node says about a failed round: the record of each failed worker as the summary and
// the rendezvous see it, the failure that explains the round's others (rdzv::explains: a death by
// signal before exits with a code, then the earliest), the line the agent says about it, and how
// the verdict's summary splits into the root cause and the rest.
//
// Pure: the error file, the stderr tail and the time are read by the caller (Agent::Impl) and
// given here. Functions only; called on the agent's io_context thread.
#pragma once

#include <string>
#include <vector>

#include "agent/failure.h"
#include "agent/policy.h"

namespace ddp::agent {

// What the agent knows about a worker that failed.
struct FailedWorker {
  WorkerRef ref;
  int exit_code = 0;  // when signal == 0
  int signal = 0;
  std::string note;        // why the agent stopped it (a hang, a timer), heads its message; or empty
  std::string error_file;  // its TORCHELASTIC_ERROR_FILE path
  ErrorFileContent error;  // that file's content, as read
  // The last lines of its stderr when it wrote no error file (pytorch#113546): from its pipe when
  // tee'd, from stderr.log when redirected (then `stderr_log` names it). Empty when its stderr went
  // straight to the console, where the user already sees it.
  std::string stderr_tail;
  std::string stderr_log;
  std::vector<std::string> log_files;  // its stdout.log / stderr.log, when it has them
};

// The record of `w` on `host`, seen failing at `seen` (seconds since the epoch) unless its error
// file says when.
LocalFailure describe_failure(const FailedWorker& w, const std::string& host, double seen);

// The failure of `failures` that explains the others. REQUIRES: `failures` not empty.
const LocalFailure& root_cause(const std::vector<LocalFailure>& failures);

// "worker 3 (local rank 1, pid 7) was killed by SIGKILL; stopped the other workers". `others_park`:
// the restart keeps some worker in memory.
std::string failure_line(const rdzv::WorkerFailure& f, bool others_park);

// The fatal report of a node that decided the job must end (`reason`): the failure it reported
// this round when it reported one, else one that names no worker (a peer's failure ended the
// round), seen at `wall`.
rdzv::WorkerFailure fatal_report(const rdzv::WorkerFailure* reported, const std::string& host,
                                 const std::string& reason, double wall);

// The verdict `root` against what this node saw (`seen`): the root's error file and log files
// when it failed here, and every other failure seen here.
struct SummaryParts {
  std::string error_file;
  std::vector<std::string> log_files;
  std::vector<LocalFailure> others;
};
SummaryParts summary_parts(const std::vector<LocalFailure>& seen, const rdzv::WorkerFailure& root);

}  // namespace ddp::agent
