#include <ddp/worker_sdk.h>

#include <iostream>

int main() {
  auto group = ddp::ProcessGroup::from_environment();
  auto model = torch::nn::Linear(4, 2);
  auto optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  ddp::TrainerOptions options;
  options.batch_size = 8;
  options.log_every = 0;
  ddp::TensorDataset data{torch::randn({32, 4}), torch::randint(2, {32}, torch::kLong)};
  ddp::Trainer trainer(group, model.ptr(), optimizer, data,
                       [&](const torch::Tensor& x, const torch::Tensor& y) {
                         return torch::nn::functional::cross_entropy(model->forward(x), y);
                       },
                       options);
  auto result = trainer.fit();
  std::cout << "consumer: world size " << group->world_size() << ", trained " << result.steps
            << " steps" << std::endl;
  // 32 samples in batches of 8, split among the ranks.
  return result.steps == 32 / (8 * group->world_size()) ? 0 : 1;
}
