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

/// The mean loss of `net` on the problem, and the analytic gradients left in its parameters.
template <class Net>
double loss_and_grad(const mesh_t& m, Net& net, const problem& pr, bool backward) {
  nn::softmax_cross_entropy<double> ce(m);
  std::vector<nn::param_ref<double>> params;
  net.collect(params);
  const auto xs = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{m},
                                     std::array<std::size_t, 2>{batch, in}, pr.x);
  const std::size_t dp = m.axes_size(mesh_t::mask_of<"data">()), rows = batch / dp;
  auto losses = meshlib::spmd(m, [&](std::size_t dev) {
    for (const auto& p : params) std::fill_n(p.grad[dev], p.count[dev], 0.0);
    auto x = xs.local_value(dev);
    auto logits = net.forward(x);
    const std::size_t di = meshlib::axis_index<"data">();
    auto part = ce.forward(logits, std::span<const std::int32_t>(pr.y).subspan(di * rows, rows), batch);
    if (backward) net.template backward<decltype(x)>(ce.backward(logits), true);
    // The devices' shares of the mean, summed over data with the public psum (as a user would).
    using share_t = meshlib::local_tensor<double, 0, mesh_t, mesh_t::mask_of<"data">()>;
    share_t share(std::array<std::size_t, 0>{}, m, dev);
    share() = part.loss;
    return meshlib::psum<"data">(share)();
  });
  for (double l : losses) REQUIRE(std::abs(l - losses[0]) < 1e-12);  // every device agrees
  return losses[0];
}

/// Checks every element of every parameter of `net` against central differences.
template <class Net>
void check_gradients(const mesh_t& m, Net& net, const problem& pr) {
  loss_and_grad(m, net, pr, true);
  std::vector<nn::param_ref<double>> params;
  net.collect(params);
  // Analytic gradient of each global element: the sum of the data replicas' pending sums, counted
  // once per replica along the other axes.
  const meshlib::axis_mask data = mesh_t::mask_of<"data">();
  std::vector<std::vector<double>> analytic;
  for (const auto& p : params) {
    std::size_t total = 1;
    for (auto e : p.shape) total *= e;
    std::vector<double> g(total, 0.0);
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      if (m.group_rank(dev, m.all_axes & ~p.sharded_axes & ~data) != 0) continue;
      for (std::size_t i = 0; i < p.count[dev]; ++i) {
        // local index -> global flat index
        std::size_t rem = i, flat = 0;
        std::vector<std::size_t> idx(p.shape.size());
        for (std::size_t d = p.shape.size(); d-- > 0;) {
          idx[d] = rem % p.extent[dev][d] + p.offset[dev][d];
          rem /= p.extent[dev][d];
        }
        for (std::size_t d = 0; d < p.shape.size(); ++d) flat = flat * p.shape[d] + idx[d];
        g[flat] += p.grad[dev][i];
      }
    }
    analytic.push_back(std::move(g));
  }
  const double h = 1e-5;
  for (std::size_t pi = 0; pi < params.size(); ++pi) {
    const auto& p = params[pi];
    for (std::size_t flat = 0; flat < analytic[pi].size(); ++flat) {
      auto nudge = [&](double by) {  // every device holding the element
        for (std::size_t dev = 0; dev < m.size(); ++dev) {
          std::size_t rem = flat, local = 0, stride = 1;
          bool inside = true;
          for (std::size_t d = p.shape.size(); d-- > 0;) {
            const std::size_t g = rem % p.shape[d];
            rem /= p.shape[d];
            if (g < p.offset[dev][d] || g >= p.offset[dev][d] + p.extent[dev][d]) inside = false;
            local += (g - p.offset[dev][d]) * stride;
            stride *= p.extent[dev][d];
          }
          if (inside) p.value[dev][local] += by;
        }
      };
      nudge(h);
      const double up = loss_and_grad(m, net, pr, false);
      nudge(-2 * h);
      const double down = loss_and_grad(m, net, pr, false);
      nudge(h);
      const double fd = (up - down) / (2 * h);
      INFO(p.name << " element " << flat << " on " << m);
      REQUIRE(std::abs(fd - analytic[pi][flat]) <= 1e-6 * (1.0 + std::abs(fd)));
    }
  }
}

}  // namespace

TEST_CASE("dense, relu, gelu and cross-entropy gradients match finite differences", "[nn][gradients]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{3};
    nn::sequential net(nn::column_dense<double, mesh_t>(m, "c1", in, hidden, key), nn::gelu<double>(m),
                       nn::row_dense<double, mesh_t>(m, "r2", hidden, hidden, key), nn::relu<double>(m),
                       nn::dense<double, mesh_t>(m, "d3", hidden, 5, key));
    check_gradients(m, net, make_problem(5));
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
    check_gradients(m, net, make_problem(6));
  }
}

TEST_CASE("the loss and the gradients do not depend on the mesh", "[nn][gradients]") {
  auto run = [](std::size_t d, std::size_t mo) {
    const mesh_t m{d, mo};
    const nn::rng_key key{5};
    nn::sequential net(nn::column_dense<double, mesh_t>(m, "c1", in, hidden, key), nn::relu<double>(m),
                       nn::row_dense<double, mesh_t>(m, "r2", hidden, 4, key));
    return loss_and_grad(m, net, make_problem(4), false);
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
    const double l = loss_and_grad(m, net, make_problem(3), false);
    if (shape[0] == 1) first = l;
    else CHECK(std::abs(l - first) < 1e-12);  // the same elements dropped on (2, 2) as on one device
    check_gradients(m, net, make_problem(3));
    net.begin_step(key.fold_in(1), false);  // evaluation: dropout is the identity
    CHECK(std::abs(loss_and_grad(m, net, make_problem(3), false) - l) > 1e-6);
  }
}

}  // namespace MESHLIB_TEST_UNIT
