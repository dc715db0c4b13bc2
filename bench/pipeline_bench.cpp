// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Pipeline bubble (issue 26): the idle fraction of pipelined training steps measured from the real
// run (each device's compute time against the step's rounds, nn::measured_bubble) for GPipe and
// 1F1B, against the closed form (p - 1) / (m + p - 1) and against the plan with the stages' own
// measured costs (pipeline_plan::bubble_with_costs of nn::stage_times, thread CPU seconds: what the
// schedule costs on this model when messages are free). The model: p stages of one dense layer
// (width W) and a relu each, the last stage also a small head. With --lead-relu a relu comes first,
// so stage 0's dense computes its input's cotangent as every later stage's does (the stages'
// backwards then cost the same). Also each stage's peak activation bytes. Not a test: it prints a
// table (docs/benchmarks.md keeps the numbers). GPipe and 1F1B steps are interleaved; the load
// average is printed with the table. The measured bubble is wall time: it means what it says only
// when every device has a core of its own (p <= idle cores).
//
//   pipeline_bench [--stages P] [--width W] [--rows R] [--steps N] [--lead-relu 1]   (R: rows per micro-batch)
//
//   pipeline_bench [--stages 2|4] [--width W] [--rows R] [--steps N] [--lead-relu 0|1]
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2.
#include <cstddef>

#include "bench_options.hpp"

namespace {

struct options {
  std::size_t p = 2, w = 512, rows = 128, steps = 10;
  bool lead = false;
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("pipeline_bench",
                         "usage: pipeline_bench [--stages 2|4] [--width W] [--rows R] [--steps N] [--lead-relu 0|1]\n", argc,
                         argv);
  options o;
  o.p = cl.choice("--stages", {"2", "4"}, "2") == "4" ? 4 : 2;
  o.w = cl.count("--width", o.w);
  o.rows = cl.count("--rows", o.rows);
  o.steps = cl.count("--steps", o.steps);
  o.lead = cl.choice("--lead-relu", {"0", "1"}, "0") == "1";
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cstdio>
#include <stdexcept>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"pipeline">>;
namespace nn = meshlib::nn;
constexpr std::size_t classes = 10;

/// p stages' layers: dense + relu each, the head on the last; `Lead`: a relu first.
template <bool Lead>
auto make_net2(const mesh_t& m, std::size_t w) {
  const nn::rng_key key{3};
  auto rest = [&](auto... first) {
    return nn::sequential(first..., nn::dense<float, mesh_t>(m, "s0", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "s1", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "head", w, classes, key));
  };
  if constexpr (Lead) return rest(nn::relu<float>(m));
  else return rest();
}
template <bool Lead>
auto make_net4(const mesh_t& m, std::size_t w) {
  const nn::rng_key key{3};
  auto rest = [&](auto... first) {
    return nn::sequential(first..., nn::dense<float, mesh_t>(m, "s0", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "s1", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "s2", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "s3", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "head", w, classes, key));
  };
  if constexpr (Lead) return rest(nn::relu<float>(m));
  else return rest();
}

struct result {
  double measured = 0, with_costs = 0;
  std::vector<double> forward, backward, recompute;  // per stage: mean CPU seconds of one
  std::vector<std::size_t> peak;  // per stage: peak activation bytes
};

template <bool Lead, std::size_t P>
auto make_state(const mesh_t& m, std::size_t mb, nn::pipeline_kind kind, std::size_t w) {
  std::vector<std::size_t> splits;
  for (std::size_t s = 1; s < P; ++s) splits.push_back(2 * s + (Lead ? 1 : 0));
  const nn::pipeline<"pipeline"> o{.schedule = kind, .microbatches = mb, .split_points = splits};
  if constexpr (P == 2) return nn::train_state(m, make_net2<Lead>(m, w), nn::sgd(nn::constant(1e-3f), 0.0f), o);
  else return nn::train_state(m, make_net4<Lead>(m, w), nn::sgd(nn::constant(1e-3f), 0.0f), o);
}

/// Both schedules' states stepped in turn (interleaved), `steps` steps after 2 warm-up steps each.
template <class State>
std::array<result, 2> measure(std::array<State*, 2> states, std::size_t p, std::size_t mb, std::size_t w,
                              std::size_t rows, std::size_t steps) {
  const std::size_t batch = rows * mb;
  std::vector<float> x(batch * w);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 101) / 101.0f;
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
  std::array<result, 2> out;
  std::array<std::vector<double>, 2> f, b, r;
  for (auto& v : f) v.assign(p, 0.0);
  b = f;
  r = f;
  for (std::size_t s = 0; s < steps + 2; ++s)
    for (std::size_t k = 0; k < 2; ++k) {
      State& state = *states[k];
      (void)nn::train_step(state, std::span<const float>(x), std::span<const std::int32_t>(y), batch, 0, batch);
      if (s < 2) continue;  // two warm-up steps
      out[k].measured += nn::measured_bubble(state) / static_cast<double>(steps);
      for (std::size_t st = 0; st < p; ++st) {  // device st is stage st on a (1, p) mesh
        const auto t = nn::stage_times(state, st);
        f[k][st] += t.forward / static_cast<double>(t.forwards);
        b[k][st] += t.backward / static_cast<double>(t.backwards);
        r[k][st] += t.recomputes == 0 ? 0.0 : t.recompute / static_cast<double>(t.recomputes);
      }
    }
  for (std::size_t k = 0; k < 2; ++k) {
    const auto& plan = nn::pipeline_plan(k == 0 ? nn::pipeline_kind::gpipe : nn::pipeline_kind::one_f_one_b, p, mb);
    out[k].with_costs = plan.bubble_with_costs(f[k], b[k], r[k]);
    for (std::size_t st = 0; st < p; ++st) {
      out[k].forward.push_back(f[k][st] / static_cast<double>(steps));
      out[k].backward.push_back(b[k][st] / static_cast<double>(steps));
      out[k].recompute.push_back(r[k][st] / static_cast<double>(steps));
    }
    for (std::size_t st = 0; st < p; ++st) out[k].peak.push_back(states[k]->activation_meter(st)->peak);
  }
  return out;
}

template <bool Lead, std::size_t P>
void table(std::size_t w, std::size_t rows, std::size_t steps) {
  const std::size_t p = P;
  const mesh_t m{1, p};
  double load[3] = {0, 0, 0};
  (void)getloadavg(load, 3);
  std::printf("pipeline bubble, %zu stages (dense %zu x %zu + relu each%s), %zu rows per micro-batch, mean of %zu "
              "steps, GPipe and 1F1B interleaved; load average %.2f %.2f %.2f\n",
              p, w, w, Lead ? ", a relu first" : "", rows, steps, load[0], load[1], load[2]);
  std::printf("| m | (p-1)/(m+p-1) | GPipe measured | GPipe plan, measured costs | GPipe plan + recompute | 1F1B measured | "
              "1F1B plan, measured costs | 1F1B plan + recompute | peak act. KiB per stage GPipe | 1F1B |\n"
              "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n");
  std::string costs;
  for (std::size_t mb : {1, 2, 4, 8, 16}) {
    auto g = make_state<Lead, P>(m, mb, nn::pipeline_kind::gpipe, w);
    auto f = make_state<Lead, P>(m, mb, nn::pipeline_kind::one_f_one_b, w);
    const auto res = measure<decltype(g)>({&g, &f}, p, mb, w, rows, steps);
    // The plans' bubble when a backward costs twice a forward and a recomputing backward three times.
    const double gp = nn::pipeline_plan(nn::pipeline_kind::gpipe, p, mb).bubble_with_recompute(1.0, 2.0);
    const double fp = nn::pipeline_plan(nn::pipeline_kind::one_f_one_b, p, mb).bubble_with_recompute(1.0, 2.0);
    const auto kib = [](const std::vector<std::size_t>& v) {
      std::string s;
      for (std::size_t i = 0; i < v.size(); ++i) s += (i ? " / " : "") + std::to_string(v[i] / 1024);
      return s;
    };
    std::printf("| %zu | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %s | %s |\n", mb,
                nn::pipeline_schedule::ideal_bubble(p, mb), res[0].measured, res[0].with_costs, gp, res[1].measured,
                res[1].with_costs, fp, kib(res[0].peak).c_str(), kib(res[1].peak).c_str());
    for (std::size_t k = 0; k < 2; ++k) {
      costs += "m = " + std::to_string(mb) + (k == 0 ? " GPipe:" : " 1F1B:");
      for (std::size_t st = 0; st < p; ++st) {
        char buf[96];
        std::snprintf(buf, sizeof buf, " stage %zu %.2f / %.2f / %.2f", st, 1e3 * res[k].forward[st],
                      1e3 * res[k].backward[st], 1e3 * res[k].recompute[st]);
        costs += buf;
      }
      costs += "\n";
    }
  }
  std::printf("\nper-stage CPU ms of one forward / backward (less recompute) / recomputed forward:\n%s", costs.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse_options(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  const std::size_t p = o.p, w = o.w, rows = o.rows, steps = o.steps;
  const bool lead = o.lead;
  meshlib::set_blas_threads_per_device(1);
  if (p == 2) lead ? table<true, 2>(w, rows, steps) : table<false, 2>(w, rows, steps);
  else lead ? table<true, 4>(w, rows, steps) : table<false, 4>(w, rows, steps);
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif
