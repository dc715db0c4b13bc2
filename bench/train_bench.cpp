// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training benchmark (issue 8): samples/s of meshlib's training step (MLP 784-H-H-10, Adam, batch
// 256, synthetic inputs) for hidden sizes 1024 and 2048 on meshes (1,1), (2,1), (1,2), (4,2),
// (2,4) (with a data axis: also with ZeRO-1), the share of the step spent in the gradient
// synchronisation, against two peers in the same run: the 1-device step and the hand-written
// cblas_sgemm trainer (bench/handwritten_mlp.hpp) with 2 OpenBLAS threads. Both sides run the
// same OpenBLAS kernels (OPENBLAS_CORETYPE as set in the environment, printed). Not a test: it
// prints a table (docs/benchmarks.md keeps the numbers).
//
//   train_bench [--steps N] [--hidden H] [--rounds R] [--mesh DxM]... [--overlap-grad-sync on|off]
//   (R interleaved rounds, best kept; default 1. --mesh: only these meshes' rows (repeatable).
//   --overlap-grad-sync: train_options::overlap_grad_sync for the table; default: the library's
//   default, printed in the header, so the table measures what a user's train_step does.)
//
// With --overlap (issue 26 item 4): the flagship's step (hidden 1024 unless --hidden) at (2, 1) and
// (4, 2), train_options::overlap_grad_sync off and on, in interleaved rounds (off, on, off, on, ...);
// per row the median over rounds of the exposed synchronisation per step (step_metrics::sync_seconds:
// the device thread's time in the gradient synchronisation), of the step time and of the process's
// CPU time per step, and the on/off ratios. "sync CPU": the CPU time per step beyond the same
// computation without the data-parallel synchronisation (d runs of (1, m) on batch / d rows, the
// "compute only" row): what the synchronisation costs a machine whose cores are all computing.
//
//   train_bench --overlap [--steps N] [--rounds R] [--hidden H]
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "bench_common.hpp"
#include "handwritten_mlp.hpp"

extern "C" void openblas_set_num_threads(int);

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
constexpr std::size_t inputs = 784, classes = 10, batch = 256;

struct result {
  double samples_per_s = 0, sync_share = 0;
  double cpu_per_step = 0;  ///< the process's CPU time (user + system, every thread) per step, seconds
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

/// The process's CPU time so far (every thread, user + system): what a step costs the machine,
/// which other load on a shared machine changes much less than the wall time.
double cpu_now() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

result run_meshlib(std::size_t d, std::size_t m, bool zero, std::size_t hidden, std::size_t steps,
                   const std::vector<float>& x, const std::vector<std::int32_t>& y, bool overlap = nn::train_options{}.overlap_grad_sync,
                   double* sync_per_step = nullptr, double* step_seconds = nullptr, std::size_t rows = batch) {
  meshlib::set_blas_threads_per_device(1);
  const mesh_t mesh{d, m};
  const nn::rng_key key{0};
  nn::sequential net(nn::column_dense<float, mesh_t>(mesh, "fc1", inputs, hidden, key), nn::relu<float>(mesh),
                     nn::row_dense<float, mesh_t>(mesh, "fc2", hidden, hidden, key), nn::relu<float>(mesh),
                     nn::dense<float, mesh_t>(mesh, "fc3", hidden, classes, key));
  nn::train_options options;
  options.zero = zero;
  options.overlap_grad_sync = overlap;
  nn::train_state state(mesh, std::move(net), nn::adam(nn::constant(1e-3f)), options);
  auto one = [&](std::size_t s) {
    const std::size_t b = s % 4;
    return nn::train_step(state, std::span<const float>(x).subspan(b * batch * inputs, rows * inputs),
                          std::span<const std::int32_t>(y).subspan(b * batch, rows), rows, 0, rows);
  };
  one(0);
  one(1);
  double sync = 0;
  const double c0 = cpu_now();
  const double t0 = now();
  for (std::size_t s = 0; s < steps; ++s) sync += one(s).sync_seconds;
  const double t = now() - t0;
  const double cpu = cpu_now() - c0;
  if (sync_per_step) *sync_per_step = sync / static_cast<double>(steps);
  if (step_seconds) *step_seconds = t / static_cast<double>(steps);
  return {static_cast<double>(steps * rows) / t, sync / t, cpu / static_cast<double>(steps)};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// --overlap: exposed synchronisation and step time with overlap_grad_sync off and on (file comment).
int run_overlap(std::size_t hidden, std::size_t steps, std::size_t rounds, const std::vector<float>& x,
                const std::vector<std::int32_t>& y) {
  std::printf("train_bench --overlap: MLP 784-%zu-%zu-10, Adam, batch %zu, %zu timed steps per run, %zu interleaved "
              "rounds (median kept); load average %.1f\n\n",
              hidden, hidden, batch, steps, rounds, bench::load_average());
  struct cell {
    std::vector<double> sync, step, cpu;
  };
  const std::pair<std::size_t, std::size_t> meshes[] = {{2, 1}, {4, 2}};
  cell cells[2][3];  // [mesh][overlap off, on, the compute-only reference]
  for (std::size_t round = 0; round < rounds; ++round)
    for (std::size_t k = 0; k < 2; ++k) {
      const auto [d, m] = meshes[k];
      for (int on = 0; on < 2; ++on) {
        // Alternate which goes first, so neither always follows the other.
        const bool overlap = (round % 2 == 0) == (on == 1);
        double sync = 0, step = 0;
        const result r = run_meshlib(d, m, false, hidden, steps, x, y, overlap, &sync, &step);
        cells[k][overlap ? 1 : 0].sync.push_back(sync);
        cells[k][overlap ? 1 : 0].step.push_back(step);
        cells[k][overlap ? 1 : 0].cpu.push_back(r.cpu_per_step);
      }
      // The same step's computation without the data-parallel synchronisation: one data replica,
      // (1, m) on batch / d rows, whose CPU time d times over is what the (d, m) step computes.
      double sync = 0, step = 0;
      const result r = run_meshlib(1, m, false, hidden, steps, x, y, false, &sync, &step, batch / d);
      cells[k][2].cpu.push_back(r.cpu_per_step * static_cast<double>(d));
    }
  std::printf("| mesh (data, model) | overlap | exposed sync / step (ms) | step (ms) | exposed share | CPU / step (ms) | "
              "sync CPU / step (ms) | sync on/off | step on/off | sync CPU on/off |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t k = 0; k < 2; ++k) {
    const auto [d, m] = meshes[k];
    const double s0 = median(cells[k][0].sync), s1 = median(cells[k][1].sync);
    const double t0 = median(cells[k][0].step), t1 = median(cells[k][1].step);
    const double c0 = median(cells[k][0].cpu), c1 = median(cells[k][1].cpu), cr = median(cells[k][2].cpu);
    std::printf("| (%zu, %zu) | off | %.2f | %.2f | %.0f%% | %.1f | %.1f | | | |\n", d, m, 1e3 * s0, 1e3 * t0,
                100.0 * s0 / t0, 1e3 * c0, 1e3 * (c0 - cr));
    std::printf("| (%zu, %zu) | on | %.2f | %.2f | %.0f%% | %.1f | %.1f | %.2f | %.2f | %.2f |\n", d, m, 1e3 * s1, 1e3 * t1,
                100.0 * s1 / t1, 1e3 * c1, 1e3 * (c1 - cr), s1 / s0, t1 / t0, (c1 - cr) / (c0 - cr));
    std::printf("| (%zu, %zu) | compute only: %zu x (1, %zu) on %zu rows | | | | %.1f | | | | |\n", d, m, d, m, batch / d,
                1e3 * cr);
  }
  std::printf("\nload average at the end: %.1f\n", bench::load_average());
  return 0;
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
  bool overlap = false;
  bool table_overlap = nn::train_options{}.overlap_grad_sync;
  std::vector<std::pair<std::size_t, std::size_t>> only;  // --mesh DxM
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--overlap") overlap = true;
    else if (std::string(argv[i]) == "--help") {
      std::printf("usage: train_bench [--steps N] [--hidden H] [--rounds R] [--mesh DxM]... [--overlap-grad-sync on|off]\n"
                  "       train_bench --overlap [--steps N] [--rounds R] [--hidden H]\n");
      return 0;
    }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--overlap") {
      --i;  // a flag without a value
      continue;
    }
    if (a == "--steps") steps = std::stoul(argv[i + 1]);
    else if (a == "--hidden") hiddens = {std::stoul(argv[i + 1])};
    else if (a == "--rounds") rounds = std::max<std::size_t>(1, std::stoul(argv[i + 1]));
    else if (a == "--overlap-grad-sync") table_overlap = std::string(argv[i + 1]) == "on";
    else if (a == "--mesh") {
      const std::string v = argv[i + 1];
      const std::size_t xpos = v.find('x');
      if (xpos == std::string::npos) {
        std::fprintf(stderr, "train_bench: --mesh %s: give the mesh as DxM (data x model), e.g. --mesh 4x2\n", v.c_str());
        return 2;
      }
      only.emplace_back(std::stoul(v.substr(0, xpos)), std::stoul(v.substr(xpos + 1)));
    } else {
      std::fprintf(stderr, "train_bench: unknown option %s (see --help)\n", a.c_str());
      return 2;
    }
  }
  std::vector<float> x(4 * batch * inputs);
  std::vector<std::int32_t> y(4 * batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(0.5 + 0.5 * std::sin(0.37 * static_cast<double>(i)));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  if (overlap) return run_overlap(hiddens.size() == 1 ? hiddens.front() : 1024, steps, std::max<std::size_t>(rounds, 1), x, y);
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  std::printf("train_bench: MLP 784-H-H-10, Adam, batch %zu, %zu timed steps, best of %zu interleaved rounds; "
              "OPENBLAS_CORETYPE=%s on both sides; overlap_grad_sync %s; load average %.1f\n\n",
              batch, steps, rounds, core ? core : "(unset)", table_overlap ? "on" : "off", bench::load_average());
  std::printf("| hidden | mesh (data, model) | samples/s | vs 1 device | vs hand-written (2 BLAS threads) | sync share | CPU ms / step |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t h : hiddens) {
    // Every round runs the peer and every mesh once, interleaved; a row keeps its best round (a
    // busy machine only ever slows a run down, and interleaving gives each row the same chances).
    struct row {
      std::size_t d, m;
      bool zero;
      result best;
      double cpu = 0;  ///< the least CPU time per step over the rounds
    };
    std::vector<row> rows;
    for (auto [d, m] : {std::pair<std::size_t, std::size_t>{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}})
      for (bool zero : {false, true})
        if ((!zero || d > 1) && (only.empty() || std::find(only.begin(), only.end(), std::pair{d, m}) != only.end()))
          rows.push_back({d, m, zero, {}});  // ZeRO-1 shards over the data axis
    double peer = 0;
    for (std::size_t round = 0; round < rounds; ++round) {
      peer = std::max(peer, run_peer(h, steps, x, y));
      for (auto& r : rows) {
        const auto got = run_meshlib(r.d, r.m, r.zero, h, steps, x, y, table_overlap);
        if (got.samples_per_s > r.best.samples_per_s) r.best = got;
        if (r.cpu == 0 || got.cpu_per_step < r.cpu) r.cpu = got.cpu_per_step;
      }
    }
    std::printf("| %zu | hand-written cblas_sgemm, 2 threads | %.0f | | 1.00x | | |\n", h, peer);
    const double one = rows.front().d == 1 && rows.front().m == 1 ? rows.front().best.samples_per_s : 0;
    for (const auto& r : rows)
      std::printf("| %zu | (%zu, %zu)%s | %.0f | %.2fx | %.2fx | %.0f%% | %.1f |\n", h, r.d, r.m, r.zero ? " ZeRO-1" : "",
                  r.best.samples_per_s, r.best.samples_per_s / one, r.best.samples_per_s / peer,
                  100.0 * r.best.sync_share, 1e3 * r.cpu);
    std::fflush(stdout);
  }
  std::printf("\nload average at the end: %.1f\n", bench::load_average());
  return 0;
}
