// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training benchmark (issue 8): samples/s of meshlib's training step (MLP 784-H-H-10, Adam, batch
// 256, synthetic inputs) for hidden sizes 1024 and 2048 on meshes (1,1), (2,1), (1,2), (4,2),
// (2,4) (with a data axis: also with ZeRO-1), the share of the step spent in the gradient
// synchronisation and the kernel launches per step and device (meshlib::launch_counter, one extra
// step after the timed ones), against two peers in the same run: the 1-device step and the hand-written
// cblas_sgemm trainer (bench/handwritten_mlp.hpp) with 2 OpenBLAS threads. Both sides run the
// same OpenBLAS kernels (OPENBLAS_CORETYPE as set in the environment, printed). Not a test: it
// prints a table (docs/benchmarks.md keeps the numbers).
//
//   train_bench [--steps N] [--hidden H] [--rounds R] [--mesh DxM]... [--overlap-grad-sync on|off]
//   (R interleaved rounds, best kept; default 1. --mesh: only these meshes' rows (repeatable).
//   --overlap-grad-sync: data_parallel's overlap for the table; default: the library's
//   default, printed in the header, so the table measures what a user's train_step does.)
//
// With --overlap (issue 26 item 4): the flagship's step (hidden 1024 unless --hidden) at (2, 1) and
// (4, 2), data_parallel's overlap off and on, in interleaved rounds (off, on, off, on, ...);
// per row the median over rounds of the exposed synchronisation per step (step_metrics::sync_seconds:
// the device thread's time in the gradient synchronisation), of the step time and of the process's
// CPU time per step, and the on/off ratios. "sync CPU": the CPU time per step beyond the same
// computation without the data-parallel synchronisation (d runs of (1, m) on batch / d rows, the
// "compute only" row): what the synchronisation costs a machine whose cores are all computing.
//
//   train_bench --overlap [--steps N] [--rounds R] [--hidden H]
//
// With --advisor (moved here from nn_remat_unit, issue 40 item 5: a comparison of measured times is
// a benchmark, not a test): nn::advise_mesh's ranking of (4, 1), (2, 2), (1, 4) for a wide
// tensor-parallel MLP against longer runs that visit the shapes in turn (R rounds, default 5, of N
// steps, default 5; a shape keeps its fastest round), and whether the two orders agree. The
// advisor's ranking logic itself is tested on injected step times (tests/unit/nn/test_advisor.cpp).
//
//   train_bench --advisor [--steps N] [--rounds R]
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2; a --mesh is any
// D x M whose D divides the batch (256) and whose M divides every hidden size.
#include "bench_options.hpp"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr std::size_t inputs = 784, classes = 10, batch = 256;

struct options {
  std::size_t steps = 10, rounds = 1;
  std::vector<std::size_t> hiddens{1024, 2048};
  bool overlap = false, advisor = false;
  std::optional<bool> table_overlap;  ///< --overlap-grad-sync; none: the library's default
  std::vector<std::pair<std::size_t, std::size_t>> only;  ///< --mesh DxM
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("train_bench",
                         "usage: train_bench [--steps N] [--hidden H] [--rounds R] [--mesh DxM]... [--overlap-grad-sync on|off]\n"
                         "       train_bench --overlap [--steps N] [--rounds R] [--hidden H]\n"
                         "       train_bench --advisor [--steps N] [--rounds R]\n",
                         argc, argv);
  options o;
  o.overlap = cl.flag("--overlap");
  o.advisor = cl.flag("--advisor");
  if (o.overlap && o.advisor) cl.fail("--overlap and --advisor are two different runs; give one");
  o.steps = cl.count("--steps", o.advisor ? 5 : 10);
  o.rounds = cl.count("--rounds", o.advisor ? 5 : 1);
  if (cl.given("--hidden")) {
    if (o.advisor) cl.fail("--hidden: --advisor measures its own model (512 wide, hidden 1024)");
    o.hiddens = {cl.count("--hidden", 1024)};
  } else if (o.overlap) {
    o.hiddens = {1024};
  }
  if (cl.given("--overlap-grad-sync")) {
    if (o.overlap || o.advisor) cl.fail("--overlap-grad-sync sets the table's runs; --overlap measures both settings");
    o.table_overlap = cl.choice("--overlap-grad-sync", {"on", "off"}, "on") == "on";
  }
  for (const std::string& v : cl.every("--mesh")) {
    if (o.overlap || o.advisor) cl.fail("--mesh chooses the table's rows; --overlap and --advisor run fixed meshes");
    const std::size_t x = v.find('x');
    if (x == std::string::npos) cl.fail("--mesh " + v + ": give the mesh as DxM (data x model), e.g. --mesh 4x2");
    const auto d = static_cast<std::size_t>(cl.integer_of("--mesh " + v + ": data size", v.substr(0, x), 1, 4096));
    const auto m = static_cast<std::size_t>(cl.integer_of("--mesh " + v + ": model size", v.substr(x + 1), 1, 4096));
    if (batch % d != 0)
      cl.fail("--mesh " + v + ": the batch of " + std::to_string(batch) + " rows does not split over " + std::to_string(d) +
              " data devices; choose a data size that divides " + std::to_string(batch));
    for (std::size_t h : o.hiddens)
      if (h % m != 0)
        cl.fail("--mesh " + v + ": the hidden size " + std::to_string(h) + " does not split over " + std::to_string(m) +
                " model devices; choose a model size that divides it (or another --hidden)");
    if (std::find(o.only.begin(), o.only.end(), std::pair{d, m}) == o.only.end()) o.only.emplace_back(d, m);
  }
  if (o.only.empty() && !o.advisor) {  // the fixed meshes split the hidden layers over up to 4 (--overlap: 2) devices
    const std::size_t most = o.overlap ? 2 : 4;
    for (std::size_t h : o.hiddens)
      if (h % most != 0)
        cl.fail("--hidden " + std::to_string(h) + ": the fixed meshes split it over " + std::to_string(most) +
                " model devices; give a multiple of " + std::to_string(most) + (o.overlap ? "" : " (or choose meshes with --mesh)"));
  }
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>

#include <sys/resource.h>

#include "bench_common.hpp"
#include "handwritten_mlp.hpp"

extern "C" void openblas_set_num_threads(int);

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

struct result {
  double samples_per_s = 0, sync_share = 0;
  double cpu_per_step = 0;  ///< the process's CPU time (user + system, every thread) per step, seconds
  double kernels = 0, products = 0;  ///< Kokkos kernels and BLAS products per step, per device
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
                   const std::vector<float>& x, const std::vector<std::int32_t>& y, bool overlap = nn::data_parallel<"data">{}.overlap,
                   double* sync_per_step = nullptr, double* step_seconds = nullptr, std::size_t rows = batch) {
  meshlib::set_blas_threads_per_device(1);
  const mesh_t mesh{d, m};
  const nn::rng_key key{0};
  nn::sequential net(nn::column_dense<float, mesh_t>(mesh, "fc1", inputs, hidden, key), nn::relu<float>(mesh),
                     nn::row_dense<float, mesh_t>(mesh, "fc2", hidden, hidden, key), nn::relu<float>(mesh),
                     nn::dense<float, mesh_t>(mesh, "fc3", hidden, classes, key));
  nn::train_state state(mesh, std::move(net), nn::adam(nn::constant(1e-3f)),
                        nn::data_parallel<"data">{.zero = zero ? 1 : 0, .overlap = overlap});
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
  // One more step, counted: outside the timed ones, since counting takes a lock per launch.
  meshlib::launch_counter count;
  one(steps);
  const auto devices = static_cast<double>(d * m);
  return {static_cast<double>(steps * rows) / t, sync / t, cpu / static_cast<double>(steps),
          static_cast<double>(count.kernels()) / devices, static_cast<double>(count.products()) / devices};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// --overlap: exposed synchronisation and step time with data_parallel's overlap off and on (file comment).
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

/// --advisor: a wide tensor-parallel MLP on a tiny batch (two column/row pairs of width 512, hidden
/// 1024), so that a step is mostly the optimizer's update and the gradient synchronisation of the
/// parameters a device holds, which the model axis divides: on 4 devices (1, 4) holds a quarter of
/// them, (2, 2) half, (4, 1) all (measured on 2 shared cores: 12-19, 27-40 and 45-70 ms a step).
auto tp_mlp(const mesh_t& m) {
  const nn::rng_key key{3};
  auto blk = [&](int i) {
    return nn::sequential(nn::column_dense<float, mesh_t>(m, "c" + std::to_string(i), 512, 1024, key), nn::relu<float>(m),
                          nn::row_dense<float, mesh_t>(m, "r" + std::to_string(i), 1024, 512, key));
  };
  return nn::sequential(nn::dense<float, mesh_t>(m, "in", 16, 512, key), blk(0), blk(1),
                        nn::dense<float, mesh_t>(m, "head", 512, 4, key));
}

/// --advisor: advise_mesh's ranking (measured, a median of 9 steps) against longer interleaved runs.
int run_advisor(std::size_t steps, std::size_t rounds, const std::vector<float>& x, const std::vector<std::int32_t>& y) {
  meshlib::set_blas_threads_per_device(1);
  nn::batch b;
  b.x = std::vector<float>(x.begin(), x.begin() + 4 * 16);
  b.y = std::vector<std::int32_t>(4);
  for (std::size_t i = 0; i < 4; ++i) b.y[i] = y[i] % 4;
  b.rows = b.global_rows = 4;
  b.features = 16;
  nn::advise_options o;
  o.only = {{{"data", "model"}, {4, 1}}, {{"data", "model"}, {2, 2}}, {{"data", "model"}, {1, 4}}};
  o.timed_steps = 9;
  o.threads_per_device = {1};  // the shapes alone, as the longer runs below measure them
  o.overlap = {false};
  std::printf("train_bench --advisor: advise_mesh on (4, 1), (2, 2), (1, 4) against %zu interleaved rounds of %zu steps "
              "(fastest round kept); load average %.1f\n\n",
              rounds, steps, bench::load_average());
  const auto a = nn::advise_mesh<mesh_t>(4, tp_mlp, b, o);
  std::printf("%s\n", a.markdown().c_str());
  using state_t = decltype(nn::train_state(std::declval<const mesh_t&>(), tp_mlp(std::declval<const mesh_t&>()), o.opt));
  std::vector<std::unique_ptr<mesh_t>> meshes;
  std::vector<std::unique_ptr<state_t>> states;
  for (const auto& s : o.only) {
    meshes.push_back(std::make_unique<mesh_t>(nn::make_mesh<mesh_t>(s)));
    states.push_back(std::make_unique<state_t>(*meshes.back(), tp_mlp(*meshes.back()), o.opt));
    for (int i = 0; i < 2; ++i) (void)nn::train_step(*states.back(), b);
  }
  std::vector<double> fastest(o.only.size(), std::numeric_limits<double>::infinity());
  for (std::size_t round = 0; round < rounds; ++round)
    for (std::size_t k = 0; k < states.size(); ++k) {
      const double t0 = now();
      for (std::size_t i = 0; i < steps; ++i) (void)nn::train_step(*states[k], b);
      fastest[k] = std::min(fastest[k], (now() - t0) / static_cast<double>(steps));
    }
  std::vector<std::pair<double, std::string>> measured;
  for (std::size_t k = 0; k < o.only.size(); ++k) measured.emplace_back(fastest[k], o.only[k].to_string());
  std::sort(measured.begin(), measured.end());
  bool agree = true;
  std::printf("| rank | advise_mesh | longer runs | step (ms), longer runs |\n| ---: | --- | --- | ---: |\n");
  for (std::size_t i = 0; i < measured.size(); ++i) {
    agree = agree && a.rows[i].shape.to_string() == measured[i].second;
    std::printf("| %zu | %s | %s | %.2f |\n", i + 1, a.rows[i].shape.to_string().c_str(), measured[i].second.c_str(),
                1e3 * measured[i].first);
  }
  std::printf("\nthe orders %s; load average at the end: %.1f\n", agree ? "agree" : "DIFFER", bench::load_average());
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const options opt = parse_options(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  const std::size_t steps = opt.steps, rounds = opt.rounds;
  const std::vector<std::size_t>& hiddens = opt.hiddens;
  const bool table_overlap = opt.table_overlap.value_or(nn::data_parallel<"data">{}.overlap);
  const auto& only = opt.only;
  std::vector<float> x(4 * batch * inputs);
  std::vector<std::int32_t> y(4 * batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(0.5 + 0.5 * std::sin(0.37 * static_cast<double>(i)));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  if (opt.overlap) return run_overlap(hiddens.front(), steps, rounds, x, y);
  if (opt.advisor) return run_advisor(steps, rounds, x, y);
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  std::printf("train_bench: MLP 784-H-H-10, Adam, batch %zu, %zu timed steps, best of %zu interleaved rounds; "
              "OPENBLAS_CORETYPE=%s on both sides; data_parallel overlap %s; load average %.1f\n\n",
              batch, steps, rounds, core ? core : "(unset)", table_overlap ? "on" : "off", bench::load_average());
  std::printf("| hidden | mesh (data, model) | samples/s | vs 1 device | vs hand-written (2 BLAS threads) | sync share | CPU ms / step "
              "| launches / step (Kokkos + BLAS, per device) |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t h : hiddens) {
    // Every round runs the peer and every mesh once, interleaved; a row keeps its best round (a
    // busy machine only ever slows a run down, and interleaving gives each row the same chances).
    struct row {
      std::size_t d, m;
      bool zero;
      result best;
      double cpu = 0;  ///< the least CPU time per step over the rounds
      double kernels = 0, products = 0;  ///< per step and device (the same in every round)
    };
    std::vector<row> rows;
    const std::vector<std::pair<std::size_t, std::size_t>> fixed{{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}};
    for (auto [d, m] : only.empty() ? fixed : only)
      for (bool zero : {false, true})
        if (!zero || d > 1) rows.push_back({d, m, zero, {}});  // ZeRO-1 shards over the data axis
    double peer = 0;
    for (std::size_t round = 0; round < rounds; ++round) {
      peer = std::max(peer, run_peer(h, steps, x, y));
      for (auto& r : rows) {
        const auto got = run_meshlib(r.d, r.m, r.zero, h, steps, x, y, table_overlap);
        if (got.samples_per_s > r.best.samples_per_s) r.best = got;
        if (r.cpu == 0 || got.cpu_per_step < r.cpu) r.cpu = got.cpu_per_step;
        r.kernels = got.kernels;
        r.products = got.products;
      }
    }
    std::printf("| %zu | hand-written cblas_sgemm, 2 threads | %.0f | | 1.00x | | | |\n", h, peer);
    // "vs 1 device" when the (1, 1) row was measured (a --mesh list may leave it out).
    double one = 0;
    for (const auto& r : rows)
      if (r.d == 1 && r.m == 1) one = r.best.samples_per_s;
    for (const auto& r : rows) {
      char vs_one[32] = "";
      if (one > 0) std::snprintf(vs_one, sizeof vs_one, "%.2fx", r.best.samples_per_s / one);
      std::printf("| %zu | (%zu, %zu)%s | %.0f | %s | %.2fx | %.0f%% | %.1f | %.0f (%.0f + %.0f) |\n", h, r.d, r.m,
                  r.zero ? " ZeRO-1" : "", r.best.samples_per_s, vs_one, r.best.samples_per_s / peer,
                  100.0 * r.best.sync_share, 1e3 * r.cpu, r.kernels + r.products, r.kernels, r.products);
    }
    std::fflush(stdout);
  }
  std::printf("\nload average at the end: %.1f\n", bench::load_average());
  return 0;
} catch (const std::exception& e) {
  // What the library refused at run time (not an option the parser could judge): said, not a crash.
  std::fprintf(stderr, "train_bench: %s\n", e.what());
  return 1;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif
