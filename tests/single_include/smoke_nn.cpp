// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Trains a tiny model (4 -> 8 -> 3 MLP, data x tensor parallel on a (2, 2) mesh of thread devices)
// for three SGD steps on one fixed batch and prints each loss. Built twice: against
// single_include/meshlib_nn.hpp alone (single_include_nn_smoke), and against include/ (the same
// source, meshlib::meshlib): the test requires both to print the same losses, bit for bit, so the
// single header is the library, and the losses to fall (it trains).
#if defined(MESHLIB_SMOKE_SINGLE_HEADER)
#include <meshlib_nn.hpp>
#ifndef MESHLIB_SINGLE_INCLUDE_MESHLIB_NN_HPP
#error "this must be the generated single header single_include/meshlib_nn.hpp"
#endif
#if __has_include(<meshlib/core/mesh.hpp>)
#error "include/ must not be on this program's include path"
#endif
#else
#include <meshlib.hpp>
#include <meshlib/nn.hpp>
#endif

#include <cstdint>
#include <cstdio>
#include <span>
#include <utility>
#include <vector>

namespace {

int run() {
  namespace nn = meshlib::nn;
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  constexpr std::size_t features = 4, hidden = 8, classes = 3, rows = 8;
  const mesh_t m{2, 2};
  const nn::rng_key key{7};
  nn::sequential net(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                     nn::row_dense<float, mesh_t>(m, "fc2", hidden, classes, key));
  nn::train_state state(m, std::move(net), nn::sgd(nn::constant(0.5f), 0.0f));

  // Class = the index of the largest of the first three features (a learnable rule).
  std::vector<float> x(rows * features);
  std::vector<std::int32_t> y(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t f = 0; f < features; ++f) x[r * features + f] = static_cast<float>((r * 7 + f * 3) % 5) - 2.0f;
    std::size_t best = 0;
    for (std::size_t c = 1; c < classes; ++c)
      if (x[r * features + c] > x[r * features + best]) best = c;
    y[r] = static_cast<std::int32_t>(best);
  }

  double losses[3] = {};
  for (double& loss : losses) loss = nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(y), rows, 0, rows).loss;
  std::printf("losses %.17g %.17g %.17g\n", losses[0], losses[1], losses[2]);
  if (!(losses[0] > 0.0) || !(losses[2] < losses[0])) {
    std::puts("single header nn: the loss did not fall");
    return 1;
  }
  std::puts("single header nn OK");
  return 0;
}

}  // namespace

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  return run();
}
