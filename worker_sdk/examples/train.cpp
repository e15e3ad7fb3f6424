// train: the worker SDK's example. A small MLP classifier on a deterministic synthetic data
// set (or a CSV), trained with DDP across the workers that ddplaunch starts.
//
//   ddplaunch --nproc_per_node=2 build/bin/train --epochs 5
//   build/bin/train                      # no launcher: one process
//
// Exit codes: 0 trained; 2 bad command line or data; 3 the checkpoint to resume from was written
// in another environment and DDPLAUNCH_ENV_CHECK is strict; 1 any other error; 13 --crash-at-step
// fired; 143 stopped by SIGTERM (after saving a checkpoint).
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include <chrono>
#include <thread>

#include "ddp/worker_sdk.h"

namespace {

struct Flags {
  int64_t epochs = 5;
  int64_t batch_size = 32;
  double lr = 0.05;
  std::string checkpoint_dir;
  std::string checkpoint_every = "0";  // steps, or "auto"
  int keep_last = 3;
  bool checkpoint_async = false;
  uint64_t seed = 0;
  int64_t crash_at_step = -1;
  int crash_rank = -1;
  double step_sleep = 0;
  double slow_ms = 0;
  int64_t hang_at_step = -1;
  int hang_rank = 0;
  std::string data;
  int64_t samples = 4096;
  int64_t features = 32;
  int64_t classes = 4;
  int64_t hidden = 64;
  int64_t max_steps = -1;
  int64_t log_every = 50;
  bool no_shuffle = false;
  bool drop_last = false;
  std::string sample_log;
  std::string dump_params;
  double bucket_mb = 25;
  int64_t accumulate = 1;
};

// Deterministic synthetic classification: class centres and noise from a generator seeded
// with `seed` only, so every rank (and every restart) builds identical data.
ddp::TensorDataset synthetic(int64_t n, int64_t features, int64_t classes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1000003);
  auto centres = torch::randn({classes, features}, gen) * 0.6;
  auto targets = torch::randint(classes, {n}, gen, torch::kLong);
  auto inputs = centres.index_select(0, targets) + torch::randn({n, features}, gen);
  return {inputs, targets};
}

// CSV: one sample per line, numeric features then an integer class label last.
ddp::TensorDataset read_csv(const std::string& path, int64_t* classes) {
  std::ifstream in(path);
  if (!in) throw ddp::UsageError("--data " + path + ": cannot open");
  std::vector<float> values;
  std::vector<int64_t> labels;
  int64_t width = -1, line_no = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::stringstream cells(line);
    std::string cell;
    std::vector<double> row;
    while (std::getline(cells, cell, ',')) {
      char* end = nullptr;
      const double v = std::strtod(cell.c_str(), &end);
      if (end == cell.c_str()) {
        if (line_no == 1 && values.empty()) { row.clear(); break; }  // header line
        throw ddp::UsageError("--data " + path + ":" + std::to_string(line_no) + ": '" + cell +
                              "' is not a number");
      }
      row.push_back(v);
    }
    if (row.empty()) continue;
    if (row.size() < 2) {
      throw ddp::UsageError("--data " + path + ":" + std::to_string(line_no) +
                            ": need at least one feature and a label");
    }
    if (width < 0) width = static_cast<int64_t>(row.size());
    if (static_cast<int64_t>(row.size()) != width) {
      throw ddp::UsageError("--data " + path + ":" + std::to_string(line_no) + ": " +
                            std::to_string(row.size()) + " columns, expected " +
                            std::to_string(width));
    }
    for (size_t i = 0; i + 1 < row.size(); ++i) values.push_back(static_cast<float>(row[i]));
    labels.push_back(static_cast<int64_t>(row.back()));
  }
  if (labels.empty()) throw ddp::UsageError("--data " + path + ": no samples");
  int64_t max_label = 0;
  for (auto l : labels) {
    if (l < 0) throw ddp::UsageError("--data " + path + ": negative class label");
    max_label = std::max(max_label, l);
  }
  *classes = max_label + 1;
  const auto n = static_cast<int64_t>(labels.size());
  return {torch::from_blob(values.data(), {n, width - 1}).clone(),
          torch::from_blob(labels.data(), {n}, torch::kLong).clone()};
}

void append_line(int fd, const std::string& line) {
  // One write per line on an O_APPEND file: lines of different ranks never interleave.
  const ssize_t n = ::write(fd, line.data(), line.size());
  (void)n;
}

// `text` with {generation} and {rank} replaced by the worker's (0 without a launcher's
// generation): one command line serves every round, as a standby's must (its arguments are
// fixed before its round exists).
std::string round_path(std::string text, const ddp::WorkerEnv& env) {
  const std::pair<std::string, std::string> fields[] = {
      {"{generation}", std::to_string(env.generation.value_or(0))}, {"{rank}", std::to_string(env.rank)}};
  for (const auto& [name, value] : fields) {
    for (std::size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + value.size())) {
      text.replace(at, name.size(), value);
    }
  }
  return text;
}

struct DataSets {
  ddp::TensorDataset train, test;
  int64_t classes;
};

DataSets load_data(const Flags& flags) {
  DataSets sets;
  sets.classes = flags.classes;
  if (!flags.data.empty()) {
    sets.train = read_csv(flags.data, &sets.classes);
    sets.test = sets.train;
  } else {
    // One draw, split: the 1024 test samples share the training set's class centres.
    auto full = synthetic(flags.samples + 1024, flags.features, sets.classes, flags.seed);
    sets.train = {full.inputs.narrow(0, 0, flags.samples), full.targets.narrow(0, 0, flags.samples)};
    sets.test = {full.inputs.narrow(0, flags.samples, 1024), full.targets.narrow(0, flags.samples, 1024)};
  }
  return sets;
}

ddp::TrainerOptions trainer_options(const Flags& flags) {
  ddp::TrainerOptions options;
  options.epochs = flags.epochs;
  options.batch_size = flags.batch_size;
  options.max_steps = flags.max_steps;
  options.accumulation_steps = flags.accumulate;
  options.checkpoint_dir = flags.checkpoint_dir;
  options.checkpoint_auto = flags.checkpoint_every == "auto";
  options.checkpoint_every = options.checkpoint_auto ? 0 : std::stoll(flags.checkpoint_every);  // checked by CLI11
  options.keep_last = flags.keep_last;
  options.checkpoint_async = flags.checkpoint_async;
  options.log_every = flags.log_every;
  options.sampler.seed = flags.seed;
  options.sampler.shuffle = !flags.no_shuffle;
  options.sampler.drop_last = flags.drop_last;
  options.ddp.bucket_cap_bytes = static_cast<size_t>(flags.bucket_mb * 1024 * 1024);
  return options;
}

// --crash-at-step, --hang-at-step, --step-sleep and --slow-ms: the faults and pacing the tests
// inject.
// `flags` and `env` outlive the trainer.
void add_test_hooks(ddp::Trainer& trainer, const Flags& flags, const ddp::WorkerEnv& env) {
  if (flags.crash_at_step >= 0) {
    trainer.on_step_begin = [&flags, &env](const ddp::StepInfo& info) {
      if (info.step == flags.crash_at_step && env.restart_count == 0 &&
          (flags.crash_rank < 0 || flags.crash_rank == info.rank)) {
        std::cout << "[train] rank " << info.rank << ": --crash-at-step " << info.step
                  << " on the first attempt: exiting with code 13" << std::endl;
        std::fflush(nullptr);
        std::_Exit(13);
      }
    };
  }
  if (flags.hang_at_step >= 0) {
    auto previous = trainer.on_step_begin;
    trainer.on_step_begin = [&flags, &env, previous](const ddp::StepInfo& info) {
      if (previous) previous(info);
      if (info.step != flags.hang_at_step || env.restart_count != 0 || info.rank != flags.hang_rank) return;
      std::cout << "[train] rank " << info.rank << ": --hang-at-step " << info.step
                << " on the first attempt: blocking forever" << std::endl;
      ddp::Progress::instance().set_phase("--hang-at-step");
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    };
  }
  if (flags.slow_ms > 0) {
    // Inside the step, before its all-reduces: the worker computes slower than its peers.
    auto previous = trainer.on_step_begin;
    trainer.on_step_begin = [&flags, previous](const ddp::StepInfo& info) {
      if (previous) previous(info);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(flags.slow_ms));
    };
  }
  if (flags.step_sleep > 0) {
    auto previous = trainer.on_step_end;
    trainer.on_step_end = [&flags, previous](const ddp::StepInfo& info) {
      if (previous) previous(info);
      std::this_thread::sleep_for(std::chrono::duration<double>(flags.step_sleep));
    };
  }
}

// --sample-log: the file of the current round, opened when its first step starts (a worker that
// restarts in memory writes each round's records to that round's file). Lives in run(), longer
// than the trainer whose hook writes to it.
class SampleLog {
 public:
  SampleLog(const Flags& flags, const ddp::WorkerEnv& env) : flags_(flags), env_(env) {}
  SampleLog(const SampleLog&) = delete;
  SampleLog& operator=(const SampleLog&) = delete;

  int file() {
    const std::string path = round_path(flags_.sample_log, env_);
    if (path == path_) return fd_;
    if (fd_ >= 0) ::close(fd_);
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw ddp::UsageError("--sample-log " + path + ": cannot open");
    path_ = path;
    return fd_;
  }

  void close() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  const Flags& flags_;
  const ddp::WorkerEnv& env_;
  int fd_ = -1;
  std::string path_;
};

void add_sample_log(ddp::Trainer& trainer, SampleLog& log, const ddp::WorkerEnv& env) {
  log.file();
  // Written when the step starts, not when it ends: once any rank has finished a step's
  // gradient all-reduce, every rank's samples are in the update, yet a rank may still be
  // blocked in that all-reduce or in the stop-flag one when its round is cut off (a cut link),
  // and a record written after them would be lost while the step is in the checkpoint. A record
  // of a step that never completed is harmless: the next round starts at that step or earlier,
  // and its records replace it (tests/e2e/elastic_job.py, committed_steps).
  auto previous = trainer.on_step_begin;
  trainer.on_step_begin = [&log, &env, previous](const ddp::StepInfo& info) {
    if (previous) previous(info);
    std::ostringstream line;
    line << "attempt=" << env.restart_count << " world=" << info.world_size
         << " rank=" << info.rank << " epoch=" << info.epoch << " step=" << info.step
         << " indices=";
    for (size_t i = 0; i < info.indices->size(); ++i) line << (i ? "," : "") << (*info.indices)[i];
    line << "\n";
    append_line(log.file(), line.str());
  };
}

// Rank 0's summary lines: the run's numbers, the test accuracy and --dump-params.
void report(const Flags& flags, const ddp::TrainResult& result, double accuracy, torch::nn::Sequential& model) {
  if (result.resumed_from_step) {
    std::cout << "[train] resumed_from_step=" << *result.resumed_from_step << std::endl;
  }
  std::cout << "[train] steps=" << result.steps << " steps_this_run=" << result.steps_this_run
            << " epochs_completed=" << result.epochs_completed
            << " final_loss=" << result.final_loss
            << " samples_per_s=" << result.samples_per_second
            << " steady_steps_per_s=" << result.steady_steps_per_second
            << " exposed_sync_s=" << result.exposed_sync_seconds << std::endl;
  std::cout << "[train] checkpoints_saved=" << result.checkpoints_saved
            << " checkpoints_skipped=" << result.checkpoints_skipped
            << " checkpoint_stall_s=" << result.checkpoint_stall_seconds << std::endl;
  std::cout << "[train] final_accuracy=" << accuracy << std::endl;
  if (!flags.dump_params.empty()) {
    std::ofstream out(flags.dump_params, std::ios::binary);
    for (const auto& p : model->parameters()) {
      auto c = p.detach().cpu().contiguous().to(torch::kFloat);
      out.write(static_cast<const char*>(c.data_ptr()), c.numel() * 4);
    }
    if (!out) throw ddp::UsageError("--dump-params " + flags.dump_params + ": write failed");
  }
}

int run(const Flags& flags) {
  auto group = ddp::ProcessGroup::from_environment();
  const auto& env = group->env();
  // Each round's header (rank 0) and each worker's pid: the first round's here, the later ones'
  // after an in-memory restart (Trainer::on_reassigned). `env` follows the group's round.
  auto announce = [&] {
    if (group->rank() == 0) std::cout << "[train] " << env.describe() << ", backend " << group->backend_name() << std::endl;
    std::cout << "[train] rank " << env.rank << " pid " << ::getpid() << " generation " << env.generation.value_or(0)
              << std::endl;
  };
  announce();

  torch::manual_seed(flags.seed);
  const DataSets sets = load_data(flags);
  const int64_t features = sets.train.inputs.size(1);

  torch::nn::Sequential model(torch::nn::Linear(features, flags.hidden), torch::nn::ReLU(),
                              torch::nn::Linear(flags.hidden, flags.hidden), torch::nn::ReLU(),
                              torch::nn::Linear(flags.hidden, sets.classes));
  model->to(group->device());
  auto optimizer = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(flags.lr).momentum(0.9));

  ddp::Trainer trainer(group, model.ptr(), optimizer, sets.train,
                       [&](const torch::Tensor& x, const torch::Tensor& y) {
                         return torch::nn::functional::cross_entropy(model->forward(x), y);
                       },
                       trainer_options(flags));
  trainer.on_reassigned = [&](const ddp::WorkerEnv&) { announce(); };
  add_test_hooks(trainer, flags, env);
  SampleLog sample_log(flags, env);
  if (!flags.sample_log.empty()) add_sample_log(trainer, sample_log, env);

  const ddp::TrainResult result = trainer.fit();
  sample_log.close();

  torch::NoGradGuard no_grad;
  model->eval();
  auto predicted = model->forward(sets.test.inputs.to(group->device())).argmax(1).cpu();
  const double accuracy = predicted.eq(sets.test.targets).to(torch::kDouble).mean().item<double>();
  if (group->rank() == 0) report(flags, result, accuracy, model);
  if (result.stopped_by_signal) return 143;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"Train a classifier with the ddplaunch worker SDK (DDP over the launcher's workers)"};
  app.add_option("--epochs", flags.epochs, "epochs to train")->capture_default_str();
  app.add_option("--batch-size", flags.batch_size, "samples per worker per step")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", flags.lr, "SGD learning rate (momentum 0.9)")->capture_default_str();
  app.add_option("--checkpoint-dir", flags.checkpoint_dir, "directory for checkpoints; resumes from the newest valid one");
  app.add_option("--checkpoint-every", flags.checkpoint_every,
                 "steps between checkpoints (0: at the end and on SIGTERM), or auto: at the interval the measured save "
                 "stall and the job's failure history call for (docs/checkpoints.md, \"How often\"; needs --checkpoint-dir)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) {
            return text == "auto" || (!text.empty() && text.size() < 19 && text.find_first_not_of("0123456789") == std::string::npos)
                       ? std::string()
                       : "must be a number of steps or auto, not '" + text + "'";
          },
          "STEPS|auto"));
  app.add_option("--keep-last", flags.keep_last, "checkpoints to keep")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--checkpoint-async", flags.checkpoint_async, "write periodic checkpoints on a background thread from a host copy taken at the step (one write at a time; a periodic checkpoint due while one is in flight is skipped, or with --checkpoint-every=auto waits for it)");
  app.add_option("--seed", flags.seed, "seed of the model, the data and the shuffling")->capture_default_str();
  app.add_option("--crash-at-step", flags.crash_at_step, "exit with code 13 before step N, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0); every rank, or --crash-rank");
  app.add_option("--crash-rank", flags.crash_rank, "the rank --crash-at-step exits (default: every rank)");
  app.add_option("--step-sleep", flags.step_sleep, "seconds each worker sleeps after each step (tests pace a job with it)")->check(CLI::NonNegativeNumber);
  app.add_option("--slow-ms", flags.slow_ms, "milliseconds each worker sleeps inside each step, before its all-reduces, as a slow GPU would (tests make one node a straggler with DDP_TRAIN_SLOW_MS in that node's environment)")
      ->envname("DDP_TRAIN_SLOW_MS")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--hang-at-step", flags.hang_at_step, "rank --hang-rank blocks forever before step N, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0)");
  app.add_option("--hang-rank", flags.hang_rank, "the rank --hang-at-step blocks")->capture_default_str();
  app.add_option("--data", flags.data, "CSV file: features..., integer label (default: synthetic data)");
  app.add_option("--samples", flags.samples, "synthetic training samples")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--features", flags.features, "synthetic features")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--classes", flags.classes, "synthetic classes")->capture_default_str()->check(CLI::Range(2, 1000));
  app.add_option("--hidden", flags.hidden, "hidden layer width")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-steps", flags.max_steps, "stop after N optimizer steps in total");
  app.add_option("--log-every", flags.log_every, "steps between log lines (rank 0)")->capture_default_str();
  app.add_option("--bucket-mb", flags.bucket_mb, "gradient bucket size in MiB")->capture_default_str();
  app.add_option("--accumulate", flags.accumulate, "micro-batches per optimizer step (gradient accumulation with no_sync)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--no-shuffle", flags.no_shuffle, "keep the data set order");
  app.add_flag("--drop-last", flags.drop_last, "drop the tail instead of padding shards");
  app.add_option("--sample-log", flags.sample_log, "append 'attempt= world= rank= epoch= step= indices=' when each step starts to this file ({generation} and {rank} are filled in; tests)");
  app.add_option("--dump-params", flags.dump_params, "rank 0 writes the final parameters as raw float32 (tests)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    return run(flags);
  } catch (const ddp::UsageError& e) {
    std::cerr << "train: error: " << e.what() << std::endl;
    return 2;
  } catch (const ddp::EnvError& e) {
    std::cerr << "train: error: " << e.what() << std::endl;
    return 2;
  } catch (const ddp::LineageError& e) {
    std::cerr << "train: error: " << e.what() << std::endl;
    ddp::Progress::instance().final_failure();  // a restart would refuse the same checkpoint
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "train: error: " << e.what() << std::endl;
    return 1;
  }
}
