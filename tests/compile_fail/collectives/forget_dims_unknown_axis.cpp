// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// forget_dims naming an axis the mesh lacks.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh_t::mask_of<"data">();
constexpr axis_mask M = mesh_t::mask_of<"model">();

int main() {
  spmd(mesh_t{2, 2}, [] {
    local_tensor<float, 1, mesh_t, D> x;
    (void)forget_dims<"modle">(x);
  });
}
