// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A typo in a shard_map in-spec ("modle"): one error naming the axis, the spec and the mesh's axes.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;

int main() {
  mesh_t m{2, 2};
  auto x = zeros<float>(named_sharding<mesh_t, P<"data">>{m}, std::array<std::size_t, 2>{4, 4});
  auto f = shard_map([](auto b) { return b; }, m, P<"modle">{}, P<"data">{});
  (void)f(x);
}
