// How the Trainer keeps a model and its optimizer in a CheckpointState: the keys, the raw
// tensors, and which of them only an optimizer step changes. Private to the SDK: not an
// installed header.
#pragma once

#include <torch/torch.h>

#include <string>
#include <unordered_set>

#include "ddp/checkpoint.h"

namespace ddp {

// Parameters and buffers as raw tensors under "model/<name>".
void save_model(torch::nn::Module& model, CheckpointState& state);
// Throws CheckpointError naming what does not match (a missing or extra key, a shape or dtype).
void load_model(torch::nn::Module& model, const CheckpointState& state);

// SGD (the common case) as raw tensors under "optimizer/": options per group and each
// parameter's momentum buffer; any other optimizer as its own torch::serialize archive.
void save_optimizer(torch::optim::Optimizer& optimizer, CheckpointState& state);
void load_optimizer(torch::optim::Optimizer& optimizer, const CheckpointState& state);

// Keys of the CPU tensors of `state` (save_model's and save_optimizer's) that only an optimizer
// step changes: the model's parameters and SGD's momentum buffers. Buffers such as running
// statistics change in every forward.
std::unordered_set<std::string> update_only_keys(torch::nn::Module& model, const CheckpointState& state);

}  // namespace ddp
