// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// shard_map function returning something that is not a local_tensor.
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"

using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;

int main() {
  mesh_t m{2, 2};
  auto x = zeros<float>(named_sharding<mesh_t, P<"data">>{m}, std::array<std::size_t, 2>{4, 4});
  auto f = shard_map([](auto) { return 1.0f; }, m, P<"data">{}, P<"data">{});
  (void)f(x);
}
