// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A parallel policy over an axis the mesh does not have: one error from train_state naming the
// requirement and the fix, at compile time (the policy's axis and the mesh's are both in the types).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), nn::data_parallel<"data">{}, nn::fully_shard<"fsdp">{});
  (void)state;
}
