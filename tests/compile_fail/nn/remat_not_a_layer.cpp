// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// remat of something that has no forward(x) and backward(dy, need_dx): one error from remat naming
// the wrapped type and the input, not errors from deep inside sequential or train_step.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>
#include <span>
#include <vector>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

struct learning_rate_table {  // not a layer: a user's mistake
  float values[4] = {};
};

int main() {
  const mesh_t m{1, 1};
  nn::train_state state(m,
                        nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1}),
                                       nn::remat(m, learning_rate_table{})),
                        nn::sgd(nn::constant(0.1f)), {});
  std::vector<float> x(64);
  std::vector<std::int32_t> labels(8);
  nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(labels), 8, 0, 8);
}
