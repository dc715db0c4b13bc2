// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training benchmark (issue 8): samples/s of meshlib's training step (MLP 784-H-H-10, Adam, batch
// 256, synthetic inputs) for hidden sizes 1024 and 2048 on meshes (1,1), (2,1), (1,2), (4,2),
// (2,4) (with a data axis: also with ZeRO-1), the share of the step spent in the gradient
// synchronisation, against two peers in the same run: the 1-device step and the hand-written
// cblas_sgemm trainer (bench/handwritten_mlp.hpp) with 2 OpenBLAS threads. Both sides run the
// same OpenBLAS kernels (OPENBLAS_CORETYPE as set in the environment, printed). Not a test: it
// prints a table (docs/benchmarks.md keeps the numbers).
//
//   train_bench [--steps N] [--hidden H] [--rounds R]   (R interleaved rounds, best kept; default 1)
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "handwritten_mlp.hpp"

extern "C" void openblas_set_num_threads(int);

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
constexpr std::size_t inputs = 784, classes = 10, batch = 256;

struct result {
  double samples_per_s = 0, sync_share = 0;
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

result run_meshlib(std::size_t d, std::size_t m, bool zero, std::size_t hidden, std::size_t steps,
                   const std::vector<float>& x, const std::vector<std::int32_t>& y) {
  meshlib::set_blas_threads_per_device(1);
  const mesh_t mesh{d, m};
  const nn::rng_key key{0};
  nn::sequential net(nn::column_dense<float, mesh_t>(mesh, "fc1", inputs, hidden, key), nn::relu<float>(mesh),
                     nn::row_dense<float, mesh_t>(mesh, "fc2", hidden, hidden, key), nn::relu<float>(mesh),
                     nn::dense<float, mesh_t>(mesh, "fc3", hidden, classes, key));
  nn::train_options options;
  options.zero = zero;
  nn::train_state state(mesh, std::move(net), nn::adam(nn::constant(1e-3f)), options);
  auto one = [&](std::size_t s) {
    const std::size_t b = s % 4;
    return nn::train_step(state, std::span<const float>(x).subspan(b * batch * inputs, batch * inputs),
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

double run_peer(std::size_t hidden, std::size_t steps, const std::vector<float>& x, const std::vector<std::int32_t>& y) {
  openblas_set_num_threads(2);
  handwritten::mlp_config c;
  c.hidden = hidden;
  c.batch = batch;
  handwritten::mlp net(c);
  net.step(x.data(), y.data(), batch);
  const double t0 = now();
  for (std::size_t s = 0; s < steps; ++s) net.step(x.data() + (s % 4) * batch * inputs, y.data() + (s % 4) * batch, batch);
  return static_cast<double>(steps * batch) / (now() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  std::size_t steps = 10, rounds = 1;
  std::vector<std::size_t> hiddens{1024, 2048};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--steps") steps = std::stoul(argv[i + 1]);
    else if (a == "--hidden") hiddens = {std::stoul(argv[i + 1])};
    else if (a == "--rounds") rounds = std::max<std::size_t>(1, std::stoul(argv[i + 1]));
  }
  std::vector<float> x(4 * batch * inputs);
  std::vector<std::int32_t> y(4 * batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(0.5 + 0.5 * std::sin(0.37 * static_cast<double>(i)));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  std::printf("train_bench: MLP 784-H-H-10, Adam, batch %zu, %zu timed steps, best of %zu interleaved rounds; "
              "OPENBLAS_CORETYPE=%s on both sides; load average %.1f\n\n",
              batch, steps, rounds, core ? core : "(unset)", bench::load_average());
  std::printf("| hidden | mesh (data, model) | samples/s | vs 1 device | vs hand-written (2 BLAS threads) | sync share |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t h : hiddens) {
    // Every round runs the peer and every mesh once, interleaved; a row keeps its best round (a
    // busy machine only ever slows a run down, and interleaving gives each row the same chances).
    struct row {
      std::size_t d, m;
      bool zero;
      result best;
    };
    std::vector<row> rows;
    for (auto [d, m] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}})
      for (bool zero : {false, true})
        if (!zero || d > 1) rows.push_back({d, m, zero, {}});  // ZeRO-1 shards over the data axis
    double peer = 0;
    for (std::size_t round = 0; round < rounds; ++round) {
      peer = std::max(peer, run_peer(h, steps, x, y));
      for (auto& r : rows) {
        const auto got = run_meshlib(r.d, r.m, r.zero, h, steps, x, y);
        if (got.samples_per_s > r.best.samples_per_s) r.best = got;
      }
    }
    std::printf("| %zu | hand-written cblas_sgemm, 2 threads | %.0f | | 1.00x | |\n", h, peer);
    const double one = rows.front().best.samples_per_s;
    for (const auto& r : rows)
      std::printf("| %zu | (%zu, %zu)%s | %.0f | %.2fx | %.2fx | %.0f%% |\n", h, r.d, r.m, r.zero ? " ZeRO-1" : "",
                  r.best.samples_per_s, r.best.samples_per_s / one, r.best.samples_per_s / peer,
                  100.0 * r.best.sync_share);
    std::fflush(stdout);
  }
  std::printf("\nload average at the end: %.1f\n", bench::load_average());
  return 0;
}
