// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A parallel policy over an axis of the mesh that is not the train_state's own (the state spelled
// with its default data axis "data", the policy over "dp"): one error from train_state naming the
// requirement and the fix (let the constructor deduce the state's type), at compile time.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"dp">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1};
  auto net = nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1}));
  nn::train_state<mesh_t, decltype(net)> state(m, std::move(net), nn::sgd(nn::constant(0.1f)),
                                               nn::data_parallel<"dp">{});
  (void)state;
}
