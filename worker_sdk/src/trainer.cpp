#include "ddp/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/version.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "ddp/checkpoint.h"
#include "ddp/error.h"
#include "ddp/lineage.h"
#include "ddp/progress.h"
#include "cadence.h"
#include "model_state.h"
#include "standby.h"

namespace ddp {
namespace {

volatile std::sig_atomic_t g_stop = 0;

void on_sigterm(int) { g_stop = 1; }

// Installs the SIGTERM handler for the lifetime of one fit().
class SigtermScope {
 public:
  explicit SigtermScope(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    struct sigaction action {};
    action.sa_handler = on_sigterm;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &action, &previous_);
  }
  ~SigtermScope() {
    if (enabled_) sigaction(SIGTERM, &previous_, nullptr);
  }

 private:
  bool enabled_;
  struct sigaction previous_ {};
};

// `from` names the state in errors: "checkpoint PATH", or the state a survivor sent.
int64_t read_int(const CheckpointState& state, const std::string& key, const std::string& from) {
  try {
    return state.get_int(key);
  } catch (const CheckpointError& e) {
    throw CheckpointError("Trainer: " + from + ": " + e.what());
  }
}

at::Generator& cpu_generator() {
  static at::Generator gen = at::detail::getDefaultCPUGenerator();
  return gen;
}

}  // namespace

bool stop_requested() { return g_stop != 0; }

Trainer::Trainer(std::shared_ptr<ProcessGroup> group, std::shared_ptr<torch::nn::Module> model,
                 std::shared_ptr<torch::optim::Optimizer> optimizer, TensorDataset data,
                 LossFn loss, TrainerOptions options)
    : group_(std::move(group)),
      model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      data_(std::move(data)),
      loss_(std::move(loss)),
      options_(std::move(options)) {
  if (!group_ || !model_ || !optimizer_ || !loss_) {
    throw UsageError("Trainer: group, model, optimizer and loss function are required");
  }
  if (!data_.inputs.defined() || !data_.targets.defined() ||
      data_.inputs.size(0) != data_.targets.size(0)) {
    throw UsageError("Trainer: inputs and targets must be defined and have the same length");
  }
  if (options_.batch_size < 1) throw UsageError("Trainer: batch_size must be at least 1");
  if (options_.accumulation_steps < 1) {
    throw UsageError("Trainer: accumulation_steps must be at least 1");
  }
  if (options_.epochs < 0) throw UsageError("Trainer: epochs must not be negative");
  if (options_.checkpoint_auto && options_.checkpoint_dir.empty()) {
    throw UsageError("Trainer: checkpoint_auto needs a checkpoint_dir");
  }
  if (options_.checkpoint_auto && options_.checkpoint_every > 0) {
    throw UsageError("Trainer: checkpoint_auto and checkpoint_every > 0 exclude each other");
  }
  // Rank 0 of the current round: an in-memory restart can give this process another rank.
  log = [group = group_](const std::string& line) {
    if (group->rank() == 0) std::cout << "[ddp] " << line << std::endl;
  };
}

// What one fit() carries from round to round. `step` and `position` are the last completed step
// and the sampler after it: an in-memory restart continues from them, whatever the abandoned
// round had begun of the next step (the optimizer updates only after the step's collectives
// completed, so the model and optimizer are at `step` too).
struct Trainer::Run {
  TrainResult result;
  bool holds = false;  // the model, optimizer and fields below are a state to continue from
  int64_t step = 0;
  SamplerPosition position{0, 0};
  int64_t last_saved = -1;
  bool stop = false;
  bool in_memory = false;
  std::chrono::steady_clock::time_point start, steady_start, steady_end;
  int64_t run_samples = 0;
  double last_local_loss = std::numeric_limits<double>::quiet_NaN();
  double previous_global_loss = std::numeric_limits<double>::quiet_NaN();
  std::unique_ptr<cadence::Cadence> cadence;  // checkpoint_auto
  // checkpoint_async on rank 0, from its first periodic save. Declared last: destroyed first,
  // its destructor waits for the write in flight when fit() leaves by an exception.
  int64_t writing_step = -1;               // the write in flight
  SamplerPosition writing_position{0, 0};
  CheckpointState recycled;                // the last written snapshot, reused by the next copy
  bool copy_pending = false;               // the writer thread still copies part of the state
  double copy_stall = 0;                   // the training thread's part of that save so far
  std::unique_ptr<AsyncCheckpointWriter> writer;
};

CheckpointState Trainer::capture(int64_t step, const SamplerPosition& position, bool lineage) const {
  CheckpointState state;
  state.put_int("ddp.format", 2);
  state.put_int("ddp.step", step);
  state.put_int("ddp.epoch", position.epoch);
  state.put_int("ddp.consumed", position.consumed);
  state.put_int("ddp.dataset_size", data_.size());
  if (lineage) {
    record_lineage(state, current_lineage(group_->world_size()));
  } else {
    state.put_int(kWorldSizeKey, group_->world_size());
  }
  {
    std::lock_guard<std::mutex> lock(cpu_generator().mutex());
    state.put("ddp.rng_cpu", cpu_generator().get_state());
  }
  save_model(*model_, state);
  save_optimizer(*optimizer_, state);
  return state;
}

namespace {

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// For tests only: DDP_TEST_CHECKPOINT_COPY_DELAY_MS=N starts the writer thread's part of each
// background save's copy N ms late (at most 10 s), so that the next optimizer step finds it
// unfinished and must wait for it.
std::chrono::milliseconds test_copy_delay() {
  const char* value = std::getenv("DDP_TEST_CHECKPOINT_COPY_DELAY_MS");
  if (value == nullptr) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(std::clamp(std::atol(value), 0L, 10000L));
}

cadence::Who who(const ProcessGroup& group) {
  return cadence::Who::of(group.rank(), group.env().restart_count, group.env().run_id);
}

std::string describe_save(const std::string& path, int64_t step, const SamplerPosition& position, int64_t size) {
  return "saved checkpoint " + path + " (step " + std::to_string(step) + ", epoch " +
         std::to_string(position.epoch) + ", position " + std::to_string(position.consumed) + "/" +
         std::to_string(size) + ")";
}

}  // namespace

void Trainer::count_stall(Run& run, double seconds) {
  run.result.checkpoint_stall_seconds += seconds;
  Progress::instance().checkpoint_stall(run.result.checkpoint_stall_seconds);
  ++run.result.checkpoints_saved;
  if (run.cadence) run.cadence->saved(seconds, who(*group_));
}

void Trainer::settle_copy(Run& run) {
  if (!run.copy_pending) return;
  const auto start = std::chrono::steady_clock::now();
  {
    PhaseScope phase("checkpoint");
    run.writer->wait_copied();
  }
  run.copy_pending = false;
  count_stall(run, run.copy_stall + since(start));
}

void Trainer::collect_write(Run& run, bool wait) {
  if (!run.writer) return;
  if (wait) settle_copy(run);
  std::optional<AsyncCheckpointWriter::Done> done;
  if (wait && run.writer->busy()) {
    log("waiting for the checkpoint write of step " + std::to_string(run.writing_step) + " in flight");
    PhaseScope phase("checkpoint");
    done = run.writer->wait();
  } else {
    done = run.writer->poll();  // nothing can start meanwhile: only this thread starts writes
  }
  if (!done) return;
  for (const auto& line : done->notices) log(line);
  run.result.last_checkpoint = done->path;
  run.recycled = std::move(done->snapshot);
  Progress::instance().checkpoint(done->step);
  std::ostringstream seconds;
  seconds.precision(3);
  seconds << done->seconds;
  log(describe_save(done->path, done->step, run.writing_position, data_.size()) +
      " in the background in " + seconds.str() + " s");
}

bool Trainer::save(Run& run, int64_t step, const SamplerPosition& position, bool periodic) {
  if (options_.checkpoint_dir.empty()) return true;
  if (group_->rank() != 0) return true;
  TrainResult& result = run.result;
  const auto start = std::chrono::steady_clock::now();
  if (periodic && options_.checkpoint_async) {
    collect_write(run, false);  // a finished write's error surfaces here
    if (run.cadence) collect_write(run, true);  // checkpoint_auto waits: the wait is part of C
    if (run.writer && run.writer->busy()) {
      if (result.checkpoints_skipped++ == 0) {
        log("checkpoint of step " + std::to_string(step) + " skipped: the previous write is still in " +
            "flight (periodic checkpoints are skipped while one is; the count is printed at the end)");
      }
      return false;
    }
    PhaseScope phase("checkpoint");
    // The parameters and SGD's momentum change only at the next optimizer step: the writer thread
    // copies them while the next step computes, and that step waits for the copy before its
    // update (settle_copy). The rest (buffers such as running statistics, which every forward
    // changes, and a GPU's tensors, whose copy is quick and belongs on this thread's stream) is
    // copied here.
    const CheckpointState live = capture(step, position, true);
    auto later = std::make_shared<const std::unordered_set<std::string>>(update_only_keys(*model_, live));
    auto copied_later = [later](const CheckpointState::Entry& e) { return later->count(e.key) > 0; };
    CheckpointState spare_now, spare_later;  // the last copy's buffers, for the part that reuses each
    for (const auto& e : run.recycled.entries()) {
      if (e.kind != CheckpointState::Kind::kTensor) continue;
      (copied_later(e) ? spare_later : spare_now).put(e.key, e.tensor);
    }
    run.recycled = CheckpointState();
    CheckpointState snapshot = host_copy(live, std::move(spare_now),
                                         [&](const CheckpointState::Entry& e) { return !copied_later(e); });
    if (!run.writer) {
      const CheckpointOptions options{options_.checkpoint_dir, options_.keep_last};
      run.writer = std::make_unique<AsyncCheckpointWriter>(
          [options](int64_t s, const CheckpointState& state, const std::function<void(const std::string&)>& notice) {
            CheckpointManager manager(options, 0, notice);
            return manager.save(s, state);
          });
    }
    run.writing_step = step;
    run.writing_position = position;
    run.writer->start(step, std::move(snapshot),
                      [spare = std::move(spare_later), copied_later, delay = test_copy_delay()](
                          CheckpointState partial) mutable {
                        std::this_thread::sleep_for(delay);
                        return host_copy(partial, std::move(spare), copied_later);
                      });
    run.copy_stall = since(start);
    run.copy_pending = true;  // counted by settle_copy, with the wait for the rest of the copy
    return true;
  }
  collect_write(run, true);  // at most one write at a time, and none lost
  PhaseScope phase("checkpoint");
  const CheckpointState state = capture(step, position, true);
  CheckpointManager manager({options_.checkpoint_dir, options_.keep_last}, group_->rank(), log);
  result.last_checkpoint = manager.save(step, state);
  Progress::instance().checkpoint(step);
  if (periodic) count_stall(run, since(start));
  log(describe_save(result.last_checkpoint, step, position, data_.size()));
  return true;
}

// Takes the model, optimizer, sampler position, step and RNG from `state` (a checkpoint, or a
// survivor's state sent over the group); `from` names it in errors.
void Trainer::restore(const CheckpointState& state, const std::string& from, Run& run) {
  const int64_t size = read_int(state, "ddp.dataset_size", from);
  if (size != data_.size()) {
    throw MismatchError("Trainer: " + from + " was written for a data set of " + std::to_string(size) +
                        " samples, this one has " + std::to_string(data_.size()));
  }
  const int64_t step = read_int(state, "ddp.step", from);
  const SamplerPosition position{read_int(state, "ddp.epoch", from), read_int(state, "ddp.consumed", from)};
  try {
    load_model(*model_, state);
    load_optimizer(*optimizer_, state);
    const torch::Tensor rng = state.tensor("ddp.rng_cpu").clone();
    std::lock_guard<std::mutex> lock(cpu_generator().mutex());
    cpu_generator().set_state(rng);
  } catch (const std::exception& e) {
    throw CheckpointError("Trainer: " + from + " does not match this model/optimizer: " + e.what());
  }
  run.step = step;
  run.position = position;
}

// Nobody holds a state: every rank reads the newest valid checkpoint, if any, and they check
// that they agree, on the step and on whether its lineage lets them resume from it.
void Trainer::load_checkpoint(Run& run) {
  run.holds = true;  // the checkpoint's state, or the initial one
  if (options_.checkpoint_dir.empty()) return;
  const int rank = group_->rank();
  // Every checkpoint this process writes records its lineage: the program's hash is computed
  // once, here, rather than at the first save, which may be on the training thread's clock.
  const Lineage lineage = current_lineage(group_->world_size());
  CheckpointManager manager({options_.checkpoint_dir, options_.keep_last}, rank,
                            [this](const std::string& line) { log(line); });
  auto loaded = manager.load_latest();
  const int64_t mine = loaded ? loaded->step : -1;
  LineageCheck check;
  if (loaded) check = check_lineage(loaded->state, lineage, env_check_strict(), loaded->path);
  // A refusal is taken by every rank (else the others would wait for it in collectives).
  auto agreed = torch::tensor({mine, -mine, check.refusal.empty() ? int64_t{0} : int64_t{1}}, torch::kLong);
  group_->allreduce_max(agreed);
  const int64_t highest = agreed[0].item<int64_t>(), lowest = -agreed[1].item<int64_t>();
  if (highest != lowest) {
    throw MismatchError("Trainer: ranks found different newest checkpoints in " +
                        options_.checkpoint_dir + " (steps " + std::to_string(lowest) +
                        " to " + std::to_string(highest) + "; rank " + std::to_string(rank) +
                        " has " + std::to_string(mine) +
                        "); every rank must see the same checkpoint directory");
  }
  if (!loaded) return;
  for (const auto& line : check.notices) log(line);
  if (!check.refusal.empty()) throw LineageError("Trainer: " + check.refusal);
  if (agreed[2].item<int64_t>() != 0) {
    throw LineageError("Trainer: another rank refused to resume from checkpoint " + loaded->path +
                       " (written in another environment, and --env_check=strict is set); its error says more");
  }
  restore(loaded->state, "checkpoint " + loaded->path, run);
  const int64_t saved_world = read_int(loaded->state, kWorldSizeKey, "checkpoint " + loaded->path);
  run.result.resumed_from_step = run.step;
  run.result.resumed_from = loaded->path;
  run.last_saved = run.step;
  log("resumed from " + loaded->path + " (step " + std::to_string(run.step) + ", epoch " +
      std::to_string(run.position.epoch) + ", position " + std::to_string(run.position.consumed) +
      "/" + std::to_string(data_.size()) + ", written at world size " + std::to_string(saved_world) +
      ", now " + std::to_string(group_->world_size()) + ")");
}

// Some ranks hold an older state than `newest`, or none (a replacement): the lowest rank that
// holds `newest` sends its state, as the bytes of a checkpoint, to all.
void Trainer::receive_state(Run& run, int64_t newest, int64_t held) {
  const int rank = group_->rank();
  auto lowest = torch::tensor({held == newest ? -static_cast<int64_t>(rank) : std::numeric_limits<int64_t>::min()},
                              torch::kLong);
  group_->allreduce_max(lowest);
  const int root = static_cast<int>(-lowest.item<int64_t>());
  PhaseScope phase("state transfer");
  torch::Tensor bytes;
  if (rank == root) bytes = encode_checkpoint(capture(run.step, run.position, false));
  auto size = torch::tensor({rank == root ? bytes.numel() : int64_t{0}}, torch::kLong);
  group_->broadcast(size, root);
  if (rank != root) bytes = torch::empty({size.item<int64_t>()}, torch::kUInt8);
  group_->broadcast(bytes, root);
  const std::string from = "the state rank " + std::to_string(root) + " sent";
  if (held != newest) {
    restore(decode_checkpoint(bytes, from), from, run);
    run.holds = true;
    run.last_saved = -1;
    std::cout << "[ddp] rank " << rank << ": received " << from << " (step " << run.step << ", "
              << bytes.numel() << " bytes), no checkpoint read" << std::endl;
  }
}

// The start of every round: the ranks agree on the newest step that any of them holds. Nobody:
// the checkpoint path (a fresh job, or the whole job restarted). Everybody: continue. Else the
// ranks without it receive it from one that has it.
void Trainer::resume(Run& run) {
  const int64_t held = run.holds ? run.step : -1;
  auto range = torch::tensor({held, -held}, torch::kLong);
  group_->allreduce_max(range);
  const int64_t newest = range[0].item<int64_t>(), oldest = -range[1].item<int64_t>();
  if (newest < 0) {
    load_checkpoint(run);
    return;
  }
  if (oldest != newest) receive_state(run, newest, held);
  run.result.resumed_from_step = run.step;
  run.result.resumed_from = "memory";
  log("resumed from memory (step " + std::to_string(run.step) + ", epoch " + std::to_string(run.position.epoch) +
      ", position " + std::to_string(run.position.consumed) + "/" + std::to_string(data_.size()) + ", world size " +
      std::to_string(group_->world_size()) +
      (oldest == newest ? std::string(", every rank held it)") : ", sent to the ranks that did not hold it)"));
}

// Lives for one train_round(), on the training thread.
struct Trainer::Round {
  Round(const Trainer& trainer, const Run& run)
      : rank(trainer.group_->rank()),
        world(trainer.group_->world_size()),
        ddp(trainer.model_, trainer.group_, trainer.options_.ddp),
        sampler(trainer.data_.size(), rank, world, trainer.options_.sampler),
        step(run.step) {
    sampler.restore(run.position);
    window_start = std::chrono::steady_clock::now();
  }

  const int rank;
  const int world;
  DistributedDataParallel ddp;
  DistributedSampler sampler;
  std::chrono::steady_clock::time_point window_start;
  int64_t window_samples = 0;
  torch::Tensor flag = torch::zeros({4}, torch::kDouble);
  int64_t step;
  // When the last step of this round ended, its checkpoint included: the next step's busy time
  // (Progress::busy) is measured from there. None before the round's first step.
  std::optional<std::chrono::steady_clock::time_point> step_end;
};

namespace {

// The next optimizer step's micro-batches (fewer at the end of an epoch); `step_indices` gets
// all their samples.
std::vector<std::vector<int64_t>> next_micro_batches(DistributedSampler& sampler, const TrainerOptions& options,
                                                     std::vector<int64_t>& step_indices) {
  std::vector<std::vector<int64_t>> micro;
  for (int64_t m = 0; m < options.accumulation_steps && !sampler.epoch_done(); ++m) {
    micro.push_back(sampler.next_batch(options.batch_size));
    step_indices.insert(step_indices.end(), micro.back().begin(), micro.back().end());
  }
  return micro;
}

}  // namespace

void Trainer::train_round(Run& run) {
  settle_copy(run);  // before the round's state transfer and DDP's broadcast touch the model
  if (run.cadence) run.cadence->refresh(who(*group_));  // an in-memory restart is a failure
  resume(run);
  Round round(*this, run);
  for (int64_t epoch = run.position.epoch; epoch < options_.epochs && !run.stop; ++epoch) {
    if (epoch != round.sampler.epoch()) round.sampler.set_epoch(epoch);
    while (!round.sampler.epoch_done()) {
      if (options_.max_steps >= 0 && round.step >= options_.max_steps) {
        run.stop = true;
        break;
      }
      if (!train_step(run, round, epoch)) break;
    }
    if (!run.stop) run.result.epochs_completed = epoch + 1;
  }
  Progress::instance().done();  // the final checkpoint and evaluation below are not a hang
  finish_round(run, round);
}

void Trainer::leave_if_abandoned(const Run& run, int64_t step) const {
  if (run.in_memory && Progress::instance().round_abandoned()) {
    throw RoundAbandoned("step " + std::to_string(step) + ": the agent abandoned the round");
  }
}

PendingWork Trainer::start_step_flags(Run& run, Round& round) {
  // A SIGTERM that came with an abandoned round (a drained node: its agent marks the round
  // abandoned, then signals) ends this round here and must not reach the peers, who continue in
  // memory: so the stop is read before the mark. The step's hook may have taken long since the
  // step's first look at the mark (a straggler's does).
  const bool stop = stop_requested();
  leave_if_abandoned(run, round.step);
  round.flag[0] = stop ? 1.0 : 0.0;
  round.flag[1] = std::isnan(run.last_local_loss) ? 0.0 : run.last_local_loss;
  // Rank 0's automatic cadence: whether a checkpoint is due (saved after this step), and the
  // interval, which the other ranks report to their agents too.
  const bool decides = run.cadence && round.rank == 0;
  round.flag[2] = decides && run.cadence->due(who(*group_)) ? 1.0 : 0.0;
  round.flag[3] = decides ? run.cadence->interval() : 0.0;
  return group_->allreduce_sum_async(round.flag);
}

// One optimizer step; false when SIGTERM stops the training after it.
bool Trainer::train_step(Run& run, Round& round, int64_t epoch) {
  TrainResult& result = run.result;
  Progress& progress = Progress::instance();
  std::vector<int64_t> step_indices;
  std::vector<std::vector<int64_t>> micro = next_micro_batches(round.sampler, options_, step_indices);
  // A restart that no collective of this rank waits through (a node joined, world size 1)
  // is seen here, before the step begins.
  leave_if_abandoned(run, round.step);
  StepInfo info{round.step, epoch, round.rank, round.world, &step_indices, 0};
  if (on_step_begin) on_step_begin(info);
  progress.set_phase("forward/backward");
  PendingWork flag_work = start_step_flags(run, round);

  const double synced_before = round.ddp.stats().exposed_sync_seconds;
  const double loss_sum = forward_backward(round, micro);
  progress.set_phase("step sync");
  const auto flag_wait_start = std::chrono::steady_clock::now();
  flag_work.wait();
  const double waited = round.ddp.stats().exposed_sync_seconds - synced_before +
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - flag_wait_start).count();
  // Every collective of the step completed: only now the update, so that a round abandoned
  // during the step leaves the model and optimizer at the last completed step; and only once
  // the last checkpoint's copy of them is made.
  settle_copy(run);
  optimizer_->step();
  const int64_t step = ++round.step;
  run.step = step;
  run.position = round.sampler.position();
  ++result.steps_this_run;
  // Busy time (--straggler): the step's time that was not spent waiting for the peers in its
  // all-reduces. A slow rank's is long; its peers' is short, their wait long.
  if (round.step_end) {
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - *round.step_end).count();
    progress.busy(std::max(0.0, took - waited));
  }
  // Heartbeats to the agent (--hang_timeout, crash-loop detection): one per optimizer step.
  progress.step(step);
  progress.set_phase("between steps");
  run.steady_end = std::chrono::steady_clock::now();
  if (result.steps_this_run == kSteadyWarmupSteps) run.steady_start = run.steady_end;
  run.stop = round.flag[0].item<double>() > 0;
  const bool checkpoint_due = round.flag[2].item<double>() > 0;
  if (run.cadence) run.cadence->follow(round.flag[3].item<double>());
  if (!std::isnan(run.last_local_loss)) run.previous_global_loss = round.flag[1].item<double>() / round.world;
  run.last_local_loss = loss_sum / static_cast<double>(micro.size());
  const int64_t step_samples = static_cast<int64_t>(step_indices.size()) * round.world;
  round.window_samples += step_samples;
  run.run_samples += step_samples;

  info.loss = run.last_local_loss;
  if (on_step_end) on_step_end(info);

  log_throughput(run, round, epoch);
  if (run.stop) {
    log("SIGTERM: stopping after step " + std::to_string(step));
    result.stopped_by_signal = true;
    return false;
  }
  if ((options_.checkpoint_every > 0 && step % options_.checkpoint_every == 0) || checkpoint_due) {
    if (save(run, step, round.sampler.position(), /*periodic=*/true)) run.last_saved = step;
  } else if (run.writer) {
    collect_write(run, false);  // report a finished background write (or its error) promptly
  }
  // Rank 0's checkpoint is not busy time of the next step: it would name rank 0 a straggler.
  round.step_end = std::chrono::steady_clock::now();
  return true;
}

// The gradients of one optimizer step, all-reduced with the last micro-batch's backward;
// returns the sum of the micro-batches' losses.
double Trainer::forward_backward(Round& round, std::vector<std::vector<int64_t>>& micro) {
  const auto device = group_->device();
  optimizer_->zero_grad();
  double loss_sum = 0;
  for (size_t m = 0; m < micro.size(); ++m) {
    auto index = torch::from_blob(micro[m].data(), {static_cast<int64_t>(micro[m].size())},
                                  torch::kLong);
    auto x = data_.inputs.index_select(0, index).to(device);
    auto y = data_.targets.index_select(0, index).to(device);
    torch::Tensor loss = loss_(x, y);
    loss_sum += loss.item<double>();
    torch::Tensor scaled = micro.size() > 1 ? loss / static_cast<double>(micro.size()) : loss;
    if (m + 1 < micro.size()) {
      auto guard = round.ddp.no_sync();
      scaled.backward();
    } else {
      round.ddp.backward(scaled);
    }
  }
  return loss_sum;
}

// Every log_every steps: the mean loss and the samples per second since the last such line.
void Trainer::log_throughput(const Run& run, Round& round, int64_t epoch) {
  const int64_t step = round.step;
  if (options_.log_every <= 0 || step % options_.log_every != 0) return;
  const auto now = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now - round.window_start).count();
  std::ostringstream line;
  line << "epoch " << epoch << " step " << step << " loss " << run.previous_global_loss
       << " samples/s " << (seconds > 0 ? round.window_samples / seconds : 0.0);
  log(line.str());
  round.window_start = now;
  round.window_samples = 0;
}

// The round's last checkpoint (unless its last step is saved already) and the mean final loss.
void Trainer::finish_round(Run& run, Round& round) {
  TrainResult& result = run.result;
  const int64_t step = round.step;
  if (run.position.epoch >= options_.epochs) result.epochs_completed = options_.epochs;

  if (step != run.last_saved || result.stopped_by_signal) {
    SamplerPosition final_position = round.sampler.position();
    if (!result.stopped_by_signal && round.sampler.epoch_done() && final_position.epoch + 1 <= options_.epochs &&
        result.epochs_completed == options_.epochs) {
      final_position = SamplerPosition{options_.epochs, 0};
    }
    if (step != run.last_saved) {
      save(run, step, final_position, /*periodic=*/false);
      run.last_saved = step;
    }
  }
  collect_write(run, true);  // the last periodic write, when the final step was saved by it
  if (result.checkpoints_skipped > 0) {
    log(std::to_string(result.checkpoints_skipped) + " periodic checkpoint(s) skipped while a write was in flight");
  }

  auto final_loss = torch::tensor({std::isnan(run.last_local_loss) ? 0.0 : run.last_local_loss},
                                  torch::kDouble);
  group_->allreduce_sum(final_loss);
  if (!std::isnan(run.last_local_loss)) result.final_loss = final_loss.item<double>() / round.world;
  result.steps = step;
  result.exposed_sync_seconds += round.ddp.stats().exposed_sync_seconds;
}

namespace {

// How long a worker whose collective failed (a peer's connection reset) waits for its agent to
// abandon the round before the failure is taken for its own: the agent hears of a lost peer
// within a heartbeat timeout.
constexpr auto kAbandonWait = std::chrono::seconds(60);

bool abandoned_within(std::chrono::steady_clock::duration wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  Progress& progress = Progress::instance();
  while (!progress.round_abandoned()) {
    if (stop_requested() || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// Tells the agent that this worker restarts in memory for as long as it lives, and lets
// collectives throw RoundAbandoned meanwhile.
class InMemoryScope {
 public:
  explicit InMemoryScope(bool on) : on_(on && detail::tell_restartable(true)) { detail::allow_parking(on_); }
  ~InMemoryScope() {
    if (!on_) return;
    detail::allow_parking(false);
    detail::tell_restartable(false);
  }
  bool on() const { return on_; }

 private:
  bool on_;
};

}  // namespace

// The round was abandoned: wait for the next one with the state of the last completed step.
void Trainer::park(Run& run) {
  collect_write(run, true);  // no write in flight while parked, or when SIGTERM ends the process
  if (stop_requested()) {
    // The agent stops this worker (the job ends): SIGTERM's default action, deferred so far.
    ::signal(SIGTERM, SIG_DFL);
    ::raise(SIGTERM);
  }
  const int64_t held = run.holds ? run.step : -1;
  std::cerr << "[ddp] rank " << group_->rank() << ": the agent ended the round (a restart); "
            << "waiting for the next one with the state of step " << held << std::endl;
  Progress::instance().set_phase("parked");
  detail::park(held);
  group_->reconnect(WorkerEnv::from_environment());
  ++run.result.in_memory_restarts;
  if (on_reassigned) on_reassigned(group_->env());
}

TrainResult Trainer::fit() {
  SigtermScope sigterm(options_.handle_sigterm);
  Run run;
  run.result.final_loss = std::numeric_limits<double>::quiet_NaN();
  run.start = std::chrono::steady_clock::now();
  // In-memory restart needs a channel from ddplaunch and waits that notice an abandoned round
  // (Gloo's; a single process has none to wait in).
  const std::string backend = group_->backend_name();
  if (options_.checkpoint_auto) {
    run.cadence = std::make_unique<cadence::Cadence>(
        options_.checkpoint_dir, cadence::prior_mtbf(std::getenv(cadence::kMtbfVariable)),
        cadence::Cadence::Hooks{nullptr, nullptr, [this](const std::string& line) { log(line); },
                                [](double seconds) { Progress::instance().checkpoint_interval(seconds); }});
  }
  InMemoryScope in_memory(options_.in_memory_restart && (backend == "gloo" || backend == "none") &&
                          detail::worker_channel() >= 0);
  run.in_memory = in_memory.on();
  for (;;) {
    try {
      train_round(run);
      break;
    } catch (const RoundAbandoned&) {
      if (!in_memory.on()) throw;
    } catch (const CommError&) {
      // A peer's connection reset before the agent said anything: wait for its word.
      if (!in_memory.on() || !abandoned_within(kAbandonWait)) throw;
    }
    park(run);
  }
  TrainResult& result = run.result;
  // Rank 0's training ended normally: a relaunch after it is no failure (after SIGTERM it is).
  if (run.cadence && !result.stopped_by_signal) run.cadence->exited(who(*group_));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - run.start).count();
  result.samples_per_second = seconds > 0 ? run.run_samples / seconds : 0;
  if (result.steps_this_run > kSteadyWarmupSteps) {
    const double steady = std::chrono::duration<double>(run.steady_end - run.steady_start).count();
    if (steady > 0) {
      result.steady_steps_per_second = static_cast<double>(result.steps_this_run - kSteadyWarmupSteps) / steady;
    }
  }
  return result;
}

}  // namespace ddp
