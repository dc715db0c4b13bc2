// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// all_gather over an axis the value does not vary over.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh_t::mask_of<"data">();
constexpr axis_mask M = mesh_t::mask_of<"model">();

int main() {
  spmd(mesh_t{2, 2}, [] {
    local_tensor<float, 2, mesh_t, D, 0, dim_masks<D, 0>> x;
    (void)all_gather<"model", 1>(x);
  });
}
