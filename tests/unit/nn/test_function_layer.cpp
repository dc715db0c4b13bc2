// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// nn::function_layer (nn/autodiff/function_layer.hpp): layers written as plain forward code, whose
// backward the tape derives, train through train_step to the losses of the same network built from
// the hand-written layers (dense, relu), on a 1x1 and a 2x1 (data-parallel) mesh, and their
// gradients equal the built-in layers' after one backward.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
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

}  // namespace

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
