// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Gradients computed in float16 reduced in bfloat16 would silently drop 3 mantissa bits:
// train_state must refuse the pair at compile time, naming both types.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using net_t = meshlib::nn::sequential<meshlib::nn::dense<float, mesh_t>>;

using compute_t = meshlib::float16;  // GCC 12+ / Clang 15+ on x86-64 and AArch64 (MESHLIB_HAS_FLOAT16)

int main() {
  const mesh_t m{1};
  meshlib::nn::train_state<mesh_t, net_t, "data", meshlib::bfloat16, compute_t> s(
      m, net_t(meshlib::nn::dense<float, mesh_t>(m, "fc", 2, 2, meshlib::nn::rng_key{0})), meshlib::nn::sgd(meshlib::nn::constant(0.1f)));
  return static_cast<int>(s.step);
}
