// Exit codes of ddplaunch: API, documented in docs/exit-codes.md and each one tested.
#pragma once

namespace ddp {

enum class ExitCode : int {
  kSuccess = 0,            // the job succeeded on every node
  kJobFailed = 1,          // workers failed past the restart budget
  kUsage = 2,              // usage or configuration error; nothing was started
  kRendezvousFailed = 3,   // timeout, closed, refused, version, token or environment mismatch
  kSignalBase = 128,       // 128 + N: ddplaunch got signal N and stopped the workers
};

inline int exit_code_for_signal(int signo) { return static_cast<int>(ExitCode::kSignalBase) + signo; }

}  // namespace ddp
