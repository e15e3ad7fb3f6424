// The lineage a checkpoint records: which environment, program, ddplaunch version and world size
// wrote it. The Trainer records it in every checkpoint and compares it with the resuming
// process (docs/worker-sdk.md, "Lineage").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ddp/checkpoint.h"

namespace ddp {

// The checkpoint keys of the lineage. The world size is the Trainer's "ddp.world_size".
inline constexpr char kLineageEnvFingerprintKey[] = "ddp.lineage.env_fingerprint";
inline constexpr char kLineageProgramKey[] = "ddp.lineage.program_sha256";
inline constexpr char kLineageVersionKey[] = "ddp.lineage.version";
inline constexpr char kWorldSizeKey[] = "ddp.world_size";

struct Lineage {
  // DDPLAUNCH_ENV_FINGERPRINT: the sha256 ddplaunch computes of the facts that break a job
  // (Python, torch, CUDA, NCCL, --env_lock; not the program). "" when no environment check ran
  // (--env_check=off, another launcher, no launcher).
  std::string env_fingerprint;
  std::string program_sha256;  // of the running executable; "" when it cannot be read
  std::string version;         // the ddplaunch version the SDK was built as
  int64_t world_size = 0;
};

// The ddplaunch version this SDK was built as (the project's CMake version), e.g. "0.1.0".
const char* sdk_version();

// The sha256 of this process's executable (/proc/self/exe), read on the first call only (about
// 0.1 s for a 30 MB program); "" when it cannot be read. Thread-safe.
const std::string& program_sha256();

// This process's lineage at `world_size`, from its environment (DDPLAUNCH_ENV_FINGERPRINT).
Lineage current_lineage(int64_t world_size);

// True when DDPLAUNCH_ENV_CHECK is "strict": a checkpoint of another environment is refused.
bool env_check_strict();

// Puts `lineage` into `state` under the keys above.
void record_lineage(CheckpointState& state, const Lineage& lineage);

// What comparing a checkpoint's lineage with the current one found.
struct LineageCheck {
  // One line per field that differs (field, the checkpoint's value, the current one, and what
  // follows), or one line saying the checkpoint carries no lineage. Empty when all agree.
  std::vector<std::string> notices;
  // Set when `strict` and both environment fingerprints are known and differ: the one-line
  // reason with the ways out. The checkpoint must not be loaded.
  std::string refusal;
};

// Compares the lineage `state` records (a checkpoint named `name` in the lines) with `current`.
// A value unknown on either side is named but not compared; a different program or version, or
// world size, is a notice only. Pure: reads no environment.
LineageCheck check_lineage(const CheckpointState& state, const Lineage& current, bool strict,
                           const std::string& name);

}  // namespace ddp
