// Checkpoint files and the directory of checkpoints a job keeps.
#pragma once

#include <torch/torch.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ddp {

// File format, little-endian (docs/worker-sdk.md has the details):
//   bytes 0..7   magic "DDPCKPT\0"
//   bytes 8..11  format version (2)
//   bytes 12..15 CRC-32C of the payload
//   bytes 16..23 payload length in bytes
//   bytes 24..   payload. For CheckpointState files: u64 index length, the binary index
//                (entries: key, kind, dtype, shape, data offset and length), zero padding to
//                a 64-byte boundary of the file, then the raw bytes of every tensor (each at
//                a 64-byte aligned offset), written with large write()s.
inline constexpr char kCheckpointMagic[8] = {'D', 'D', 'P', 'C', 'K', 'P', 'T', '\0'};
inline constexpr uint32_t kCheckpointVersion = 2;
inline constexpr size_t kCheckpointHeaderSize = 24;

// Writes header + payload to `path` atomically: a temporary file in the same directory,
// fsync, rename over `path`, fsync of the directory. Throws CheckpointError with the path
// and the system error.
//
// For tests only: with DDP_TEST_CHECKPOINT_PAUSE=STEP:GATE in the environment and the file GATE
// present, the process's first write of a checkpoint of step STEP or later (ckpt-<step>.ddpckpt)
// stops after the first bytes of its payload are in the temporary file, creates GATE.reached
// (holding the temporary file's path) and waits until GATE is removed (at most 120 s). Tests use
// it to kill or stop a process in the middle of a write.
void write_checkpoint_file(const std::string& path, const std::string& payload);

// Reads and verifies a checkpoint file; returns the payload. Throws CheckpointError saying
// what is wrong (missing, truncated, bad magic, unknown version, checksum mismatch).
std::string read_checkpoint_file(const std::string& path);

// What a checkpoint holds: named tensors, integers, doubles and byte strings, in insertion
// order. Tensors are stored as raw bytes (any device/layout is copied to contiguous CPU on
// save); loaded tensors are CPU tensors that share one buffer of the file's bytes.
class CheckpointState {
 public:
  enum class Kind : uint8_t { kTensor = 0, kInt = 1, kDouble = 2, kBytes = 3 };
  struct Entry {
    std::string key;
    Kind kind = Kind::kInt;
    torch::Tensor tensor;
    int64_t integer = 0;
    double real = 0;
    std::string bytes;
  };

  // A key may be set once; setting it again replaces the value.
  void put(const std::string& key, const torch::Tensor& tensor);
  void put_int(const std::string& key, int64_t value);
  void put_double(const std::string& key, double value);
  void put_bytes(const std::string& key, std::string value);

  bool contains(const std::string& key) const;
  // Throw CheckpointError naming the key when it is missing or of another kind.
  const torch::Tensor& tensor(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_double(const std::string& key) const;
  const std::string& get_bytes(const std::string& key) const;
  // Keys starting with `prefix`, in insertion order.
  std::vector<std::string> keys(const std::string& prefix = "") const;
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  Entry& slot(const std::string& key);
  const Entry& find(const std::string& key, Kind kind) const;
  std::vector<Entry> entries_;
};

// Writes `state` to `path` atomically (as write_checkpoint_file), streaming the tensors'
// bytes straight from their memory; CRC-32C is computed over the buffers as they are written.
void write_checkpoint(const std::string& path, const CheckpointState& state);

// Reads, verifies (size, magic, version, checksum, index bounds) and parses a checkpoint.
// Throws CheckpointError saying what is wrong.
CheckpointState read_checkpoint(const std::string& path);

// A deep copy of `state` in host memory: every tensor copied to a contiguous CPU tensor of its
// own, so the training thread can go on changing the originals. Tensors of `recycled` (an
// earlier copy nobody else uses) whose key, dtype and shape match are reused as the
// destinations, which spares the allocation and page faults of a fresh copy. A GPU tensor's
// destination is page-locked (pinned) memory, which the copy from the device needs for full speed.
// With `only`, just the tensors it accepts are copied; the others are taken over as they are (the
// same tensors), for a later host_copy to copy.
CheckpointState host_copy(const CheckpointState& state, CheckpointState recycled = {},
                          const std::function<bool(const CheckpointState::Entry&)>& only = {});

// The bytes a checkpoint file of `state` holds (header and payload), in a CPU uint8 tensor: what
// a survivor of an in-memory restart sends to the ranks that hold no state (Trainer).
torch::Tensor encode_checkpoint(const CheckpointState& state);

// Verifies and parses such bytes, as read_checkpoint does a file's; `name` stands for the path
// in errors. Loaded tensors share `bytes`' memory.
CheckpointState decode_checkpoint(torch::Tensor bytes, const std::string& name);

struct CheckpointOptions {
  std::string directory;  // created when missing
  int keep_last = 3;      // default 3; older checkpoints are deleted after a successful save
};

struct LoadedCheckpoint {
  std::string path;
  int64_t step = 0;
  CheckpointState state;
  // Set when the checkpoint was saved from a torch::serialize::OutputArchive.
  std::shared_ptr<torch::serialize::InputArchive> archive;
};

// The checkpoints of one job in one directory, named ckpt-<step, 12 digits>.ddpckpt.
// One per process; used from the training thread. Only rank 0 writes; every rank reads.
class CheckpointManager {
 public:
  using Log = std::function<void(const std::string&)>;

  // `log` receives warnings and notices (the Trainer passes a rank-0-only logger).
  CheckpointManager(CheckpointOptions options, int rank, Log log);

  // On rank 0: writes `state` as the checkpoint of `step`, prunes to keep_last, returns the
  // path. On other ranks: returns "" without writing.
  std::string save(int64_t step, const CheckpointState& state);
  // The same for a torch archive, stored whole (torch's zip serializer) under the key
  // "torch.archive"; slower than a CheckpointState of the tensors. Loads as
  // LoadedCheckpoint::archive.
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

// One background thread that writes checkpoint snapshots, one at a time (the Trainer's
// `checkpoint_async`). Owned by its user (the Trainer: one per fit(), on rank 0); start(),
// poll() and wait() are called from one thread (the training thread), `write` runs on the
// writer thread. A write's error is kept until poll() or wait() rethrows it, so it is reported
// as the synchronous save would have reported it. The destructor waits for the write in flight.
class AsyncCheckpointWriter {
 public:
  // Writes `state` as the checkpoint of `step`, returns its path (CheckpointManager::save).
  // `log` collects the notices the write produces; they are handed back in Done.
  using WriteFn = std::function<std::string(int64_t step, const CheckpointState& state,
                                            const std::function<void(const std::string&)>& log)>;
  // Makes the rest of a snapshot's host copy, on the writer thread, before the write.
  using CopyFn = std::function<CheckpointState(CheckpointState snapshot)>;
  struct Done {
    int64_t step = 0;
    std::string path;
    double seconds = 0;               // the write on the writer thread
    std::vector<std::string> notices;  // what `write` logged
    CheckpointState snapshot;          // the written snapshot, for host_copy() to recycle
  };

  explicit AsyncCheckpointWriter(WriteFn write);
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // True while a write is in flight.
  bool busy() const;
  // Hands `snapshot` to the writer thread. REQUIRES: !busy() and the previous write collected
  // by poll() or wait() (else UsageError: at most one write in flight, none unreported).
  // `finish_copy`, when given, runs first on the writer thread and its result is written: the
  // caller keeps the tensors it copies unchanged until wait_copied() returns. Its error is the
  // write's error.
  void start(int64_t step, CheckpointState snapshot, CopyFn finish_copy = {});
  // Blocks until the write in flight, if any, has run its finish_copy (at once when none is).
  void wait_copied();
  // The write that finished and was not yet collected; rethrows its error (a CheckpointError,
  // or whatever `write` threw) instead when it failed. nullopt when none finished, or one is in
  // flight.
  std::optional<Done> poll();
  // Blocks until no write is in flight, then as poll().
  std::optional<Done> wait();
  // Blocks until no writer of this process has a write in flight (their results stay to be
  // collected): for a process about to take a fatal signal's default action, so that it does
  // not die in the middle of a write. Called from the thread that owns the writers.
  static void wait_for_all();

 private:
  enum class State { kIdle, kWriting, kFinished };
  void loop();

  WriteFn write_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kIdle;    // guarded by mu_
  bool stopping_ = false;         // guarded by mu_
  int64_t step_ = 0;              // guarded by mu_: the write in flight or finished
  CheckpointState snapshot_;      // guarded by mu_
  CopyFn finish_copy_;            // guarded by mu_
  bool copying_ = false;          // guarded by mu_: finish_copy_ has not yet returned
  std::optional<Done> done_;      // guarded by mu_: a finished write's result
  std::exception_ptr error_;      // guarded by mu_: a finished write's error
  std::thread thread_;            // last member: starts after the fields above exist
};

}  // namespace ddp
