// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// fully_shard of a model that is not a sequential (here one dense layer, no layers to shard one
// after another): one error from train_state naming the requirement and the fix (wrap the layers
// in nn::sequential), at compile time (whether the model is a sequential is in its type).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1};
  nn::train_state state(m, nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1}), nn::sgd(nn::constant(0.1f)),
                        nn::fully_shard<"fsdp">{});
  (void)state;
}
