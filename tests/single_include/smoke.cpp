// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Built against single_include/meshlib.hpp alone (include/ is not on the include path).
#include <Kokkos_Core.hpp>
#include <meshlib.hpp>

#include <cstdio>
#include <vector>

#ifndef MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
#error "this must be the generated single header, not include/meshlib.hpp"
#endif
#if __has_include(<meshlib/core/mesh.hpp>)
#error "include/ must not be on this program's include path"
#endif

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  const mesh_t m{2, 3};
  // Row-major over (data, model): device 4 = (1, 1); its "data" group is {1, 4}.
  const bool mesh_ok = m.size() == 6 && m.device_at({1, 1}) == 4 &&
                       m.group<"data">(4) == std::vector<std::size_t>{1, 4} &&
                       m.group<"model">(4) == std::vector<std::size_t>{3, 4, 5};
  // Rows over "data": device 4 holds the second of two row shards; columns are replicated.
  const meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>> s{m};
  const bool sharding_ok = s.num_shards(0) == 2 && s.num_shards(1) == 1 && s.shard_index(4, 0) == 1;
  if (!mesh_ok || !sharding_ok) {
    std::printf("single header: wrong results (mesh %d, sharding %d)\n", mesh_ok, sharding_ok);
    return 1;
  }
  std::puts("single header OK");
  return 0;
}
