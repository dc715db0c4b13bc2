// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// data_parallel over two axes beside fully_shard: the batch would be split over three axes (a
// train_state splits it over at most two, fully_shard's axis one of them): one error from
// train_state naming the requirement and the fix (HSDP is data_parallel<"data"> with fully_shard).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"replica">, meshlib::axis<"fsdp">>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1, 1, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), nn::data_parallel<"data", "replica">{}, nn::fully_shard<"fsdp">{});
  (void)state;
}
