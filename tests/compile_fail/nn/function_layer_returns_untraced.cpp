// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A function_layer whose forward computes with meshlib:: operations on the primals, so it returns a
// plain local_tensor the tape never saw (no backward could be derived): one error from
// function_layer naming the forward function and the type it returned, and saying the fix, not
// errors from deep inside sequential or train_step.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>
#include <span>
#include <vector>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using w_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, meshlib::none>>;
namespace nn = meshlib::nn;

int main() {
  const mesh_t m{1};
  auto untraced_dense = nn::function_layer(
      m, "fc1",
      [](const auto& x, const auto& w) { return meshlib::matmul(x.primal(), w.primal()); },  // the mistake
      nn::parameter<float, 2, w_s>("fc1.w", w_s{m}, {8, 4}, nn::rng_key{1}, nn::init::uniform(0.5f)));
  nn::train_state state(m, nn::sequential(std::move(untraced_dense)), nn::sgd(nn::constant(0.1f)), {});
  std::vector<float> x(64);
  std::vector<std::int32_t> labels(8);
  nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(labels), 8, 0, 8);
}
