// Trainer: the DDP training loop that resumes from the newest checkpoint by itself.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddp/checkpoint.h"
#include "ddp/ddp.h"
#include "ddp/process_group.h"
#include "ddp/sampler.h"

namespace ddp {

// Samples are rows of `inputs` and `targets` (same first dimension), kept on the CPU.
struct TensorDataset {
  torch::Tensor inputs;
  torch::Tensor targets;
  int64_t size() const { return inputs.size(0); }
};

struct TrainerOptions {
  int64_t epochs = 1;              // default 1
  int64_t batch_size = 32;         // per worker; default 32
  // Micro-batches per optimizer step; all but the last run inside no_sync(). Default 1.
  int64_t accumulation_steps = 1;
  int64_t max_steps = -1;          // stop after this many optimizer steps in total; -1: no limit
  std::string checkpoint_dir;      // empty: no checkpoints, no resume
  int64_t checkpoint_every = 0;    // steps; 0: only at the end and on SIGTERM
  int keep_last = 3;               // default 3
  // Periodic checkpoints are copied to host memory as of the step (the CPU parameters and SGD
  // momentum by the writer thread while the next step computes; that step's update waits for
  // it) and written by a background thread while training goes on; one write at a time, a
  // periodic save that comes while one is in flight is skipped; the final and SIGTERM saves wait
  // for it, then write synchronously (docs/worker-sdk.md, "Asynchronous checkpoints"). The loss
  // function and hooks must then leave the parameters alone. Default false.
  bool checkpoint_async = false;
  // Checkpoints at the interval that the job's measured save stall and failure history call for
  // (docs/checkpoints.md, "How often": the Python side's policy and its DIR/cadence.json), checked
  // at each step: the Young/Daly interval sqrt(2 C M) within [max(10 s, 10 C), 1 h]. Rank 0
  // decides; the decision travels in the step's existing all-reduce. Needs checkpoint_dir;
  // excludes checkpoint_every. With checkpoint_async a checkpoint that comes due while a write
  // is in flight waits for it (the wait counts in C) rather than being skipped. Throws EnvError
  // from fit() when DDPLAUNCH_CHECKPOINT_MTBF is not a positive number. Default false.
  bool checkpoint_auto = false;
  int64_t log_every = 50;          // steps between rank-0 log lines; 0: none
  bool handle_sigterm = true;      // on SIGTERM: finish the step, save, return (default true)
  // When ddplaunch offers it (docs/worker-sdk.md, "In-memory restart"): a peer's failure does not
  // end this process; it parks with the model, optimizer and sampler of its last completed step
  // and continues in the next round. Gloo only. Default true.
  bool in_memory_restart = true;
  DistributedSampler::Options sampler;
  DdpOptions ddp;
};

// What one step is about to use / has used. `indices` are this rank's samples of the step.
struct StepInfo {
  int64_t step = 0;   // optimizer steps completed before this one (0-based step number)
  int64_t epoch = 0;
  int rank = 0;
  int world_size = 1;
  const std::vector<int64_t>* indices = nullptr;
  double loss = 0;    // this rank's mean loss of the step (on_step_end only)
};

// Steps at the start of each run left out of TrainResult::steady_steps_per_second (first
// collectives, allocator warm-up).
inline constexpr int64_t kSteadyWarmupSteps = 5;

struct TrainResult {
  int64_t steps = 0;             // optimizer steps completed in total, across restarts
  int64_t steps_this_run = 0;
  int64_t epochs_completed = 0;
  double final_loss = 0;         // mean over ranks of the last step's loss (NaN if no step ran)
  std::optional<int64_t> resumed_from_step;  // set when a checkpoint was loaded
  std::string resumed_from;      // its path
  bool stopped_by_signal = false;  // SIGTERM arrived: saved (if a directory is set) and stopped
  double samples_per_second = 0;   // all ranks together, over this run
  // Steady-state speed: optimizer steps per second from the end of this run's
  // kSteadyWarmupSteps-th step to the end of its last step (no setup, no final save). 0 when
  // the run had no more than kSteadyWarmupSteps steps.
  double steady_steps_per_second = 0;
  double exposed_sync_seconds = 0; // gradient-sync wait not hidden behind backward, this rank
  std::string last_checkpoint;   // path of the last checkpoint this run wrote ("" if none)
  // Periodic checkpoints of this run (rank 0; the final and SIGTERM saves not counted): saved
  // (for checkpoint_async: handed to the writer thread), skipped because the previous write was
  // still in flight (checkpoint_async only), and the training thread's time in them (for
  // checkpoint_async the host copy and the next step's wait for its background part, for
  // synchronous saves the whole write).
  int64_t checkpoints_saved = 0;
  int64_t checkpoints_skipped = 0;
  double checkpoint_stall_seconds = 0;
  int in_memory_restarts = 0;    // rounds this fit() continued in after parking
};

// Runs the loop for one model/optimizer pair that the caller owns. Lives for one fit() (a
// second fit() continues from where the first ended). Training thread only. While fit()
// runs and handle_sigterm is set, a process-wide SIGTERM handler is installed (the previous
// one is restored afterwards).
class Trainer {
 public:
  // Computes the loss of one micro-batch (forward + criterion); inputs on group->device().
  using LossFn = std::function<torch::Tensor(const torch::Tensor& inputs,
                                             const torch::Tensor& targets)>;

  Trainer(std::shared_ptr<ProcessGroup> group, std::shared_ptr<torch::nn::Module> model,
          std::shared_ptr<torch::optim::Optimizer> optimizer, TensorDataset data, LossFn loss,
          TrainerOptions options);

  // Resumes from the newest valid checkpoint (if any), trains, saves, returns.
  // Throws ddp::Error subclasses (CommError, MismatchError, CheckpointError, UsageError).
  TrainResult fit();

  // Hooks for programs and tests (crash injection, sample accounting). Optional.
  std::function<void(const StepInfo&)> on_step_begin;
  std::function<void(const StepInfo&)> on_step_end;
  // After an in-memory restart, with the new round's environment (the group has joined it
  // already; the ranks have not yet agreed on their state).
  std::function<void(const WorkerEnv&)> on_reassigned;
  // Rank-0 log sink; default: prints "[ddp] ..." lines to stdout.
  std::function<void(const std::string&)> log;

 private:
  struct Run;  // what one fit() carries from round to round (trainer.cpp)
  void resume(Run& run);
  void load_checkpoint(Run& run);
  void receive_state(Run& run, int64_t newest, int64_t held);
  void restore(const CheckpointState& state, const std::string& from, Run& run);
  // The state of `step`; `lineage`: with this process's lineage (ddp/lineage.h), as checkpoints
  // carry it (the state sent to a replacement of the same job does not need it).
  CheckpointState capture(int64_t step, const SamplerPosition& position, bool lineage) const;
  struct Round;  // one round's DDP wrapper, sampler and throughput window (trainer.cpp)
  void train_round(Run& run);
  bool train_step(Run& run, Round& round, int64_t epoch);
  // Throws RoundAbandoned when the agent abandoned the round (with in-memory restart).
  void leave_if_abandoned(const Run& run, int64_t step) const;
  // Starts the step's one small all-reduce, which runs while the step computes: whether any
  // rank stops after it (SIGTERM), the previous step's mean loss, and rank 0's cadence decision.
  PendingWork start_step_flags(Run& run, Round& round);
  double forward_backward(Round& round, std::vector<std::vector<int64_t>>& micro);
  void log_throughput(const Run& run, Round& round, int64_t epoch);
  void finish_round(Run& run, Round& round);
  void park(Run& run);
  // Rank 0 saves the checkpoint of `step` (other ranks and no checkpoint_dir: nothing). When
  // `periodic` and checkpoint_async: a host copy goes to the writer thread, or, while a write is
  // in flight, nothing (returns false: skipped; the only false). Otherwise (every final and
  // SIGTERM save) the write in flight is waited for, then this one is written synchronously.
  bool save(Run& run, int64_t step, const SamplerPosition& position, bool periodic);
  // Rank 0's training thread spent `seconds` in a periodic save: counted in the result, told
  // to the agent, and taken as the cadence's save cost.
  void count_stall(Run& run, double seconds);
  // Waits until the writer thread has copied what the last background save left to it (the
  // parameters and the optimizer's state), before anything changes them; the wait is part of
  // that save's stall.
  void settle_copy(Run& run);
  // Reports the background write that finished (`wait`: waits for the one in flight first) and
  // rethrows its error.
  void collect_write(Run& run, bool wait);

  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  TensorDataset data_;
  LossFn loss_;
  TrainerOptions options_;
};

// True once SIGTERM arrived while a Trainer's handler was installed.
bool stop_requested();

}  // namespace ddp
