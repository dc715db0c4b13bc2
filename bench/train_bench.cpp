// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training benchmark (issue 8): samples/s of meshlib's training step (MLP 784-H-H-10, Adam, batch
// 256, synthetic inputs) for hidden sizes 1024 and 2048 on meshes (1,1), (2,1), (1,2), (4,2),
// (2,4), the share of the step spent in the gradient synchronisation, against two peers in the same
// run: the 1-device step and the hand-written cblas_sgemm trainer (bench/handwritten_mlp.hpp) with
// 2 OpenBLAS threads. Both sides run the same OpenBLAS kernels (OPENBLAS_CORETYPE as set in the
// environment, printed). Not a test: it prints a table (docs/benchmarks.md keeps the numbers).
//
//   train_bench [--steps N] [--hidden 1024,2048]
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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

result run_meshlib(std::size_t d, std::size_t m, std::size_t hidden, std::size_t steps, const std::vector<float>& x,
                   const std::vector<std::int32_t>& y) {
  meshlib::set_blas_threads_per_device(1);
  const mesh_t mesh{d, m};
  const nn::rng_key key{0};
  nn::sequential net(nn::column_dense<float, mesh_t>(mesh, "fc1", inputs, hidden, key), nn::relu<float>(mesh),
                     nn::row_dense<float, mesh_t>(mesh, "fc2", hidden, hidden, key), nn::relu<float>(mesh),
                     nn::dense<float, mesh_t>(mesh, "fc3", hidden, classes, key));
  nn::train_state state(mesh, std::move(net), nn::adam(nn::constant(1e-3f)));
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
  std::size_t steps = 10;
  std::vector<std::size_t> hiddens{1024, 2048};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--steps") steps = std::stoul(argv[i + 1]);
    else if (a == "--hidden") hiddens = {std::stoul(argv[i + 1])};
  }
  std::vector<float> x(4 * batch * inputs);
  std::vector<std::int32_t> y(4 * batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(0.5 + 0.5 * std::sin(0.37 * static_cast<double>(i)));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  double load[1] = {0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load[0]) != 1) load[0] = -1;
    std::fclose(f);
  }
  std::printf("train_bench: MLP 784-H-H-10, Adam, batch %zu, %zu timed steps; OPENBLAS_CORETYPE=%s on both sides; "
              "load average %.1f\n\n",
              batch, steps, core ? core : "(unset)", load[0]);
  std::printf("| hidden | mesh (data, model) | samples/s | vs 1 device | vs hand-written (2 BLAS threads) | sync share |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t h : hiddens) {
    const double peer = run_peer(h, steps, x, y);
    std::printf("| %zu | hand-written cblas_sgemm, 2 threads | %.0f | | 1.00x | |\n", h, peer);
    double one = 0;
    for (auto [d, m] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}}) {
      const auto r = run_meshlib(d, m, h, steps, x, y);
      if (d * m == 1) one = r.samples_per_s;
      std::printf("| %zu | (%zu, %zu) | %.0f | %.2fx | %.2fx | %.0f%% |\n", h, d, m, r.samples_per_s, r.samples_per_s / one,
                  r.samples_per_s / peer, 100.0 * r.sync_share);
      std::fflush(stdout);
    }
  }
  return 0;
}
