// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// ResNet benchmark (issue 25): two tables, Markdown.
//  1. Samples/s of a training step of the flagship's ResNet (examples/train_resnet_fashion_mnist:
//     28x28x1 images, stem conv-BN-ReLU, max pooling, basic blocks W, 2W, 4W, global average
//     pooling, dense head; Adam; synthetic inputs) on meshes (1,1), (2,1), (1,2), (2,2), against the
//     1-device step, with the share of the step spent in the gradient synchronisation
//     (`step_metrics::sync_seconds`, as train_bench measures it; batch norm's two small psums per
//     layer happen inside forward and backward and are not in that share).
//  2. conv2d forward (the algorithm each layer picks: direct, pointwise or blocked im2col) against cblas_sgemm on the same product sizes
//     (`M = batch * Ho * Wo`, `K = kernel * kernel * C_in`, `N = C_out`) for every convolution of
//     that ResNet, at batch 64, one device and one BLAS thread on both sides (the rate each device
//     of a mesh gets). Target: conv forward at least 0.8x the sgemm rate.
// Not a test: it prints tables (docs/benchmarks.md keeps the numbers).
//
//   resnet_bench [--steps N] [--rounds R] [--width W] [--batch B] [--conv-batch B]
// (--steps 0: only the convolution table)
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2.
#include <cstddef>
#include <string>

#include "bench_options.hpp"

namespace {

struct options {
  std::size_t steps = 10, rounds = 1, w = 16, batch = 128, conv_batch = 64;
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("resnet_bench",
                         "usage: resnet_bench [--steps N] [--rounds R] [--width W] [--batch B] [--conv-batch B]\n"
                         "       (--steps 0: only the convolution table)\n",
                         argc, argv);
  options o;
  o.steps = static_cast<std::size_t>(cl.integer("--steps", 10, 0, 1000000000));
  o.rounds = cl.count("--rounds", o.rounds);
  o.w = cl.count("--width", o.w);
  o.batch = cl.count("--batch", o.batch);
  o.conv_batch = cl.count("--conv-batch", o.conv_batch);
  if (o.steps > 0 && o.batch % 2 != 0)
    cl.fail("--batch " + std::to_string(o.batch) + ": the meshes (2, 1) and (2, 2) split it over 2 data devices; give an even batch");
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
constexpr nn::image_shape image{28, 28, 1};
constexpr std::size_t classes = 10;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

/// The flagship's network (widths W, 2W, 4W).
auto resnet(const mesh_t& m, std::size_t w) {
  const nn::rng_key key{0};
  nn::conv2d<float, mesh_t> stem(m, "stem", image, w, 3, key, {.padding = 1, .use_bias = false});
  nn::max_pool2d<float, mesh_t> pool(m, "pool", stem.output_shape(), 2);
  nn::basic_block<float, mesh_t> b1(m, "b1", pool.output_shape(), w, 1, key);
  nn::basic_block<float, mesh_t> b2(m, "b2", b1.output_shape(), 2 * w, 2, key);
  nn::basic_block<float, mesh_t> b3(m, "b3", b2.output_shape(), 4 * w, 2, key);
  const auto last = b3.output_shape();
  return nn::sequential(stem, nn::batch_norm<float, mesh_t>(m, "stem_bn", stem.output_shape()), nn::relu<float>(m),
                        pool, b1, b2, b3, nn::global_avg_pool<float, mesh_t>(m, "gap", last),
                        nn::dense<float, mesh_t>(m, "fc", last.channels, classes, key));
}

struct step_result {
  double samples_per_s = 0, sync_share = 0;
};

step_result run_training(std::size_t d, std::size_t mo, std::size_t w, std::size_t batch, std::size_t steps,
                         const std::vector<float>& x, const std::vector<std::int32_t>& y) {
  const mesh_t mesh{d, mo};
  nn::train_state state(mesh, resnet(mesh, w), nn::adam(nn::constant(1e-3f)));
  auto one = [&](std::size_t s) {
    const std::size_t b = s % 4;
    return nn::train_step(state, std::span<const float>(x).subspan(b * batch * image.size(), batch * image.size()),
                          std::span<const std::int32_t>(y).subspan(b * batch, batch), batch, 0, batch);
  };
  one(0);
  one(1);
  double sync = 0;
  const double t0 = now();
  for (std::size_t s = 0; s < steps; ++s) sync += one(s).sync_seconds;
  const double t = now() - t0;
  return {static_cast<double>(steps * batch) / t, sync / t};
}

/// One convolution of the network: its input shape, output channels, kernel and options.
struct conv_case {
  const char* name;
  nn::image_shape in;
  std::size_t out_channels, kernel;
  nn::conv2d_options opt;
};

/// The name of a convolution algorithm, for the table.
const char* algorithm_name(nn::conv2d_algorithm a) {
  switch (a) {
    case nn::conv2d_algorithm::direct: return "direct";
    case nn::conv2d_algorithm::pointwise: return "pointwise";
    case nn::conv2d_algorithm::im2col: return "im2col (blocked)";
    default: return "automatic";
  }
}

/// Seconds per forward of `c` on a (1, 1) mesh, the best of `batches` timed loops of `reps`; the
/// algorithm the layer chose in `algo`.
double time_conv(const conv_case& c, std::size_t n, int reps, int batches, nn::conv2d_algorithm& algo) {
  const mesh_t m{1, 1};
  nn::conv2d<float, mesh_t> conv(m, c.name, c.in, c.out_channels, c.kernel, nn::rng_key{1}, c.opt);
  algo = conv.algorithm();
  const auto host = bench::random_matrix(n * c.in.size(), 7);
  const auto xs = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{m},
                                     std::array<std::size_t, 2>{n, c.in.size()}, host);
  const auto t = meshlib::spmd(m, [&](std::size_t dev) {
    const auto x = xs.local_value(dev);
    (void)conv.forward(x);
    double best = 1e30;
    for (int b = 0; b < batches; ++b) {
      const double t0 = now();
      for (int r = 0; r < reps; ++r) (void)conv.forward(x);
      best = std::min(best, (now() - t0) / reps);
    }
    return best;
  });
  return t[0];
}

/// Seconds per `cblas_sgemm` of `M x K` by `K x N` (row-major, beta 0), the best of `batches` loops.
double time_sgemm(std::size_t m, std::size_t k, std::size_t n, int reps, int batches) {
  const auto a = bench::random_matrix(m * k, 3), b = bench::random_matrix(k * n, 5);
  std::vector<float> c(m * n);
  const auto call = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                1.0f, a.data(), static_cast<int>(k), b.data(), static_cast<int>(n), 0.0f, c.data(), static_cast<int>(n));
  };
  call();
  double best = 1e30;
  for (int bt = 0; bt < batches; ++bt) {
    const double t0 = now();
    for (int r = 0; r < reps; ++r) call();
    best = std::min(best, (now() - t0) / reps);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse_options(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  const std::size_t steps = o.steps, rounds = o.rounds, w = o.w, batch = o.batch, conv_batch = o.conv_batch;
  meshlib::set_blas_threads_per_device(1);  // one BLAS thread per device (and for the sgemm peer)

  std::vector<float> x(4 * batch * image.size());
  std::vector<std::int32_t> y(4 * batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(0.5 + 0.5 * std::sin(0.37 * static_cast<double>(i)));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  std::printf("resnet_bench: the flagship's ResNet (W = %zu), Adam, batch %zu, %zu timed steps, best of %zu "
              "interleaved rounds; OPENBLAS_CORETYPE=%s; load average %.1f\n\n",
              w, batch, steps, rounds, core ? core : "(unset)", bench::load_average());
  std::vector<std::pair<std::size_t, std::size_t>> meshes{{1, 1}, {2, 1}, {1, 2}, {2, 2}};
  if (steps == 0) meshes.clear();  // --steps 0: only the convolution table
  else std::printf("| mesh (data, model) | samples/s | vs 1 device | sync share |\n| --- | --- | --- | --- |\n");
  std::vector<step_result> best(meshes.size());
  for (std::size_t r = 0; r < rounds; ++r)
    for (std::size_t i = 0; i < meshes.size(); ++i) {
      const auto got = run_training(meshes[i].first, meshes[i].second, w, batch, steps, x, y);
      if (got.samples_per_s > best[i].samples_per_s) best[i] = got;
    }
  for (std::size_t i = 0; i < meshes.size(); ++i)
    std::printf("| (%zu, %zu) | %.0f | %.2fx | %.0f%% |\n", meshes[i].first, meshes[i].second, best[i].samples_per_s,
                best[i].samples_per_s / best[0].samples_per_s, 100.0 * best[i].sync_share);
  std::fflush(stdout);

  // ---- 2. convolution forward against cblas_sgemm ------------------------------------------------
  const std::vector<conv_case> cases{
      {"stem", {28, 28, 1}, w, 3, {.padding = 1, .use_bias = false}},
      {"b1.conv", {14, 14, w}, w, 3, {.padding = 1, .use_bias = false}},
      {"b2.conv1", {14, 14, w}, 2 * w, 3, {.stride = 2, .padding = 1, .use_bias = false}},
      {"b2.conv2", {7, 7, 2 * w}, 2 * w, 3, {.padding = 1, .use_bias = false}},
      {"b2.proj", {14, 14, w}, 2 * w, 1, {.stride = 2, .use_bias = false}},
      {"b3.conv1", {7, 7, 2 * w}, 4 * w, 3, {.stride = 2, .padding = 1, .use_bias = false}},
      {"b3.conv2", {4, 4, 4 * w}, 4 * w, 3, {.padding = 1, .use_bias = false}},
  };
  std::printf("\nconv2d forward vs cblas_sgemm on the same product, batch %zu, 1 thread each\n\n", conv_batch);
  std::printf("| layer | M x K x N | algorithm | conv forward GFLOP/s | cblas_sgemm GFLOP/s | conv / sgemm | target |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const auto& c : cases) {
    const std::size_t ho = (c.in.height + 2 * c.opt.padding - c.kernel) / c.opt.stride + 1;
    const std::size_t wo = (c.in.width + 2 * c.opt.padding - c.kernel) / c.opt.stride + 1;
    const std::size_t m = conv_batch * ho * wo, k = c.kernel * c.kernel * c.in.channels, n = c.out_channels;
    const double flop = 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
    const int reps = static_cast<int>(std::clamp(2e8 / flop, 3.0, 200.0));  // ~0.1 s per loop at 2 GFLOP/s
    double conv_t = 1e30, gemm_t = 1e30;
    nn::conv2d_algorithm algo{};
    for (std::size_t r = 0; r < rounds; ++r) {  // interleaved: a busy spell slows both sides alike
      conv_t = std::min(conv_t, time_conv(c, conv_batch, reps, 3, algo));
      gemm_t = std::min(gemm_t, time_sgemm(m, k, n, reps, 3));
    }
    const double ratio = gemm_t / conv_t;
    std::printf("| %s | %zu x %zu x %zu | %s | %.1f | %.1f | %.2fx | >= 0.80x %s |\n", c.name, m, k, n,
                algorithm_name(algo), flop / conv_t / 1e9, flop / gemm_t / 1e9, ratio, ratio >= 0.8 ? "met" : "not met");
    std::fflush(stdout);
  }
  std::printf("\nload average at the end: %.1f\n", bench::load_average());
  return 0;
} catch (const std::exception& e) {
  // What the library refused at run time (not an option the parser could judge): said, not a crash.
  std::fprintf(stderr, "resnet_bench: %s\n", e.what());
  return 1;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif
