// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// conv2d's forward algorithms (direct, pointwise at stride 1 and 2, im2col in blocks, and the
// automatic rule), each forced on shapes with padding, stride 2, odd sizes, C_in = 1 and 3, more
// output channels than one direct pass (16) and several im2col blocks: forward, the weight, bias and
// input gradients against plain reference loops written here (not against another algorithm), in
// double and in float, on one and two data-parallel devices; the gradient written over garbage
// when the step says so (several im2col blocks; direct's weight gradient both ways); the rule; the
// error for a pointwise request on a 3x3 kernel.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
using data_rows = meshlib::named_sharding<mesh_t, meshlib::P<"data">>;
using algo = nn::conv2d_algorithm;

/// One convolution to check: input shape, output channels, kernel, stride, padding, bias, images.
struct conv_case {
  nn::image_shape in;
  std::size_t cout, k, s, p;
  bool bias;
  std::size_t batch;
};

/// Values of a fixed irregular sequence.
std::vector<double> values(std::size_t count, double phase) {
  std::vector<double> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = std::sin(0.61 * static_cast<double>(i) + phase) + 0.05 * static_cast<double>(i % 5);
  return v;
}

/// The reference loops: every output pixel, channel and window entry, NHWC input, HWIO weight,
/// zero padding; the backward by the chain rule of the same sum.
struct reference {
  const conv_case& c;
  std::size_t ho, wo;
  explicit reference(const conv_case& cc)
      : c(cc), ho((cc.in.height + 2 * cc.p - cc.k) / cc.s + 1), wo((cc.in.width + 2 * cc.p - cc.k) / cc.s + 1) {}

  /// Calls `f(x index, w index, y index)` for every product term of the convolution.
  template <class F>
  void terms(F f) const {
    const std::size_t h = c.in.height, w = c.in.width, cin = c.in.channels;
    for (std::size_t n = 0; n < c.batch; ++n)
      for (std::size_t oh = 0; oh < ho; ++oh)
        for (std::size_t ow = 0; ow < wo; ++ow)
          for (std::size_t i = 0; i < c.k; ++i)
            for (std::size_t j = 0; j < c.k; ++j) {
              const long ih = static_cast<long>(oh * c.s + i) - static_cast<long>(c.p);
              const long iw = static_cast<long>(ow * c.s + j) - static_cast<long>(c.p);
              if (ih < 0 || iw < 0 || ih >= static_cast<long>(h) || iw >= static_cast<long>(w)) continue;
              for (std::size_t ch = 0; ch < cin; ++ch)
                for (std::size_t o = 0; o < c.cout; ++o)
                  f(((n * h + static_cast<std::size_t>(ih)) * w + static_cast<std::size_t>(iw)) * cin + ch,
                    ((i * c.k + j) * cin + ch) * c.cout + o, ((n * ho + oh) * wo + ow) * c.cout + o);
            }
  }
  std::vector<double> forward(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b) const {
    std::vector<double> y(c.batch * ho * wo * c.cout, 0.0);
    for (std::size_t r = 0; r < y.size(); ++r) y[r] = c.bias ? b[r % c.cout] : 0.0;
    terms([&](std::size_t xi, std::size_t wi, std::size_t yi) { y[yi] += x[xi] * w[wi]; });
    return y;
  }
  std::vector<double> grad_w(const std::vector<double>& x, const std::vector<double>& dy) const {
    std::vector<double> g(c.k * c.k * c.in.channels * c.cout, 0.0);
    terms([&](std::size_t xi, std::size_t wi, std::size_t yi) { g[wi] += x[xi] * dy[yi]; });
    return g;
  }
  std::vector<double> grad_b(const std::vector<double>& dy) const {
    std::vector<double> g(c.cout, 0.0);
    for (std::size_t r = 0; r < dy.size(); ++r) g[r % c.cout] += dy[r];
    return g;
  }
  std::vector<double> grad_x(const std::vector<double>& w, const std::vector<double>& dy) const {
    std::vector<double> g(c.batch * c.in.size(), 0.0);
    terms([&](std::size_t xi, std::size_t wi, std::size_t yi) { g[xi] += w[wi] * dy[yi]; });
    return g;
  }
};

void require_close(const std::vector<double>& got, const std::vector<double>& want, double tol, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO(what << " element " << i << ": " << got[i] << " vs " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= tol * (1.0 + std::abs(want[i])));
  }
}

/// Forward and backward of `c` with algorithm `a` in `T` on a (`d`, 1) mesh, against the
/// reference; `overwrite`: the gradients hold NaN and the step asks the layer to overwrite them.
template <class T>
void check_case(const conv_case& c, algo a, std::size_t d, bool overwrite, double tol) {
  const mesh_t m{d, 1};
  nn::conv2d<T, mesh_t> conv(m, "c", c.in, c.cout, c.k, nn::rng_key{5},
                             {.stride = c.s, .padding = c.p, .use_bias = c.bias, .algorithm = a});
  const reference ref(c);
  const std::size_t kk = c.k * c.k * c.in.channels;
  std::vector<nn::param_ref<T>> ps;
  conv.collect(ps);
  REQUIRE(ps.size() == (c.bias ? 2u : 1u));
  // The weight as initialised (the same on every device), and a non-zero bias.
  const std::vector<double> w(ps[0].value[0], ps[0].value[0] + kk * c.cout);
  std::vector<double> b(c.cout);
  for (std::size_t o = 0; o < c.cout; ++o) b[o] = 0.1 * static_cast<double>(o + 1) - 0.4;
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    if (c.bias)
      for (std::size_t o = 0; o < c.cout; ++o) ps[1].value[dev][o] = static_cast<T>(b[o]);
    for (const auto& p : ps) {
      for (std::size_t i = 0; i < p.count[dev]; ++i)
        p.grad[dev][i] = overwrite ? std::numeric_limits<T>::quiet_NaN() : T{0};
      if (overwrite) p.overwrite[dev] = 1;
    }
  }
  const auto xd = values(c.batch * c.in.size(), 0.3);
  const auto dyd = values(c.batch * ref.ho * ref.wo * c.cout, 1.1);
  const std::vector<T> x(xd.begin(), xd.end()), dy(dyd.begin(), dyd.end());
  const std::size_t out_features = ref.ho * ref.wo * c.cout;
  const auto xs = meshlib::from_host(data_rows{m}, std::array<std::size_t, 2>{c.batch, c.in.size()}, x);
  const auto dys = meshlib::from_host(data_rows{m}, std::array<std::size_t, 2>{c.batch, out_features}, dy);
  struct result {
    std::vector<double> y, dx;
  };
  auto blocks = meshlib::spmd(m, [&](std::size_t dev) {
    auto y = conv.forward(xs.local_value(dev));
    result r{std::vector<double>(y.data(), y.data() + y.size()), {}};
    auto dx = conv.backward(dys.local_value(dev), true);
    r.dx.assign(dx.data(), dx.data() + dx.size());
    return r;
  });
  std::vector<double> y, dx, gw(kk * c.cout, 0.0), gb(c.cout, 0.0);
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    y.insert(y.end(), blocks[dev].y.begin(), blocks[dev].y.end());
    dx.insert(dx.end(), blocks[dev].dx.begin(), blocks[dev].dx.end());
    for (std::size_t i = 0; i < gw.size(); ++i) gw[i] += static_cast<double>(ps[0].grad[dev][i]);  // the pending sum
    if (c.bias)
      for (std::size_t o = 0; o < c.cout; ++o) gb[o] += static_cast<double>(ps[1].grad[dev][o]);
  }
  require_close(y, ref.forward(xd, w, b), tol, "y");
  require_close(gw, ref.grad_w(xd, dyd), tol, "dW");
  if (c.bias) require_close(gb, ref.grad_b(dyd), tol, "db");
  require_close(dx, ref.grad_x(w, dyd), tol, "dx");
}

/// Shapes every algorithm that takes them is checked on (batch 4 or 2: the mesh splits it).
const std::vector<conv_case> general_cases{
    {{5, 5, 1}, 3, 3, 1, 1, true, 4},      // C_in = 1, padding: the stem's shape, small
    {{7, 6, 3}, 20, 3, 2, 1, false, 4},    // C_in = 3, stride 2, odd sizes, 16 + 4 output channels
    {{9, 9, 1}, 16, 3, 1, 1, false, 4},    // a row wider than a direct tile, exactly one pass of 16
    {{6, 7, 2}, 33, 3, 1, 0, true, 2},     // no padding, 2 x 16 + 1 output channels
    {{5, 4, 3}, 4, 2, 2, 1, true, 4},      // an even kernel
    {{4, 5, 2}, 3, 3, 1, 2, true, 2},      // padding 2: windows at the corners lie half outside
    {{20, 20, 3}, 5, 3, 1, 1, true, 4},    // 1600 output pixels: several im2col blocks
    {{3, 3, 2}, 17, 1, 1, 1, true, 2},     // 1x1 with padding: border pixels are the bias only
    {{6, 5, 4}, 5, 3, 2, 1, true, 4},      // 36 values: direct's weight gradient through im2col
    {{5, 5, 8}, 16, 3, 1, 1, false, 2},    // 72 values, 16 outputs (direct by the rule)
};
/// 1x1 kernels without padding (every algorithm, pointwise included).
const std::vector<conv_case> pointwise_cases{
    {{5, 7, 3}, 4, 1, 1, 0, true, 4},     // stride 1: the input rows are the patches
    {{7, 5, 3}, 18, 1, 2, 0, false, 4},   // stride 2, odd sizes: a row gather
    {{6, 6, 1}, 2, 1, 2, 0, true, 2},     // C_in = 1
    {{30, 30, 2}, 3, 1, 1, 0, true, 4},   // 3600 output pixels
};

}  // namespace

TEST_CASE("conv2d: every algorithm's forward and gradients equal reference loops", "[nn][conv][conv_algorithms]") {
  for (algo a : {algo::automatic, algo::direct, algo::im2col}) {
    for (const auto& c : general_cases)
      for (std::size_t d : {std::size_t{1}, std::size_t{2}}) {
        INFO("algorithm " << static_cast<int>(a) << ", input " << c.in.to_string() << ", " << c.cout << " outputs, kernel "
                          << c.k << ", stride " << c.s << ", padding " << c.p << ", on " << d << " devices");
        check_case<double>(c, a, d, false, 1e-12);
      }
  }
  for (algo a : {algo::automatic, algo::direct, algo::im2col, algo::pointwise})
    for (const auto& c : pointwise_cases)
      for (std::size_t d : {std::size_t{1}, std::size_t{2}}) {
        INFO("algorithm " << static_cast<int>(a) << ", input " << c.in.to_string() << ", stride " << c.s << ", on " << d
                          << " devices");
        check_case<double>(c, a, d, false, 1e-12);
      }
}

TEST_CASE("conv2d: every algorithm in float (the vector lanes of the direct kernel) within float rounding",
          "[nn][conv][conv_algorithms]") {
  const std::vector<conv_case> cases{
      {{28, 28, 1}, 16, 3, 1, 1, false, 2},  // the flagship's stem
      {{11, 9, 3}, 20, 3, 2, 1, true, 2},
      {{14, 14, 4}, 8, 1, 2, 0, false, 2},
      {{14, 14, 16}, 16, 3, 1, 1, false, 2},  // the flagship's b1.conv (direct by the rule)
  };
  for (algo a : {algo::automatic, algo::direct, algo::im2col})
    for (const auto& c : cases) {
      INFO("algorithm " << static_cast<int>(a) << ", input " << c.in.to_string());
      check_case<float>(c, a, 1, false, 2e-5);
    }
  check_case<float>(cases[2], algo::pointwise, 2, false, 2e-5);
}

TEST_CASE("conv2d: a gradient the step marks for overwriting is written, not added to (NaN before)",
          "[nn][conv][conv_algorithms]") {
  for (algo a : {algo::direct, algo::im2col}) {
    check_case<double>(general_cases[6], a, 1, true, 1e-12);  // several blocks
    check_case<double>(general_cases[8], a, 2, true, 1e-12);  // 36 values per patch
  }
  for (algo a : {algo::pointwise, algo::im2col}) {
    check_case<double>(pointwise_cases[0], a, 2, true, 1e-12);
    check_case<double>(pointwise_cases[1], a, 2, true, 1e-12);
  }
}

TEST_CASE("conv2d: the automatic rule picks pointwise for 1x1 without padding, direct for small patches, else im2col",
          "[nn][conv][conv_algorithms]") {
  const mesh_t m{1, 1};
  const auto pick = [&](nn::image_shape in, std::size_t cout, std::size_t k, nn::conv2d_options o) {
    return nn::conv2d<float, mesh_t>(m, "c", in, cout, k, nn::rng_key{0}, o).algorithm();
  };
  CHECK(pick({28, 28, 1}, 16, 3, {.padding = 1}) == algo::direct);    // 9 values per patch
  CHECK(pick({32, 32, 3}, 64, 3, {.padding = 1}) == algo::direct);    // 27
  CHECK(pick({14, 14, 16}, 16, 3, {.padding = 1}) == algo::direct);   // 144, but 16 output channels
  CHECK(pick({14, 14, 16}, 32, 3, {.padding = 1}) == algo::im2col);
  CHECK(pick({14, 14, 4}, 17, 3, {.padding = 1}) == algo::im2col);    // 36 values, 17 outputs
  CHECK(pick({14, 14, 16}, 32, 1, {.stride = 2}) == algo::pointwise);
  CHECK(pick({14, 14, 16}, 8, 1, {}) == algo::pointwise);
  CHECK(pick({14, 14, 16}, 32, 1, {.padding = 1}) == algo::direct);   // 1x1 with padding: 16 values
  CHECK(pick({14, 14, 64}, 32, 1, {.padding = 1}) == algo::im2col);
  CHECK(pick({14, 14, 64}, 64, 3, {.padding = 1, .algorithm = algo::direct}) == algo::direct);  // as asked
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { (void)pick({14, 14, 16}, 8, 3, {.padding = 1, .algorithm = algo::pointwise}); }) ==
        "meshlib::nn: c (conv2d 3x3, padding 1): the pointwise algorithm needs a 1x1 kernel without padding; use "
        "conv2d_algorithm::im2col, direct or automatic");
  CHECK_THROWS_AS(pick({14, 14, 16}, 8, 1, {.padding = 1, .algorithm = algo::pointwise}), meshlib::sharding_error);
}

}  // namespace MESHLIB_TEST_UNIT
