// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Pipeline bubble (issue 26): the idle fraction of pipelined training steps measured from the real
// run (each device's compute time against the step's rounds, nn::measured_bubble) for GPipe and
// 1F1B, against the closed form (p - 1) / (m + p - 1). The model is balanced: p stages of one
// dense layer (width W) and a relu each, the last stage also a small head. Not a test: it prints a
// table (docs/benchmarks.md keeps the numbers). A measurement means something only when every
// device has a core of its own (p <= cores, nothing else running).
//
//   pipeline_bench [--stages P] [--width W] [--rows R] [--steps N]   (R: rows per micro-batch)
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"pipeline">>;
namespace nn = meshlib::nn;
constexpr std::size_t classes = 10;

/// Two stages' layers: dense + relu each, the head on the last.
auto make_net2(const mesh_t& m, std::size_t w) {
  const nn::rng_key key{3};
  return nn::sequential(nn::dense<float, mesh_t>(m, "s0", w, w, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "s1", w, w, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "head", w, classes, key));
}
auto make_net4(const mesh_t& m, std::size_t w) {
  const nn::rng_key key{3};
  return nn::sequential(nn::dense<float, mesh_t>(m, "s0", w, w, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "s1", w, w, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "s2", w, w, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "s3", w, w, key), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "head", w, classes, key));
}

template <class Net>
double measure(Net net, const mesh_t& m, std::size_t p, std::size_t mb, nn::pipeline_kind kind, std::size_t w,
               std::size_t rows, std::size_t steps) {
  std::vector<std::size_t> splits;
  for (std::size_t s = 1; s < p; ++s) splits.push_back(2 * s);
  nn::train_state state(m, std::move(net), nn::sgd(nn::constant(1e-3f), 0.0f),
                        {.pipeline = {.microbatches = mb, .schedule = kind, .split_points = splits}});
  const std::size_t batch = rows * mb;
  std::vector<float> x(batch * w);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 101) / 101.0f;
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  double sum = 0;
  for (std::size_t s = 0; s < steps + 2; ++s) {
    (void)nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(y), batch, 0, batch);
    if (s >= 2) sum += nn::measured_bubble(state);  // two warm-up steps
  }
  return sum / static_cast<double>(steps);
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  std::size_t p = 2, w = 512, rows = 128, steps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const std::size_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (a == "--stages") p = v;
    else if (a == "--width") w = v;
    else if (a == "--rows") rows = v;
    else if (a == "--steps") steps = v;
  }
  if (p != 2 && p != 4) {
    std::fprintf(stderr, "pipeline_bench: --stages 2 or 4\n");
    return 2;
  }
  meshlib::set_blas_threads_per_device(1);
  const mesh_t m{1, p};
  std::printf("pipeline bubble, %zu stages (dense %zu x %zu + relu each), %zu rows per micro-batch, mean of %zu steps\n",
              p, w, w, rows, steps);
  std::printf("| micro-batches | (p-1)/(m+p-1) | GPipe measured | GPipe plan + recompute | 1F1B measured | 1F1B plan + "
              "recompute |\n|---:|---:|---:|---:|---:|---:|\n");
  for (std::size_t mb : {1, 2, 4, 8, 16}) {
    double g = 0, f = 0;
    if (p == 2) {
      g = measure(make_net2(m, w), m, p, mb, nn::pipeline_kind::gpipe, w, rows, steps);
      f = measure(make_net2(m, w), m, p, mb, nn::pipeline_kind::one_f_one_b, w, rows, steps);
    } else {
      g = measure(make_net4(m, w), m, p, mb, nn::pipeline_kind::gpipe, w, rows, steps);
      f = measure(make_net4(m, w), m, p, mb, nn::pipeline_kind::one_f_one_b, w, rows, steps);
    }
    // The plans' bubble when a backward costs twice a forward and a recomputing backward three times.
    const double gp = nn::pipeline_plan(nn::pipeline_kind::gpipe, p, mb).bubble_with_recompute(1.0, 2.0);
    const double fp = nn::pipeline_plan(nn::pipeline_kind::one_f_one_b, p, mb).bubble_with_recompute(1.0, 2.0);
    std::printf("| %zu | %.3f | %.3f | %.3f | %.3f | %.3f |\n", mb, nn::pipeline_schedule::ideal_bubble(p, mb), g, gp, f,
                fp);
  }
  return 0;
}
