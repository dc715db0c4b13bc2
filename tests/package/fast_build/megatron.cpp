// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The 40-line shard_map program of docs/fast-builds.md's timings: a Megatron pair (column-parallel
// matmul, relu, row-parallel matmul, one psum) on a (2, 2) mesh, checked against the host.
#include <meshlib.hpp>

#include <array>
#include <cmath>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  using meshlib::none, meshlib::P;
  const mesh_t mesh{2, 2};
  constexpr std::size_t B = 4, D = 2, H = 4;
  const std::vector<float> xh(B * D, 1.0f), w1h(D * H, 0.5f), w2h(H * D, 0.25f);
  const auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, P<"data", none>>{mesh}, std::array{B, D}, xh);
  const auto w1 = meshlib::from_host(meshlib::named_sharding<mesh_t, P<none, "model">>{mesh}, std::array{D, H}, w1h);
  const auto w2 = meshlib::from_host(meshlib::named_sharding<mesh_t, P<"model", none>>{mesh}, std::array{H, D}, w2h);
  auto mlp = meshlib::shard_map(
      [](auto xb, auto w1b, auto w2b) {
        const auto h = meshlib::map([](float v) { return v > 0.0f ? v : 0.0f; }, meshlib::matmul(xb, w1b));
        return meshlib::psum<"model">(meshlib::matmul(h, w2b));  // h @ W2 is a pending sum over "model"
      },
      mesh, meshlib::specs<P<"data", none>, P<none, "model">, P<"model", none>>{}, P<"data", none>{});
  const std::vector<float> y = meshlib::to_host(mlp(x, w1, w2));
  // Every h = relu(1 * 0.5 * 2) = 1, every y = 4 * 1 * 0.25 = 1.
  int wrong = 0;
  for (float v : y) wrong += std::abs(v - 1.0f) > 1e-6f;
  std::printf("megatron pair on %s: %zu values, %d wrong\n", mesh.to_string().c_str(), y.size(), wrong);
  return wrong == 0 ? 0 : 1;
}
