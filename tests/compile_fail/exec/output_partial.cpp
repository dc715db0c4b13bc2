// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// shard_map output that is a pending sum over "model".
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;

int main() {
  mesh_t m{2, 2};
  auto x = zeros<float>(named_sharding<mesh_t, P<"data">>{m}, std::array<std::size_t, 2>{4, 4});
  auto f = shard_map(
      [](auto b) {
        using partial_t = local_tensor<float, 2, mesh_t, mesh_t::mask_of<"data">(), mesh_t::mask_of<"model">(),
                                       dim_masks<mesh_t::mask_of<"data">(), 0>>;
        return partial_t(b.shape(), b.mesh(), b.device());
      },
      m, P<"data">{}, P<"data">{});
  (void)f(x);
}
