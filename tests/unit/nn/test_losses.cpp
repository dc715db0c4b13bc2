// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Losses other than softmax cross-entropy with train_step, and the trained parameters read back:
// mean_squared_error's value and gradient against the formula and central differences
// (nn::check_gradients) on every sharding of the output; regression training with the same losses
// on every mesh; a user-written loss equal to the built-in one; targets of the wrong shape refused
// naming both shapes; nn::params(state) against an independent SGD step and across meshes.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
constexpr meshlib::axis_mask data_mask = mesh_t::mask_of<"data">();

constexpr std::size_t in = 6, hidden = 16, outs = 4, batch = 16;

/// A learnable regression problem: `rows` rows of `in` features, `outs` targets each, a smooth
/// function of the features.
struct regression {
  std::vector<float> x, t;
};
regression make_regression(std::size_t rows) {
  regression r{std::vector<float>(rows * in), std::vector<float>(rows * outs)};
  for (std::size_t i = 0; i < rows * in; ++i) r.x[i] = static_cast<float>(std::sin(0.61 * static_cast<double>(i) + 0.4));
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < outs; ++j) {
      double s = 0.1 * static_cast<double>(j);
      for (std::size_t k = 0; k < in; ++k) s += 0.5 * r.x[i * in + k] * std::cos(static_cast<double>(3 * j + k));
      r.t[i * outs + j] = static_cast<float>(std::tanh(s));
    }
  return r;
}

/// The built-in loss's value (summed over the data devices' shares) and every device's gradient
/// block placed in the global (rows x cols) array, for outputs `z` sharded as `S`.
template <class S, class T>
std::pair<double, std::vector<T>> mse_on_mesh(const mesh_t& m, const std::vector<T>& z, const std::vector<T>& t,
                                              std::size_t rows, std::size_t cols) {
  const auto zs = meshlib::from_host(S{m}, std::array<std::size_t, 2>{rows, cols}, z);
  std::vector<T> grad(rows * cols, T{-100});
  const std::size_t dp = m.axes_size(data_mask), local_rows = rows / dp;
  const auto shares = meshlib::spmd(m, [&](std::size_t dev) {
    auto zl = zs.local_value(dev);
    decltype(zl) g(zl.shape(), m, dev);
    const std::size_t di = m.group_rank(dev, data_mask);
    const auto part = nn::mean_squared_error<T>{}(
        zl, std::span<const T>(t).subspan(di * local_rows * cols, local_rows * cols), rows, g);
    const auto b = zs.block_of(dev);
    for (std::size_t i = 0; i < g.extent(0); ++i)
      for (std::size_t j = 0; j < g.extent(1); ++j) grad[(b.offset[0] + i) * cols + b.offset[1] + j] = g(i, j);
    return part.loss;
  });
  double total = 0;
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    // Every device of a model group holds its rows' whole share (complete over the columns).
    const std::size_t mr = m.group_rank(dev, m.all_axes & ~data_mask);  // "model" is the inner axis
    CHECK(shares[dev] == shares[dev - mr]);
    if (mr == 0) total += shares[dev];
  }
  return {total, grad};
}

/// A regression MLP whose output layer is column-parallel (its output sharded over "model").
auto mlp(const mesh_t& m) {
  const nn::rng_key key{5};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", in, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::column_dense<float, mesh_t>(m, "fc3", hidden, outs, key));
}

/// The same network with a replicated output layer (a user's loss reads whole rows).
auto mlp_replicated_output(const mesh_t& m) {
  const nn::rng_key key{5};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", in, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, outs, key));
}

/// The user-written loss of nn/loss_function.hpp's example: mean over batch and features of
/// (z - t)^2, with plain loops over a replicated output's block.
struct user_mse {
  using target_type = float;
  template <meshlib::local_tensor_type Z>
  double operator()(const Z& z, std::span<const float> t, std::size_t global_batch, Z& grad) const {
    const std::size_t rows = z.extent(0), cols = z.extent(1);
    const double n = static_cast<double>(global_batch * cols);
    double sum = 0;
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) {
        const double d = static_cast<double>(z(i, j)) - t[i * cols + j];
        sum += d * d;
        grad(i, j) = static_cast<float>(2 * d / n);
      }
    return sum / n;
  }
};

template <class Net, class Loss>
std::vector<double> train_regression(const mesh_t& m, Net net, Loss loss, std::size_t steps,
                                     std::vector<nn::param_array>* params_out = nullptr) {
  const auto data = make_regression(batch * steps);
  nn::train_state state(m, std::move(net), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{5});
  std::vector<double> losses;
  for (std::size_t s = 0; s < steps; ++s) {
    const auto r = nn::train_step(state, std::span<const float>(data.x).subspan(s * batch * in, batch * in),
                                  std::span<const float>(data.t).subspan(s * batch * outs, batch * outs), batch, 0,
                                  batch, loss);
    CHECK(r.rows == batch);
    CHECK(r.correct == 0);
    losses.push_back(r.loss);
  }
  if (params_out != nullptr) *params_out = nn::params(state);
  return losses;
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

void require_close(const std::vector<nn::param_array>& a, const std::vector<nn::param_array>& b, float tol) {
  REQUIRE(a.size() == b.size());
  for (std::size_t p = 0; p < a.size(); ++p) {
    REQUIRE(a[p].name == b[p].name);
    REQUIRE(a[p].shape == b[p].shape);
    REQUIRE(a[p].values.size() == b[p].values.size());
    for (std::size_t e = 0; e < a[p].values.size(); ++e) {
      INFO(a[p].name << " element " << e);
      REQUIRE(std::abs(a[p].values[e] - b[p].values[e]) <= tol * (1.0f + std::abs(b[p].values[e])));
    }
  }
}

/// The cause's what() of the device_error `f` throws, when it is a sharding_error.
template <class F>
std::string device_cause(F&& f) {
  try {
    f();
  } catch (const meshlib::device_error& e) {
    return meshlib_test::message_of<meshlib::sharding_error>([&] { e.rethrow_cause(); });
  }
  return "(no device_error)";
}

}  // namespace

TEST_CASE("mean_squared_error is mean((z - t)^2) over batch and features, gradient 2 (z - t) / (B F), on every "
          "sharding of the output",
          "[nn][loss][mse]") {
  constexpr std::size_t rows = 8, cols = 4;
  std::vector<float> z(rows * cols), t(rows * cols);
  for (std::size_t i = 0; i < z.size(); ++i) {
    z[i] = static_cast<float>(std::sin(0.9 * static_cast<double>(i)));
    t[i] = static_cast<float>(std::cos(0.5 * static_cast<double>(i)) * 0.7);
  }
  double want = 0;
  std::vector<float> want_grad(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    const double d = static_cast<double>(z[i]) - static_cast<double>(t[i]);
    want += d * d / (rows * cols);
    want_grad[i] = static_cast<float>(2 * d / (rows * cols));
  }
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 1}, {1, 2}, {2, 2}, {4, 2}}) {
    const mesh_t m{d, mo};
    INFO("mesh (" << d << ", " << mo << ")");
    const auto check = [&](const std::pair<double, std::vector<float>>& got) {
      CHECK(std::abs(got.first - want) <= 1e-12 * want);
      for (std::size_t i = 0; i < z.size(); ++i) {
        INFO("element " << i);
        CHECK(std::abs(got.second[i] - want_grad[i]) <= 1e-7f * std::abs(want_grad[i]) + 1e-9f);
      }
    };
    // Replicated columns, and columns sharded over "model" (one psum of the partial sums).
    check(mse_on_mesh<meshlib::named_sharding<mesh_t, meshlib::P<"data">>>(m, z, t, rows, cols));
    check(mse_on_mesh<meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>(m, z, t, rows, cols));
  }
}

TEST_CASE("mean_squared_error's gradient matches central differences of its value", "[nn][loss][mse]") {
  constexpr std::size_t rows = 4, cols = 3;
  std::vector<double> z(rows * cols), t(rows * cols);
  for (std::size_t i = 0; i < z.size(); ++i) {
    z[i] = std::sin(1.3 * static_cast<double>(i) + 0.1);
    t[i] = std::cos(0.7 * static_cast<double>(i));
  }
  using S = meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>;
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 3}}) {
    const mesh_t m{d, mo};
    INFO("mesh (" << d << ", " << mo << ")");
    // The outputs as a parameter, each device's block its own (split over both axes): no sum over
    // reduce_axes. The loss is quadratic, so central differences are exact but for rounding.
    nn::parameter<double, 2, S> zp("z", S{m}, {rows, cols}, nn::rng_key{0}, [&z](nn::rng_key, std::uint64_t i) { return z[i]; });
    const std::size_t local_rows = rows / m.axes_size(data_mask);
    const auto r = nn::check_gradients(
        m, std::vector<nn::param_ref<double>>{zp.ref()},
        [&](std::size_t dev, bool backward) {
          auto zl = zp.local(dev);
          decltype(zl) g(zl.shape(), m, dev);
          const std::size_t di = m.group_rank(dev, data_mask);
          const auto part = nn::mean_squared_error<double>{}(
              zl, std::span<const double>(t).subspan(di * local_rows * cols, local_rows * cols), rows, g);
          if (backward)
            for (std::size_t k = 0; k < g.size(); ++k) zp.grad.local(dev).data()[k] += g.data()[k];
          // The rows' share, complete over the columns on every device of a model group.
          meshlib::local_tensor<double, 0, mesh_t, data_mask> share(std::array<std::size_t, 0>{}, m, dev);
          share() = part.loss;
          return meshlib::psum<"data">(share)();
        },
        {.eps = 1e-5, .atol = 1e-8, .rtol = 0});
    CHECK(r.passed);
    CHECK(r.elements == rows * cols);
    CHECK(mse_on_mesh<S>(m, z, t, rows, cols).first > 0);
  }
}

TEST_CASE("regression with mean_squared_error learns and gives the same losses on every mesh",
          "[nn][training][loss][mse]") {
  // The output layer is column-parallel: on a mesh with a model axis the loss reads sharded columns.
  const auto ref = train_regression(mesh_t{1, 1}, mlp(mesh_t{1, 1}), nn::mean_squared_error{}, 8);
  CHECK(ref.back() < 0.5 * ref.front());  // it learns
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{2, 1}, {1, 2}, {2, 2}, {4, 2}}) {
    INFO("mesh (" << d << ", " << mo << ")");
    const mesh_t m{d, mo};
    require_close(train_regression(m, mlp(m), nn::mean_squared_error{}, 8), ref, 1e-5);
  }
}

TEST_CASE("a user-written loss computing the squared error trains as mean_squared_error does",
          "[nn][training][loss][user]") {
  static_assert(nn::loss_function<user_mse, meshlib::local_tensor<float, 2, mesh_t>>);
  static_assert(nn::loss_function<nn::mean_squared_error<float>, meshlib::local_tensor<float, 2, mesh_t>>);
  static_assert(nn::loss_function<nn::softmax_cross_entropy<float>, meshlib::local_tensor<float, 2, mesh_t>>);
  static_assert(!nn::loss_function<int, meshlib::local_tensor<float, 2, mesh_t>>);
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 2}}) {
    INFO("mesh (" << d << ", " << mo << ")");
    const mesh_t m{d, mo};
    std::vector<nn::param_array> builtin_params, user_params;
    const auto builtin =
        train_regression(m, mlp_replicated_output(m), nn::mean_squared_error{}, 5, &builtin_params);
    const auto user = train_regression(m, mlp_replicated_output(m), user_mse{}, 5, &user_params);
    CHECK(builtin.back() < builtin.front());
    require_close(user, builtin, 1e-6);
    require_close(user_params, builtin_params, 1e-6f);
  }
}

TEST_CASE("targets of the wrong shape are refused, naming the loss, both shapes and the fix",
          "[nn][training][loss][errors]") {
  const mesh_t m{2, 1};
  nn::train_state state(m, mlp(m), nn::sgd(nn::constant(0.1f)), {});
  const auto data = make_regression(batch);
  const std::string fix =
      " but the model output has shape (16, 4); give one target per output column (16 x 4 values, row-major) or a "
      "model with as many outputs as target columns; class labels need softmax_cross_entropy";
  // Three targets per row for four outputs.
  const std::vector<float> narrow(batch * 3, 0.5f);
  CHECK(device_cause([&] {
          nn::train_step(state, std::span<const float>(data.x), narrow, batch, 0, batch, nn::mean_squared_error{});
        }) == "meshlib::nn: mean_squared_error: the targets have shape (16, 3)" + fix);
  // Class labels (as floats, one per row) given to the regression loss.
  std::vector<float> labels(batch);
  for (std::size_t i = 0; i < batch; ++i) labels[i] = static_cast<float>(i % outs);
  CHECK(device_cause([&] {
          nn::train_step(state, std::span<const float>(data.x), labels, batch, 0, batch, nn::mean_squared_error{});
        }) == "meshlib::nn: mean_squared_error: the targets have shape (16, 1)" + fix);
  // Not the same number of targets for every row: refused before any device runs.
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_step(state, std::span<const float>(data.x), std::span<const float>(data.t).first(13), batch, 0,
                         batch, nn::mean_squared_error{});
        }) ==
        "meshlib::nn: train_step: 13 target values for 16 rows: give every row the same number of targets (one label "
        "per row for softmax_cross_entropy, one value per output column for mean_squared_error)");
  CHECK(state.step == 0);
  // The right targets then train.
  CHECK(nn::train_step(state, std::span<const float>(data.x), data.t, batch, 0, batch, nn::mean_squared_error{}).loss >
        0);
  CHECK(state.step == 1);
}

TEST_CASE("nn::params reads back every parameter's global values: one SGD step of linear regression by hand",
          "[nn][training][params]") {
  constexpr float lr = 0.25f;
  const auto data = make_regression(batch);
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 2}, {4, 1}}) {
    INFO("mesh (" << d << ", " << mo << ")");
    const mesh_t m{d, mo};
    nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "lin", in, outs, nn::rng_key{9})),
                          nn::sgd(nn::constant(lr), 0.0f), {});
    const auto before = nn::params(state);
    REQUIRE(before.size() == 2);
    CHECK(before[0].name == "lin.w");
    CHECK(before[0].shape == std::vector<std::size_t>{in, outs});
    CHECK(before[1].name == "lin.b");
    CHECK(before[1].shape == std::vector<std::size_t>{outs});
    CHECK(before[1].values == std::vector<float>(outs, 0.0f));  // biases start at zero
    // Independently, in double: z = x W + b, G = 2 (z - t) / (B F), W -= lr x^T G, b -= lr colsum(G).
    const auto& w = before[0].values;
    const auto& b = before[1].values;
    std::vector<double> g(batch * outs);
    for (std::size_t i = 0; i < batch; ++i)
      for (std::size_t j = 0; j < outs; ++j) {
        double z = b[j];
        for (std::size_t k = 0; k < in; ++k) z += static_cast<double>(data.x[i * in + k]) * w[k * outs + j];
        g[i * outs + j] = 2 * (z - data.t[i * outs + j]) / (batch * outs);
      }
    std::vector<double> want_w(w.begin(), w.end()), want_b(b.begin(), b.end());
    for (std::size_t i = 0; i < batch; ++i)
      for (std::size_t j = 0; j < outs; ++j) {
        for (std::size_t k = 0; k < in; ++k) want_w[k * outs + j] -= lr * data.x[i * in + k] * g[i * outs + j];
        want_b[j] -= lr * g[i * outs + j];
      }
    nn::train_step(state, std::span<const float>(data.x), data.t, batch, 0, batch, nn::mean_squared_error{});
    const auto after = nn::params(state);
    REQUIRE(after.size() == 2);
    for (std::size_t e = 0; e < want_w.size(); ++e) {
      INFO("lin.w element " << e);
      CHECK(std::abs(after[0].values[e] - want_w[e]) <= 1e-6 * (1 + std::abs(want_w[e])));
      CHECK(after[0].values[e] != w[e]);  // every weight moved
    }
    for (std::size_t e = 0; e < want_b.size(); ++e) {
      INFO("lin.b element " << e);
      CHECK(std::abs(after[1].values[e] - want_b[e]) <= 1e-6 * (1 + std::abs(want_b[e])));
    }
  }
}

TEST_CASE("nn::params gathers sharded parameters: the global values on any mesh are the (1, 1) mesh's",
          "[nn][training][params]") {
  std::vector<nn::param_array> ref;
  train_regression(mesh_t{1, 1}, mlp(mesh_t{1, 1}), nn::mean_squared_error{}, 3, &ref);
  REQUIRE(ref.size() == 6);
  CHECK(ref[0].name == "fc1.w");
  CHECK(ref[0].shape == std::vector<std::size_t>{in, hidden});
  CHECK(ref[0].sharding == "named_sharding(mesh{'data': 1, 'model': 1}, P<none, \"model\">)");
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{1, 2}, {2, 2}, {2, 4}}) {
    INFO("mesh (" << d << ", " << mo << ")");
    const mesh_t m{d, mo};
    std::vector<nn::param_array> got;
    train_regression(m, mlp(m), nn::mean_squared_error{}, 3, &got);
    CHECK(got[2].sharding == "named_sharding(mesh{'data': " + std::to_string(d) + ", 'model': " + std::to_string(mo) +
                                 "}, P<\"model\", none>)");
    require_close(got, ref, 1e-5f);
  }
}

TEST_CASE("nn::params refuses a parameter whose blocks are on other processes' devices, naming it",
          "[nn][training][params][errors]") {
  // This process's two devices of four, as under mpirun with 2 processes: fc1.w is split over
  // "model", so half of it is elsewhere.
  const mesh_t m{1, 4};
  const std::vector<std::size_t> mine{2, 3};
  nn::train_state state(m, nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", in, 8, nn::rng_key{1}, mine)),
                        nn::sgd(nn::constant(0.1f)), {}, nn::rng_key{1}, mine);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::params(state); }) ==
        "meshlib::nn: params: 24 of the 48 elements of parameter 'fc1.w' are held only by devices of other processes "
        "(this process holds devices {2, 3}); read them where every block is (a train state of every device), or "
        "save_checkpoint and read its global files");
}

}  // namespace MESHLIB_TEST_UNIT
