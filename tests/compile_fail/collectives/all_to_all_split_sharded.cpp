// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// all_to_all over "model" splitting dim 0, which is already sharded on it.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh_t::mask_of<"data">();
constexpr axis_mask M = mesh_t::mask_of<"model">();

int main() {
  spmd(mesh_t{2, 2}, [] {
    local_tensor<float, 2, mesh_t, D | M, 0, dim_masks<M, 0>> x;
    (void)all_to_all<"model", 0, 1>(x);
  });
}
