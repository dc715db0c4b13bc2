// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// data_parallel's second axis is not an axis of the mesh: one error from train_state naming the
// policy, that axis and the mesh's axes, at compile time.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), nn::data_parallel<"data", "fsdp">{});
  (void)state;
}
