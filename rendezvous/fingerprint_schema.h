// The node fingerprint's schema (docs/env-check.md), defined once: every compared fact by
// its dotted path ("python.torch"), the label messages and tables show for it, and whether a
// difference breaks a job. The agent writes these paths (agent/fingerprint.cpp), the environment
// check compares and names them (rendezvous/env_check.cpp), `--check_env` labels them
// (agent/fingerprint_render.cpp). No Boost.Asio, no state: constants only.
#pragma once

#include <string_view>

namespace ddp::rdzv::fingerprint {

// Sections (top-level keys) of a fingerprint.
inline constexpr std::string_view kMachine = "machine";
inline constexpr std::string_view kGpu = "gpu";
inline constexpr std::string_view kPython = "python";
inline constexpr std::string_view kProgram = "program";
inline constexpr std::string_view kEnvLock = "env_lock";
inline constexpr std::string_view kEnv = "env";  // NCCL_* and CUDA_VISIBLE_DEVICES, by name
// program.libraries.NAME: sha256 of each shared library the program loads.
inline constexpr std::string_view kLibrariesPrefix = "program.libraries.";

enum class Kind {
  informational,  // shown when it differs, never refuses a round
  breaking,       // a difference refuses the round under --env_check=strict
  ignored,        // says how the fingerprint was made, not what the node has: never compared
};

struct Field {
  std::string_view path;
  std::string_view label;
  Kind kind;
};

inline constexpr Field kFields[] = {
    {"machine.arch", "CPU architecture", Kind::informational},
    {"machine.os", "OS", Kind::informational},
    {"machine.glibc", "glibc", Kind::informational},
    {"gpu.count", "GPU count", Kind::informational},
    {"gpu.models", "GPU models", Kind::informational},
    {"gpu.driver", "NVIDIA driver", Kind::informational},
    {"gpu.note", "GPU note", Kind::ignored},
    {"python.version", "Python", Kind::breaking},
    {"python.implementation", "Python implementation", Kind::breaking},
    {"python.executable", "Python interpreter", Kind::informational},
    {"python.error", "Python probe error", Kind::breaking},
    {"python.torch", "torch", Kind::breaking},
    {"python.torch_error", "torch import error", Kind::ignored},
    {"python.torch_cuda", "CUDA", Kind::breaking},
    {"python.nccl", "NCCL", Kind::breaking},
    {"python.cudnn", "cuDNN", Kind::breaking},
    {"program.path", "program path", Kind::informational},
    {"program.sha256", "program sha256", Kind::breaking},
    {"program.module", "program module", Kind::breaking},
    {"program.error", "program error", Kind::breaking},
    {"program.libraries_error", "shared library listing error", Kind::informational},
    {"env_lock.source", "lock file", Kind::informational},
    {"env_lock.sha256", "lock file sha256", Kind::breaking},
};

// The schema entry of a path; nullptr for paths outside it (libraries, env.*, future fields).
constexpr const Field* find(std::string_view path) {
  for (const Field& f : kFields) {
    if (f.path == path) return &f;
  }
  return nullptr;
}

// The label of a known path ("torch" for "python.torch"); `fallback` for others.
constexpr std::string_view label(std::string_view path, std::string_view fallback = {}) {
  const Field* f = find(path);
  return f != nullptr ? f->label : fallback;
}

}  // namespace ddp::rdzv::fingerprint
