// Checkpoint files and the directory of checkpoints a job keeps.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddp {

// File format, little-endian:
//   bytes 0..7   magic "DDPCKPT\0"
//   bytes 8..11  format version (1)
//   bytes 12..15 CRC-32C of the payload
//   bytes 16..23 payload length in bytes
//   bytes 24..   payload: a torch::serialize::OutputArchive (zip), see docs/worker-sdk.md
inline constexpr char kCheckpointMagic[8] = {'D', 'D', 'P', 'C', 'K', 'P', 'T', '\0'};
inline constexpr uint32_t kCheckpointVersion = 1;
inline constexpr size_t kCheckpointHeaderSize = 24;

// Writes header + payload to `path` atomically: a temporary file in the same directory,
// fsync, rename over `path`, fsync of the directory. Throws CheckpointError with the path
// and the system error.
void write_checkpoint_file(const std::string& path, const std::string& payload);

// Reads and verifies a checkpoint file; returns the payload. Throws CheckpointError saying
// what is wrong (missing, truncated, bad magic, unknown version, checksum mismatch).
std::string read_checkpoint_file(const std::string& path);

struct CheckpointOptions {
  std::string directory;  // created when missing
  int keep_last = 3;      // default 3; older checkpoints are deleted after a successful save
};

struct LoadedCheckpoint {
  std::string path;
  int64_t step = 0;
  std::shared_ptr<torch::serialize::InputArchive> archive;
};

// The checkpoints of one job in one directory, named ckpt-<step, 12 digits>.ddpckpt.
// One per process; used from the training thread. Only rank 0 writes; every rank reads.
class CheckpointManager {
 public:
  using Log = std::function<void(const std::string&)>;

  // `log` receives warnings and notices (the Trainer passes a rank-0-only logger).
  CheckpointManager(CheckpointOptions options, int rank, Log log);

  // On rank 0: serializes `archive`, writes it as the checkpoint of `step`, prunes to
  // keep_last, returns the path. On other ranks: returns "" without writing.
  std::string save(int64_t step, torch::serialize::OutputArchive& archive);

  // The newest checkpoint that verifies, skipping (with a warning naming each) corrupt or
  // truncated ones. nullopt when none is valid (also logged). `max_step` limits the search
  // to steps <= max_step (used when ranks must agree on one step).
  std::optional<LoadedCheckpoint> load_latest(std::optional<int64_t> max_step = std::nullopt);

  // Checkpoint files present, newest first: (step, path).
  std::vector<std::pair<int64_t, std::string>> list() const;
  std::string path_for(int64_t step) const;
  const CheckpointOptions& options() const { return options_; }

 private:
  CheckpointOptions options_;
  int rank_;
  Log log_;
  bool cleaned_temporaries_ = false;
};

}  // namespace ddp
