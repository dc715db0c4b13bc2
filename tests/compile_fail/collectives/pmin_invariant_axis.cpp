// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// pmin over an axis the value does not vary over: already equal on that axis.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh_t::mask_of<"data">();
constexpr axis_mask M = mesh_t::mask_of<"model">();

int main() {
  spmd(mesh_t{2, 2}, [] {
    local_tensor<float, 1, mesh_t, D> x;
    (void)pmin<"model">(x);
  });
}
