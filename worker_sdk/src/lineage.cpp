#include "ddp/lineage.h"

#include <cstdlib>

#include "ddp/error.h"
#include "sha256.h"

#ifndef DDPLAUNCH_VERSION
#define DDPLAUNCH_VERSION "unknown"
#endif

namespace ddp {
namespace {

// Hashes in lines: 16 hex digits tell two builds or environments apart; the full value is in
// the checkpoint.
std::string shown(const std::string& hash) { return hash.empty() ? "none" : hash.substr(0, 16); }

std::string bytes_or_empty(const CheckpointState& state, const char* key) {
  return state.contains(key) ? state.get_bytes(key) : std::string();
}

}  // namespace

const char* sdk_version() { return DDPLAUNCH_VERSION; }

const std::string& program_sha256() {
  static const std::string hash = [] {
    try {
      return sha256_file("/proc/self/exe");
    } catch (const Error&) {
      return std::string();  // no /proc: the program is not compared
    }
  }();
  return hash;
}

Lineage current_lineage(int64_t world_size) {
  const char* fingerprint = std::getenv("DDPLAUNCH_ENV_FINGERPRINT");
  return Lineage{fingerprint ? fingerprint : "", program_sha256(), sdk_version(), world_size};
}

bool env_check_strict() {
  const char* mode = std::getenv("DDPLAUNCH_ENV_CHECK");
  return mode != nullptr && std::string(mode) == "strict";
}

void record_lineage(CheckpointState& state, const Lineage& lineage) {
  state.put_bytes(kLineageEnvFingerprintKey, lineage.env_fingerprint);
  state.put_bytes(kLineageProgramKey, lineage.program_sha256);
  state.put_bytes(kLineageVersionKey, lineage.version);
  state.put_int(kWorldSizeKey, lineage.world_size);
}

LineageCheck check_lineage(const CheckpointState& state, const Lineage& current, bool strict,
                           const std::string& name) {
  LineageCheck check;
  const std::string prefix = "lineage of checkpoint " + name + ": ";
  if (state.contains(kWorldSizeKey) && state.get_int(kWorldSizeKey) != current.world_size) {
    const int64_t then = state.get_int(kWorldSizeKey);
    check.notices.push_back(prefix + "world_size was " + std::to_string(then) + ", now " +
                            std::to_string(current.world_size) + ": resuming; the sampler splits the rest of the " +
                            "epoch over " + std::to_string(current.world_size) +
                            (current.world_size == 1 ? " rank" : " ranks") + ", every sample once");
  }
  if (!state.contains(kLineageVersionKey)) {
    check.notices.push_back("checkpoint " + name + " carries no lineage (written before checkpoints recorded " +
                            "one): its environment, program and ddplaunch version are not compared");
    return check;
  }
  const std::string env = bytes_or_empty(state, kLineageEnvFingerprintKey);
  if (env != current.env_fingerprint) {
    const std::string values = "env_fingerprint was " + shown(env) + ", now " + shown(current.env_fingerprint);
    if (env.empty()) {
      check.notices.push_back(prefix + values + ": it was written without ddplaunch's environment check; " +
                              "not compared");
    } else if (current.env_fingerprint.empty()) {
      check.notices.push_back(prefix + values + ": this run has no environment check (--env_check=off, or " +
                              "not started by ddplaunch); not compared");
    } else if (strict) {
      check.refusal = "refusing to resume from checkpoint " + name + ": it was written in another environment (" +
                      values + ": Python, torch, CUDA, NCCL or --env_lock differ) and --env_check=strict is " +
                      "set; resume with the environment that wrote it, start from a fresh checkpoint " +
                      "directory, or pass --env_check=warn to resume anyway";
    } else {
      check.notices.push_back(prefix + values + ": it was written in another environment (Python, torch, CUDA, " +
                              "NCCL or --env_lock differ); resuming (--env_check=strict would refuse)");
    }
  }
  const std::string program = bytes_or_empty(state, kLineageProgramKey);
  if (program != current.program_sha256) {
    check.notices.push_back(prefix + "program_sha256 was " + shown(program) + ", now " +
                            shown(current.program_sha256) +
                            (program.empty() || current.program_sha256.empty()
                                 ? ": unknown on one side; not compared"
                                 : ": another build of the program wrote it; resuming"));
  }
  const std::string version = bytes_or_empty(state, kLineageVersionKey);
  if (version != current.version) {
    check.notices.push_back(prefix + "version was ddplaunch " + version + ", now ddplaunch " + current.version +
                            "; resuming");
  }
  return check;
}

}  // namespace ddp
