// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// all_gather over ("model", "data") of a value that does not vary over "model": pvary first.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh_t::mask_of<"data">();
constexpr axis_mask M = mesh_t::mask_of<"model">();

int main() {
  spmd(mesh_t{2, 2}, [] {
    local_tensor<float, 1, mesh_t, D> x;
    (void)all_gather<axis_group<"model", "data">, 0>(x);
  });
}
