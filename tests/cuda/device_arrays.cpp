// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): meshlib's typed layer on device memory. With
// Kokkos CUDA, every block below lives in CudaSpace: creation from a host array, shard_map with
// element-wise kernels, transposes, a product into a caller's buffer, and the copy back. Compiled
// for sm_90 with nvcc; not run (no GPU in CI).
#include <meshlib.hpp>

#include <array>
#include <cstddef>
#include <vector>

static_assert(!meshlib::tensor::detail::host_accessible_v<meshlib::default_memory_space>,
              "the CUDA compile check must compile for device memory: Kokkos was not configured with CUDA");

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  const mesh_t mesh{2, 2};
  const meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>> rows{mesh};
  std::vector<float> host(8 * 4, 1.0f);
  const auto x = meshlib::from_host(rows, std::array<std::size_t, 2>{8, 4}, host);
  auto f = meshlib::shard_map(
      [](auto block) {
        auto y = block * 2.0f + 1.0f;
        auto t = meshlib::transpose(y);  // (4, rows) on the device
        // y y^T would shard both result dimensions over "data": refused at compile time (tested
        // on the host); y^T y sums over the rows, a product on the device's own block.
        // Row-major as the blocks: the product goes to cuBLAS where meshlib has it (MESHLIB_ENABLE_CUBLAS).
        Kokkos::View<float**, Kokkos::LayoutRight> g("g", 4, 4);
        meshlib::matmul_into(g, t.view(), y.view(), {.alpha = 0.5f, .beta = 0.0f});
        return meshlib::transpose(t);
      },
      mesh, meshlib::P<"data", meshlib::none>{}, meshlib::P<"data", meshlib::none>{});
  const auto y = f(x);
  const std::vector<float> back = meshlib::to_host(y);
  return back.empty() ? 1 : 0;
}
