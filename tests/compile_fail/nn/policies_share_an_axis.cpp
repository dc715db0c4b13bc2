// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Two parallel policies over one mesh axis (data parallelism and FSDP both on "data"): one error from
// train_state naming the requirement and the fix; the compiler names both policies in its context.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), nn::data_parallel<"data">{}, nn::fully_shard<"data">{});
  (void)state;
}
