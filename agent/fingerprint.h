// A node's software fingerprint: what must match across the nodes of a job for it to
// run: machine, GPUs, the Python stack that will run the workers (or the program and the shared
// libraries it loads), a user-named lock file, and the NCCL_* / CUDA_VISIBLE_DEVICES settings.
//
// compute_fingerprint() is called once per agent start, on the agent's thread, before it joins
// the rendezvous; the expensive parts (the interpreter probe, hashing big libraries) are cached
// on disk, so a restart does not pay again. The result is plain JSON (see docs/env-check.md for
// every field); rdzv::compare_fingerprints() compares them, render_fingerprint_table() prints one.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/gpus.h"
#include "agent/sha256.h"

namespace ddp::agent {

struct FingerprintOptions {
  // The worker program: a script (Python), a module name (module = true) or an executable
  // (python = false, i.e. --no_python). Empty: nothing about the program is recorded.
  std::string program;
  bool python = true;                  // false with --no_python (default: Python workers)
  bool module = false;                 // -m: program names a module; it is not hashed
  std::string python_exec = "python3"; // the interpreter that will run the workers (PATH lookup)
  // --env_lock: "" (none), a file path, or "cmd:COMMAND" (COMMAND runs in /bin/sh -c and its
  // standard output is hashed). Default: none.
  std::string env_lock;
  // Cache directory. Empty (default): $DDPLAUNCH_CACHE_DIR, else $XDG_CACHE_HOME/ddplaunch, else
  // $HOME/.cache/ddplaunch. When it cannot be written the fingerprint is still computed.
  std::string cache_dir;
  // Deadline for each child process (interpreter probe, ldd, the lock command). Default 60 s:
  // a cold `import torch` on a network filesystem can take tens of seconds.
  std::chrono::milliseconds probe_timeout{60000};
  // Root of the NVIDIA driver's /proc files; tests point it at a fake tree.
  std::string nvidia_proc_dir = "/proc/driver/nvidia";
  // The environment the workers will get: its NCCL_* and CUDA_VISIBLE_DEVICES are recorded, and
  // the probe, ldd and the lock command run with it. Entries here override this process's
  // environment; with use_process_environment = false (default true) they are all of it.
  // PATH defaults to /usr/local/bin:/usr/bin:/bin when absent.
  std::map<std::string, std::string> environment;
  bool use_process_environment = true;
};

// Computes this node's fingerprint. Never starts more than one interpreter probe; a failing probe
// (interpreter missing, `import torch` failing, deadline) is recorded in python.error, not thrown,
// so that --check_env can show it. REQUIRES: options.probe_timeout > 0.
// Refused when the --env_lock input cannot be read (the file is missing, its command failed): a
// usage error, which the launcher ends with exit code 2.
Expected<nlohmann::json> compute_fingerprint(const FingerprintOptions& options);

// Parts, exposed for tests and for --check_env.
nlohmann::json machine_fingerprint();  // {"arch", "os", "glibc"}
// The "python" section alone: the interpreter probe, cached like compute_fingerprint()'s. The
// launcher checks with it that Python workers' interpreter imports torch.
nlohmann::json interpreter_fingerprint(const FingerprintOptions& options);
// gpu_fingerprint(): agent/gpus.h.

// The sections of the fingerprint that describe the environment rather than the machine or the
// program: "python" (for Python workers) and "env_lock" (with --env_lock). What a single node,
// which compares with no one, computes for its checkpoints' lineage.
Expected<nlohmann::json> environment_fingerprint(const FingerprintOptions& options);

// The sha256 (hex) of a fingerprint's breaking facts outside "program" (the program changes
// between runs on purpose; checkpoints record its hash on their own): equal for two fingerprints
// exactly when --env_check=strict would let them into one job, program aside. Workers get it as
// DDPLAUNCH_ENV_FINGERPRINT. "" when the fingerprint has no such fact.
std::string environment_digest(const nlohmann::json& fingerprint);

// The readable table of `ddplaunch --check_env`: one line per fact, "label  value".
std::string render_fingerprint_table(const nlohmann::json& fingerprint);

// sha256_hex(), sha256_file(): agent/sha256.h.

}  // namespace ddp::agent
