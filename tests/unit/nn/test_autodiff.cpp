// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// nn::value_and_grad / nn::grad (include/meshlib/nn/autodiff/): gradients of small programs
// against hand-derived formulas, and of programs mixing every differentiable collective against
// central finite differences of the loss, over a 1-D mesh of 4 devices and a 2x2 mesh. Each
// device's gradient is compared with the finite difference of the global element its block holds,
// so the gradients are checked to come back sharded like the inputs; and inside shard_map, global
// arrays in and the gradients assembled by its out_specs.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

namespace nn = meshlib::nn;

using mesh1 = meshlib::mesh<meshlib::axis<"x">>;
constexpr meshlib::axis_mask X = mesh1::mask_of<"x">();
using rows1 = meshlib::local_tensor<double, 2, mesh1, X, 0, meshlib::dim_masks<X, 0>>;  // P<"x", none>
using vary1 = meshlib::local_tensor<double, 2, mesh1, X, 0, meshlib::dim_masks<0, 0>>;  // varying, not sharded
using repl1 = meshlib::local_tensor<double, 2, mesh1, 0, 0, meshlib::dim_masks<0, 0>>;  // P<none, none>

using mesh2 = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
constexpr meshlib::axis_mask D = mesh2::mask_of<"data">(), M = mesh2::mask_of<"model">();
using x2_t = meshlib::local_tensor<double, 2, mesh2, D | M, 0, meshlib::dim_masks<D, M>>;  // P<"data", "model">
using w2_t = meshlib::local_tensor<double, 2, mesh2, M, 0, meshlib::dim_masks<M, 0>>;      // P<"model", none>

/// A global row-major array of `rows x cols` pseudo-random values in [-1, 1] (fixed seed).
std::vector<double> random_array(std::size_t rows, std::size_t cols, unsigned seed) {
  std::vector<double> v(rows * cols);
  unsigned s = seed * 2654435761U + 12345U;
  for (auto& x : v) {
    s = s * 1664525U + 1013904223U;
    x = static_cast<double>(s >> 8) / static_cast<double>(1U << 24) * 2.0 - 1.0;
  }
  return v;
}

/// Where a device's block lies in a global 2-D array: first row, first column, and its shape.
struct block_at {
  std::size_t row, col, rows, cols, global_cols;
  [[nodiscard]] std::size_t global_index(std::size_t k) const { return (row + k / cols) * global_cols + col + k % cols; }
};

/// Device `dev`'s block of `global` as a local value of type `L`.
template <class L, class Mesh>
L block_of(const Mesh& m, std::size_t dev, const std::vector<double>& global, const block_at& b) {
  L t(std::array<std::size_t, 2>{b.rows, b.cols}, m, dev);
  for (std::size_t k = 0; k < t.size(); ++k) t.data()[k] = global[b.global_index(k)];
  return t;
}

/// Checks every device's gradient block against central differences of `loss(globals)` at the
/// global elements it holds. `grads[i][dev]` is the gradient of argument i on device `dev`,
/// `where[i](dev)` its block.
void check_against_differences(const std::function<double(const std::vector<std::vector<double>>&)>& loss,
                               std::vector<std::vector<double>> globals,
                               const std::vector<std::vector<std::vector<double>>>& grads,
                               const std::vector<std::function<block_at(std::size_t)>>& where) {
  const double h = 1e-6;
  for (std::size_t i = 0; i < globals.size(); ++i) {
    std::vector<double> numeric(globals[i].size());
    for (std::size_t e = 0; e < globals[i].size(); ++e) {
      const double keep = globals[i][e];
      globals[i][e] = keep + h;
      const double up = loss(globals);
      globals[i][e] = keep - h;
      const double down = loss(globals);
      globals[i][e] = keep;
      numeric[e] = (up - down) / (2 * h);
    }
    for (std::size_t dev = 0; dev < grads[i].size(); ++dev) {
      const block_at b = where[i](dev);
      REQUIRE(grads[i][dev].size() == b.rows * b.cols);
      for (std::size_t k = 0; k < grads[i][dev].size(); ++k) {
        INFO("argument " << i << ", device " << dev << ", local element " << k);
        CHECK(std::abs(grads[i][dev][k] - numeric[b.global_index(k)]) <= 1e-6 * (1 + std::abs(numeric[b.global_index(k)])));
      }
    }
  }
}

auto host(const auto& t) { return meshlib::to_host(t); }

}  // namespace

TEST_CASE("value_and_grad of elementwise maps and a psum matches the hand-derived gradient", "[nn][autodiff]") {
  // L = sum over the global (8, 3) array of c tanh(x) + x^2 - x / 2, rows sharded over 4 devices:
  // dL/dx = c (1 - tanh(x)^2) + 2 x - 1/2, and every device's loss is the whole sum.
  const mesh1 m{4};
  const auto gx = random_array(8, 3, 1), gc = random_array(8, 3, 2);
  double expected_loss = 0;
  for (std::size_t e = 0; e < gx.size(); ++e) expected_loss += gc[e] * std::tanh(gx[e]) + gx[e] * gx[e] - gx[e] / 2;
  auto loss_fn = [](const auto& x, const rows1& c) {
    return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::tanh(x) * c + nn::square(x) - x * 0.5)));
  };
  // Catch2's assertions are not thread-safe: the device threads record, the test thread checks.
  std::vector<double> values(4);
  std::vector<std::vector<double>> gs(4), g2s(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const block_at b{2 * dev, 0, 2, 3, 3};
    const auto x = block_of<rows1>(m, dev, gx, b), c = block_of<rows1>(m, dev, gc, b);
    auto [value, dx] = nn::value_and_grad(loss_fn)(x, c);
    static_assert(std::is_same_v<decltype(dx), rows1>, "the gradient has the argument's type");
    values[dev] = host(value)[0];
    gs[dev] = host(dx);
    g2s[dev] = host(nn::grad(loss_fn)(x, c));  // grad: the same gradient without the value
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    const block_at b{2 * dev, 0, 2, 3, 3};
    CHECK(std::abs(values[dev] - expected_loss) < 1e-12 * (1 + std::abs(expected_loss)));
    REQUIRE(gs[dev].size() == 6);
    for (std::size_t k = 0; k < 6; ++k) {
      const double xv = gx[b.global_index(k)], cv = gc[b.global_index(k)];
      CHECK(std::abs(gs[dev][k] - (cv * (1 - std::tanh(xv) * std::tanh(xv)) + 2 * xv - 0.5)) < 1e-12);
    }
    CHECK(g2s[dev] == gs[dev]);
  }
}

TEST_CASE("value_and_grad of data-parallel least squares matches X^T R and R W^T", "[nn][autodiff]") {
  // L = 1/2 sum (X W - Y)^2 with X, Y rows sharded over 4 devices, W replicated: dW = X^T R summed
  // over the devices (R = X W - Y), each device's dX = its rows of R W^T.
  const mesh1 m{4};
  const std::size_t n = 8, k = 3, o = 2;
  const auto gx = random_array(n, k, 3), gw = random_array(k, o, 4), gy = random_array(n, o, 5);
  std::vector<double> r(n * o, 0.0), dw(k * o, 0.0), dx(n * k, 0.0);
  double expected_loss = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < o; ++j) {
      double s = -gy[i * o + j];
      for (std::size_t q = 0; q < k; ++q) s += gx[i * k + q] * gw[q * o + j];
      r[i * o + j] = s;
      expected_loss += s * s / 2;
    }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t q = 0; q < k; ++q)
      for (std::size_t j = 0; j < o; ++j) {
        dw[q * o + j] += gx[i * k + q] * r[i * o + j];
        dx[i * k + q] += r[i * o + j] * gw[q * o + j];
      }
  using y_t = meshlib::local_tensor<double, 2, mesh1, X, 0, meshlib::dim_masks<X, 0>>;
  std::vector<double> values(4);
  std::vector<std::vector<double>> hws(4), hxs(4), hw1s(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, gx, {2 * dev, 0, 2, k, k});
    const auto w = block_of<repl1>(m, dev, gw, {0, 0, k, o, o});
    const auto y = block_of<y_t>(m, dev, gy, {2 * dev, 0, 2, o, o});
    auto loss_fn = [](const auto& xs, const auto& ws, const y_t& ys) {
      return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::matmul(xs, ws) - ys)))) * 0.5;
    };
    auto [value, grads] = nn::value_and_grad<0, 1>(loss_fn)(x, w, y);
    const auto& [gxs, gws] = grads;
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(gws)>, repl1>, "W's gradient is replicated, as W is");
    values[dev] = host(value)[0];
    hws[dev] = host(gws);
    hxs[dev] = host(gxs);
    hw1s[dev] = host(nn::grad<1>(loss_fn)(x, w, y));  // argnums 1 alone: W's gradient only
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    CHECK(std::abs(values[dev] - expected_loss) < 1e-12 * (1 + expected_loss));
    REQUIRE(hws[dev].size() == k * o);
    REQUIRE(hxs[dev].size() == 2 * k);
    for (std::size_t e = 0; e < k * o; ++e) CHECK(std::abs(hws[dev][e] - dw[e]) < 1e-12);
    for (std::size_t e = 0; e < 2 * k; ++e) CHECK(std::abs(hxs[dev][e] - dx[2 * dev * k + e]) < 1e-12);
    CHECK(hw1s[dev] == hws[dev]);
  }
}

TEST_CASE("value_and_grad inside shard_map: global arrays in, the gradients out as global arrays sharded like them",
          "[nn][autodiff][shard_map]") {
  // L = 1/2 sum (tanh(X W) - Y)^2 over the global batch, X and Y (4 rows) split over the 2 devices
  // of "x" by shard_map's in_specs, W replicated; the loss completed with a psum. With Z = X W and
  // G = (tanh(Z) - Y) (1 - tanh(Z)^2): dW = X^T G (summed over the devices: W is replicated) and
  // dX = G W^T, its rows on the device that holds X's; shard_map assembles both by its out_specs.
  const mesh1 m{2};
  const std::size_t n = 4, k = 3, o = 2;
  const auto gx = random_array(n, k, 41), gw = random_array(k, o, 42), gy = random_array(n, o, 43);
  std::vector<double> g(n * o), dw(k * o, 0.0), dx(n * k, 0.0);
  double expected_loss = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < o; ++j) {
      double z = 0;
      for (std::size_t q = 0; q < k; ++q) z += gx[i * k + q] * gw[q * o + j];
      const double t = std::tanh(z), r = t - gy[i * o + j];
      expected_loss += r * r / 2;
      g[i * o + j] = r * (1 - t * t);
    }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t q = 0; q < k; ++q)
      for (std::size_t j = 0; j < o; ++j) {
        dw[q * o + j] += gx[i * k + q] * g[i * o + j];
        dx[i * k + q] += g[i * o + j] * gw[q * o + j];
      }
  using rows_spec = meshlib::P<"x", meshlib::none>;
  using repl_spec = meshlib::P<meshlib::none, meshlib::none>;
  const auto X = meshlib::from_host(meshlib::named_sharding<mesh1, rows_spec>{m}, std::array<std::size_t, 2>{n, k}, gx);
  const auto W = meshlib::from_host(meshlib::named_sharding<mesh1, repl_spec>{m}, std::array<std::size_t, 2>{k, o}, gw);
  const auto Y = meshlib::from_host(meshlib::named_sharding<mesh1, rows_spec>{m}, std::array<std::size_t, 2>{n, o}, gy);
  // Catch2's assertions are not thread-safe: the device threads record, the test thread checks.
  std::vector<double> values(2);
  auto step = meshlib::shard_map(
      [&](const auto& xb, const auto& wb, const auto& yb) {
        static_assert(std::is_same_v<std::remove_cvref_t<decltype(xb)>, rows1>, "X's block: rows over x");
        static_assert(std::is_same_v<std::remove_cvref_t<decltype(wb)>, repl1>, "W's block: replicated");
        auto loss_fn = [](const auto& xs, const auto& ws, const rows1& ys) {
          return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(nn::matmul(xs, ws)) - ys)))) * 0.5;
        };
        auto [value, grads] = nn::value_and_grad<0, 1>(loss_fn)(xb, wb, yb);
        values[xb.device()] = host(value)[0];
        return std::tuple(std::get<0>(grads), std::get<1>(grads));
      },
      m, meshlib::specs<rows_spec, repl_spec, rows_spec>{}, meshlib::specs<rows_spec, repl_spec>{});
  const auto [DX, DW] = step(X, W, Y);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(DX)>, std::remove_cvref_t<decltype(X)>>,
                "dX comes back sharded as X");
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(DW)>, std::remove_cvref_t<decltype(W)>>,
                "dW comes back replicated as W");
  for (std::size_t dev = 0; dev < 2; ++dev) CHECK(std::abs(values[dev] - expected_loss) < 1e-12 * (1 + expected_loss));
  const auto hdx = DX.to_host(), hdw = DW.to_host();
  REQUIRE(hdx.size() == n * k);
  REQUIRE(hdw.size() == k * o);
  for (std::size_t e = 0; e < n * k; ++e) CHECK(std::abs(hdx[e] - dx[e]) < 1e-12);
  for (std::size_t e = 0; e < k * o; ++e) CHECK(std::abs(hdw[e] - dw[e]) < 1e-12);
  // Each device's replica of dW is the whole sum (no device kept only its rows' share).
  for (std::size_t dev = 0; dev < 2; ++dev) {
    const auto local = host(DW.local_value(dev));
    for (std::size_t e = 0; e < k * o; ++e) CHECK(std::abs(local[e] - dw[e]) < 1e-12);
  }
}

TEST_CASE("value_and_grad: an argument the loss does not use gets a zero gradient", "[nn][autodiff]") {
  const mesh1 m{4};
  std::vector<std::vector<double>> used(4), unused(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, random_array(8, 3, 6), {2 * dev, 0, 2, 3, 3});
    auto [value, grads] = nn::value_and_grad<0, 1>([](const auto& a, const auto&) {
      return nn::psum<"x">(nn::sum<0>(nn::sum<1>(a)));
    })(x, x);
    used[dev] = host(std::get<0>(grads));
    unused[dev] = host(std::get<1>(grads));
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    CHECK(used[dev] == std::vector<double>(6, 1.0));
    CHECK(unused[dev] == std::vector<double>(6, 0.0));
  }
}

TEST_CASE("value_and_grad refuses a loss of more than one element, saying how to reduce it", "[nn][autodiff]") {
  const mesh1 m{4};
  std::vector<std::string> what(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, random_array(8, 3, 7), {2 * dev, 0, 2, 3, 3});
    try {
      (void)nn::value_and_grad([](const auto& a) { return nn::psum<"x">(a); })(x);
    } catch (const nn::autodiff_error& e) {
      what[dev] = e.what();
    }
  });
  for (std::size_t dev = 0; dev < 4; ++dev)
    CHECK(what[dev] == "meshlib::nn: value_and_grad: the loss must be a scalar (one element), but the function returned "
                       "a block of shape (2, 3) on device " + std::to_string(dev) +
                           "; reduce it with nn::sum / nn::mean first");
}

TEST_CASE("value_and_grad through every collective on a 1-D mesh matches finite differences", "[nn][autodiff]") {
  // x: (8, 3) rows sharded over 4 devices; w: (3, 4) replicated; c: a constant that varies by device.
  const mesh1 m{4};
  const auto gx0 = random_array(8, 3, 11), gw0 = random_array(3, 4, 12);
  const std::vector<std::pair<std::size_t, std::size_t>> shift{{0, 1}, {1, 2}, {2, 3}, {3, 0}};
  auto loss_fn = [&](const auto& x, const auto& w, const vary1& c) {
    auto h = nn::tanh(nn::matmul(x, w));                          // (2, 4), rows sharded
    auto g = nn::all_gather<"x", 0>(h);                           // (8, 4), invariant
    auto s = nn::psum_scatter<"x", 1>(nn::pvary<"x">(g) * c);     // (8, 1), columns sharded
    auto a = nn::all_to_all<"x", 0, 1>(nn::ppermute<"x">(s, shift));  // (2, 4), rows sharded
    auto term_a = nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(a))));
    auto term_h = nn::pmean<"x">(nn::mean<0>(nn::mean<1>(nn::exp(h))));
    auto term_d = nn::psum<"x">(nn::sum<0>(nn::sum<1>(x / (nn::square(x) + 2.0))));
    return term_a + term_h * 2.0 - term_d;
  };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<rows1>(m, dev, gl[0], {2 * dev, 0, 2, 3, 3});
      const auto w = block_of<repl1>(m, dev, gl[1], {0, 0, 3, 4, 4});
      const auto c = block_of<vary1>(m, dev, random_array(8, 4, 13 + static_cast<unsigned>(dev)), {0, 0, 8, 4, 4});
      auto [value, g] = nn::value_and_grad<0, 1>(loss_fn)(x, w, c);
      loss[dev] = host(value)[0];
      if (grads) {
        (*grads)[0][dev] = host(std::get<0>(g));
        (*grads)[1][dev] = host(std::get<1>(g));
      }
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);  // one loss, every device
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(2, std::vector<std::vector<double>>(4));
  run({gx0, gw0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0, gw0}, grads,
                            {[](std::size_t dev) { return block_at{2 * dev, 0, 2, 3, 3}; },
                             [](std::size_t) { return block_at{0, 0, 3, 4, 4}; }});
}

TEST_CASE("value_and_grad on a 2x2 mesh (contraction sharded on model) matches finite differences", "[nn][autodiff]") {
  // x: (4, 6) as P<"data", "model">; w: (6, 4) as P<"model", none>: x w is a pending sum over model.
  const mesh2 m{2, 2};
  const auto gx0 = random_array(4, 6, 21), gw0 = random_array(6, 4, 22);
  const std::vector<std::pair<std::size_t, std::size_t>> swap{{0, 1}, {1, 0}};
  auto loss_fn = [&](const auto& x, const auto& w) {
    auto s = nn::psum<"model">(nn::matmul(x, w));                 // (2, 4): varies over data
    auto h = nn::tanh(s) * 0.7 + nn::square(s) * 0.1;
    auto g = nn::all_gather<"data", 0>(h);                        // (4, 4): invariant
    auto term1 = nn::mean<0>(nn::sum<1>(nn::log(nn::exp(g) + 1.0) + nn::maximum(g, 0.1)));
    auto term2 = nn::psum<"data">(nn::sum<0>(nn::sum<1>(h / (nn::square(h) + 1.5))));
    auto p = nn::ppermute<"model">(nn::psum_scatter<"model", 1>(nn::pvary<"model">(h)), swap);  // (2, 2)
    auto term3 = nn::psum<"data", "model">(nn::sum<0>(nn::sum<1>(nn::square(p))));
    return term1 + term2 * 0.5 + term3 * 0.25;
  };
  for (std::size_t dev = 0; dev < 4; ++dev) REQUIRE(m.coords(dev)[0] == dev / 2);  // row-major: data, then model
  auto x_at = [](std::size_t dev) { return block_at{2 * (dev / 2), 3 * (dev % 2), 2, 3, 6}; };
  auto w_at = [](std::size_t dev) { return block_at{3 * (dev % 2), 0, 3, 4, 4}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<x2_t>(m, dev, gl[0], x_at(dev));
      const auto w = block_of<w2_t>(m, dev, gl[1], w_at(dev));
      auto [value, g] = nn::value_and_grad<0, 1>(loss_fn)(x, w);
      static_assert(std::is_same_v<std::tuple_element_t<1, decltype(g)>, w2_t>);
      loss[dev] = host(value)[0];
      if (grads) {
        (*grads)[0][dev] = host(std::get<0>(g));
        (*grads)[1][dev] = host(std::get<1>(g));
      }
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(2, std::vector<std::vector<double>>(4));
  run({gx0, gw0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0, gw0}, grads, {x_at, w_at});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("a dense layer as a primitive: its hand-written backward equals value_and_grad of x W", "[nn][autodiff]") {
  // L = sum over the global (8, 3) batch of tanh(x W + b)^2, rows sharded over 4 devices, b = 0 (the
  // layer's initial bias): the layer's dx and the sum over devices of its dW equal the gradients of
  // the same loss written with nn::matmul.
  const mesh1 m{4};
  nn::dense<double, mesh1> fc(m, "fc", 3, 4, nn::rng_key{7});
  const auto gx = random_array(8, 3, 31);
  std::vector<std::vector<double>> layer_dw(4), traced_dw(4), layer_dx(4), traced_dx(4);
  std::vector<double> layer_loss(4), traced_loss(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, gx, {2 * dev, 0, 2, 3, 3});
    const repl1 w = fc.w.local(dev);
    auto with_layer = nn::value_and_grad([&](const auto& xs) {
      return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(nn::apply_layer(fc, xs))))));
    })(x);
    auto with_matmul = nn::value_and_grad<0, 1>([](const auto& xs, const auto& ws) {
      return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(nn::matmul(xs, ws))))));
    })(x, w);
    layer_loss[dev] = host(with_layer.value)[0];
    traced_loss[dev] = host(with_matmul.value)[0];
    layer_dx[dev] = host(with_layer.grad);
    traced_dx[dev] = host(std::get<0>(with_matmul.grad));
    traced_dw[dev] = host(std::get<1>(with_matmul.grad));
    layer_dw[dev] = host(fc.w.grad.local_value(dev));
  });
  std::vector<double> summed(12, 0.0);
  for (std::size_t dev = 0; dev < 4; ++dev)
    for (std::size_t e = 0; e < 12; ++e) summed[e] += layer_dw[dev][e];  // the layer leaves the data sum to its policy
  for (std::size_t dev = 0; dev < 4; ++dev) {
    CHECK(std::abs(layer_loss[dev] - traced_loss[dev]) < 1e-12);
    for (std::size_t e = 0; e < 6; ++e) CHECK(std::abs(layer_dx[dev][e] - traced_dx[dev][e]) < 1e-5);
    for (std::size_t e = 0; e < 12; ++e) CHECK(std::abs(summed[e] - traced_dw[dev][e]) < 1e-5);
  }
  CHECK(std::abs(summed[0]) > 1e-3);  // a real gradient, not zeros on both sides
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("norms and activations as primitives: their backwards equal value_and_grad of their forward code",
          "[nn][autodiff][layers]") {
  // L = sum over the global (8, 5) batch of tanh(layer(x))^2, rows sharded over 4 devices; each
  // layer once through apply_layer (its own backward) and once written with the traced ops, its
  // parameters as inputs (replicated: pvary'd onto the varying rows, so their cotangent is the psum
  // over the devices, where the layer leaves the data sum to its policy).
  const mesh1 m{4};
  const auto gx = random_array(8, 5, 91);
  const auto loss_of = [](const auto& y) { return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(y))))); };
  const auto row = [](const auto& v, const auto& like) { return nn::broadcast_in_dim<1>(v, like); };
  const auto col = [](const auto& p, const auto& like) { return nn::broadcast_in_dim<0>(nn::pvary<"x">(p), like); };
  // One layer: `via_layer(x)` the loss through apply_layer, `written(x, params...)` the same loss as
  // forward code; `params(dev)` the layer's parameters on `dev` and `grads(dev)` their gradients
  // there (each a host vector), compared with the traced gradients.
  const auto compare = [&](const char* what, auto& layer, auto written, auto params, auto grads) {
    INFO(what);
    constexpr std::size_t np = std::tuple_size_v<decltype(params(std::size_t{0}))>;
    std::vector<double> loss_layer(4), loss_written(4);
    std::vector<std::vector<double>> dx_layer(4), dx_written(4);
    std::vector<std::array<std::vector<double>, np>> dp_layer(4), dp_written(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<rows1>(m, dev, gx, {2 * dev, 0, 2, 5, 5});
      auto a = nn::value_and_grad([&](const auto& xs) { return loss_of(nn::apply_layer(layer, xs)); })(x);
      loss_layer[dev] = host(a.value)[0];
      dx_layer[dev] = host(a.grad);
      dp_layer[dev] = grads(dev);
      const auto f = [&](const auto& xs, const auto&... qs) { return loss_of(written(xs, qs...)); };
      if constexpr (np == 0) {
        auto b = nn::value_and_grad(f)(x);
        loss_written[dev] = host(b.value)[0];
        dx_written[dev] = host(b.grad);
      } else {
        std::apply(
            [&](const auto&... ps) {
              auto b = [&]<std::size_t... I>(std::index_sequence<I...>) {
                return nn::value_and_grad<0, (I + 1)...>(f)(x, ps...);
              }(std::make_index_sequence<np>{});
              loss_written[dev] = host(b.value)[0];
              dx_written[dev] = host(std::get<0>(b.grad));
              std::size_t k = 0;
              std::apply([&](const auto&, const auto&... gs) { ((dp_written[dev][k++] = host(gs)), ...); }, b.grad);
            },
            params(dev));
      }
    });
    for (std::size_t dev = 0; dev < 4; ++dev) {
      CHECK(std::abs(loss_layer[dev] - loss_written[dev]) < 1e-10);
      for (std::size_t e = 0; e < dx_layer[dev].size(); ++e) CHECK(std::abs(dx_layer[dev][e] - dx_written[dev][e]) < 1e-5);
    }
    for (std::size_t k = 0; k < np; ++k) {
      std::vector<double> summed(dp_layer[0][k].size(), 0.0);
      for (std::size_t dev = 0; dev < 4; ++dev)
        for (std::size_t e = 0; e < summed.size(); ++e) summed[e] += dp_layer[dev][k][e];
      for (std::size_t dev = 0; dev < 4; ++dev)
        for (std::size_t e = 0; e < summed.size(); ++e) CHECK(std::abs(summed[e] - dp_written[dev][k][e]) < 1e-5);
      CHECK(std::abs(summed[0]) > 1e-4);  // a real gradient, not zeros on both sides
    }
    CHECK(std::any_of(dx_layer[0].begin(), dx_layer[0].end(), [](double v) { return std::abs(v) > 1e-6; }));
  };
  const auto none = [](std::size_t) { return std::tuple<>{}; };
  const auto no_grads = [](std::size_t) { return std::array<std::vector<double>, 0>{}; };

  nn::rms_norm<double, mesh1> rms(m, "rms", 5, 1e-5);
  compare(
      "rms_norm", rms,
      [&](const auto& xs, const auto& g) {
        auto r = nn::rsqrt(nn::mean<1>(nn::square(xs)) + 1e-5);
        return xs * row(r, xs) * col(g, xs);
      },
      [&](std::size_t dev) { return std::tuple{rms.g.local(dev)}; },
      [&](std::size_t dev) { return std::array{host(rms.g.grad.local_value(dev))}; });

  nn::layer_norm<double, mesh1> ln(m, "ln", 5, 1e-5);
  compare(
      "layer_norm", ln,
      [&](const auto& xs, const auto& g, const auto& b) {
        auto xc = xs - row(nn::mean<1>(xs), xs);
        auto r = nn::rsqrt(nn::mean<1>(nn::square(xc)) + 1e-5);
        return xc * row(r, xs) * col(g, xs) + col(b, xs);
      },
      [&](std::size_t dev) { return std::tuple{ln.g.local(dev), ln.b.local(dev)}; },
      [&](std::size_t dev) { return std::array{host(ln.g.grad.local_value(dev)), host(ln.b.grad.local_value(dev))}; });

  // batch_norm: the statistics over the global batch (8 rows on 4 devices: a psum over x), biased.
  nn::batch_norm<double, mesh1, "x"> bn(m, "bn", 5, 0.1, 1e-5);
  compare(
      "batch_norm", bn,
      [&](const auto& xs, const auto& g, const auto& b) {
        const auto over_batch = [&](const auto& v) { return nn::pvary<"x">(nn::psum<"x">(nn::sum<0>(v)) * 0.125); };
        auto xc = xs - nn::broadcast_in_dim<0>(over_batch(xs), xs);
        auto r = nn::rsqrt(over_batch(nn::square(xc)) + 1e-5);
        return xc * nn::broadcast_in_dim<0>(r, xs) * col(g, xs) + col(b, xs);
      },
      [&](std::size_t dev) { return std::tuple{bn.g.local(dev), bn.b.local(dev)}; },
      [&](std::size_t dev) { return std::array{host(bn.g.grad.local_value(dev)), host(bn.b.grad.local_value(dev))}; });

  nn::gelu<double> gelu(m);
  const double c = std::sqrt(2.0 / 3.141592653589793);
  compare(
      "gelu", gelu,
      [&](const auto& xs) { return xs * 0.5 * (nn::tanh((xs + nn::square(xs) * xs * 0.044715) * c) + 1.0); }, none,
      no_grads);

  nn::relu<double> relu(m);
  compare(
      "relu", relu, [&](const auto& xs) { return nn::maximum(xs, 0.0); }, none, no_grads);
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("image layers as primitives (conv2d, pools, a basic block) match finite differences",
          "[nn][autodiff][layers]") {
  // 8 images of 4 x 4 x 2 (NHWC rows), 2 per device over 4 devices; L = sum over the global batch
  // of tanh(f(x))^2 for f a conv2d, then a max pool and an average pool, and separately a basic
  // block (conv, batch_norm over the sharded batch, relu, conv, batch_norm, a projection shortcut):
  // each layer's backward through apply_layer gives dL/dx, checked against central differences.
  const mesh1 m{4};
  const nn::image_shape in{4, 4, 2};
  const std::size_t width = in.height * in.width * in.channels;
  const auto gx = random_array(8, width, 77);
  nn::conv2d<double, mesh1> conv(m, "c", in, 3, 3, nn::rng_key{5}, {.padding = 1});
  nn::max_pool2d<double, mesh1> mp(m, "mp", conv.output_shape(), 2, 1);
  nn::avg_pool2d<double, mesh1> ap(m, "ap", mp.output_shape(), 2);
  nn::basic_block<double, mesh1, "x"> block(m, "b", in, 3, 2, nn::rng_key{6});
  auto x_at = [&](std::size_t dev) { return block_at{2 * dev, 0, 2, width, width}; };
  const auto check = [&](const char* what, auto&& f) {
    INFO(what);
    auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
      std::vector<double> loss(4);
      meshlib::spmd(m, [&](std::size_t dev) {
        const auto x = block_of<rows1>(m, dev, gl[0], x_at(dev));
        auto [value, dx] = nn::value_and_grad([&](const auto& xs) {
          return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(f(xs))))));
        })(x);
        loss[dev] = host(value)[0];
        if (grads) (*grads)[0][dev] = host(dx);
      });
      for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
      return loss[0];
    };
    std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
    run({gx}, &grads);
    CHECK(std::any_of(grads[0][0].begin(), grads[0][0].end(), [](double v) { return std::abs(v) > 1e-6; }));
    check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx}, grads, {x_at});
  };
  check("conv2d, max_pool2d, avg_pool2d",
        [&](const auto& xs) { return nn::apply_layer(ap, nn::apply_layer(mp, nn::apply_layer(conv, xs))); });
  check("basic_block", [&](const auto& xs) { return nn::apply_layer(block, xs); });
}

TEST_CASE("value_and_grad of a Megatron MLP on a 2x2 mesh matches finite differences", "[nn][autodiff]") {
  // x: (4, 3) as P<"data", none>; w1: (3, 4) as P<none, "model"> (column-parallel); w2: (4, 2) as
  // P<"model", none> (row-parallel). x's gradient needs the psum over model of x w1's backward
  // (Megatron's f), w1's and w2's the psum over data (data parallelism), all from the types.
  const mesh2 m{2, 2};
  using xs_t = meshlib::local_tensor<double, 2, mesh2, D, 0, meshlib::dim_masks<D, 0>>;
  using w1_t = meshlib::local_tensor<double, 2, mesh2, M, 0, meshlib::dim_masks<0, M>>;
  using w2_t = meshlib::local_tensor<double, 2, mesh2, M, 0, meshlib::dim_masks<M, 0>>;
  const auto gx0 = random_array(4, 3, 41), g10 = random_array(3, 4, 42), g20 = random_array(4, 2, 43);
  auto loss_fn = [](const auto& x, const auto& w1, const auto& w2) {
    auto h = nn::maximum(nn::matmul(-x, w1), 0.05);                  // (2, 2): varies over data and model
    auto y = nn::psum<"model">(nn::matmul(h, w2));                    // (2, 2): varies over data
    auto z = nn::transpose(2.0 - nn::square(y) * 0.3);                // (2, 2), columns sharded over data
    return nn::pmean<"data">(nn::mean<0>(nn::sum<1>(nn::tanh(z)))) + nn::psum<"data">(nn::sum<0>(nn::sum<1>(y)));
  };
  auto x_at = [](std::size_t dev) { return block_at{2 * (dev / 2), 0, 2, 3, 3}; };
  auto w1_at = [](std::size_t dev) { return block_at{0, 2 * (dev % 2), 3, 2, 4}; };
  auto w2_at = [](std::size_t dev) { return block_at{2 * (dev % 2), 0, 2, 2, 2}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<xs_t>(m, dev, gl[0], x_at(dev));
      const auto w1 = block_of<w1_t>(m, dev, gl[1], w1_at(dev));
      const auto w2 = block_of<w2_t>(m, dev, gl[2], w2_at(dev));
      auto [value, g] = nn::value_and_grad<0, 1, 2>(loss_fn)(x, w1, w2);
      static_assert(std::is_same_v<std::tuple_element_t<0, decltype(g)>, xs_t>);
      static_assert(std::is_same_v<std::tuple_element_t<1, decltype(g)>, w1_t>);
      loss[dev] = host(value)[0];
      if (grads) {
        (*grads)[0][dev] = host(std::get<0>(g));
        (*grads)[1][dev] = host(std::get<1>(g));
        (*grads)[2][dev] = host(std::get<2>(g));
      }
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(3, std::vector<std::vector<double>>(4));
  run({gx0, g10, g20}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0, g10, g20}, grads,
                            {x_at, w1_at, w2_at});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

namespace {

/// A random program: every collective step (codes `first_collective` .. `codes - 1`) once and
/// `extra` elementwise steps (codes 0 .. first_collective - 1), in a seeded random order.
std::vector<int> random_program(unsigned seed, int first_collective, int codes, int extra) {
  std::vector<int> ops;
  for (int c = first_collective; c < codes; ++c) ops.push_back(c);
  unsigned s = seed * 747796405U + 2891336453U;
  auto next = [&s](unsigned n) {
    s = s * 1664525U + 1013904223U;
    return (s >> 8) % n;
  };
  for (int i = 0; i < extra; ++i) ops.push_back(static_cast<int>(next(static_cast<unsigned>(first_collective))));
  for (std::size_t i = ops.size(); i > 1; --i) std::swap(ops[i - 1], ops[next(static_cast<unsigned>(i))]);
  return ops;
}

/// One elementwise step of a random program (codes 0..6); `x` is the program's input.
template <class V, class X>
V elementwise_step(int op, const V& v, const X& x) {
  switch (op) {
    case 0: return nn::tanh(v);
    case 1: return nn::square(v) * 0.5;
    case 2: return nn::maximum(v, 0.1);
    case 3: return v * 1.3 + 0.2;
    case 4: return v * x;
    case 5: return v / (nn::square(v) + 2.0);
    default: return nn::exp(v * 0.3);
  }
}

}  // namespace

TEST_CASE("value_and_grad of random programs mixing collectives on a 1-D mesh matches finite differences",
          "[nn][autodiff]") {
  const mesh1 m{4};  // x: (8, 4), rows sharded: all_to_all splits its 4 columns over the 4 devices
  const auto gx0 = random_array(8, 4, 51);
  const std::vector<std::pair<std::size_t, std::size_t>> perm{{0, 2}, {1, 0}, {2, 3}, {3, 1}};
  for (unsigned seed = 1; seed <= 4; ++seed) {
    const auto ops = random_program(seed, 7, 10, 5);
    INFO("program " << seed);
    auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
      std::vector<double> loss(4);
      meshlib::spmd(m, [&](std::size_t dev) {
        const auto x = block_of<rows1>(m, dev, gl[0], {2 * dev, 0, 2, 4, 4});
        const auto c = block_of<rows1>(m, dev, random_array(8, 4, 52), {2 * dev, 0, 2, 4, 4});
        const auto moved_c = meshlib::all_to_all<"x", 1, 0>(c);  // a constant laid out as the moved value
        auto [value, g] = nn::value_and_grad([&](const auto& xs) {
          auto v = xs;
          for (int op : ops) {
            if (op == 7) v = nn::ppermute<"x">(v, perm);
            else if (op == 8) v = nn::all_to_all<"x", 0, 1>(nn::tanh(nn::all_to_all<"x", 1, 0>(v)) * moved_c);
            else if (op == 9) v = nn::psum_scatter<"x", 0>(nn::pvary<"x">(nn::all_gather<"x", 0>(v) * 0.25));
            else v = elementwise_step(op, v, xs);
          }
          return nn::psum<"x">(nn::sum<0>(nn::sum<1>(v * c)));
        })(x);
        loss[dev] = host(value)[0];
        if (grads) (*grads)[0][dev] = host(g);
      });
      return loss[0];
    };
    std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
    run({gx0}, &grads);
    check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads,
                              {[](std::size_t dev) { return block_at{2 * dev, 0, 2, 4, 4}; }});
  }
}

TEST_CASE("value_and_grad of random programs mixing collectives on a 2x2 mesh matches finite differences",
          "[nn][autodiff]") {
  const mesh2 m{2, 2};
  const auto gx0 = random_array(4, 6, 61);
  const std::vector<std::pair<std::size_t, std::size_t>> swap{{0, 1}, {1, 0}};
  auto x_at = [](std::size_t dev) { return block_at{2 * (dev / 2), 3 * (dev % 2), 2, 3, 6}; };
  for (unsigned seed = 1; seed <= 4; ++seed) {
    const auto ops = random_program(seed, 7, 11, 5);
    INFO("program " << seed);
    auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
      std::vector<double> loss(4);
      meshlib::spmd(m, [&](std::size_t dev) {
        const auto x = block_of<x2_t>(m, dev, gl[0], x_at(dev));
        const auto c = block_of<x2_t>(m, dev, random_array(4, 6, 62), x_at(dev));
        auto [value, g] = nn::value_and_grad([&](const auto& xs) {
          auto v = xs;
          for (int op : ops) {
            if (op == 7) v = nn::ppermute<"data">(v, swap);
            else if (op == 8) v = nn::ppermute<"model">(v, swap);
            else if (op == 9) v = nn::psum_scatter<"model", 1>(nn::pvary<"model">(nn::all_gather<"model", 1>(v) * 0.5));
            else if (op == 10) v = nn::psum_scatter<"data", 0>(nn::pvary<"data">(nn::tanh(nn::all_gather<"data", 0>(v))));
            else v = elementwise_step(op, v, xs);
          }
          return nn::psum<"data", "model">(nn::sum<0>(nn::sum<1>(v * c)));
        })(x);
        loss[dev] = host(value)[0];
        if (grads) (*grads)[0][dev] = host(g);
      });
      return loss[0];
    };
    std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
    run({gx0}, &grads);
    check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads, {x_at});
  }
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("value_and_grad through slice and concatenate matches the hand-derived gradient", "[nn][autodiff][shape]") {
  // L = sum over the global (8, 6) array of slice<1>(x, 2, 5) * c + 1/2 concatenate<1>(x, x)^2, rows
  // sharded over 4 devices: dL/dx = c shifted to columns 2..4 (zeros elsewhere) + 2 x.
  const mesh1 m{4};
  const auto gx = random_array(8, 6, 71), gc = random_array(8, 3, 72);
  auto loss_fn = [](const auto& x, const rows1& c) {
    auto cut = nn::slice<1>(x, 2, 5) * c;
    auto both = nn::concatenate<1>(x, x);
    static_assert(std::is_same_v<typename std::remove_cvref_t<decltype(both)>::primal_type, rows1>);
    return nn::psum<"x">(nn::sum<0>(nn::sum<1>(cut)) + nn::sum<0>(nn::sum<1>(nn::square(both))) * 0.5);
  };
  std::vector<std::vector<double>> gs(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, gx, {2 * dev, 0, 2, 6, 6});
    const auto c = block_of<rows1>(m, dev, gc, {2 * dev, 0, 2, 3, 3});
    gs[dev] = host(nn::grad(loss_fn)(x, c));
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    REQUIRE(gs[dev].size() == 12);
    for (std::size_t k = 0; k < 12; ++k) {
      const std::size_t row = 2 * dev + k / 6, col = k % 6;
      const double want = 2 * gx[row * 6 + col] + (col >= 2 && col < 5 ? gc[row * 3 + col - 2] : 0.0);
      CHECK(std::abs(gs[dev][k] - want) < 1e-12);
    }
  }
}

TEST_CASE("value_and_grad through reshape, slice, pad and concatenate on a 1-D mesh matches finite differences",
          "[nn][autodiff][shape]") {
  // x: (8, 6), rows sharded over 4 devices; overlapping slices (two uses of the same columns), a
  // concatenation with a constant, reshapes that mix rows and columns and of a pending sum, a pad.
  const mesh1 m{4};
  const auto gx0 = random_array(8, 6, 73);
  auto x_at = [](std::size_t dev) { return block_at{2 * dev, 0, 2, 6, 6}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<rows1>(m, dev, gl[0], x_at(dev));
      const auto c2 = block_of<rows1>(m, dev, random_array(8, 2, 74), {2 * dev, 0, 2, 2, 2});
      const auto c8 = block_of<rows1>(m, dev, random_array(8, 8, 75), {2 * dev, 0, 2, 8, 8});
      auto [value, g] = nn::value_and_grad([&](const auto& xs) {
        auto a = nn::slice<1>(xs, 0, 4);                                        // (2, 4)
        auto b = nn::slice<1>(xs, 2, 6);                                        // (2, 4), columns 2, 3 again
        auto h = nn::concatenate<1>(nn::tanh(a), a * b, c2);                    // (2, 10)
        auto r = nn::reshape(h, std::array<std::size_t, 3>{5, 2, 2});           // (rows mixed with columns)
        auto s = nn::reshape(nn::sum<2>(nn::square(r)), std::array<std::size_t, 2>{2, 5});
        auto p = nn::pad<1>(s, 1, 2) * meshlib::forget_dims<"x">(c8);           // (2, 8)
        auto q = nn::reshape(nn::sum<0>(p), std::array<std::size_t, 2>{2, 4});  // varies over x
        auto z = nn::reshape(nn::sum<0>(nn::square(xs)), std::array<std::size_t, 2>{3, 2});  // a pending sum over x
        static_assert(std::remove_cvref_t<decltype(z)>::partial == X);
        return nn::sum<0>(nn::sum<1>(nn::tanh(nn::psum<"x">(q)))) + nn::sum<0>(nn::sum<1>(nn::tanh(nn::psum<"x">(z))));
      })(x);
      loss[dev] = host(value)[0];
      if (grads) (*grads)[0][dev] = host(g);
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
  run({gx0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads, {x_at});
}

TEST_CASE("value_and_grad through all_gather, reshape, slice and pad on a 2x2 mesh matches finite differences",
          "[nn][autodiff][shape]") {
  // x: (4, 6) as P<"data", "model">; gathering the columns over model makes dimension 1 whole, so
  // it can be sliced and reshaped; the gradient comes back as x's blocks.
  const mesh2 m{2, 2};
  using rows_t = meshlib::local_tensor<double, 2, mesh2, D, 0, meshlib::dim_masks<D, 0>>;
  const auto gx0 = random_array(4, 6, 76);
  auto x_at = [](std::size_t dev) { return block_at{2 * (dev / 2), 3 * (dev % 2), 2, 3, 6}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<x2_t>(m, dev, gl[0], x_at(dev));
      const auto c = block_of<rows_t>(m, dev, random_array(4, 4, 77), {2 * (dev / 2), 0, 2, 4, 4});
      auto [value, g] = nn::value_and_grad([&](const auto& xs) {
        auto full = nn::all_gather<"model", 1>(xs);                                     // (2, 6)
        auto mid = nn::reshape(nn::slice<1>(full, 1, 5), std::array<std::size_t, 3>{2, 2, 2});
        auto pairs = nn::sum<2>(nn::tanh(mid));                                         // (2, 2)
        auto cols = nn::forget_dims<"data">(nn::slice<1>(nn::square(full), 0, 2));     // as reshaped values are
        auto joined = nn::concatenate<1>(pairs, cols) * meshlib::forget_dims<"data">(c);  // (2, 4)
        auto padded = nn::pad<1>(joined, 2, 0);                                          // (2, 6)
        return nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(padded + nn::forget_dims<"data">(full)))));
      })(x);
      static_assert(std::is_same_v<decltype(g), x2_t>, "the gradient has the argument's type");
      loss[dev] = host(value)[0];
      if (grads) (*grads)[0][dev] = host(g);
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
  run({gx0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads, {x_at});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("value_and_grad through broadcast_in_dim (a varying row, a pending sum) matches finite differences",
          "[nn][autodiff][shape]") {
  // x: (8, 3), rows sharded over 4 devices; b: (3,) replicated. b is pvary'd and broadcast over x's
  // rows (its cotangent: the local column sums, then psum from pvary); the column sums of x, a
  // pending sum, are broadcast over a new unsharded dimension and completed.
  const mesh1 m{4};
  using b_t = meshlib::local_tensor<double, 1, mesh1>;
  const auto gx0 = random_array(8, 3, 81), gb0 = random_array(1, 3, 82);
  auto x_at = [](std::size_t dev) { return block_at{2 * dev, 0, 2, 3, 3}; };
  auto b_at = [](std::size_t) { return block_at{0, 0, 1, 3, 3}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<rows1>(m, dev, gl[0], x_at(dev));
      b_t b(std::array<std::size_t, 1>{3}, m, dev);
      for (std::size_t k = 0; k < 3; ++k) b(k) = gl[1][k];
      auto [value, g] = nn::value_and_grad<0, 1>([](const auto& xs, const auto& bs) {
        auto row = nn::broadcast_in_dim<0>(nn::pvary<"x">(bs), xs);                  // (2, 3), as xs
        auto cols = nn::broadcast_in_dim<0>(nn::sum<0>(nn::square(xs)), 2);          // a pending sum over x
        auto a = nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::tanh(xs + row))));
        return a + nn::sum<0>(nn::sum<1>(nn::tanh(nn::psum<"x">(cols) * 0.3)));
      })(x, b);
      static_assert(std::is_same_v<std::tuple_element_t<1, decltype(g)>, b_t>);
      loss[dev] = host(value)[0];
      if (grads) {
        (*grads)[0][dev] = host(std::get<0>(g));
        (*grads)[1][dev] = host(std::get<1>(g));
      }
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(2, std::vector<std::vector<double>>(4));
  run({gx0, gb0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0, gb0}, grads, {x_at, b_at});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("value_and_grad with has_aux returns the aux f computed and the gradients it gives without aux",
          "[nn][autodiff][aux]") {
  // f(x, w) = (loss, (tanh(x w), psum of the rows of x, a host number)): the aux holds a traced
  // value (returned as its primal), a pending sum completed and a plain int, none differentiated.
  const mesh1 m{4};
  const auto gx = random_array(8, 3, 91), gw = random_array(3, 2, 92);
  auto forward = [](const auto& x, const auto& w) {
    auto h = nn::tanh(nn::matmul(x, w));
    return std::pair(nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(h)))), h);
  };
  auto with_aux = [&](const auto& x, const auto& w) {
    auto [loss, h] = forward(x, w);
    return std::pair(loss, std::tuple(h, nn::psum<"x">(nn::sum<0>(x)), 7));
  };
  auto without_aux = [&](const auto& x, const auto& w) { return forward(x, w).first; };
  std::vector<double> values(4), aux_values(4);
  std::vector<std::vector<double>> h_aux(4), h_direct(4), s_aux(4), s_direct(4);
  std::vector<std::vector<std::vector<double>>> g_aux(2, std::vector<std::vector<double>>(4)), g_plain = g_aux,
                                                g_grad = g_aux;
  std::vector<int> seven(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, gx, {2 * dev, 0, 2, 3, 3});
    const auto w = block_of<repl1>(m, dev, gw, {0, 0, 3, 2, 2});
    auto [out, g] = nn::value_and_grad<0, 1>(with_aux, nn::has_aux)(x, w);
    auto& [loss, aux] = out;
    using h_t = decltype(meshlib::matmul(x, w));
    static_assert(std::is_same_v<std::tuple_element_t<0, std::remove_cvref_t<decltype(aux)>>, h_t>,
                  "a traced value in the aux comes back as its primal local_tensor");
    static_assert(std::is_same_v<std::tuple_element_t<2, std::remove_cvref_t<decltype(aux)>>, int>);
    auto [value, g0] = nn::value_and_grad<0, 1>(without_aux)(x, w);
    values[dev] = host(loss)[0];
    aux_values[dev] = host(value)[0];
    h_aux[dev] = host(std::get<0>(aux));
    h_direct[dev] = host(meshlib::map([](double v) { return std::tanh(v); }, meshlib::matmul(x, w)));
    s_aux[dev] = host(std::get<1>(aux));
    s_direct[dev] = host(meshlib::psum<"x">(meshlib::sum<0>(x)));
    seven[dev] = std::get<2>(aux);
    g_aux[0][dev] = host(std::get<0>(g));
    g_aux[1][dev] = host(std::get<1>(g));
    g_plain[0][dev] = host(std::get<0>(g0));
    g_plain[1][dev] = host(std::get<1>(g0));
    auto [gg, aux2] = nn::grad<0, 1>(with_aux, nn::has_aux)(x, w);  // grad: (grads, aux), as JAX's
    g_grad[0][dev] = host(std::get<0>(gg));
    g_grad[1][dev] = host(std::get<1>(gg));
    seven[dev] += std::get<2>(aux2) - 7;  // the aux of grad, too
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    CHECK(values[dev] == aux_values[dev]);
    CHECK(h_aux[dev] == h_direct[dev]);
    CHECK(s_aux[dev] == s_direct[dev]);
    CHECK(seven[dev] == 7);
    for (std::size_t i = 0; i < 2; ++i) {
      CHECK(g_aux[i][dev] == g_plain[i][dev]);
      CHECK(g_grad[i][dev] == g_plain[i][dev]);
    }
  }
}

TEST_CASE("value_and_grad with has_aux: one differentiated argument, a plain-value aux", "[nn][autodiff][aux]") {
  const mesh1 m{4};
  std::vector<double> loss(4), gsum(4);
  std::vector<std::string> names(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = block_of<rows1>(m, dev, random_array(8, 3, 93), {2 * dev, 0, 2, 3, 3});
    auto [out, dx] = nn::value_and_grad([](const auto& a) {
      return std::tuple(nn::psum<"x">(nn::sum<0>(nn::sum<1>(a * 3.0))), std::string("three"));
    }, nn::has_aux)(x);
    static_assert(std::is_same_v<decltype(dx), rows1>);
    loss[dev] = host(out.first)[0];
    names[dev] = out.second;
    for (double v : host(dx)) gsum[dev] += v;
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    CHECK(names[dev] == "three");
    CHECK(gsum[dev] == 18.0);  // 6 elements, each 3
  }
  CHECK(loss[1] == loss[0]);
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("value_and_grad through sqrt, rsqrt and stop_gradient matches the hand-derived gradient",
          "[nn][autodiff][norms]") {
  // L = sum c sqrt(x^2 + 1) + rsqrt(x^2 + 2) + x stop_gradient(x) over the global (8, 3) array:
  // dL/dx = c x / sqrt(x^2 + 1) - x (x^2 + 2)^(-3/2) + x (the stopped factor takes no gradient).
  const mesh1 m{4};
  const auto gx = random_array(8, 3, 101), gc = random_array(8, 3, 102);
  double expected_loss = 0;
  for (std::size_t e = 0; e < gx.size(); ++e)
    expected_loss += gc[e] * std::sqrt(gx[e] * gx[e] + 1) + 1 / std::sqrt(gx[e] * gx[e] + 2) + gx[e] * gx[e];
  std::vector<double> values(4);
  std::vector<std::vector<double>> gs(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    const block_at b{2 * dev, 0, 2, 3, 3};
    const auto x = block_of<rows1>(m, dev, gx, b), c = block_of<rows1>(m, dev, gc, b);
    static_assert(std::is_same_v<decltype(nn::stop_gradient(c)), rows1>, "a constant stays a constant");
    auto [value, dx] = nn::value_and_grad([](const auto& a, const rows1& cs) {
      auto sq = nn::square(a);
      auto terms = nn::sqrt(sq + 1.0) * cs + nn::rsqrt(sq + 2.0) + a * nn::stop_gradient(a);
      return nn::psum<"x">(nn::sum<0>(nn::sum<1>(terms)));
    })(x, c);
    values[dev] = host(value)[0];
    gs[dev] = host(dx);
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    const block_at b{2 * dev, 0, 2, 3, 3};
    CHECK(std::abs(values[dev] - expected_loss) < 1e-12 * (1 + std::abs(expected_loss)));
    REQUIRE(gs[dev].size() == 6);
    for (std::size_t k = 0; k < 6; ++k) {
      const double xv = gx[b.global_index(k)], cv = gc[b.global_index(k)];
      const double expected = cv * xv / std::sqrt(xv * xv + 1) - xv / std::pow(xv * xv + 2, 1.5) + xv;
      CHECK(std::abs(gs[dev][k] - expected) < 1e-12);
    }
  }
}

TEST_CASE("value_and_grad through max: the gradient goes to the argmax, split between ties", "[nn][autodiff][max]") {
  // One device, x (3, 4) with rows [1 5 2 5], [7 0 7 7], [-1 -2 -3 -4]: L = sum_rows max_row * w_row
  // with w = (1, 2, 3). dL/dx: w_row / (number of maxima of the row) at each maximum, else 0.
  const mesh1 m{1};
  using r2 = meshlib::local_tensor<double, 2, mesh1>;
  using r1 = meshlib::local_tensor<double, 1, mesh1>;
  const std::vector<double> gx{1, 5, 2, 5, 7, 0, 7, 7, -1, -2, -3, -4};
  std::vector<double> loss, g, g0;
  meshlib::spmd(m, [&](std::size_t dev) {
    r2 x(std::array<std::size_t, 2>{3, 4}, m, dev);
    for (std::size_t k = 0; k < gx.size(); ++k) x.data()[k] = gx[k];
    r1 w(std::array<std::size_t, 1>{3}, m, dev);
    for (std::size_t k = 0; k < 3; ++k) w(k) = static_cast<double>(k + 1);
    auto [value, dx] = nn::value_and_grad([](const auto& a, const r1& ws) {
      return nn::sum<0>(nn::max<1>(a) * ws);
    })(x, w);
    loss = host(value);
    g = host(dx);
    // max along dimension 0: the columns' maxima 7, 5, 7, 7, each at one row
    g0 = host(nn::grad([](const auto& a) { return nn::sum<0>(nn::max<0>(a)); })(x));
  });
  CHECK(loss == std::vector<double>{1 * 5 + 2 * 7 + 3 * -1.0});
  CHECK(g == std::vector<double>{0, 0.5, 0, 0.5, 2.0 / 3, 0, 2.0 / 3, 2.0 / 3, 3, 0, 0, 0});
  CHECK(g0 == std::vector<double>{0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0});
}

TEST_CASE("a numerically safe softmax cross-entropy through max and stop_gradient matches p - onehot and finite "
          "differences",
          "[nn][autodiff][max]") {
  // Logits x (8, 5), rows sharded over 4 devices; L = -1/8 sum_rows log softmax(x)[label]:
  // dL/dx = (softmax(x) - onehot) / 8. The shift by the row max (its gradient stopped) keeps
  // exp finite at logits near 1000, where exp(x) itself overflows.
  const mesh1 m{4};
  const std::size_t n = 8, k = 5;
  auto loss_fn = [](const auto& x, const rows1& onehot) {
    auto z = x - nn::broadcast_in_dim<1>(nn::stop_gradient(nn::max<1>(x)), x);
    auto lse = nn::log(nn::sum<1>(nn::exp(z)));
    auto logp = z - nn::broadcast_in_dim<1>(lse, z);
    return nn::psum<"x">(nn::sum<0>(nn::sum<1>(logp * onehot))) * (-1.0 / 8);
  };
  auto onehot_of = [&](std::size_t dev) {
    rows1 o(std::array<std::size_t, 2>{2, k}, m, dev);
    for (std::size_t i = 0; i < 2; ++i) o(i, (2 * dev + i) * 3 % k) = 1.0;
    return o;
  };
  auto x_at = [](std::size_t dev) { return block_at{2 * dev, 0, 2, 5, 5}; };
  for (const double offset : {0.0, 1000.0}) {
    auto gx0 = random_array(n, k, 111);
    for (auto& v : gx0) v = 3 * v + offset;
    auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
      std::vector<double> loss(4);
      meshlib::spmd(m, [&](std::size_t dev) {
        auto [value, dx] = nn::value_and_grad(loss_fn)(block_of<rows1>(m, dev, gl[0], x_at(dev)), onehot_of(dev));
        loss[dev] = host(value)[0];
        if (grads) (*grads)[0][dev] = host(dx);
      });
      for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
      return loss[0];
    };
    std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
    const double loss = run({gx0}, &grads);
    double expected_loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double mx = gx0[i * k], s = 0;
      for (std::size_t j = 0; j < k; ++j) mx = std::max(mx, gx0[i * k + j]);
      for (std::size_t j = 0; j < k; ++j) s += std::exp(gx0[i * k + j] - mx);
      const std::size_t label = i * 3 % k;
      expected_loss -= (gx0[i * k + label] - mx - std::log(s)) / 8;
      for (std::size_t j = 0; j < k; ++j) {
        const double expected = (std::exp(gx0[i * k + j] - mx) / s - (j == label ? 1.0 : 0.0)) / 8;
        const double got = grads[0][i / 2][(i % 2) * k + j];
        INFO("offset " << offset << ", row " << i << ", class " << j);
        CHECK(std::abs(got - expected) < 1e-12);
      }
    }
    CHECK(std::isfinite(loss));
    CHECK(std::abs(loss - expected_loss) < 1e-12 * (1 + std::abs(expected_loss)));
    if (offset == 0.0) check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads, {x_at});
  }
}

TEST_CASE("value_and_grad of an RMS norm (rsqrt) and row L2 norms (sqrt) on a 2x2 mesh matches finite differences",
          "[nn][autodiff][norms]") {
  // x: (4, 6) as P<"data", "model">. y = x rsqrt(mean over features of x^2 + eps), features
  // completed with psum over model; plus the row norms sqrt(sum x^2) and a max over the local
  // columns (varying over model: each block's own max).
  const mesh2 m{2, 2};
  const auto gx0 = random_array(4, 6, 121);
  auto x_at = [](std::size_t dev) { return block_at{(dev / 2) * 2, (dev % 2) * 3, 2, 3, 6}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<x2_t>(m, dev, gl[0], x_at(dev));
      auto [value, dx] = nn::value_and_grad([](const auto& a) {
        auto ms = nn::psum<"model">(nn::mean<1>(nn::square(a)));            // (2,): rows' mean square
        auto y = a * nn::broadcast_in_dim<1>(nn::pvary<"model">(nn::rsqrt(ms + 1e-3)), a);
        auto norms = nn::sqrt(nn::psum<"model">(nn::sum<1>(nn::square(a))));  // (2,)
        auto mx = nn::max<1>(a);                                              // (2,), varies over model
        auto t1 = nn::psum<"data">(nn::psum<"model">(nn::sum<0>(nn::sum<1>(nn::tanh(y) * a))));
        auto t2 = nn::psum<"data">(nn::sum<0>(norms * 0.5));
        auto t3 = nn::psum<"data">(nn::psum<"model">(nn::sum<0>(nn::square(mx))));
        return t1 + t2 + t3 * 0.25;
      })(x);
      loss[dev] = host(value)[0];
      if (grads) (*grads)[0][dev] = host(dx);
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
  run({gx0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads, {x_at});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("value_and_grad through pmax and pmin on a 1-D mesh: the gradient goes to the devices holding the "
          "extremum, split between ties across devices",
          "[nn][autodiff][pmax]") {
  // x: a (2, 3) block per device (varying over x); L = sum_k pmax(x)[k] w[k] with w = 1..6 (a
  // replicated constant). dL/dx on device d at k: w[k] / c_k where x_d[k] is the max over the 4
  // devices (c_k devices hold it), else 0; the same for pmin.
  const mesh1 m{4};
  const std::array<std::array<double, 6>, 4> xs{{{0, 5, 4, -1, 2, 0.5},       // max at k = 4 alone
                                                  {1, 1, 4, 7, -3, -0.5},      // min at k = 1, 5 alone
                                                  {3, 2, 4, 7, -3, 0.25},      // max at k = 0 alone
                                                  {2, 5, 4, 7, 0, 0.5}}};      // k = 2: a 4-way tie
  std::vector<double> vmax(4), vmin(4);
  std::vector<std::vector<double>> gmax(4), gmin(4), gsum(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    vary1 x(std::array<std::size_t, 2>{2, 3}, m, dev);
    repl1 w(std::array<std::size_t, 2>{2, 3}, m, dev);
    for (std::size_t k = 0; k < 6; ++k) {
      x.data()[k] = xs[dev][k];
      w.data()[k] = static_cast<double>(k + 1);
    }
    auto [v1, g1] = nn::value_and_grad([](const auto& a, const repl1& c) {
      auto y = nn::pmax<"x">(a);
      static_assert(std::is_same_v<typename decltype(y)::primal_type, repl1>, "pmax's result is invariant over x");
      return nn::sum<0>(nn::sum<1>(y * c));
    })(x, w);
    static_assert(std::is_same_v<decltype(g1), vary1>, "the gradient has the argument's type");
    auto [v2, g2] = nn::value_and_grad([](const auto& a, const repl1& c) {
      return nn::sum<0>(nn::sum<1>(nn::pmin<"x">(a) * c));
    })(x, w);
    vmax[dev] = host(v1)[0];
    vmin[dev] = host(v2)[0];
    gmax[dev] = host(g1);
    gmin[dev] = host(g2);
    // both in one program: the cotangents add up
    gsum[dev] = host(nn::grad([](const auto& a, const repl1& c) {
      return nn::sum<0>(nn::sum<1>(nn::pmax<"x">(a) * c)) + nn::sum<0>(nn::sum<1>(nn::pmin<"x">(a) * c));
    })(x, w));
  });
  const std::vector<std::vector<double>> expected_max{{0, 1, 0.75, 0, 5, 3},
                                                      {0, 0, 0.75, 4.0 / 3, 0, 0},
                                                      {1, 0, 0.75, 4.0 / 3, 0, 0},
                                                      {0, 1, 0.75, 4.0 / 3, 0, 3}};
  const std::vector<std::vector<double>> expected_min{{1, 0, 0.75, 4, 0, 0},
                                                      {0, 2, 0.75, 0, 2.5, 6},
                                                      {0, 0, 0.75, 0, 2.5, 0},
                                                      {0, 0, 0.75, 0, 0, 0}};
  for (std::size_t dev = 0; dev < 4; ++dev) {
    INFO("device " << dev);
    CHECK(vmax[dev] == 3 * 1 + 5 * 2 + 4 * 3 + 7 * 4 + 2 * 5 + 0.5 * 6);
    CHECK(vmin[dev] == 0 * 1 + 1 * 2 + 4 * 3 - 1 * 4 - 3 * 5 - 0.5 * 6);
    REQUIRE(gmax[dev].size() == 6);
    REQUIRE(gmin[dev].size() == 6);
    REQUIRE(gsum[dev].size() == 6);
    for (std::size_t k = 0; k < 6; ++k) {
      INFO("element " << k);
      CHECK(std::abs(gmax[dev][k] - expected_max[dev][k]) < 1e-15);
      CHECK(std::abs(gmin[dev][k] - expected_min[dev][k]) < 1e-15);
      CHECK(std::abs(gsum[dev][k] - expected_max[dev][k] - expected_min[dev][k]) < 1e-15);
    }
  }
  // the shares of a tie sum to the cotangent: every element's gradient, summed over devices, is w[k]
  for (std::size_t k = 0; k < 6; ++k) {
    double s = 0;
    for (std::size_t dev = 0; dev < 4; ++dev) s += gmax[dev][k];
    CHECK(std::abs(s - static_cast<double>(k + 1)) < 1e-14);
  }
}

TEST_CASE("value_and_grad through pmax over one axis and pmin over both on a 2x2 mesh splits ties within each group",
          "[nn][autodiff][pmax]") {
  // x: (4, 6) as P<"data", "model">, values from {0, 1, 2} so that ties are common. L =
  // psum<data>(sum(pmax<model>(x))) + 3 sum(pmin<data, model>(x)): on device d at k, 1 / c where
  // x equals the max over d's model group (c devices of it hold it), plus 3 / c' where it equals
  // the min over all four devices (c' devices hold it). Reference computed on the host.
  const mesh2 m{2, 2};
  auto value_at = [](std::size_t dev, std::size_t k) { return static_cast<double>((dev * 5 + k * 7 + dev * k) % 3); };
  std::vector<double> values(4);
  std::vector<std::vector<double>> gs(4);
  meshlib::spmd(m, [&](std::size_t dev) {
    x2_t x(std::array<std::size_t, 2>{2, 3}, m, dev);
    for (std::size_t k = 0; k < 6; ++k) x.data()[k] = value_at(dev, k);
    auto [value, dx] = nn::value_and_grad([](const auto& a) {
      auto mx = nn::pmax<"model">(a);             // varies over data
      auto mn = nn::pmin<"data", "model">(a);     // invariant
      return nn::psum<"data">(nn::sum<0>(nn::sum<1>(mx))) + nn::sum<0>(nn::sum<1>(mn)) * 3.0;
    })(x);
    static_assert(std::is_same_v<decltype(dx), x2_t>);
    values[dev] = host(value)[0];
    gs[dev] = host(dx);
  });
  double expected_value = 0;
  for (std::size_t k = 0; k < 6; ++k) {
    double mn = value_at(0, k);
    for (std::size_t d = 1; d < 4; ++d) mn = std::min(mn, value_at(d, k));
    expected_value += 3 * mn;
    for (std::size_t row = 0; row < 2; ++row) expected_value += std::max(value_at(2 * row, k), value_at(2 * row + 1, k));
  }
  for (std::size_t dev = 0; dev < 4; ++dev) {
    INFO("device " << dev);
    CHECK(values[dev] == expected_value);
    REQUIRE(gs[dev].size() == 6);
    for (std::size_t k = 0; k < 6; ++k) {
      const double v = value_at(dev, k);
      const std::size_t first = 2 * (dev / 2);  // the model group: devices first, first + 1
      const double mx = std::max(value_at(first, k), value_at(first + 1, k));
      const double c = (value_at(first, k) == mx ? 1.0 : 0.0) + (value_at(first + 1, k) == mx ? 1.0 : 0.0);
      double mn = value_at(0, k), c_min = 0;
      for (std::size_t d = 1; d < 4; ++d) mn = std::min(mn, value_at(d, k));
      for (std::size_t d = 0; d < 4; ++d) c_min += value_at(d, k) == mn ? 1.0 : 0.0;
      const double expected = (v == mx ? 1 / c : 0.0) + (v == mn ? 3 / c_min : 0.0);
      INFO("element " << k);
      CHECK(std::abs(gs[dev][k] - expected) < 1e-15);
    }
  }
  // the values do tie across devices: some element is held by both devices of a model group
  bool tie = false;
  for (std::size_t k = 0; k < 6; ++k) tie = tie || value_at(0, k) == value_at(1, k) || value_at(2, k) == value_at(3, k);
  CHECK(tie);
}

TEST_CASE("value_and_grad of programs through pmax and pmin on a 1-D mesh matches finite differences",
          "[nn][autodiff][pmax]") {
  // x: (8, 3) as rows stacked over 4 devices (each block varies over x), w: (3, 4) replicated;
  // random values, so no ties. The exp term is shifted by the pmax (gradient through pvary, then pmax).
  const mesh1 m{4};
  const auto gx0 = random_array(8, 3, 131), gw0 = random_array(3, 4, 132);
  auto loss_fn = [](const auto& x, const auto& w) {
    auto h = nn::matmul(x, w);                                   // (2, 4), varies over x
    auto mx = nn::pmax<"x">(h);                                  // (2, 4), invariant
    auto mn = nn::pmin<"x">(nn::tanh(h));
    auto z = h - nn::pvary<"x">(mx);
    return nn::sum<0>(nn::sum<1>(nn::square(mx) * 0.5 + mn * mx)) + nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::exp(z))));
  };
  auto at = [](std::size_t dev) { return block_at{2 * dev, 0, 2, 3, 3}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<vary1>(m, dev, gl[0], at(dev));
      const auto w = block_of<repl1>(m, dev, gl[1], {0, 0, 3, 4, 4});
      auto [value, g] = nn::value_and_grad<0, 1>(loss_fn)(x, w);
      loss[dev] = host(value)[0];
      if (grads) {
        (*grads)[0][dev] = host(std::get<0>(g));
        (*grads)[1][dev] = host(std::get<1>(g));
      }
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(2, std::vector<std::vector<double>>(4));
  run({gx0, gw0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0, gw0}, grads,
                            {at, [](std::size_t) { return block_at{0, 0, 3, 4, 4}; }});
}

TEST_CASE("value_and_grad through pmax on a 2x2 mesh, with a softmax over classes sharded on model, matches "
          "finite differences",
          "[nn][autodiff][pmax]") {
  // x: (4, 6) as P<"data", "model">: the classes (dimension 1) are split over model. A log-softmax
  // shifted by the row max over the whole row (pmax over model of each block's max, stopped), plus
  // a pmax over model and a pmin over both axes that do carry gradient.
  const mesh2 m{2, 2};
  const auto gx0 = random_array(4, 6, 141);
  auto x_at = [](std::size_t dev) { return block_at{(dev / 2) * 2, (dev % 2) * 3, 2, 3, 6}; };
  auto run = [&](const std::vector<std::vector<double>>& gl, std::vector<std::vector<std::vector<double>>>* grads) {
    std::vector<double> loss(4);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<x2_t>(m, dev, gl[0], x_at(dev));
      auto [value, dx] = nn::value_and_grad([](const auto& a) {
        auto shift = nn::pvary<"model">(nn::stop_gradient(nn::pmax<"model">(nn::max<1>(a))));  // (2,)
        auto z = a - nn::broadcast_in_dim<1>(shift, a);
        auto lse = nn::log(nn::psum<"model">(nn::sum<1>(nn::exp(z))));  // (2,), varies over data
        auto logp = z - nn::broadcast_in_dim<1>(nn::pvary<"model">(lse), z);
        auto t1 = nn::psum<"data", "model">(nn::sum<0>(nn::sum<1>(logp * 0.3)));
        auto mx = nn::pmax<"model">(nn::tanh(a) * 1.3);                  // (2, 3), varies over data
        auto t2 = nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(mx))));
        auto mn = nn::pmin<"data", "model">(nn::square(a) - a);          // (2, 3), invariant
        auto t3 = nn::sum<0>(nn::sum<1>(nn::exp(mn)));
        return t1 + t2 + t3 * 0.5;
      })(x);
      loss[dev] = host(value)[0];
      if (grads) (*grads)[0][dev] = host(dx);
    });
    for (std::size_t dev = 1; dev < 4; ++dev) CHECK(loss[dev] == loss[0]);
    return loss[0];
  };
  std::vector<std::vector<std::vector<double>>> grads(1, std::vector<std::vector<double>>(4));
  run({gx0}, &grads);
  check_against_differences([&](const auto& gl) { return run(gl, nullptr); }, {gx0}, grads, {x_at});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

namespace {

/// Writes `global` into parameter `p`'s blocks, device `dev` holding `where(dev)` (a rank-1
/// parameter as one row).
template <class Param, class Where>
void set_param(Param& p, std::size_t devices, const std::vector<double>& global, Where where) {
  for (std::size_t dev = 0; dev < devices; ++dev) {
    auto l = p.local(dev);
    const block_at b = where(dev);
    REQUIRE(l.size() == b.rows * b.cols);
    for (std::size_t k = 0; k < l.size(); ++k) l.data()[k] = global[b.global_index(k)];
  }
}

/// `got[dev]` and `want[dev]` agree element by element to 1e-5 relative, and `want` is not all ~0
/// (a real gradient, not zeros on both sides).
void check_close(const std::vector<std::vector<double>>& got, const std::vector<std::vector<double>>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t dev = 0; dev < got.size(); ++dev) {
    REQUIRE(got[dev].size() == want[dev].size());
    for (std::size_t e = 0; e < got[dev].size(); ++e) {
      INFO("device " << dev << ", local element " << e << ": " << got[dev][e] << " vs " << want[dev][e]);
      CHECK(std::abs(got[dev][e] - want[dev][e]) <= 1e-5 * (1 + std::abs(want[dev][e])));
    }
    CHECK(std::any_of(want[dev].begin(), want[dev].end(), [](double v) { return std::abs(v) > 1e-4; }));
  }
}

/// A layer's parameter gradient is each device's share of its data: `shares[dev]` summed over the
/// devices of the same `group(dev)` (those holding the same block) is the whole gradient.
template <class Group>
std::vector<std::vector<double>> summed_shares(const std::vector<std::vector<double>>& shares, Group group) {
  std::vector<std::vector<double>> out(shares.size(), std::vector<double>(shares[0].size(), 0.0));
  for (std::size_t dev = 0; dev < shares.size(); ++dev)
    for (std::size_t other = 0; other < shares.size(); ++other)
      if (group(other) == group(dev))
        for (std::size_t e = 0; e < shares[dev].size(); ++e) out[dev][e] += shares[other][e];
  return out;
}

using ids2_t = meshlib::local_tensor<std::int32_t, 1, mesh2, D, 0, meshlib::dim_masks<D>>;     // P<"data">
using xd2_t = meshlib::local_tensor<double, 2, mesh2, D, 0, meshlib::dim_masks<D, 0>>;          // P<"data", none>
using hot2_t = meshlib::local_tensor<double, 2, mesh2, D | M, 0, meshlib::dim_masks<D, M>>;     // P<"data", "model">
constexpr auto model_of = [](std::size_t dev) { return dev % 2; };  // 2x2, row-major: data, then model

}  // namespace

TEST_CASE("embedding and tied_head as primitives: gradients equal the written lookup (2x2)", "[nn][autodiff][layers]") {
  // Vocabulary 8 sharded over model (4 rows a device), 8 tokens sharded over data (4 a device),
  // width 3. Written: the lookup as one-hot(ids) E (the one-hot's columns this device's vocabulary
  // range) completed by a psum over model; the tied head as x E^T. L = sum of tanh(.)^2 over the
  // global output. Ids repeat within a device and across the data axis.
  const mesh2 m{2, 2};
  const std::size_t vocab = 8, f = 3, tokens = 8;
  const std::vector<std::int32_t> gids{5, 1, 5, 7, 0, 3, 5, 6};
  const auto gtable = random_array(vocab, f, 61), gx = random_array(tokens, f, 62);
  const auto table_at = [](std::size_t dev) { return block_at{4 * (dev % 2), 0, 4, 3, 3}; };
  const auto x_at = [](std::size_t dev) { return block_at{4 * (dev / 2), 0, 4, 3, 3}; };
  const auto ids_of = [&](std::size_t dev) {
    ids2_t ids(std::array<std::size_t, 1>{4}, m, dev);
    for (std::size_t i = 0; i < 4; ++i) ids.data()[i] = gids[4 * (dev / 2) + i];
    return ids;
  };
  const auto one_hot = [&](std::size_t dev) {  // (this device's tokens, this device's vocabulary range)
    hot2_t h(std::array<std::size_t, 2>{4, 4}, m, dev);
    for (std::size_t i = 0; i < 4; ++i)
      for (std::size_t v = 0; v < 4; ++v) h.data()[i * 4 + v] = gids[4 * (dev / 2) + i] == static_cast<std::int32_t>(4 * (dev % 2) + v) ? 1.0 : 0.0;
    return h;
  };
  const auto loss_of = [](const auto& y) { return nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(y))))); };
  const auto logits_loss = [](const auto& z) {  // logits sharded over data (rows) and model (vocabulary)
    return nn::psum<"data", "model">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(z)))));
  };
  const auto lookup = [](const auto& hot, const auto& e) { return nn::psum<"model">(nn::matmul(hot, e)); };
  const auto attend = [](const auto& x, const auto& e) { return nn::matmul(x, nn::transpose(e)); };
  using embedding_t = nn::embedding<double, mesh2>;
  const auto fresh_table = [&](embedding_t& tok) { set_param(tok.table, 4, gtable, table_at); };
  std::vector<double> loss_layer(4), loss_written(4);
  std::vector<std::vector<double>> de_layer(4), de_written(4), dx_layer(4), dx_written(4), dids(4);

  SECTION("embedding: the table's gradient; the ids' is zero") {
    embedding_t tok(m, "tok", vocab, f, nn::rng_key{11});
    fresh_table(tok);
    meshlib::spmd(m, [&](std::size_t dev) {
      auto a = nn::value_and_grad([&](const auto& ids) { return loss_of(nn::apply_layer(tok, ids)); })(ids_of(dev));
      auto b = nn::value_and_grad([&](const auto& e) { return loss_of(lookup(one_hot(dev), e)); })(tok.table.local(dev));
      loss_layer[dev] = host(a.value)[0];
      loss_written[dev] = host(b.value)[0];
      const auto ids_grad = host(a.grad);
      dids[dev].assign(ids_grad.begin(), ids_grad.end());
      de_layer[dev] = host(tok.table.grad.local_value(dev));
      de_written[dev] = host(b.grad);
    });
    for (std::size_t dev = 0; dev < 4; ++dev) {
      CHECK(std::abs(loss_layer[dev] - loss_written[dev]) < 1e-10);
      // integer ids have no cotangent: their gradient is zeros (JAX's allow_int), not the ids
      CHECK(dids[dev] == std::vector<double>(4, 0.0));
    }
    check_close(summed_shares(de_layer, model_of), de_written);
  }

  SECTION("tied_head: the input's gradient and the table's") {
    embedding_t tok(m, "tok", vocab, f, nn::rng_key{11});
    fresh_table(tok);
    nn::tied_head<double, mesh2> head(tok);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<xd2_t>(m, dev, gx, x_at(dev));
      auto a = nn::value_and_grad([&](const auto& xs) { return logits_loss(nn::apply_layer(head, xs)); })(x);
      auto b = nn::value_and_grad<0, 1>([&](const auto& xs, const auto& e) { return logits_loss(attend(xs, e)); })(
          x, tok.table.local(dev));
      loss_layer[dev] = host(a.value)[0];
      loss_written[dev] = host(b.value)[0];
      dx_layer[dev] = host(a.grad);
      dx_written[dev] = host(std::get<0>(b.grad));
      de_layer[dev] = host(tok.table.grad.local_value(dev));
      de_written[dev] = host(std::get<1>(b.grad));
    });
    for (std::size_t dev = 0; dev < 4; ++dev) CHECK(std::abs(loss_layer[dev] - loss_written[dev]) < 1e-10);
    check_close(dx_layer, dx_written);
    check_close(summed_shares(de_layer, model_of), de_written);
  }

  SECTION("embedding, then the head tied to it: the table's gradient sums both uses") {
    embedding_t tok(m, "tok", vocab, f, nn::rng_key{11});
    fresh_table(tok);
    nn::tied_head<double, mesh2> head(tok);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto x = block_of<xd2_t>(m, dev, gx, x_at(dev));
      auto a = nn::value_and_grad<0, 1>([&](const auto& ids, const auto& xs) {
        return logits_loss(nn::apply_layer(head, nn::tanh(nn::apply_layer(tok, ids)) + xs));
      })(ids_of(dev), x);
      auto b = nn::value_and_grad<0, 1>([&](const auto& xs, const auto& e) {
        return logits_loss(attend(nn::tanh(lookup(one_hot(dev), e)) + xs, e));
      })(x, tok.table.local(dev));
      loss_layer[dev] = host(a.value)[0];
      loss_written[dev] = host(b.value)[0];
      dx_layer[dev] = host(std::get<1>(a.grad));
      dx_written[dev] = host(std::get<0>(b.grad));
      de_layer[dev] = host(tok.table.grad.local_value(dev));
      de_written[dev] = host(std::get<1>(b.grad));
    });
    for (std::size_t dev = 0; dev < 4; ++dev) CHECK(std::abs(loss_layer[dev] - loss_written[dev]) < 1e-10);
    check_close(dx_layer, dx_written);
    check_close(summed_shares(de_layer, model_of), de_written);
  }
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

namespace {

/// Checks a layer's hand-written backward through `apply_layer` against `value_and_grad` of the
/// same forward written with the traced ops: `L = loss_of(apply_layer(layer, x))` and
/// `loss_of(written(x, p...))`, `x = x_of(dev)` and `p...` the blocks of the parameters in `ps` (a
/// tuple of references to the layer's `parameter`s) on every device of `m`. The losses, the inputs'
/// gradients, and each parameter's gradient (the layer's per-device shares summed over the devices
/// of the same `group`) must agree to 1e-5.
template <class Mesh, class Layer, class Params, class XOf, class Written, class LossOf, class Group>
void check_layer(const Mesh& m, Layer& layer, Params ps, XOf x_of, Written written, LossOf loss_of, Group group) {
  constexpr std::size_t np = std::tuple_size_v<Params>;
  const std::size_t n = m.size();
  std::vector<double> loss_layer(n), loss_written(n);
  std::vector<std::vector<double>> dx_layer(n), dx_written(n);
  std::vector<std::vector<std::vector<double>>> dp_layer(np, std::vector<std::vector<double>>(n)), dp_written = dp_layer;
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = x_of(dev);
    auto a = nn::value_and_grad([&](const auto& xs) { return loss_of(nn::apply_layer(layer, xs)); })(x);
    loss_layer[dev] = host(a.value)[0];
    dx_layer[dev] = host(a.grad);
    const auto f = [&](const auto& xs, const auto&... qs) { return loss_of(written(xs, qs...)); };
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      auto b = nn::value_and_grad<0, (I + 1)...>(f)(x, std::get<I>(ps).local(dev)...);
      loss_written[dev] = host(b.value)[0];
      if constexpr (np == 0) {
        dx_written[dev] = host(b.grad);
      } else {
        dx_written[dev] = host(std::get<0>(b.grad));
        ((dp_written[I][dev] = host(std::get<I + 1>(b.grad))), ...);
        ((dp_layer[I][dev] = host(std::get<I>(ps).grad.local_value(dev))), ...);
      }
    }(std::make_index_sequence<np>{});
  });
  for (std::size_t dev = 0; dev < n; ++dev) CHECK(std::abs(loss_layer[dev] - loss_written[dev]) < 1e-10);
  {
    INFO("the input's gradient");
    check_close(dx_layer, dx_written);
  }
  for (std::size_t k = 0; k < np; ++k) {
    INFO("the gradient of parameter " << k);
    check_close(summed_shares(dp_layer[k], group), dp_written[k]);
  }
}

using cmask2_t = meshlib::local_tensor<double, 2, mesh2, D | M, 0, meshlib::dim_masks<0, 0>>;  // varying, not sharded

/// The causal mask of a sequence of `seq` (1 where `j <= i`) on device `dev`.
cmask2_t causal_mask(const mesh2& m, std::size_t dev, std::size_t seq) {
  cmask2_t c(std::array<std::size_t, 2>{seq, seq}, m, dev);
  for (std::size_t i = 0; i < seq; ++i)
    for (std::size_t j = 0; j < seq; ++j) c.data()[i * seq + j] = j <= i ? 1.0 : 0.0;
  return c;
}

/// `causal_self_attention` written with the traced ops, for a device holding 2 heads of `hd` and
/// 2 sequences of `seq`: the fused projection (columns `[head][q, k, v][head_dim]`, sharded over
/// model), per head and sequence `softmax(mask(Q K^T / sqrt(hd))) V` (the exponentials masked),
/// the heads concatenated, the output projection (rows sharded over model) completed by a psum.
template <class X, class W1, class B1, class W2, class B2>
auto attention_written(const X& x, const W1& wqkv, const B1& bqkv, const W2& wout, const B2& bout, const cmask2_t& mask,
                       std::size_t seq, std::size_t hd) {
  auto y = nn::matmul(x, wqkv);
  auto z = nn::forget_dims<"data", "model">(y + nn::broadcast_in_dim<0>(nn::pvary<"data">(bqkv), y));
  const double scale = 1 / std::sqrt(static_cast<double>(hd));
  const auto head = [&](std::size_t h, std::size_t s) {
    auto rows = nn::slice<0>(z, s * seq, (s + 1) * seq);
    auto q = nn::slice<1>(rows, 3 * h * hd, 3 * h * hd + hd);
    auto k = nn::slice<1>(rows, 3 * h * hd + hd, 3 * h * hd + 2 * hd);
    auto v = nn::slice<1>(rows, 3 * h * hd + 2 * hd, 3 * h * hd + 3 * hd);
    auto sc = nn::matmul(q, nn::transpose(k)) * scale;
    auto e = nn::exp(sc - nn::broadcast_in_dim<1>(nn::stop_gradient(nn::max<1>(sc)), sc)) * mask;
    return nn::matmul(e / nn::broadcast_in_dim<1>(nn::sum<1>(e), e), v);
  };
  auto o = nn::concatenate<1>(nn::concatenate<0>(head(0, 0), head(0, 1)), nn::concatenate<0>(head(1, 0), head(1, 1)));
  auto out = nn::psum<"model">(nn::matmul(o, nn::forget_dims<"model">(wout)));
  return out + nn::broadcast_in_dim<0>(nn::pvary<"data">(bout), out);
}

/// `layer_norm` written with the traced ops (over the features; eps 1e-5), parameters replicated.
template <meshlib::fixed_string Data, class X, class G, class B>
auto layer_norm_written(const X& xs, const G& g, const B& b) {
  const auto row = [](const auto& v, const auto& like) { return nn::broadcast_in_dim<1>(v, like); };
  const auto col = [](const auto& p, const auto& like) { return nn::broadcast_in_dim<0>(nn::pvary<Data>(p), like); };
  auto xc = xs - row(nn::mean<1>(xs), xs);
  auto r = nn::rsqrt(nn::mean<1>(nn::square(xc)) + 1e-5);
  return xc * row(r, xs) * col(g, xs) + col(b, xs);
}

const auto tanh_square_loss2 = [](const auto& y) {  // rows over data
  return nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(y)))));
};

}  // namespace

TEST_CASE("positional_embedding as a primitive: gradients equal x + onehot(pos) W", "[nn][autodiff][layers]") {
  // 16 tokens in sequences of 2, 4 a device over 4 devices, width 3, a table of 3 positions (the
  // last never used): written as x + P W, P the one-hot of each token's position.
  const mesh1 m{4};
  nn::positional_embedding<double, mesh1> pos(m, "pos", 3, 3, 2, nn::rng_key{13});
  set_param(pos.table, 4, random_array(3, 3, 71), [](std::size_t) { return block_at{0, 0, 3, 3, 3}; });
  const auto gx = random_array(16, 3, 72);
  check_layer(
      m, pos, std::tie(pos.table), [&](std::size_t dev) { return block_of<rows1>(m, dev, gx, {4 * dev, 0, 4, 3, 3}); },
      [&](const auto& xs, const auto& w) {
        rows1 p(std::array<std::size_t, 2>{4, 3}, m, xs.device());
        for (std::size_t i = 0; i < 4; ++i)
          for (std::size_t q = 0; q < 3; ++q) p.data()[i * 3 + q] = i % 2 == q ? 1.0 : 0.0;
        return xs + nn::matmul(p, w);
      },
      [](const auto& y) { return nn::psum<"x">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(y))))); },
      [](std::size_t) { return 0; });
}

TEST_CASE("dropout as a primitive: its gradient is the mask times 1/(1-rate), eval the identity",
          "[nn][autodiff][layers]") {
  // A (4, 6) activation sharded over data and model (2x2); rate 0.5 with a fixed key. The mask is
  // computed here from the documented rule (global element (r, c) kept iff uniform(key.fold_in(id),
  // r * 6 + c) >= rate, whichever device holds it), so the test also checks that the mask does not
  // depend on the sharding. Written: x * mask * 2; in evaluation: x.
  const mesh2 m{2, 2};
  const float rate = 0.5f;
  const nn::rng_key key{21};
  nn::dropout<double> drop(m, "drop", rate);
  const auto gx = random_array(4, 6, 81);
  const auto x_at = [](std::size_t dev) { return block_at{2 * (dev / 2), 3 * (dev % 2), 2, 3, 6}; };
  const auto x_of = [&](std::size_t dev) { return block_of<x2_t>(m, dev, gx, x_at(dev)); };
  std::vector<double> gmask(24);
  const nn::rng_key k = key.fold_in(nn::detail::name_id("drop"));
  for (std::size_t e = 0; e < 24; ++e) gmask[e] = nn::uniform(k, e) >= rate ? 1.0 / static_cast<double>(1.0f - rate) : 0.0;
  const auto kept = std::count_if(gmask.begin(), gmask.end(), [](double v) { return v != 0.0; });
  CHECK(kept > 0);
  CHECK(kept < 24);
  const auto loss_of = [](const auto& y) { return nn::psum<"data", "model">(nn::sum<0>(nn::sum<1>(nn::square(nn::tanh(y))))); };
  const auto group = [](std::size_t) { return 0; };
  SECTION("training: the mask of the key") {
    drop.begin_step(key, true);
    check_layer(
        m, drop, std::tuple<>{}, x_of,
        [&](const auto& xs) { return xs * block_of<x2_t>(m, xs.device(), gmask, x_at(xs.device())); }, loss_of, group);
  }
  SECTION("evaluation: the identity") {
    drop.begin_step(key, false);
    check_layer(m, drop, std::tuple<>{}, x_of, [](const auto& xs) { return xs * 1.0; }, loss_of, group);
  }
}

TEST_CASE("causal_self_attention as a primitive: gradients equal the written attention (2x2)",
          "[nn][autodiff][layers]") {
  // Width 8, 4 heads of 2 (2 a device over model), sequences of 3, 12 tokens (2 sequences a device
  // over data); random biases. Every parameter's gradient and the input's.
  const mesh2 m{2, 2};
  const std::size_t seq = 3, hd = 2;
  nn::causal_self_attention<double, mesh2> attn(m, "attn", 8, 4, seq, nn::rng_key{17});
  set_param(attn.qkv.b, 4, random_array(1, 24, 91), [](std::size_t dev) { return block_at{0, 12 * (dev % 2), 1, 12, 24}; });
  set_param(attn.proj.b, 4, random_array(1, 8, 92), [](std::size_t) { return block_at{0, 0, 1, 8, 8}; });
  const auto gx = random_array(12, 8, 93);
  check_layer(
      m, attn, std::tie(attn.qkv.w, attn.qkv.b, attn.proj.w, attn.proj.b),
      [&](std::size_t dev) { return block_of<xd2_t>(m, dev, gx, {6 * (dev / 2), 0, 6, 8, 8}); },
      [&](const auto& xs, const auto& w1, const auto& b1, const auto& w2, const auto& b2) {
        return attention_written(xs, w1, b1, w2, b2, causal_mask(m, xs.device(), seq), seq, hd);
      },
      tanh_square_loss2, model_of);
}

TEST_CASE("transformer_block as a primitive: gradients equal the written block (2x2)", "[nn][autodiff][layers]") {
  // Width 8, 4 heads of 2, an MLP of 16 (8 a device over model), sequences of 3, 12 tokens (2
  // sequences a device over data); random norms and biases. Written: x + attn(ln1(x)), then
  // h + fc2(gelu(fc1(ln2(h)))), fc2 completed by a psum over model.
  const mesh2 m{2, 2};
  const std::size_t seq = 3, hd = 2;
  nn::transformer_block<double, mesh2> blk(m, "h0", 8, 4, 16, seq, nn::rng_key{19});
  const auto whole = [](std::size_t n) { return [n](std::size_t) { return block_at{0, 0, 1, n, n}; }; };
  const auto split = [](std::size_t n) { return [n](std::size_t dev) { return block_at{0, n / 2 * (dev % 2), 1, n / 2, n}; }; };
  auto around_one = random_array(1, 8, 101);
  for (auto& v : around_one) v = 1 + 0.3 * v;
  set_param(blk.ln1.g, 4, around_one, whole(8));
  set_param(blk.ln1.b, 4, random_array(1, 8, 102), whole(8));
  set_param(blk.ln2.g, 4, random_array(1, 8, 103), whole(8));
  set_param(blk.ln2.b, 4, random_array(1, 8, 104), whole(8));
  set_param(blk.attn.qkv.b, 4, random_array(1, 24, 105), split(24));
  set_param(blk.attn.proj.b, 4, random_array(1, 8, 106), whole(8));
  set_param(blk.fc1.b, 4, random_array(1, 16, 107), split(16));
  set_param(blk.fc2.b, 4, random_array(1, 8, 108), whole(8));
  const auto gx = random_array(12, 8, 109);
  const double c = std::sqrt(2.0 / 3.141592653589793);
  check_layer(
      m, blk,
      std::tie(blk.ln1.g, blk.ln1.b, blk.attn.qkv.w, blk.attn.qkv.b, blk.attn.proj.w, blk.attn.proj.b, blk.ln2.g,
               blk.ln2.b, blk.fc1.w, blk.fc1.b, blk.fc2.w, blk.fc2.b),
      [&](std::size_t dev) { return block_of<xd2_t>(m, dev, gx, {6 * (dev / 2), 0, 6, 8, 8}); },
      [&](const auto& xs, const auto& g1, const auto& b1, const auto& wqkv, const auto& bqkv, const auto& wout,
          const auto& bout, const auto& g2, const auto& b2, const auto& w1, const auto& c1, const auto& w2,
          const auto& c2) {
        auto x = nn::forget_dims<"data">(xs);
        auto h = x + attention_written(layer_norm_written<"data">(x, g1, b1), wqkv, bqkv, wout, bout,
                                       causal_mask(m, xs.device(), seq), seq, hd);
        auto u = nn::matmul(layer_norm_written<"data">(h, g2, b2), w1);
        auto a = u + nn::broadcast_in_dim<0>(nn::pvary<"data">(c1), u);
        auto gl = a * 0.5 * (nn::tanh((a + nn::square(a) * a * 0.044715) * c) + 1.0);
        auto z = nn::psum<"model">(nn::matmul(gl, w2));
        return h + z + nn::broadcast_in_dim<0>(nn::pvary<"data">(c2), z);
      },
      tanh_square_loss2, model_of);
}

}  // namespace MESHLIB_TEST_UNIT
