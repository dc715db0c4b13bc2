// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// quickstart: the vocabulary of meshlib in one screen. Eight devices in a 2 x 4 mesh with axes
// "data" and "model"; an 8 x 6 array whose rows are split over "data" and replicated over "model"
// (JAX: NamedSharding(mesh, P("data", None))); and which block of it every device holds.
#include <meshlib.hpp>

#include <array>
#include <cstddef>
#include <iostream>

int main() {
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  const mesh_t mesh{2, 4};

  using rows_over_data = meshlib::P<"data", meshlib::none>;
  const meshlib::named_sharding<mesh_t, rows_over_data> sharding{mesh};
  const meshlib::shard_layout layout{sharding, std::array<std::size_t, 2>{8, 6}};

  std::cout << sharding << "\n\n";
  std::cout << "device  coords  block          replicas\n";
  for (std::size_t device = 0; device < mesh.size(); ++device) {
    const auto c = mesh.coords(device);
    std::cout << "  " << device << "     (" << c[0] << ", " << c[1] << ")  " << layout.block_of(device) << "   ";
    for (std::size_t r : layout.replicas(device)) std::cout << ' ' << r;
    std::cout << '\n';
  }
  return 0;
}
