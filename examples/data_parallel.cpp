// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// data_parallel: data-parallel training with gradient averaging by `pmean`, the pattern of JAX's
// "data parallelism" tutorials. The batch is split over axis "data"; the weights are replicated.
// Every device computes the gradient of the mean-squared error on its shard of the batch, and
// `pmean<"data">` averages the gradients, so that every device applies the same update and the
// weights stay replicated (the type says so: the update is invariant over "data").
//
// Linear regression y = X w, loss = mean((X w - y)^2), gradient = 2/N X^T (X w - y).
#include <meshlib.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <iostream>
#include <tuple>
#include <vector>

namespace {
int run() {
  using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
  const mesh_t mesh{4};
  constexpr std::size_t n = 64, f = 3, steps = 200;
  constexpr double lr = 0.5;

  // A batch whose exact solution is w* = (1, -2, 0.5).
  const std::array<double, f> w_true{1.0, -2.0, 0.5};
  std::vector<double> xs(n * f), ys(n);
  for (std::size_t i = 0; i < n; ++i) {
    double y = 0;
    for (std::size_t j = 0; j < f; ++j) {
      xs[i * f + j] = std::cos(0.9 * static_cast<double>((j + 1) * i) + static_cast<double>(j));
      y += xs[i * f + j] * w_true[j];
    }
    ys[i] = y;
  }
  const auto X = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{mesh}, std::array<std::size_t, 2>{n, f}, xs);
  const auto Y = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{mesh}, std::array<std::size_t, 2>{n, 1}, ys);
  const auto W0 = meshlib::zeros<double>(meshlib::named_sharding<mesh_t, meshlib::P<>>{mesh}, std::array<std::size_t, 2>{f, 1});

  auto train = meshlib::shard_map(
      [&](auto x, auto y, auto w) {
        const double local_rows = static_cast<double>(x.extent(0));
        auto grad = [&](const auto& w_now) {
          auto residual = meshlib::matmul(x, w_now) - y;  // (n/4, 1), varies over data
          // X_b^T r_b contracts the sharded batch dimension: a pending sum over "data" in the type.
          auto local = meshlib::matmul(meshlib::transpose(x), residual) * (2.0 / local_rows);
          return meshlib::pmean<"data">(local);  // the average of the devices' gradients: replicated
        };
        auto first = grad(w);
        for (std::size_t s = 0; s < steps; ++s) w = w - grad(w) * lr;
        return std::make_tuple(w, first);
      },
      mesh, meshlib::specs<meshlib::P<"data">, meshlib::P<"data">, meshlib::P<>>{},
      meshlib::specs<meshlib::P<>, meshlib::P<>>{});
  const auto [W, G0] = train(X, Y, W0);

  // The full-batch gradient at w = 0, on the host: 2/N X^T (0 - y).
  const auto g0 = meshlib::to_host(G0);
  const auto w = meshlib::to_host(W);
  bool ok = true;
  for (std::size_t j = 0; j < f; ++j) {
    double g = 0;
    for (std::size_t i = 0; i < n; ++i) g += xs[i * f + j] * (0.0 - ys[i]);
    g *= 2.0 / static_cast<double>(n);
    if (std::abs(g - g0[j]) > 1e-12 * (1 + std::abs(g))) ok = false;
  }
  // And training reproduces the same steps on the host.
  std::array<double, f> wh{};
  for (std::size_t s = 0; s < steps; ++s) {
    std::array<double, f> g{};
    for (std::size_t i = 0; i < n; ++i) {
      double r = -ys[i];
      for (std::size_t j = 0; j < f; ++j) r += xs[i * f + j] * wh[j];
      for (std::size_t j = 0; j < f; ++j) g[j] += 2.0 / static_cast<double>(n) * xs[i * f + j] * r;
    }
    for (std::size_t j = 0; j < f; ++j) wh[j] -= lr * g[j];
  }
  for (std::size_t j = 0; j < f; ++j)
    if (std::abs(wh[j] - w[j]) > 1e-9) ok = false;
  // The batch was generated from w_true, so training must recover it.
  for (std::size_t j = 0; j < f; ++j)
    if (std::abs(w[j] - w_true[j]) > 1e-6) ok = false;

  std::cout << "data_parallel: 4 devices, batch " << n << " split over 'data'\n  averaged gradient at w=0:";
  for (double g : g0) std::cout << ' ' << g;
  std::cout << "\n  w after " << steps << " steps:";
  for (double v : w) std::cout << ' ' << v;
  std::cout << "\n  (host reference:";
  for (double v : wh) std::cout << ' ' << v;
  std::cout << ")\n";
  if (!ok) {
    std::cout << "FAILED: the averaged gradient or the trained weights differ from the host reference or from w_true\n";
    return 1;
  }
  std::cout << "OK: pmean of the local gradients is the full-batch gradient, and training recovers w_true = (1, -2, 0.5)\n";
  return 0;
}
}  // namespace

int main(int argc, char* argv[]) {
  // Kokkos lives for the whole program; every view above is gone when run() returns.
  Kokkos::ScopeGuard kokkos(argc, argv);
  return run();
}
