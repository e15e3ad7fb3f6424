// How the Trainer keeps a model and its optimizer in a CheckpointState (model_state.h).

#include "model_state.h"

#include <torch/version.h>

#include <sstream>

#include "ddp/error.h"

namespace ddp {
namespace {

#if TORCH_VERSION_MAJOR >= 2
using StateKey = void*;  // 2.x keys optimizer state by the parameter's TensorImpl pointer
StateKey state_key(const torch::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
using StateKey = std::string;  // 1.x: the pointer printed as a string
StateKey state_key(const torch::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }
#endif

std::string group_key(size_t g) { return "optimizer/group/" + std::to_string(g) + "/"; }
std::string param_key(size_t g, size_t i) {
  return group_key(g) + "param/" + std::to_string(i) + "/";
}

}  // namespace

void save_model(torch::nn::Module& model, CheckpointState& state) {
  for (const auto& item : model.named_parameters()) state.put("model/" + item.key(), item.value());
  for (const auto& item : model.named_buffers()) state.put("model/" + item.key(), item.value());
}

void load_model(torch::nn::Module& model, const CheckpointState& state) {
  torch::NoGradGuard no_grad;
  size_t used = 0;
  auto load = [&](const std::string& name, torch::Tensor& target) {
    const std::string key = "model/" + name;
    if (!state.contains(key)) throw CheckpointError("it has no parameter or buffer '" + name + "'");
    const torch::Tensor& saved = state.tensor(key);
    if (saved.sizes() != target.sizes() || saved.scalar_type() != target.scalar_type()) {
      std::ostringstream msg;
      msg << "'" << name << "' is " << saved.sizes() << " " << saved.dtype() << " there, "
          << target.sizes() << " " << target.dtype() << " here";
      throw CheckpointError(msg.str());
    }
    target.copy_(saved);
    ++used;
  };
  for (auto& item : model.named_parameters()) load(item.key(), item.value());
  for (auto& item : model.named_buffers()) load(item.key(), item.value());
  const size_t saved = state.keys("model/").size();
  if (saved != used) {
    throw CheckpointError("it has " + std::to_string(saved - used) +
                          " parameters/buffers this model does not have");
  }
}

void save_optimizer(torch::optim::Optimizer& optimizer, CheckpointState& state) {
  auto* sgd = dynamic_cast<torch::optim::SGD*>(&optimizer);
  if (sgd == nullptr) {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    state.put_bytes("optimizer/torch_archive", bytes.str());
    return;
  }
  state.put_bytes("optimizer/type", "sgd");
  const auto& groups = sgd->param_groups();
  state.put_int("optimizer/groups", static_cast<int64_t>(groups.size()));
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(groups[g].options());
    state.put_double(group_key(g) + "lr", o.lr());
    state.put_double(group_key(g) + "momentum", o.momentum());
    state.put_double(group_key(g) + "dampening", o.dampening());
    state.put_double(group_key(g) + "weight_decay", o.weight_decay());
    state.put_int(group_key(g) + "nesterov", o.nesterov() ? 1 : 0);
    state.put_int(group_key(g) + "params", static_cast<int64_t>(groups[g].params().size()));
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      auto found = sgd->state().find(state_key(groups[g].params()[i]));
      if (found == sgd->state().end()) continue;
      const auto& ps = static_cast<const torch::optim::SGDParamState&>(*found->second);
      if (ps.momentum_buffer().defined()) {
        state.put(param_key(g, i) + "momentum_buffer", ps.momentum_buffer());
      }
    }
  }
}

void load_optimizer(torch::optim::Optimizer& optimizer, const CheckpointState& state) {
  auto* sgd = dynamic_cast<torch::optim::SGD*>(&optimizer);
  if (state.contains("optimizer/torch_archive")) {
    if (sgd != nullptr) throw CheckpointError("it holds a non-SGD optimizer's state, this is SGD");
    const std::string& bytes = state.get_bytes("optimizer/torch_archive");
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size());
    optimizer.load(archive);
    return;
  }
  if (state.get_bytes("optimizer/type") != "sgd" || sgd == nullptr) {
    throw CheckpointError("it holds SGD state, this optimizer is not SGD");
  }
  auto& groups = sgd->param_groups();
  if (state.get_int("optimizer/groups") != static_cast<int64_t>(groups.size())) {
    throw CheckpointError("it has " + std::to_string(state.get_int("optimizer/groups")) +
                          " optimizer parameter groups, this optimizer has " +
                          std::to_string(groups.size()));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (state.get_int(group_key(g) + "params") != static_cast<int64_t>(groups[g].params().size())) {
      throw CheckpointError("optimizer parameter group " + std::to_string(g) +
                            " has a different number of parameters");
    }
    auto& o = static_cast<torch::optim::SGDOptions&>(groups[g].options());
    o.lr(state.get_double(group_key(g) + "lr"));
    o.momentum(state.get_double(group_key(g) + "momentum"));
    o.dampening(state.get_double(group_key(g) + "dampening"));
    o.weight_decay(state.get_double(group_key(g) + "weight_decay"));
    o.nesterov(state.get_int(group_key(g) + "nesterov") != 0);
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const auto& p = groups[g].params()[i];
      const std::string key = param_key(g, i) + "momentum_buffer";
      if (!state.contains(key)) {
        sgd->state().erase(state_key(p));
        continue;
      }
      const torch::Tensor& saved = state.tensor(key);
      if (saved.sizes() != p.sizes()) {
        throw CheckpointError("momentum buffer of optimizer parameter " + std::to_string(i) +
                              " of group " + std::to_string(g) + " has another shape");
      }
      auto ps = std::make_unique<torch::optim::SGDParamState>();
      ps->momentum_buffer(saved.to(p.device()).clone());  // own memory, not the file buffer
      sgd->state()[state_key(p)] = std::move(ps);
    }
  }
}

std::unordered_set<std::string> update_only_keys(torch::nn::Module& model, const CheckpointState& state) {
  std::unordered_set<std::string> parameters;
  for (const auto& item : model.named_parameters()) parameters.insert("model/" + item.key());
  static const std::string momentum = "/momentum_buffer";
  std::unordered_set<std::string> keys;
  for (const auto& e : state.entries()) {
    if (e.kind != CheckpointState::Kind::kTensor || !e.tensor.device().is_cpu()) continue;
    const bool is_momentum = e.key.rfind("optimizer/", 0) == 0 && e.key.size() > momentum.size() &&
                             e.key.compare(e.key.size() - momentum.size(), momentum.size(), momentum) == 0;
    if (is_momentum || parameters.count(e.key)) keys.insert(e.key);
  }
  return keys;
}

}  // namespace ddp
