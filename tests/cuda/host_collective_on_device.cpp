// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check, must NOT compile (scripts/cuda_compile_check.sh checks the message): a psum
// over blocks in device memory through the thread runner, whose communicator reads host memory.
// The error says which backend to use.
#include <meshlib.hpp>

#include <array>
#include <vector>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
  const mesh_t mesh{2};
  const meshlib::named_sharding<mesh_t, meshlib::P<"data">> rows{mesh};
  std::vector<float> host(8, 1.0f);
  const auto x = meshlib::from_host(rows, std::array<std::size_t, 1>{8}, host);
  auto f = meshlib::shard_map([](auto block) { return meshlib::psum<"data">(block); }, mesh, meshlib::P<"data">{},
                              meshlib::P<>{});
  return meshlib::to_host(f(x)).empty() ? 1 : 0;
}
