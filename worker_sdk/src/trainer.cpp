#include "ddp/trainer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <sstream>

#include "ddp/checkpoint.h"
#include "ddp/error.h"

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

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  if (!archive.try_read(key, value) || !value.isInt()) {
    throw CheckpointError("checkpoint has no integer '" + key + "'");
  }
  return value.toInt();
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
  const int rank = group_->rank();
  log = [rank](const std::string& line) {
    if (rank == 0) std::cout << "[ddp] " << line << std::endl;
  };
}

void Trainer::save(int64_t step, const SamplerPosition& position, TrainResult& result) {
  if (options_.checkpoint_dir.empty()) return;
  if (group_->rank() != 0) return;
  torch::serialize::OutputArchive archive;
  archive.write("ddp.format", c10::IValue(int64_t{1}));
  archive.write("ddp.step", c10::IValue(step));
  archive.write("ddp.epoch", c10::IValue(position.epoch));
  archive.write("ddp.consumed", c10::IValue(position.consumed));
  archive.write("ddp.dataset_size", c10::IValue(data_.size()));
  archive.write("ddp.world_size", c10::IValue(int64_t{group_->world_size()}));
  {
    std::lock_guard<std::mutex> lock(cpu_generator().mutex());
    archive.write("ddp.rng_cpu", cpu_generator().get_state());
  }
  torch::serialize::OutputArchive model_archive;
  model_->save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer_->save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  CheckpointManager manager({options_.checkpoint_dir, options_.keep_last}, group_->rank(), log);
  result.last_checkpoint = manager.save(step, archive);
  log("saved checkpoint " + result.last_checkpoint + " (step " + std::to_string(step) +
      ", epoch " + std::to_string(position.epoch) + ", position " +
      std::to_string(position.consumed) + "/" + std::to_string(data_.size()) + ")");
}

TrainResult Trainer::fit() {
  TrainResult result;
  result.final_loss = std::numeric_limits<double>::quiet_NaN();
  SigtermScope sigterm(options_.handle_sigterm);
  const int rank = group_->rank();
  const int world = group_->world_size();

  // Resume: every rank reads the newest valid checkpoint, then they check that they agree.
  int64_t step = 0;
  SamplerPosition position{0, 0};
  if (!options_.checkpoint_dir.empty()) {
    CheckpointManager manager({options_.checkpoint_dir, options_.keep_last}, rank,
                              [this](const std::string& line) { log(line); });
    auto loaded = manager.load_latest();
    const int64_t mine = loaded ? loaded->step : -1;
    auto agreed = torch::tensor({mine, -mine}, torch::kLong);
    group_->allreduce_max(agreed);
    const int64_t highest = agreed[0].item<int64_t>(), lowest = -agreed[1].item<int64_t>();
    if (highest != lowest) {
      throw MismatchError("Trainer: ranks found different newest checkpoints in " +
                          options_.checkpoint_dir + " (steps " + std::to_string(lowest) +
                          " to " + std::to_string(highest) + "; rank " + std::to_string(rank) +
                          " has " + std::to_string(mine) +
                          "); every rank must see the same checkpoint directory");
    }
    if (loaded) {
      auto& archive = *loaded->archive;
      const int64_t size = read_int(archive, "ddp.dataset_size");
      if (size != data_.size()) {
        throw MismatchError("Trainer: checkpoint " + loaded->path + " was written for a data set "
                            "of " + std::to_string(size) + " samples, this one has " +
                            std::to_string(data_.size()));
      }
      step = read_int(archive, "ddp.step");
      position.epoch = read_int(archive, "ddp.epoch");
      position.consumed = read_int(archive, "ddp.consumed");
      const int64_t saved_world = read_int(archive, "ddp.world_size");
      try {
        torch::serialize::InputArchive model_archive, optimizer_archive;
        archive.read("model", model_archive);
        model_->load(model_archive);
        archive.read("optimizer", optimizer_archive);
        optimizer_->load(optimizer_archive);
        torch::Tensor rng;
        archive.read("ddp.rng_cpu", rng);
        std::lock_guard<std::mutex> lock(cpu_generator().mutex());
        cpu_generator().set_state(rng);
      } catch (const ddp::Error&) {
        throw;
      } catch (const std::exception& e) {
        throw CheckpointError("Trainer: checkpoint " + loaded->path +
                              " does not match this model/optimizer: " + e.what());
      }
      result.resumed_from_step = step;
      result.resumed_from = loaded->path;
      log("resumed from " + loaded->path + " (step " + std::to_string(step) + ", epoch " +
          std::to_string(position.epoch) + ", position " + std::to_string(position.consumed) +
          "/" + std::to_string(data_.size()) + ", written at world size " +
          std::to_string(saved_world) + ", now " + std::to_string(world) + ")");
    }
  }

  DistributedDataParallel ddp(model_, group_, options_.ddp);
  DistributedSampler sampler(data_.size(), rank, world, options_.sampler);
  sampler.restore(position);

  const auto device = group_->device();
  const auto start = std::chrono::steady_clock::now();
  auto window_start = start;
  int64_t window_samples = 0, run_samples = 0;
  double last_local_loss = std::numeric_limits<double>::quiet_NaN();
  double previous_global_loss = std::numeric_limits<double>::quiet_NaN();
  bool stop = false;
  int64_t last_saved = result.resumed_from_step.value_or(-1);
  auto flag = torch::zeros({2}, torch::kDouble);

  for (int64_t epoch = position.epoch; epoch < options_.epochs && !stop; ++epoch) {
    if (epoch != sampler.epoch()) sampler.set_epoch(epoch);
    while (!sampler.epoch_done()) {
      if (options_.max_steps >= 0 && step >= options_.max_steps) {
        stop = true;
        break;
      }
      std::vector<std::vector<int64_t>> micro;
      std::vector<int64_t> step_indices;
      for (int64_t m = 0; m < options_.accumulation_steps && !sampler.epoch_done(); ++m) {
        micro.push_back(sampler.next_batch(options_.batch_size));
        step_indices.insert(step_indices.end(), micro.back().begin(), micro.back().end());
      }
      StepInfo info{step, epoch, rank, world, &step_indices, 0};
      if (on_step_begin) on_step_begin(info);

      // Agreement on stopping (and the previous step's mean loss) travels in one small
      // all-reduce that runs while this step computes.
      flag[0] = stop_requested() ? 1.0 : 0.0;
      flag[1] = std::isnan(last_local_loss) ? 0.0 : last_local_loss;
      PendingWork flag_work = group_->allreduce_sum_async(flag);

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
          auto guard = ddp.no_sync();
          scaled.backward();
        } else {
          ddp.backward(scaled);
        }
      }
      optimizer_->step();
      ++step;
      ++result.steps_this_run;
      flag_work.wait();
      stop = flag[0].item<double>() > 0;
      if (!std::isnan(last_local_loss)) previous_global_loss = flag[1].item<double>() / world;
      last_local_loss = loss_sum / static_cast<double>(micro.size());
      const int64_t step_samples = static_cast<int64_t>(step_indices.size()) * world;
      window_samples += step_samples;
      run_samples += step_samples;

      info.loss = last_local_loss;
      if (on_step_end) on_step_end(info);

      if (options_.log_every > 0 && step % options_.log_every == 0) {
        const auto now = std::chrono::steady_clock::now();
        const double seconds = std::chrono::duration<double>(now - window_start).count();
        std::ostringstream line;
        line << "epoch " << epoch << " step " << step << " loss " << previous_global_loss
             << " samples/s " << (seconds > 0 ? window_samples / seconds : 0.0);
        log(line.str());
        window_start = now;
        window_samples = 0;
      }
      if (stop) {
        log("SIGTERM: stopping after step " + std::to_string(step));
        result.stopped_by_signal = true;
        break;
      }
      if (options_.checkpoint_every > 0 && step % options_.checkpoint_every == 0) {
        save(step, sampler.position(), result);
        last_saved = step;
      }
    }
    if (!stop) result.epochs_completed = epoch + 1;
  }
  if (position.epoch >= options_.epochs) result.epochs_completed = options_.epochs;

  if (step != last_saved || result.stopped_by_signal) {
    SamplerPosition final_position = sampler.position();
    if (!result.stopped_by_signal && sampler.epoch_done() && final_position.epoch + 1 <= options_.epochs &&
        result.epochs_completed == options_.epochs) {
      final_position = SamplerPosition{options_.epochs, 0};
    }
    if (step != last_saved) save(step, final_position, result);
  }

  auto final_loss = torch::tensor({std::isnan(last_local_loss) ? 0.0 : last_local_loss},
                                  torch::kDouble);
  group_->allreduce_sum(final_loss);
  if (!std::isnan(last_local_loss)) result.final_loss = final_loss.item<double>() / world;
  result.steps = step;
  result.exposed_sync_seconds = ddp.stats().exposed_sync_seconds;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.samples_per_second = seconds > 0 ? run_samples / seconds : 0;
  return result;
}

}  // namespace ddp
