// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// pmap_affine: the first pattern of JAX's parallelism tutorials, `pmap(lambda x: x * 2 + 1)`,
// written with meshlib: one axis over every device, an array split over it, the function applied
// by every device to its own block, and the blocks assembled back into one array.
//
// JAX:
//   mesh = jax.make_mesh((8,), ('devices',))
//   f = shard_map(lambda b: b * 2 + 1, mesh=mesh, in_specs=P('devices'), out_specs=P('devices'))
//   y = f(jnp.arange(32.0))
#include <meshlib.hpp>

#include <array>
#include <cstddef>
#include <iostream>
#include <vector>

namespace {
int run() {
  using mesh_t = meshlib::mesh<meshlib::axis<"devices">>;
  const mesh_t mesh{8};
  const meshlib::named_sharding<mesh_t, meshlib::P<"devices">> sharding{mesh};

  std::vector<float> host(32);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
  const auto x = meshlib::from_host(sharding, std::array<std::size_t, 1>{32}, host);

  // Each device sees its 4-element block, typed as varying over "devices".
  auto f = meshlib::shard_map([](auto block) { return block * 2.0f + 1.0f; }, mesh, meshlib::P<"devices">{},
                              meshlib::P<"devices">{});
  const auto y = f(x);

  const std::vector<float> got = meshlib::to_host(y);
  int wrong = 0;
  for (std::size_t i = 0; i < host.size(); ++i)
    if (got[i] != host[i] * 2.0f + 1.0f) ++wrong;
  std::cout << "pmap_affine: " << y << "\n  y[0:8] =";
  for (std::size_t i = 0; i < 8; ++i) std::cout << ' ' << got[i];
  std::cout << "\n  device 3 holds " << y.block_of(3) << "\n";
  if (wrong) {
    std::cout << "FAILED: " << wrong << " wrong elements\n";
    return 1;
  }
  std::cout << "OK: every element is x * 2 + 1\n";
  return 0;
}
}  // namespace

int main(int argc, char* argv[]) {
  // Kokkos lives for the whole program; every view above is gone when run() returns.
  Kokkos::ScopeGuard kokkos(argc, argv);
  return run();
}
