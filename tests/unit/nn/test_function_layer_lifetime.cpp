// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A function_layer's output outlives the next layer's backward (built under AddressSanitizer too,
// run there with MESHLIB_NO_BLAS=1 so that the reads are instrumented code's):
// the output is a tensor of the layer's tape, which the dense layer after it keeps only an
// unmanaged view of; freed early, that layer's backward read released memory (a NaN gradient in a
// few runs of docs/autodiff.md's example before the fix, every run under AddressSanitizer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {
namespace {
namespace nn = meshlib::nn;
using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using w_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, meshlib::none>>;
using b_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none>>;
}  // namespace

TEST_CASE("a function_layer's output stays valid until the backward of the layer after it", "[nn][autodiff]") {
  const mesh_t m{2};
  const nn::rng_key key{1};
  auto relu_layer = nn::function_layer(
      m, "fc1",
      [](const auto& x, const auto& w, const auto& b) {
        auto xw = nn::matmul(x, w);
        return nn::maximum(xw + nn::broadcast_in_dim<0>(b, xw), 0.0f);
      },
      nn::parameter<float, 2, w_s>("fc1.w", w_s{m}, {4, 16}, key, nn::init::uniform(0.5f)),
      nn::parameter<float, 1, b_s>("fc1.b", b_s{m}, {16}, key, nn::init::zeros(), false));
  auto net = nn::sequential(std::move(relu_layer), nn::dense<float, mesh_t>(m, "fc2", 16, 2, key));
  nn::train_state state(m, std::move(net), nn::adam(nn::constant(1e-2f)), {});
  const std::size_t rows = 64;
  std::vector<float> x(rows * 4);
  std::vector<std::int32_t> y(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    for (std::size_t f = 0; f < 4; ++f) x[i * 4 + f] = static_cast<float>(std::sin(0.7 * static_cast<double>(i * 4 + f)));
    y[i] = x[i * 4] > x[i * 4 + 1] ? 1 : 0;
  }
  std::vector<double> norms;
  for (int step = 0; step < 20; ++step)
    norms.push_back(nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(y), rows, 0, rows).grad_norm);
  for (double n : norms) CHECK(std::isfinite(n));
}

}  // namespace MESHLIB_TEST_UNIT
