// Checkpoint save throughput of the SDK (the Trainer's format): index + checksum + write + fsync + rename +
// directory fsync of a model-sized archive. Prints "bytes=N best_seconds=S mb_per_s=R".
//   bench_sdk_checkpoint DIR MEGABYTES REPEATS
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "ddp/checkpoint.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: bench_sdk_checkpoint DIR MEGABYTES REPEATS\n";
    return 2;
  }
  const std::string dir = argv[1];
  const int64_t megabytes = std::atoll(argv[2]);
  const int repeats = std::atoi(argv[3]);
  // A model-like set of tensors: 16 layers of float32 weights.
  const int64_t per_layer = megabytes * 1024 * 1024 / 4 / 16;
  std::vector<torch::Tensor> layers;
  for (int i = 0; i < 16; ++i) layers.push_back(torch::randn({per_layer}));
  ddp::CheckpointManager manager({dir, 1}, 0, [](const std::string&) {});
  double best = 1e30;
  uintmax_t bytes = 0;
  for (int r = 0; r < repeats; ++r) {
    // The Trainer's path: a CheckpointState of raw tensors (plus the few scalars it adds).
    ddp::CheckpointState state;
    state.put_int("ddp.step", r + 1);
    for (int i = 0; i < 16; ++i) state.put("model/layer" + std::to_string(i), layers[i]);
    const auto start = std::chrono::steady_clock::now();
    const std::string path = manager.save(r + 1, state);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, seconds);
    bytes = std::filesystem::file_size(path);
  }
  std::printf("bytes=%ju best_seconds=%.4f mb_per_s=%.1f\n", bytes, best,
              static_cast<double>(bytes) / 1048576.0 / best);
  return 0;
}
