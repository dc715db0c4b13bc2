// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Integer class labels given to the regression loss: mean_squared_error takes float targets, one
// per output column. One error from train_step naming the loss, both element types and the fix.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>
#include <span>
#include <vector>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{2, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), {});
  std::vector<float> x(64);
  std::vector<std::int32_t> labels(8);
  nn::train_step(state, std::span<const float>(x), labels, 8, 0, 8, nn::mean_squared_error{});
}
