// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The same parallelism given twice (two pipelines, over two axes): one error from train_state; the
// compiler names both policies in its context.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"a">, meshlib::axis<"b">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1, 1, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), nn::pipeline<"a">{}, nn::pipeline<"b">{});
  (void)state;
}
