// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Every layer's backward against central finite differences of the loss, in double, on one device
// and on a (2, 2) mesh (data x model), so the collectives of the backward pass (psum <-> pvary) are
// exercised by real sharded gradients.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

constexpr std::size_t batch = 8, in = 6, hidden = 8;

struct problem {
  std::vector<double> x;
  std::vector<std::int32_t> y;
  std::size_t classes;
};

problem make_problem(std::size_t classes) {
  problem p{std::vector<double>(batch * in), std::vector<std::int32_t>(batch), classes};
  for (std::size_t i = 0; i < p.x.size(); ++i) p.x[i] = std::sin(0.37 * static_cast<double>(i) + 0.2);
  for (std::size_t i = 0; i < batch; ++i) p.y[i] = static_cast<std::int32_t>((i * 3 + 1) % classes);
  return p;
}

/// The mean loss of `net` on the problem as `nn::check_gradients` runs it on each device: the whole
/// loss (the devices' shares summed over data with the public psum, as a user would), and with
/// `backward` the analytic gradients added into the parameters.
template <class Net>
auto loss_of(const mesh_t& m, Net& net, const problem& pr) {
  const auto xs = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{m},
                                     std::array<std::size_t, 2>{batch, in}, pr.x);
  const std::size_t rows = batch / m.axes_size(mesh_t::mask_of<"data">());
  return [&m, &net, &pr, xs, rows, ce = nn::softmax_cross_entropy<double>(m)](std::size_t dev, bool backward) mutable {
    auto x = xs.local_value(dev);
    auto logits = net.forward(x);
    const std::size_t di = meshlib::axis_index<"data">();
    auto part = ce.forward(logits, std::span<const std::int32_t>(pr.y).subspan(di * rows, rows), batch);
    if (backward) net.template backward<decltype(x)>(ce.backward(logits), true);
    using share_t = meshlib::local_tensor<double, 0, mesh_t, mesh_t::mask_of<"data">()>;
    share_t share(std::array<std::size_t, 0>{}, m, dev);
    share() = part.loss;
    return meshlib::psum<"data">(share)();
  };
}

/// The mean loss of `net` on the problem (the same on every device).
template <class Net>
double loss_and_grad(const mesh_t& m, Net& net, const problem& pr) {
  auto losses = meshlib::spmd(m, [loss = loss_of(m, net, pr)](std::size_t dev) mutable { return loss(dev, false); });
  for (double l : losses) REQUIRE(std::abs(l - losses[0]) < 1e-12);  // every device agrees
  return losses[0];
}

/// Every element of every parameter of `net` against central differences (step 1e-5, within
/// 1e-6 (1 + |numeric|)), on every device that holds it: the weights' gradients are the data
/// replicas' pending sums, summed over "data".
template <class Net>
void check_net(const mesh_t& m, Net& net, const problem& pr) {
  const auto r = nn::check_gradients(m, net, loss_of(m, net, pr),
                                     {.eps = 1e-5, .atol = 1e-6, .rtol = 1e-6, .reduce_axes = {"data"}});
  CHECK(r.passed);
  std::vector<nn::param_ref<double>> params;
  net.collect(params);
  std::size_t elements = 0;
  for (const auto& p : params) {
    std::size_t n = 1;
    for (auto e : p.shape) n *= e;
    elements += n;
  }
  CHECK(r.elements == elements);
}

// ---- nn::check_gradients on a layer of a user's own --------------------------------------------

/// A layer as a user writes one (forward, backward(dy, need_dx), collect), with a backward by hand:
/// `y[r, j] = g[j]^2 x[r, j]`, so `dg[j] = sum_r 2 g[j] x[r, j] dy[r, j]` (a pending sum over the
/// rows' data axis) and `dx = g^2 dy`. `forget_two` is the bug the checker must find.
template <class T, class GSpec, class XSpec>
struct squared_gain {
  using x_type = typename meshlib::sharded_tensor<T, 2, meshlib::named_sharding<mesh_t, XSpec>>::local_type;
  nn::parameter<T, 1, meshlib::named_sharding<mesh_t, GSpec>> g;
  bool forget_two = false;
  std::vector<x_type> saved;  // per device: the last forward's input

  squared_gain(const mesh_t& m, std::size_t features)
      : g("gain.g", meshlib::named_sharding<mesh_t, GSpec>{m}, {features}, nn::rng_key{0},
          [](nn::rng_key, std::uint64_t j) { return 0.5f + 0.25f * static_cast<float>(j); }),
        saved(m.size()) {}

  x_type forward(const x_type& x) {
    saved[x.device()] = x;
    const T* gv = g.value.local(x.device()).data();
    x_type y(x.shape(), x.mesh(), x.device());
    for (std::size_t r = 0; r < x.extent(0); ++r)
      for (std::size_t j = 0; j < x.extent(1); ++j) y(r, j) = gv[j] * gv[j] * x(r, j);
    return y;
  }
  x_type backward(const x_type& dy, bool) {
    const x_type& x = saved[dy.device()];
    const T* gv = g.value.local(dy.device()).data();
    T* dg = g.grad.local(dy.device()).data();
    x_type dx(dy.shape(), dy.mesh(), dy.device());
    for (std::size_t r = 0; r < dy.extent(0); ++r)
      for (std::size_t j = 0; j < dy.extent(1); ++j) {
        dg[j] += (forget_two ? T(1) : T(2)) * gv[j] * x(r, j) * dy(r, j);
        dx(r, j) = gv[j] * gv[j] * dy(r, j);
      }
    return dx;
  }
  void collect(std::vector<nn::param_ref<T>>& out) { out.push_back(g.ref()); }
};

/// The layer's input as a parameter `x` (`x[r, j] = 1 + r + j`), so that its cotangent is checked
/// too, and the loss `sum(y^2) / 2` over the global array: its cotangent is `y`.
template <class T, class GSpec, class XSpec>
struct gain_problem {
  squared_gain<T, GSpec, XSpec> layer;
  nn::parameter<T, 2, meshlib::named_sharding<mesh_t, XSpec>> x;
  std::vector<nn::param_ref<T>> params;

  gain_problem(const mesh_t& m, std::size_t rows, std::size_t features)
      : layer(m, features),
        x("x", meshlib::named_sharding<mesh_t, XSpec>{m}, {rows, features}, nn::rng_key{0},
          [features](nn::rng_key, std::uint64_t i) { return static_cast<float>(1 + i / features + i % features); }) {
    layer.collect(params);
    params.push_back(x.ref());
  }

  auto loss(const mesh_t& m) {
    return [this, &m](std::size_t dev, bool backward) {
      auto y = layer.forward(x.local(dev));
      double part = 0;
      for (T v : meshlib::to_host(y)) part += static_cast<double>(v) * static_cast<double>(v) / 2;
      if (backward) {
        const auto dx = layer.backward(y, true);
        T* gx = x.grad.local(dev).data();
        for (std::size_t k = 0; k < dx.size(); ++k) gx[k] += dx.data()[k];
      }
      // The whole loss: the devices' shares summed over the axes that split y (a block replicated
      // over model is counted once).
      if constexpr ((meshlib::named_sharding<mesh_t, XSpec>::sharded_axes & mesh_t::mask_of<"model">()) != 0) {
        meshlib::local_tensor<double, 0, mesh_t, mesh_t::all_axes> share(std::array<std::size_t, 0>{}, m, dev);
        share() = part;
        return meshlib::psum<"data", "model">(share)();
      } else {
        meshlib::local_tensor<double, 0, mesh_t, mesh_t::mask_of<"data">()> share(std::array<std::size_t, 0>{}, m, dev);
        share() = part;
        return meshlib::psum<"data">(share)();
      }
    };
  }
};

using replicated_gain = gain_problem<double, meshlib::P<meshlib::none>, meshlib::P<"data", meshlib::none>>;
using sharded_gain = gain_problem<double, meshlib::P<"model">, meshlib::P<"data", "model">>;

}  // namespace

TEST_CASE("dense, relu, gelu and cross-entropy gradients match finite differences", "[nn][gradients]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{3};
    nn::sequential net(nn::column_dense<double, mesh_t>(m, "c1", in, hidden, key), nn::gelu<double>(m),
                       nn::row_dense<double, mesh_t>(m, "r2", hidden, hidden, key), nn::relu<double>(m),
                       nn::dense<double, mesh_t>(m, "d3", hidden, 5, key));
    check_net(m, net, make_problem(5));
  }
}

/// relu's branch-free kernels (a bit mask forward, a select backward) against the plain definitions,
/// bit for bit, on the values where a mask could go wrong: signed zeros, infinities, NaNs of both
/// signs, denormals; the cotangents include an infinity and a NaN where x <= 0.
template <class T>
void check_relu_special_values() {
  const mesh_t m{1, 1};
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const T tiny = std::numeric_limits<T>::denorm_min();
  const std::vector<T> x = {T(1.5), T(-2), T(0), -T(0), inf, -inf, nan, -nan, tiny, -tiny, T(3e-30), T(-7)};
  const std::vector<T> dy = {T(2), T(3), T(4), T(5), T(-6), T(7), T(8), T(9), T(10), -T(11), inf, nan};
  const std::size_t n = x.size();
  const meshlib::named_sharding<mesh_t, meshlib::P<"data">> rows{m};
  const auto xs = meshlib::from_host(rows, std::array<std::size_t, 2>{1, n}, x);
  const auto dys = meshlib::from_host(rows, std::array<std::size_t, 2>{1, n}, dy);
  nn::relu<T> act(m);
  std::vector<T> y(n), dx(n);
  meshlib::spmd(m, [&](std::size_t dev) {
    const auto out = act.forward(xs.local_value(dev));
    std::copy_n(out.data(), n, y.begin());
    const auto g = act.backward(dys.local_value(dev));
    std::copy_n(g.data(), n, dx.begin());
  });
  for (std::size_t i = 0; i < n; ++i) {
    INFO("x[" << i << "] = " << x[i] << ", dy = " << dy[i]);
    const T want_y = x[i] > T{0} ? x[i] : T{0}, want_dx = x[i] > T{0} ? dy[i] : T{0};
    CHECK(std::memcmp(&y[i], &want_y, sizeof(T)) == 0);
    CHECK(std::memcmp(&dx[i], &want_dx, sizeof(T)) == 0);
  }
}

TEST_CASE("relu: forward and backward equal the plain definitions bit for bit on special values", "[nn][gradients]") {
  check_relu_special_values<float>();
  check_relu_special_values<double>();
}

TEST_CASE("cross-entropy on class-sharded logits: gradients match finite differences, no gather", "[nn][gradients]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{4};
    // The last layer is column-parallel: the logits' classes are sharded over "model".
    nn::sequential net(nn::dense<double, mesh_t>(m, "d1", in, hidden, key), nn::gelu<double>(m),
                       nn::column_dense<double, mesh_t>(m, "c2", hidden, 6, key));
    check_net(m, net, make_problem(6));
  }
}

TEST_CASE("the loss and the gradients do not depend on the mesh", "[nn][gradients]") {
  auto run = [](std::size_t d, std::size_t mo) {
    const mesh_t m{d, mo};
    const nn::rng_key key{5};
    nn::sequential net(nn::column_dense<double, mesh_t>(m, "c1", in, hidden, key), nn::relu<double>(m),
                       nn::row_dense<double, mesh_t>(m, "r2", hidden, 4, key));
    return loss_and_grad(m, net, make_problem(4));
  };
  const double ref = run(1, 1);
  CHECK(std::abs(run(2, 2) - ref) < 1e-12);
  CHECK(std::abs(run(4, 1) - ref) < 1e-12);
  CHECK(std::abs(run(1, 4) - ref) < 1e-12);
}

TEST_CASE("layer norm and dropout: gradients match finite differences, the dropout mask is mesh-invariant",
          "[nn][gradients]") {
  double first = 0;
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{6};
    nn::sequential net(nn::column_dense<double, mesh_t>(m, "c1", in, hidden, key), nn::dropout<double>(m, "drop", 0.3f),
                       nn::gelu<double>(m), nn::row_dense<double, mesh_t>(m, "r2", hidden, hidden, key),
                       nn::layer_norm<double, mesh_t>(m, "ln", hidden), nn::dense<double, mesh_t>(m, "d3", hidden, 3, key));
    net.begin_step(key.fold_in(1), true);
    const double l = loss_and_grad(m, net, make_problem(3));
    if (shape[0] == 1) first = l;
    else CHECK(std::abs(l - first) < 1e-12);  // the same elements dropped on (2, 2) as on one device
    check_net(m, net, make_problem(3));
    net.begin_step(key.fold_in(1), false);  // evaluation: dropout is the identity
    CHECK(std::abs(loss_and_grad(m, net, make_problem(3)) - l) > 1e-6);
  }
}

TEST_CASE("check_gradients: a user's layer with a correct backward passes, and its result says how close",
          "[nn][gradients][check_gradients]") {
  const mesh_t m{1, 1};
  replicated_gain pb(m, 2, 4);
  const auto r = nn::check_gradients(m, pb.params, pb.loss(m));
  CHECK(r.passed);
  CHECK(r.failures == 0);
  CHECK(r.elements == 4 + 8);
  // L = sum_rj g_j^4 x_rj^2 / 2 is a polynomial: central differences are exact up to h^2 g^2 and rounding.
  CHECK(r.max_abs_error < 1e-6);
  CHECK(r.max_rel_error < 1e-5);
  CHECK_FALSE(r.worst_parameter.empty());
  // The parameters and the gradient blocks are as they were: x restored exactly, g's gradient the backward's.
  for (std::size_t i = 0; i < 8; ++i) CHECK(pb.x.value.local(0).data()[i] == static_cast<double>(1 + i / 4 + i % 4));
  for (std::size_t j = 0; j < 4; ++j) {
    const double g = 0.5 + 0.25 * static_cast<double>(j), s = (1.0 + j) * (1.0 + j) + (2.0 + j) * (2.0 + j);
    CHECK(std::abs(pb.layer.g.grad.local(0).data()[j] - 2 * g * g * g * s) < 1e-12);
  }
  // The model overload collects the layer's parameters itself (only g: the input is held fixed).
  CHECK(nn::check_gradients(m, pb.layer, pb.loss(m)).elements == 4);
}

TEST_CASE("check_gradients: a backward missing a factor 2 is reported with the parameter, element and both values",
          "[nn][gradients][check_gradients]") {
  const mesh_t m{1, 1};
  replicated_gain pb(m, 2, 4);
  pb.layer.forget_two = true;
  // dL/dg_j = 2 g_j^3 sum_r x_rj^2; the worst (largest) is j = 3: g = 1.25, sum = 4^2 + 5^2 = 41,
  // 2 * 1.953125 * 41 = 160.15625 by differences, half of it by the wrong backward.
  CHECK(meshlib_test::message_of<nn::gradient_check_error>([&] { nn::check_gradients(m, pb.params, pb.loss(m)); }) ==
        "meshlib::nn: check_gradients: the gradient of 'gain.g' at [3] on device 0 is 80.0781 by the backward pass "
        "but 160.156 by central differences (eps 1e-6): |difference| 80.0781 > atol 1e-5 + rtol 0.001 * |numeric|; "
        "4 of 12 elements are out of tolerance; check the backward pass that writes 'gain.g'");
  // Without raising: the same finding in the result.
  const auto r = nn::check_gradients(m, pb.params, pb.loss(m), {.raise_exception = false});
  CHECK_FALSE(r.passed);
  CHECK(r.failures == 4);
  CHECK(r.worst_parameter == "gain.g");
  CHECK(r.worst_index == std::vector<std::size_t>{3});
  CHECK(std::abs(r.worst_analytic - 80.078125) < 1e-12);
  CHECK(std::abs(r.worst_numeric - 160.15625) < 1e-6);
  CHECK(std::abs(r.max_abs_error - 80.078125) < 1e-6);
  CHECK(std::abs(r.max_rel_error - 0.5) < 1e-8);
}

TEST_CASE("check_gradients on a (2, 2) mesh: sharded parameter and input compared block by block",
          "[nn][gradients][check_gradients]") {
  const mesh_t m{2, 2};
  {
    // g split over model, x over data and model: g's gradient is each data row-block's share.
    sharded_gain pb(m, 4, 4);
    const auto r = nn::check_gradients(m, pb.params, pb.loss(m), {.reduce_axes = {"data"}});
    CHECK(r.passed);
    CHECK(r.elements == 4 + 16);
    CHECK(r.max_abs_error < 1e-5);
  }
  {
    // Replicated g: its gradient is compared on all 4 devices (after the sum over data).
    replicated_gain pb(m, 4, 4);
    CHECK(nn::check_gradients(m, pb.params, pb.loss(m), {.reduce_axes = {"data"}}).passed);
  }
  {
    // The bug on the mesh: found on the device that holds g[3] (model index 1), named as on one device.
    sharded_gain pb(m, 4, 4);
    pb.layer.forget_two = true;
    const auto r = nn::check_gradients(m, pb.params, pb.loss(m), {.reduce_axes = {"data"}, .raise_exception = false});
    CHECK_FALSE(r.passed);
    CHECK(r.worst_parameter == "gain.g");
    CHECK(r.worst_index == std::vector<std::size_t>{3});
    CHECK(r.worst_device == 1);      // device (data 0, model 1); its data peer 3 holds the same block
    CHECK(r.failures == 4 * 2);      // 4 elements of g, each on 2 devices
  }
  {
    // Forgetting that the data axis holds shares: the message says so.
    sharded_gain pb(m, 4, 4);
    const std::string what =
        meshlib_test::message_of<nn::gradient_check_error>([&] { nn::check_gradients(m, pb.params, pb.loss(m)); });
    CHECK(what.find("check the backward pass that writes 'gain.g' (or, if each device of 'data' holds a share of "
                    "the gradient, name it in reduce_axes)") != std::string::npos);
  }
}

TEST_CASE("check_gradients in float: the looser defaults pass a correct backward and catch a wrong one",
          "[nn][gradients][check_gradients]") {
  const mesh_t m{2, 2};
  gain_problem<float, meshlib::P<"model">, meshlib::P<"data", "model">> pb(m, 4, 4);
  const auto r = nn::check_gradients(m, pb.params, pb.loss(m), {.reduce_axes = {"data"}});
  CHECK(r.passed);
  pb.layer.forget_two = true;
  CHECK_FALSE(nn::check_gradients(m, pb.params, pb.loss(m), {.reduce_axes = {"data"}, .raise_exception = false}).passed);
}

TEST_CASE("check_gradients: bad options and bad inputs say what is wrong and the fix", "[nn][gradients][check_gradients]") {
  const mesh_t m{1, 1};
  replicated_gain pb(m, 2, 4);
  auto what = [&](nn::gradient_check_options<double> o) {
    return meshlib_test::message_of<std::invalid_argument>([&] { nn::check_gradients(m, pb.params, pb.loss(m), o); });
  };
  const std::string defaults = " (the defaults for double: eps 1e-6, atol 1e-5, rtol 0.001)";
  CHECK(what({.eps = 0}) == "meshlib::nn: check_gradients: eps is 0; the central-difference step must be positive "
                            "and finite" + defaults);
  CHECK(what({.eps = -1e-4}) == "meshlib::nn: check_gradients: eps is -1e-4; the central-difference step must be "
                                "positive and finite" + defaults);
  CHECK(what({.eps = std::numeric_limits<double>::infinity()}) ==
        "meshlib::nn: check_gradients: eps is inf; the central-difference step must be positive and finite" + defaults);
  CHECK(what({.atol = -1}) ==
        "meshlib::nn: check_gradients: atol is -1; tolerances must be non-negative and finite" + defaults);
  CHECK(what({.rtol = std::numeric_limits<double>::quiet_NaN()}) ==
        "meshlib::nn: check_gradients: rtol is nan; tolerances must be non-negative and finite" + defaults);
  CHECK(what({.reduce_axes = {"batch"}}) ==
        "meshlib::nn: check_gradients: reduce_axes names 'batch', which mesh{'data': 1, 'model': 1} does not have; "
        "name axes of the mesh (the data axis, whose gradient shares the data-parallel synchronisation adds)");
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          nn::check_gradients(m, std::vector<nn::param_ref<float>>{}, [](std::size_t, bool) { return 0.0; });
        }) == "meshlib::nn: check_gradients: no parameters to check; pass the parameters the loss depends on "
              "(layer.collect(params))");
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          nn::check_gradients(m, pb.params, [](std::size_t, bool) { return std::numeric_limits<double>::quiet_NaN(); });
        }) == "meshlib::nn: check_gradients: the loss is nan at the given parameters; check gradients where the loss "
              "is finite");
  auto no_grad = pb.params;
  no_grad.back().grad = {};  // x without its gradient blocks, as a buffer's view has
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] { nn::check_gradients(m, no_grad, pb.loss(m)); }) ==
        "meshlib::nn: check_gradients: 'x' has no gradient (a buffer, not a trained parameter); leave it out of the "
        "parameters to check");
  gain_problem<float, meshlib::P<meshlib::none>, meshlib::P<"data", meshlib::none>> pf(m, 2, 4);
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          nn::check_gradients(m, pf.params, pf.loss(m), {.eps = 1e-12});
        }) == "meshlib::nn: check_gradients: eps 1e-12 does not move 'gain.g' at [0] (0.5 in float); take a larger eps");
  const mesh_t m4{2, 2};
  replicated_gain pb4(m4, 4, 4);
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          nn::check_gradients(m4, pb4.params, [](std::size_t dev, bool) { return static_cast<double>(dev); });
        }) == "meshlib::nn: check_gradients: the loss is 0 on device 0 but 1 on device 1; the loss function must "
              "return the whole loss on every device (psum the devices' shares over every axis they differ on)");
}

}  // namespace MESHLIB_TEST_UNIT
