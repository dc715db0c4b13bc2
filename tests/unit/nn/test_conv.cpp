// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The convolutional layers (conv2d, pooling, sync batch norm, residual blocks): each forward against
// a plain reference loop written here, each backward (and the input's cotangent) against central
// finite differences of the loss by nn::check_gradients, in double on one device and on
// data-parallel meshes, sync batch norm on several devices equal to batch norm over the global batch
// on one, mesh-invariant training of a tiny conv net, and the messages of bad sizes.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
using data_rows = meshlib::named_sharding<mesh_t, meshlib::P<"data">>;

constexpr std::size_t batch = 4;

/// Distinct, irregular inputs (no ties for max pooling): `count` values of a fixed sequence.
std::vector<double> inputs(std::size_t count, double phase = 0.2) {
  std::vector<double> x(count);
  for (std::size_t i = 0; i < count; ++i) x[i] = std::sin(0.37 * static_cast<double>(i) + phase) + 0.01 * static_cast<double>(i % 7);
  return x;
}

/// The global output of `net.forward` on `x` (batch rows of `features`), gathered from the devices in row order.
template <class Net>
std::vector<double> forward_all(const mesh_t& m, Net& net, const std::vector<double>& x, std::size_t features) {
  const auto xs = meshlib::from_host(data_rows{m}, std::array<std::size_t, 2>{batch, features}, x);
  auto blocks = meshlib::spmd(m, [&](std::size_t dev) {
    auto y = net.forward(xs.local_value(dev));
    return std::vector<double>(y.data(), y.data() + y.size());
  });
  std::vector<double> out;
  const std::size_t model = m.axes_size(mesh_t::mask_of<"model">());
  for (std::size_t dev = 0; dev < m.size(); dev += model) out.insert(out.end(), blocks[dev].begin(), blocks[dev].end());
  return out;
}

void require_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": " << got[i] << " vs " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= tol * (1.0 + std::abs(want[i])));
  }
}

/// Parameter `name` of `net`, as a host vector (device 0's block of a replicated parameter).
template <class Net>
std::vector<double> param_values(Net& net, const std::string& name) {
  std::vector<nn::param_ref<double>> ps;
  net.collect(ps);
  for (const auto& p : ps)
    if (p.name == name) return std::vector<double>(p.value[0], p.value[0] + p.count[0]);
  FAIL("no parameter " << name);
  return {};
}

/// The reference convolution: NHWC input, HWIO weight, zero padding.
std::vector<double> reference_conv(const std::vector<double>& x, const nn::image_shape& in, const std::vector<double>& w,
                                   const std::vector<double>& b, std::size_t cout, std::size_t k, std::size_t s,
                                   std::size_t p) {
  const std::size_t ho = (in.height + 2 * p - k) / s + 1, wo = (in.width + 2 * p - k) / s + 1;
  std::vector<double> y(batch * ho * wo * cout);
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t oh = 0; oh < ho; ++oh)
      for (std::size_t ow = 0; ow < wo; ++ow)
        for (std::size_t o = 0; o < cout; ++o) {
          double acc = b.empty() ? 0.0 : b[o];
          for (std::size_t i = 0; i < k; ++i)
            for (std::size_t j = 0; j < k; ++j)
              for (std::size_t c = 0; c < in.channels; ++c) {
                const long ih = static_cast<long>(oh * s + i) - static_cast<long>(p);
                const long iw = static_cast<long>(ow * s + j) - static_cast<long>(p);
                if (ih < 0 || iw < 0 || ih >= static_cast<long>(in.height) || iw >= static_cast<long>(in.width)) continue;
                acc += x[((n * in.height + static_cast<std::size_t>(ih)) * in.width + static_cast<std::size_t>(iw)) *
                             in.channels + c] *
                       w[((i * k + j) * in.channels + c) * cout + o];
              }
          y[((n * ho + oh) * wo + ow) * cout + o] = acc;
        }
  return y;
}

// ---- gradients, through nn::check_gradients ------------------------------------------------------

/// A network's input (`batch` rows of `features`, split over "data") as a parameter, so that
/// `nn::check_gradients` checks its cotangent along with the weights' gradients.
using input_t = nn::parameter<double, 2, data_rows>;

input_t input_of(const mesh_t& m, std::size_t features) {
  const auto x = inputs(batch * features);
  return input_t("x", data_rows{m}, {batch, features}, nn::rng_key{0}, [&x](nn::rng_key, std::uint64_t i) { return x[i]; });
}

/// The mean cross-entropy of `net`'s output (`classes` logits per row) on `x`, as
/// `nn::check_gradients` runs it on each device: the devices' shares summed over "data"; with
/// `backward`, the weights' gradients and the input's cotangent added into their gradient blocks.
template <class Net>
auto loss_of(const mesh_t& m, Net& net, input_t& x, std::size_t classes) {
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < batch; ++i) y[i] = static_cast<std::int32_t>((i * 3 + 1) % classes);
  const std::size_t rows = batch / m.axes_size(mesh_t::mask_of<"data">());
  return [&m, &net, &x, y = std::move(y), rows, ce = nn::softmax_cross_entropy<double>(m)](std::size_t dev,
                                                                                          bool backward) mutable {
    auto xl = x.local(dev);
    auto logits = net.forward(xl);
    const std::size_t di = meshlib::axis_index<"data">();
    auto part = ce.forward(logits, std::span<const std::int32_t>(y).subspan(di * rows, rows), batch);
    if (backward) {
      const auto dx = net.template backward<decltype(xl)>(ce.backward(logits), true);
      double* gx = x.grad.local(dev).data();
      for (std::size_t k = 0; k < dx.size(); ++k) gx[k] += dx.data()[k];
    }
    using share_t = meshlib::local_tensor<double, 0, mesh_t, mesh_t::mask_of<"data">()>;
    share_t share(std::array<std::size_t, 0>{}, m, dev);
    share() = part.loss;
    return meshlib::psum<"data">(share)();
  };
}

/// Every element of every parameter of `net`, and every input element, against central differences
/// (step 1e-5, within 1e-6 (1 + |numeric|)), on every device that holds it: the weights are
/// replicated, their gradients the data replicas' pending sums, summed over "data".
template <class Net>
void check_net(const mesh_t& m, Net& net, std::size_t features, std::size_t classes) {
  auto x = input_of(m, features);
  std::vector<nn::param_ref<double>> params;
  net.collect(params);
  params.push_back(x.ref());
  const auto r = nn::check_gradients(m, params, loss_of(m, net, x, classes),
                                     {.eps = 1e-5, .atol = 1e-6, .rtol = 1e-6, .reduce_axes = {"data"}});
  CHECK(r.passed);
}

template <class MakeNet>
void check_all_gradients(MakeNet make, std::size_t features, std::size_t classes) {
  for (auto d : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    const mesh_t m{d, 1};
    auto net = make(m);
    check_net(m, net, features, classes);
  }
  const mesh_t m{2, 2};  // replicated over a model axis too
  auto net = make(m);
  check_net(m, net, features, classes);
}

}  // namespace

TEST_CASE("conv2d forward equals a reference convolution (stride, padding, bias)", "[nn][conv]") {
  struct cfg {
    nn::image_shape in;
    std::size_t cout, k, s, p;
    bool bias;
  };
  for (const cfg c : {cfg{{5, 5, 2}, 3, 3, 1, 1, true}, cfg{{6, 5, 3}, 4, 3, 2, 0, true}, cfg{{5, 6, 1}, 2, 2, 2, 1, false},
                      cfg{{4, 4, 2}, 3, 1, 1, 0, true}, cfg{{7, 7, 2}, 2, 3, 2, 1, false}}) {
    for (auto d : {std::size_t{1}, std::size_t{2}}) {
      const mesh_t m{d, 1};
      nn::conv2d<double, mesh_t> conv(m, "c", c.in, c.cout, c.k, nn::rng_key{7}, {.stride = c.s, .padding = c.p, .use_bias = c.bias});
      std::vector<nn::param_ref<double>> ps;
      conv.collect(ps);
      CHECK(ps.size() == (c.bias ? 2u : 1u));
      std::vector<double> b;
      if (c.bias) {  // a non-zero bias, so the test sees it added
        for (std::size_t o = 0; o < c.cout; ++o) ps[1].value[0][o] = 0.1 * static_cast<double>(o + 1);
        if (d == 2)
          for (std::size_t o = 0; o < c.cout; ++o) ps[1].value[1][o] = 0.1 * static_cast<double>(o + 1);
        b = param_values(conv, "c.b");
      }
      const auto x = inputs(batch * c.in.size());
      const auto want = reference_conv(x, c.in, param_values(conv, "c.w"), b, c.cout, c.k, c.s, c.p);
      CHECK(conv.output_shape().size() * batch == want.size());
      require_close(forward_all(m, conv, x, c.in.size()), want, 1e-12);
    }
  }
}

TEST_CASE("conv2d gradients match finite differences on 1, 2 and 4 data-parallel devices", "[nn][conv][gradients]") {
  const nn::image_shape in{5, 4, 2};
  check_all_gradients(
      [&](const mesh_t& m) {
        nn::conv2d<double, mesh_t> c1(m, "c1", in, 3, 3, nn::rng_key{1}, {.stride = 2, .padding = 1});
        nn::conv2d<double, mesh_t> c2(m, "c2", c1.output_shape(), 2, 2, nn::rng_key{1}, {.use_bias = false});
        return nn::sequential(c1, c2);
      },
      in.size(), 2);
}

// ---- pooling -------------------------------------------------------------------------------------

namespace {
/// The reference pooling (`max` or mean over each window, no padding).
std::vector<double> reference_pool(const std::vector<double>& x, const nn::image_shape& in, std::size_t k, std::size_t s,
                                   bool max) {
  const std::size_t ho = (in.height - k) / s + 1, wo = (in.width - k) / s + 1, c = in.channels;
  std::vector<double> y(batch * ho * wo * c);
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t oh = 0; oh < ho; ++oh)
      for (std::size_t ow = 0; ow < wo; ++ow)
        for (std::size_t ch = 0; ch < c; ++ch) {
          double acc = max ? -1e300 : 0.0;
          for (std::size_t i = 0; i < k; ++i)
            for (std::size_t j = 0; j < k; ++j) {
              const double v = x[((n * in.height + oh * s + i) * in.width + ow * s + j) * c + ch];
              acc = max ? std::max(acc, v) : acc + v / static_cast<double>(k * k);
            }
          y[((n * ho + oh) * wo + ow) * c + ch] = acc;
        }
  return y;
}

std::size_t gap_classes = 3;

/// The global-batch batch norm of `x` (rows of images of shape `in`) with scale 1, shift 0.
std::vector<double> reference_batch_norm(const std::vector<double>& x, const nn::image_shape& in, double eps,
                                         std::vector<double>* mean_out = nullptr, std::vector<double>* var_out = nullptr) {
  const std::size_t c = in.channels, np = x.size() / c;
  std::vector<double> mean(c, 0.0), var(c, 0.0), y(x.size());
  for (std::size_t i = 0; i < np; ++i)
    for (std::size_t j = 0; j < c; ++j) mean[j] += x[i * c + j] / static_cast<double>(np);
  for (std::size_t i = 0; i < np; ++i)
    for (std::size_t j = 0; j < c; ++j) var[j] += (x[i * c + j] - mean[j]) * (x[i * c + j] - mean[j]) / static_cast<double>(np);
  for (std::size_t i = 0; i < np; ++i)
    for (std::size_t j = 0; j < c; ++j) y[i * c + j] = (x[i * c + j] - mean[j]) / std::sqrt(var[j] + eps);
  if (mean_out != nullptr) *mean_out = mean;
  if (var_out != nullptr) *var_out = var;
  return y;
}
}  // namespace

TEST_CASE("max, average and global average pooling equal reference loops", "[nn][conv]") {
  for (auto d : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    const mesh_t m{d, 1};
    const nn::image_shape in{5, 6, 3};
    const auto x = inputs(batch * in.size());
    for (auto [k, s] : {std::pair<std::size_t, std::size_t>{2, 2}, {3, 1}, {3, 2}, {1, 1}}) {
      INFO("window " << k << " stride " << s << " on " << m);
      nn::max_pool2d<double, mesh_t> mp(m, "mp", in, k, s);
      nn::avg_pool2d<double, mesh_t> ap(m, "ap", in, k, s);
      CHECK(mp.output_shape() == nn::image_shape{(5 - k) / s + 1, (6 - k) / s + 1, 3});
      require_close(forward_all(m, mp, x, in.size()), reference_pool(x, in, k, s, true), 1e-14);
      require_close(forward_all(m, ap, x, in.size()), reference_pool(x, in, k, s, false), 1e-14);
    }
    nn::max_pool2d<double, mesh_t> dflt(m, "mp", in, 2);  // stride defaults to the window
    CHECK(dflt.output_shape() == nn::image_shape{2, 3, 3});
    nn::global_avg_pool<double, mesh_t> gap(m, "gap", in);
    CHECK(gap.out_features() == 3);
    std::vector<double> means(batch * 3, 0.0);  // per image and channel, over its 30 pixels
    for (std::size_t n = 0; n < batch; ++n)
      for (std::size_t q = 0; q < 30; ++q)
        for (std::size_t c = 0; c < 3; ++c) means[n * 3 + c] += x[(n * 30 + q) * 3 + c] / 30.0;
    require_close(forward_all(m, gap, x, in.size()), means, 1e-14);
  }
}

TEST_CASE("pooling gradients match finite differences on 1, 2 and 4 data-parallel devices", "[nn][conv][gradients]") {
  const nn::image_shape in{5, 5, 2};
  // Overlapping max windows (a pixel in several windows), then the global average and a classifier.
  check_all_gradients(
      [&](const mesh_t& m) {
        nn::conv2d<double, mesh_t> c(m, "c", in, 3, 3, nn::rng_key{2}, {.padding = 1});
        nn::max_pool2d<double, mesh_t> mp(m, "mp", c.output_shape(), 3, 2);
        return nn::sequential(c, mp, nn::global_avg_pool<double, mesh_t>(m, "gap", mp.output_shape()),
                              nn::dense<double, mesh_t>(m, "fc", 3, gap_classes, nn::rng_key{2}));
      },
      in.size(), gap_classes);
  // Overlapping average windows, then non-overlapping max windows.
  check_all_gradients(
      [&](const mesh_t& m) {
        nn::conv2d<double, mesh_t> c(m, "c", in, 3, 2, nn::rng_key{3});
        nn::avg_pool2d<double, mesh_t> ap(m, "ap", c.output_shape(), 2, 1);
        nn::max_pool2d<double, mesh_t> mp(m, "mp", ap.output_shape(), 2);
        return nn::sequential(c, ap, mp, nn::dense<double, mesh_t>(m, "fc", mp.out_features(), gap_classes, nn::rng_key{3}));
      },
      in.size(), gap_classes);
}

// ---- batch norm ----------------------------------------------------------------------------------

TEST_CASE("sync batch norm on 2 and 4 devices equals batch norm over the global batch on one", "[nn][conv][batch_norm]") {
  const nn::image_shape in{3, 2, 4};
  const auto x = inputs(batch * in.size(), 0.9);
  std::vector<double> mean, var;
  const auto want = reference_batch_norm(x, in, 1e-5, &mean, &var);
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 1}, {4, 1}, {2, 2}}) {
    const mesh_t m{d, mo};
    INFO("on " << m);
    nn::batch_norm<double, mesh_t> bn(m, "bn", in);
    require_close(forward_all(m, bn, x, in.size()), want, 1e-12);
    // Running statistics: one step of momentum 0.1 from (0, 1), the variance unbiased, the same on every device.
    const double count = static_cast<double>(batch * in.pixels());
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      const double* run_mean = bn.running_mean().local(dev).data();
      const double* run_var = bn.running_var().local(dev).data();
      for (std::size_t j = 0; j < in.channels; ++j) {
        CHECK(std::abs(run_mean[j] - 0.1 * mean[j]) < 1e-12);
        CHECK(std::abs(run_var[j] - (0.9 + 0.1 * var[j] * count / (count - 1))) < 1e-12);
      }
    }
    // Evaluation: the running statistics replace the batch's.
    bn.begin_step(nn::rng_key{}, false);
    CHECK_FALSE(bn.training());
    std::vector<double> eval(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::size_t j = i % in.channels;
      eval[i] = (x[i] - 0.1 * mean[j]) / std::sqrt(0.9 + 0.1 * var[j] * count / (count - 1) + 1e-5);
    }
    require_close(forward_all(m, bn, x, in.size()), eval, 1e-12);
  }
}

TEST_CASE("sync batch norm in float agrees with the global batch to 1e-5 relative", "[nn][conv][batch_norm]") {
  const nn::image_shape in{4, 4, 8};
  const auto xd = inputs(batch * in.size(), 0.4);
  const auto want = reference_batch_norm(xd, in, 1e-5);
  const std::vector<float> x(xd.begin(), xd.end());
  for (auto d : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    const mesh_t m{d, 1};
    nn::batch_norm<float, mesh_t> bn(m, "bn", in);
    const auto xs = meshlib::from_host(data_rows{m}, std::array<std::size_t, 2>{batch, in.size()}, x);
    auto blocks = meshlib::spmd(m, [&](std::size_t dev) {
      auto y = bn.forward(xs.local_value(dev));
      return std::vector<float>(y.data(), y.data() + y.size());
    });
    std::vector<double> got;
    for (const auto& b : blocks) got.insert(got.end(), b.begin(), b.end());
    INFO("on " << m);
    require_close(got, want, 1e-5);
  }
}

TEST_CASE("batch norm gradients (images and plain features) match finite differences on 1, 2 and 4 devices",
          "[nn][conv][batch_norm][gradients]") {
  const nn::image_shape in{4, 3, 2};
  check_all_gradients(
      [&](const mesh_t& m) {
        nn::conv2d<double, mesh_t> c(m, "c", in, 3, 3, nn::rng_key{4}, {.padding = 1, .use_bias = false});
        return nn::sequential(c, nn::batch_norm<double, mesh_t>(m, "bn", c.output_shape()), nn::relu<double>(m),
                              nn::global_avg_pool<double, mesh_t>(m, "gap", c.output_shape()),
                              nn::dense<double, mesh_t>(m, "fc", 3, gap_classes, nn::rng_key{4}),
                              nn::batch_norm<double, mesh_t>(m, "bn1d", gap_classes));
      },
      in.size(), gap_classes);
}

TEST_CASE("batch norm in evaluation mode: gradients of the affine map match finite differences", "[nn][conv][batch_norm][gradients]") {
  const nn::image_shape in{3, 3, 2};
  for (auto d : {std::size_t{1}, std::size_t{2}}) {
    const mesh_t m{d, 1};
    nn::conv2d<double, mesh_t> c(m, "c", in, 3, 2, nn::rng_key{5});
    nn::sequential net(c, nn::batch_norm<double, mesh_t>(m, "bn", c.output_shape()),
                       nn::dense<double, mesh_t>(m, "fc", c.out_features(), gap_classes, nn::rng_key{5}));
    (void)forward_all(m, net, inputs(batch * in.size()), in.size());  // running statistics away from (0, 1)
    net.begin_step(nn::rng_key{}, false);
    check_net(m, net, in.size(), gap_classes);
  }
}

// ---- residual connections and the ResNet block ---------------------------------------------------

TEST_CASE("residual: y = main(x) + x (its backward: the basic-block gradients below)", "[nn][conv][residual]") {
  const mesh_t m{2, 1};
  const nn::image_shape in{3, 3, 2};
  nn::conv2d<double, mesh_t> c(m, "c", in, 2, 3, nn::rng_key{6}, {.padding = 1});
  auto res = nn::make_residual<double>(m, c);
  CHECK(res.in_features() == in.size());
  const auto x = inputs(batch * in.size());
  auto want = reference_conv(x, in, param_values(c, "c.w"), param_values(c, "c.b"), 2, 3, 1, 1);
  for (std::size_t i = 0; i < want.size(); ++i) want[i] += x[i];
  require_close(forward_all(m, res, x, in.size()), want, 1e-12);
}

TEST_CASE("ResNet basic blocks (identity and projection shortcuts): gradients match finite differences",
          "[nn][conv][residual][gradients]") {
  const nn::image_shape in{4, 4, 2};
  check_all_gradients(
      [&](const mesh_t& m) {
        nn::conv2d<double, mesh_t> stem(m, "stem", in, 3, 3, nn::rng_key{8}, {.padding = 1, .use_bias = false});
        nn::basic_block<double, mesh_t> b1(m, "b1", stem.output_shape(), 3, 1, nn::rng_key{8});
        nn::basic_block<double, mesh_t> b2(m, "b2", b1.output_shape(), 4, 2, nn::rng_key{8});
        CHECK(b2.output_shape() == nn::image_shape{2, 2, 4});
        CHECK(b1.to_string() == "b1 (basic_block 4x4x3 -> 4x4x3, identity shortcut)");
        CHECK(b2.to_string() == "b2 (basic_block 4x4x3 -> 2x2x4, projection shortcut)");
        return nn::sequential(stem, nn::batch_norm<double, mesh_t>(m, "stem_bn", stem.output_shape()), nn::relu<double>(m),
                              b1, b2, nn::global_avg_pool<double, mesh_t>(m, "gap", b2.output_shape()),
                              nn::dense<double, mesh_t>(m, "fc", 4, gap_classes, nn::rng_key{8}));
      },
      in.size(), gap_classes);
}

// ---- training ------------------------------------------------------------------------------------

namespace {
constexpr nn::image_shape train_image{6, 6, 1};
constexpr std::size_t train_classes = 4, train_batch = 16;

auto make_conv_net(const mesh_t& m) {
  const nn::rng_key key{12};
  nn::conv2d<float, mesh_t> stem(m, "stem", train_image, 4, 3, key, {.padding = 1, .use_bias = false});
  nn::basic_block<float, mesh_t> b1(m, "b1", stem.output_shape(), 8, 2, key);
  return nn::sequential(stem, nn::batch_norm<float, mesh_t>(m, "stem_bn", stem.output_shape()), nn::relu<float>(m), b1,
                        nn::max_pool2d<float, mesh_t>(m, "pool", b1.output_shape(), 2, 1),
                        nn::global_avg_pool<float, mesh_t>(m, "gap", {2, 2, 8}),
                        nn::dense<float, mesh_t>(m, "fc", 8, train_classes, key));
}

std::vector<double> train_conv(const mesh_t& m, std::size_t steps) {
  const auto ds = meshlib_test::synthetic_problem(train_batch * steps, train_image.size(), train_classes);
  nn::train_state state(m, make_conv_net(m), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{12});
  std::vector<double> losses;
  for (std::size_t s = 0; s < steps; ++s)
    losses.push_back(nn::train_step(state,
                                    std::span<const float>(ds.x).subspan(s * train_batch * train_image.size(),
                                                                         train_batch * train_image.size()),
                                    std::span<const std::int32_t>(ds.y).subspan(s * train_batch, train_batch), train_batch,
                                    0, train_batch)
                         .loss);
  // Evaluation: batch norms switch to their running statistics, equal on every device and mesh.
  losses.push_back(nn::evaluate(state, ds, 24).loss);
  return losses;
}
}  // namespace

TEST_CASE("a tiny ResNet trains to the same per-step losses on (1, 1), (2, 1), (4, 1), (1, 2), (2, 2), and evaluates alike",
          "[nn][conv][training]") {
  const auto ref = train_conv(mesh_t{1, 1}, 5);  // 5 training losses, then the evaluation loss
  CHECK(ref[4] < ref[0]);                        // it learns
  // Data parallel, and replicated over a model axis (each model device computes the same block).
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{2, 1}, {4, 1}, {1, 2}, {2, 2}}) {
    const auto got = train_conv(mesh_t{d, mo}, 5);
    for (std::size_t i = 0; i < ref.size(); ++i) {
      INFO("step " << i << " on (" << d << ", " << mo << "): " << got[i] << " vs " << ref[i]);
      REQUIRE(std::abs(got[i] - ref[i]) <= 1e-5 * std::abs(ref[i]));
    }
  }
}

// ---- bad sizes -----------------------------------------------------------------------------------

namespace {
template <class Body>
std::string device_cause(const mesh_t& m, Body&& body) {
  try {
    meshlib::spmd(m, [&](std::size_t dev) { body(dev); });
  } catch (const meshlib::device_error& e) {
    return meshlib_test::message_of<meshlib::sharding_error>([&] { e.rethrow_cause(); });
  }
  return "(no exception)";
}
auto image_rows(const mesh_t& m, std::size_t features) {
  return meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{m}, std::array<std::size_t, 2>{batch, features},
                            std::vector<float>(batch * features, 0.5f));
}
}  // namespace

TEST_CASE("a convolution or pooling window larger than its input is refused, naming the sizes and the fix",
          "[nn][conv][errors]") {
  const mesh_t m{2, 1};
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::conv2d<float, mesh_t>(m, "c", {2, 3, 1}, 4, 5, nn::rng_key{});
        }) == "meshlib::nn: c (conv2d 5x5 on 2x3x1 images): the input, 2x3 with padding 0 (2x3), is smaller than the "
              "5x5 kernel; use a kernel of at most 2, pad by at least 2, or remove a pooling layer before it");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::conv2d<float, mesh_t>(m, "c", {2, 3, 1}, 4, 5, nn::rng_key{}, {.padding = 2});
        }) == "(no exception)");
  // Compile-time sizes: the same arithmetic, checked by the compiler (tests/compile_fail/nn for the refusal).
  constexpr auto padded = nn::conv2d_output_shape<nn::image_shape{2, 3, 1}, 4, 5, nn::conv2d_options{.padding = 2}>();
  static_assert(padded == nn::image_shape{2, 3, 4});
  constexpr auto strided = nn::conv2d_output_shape<nn::image_shape{7, 7, 2}, 8, 3, nn::conv2d_options{.stride = 2, .padding = 1}>();
  CHECK(strided == nn::conv2d<float, mesh_t>(m, "c", {7, 7, 2}, 8, 3, nn::rng_key{}, {.stride = 2, .padding = 1}).output_shape());
  CHECK(strided == nn::image_shape{4, 4, 8});
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::max_pool2d<float, mesh_t>(m, "p", {2, 3, 1}, 3); }) ==
        "meshlib::nn: p (max_pool2d 3x3 on 2x3x1 images): the input, 2x3, is smaller than the 3x3 window; use a "
        "window of at most 2 or remove a pooling layer before it");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::conv2d<float, mesh_t>(m, "c", {4, 4, 1}, 4, 3, nn::rng_key{}, {.stride = 0});
        }) == "meshlib::nn: c (conv2d 3x3 on 4x4x1 images): kernel, stride, output channels and the image's height, "
              "width and channels must be at least 1 (kernel 3, stride 0, 4 output channels)");
}

TEST_CASE("a channel count other than the layer's C_in, or a batch-norm width mismatch, names the layer and the fix",
          "[nn][conv][errors]") {
  const mesh_t m{2, 1};
  nn::conv2d<float, mesh_t> c(m, "c", {4, 4, 3}, 8, 3, nn::rng_key{}, {.padding = 1});
  const auto two_channels = image_rows(m, 4 * 4 * 2);
  CHECK(device_cause(m, [&](std::size_t dev) { (void)c.forward(two_channels.local_value(dev)); }) ==
        "meshlib::nn: c (conv2d 3x3, 4x4x3 -> 4x4x8, stride 1, padding 1) received 32 features per row, but it takes "
        "4x4x3 images (height x width x channels, NHWC) = 48 features: that is 2 channels where c takes 3; declare c "
        "with 2 input channels, or feed it 3-channel images");
  const auto odd = image_rows(m, 7);
  CHECK(device_cause(m, [&](std::size_t dev) { (void)c.forward(odd.local_value(dev)); }) ==
        "meshlib::nn: c (conv2d 3x3, 4x4x3 -> 4x4x8, stride 1, padding 1) received 7 features per row, but it takes "
        "4x4x3 images (height x width x channels, NHWC) = 48 features; declare c with the image shape of the layer "
        "before it (its output_shape())");
  nn::batch_norm<float, mesh_t> bn(m, "bn", {4, 4, 8});
  const auto six = image_rows(m, 4 * 4 * 6);
  CHECK(device_cause(m, [&](std::size_t dev) { (void)bn.forward(six.local_value(dev)); }) ==
        "meshlib::nn: bn (batch_norm over 8 channels of 4x4x8, synchronised over 'data') received 96 features per "
        "row, but it takes 4x4x8 images (height x width x channels, NHWC) = 128 features: that is 6 channels where "
        "bn takes 8; declare bn with 6 input channels, or feed it 8-channel images");
  nn::batch_norm<float, mesh_t> bn1(m, "bn1", 6);
  const auto five = image_rows(m, 5);
  CHECK(device_cause(m, [&](std::size_t dev) { (void)bn1.forward(five.local_value(dev)); }) ==
        "meshlib::nn: bn1 (batch_norm over 6 channels of 1x1x6, synchronised over 'data') received 5 features per "
        "row, but it normalises 6; declare bn1 with 5 features (or the image shape of the layer before it), or feed "
        "it 6");
  // Composed: sequential compares the widths at construction.
  nn::conv2d<float, mesh_t> c2(m, "c2", {4, 4, 3}, 8, 3, nn::rng_key{}, {.padding = 1});
  const auto msg = meshlib_test::message_of<meshlib::sharding_error>(
      [&] { nn::sequential(c, nn::batch_norm<float, mesh_t>(m, "bn", {4, 4, 6})); });
  CHECK(msg.find("bn (batch_norm over 6 channels of 4x4x6, synchronised over 'data'), takes 96 features") != std::string::npos);
  CHECK(msg.find("outputs 128") != std::string::npos);
  // A residual whose branches cannot be added.
  nn::conv2d<float, mesh_t> strided(m, "s", {4, 4, 3}, 3, 3, nn::rng_key{}, {.stride = 2, .padding = 1});
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { (void)nn::make_residual<float>(m, strided); }) ==
        "meshlib::nn: residual: its main branch maps 48 to 12 features, which cannot be added to the identity "
        "shortcut, which returns its 48 input features; give the main branch the input's width (same image shape, "
        "stride 1) or use a projection shortcut that maps the input to the main branch's output");
}

}  // namespace MESHLIB_TEST_UNIT
