// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// nn::function_layer (nn/autodiff/function_layer.hpp): layers written as plain forward code, whose
// backward the tape derives, train through train_step to the losses of the same network built from
// the hand-written layers (dense, relu), on a 1x1 and a 2x1 (data-parallel) mesh, and their
// gradients equal the built-in layers' after one backward; a GPT block written as forward code
// trains to the losses of nn::transformer_block.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
using w_sharding = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, meshlib::none>>;
using b_sharding = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none>>;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32;

/// `x w + b` and `relu(x w + b)` written forward only.
struct affine_fn {
  template <class X, class W, class B>
  auto operator()(const X& x, const W& w, const B& b) const {
    auto xw = nn::matmul(x, w);
    return xw + nn::broadcast_in_dim<0>(b, xw);
  }
};
struct affine_relu_fn {
  template <class X, class W, class B>
  auto operator()(const X& x, const W& w, const B& b) const {
    return nn::maximum(affine_fn{}(x, w, b), 0.0f);
  }
};

/// A function_layer with dense's parameters: the same names, shapes, initialisers and decay flags,
/// so the same initial values.
template <class F>
auto written_dense(const mesh_t& m, const std::string& name, std::size_t in, std::size_t out, F f) {
  const nn::rng_key key{11};
  const auto limit = static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out)));
  return nn::function_layer(m, name, f,
                            nn::parameter<float, 2, w_sharding>(name + ".w", w_sharding{m}, {in, out}, key,
                                                                nn::init::uniform(limit)),
                            nn::parameter<float, 1, b_sharding>(name + ".b", b_sharding{m}, {out}, key,
                                                                nn::init::zeros(), false));
}

auto builtin_net(const mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key));
}

auto written_net(const mesh_t& m) {
  return nn::sequential(written_dense(m, "fc1", features, hidden, affine_relu_fn{}),
                        written_dense(m, "fc2", hidden, hidden, affine_relu_fn{}),
                        written_dense(m, "fc3", hidden, classes, affine_fn{}));
}

template <class Net>
std::vector<double> train(const mesh_t& m, Net net, std::size_t steps) {
  const auto ds = meshlib_test::synthetic_problem(batch * steps, features, classes);
  nn::train_state state(m, std::move(net), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{11});
  std::vector<double> losses;
  for (std::size_t s = 0; s < steps; ++s)
    losses.push_back(nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                                    std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch)
                         .loss);
  return losses;
}

/// A GPT block (pre-norm: h = x + attn(ln1(x)), y = h + mlp(ln2(h))) written as forward code, the
/// computation of nn::transformer_block: layer norms with eps 1e-5, the fused Q, K, V projection
/// with columns [head][q, k, v][head_dim], causal softmax attention within each sequence, the tanh
/// GELU as x / (1 + exp(-2u)). All sequences of a device attend at once through a block-diagonal
/// causal mask (a constant of zeros and ones), so no row is sliced; the softmax does not subtract
/// the row maximum (small logits here).
struct gpt_block_fn {
  std::size_t seq, heads;

  template <class X, class G, class B>
  static auto norm(const X& x, const G& g, const B& b) {
    auto xc = x - nn::broadcast_in_dim<1>(nn::mean<1>(x), x);
    auto inv = nn::exp(nn::log(nn::mean<1>(nn::square(xc)) + 1e-5f) * -0.5f);  // 1 / sqrt(var + eps)
    return xc * nn::broadcast_in_dim<1>(inv, x) * nn::broadcast_in_dim<0>(g, x) + nn::broadcast_in_dim<0>(b, x);
  }
  template <class X, class W, class B>
  static auto affine(const X& x, const W& w, const B& b) {
    auto xw = nn::matmul(x, w);
    return xw + nn::broadcast_in_dim<0>(b, xw);
  }

  template <class X, class P>
  auto operator()(const X& x, const P& ln1g, const P& ln1b, const auto& qkvw, const P& qkvb, const auto& outw,
                  const P& outb, const P& ln2g, const P& ln2b, const auto& fc1w, const P& fc1b, const auto& fc2w,
                  const P& fc2b) const {
    const std::size_t rows = x.extent(0), width = x.extent(1), hd = width / heads;
    auto qkv = affine(norm(x, ln1g, ln1b), qkvw, qkvb);  // (rows, 3 width)
    using S = typename std::remove_cvref_t<decltype(nn::matmul(qkv, nn::forget_dims<"data">(nn::transpose(qkv))))>::primal_type;
    S mask(std::array<std::size_t, 2>{rows, rows}, x.mesh(), x.device());  // zeros
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = i - i % seq; j <= i; ++j) mask(i, j) = 1.0f;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    auto head = [&](std::size_t h) {
      const std::size_t c = 3 * hd * h;
      auto q = nn::slice<1>(qkv, c, c + hd);
      auto k = nn::forget_dims<"data">(nn::slice<1>(qkv, c + hd, c + 2 * hd));
      auto v = nn::forget_dims<"data">(nn::slice<1>(qkv, c + 2 * hd, c + 3 * hd));
      auto e = nn::exp(nn::matmul(q, nn::transpose(k)) * scale) * mask;  // (rows, rows), causal per sequence
      auto p = e / nn::broadcast_in_dim<1>(nn::sum<1>(e), e);
      return nn::matmul(p, v);  // (rows, hd)
    };
    auto o = head(0);
    for (std::size_t h = 1; h < heads; ++h) o = nn::concatenate<1>(o, head(h));
    auto h1 = x + affine(o, outw, outb);
    auto u = affine(norm(h1, ln2g, ln2b), fc1w, fc1b);
    auto s = (u + u * u * u * 0.044715f) * 0.7978845608028654f;  // sqrt(2 / pi) (u + 0.044715 u^3)
    auto act = u / (nn::exp(s * -2.0f) + 1.0f);
    return h1 + affine(act, fc2w, fc2b);
  }
};

constexpr std::size_t width = 8, n_heads = 2, mlp = 16, seq = 4, sequences = 4, gpt_rows = seq * sequences;

auto builtin_gpt(const mesh_t& m) {
  return nn::sequential(nn::transformer_block<float, mesh_t>(m, "h0", width, n_heads, mlp, seq, nn::rng_key{5}));
}

auto written_gpt(const mesh_t& m) {
  const nn::rng_key key{5};
  auto weight = [&](const std::string& name, std::size_t in, std::size_t out) {
    return nn::parameter<float, 2, w_sharding>(name, w_sharding{m}, {in, out}, key,
                                               nn::init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out)))));
  };
  auto vec = [&](const std::string& name, std::size_t n, float value) {
    return nn::parameter<float, 1, b_sharding>(name, b_sharding{m}, {n}, nn::rng_key{}, nn::init::constant(value), false);
  };
  auto bias = [&](const std::string& name, std::size_t n) {
    return nn::parameter<float, 1, b_sharding>(name, b_sharding{m}, {n}, key, nn::init::zeros(), false);
  };
  return nn::sequential(nn::function_layer(
      m, "h0", gpt_block_fn{seq, n_heads}, vec("h0.ln1.g", width, 1.0f), vec("h0.ln1.b", width, 0.0f),
      weight("h0.attn.qkv.w", width, 3 * width), bias("h0.attn.qkv.b", 3 * width), weight("h0.attn.out.w", width, width),
      bias("h0.attn.out.b", width), vec("h0.ln2.g", width, 1.0f), vec("h0.ln2.b", width, 0.0f),
      weight("h0.mlp.fc1.w", width, mlp), bias("h0.mlp.fc1.b", mlp), weight("h0.mlp.fc2.w", mlp, width),
      bias("h0.mlp.fc2.b", width)));
}

template <class Net>
std::vector<double> train_regression(const mesh_t& m, Net net, std::size_t steps) {
  std::vector<float> x(gpt_rows * width), y(gpt_rows * width);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 0.1));
    y[i] = static_cast<float>(0.5 * std::cos(0.23 * static_cast<double>(i)));
  }
  nn::train_state state(m, std::move(net), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{5});
  std::vector<double> losses;
  for (std::size_t s = 0; s < steps; ++s)
    losses.push_back(nn::train_step(state, std::span<const float>(x), std::span<const float>(y), gpt_rows, 0, gpt_rows,
                                    nn::mean_squared_error{})
                         .loss);
  return losses;
}

/// Megatron's MLP written forward: relu(x w1 + b1) with w1 split by columns over "model", then
/// psum over "model" of h w2 (w2 split by rows) + b2: the computation of column_dense, relu, row_dense.
struct megatron_mlp_fn {
  template <class X, class W1, class B1, class W2, class B2>
  auto operator()(const X& x, const W1& w1, const B1& b1, const W2& w2, const B2& b2) const {
    auto h = nn::maximum(affine_fn{}(x, w1, b1), 0.0f);  // columns sharded over model
    auto y = nn::psum<"model">(nn::matmul(h, w2));
    return y + nn::broadcast_in_dim<0>(b2, y);
  }
};

auto builtin_megatron(const mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, classes, key));
}

auto written_megatron(const mesh_t& m) {
  using col_w = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, "model">>;
  using col_b = meshlib::named_sharding<mesh_t, meshlib::P<"model">>;
  using row_w = meshlib::named_sharding<mesh_t, meshlib::P<"model", meshlib::none>>;
  const nn::rng_key key{11};
  auto limit = [](std::size_t in, std::size_t out) {
    return nn::init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out))));
  };
  return nn::sequential(nn::function_layer(
      m, "mlp", megatron_mlp_fn{},
      nn::parameter<float, 2, col_w>("fc1.w", col_w{m}, {features, hidden}, key, limit(features, hidden)),
      nn::parameter<float, 1, col_b>("fc1.b", col_b{m}, {hidden}, key, nn::init::zeros(), false),
      nn::parameter<float, 2, row_w>("fc2.w", row_w{m}, {hidden, classes}, key, limit(hidden, classes)),
      nn::parameter<float, 1, b_sharding>("fc2.b", b_sharding{m}, {classes}, key, nn::init::zeros(), false)));
}

}  // namespace

TEST_CASE("a tensor-parallel function_layer (Megatron's MLP written forward) trains as column_dense + row_dense",
          "[nn][autodiff][function_layer]") {
  // On 2x2 and 1x2 meshes: the tape puts Megatron's psum of the input's cotangent where the types
  // say, and leaves the weight gradients as each data replica's share, as the layers do.
  for (const mesh_t m : {mesh_t{2, 2}, mesh_t{1, 2}}) {
    INFO("mesh " << m.size() / 2 << "x2");
    const auto builtin = train(m, builtin_megatron(m), 8);
    const auto written = train(m, written_megatron(m), 8);
    REQUIRE(builtin.size() == written.size());
    for (std::size_t s = 0; s < builtin.size(); ++s) {
      INFO("step " << s << ": " << builtin[s] << " vs " << written[s]);
      CHECK(std::abs(builtin[s] - written[s]) <= 1e-5 * std::abs(builtin[s]));
    }
    CHECK(written.back() < written.front());
  }
}

TEST_CASE("a loss written as forward code (function_loss) trains as mean_squared_error", "[nn][autodiff][loss]") {
  // Megatron's MLP on 2x2 (heads of the output complete after row_dense's psum) and 2x1, with 2
  // accumulated micro-batches on one of them: the tape's gradient of the written mean squared
  // error, and the step's loss (each device's rows' share of the value, added over 'data'), are
  // the built-in loss's to float rounding.
  std::vector<float> x(batch * features), y(batch * classes);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.31 * static_cast<double>(i) + 0.2));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(0.5 * std::cos(0.17 * static_cast<double>(i)));
  const auto written = nn::function_loss([](const auto& z, const auto& t, std::size_t n) {
    return nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(z - t)))) * (1.0f / static_cast<float>(n * classes));
  });
  for (const auto& [m, k] : {std::pair{mesh_t{2, 2}, std::size_t{1}}, std::pair{mesh_t{2, 1}, std::size_t{2}}}) {
    INFO("mesh with " << m.size() << " devices, accumulation " << k);
    const auto run = [&](const auto& loss) {
      nn::train_state state(m, builtin_megatron(m), nn::adam(nn::constant(1e-2f)), {.accumulation = k}, nn::rng_key{5});
      std::vector<double> losses;
      for (std::size_t s = 0; s < 6; ++s)
        losses.push_back(
            nn::train_step(state, std::span<const float>(x), std::span<const float>(y), batch, 0, batch, loss).loss);
      return losses;
    };
    const auto builtin = run(nn::mean_squared_error{});
    const auto traced = run(written);
    for (std::size_t s = 0; s < builtin.size(); ++s) {
      INFO("step " << s << ": " << builtin[s] << " vs " << traced[s]);
      CHECK(std::abs(builtin[s] - traced[s]) <= 1e-5 * std::abs(builtin[s]));
    }
    CHECK(traced.back() < traced.front());
  }
  // Targets that are not one per output element: refused before any arithmetic.
  const mesh_t m{2, 1};
  nn::train_state state(m, builtin_megatron(m), nn::adam(nn::constant(1e-2f)));
  const std::vector<float> short_y(batch * (classes - 1));
  CHECK_THROWS_WITH(
      nn::train_step(state, std::span<const float>(x), std::span<const float>(short_y), batch, 0, batch, written),
      Catch::Matchers::Contains("meshlib::nn: function_loss: device ") &&
          Catch::Matchers::Contains("received 48 targets for its 16 rows of 4 outputs; pass one float target per "
                                    "output column of every row"));
}

TEST_CASE("a GPT block written as forward code trains to the losses of nn::transformer_block",
          "[nn][autodiff][function_layer][gpt]") {
  // Tolerance 1e-5 relative (about 3e-8 relative seen on the CPU build): the forward code's softmax
  // does not subtract the row maximum, its rsqrt is exp(-log(v) / 2) and its attention scale is
  // applied after the product, each a float rounding away from the layer's kernels.
  for (const mesh_t m : {mesh_t{1, 1}, mesh_t{2, 1}}) {
    INFO("mesh " << m.size() << "x1");
    const auto builtin = train_regression(m, builtin_gpt(m), 8);
    const auto written = train_regression(m, written_gpt(m), 8);
    REQUIRE(builtin.size() == written.size());
    for (std::size_t s = 0; s < builtin.size(); ++s) {
      INFO("step " << s << ": " << builtin[s] << " vs " << written[s]);
      CHECK(std::abs(builtin[s] - written[s]) <= 1e-5 * std::abs(builtin[s]));
    }
    CHECK(written.back() < written.front());  // it learns
  }
}

TEST_CASE("a function_layer network trains to the losses of the same network of built-in layers",
          "[nn][autodiff][function_layer]") {
  for (const mesh_t m : {mesh_t{1, 1}, mesh_t{2, 1}}) {
    INFO("mesh " << m.size() << "x1");
    const auto builtin = train(m, builtin_net(m), 8);
    const auto written = train(m, written_net(m), 8);
    REQUIRE(builtin.size() == written.size());
    for (std::size_t s = 0; s < builtin.size(); ++s) {
      INFO("step " << s << ": " << builtin[s] << " vs " << written[s]);
      CHECK(std::abs(builtin[s] - written[s]) <= 1e-5 * std::abs(builtin[s]));
    }
    CHECK(written.back() < written.front());  // it learns
  }
}

TEST_CASE("a function_layer's parameters are collected with their names, and its gradients are the built-in layer's",
          "[nn][autodiff][function_layer]") {
  const mesh_t m{2, 1};
  auto written = written_net(m);
  auto builtin = builtin_net(m);
  std::vector<nn::param_ref<float>> wp, bp;
  written.collect(wp);
  builtin.collect(bp);
  REQUIRE(wp.size() == bp.size());
  for (std::size_t i = 0; i < wp.size(); ++i) {
    CHECK(wp[i].name == bp[i].name);
    CHECK(wp[i].shape == bp[i].shape);
    CHECK(wp[i].decay == bp[i].decay);
  }
  // One forward and backward on each device of a batch split over data; the gradients are each
  // device's share (the data-parallel policy sums them), as the built-in layers leave them.
  using x_t = meshlib::local_tensor<float, 2, mesh_t, mesh_t::mask_of<"data">(), 0,
                                    meshlib::dim_masks<mesh_t::mask_of<"data">(), 0>>;
  const auto ds = meshlib_test::synthetic_problem(8, features, classes);
  meshlib::spmd(m, [&](std::size_t dev) {
    x_t x(std::array<std::size_t, 2>{4, features}, m, dev);
    for (std::size_t k = 0; k < x.size(); ++k) x.data()[k] = ds.x[dev * x.size() + k];
    auto yw = written.forward(x);
    auto yb = builtin.forward(x);
    (void)written.backward<x_t>(yw, true);  // the cotangent of sum(y^2) / 2
    (void)builtin.backward<x_t>(yb, true);
  });
  for (std::size_t i = 0; i < wp.size(); ++i)
    for (std::size_t dev = 0; dev < 2; ++dev)
      for (std::size_t k = 0; k < wp[i].count[dev]; ++k) {
        INFO(wp[i].name << " device " << dev << " element " << k);
        CHECK(std::abs(wp[i].grad[dev][k] - bp[i].grad[dev][k]) <= 1e-5f * (1 + std::abs(bp[i].grad[dev][k])));
      }
}

}  // namespace MESHLIB_TEST_UNIT
