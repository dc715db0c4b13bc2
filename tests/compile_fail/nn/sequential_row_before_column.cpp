// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A row_dense before a column_dense (the tensor-parallel pair in the wrong order), trained as a user
// does: the row_dense needs its features sharded over "model" but receives the network input, whose
// features are complete. One error from sequential naming the layer, what it receives and what it
// needs, instead of three from inside matmul.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>
#include <span>
#include <vector>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{2, 2};
  const nn::rng_key key{1};
  nn::train_state state(m, nn::sequential(nn::row_dense<float, mesh_t>(m, "fc1", 8, 16, key), nn::relu<float>(m),
                                          nn::column_dense<float, mesh_t>(m, "fc2", 16, 4, key)),
                        nn::sgd(nn::constant(0.1f)), {});
  std::vector<float> x(64);
  std::vector<std::int32_t> y(8);
  nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(y), 8, 0, 8);
}
