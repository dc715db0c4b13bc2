// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Pipeline parallelism (nn/parallel/pipeline.hpp, issue 26) with what it used to refuse: 16-bit compute
// (bfloat16, float16 with loss scaling), batch norm (statistics per micro-batch, running statistics
// moved once per micro-batch, in order), gradient accumulation over whole schedules and Adafactor
// (statistics over whole parameters; it threw on another stage's devices); each against
// the run without a pipeline on the same micro-batches (train_options{.accumulation} = micro-batches
// x accumulation). And the activation memory a stage holds across the schedule
// (step_metrics::peak_activation_bytes): 1F1B less than GPipe, by exactly the boundary buffers the
// plans say each holds.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "pipeline_mlp.hpp"
#include "small_gpt.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

namespace nn = meshlib::nn;
// test_pipeline.cpp's five-layer MLP and its data (pipeline_mlp.hpp).
using namespace meshlib_test::pipeline_mlp;  // mesh_t, shape_t, the sizes, make_mlp, data()

/// An MLP with a batch norm on each side of the split at layer 3 (statistics over 'data').
auto make_bn_mlp(const mesh_t& m) {
  const nn::rng_key key{13};
  return nn::sequential(nn::dense<float, mesh_t>(m, "fc1", features, hidden, key),
                        nn::batch_norm<float, mesh_t>(m, "bn1", {1, 1, hidden}, 0.2f), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc2", hidden, hidden, key),
                        nn::batch_norm<float, mesh_t>(m, "bn2", {1, 1, hidden}, 0.2f), nn::gelu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key));
}

template <class State>
nn::step_metrics step(State& state, std::size_t s, std::size_t rows = batch) {
  const auto& ds = data();
  return nn::train_step(state, std::span<const float>(ds.x).subspan(s * rows * features, rows * features),
                        std::span<const std::int32_t>(ds.y).subspan(s * rows, rows), rows, 0, rows);
}

/// Per-step losses of `steps` steps, then evaluate's loss (batches of 44 rows).
template <class State>
std::vector<double> run(State& state, std::size_t steps = 10) {
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(step(state, s).loss);
  out.push_back(nn::evaluate(state, data(), 44).loss);
  return out;
}

template <class Compute>
using state_t = nn::train_state<mesh_t, mlp_t, "data", float, Compute>;

/// The MLP's losses with the pipeline policy `pipe` (on a pipeline axis of one device: no pipeline)
/// and the data-parallel policy `dp`.
template <class Compute = float>
std::vector<double> mlp_losses(const shape_t& shape, nn::train_options o, nn::pipeline<"pipeline"> pipe = {},
                               nn::data_parallel<"data"> dp = {}) {
  const mesh_t m{shape[0], shape[1], shape[2]};
  state_t<Compute> state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), o, dp, pipe);
  return run(state);
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

const char* name(nn::pipeline_kind k) { return k == nn::pipeline_kind::gpipe ? "GPipe" : "1F1B"; }

/// The small GPT (small_gpt.hpp; the head tied to the embedding, mirrored on the last stage).
using meshlib_test::gpt_windows;
using meshlib_test::small_gpt;
using gpt_t = decltype(small_gpt(std::declval<const mesh_t&>()));
/// `small_gpt` with its two blocks in `nn::remat`.
auto small_gpt_remat(const mesh_t& m) { return small_gpt<"model", true>(m); }
template <class Compute = float>
std::vector<double> gpt_losses(const shape_t& shape, nn::train_options o, nn::pipeline<"pipeline"> pipe = {},
                               std::size_t steps = 8) {
  const mesh_t m{shape[0], shape[1], shape[2]};
  nn::train_state<mesh_t, gpt_t, "data", float, Compute> state(m, small_gpt(m), nn::adam(nn::constant(1e-2f)), o, pipe);
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(nn::train_step(state, gpt_windows(s)).loss);
  return out;
}

}  // namespace

TEST_CASE("pipeline in bfloat16: the rounding of the run without a pipeline on the same micro-batches",
          "[nn][pipeline][precision]") {
  // A pipeline of m micro-batches computes what accumulation = m computes without one: the same
  // rows per forward, the gradients summed over them in float and then rounded.
  for (std::size_t mb : {2, 4}) {
    const auto ref = mlp_losses<meshlib::bfloat16>({1, 1, 1}, {.accumulation = mb});
    const auto fl = mlp_losses<float>({1, 1, 1}, {.accumulation = mb});
    CHECK(ref[0] != fl[0]);  // it really computes on the bfloat16 grid
    for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
      for (auto shape : {shape_t{1, 1, 2}, shape_t{1, 1, 4}}) {
        INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ") micro-batches " << mb << " " << name(kind));
        require_close(mlp_losses<meshlib::bfloat16>(shape, {}, {.schedule = kind, .microbatches = mb}), ref,
                      1e-6);
      }
    // Beside a data axis (rows per device differ from the 1-device micro-batches: the data-parallel
    // run with accumulation is the reference) and a tensor axis (the products split: bfloat16 rounding
    // of a float sum in another order, within 0.1%).
    const auto dp_ref = mlp_losses<meshlib::bfloat16>({2, 1, 1}, {.accumulation = mb / 2});
    require_close(mlp_losses<meshlib::bfloat16>({2, 1, 2}, {}, {.microbatches = mb / 2}), dp_ref, 1e-6);
    require_close(mlp_losses<meshlib::bfloat16>({1, 2, 2}, {}, {.microbatches = mb}), ref, 1e-3);
  }
  // The small GPT, its tied table's two gradients summed across stages before the rounding.
  const auto ref = gpt_losses<meshlib::bfloat16>({1, 1, 1}, {.accumulation = 4});
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
    INFO(name(kind));
    require_close(gpt_losses<meshlib::bfloat16>({1, 1, 2}, {}, {.schedule = kind, .microbatches = 4}), ref, 1e-3);
  }
}

#if MESHLIB_HAS_FLOAT16
TEST_CASE("pipeline in float16: dynamic loss scaling skips the same steps as without a pipeline",
          "[nn][pipeline][precision]") {
  // A huge initial scale: the first steps overflow and are skipped, halving the scale, on both.
  const nn::train_options base{.loss_scale = 1e12f, .scale_growth_interval = 3};
  const mesh_t one{1, 1, 1}, m{1, 1, 2};
  nn::train_options ro = base;
  ro.accumulation = 2;
  state_t<meshlib::float16> ref(one, make_mlp(one), nn::adam(nn::constant(1e-2f)), ro);
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
    const nn::pipeline<"pipeline"> pipe{.schedule = kind, .microbatches = 2};
    state_t<meshlib::float16> a(one, make_mlp(one), nn::adam(nn::constant(1e-2f)), ro);
    state_t<meshlib::float16> b(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), base, pipe);
    std::size_t skipped = 0;
    for (std::size_t s = 0; s < 12; ++s) {
      INFO(name(kind) << " step " << s);
      const auto x = step(a, s), y = step(b, s);
      REQUIRE(x.skipped == y.skipped);
      REQUIRE(x.loss_scale == y.loss_scale);
      REQUIRE(std::abs(x.loss - y.loss) <= 1e-6 * std::abs(x.loss));
      skipped += x.skipped ? 1 : 0;
    }
    CHECK(skipped > 0);
    CHECK(a.step == b.step);
    CHECK(a.loss_scale() == b.loss_scale());
  }
}
#endif

TEST_CASE("pipeline with batch norm: statistics per micro-batch, running statistics moved once per micro-batch in "
          "order, as accumulation without a pipeline",
          "[nn][pipeline][batch_norm]") {
  using bn_t = decltype(make_bn_mlp(std::declval<const mesh_t&>()));
  const auto running = [](const nn::train_state<mesh_t, bn_t>& s, std::size_t dev) {
    std::vector<float> v;
    for (const auto* t : {&std::get<1>(s.model.layers).running_mean(), &std::get<1>(s.model.layers).running_var(),
                          &std::get<4>(s.model.layers).running_mean(), &std::get<4>(s.model.layers).running_var()})
      v.insert(v.end(), t->local(dev).data(), t->local(dev).data() + hidden);
    return v;
  };
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_pipeline_bn_" + std::to_string(::getpid()));
  for (std::size_t dp : {1, 2})
    for (std::size_t mb : {2, 4}) {
      // The reference: the same data mesh without a pipeline, accumulating over the same micro-batches.
      const mesh_t rm{dp, 1, 1};
      nn::train_state ref(rm, make_bn_mlp(rm), nn::adam(nn::constant(1e-2f)), {.accumulation = mb});
      const auto want = run(ref);
      const auto stats = running(ref, 0);
      CHECK(stats != running(nn::train_state(rm, make_bn_mlp(rm), nn::adam(nn::constant(1e-2f))), 0));  // they moved
      for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
        for (std::size_t p : {2, 3}) {
          const mesh_t m{dp, 1, p};
          INFO("mesh " << m << " micro-batches " << mb << " " << name(kind));
          std::vector<std::size_t> split = p == 2 ? std::vector<std::size_t>{3} : std::vector<std::size_t>{2, 5};
          nn::train_state state(m, make_bn_mlp(m), nn::adam(nn::constant(1e-2f)),
                                nn::pipeline<"pipeline">{.schedule = kind, .microbatches = mb, .split_points = split});
          require_close(run(state), want, 1e-5);  // the evaluation (last) uses the running statistics
          // Every device holds them (each stage sends its layers' to the others after a step).
          for (std::size_t dev = 0; dev < m.size(); ++dev) {
            INFO("device " << dev);
            const auto got = running(state, dev);
            for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(std::abs(got[i] - stats[i]) <= 1e-5f * (1 + std::abs(stats[i])));
          }
          // So a checkpoint holds them, and restores on one device.
          if (dp == 2 && mb == 2) {
            fs::remove_all(dir);
            nn::save_checkpoint(dir, state);
            const mesh_t one{1, 1, 1};
            nn::train_state back(one, make_bn_mlp(one), nn::adam(nn::constant(1e-2f)));
            nn::restore_checkpoint(dir, back);
            CHECK(running(back, 0) == running(state, 0));
          }
        }
    }
  fs::remove_all(dir);
}

TEST_CASE("pipeline with gradient accumulation: whole schedules summed before one synchronisation",
          "[nn][pipeline][accumulation]") {
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
    INFO(name(kind));
    // accumulation k x micro-batches m: the run without a pipeline accumulating over k m micro-batches.
    const auto ref = mlp_losses({1, 1, 1}, {.accumulation = 4});
    require_close(mlp_losses({1, 1, 2}, {.accumulation = 2}, {.schedule = kind, .microbatches = 2}), ref, 1e-5);
    require_close(mlp_losses({1, 1, 4}, {.accumulation = 4}, {.schedule = kind, .microbatches = 1}), ref, 1e-5);
    require_close(mlp_losses({1, 2, 2}, {.accumulation = 2}, {.schedule = kind, .microbatches = 2}), ref, 1e-5);
    const auto dp_ref = mlp_losses({2, 1, 1}, {.accumulation = 4});
    require_close(mlp_losses({2, 1, 2}, {.accumulation = 2}, {.schedule = kind, .microbatches = 2}), dp_ref,
                  1e-5);
    require_close(mlp_losses({2, 1, 2}, {.accumulation = 2}, {.schedule = kind, .microbatches = 2}, {.zero = 1}),
                  dp_ref, 1e-5);
    // The GPT: its mirrored head's gradient summed over all k m micro-batches.
    require_close(gpt_losses({1, 1, 2}, {.accumulation = 2}, {.schedule = kind, .microbatches = 2}),
                  gpt_losses({1, 1, 1}, {}), 1e-5);
  }
  // Micro-batches x accumulation steps that do not divide a device's rows.
  const mesh_t m{2, 1, 2};
  nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), {.accumulation = 3}, nn::pipeline<"pipeline">{.microbatches = 2});
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { step(state, 0); }) ==
        "meshlib::nn: train_step: the pipeline's 2 micro-batches x 3 accumulation steps do not divide the 8 rows each "
        "device of the data axes gets (a global batch of 16 rows over 2 devices); choose pipeline.microbatches x "
        "accumulation dividing 8, or a batch of a multiple of 12 rows");
  CHECK(state.step == 0);
}

namespace {
/// The most received activations, received cotangents and loss gradients stage `st` holds at once
/// under `plan`, counted from the rounds (independently of `pipeline_plan::held`): an activation
/// from the forward exchange that brings it to the stage's backward of it, a cotangent from the
/// backward exchange that brings it to that backward, a loss gradient from the last stage's forward
/// to its backward.
std::array<std::size_t, 3> most_held(const nn::pipeline_plan& plan, std::size_t st) {
  constexpr auto none = nn::pipeline_slot::none;
  const std::size_t p = plan.stages();
  std::array<std::size_t, 3> now{}, most{};
  const auto up = [&](std::size_t k) { most[k] = std::max(most[k], ++now[k]); };
  for (const auto& r : plan.rounds()) {
    if (st + 1 == p && r[st].forward != none) up(2);
    if (st > 0 && r[st - 1].forward != none) up(0);
    if (r[st].backward != none) {
      if (st > 0) --now[0];
      if (st + 1 < p) --now[1];
      else --now[2];
    }
    if (st + 1 < p && r[st + 1].backward != none) up(1);
  }
  return most;
}
}  // namespace

TEST_CASE("pipeline activation memory: each stage's peak is its layers' buffers plus the boundary buffers the "
          "schedule holds; 1F1B holds fewer than GPipe",
          "[nn][pipeline][remat]") {
  // The MLP cut at layer 2: stage 0 runs fc1 and relu, the rest on the last stage. The boundary
  // activation is `hidden` wide; the loss gradient `classes` wide.
  const std::size_t micro = 4;
  for (std::size_t p : {2, 4}) {
    std::vector<std::size_t> split = p == 2 ? std::vector<std::size_t>{2} : std::vector<std::size_t>{1, 2, 4};
    for (std::size_t mb : {1, 2, 4, 8}) {
      const std::size_t rows = micro * mb;
      const mesh_t m{1, 1, p};
      std::vector<std::size_t> layer_bytes(p);  // per stage, the peak less the boundary buffers
      std::array<std::vector<std::size_t>, 2> peaks;
      for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
        INFO(p << " stages, " << mb << " micro-batches of " << micro << " rows, " << name(kind));
        nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)),
                              nn::pipeline<"pipeline">{.schedule = kind, .microbatches = mb, .split_points = split});
        const nn::pipeline_plan plan(kind, p, mb);
        // The widest boundary activation is `hidden` (p = 4: fc1 | relu | fc2 gelu | fc3: all `hidden`).
        const std::size_t msg = micro * hidden * sizeof(float), zn = micro * classes * sizeof(float);
        for (std::size_t s = 0; s < 3; ++s) {
          const auto metrics = step(state, s, rows);
          CHECK(metrics.peak_activation_bytes == state.activation_meter(0)->peak);
          CHECK(metrics.activation_bytes <= metrics.peak_activation_bytes);
          CHECK(metrics.activation_bytes > 0);
        }
        for (std::size_t st = 0; st < p; ++st) {
          INFO("stage " << st);
          const auto most = most_held(plan, st);
          const auto h = plan.held(st);
          CHECK(h.inputs == most[0]);
          CHECK(h.cotangents == most[1]);
          CHECK(h.loss_grads == most[2]);
          const std::size_t boundary = (most[0] + most[1]) * msg + most[2] * zn + msg;  // + the send buffer
          const std::size_t peak = state.activation_meter(st)->peak;  // device st is stage st
          REQUIRE(peak > boundary);
          peaks[kind == nn::pipeline_kind::gpipe ? 0 : 1].push_back(peak);
          // The layers' part does not depend on the schedule.
          if (kind == nn::pipeline_kind::gpipe) layer_bytes[st] = peak - boundary;
          else CHECK(peak - boundary == layer_bytes[st]);
        }
        // GPipe's last stage holds every micro-batch's activation and loss gradient; 1F1B's stage s
        // at most 2 (p - s) activations.
        if (kind == nn::pipeline_kind::gpipe) CHECK(plan.held(p - 1).inputs == mb);
        if (kind == nn::pipeline_kind::gpipe) CHECK(plan.held(p - 1).loss_grads == mb);
        if (kind == nn::pipeline_kind::one_f_one_b)
          for (std::size_t st = 1; st < p; ++st) CHECK(plan.held(st).inputs <= std::min(mb, 2 * (p - st)));
      }
      for (std::size_t st = 0; st < p; ++st) {
        INFO(p << " stages, " << mb << " micro-batches, stage " << st);
        CHECK(peaks[1][st] <= peaks[0][st]);
        if (mb >= 2 * p && st + 1 == p) CHECK(peaks[1][st] < peaks[0][st]);
      }
    }
  }
}

TEST_CASE("pipeline activation memory: remat inside a stage lowers its activations and peak, the losses unchanged",
          "[nn][pipeline][remat]") {
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
    INFO(name(kind));
    const mesh_t m{1, 1, 2};
    // Both blocks on stage 0: during h1's backward, remat has dropped h0's internal buffers.
    const nn::pipeline<"pipeline"> o{.schedule = kind, .microbatches = 4, .split_points = {4}};
    nn::train_state plain(m, small_gpt(m), nn::adam(nn::constant(1e-2f)), o);
    nn::train_state remat(m, small_gpt_remat(m), nn::adam(nn::constant(1e-2f)), o);
    for (std::size_t s = 0; s < 3; ++s) {
      const auto a = nn::train_step(plain, gpt_windows(s)), b = nn::train_step(remat, gpt_windows(s));
      REQUIRE(std::abs(a.loss - b.loss) <= 1e-6 * a.loss);
    }
    const auto a = nn::train_step(plain, gpt_windows(3)), b = nn::train_step(remat, gpt_windows(3));
    CHECK(b.activation_bytes < a.activation_bytes);  // device 0: stage 0, both blocks
    CHECK(b.peak_activation_bytes < a.peak_activation_bytes);
    // Stage 1 (ln_f and the head) has nothing in remat: the same bytes.
    CHECK(remat.activation_meter(1)->peak == plain.activation_meter(1)->peak);
  }
}

TEST_CASE("pipeline_plan::bubble_with_costs: the plan's bubble with each stage's own costs, and nn::stage_times "
          "counts each stage's forwards, backwards and recomputes",
          "[nn][pipeline]") {
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (std::size_t p = 1; p <= 5; ++p)
      for (std::size_t m = 1; m <= 9; ++m) {
        const nn::pipeline_plan plan(kind, p, m);
        INFO(plan.timeline());
        // Equal costs everywhere: the plan's own bubble with recompute.
        const std::vector<double> one(p, 1.0), two(p, 2.0);
        CHECK(std::abs(plan.bubble_with_costs(one, two, one) - plan.bubble_with_recompute(1.0, 2.0)) < 1e-12);
        // A free recompute: the closed form.
        CHECK(std::abs(plan.bubble_with_costs(one, two, std::vector<double>(p, 0.0)) -
                       nn::pipeline_schedule::ideal_bubble(p, m)) < 1e-12);
      }
  // Two stages, stage 0's backward one product cheaper (no input cotangent), a recompute one
  // forward: GPipe's rounds are m forwards, the last stage's first forward + backward, m - 1
  // backward rounds at the last stage's 3, stage 0's last backward (2): 4 m + 3; the stages
  // work 3 m and 4 m.
  for (std::size_t m = 1; m <= 16; ++m) {
    const nn::pipeline_plan plan(nn::pipeline_kind::gpipe, 2, m);
    const double want = 1.0 - 7.0 * static_cast<double>(m) / (2.0 * (4.0 * static_cast<double>(m) + 3.0));
    CHECK(std::abs(plan.bubble_with_costs({1, 1}, {1, 2}, {1, 1}) - want) < 1e-12);
  }
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([] {
          (void)nn::pipeline_plan(nn::pipeline_kind::gpipe, 2, 2).bubble_with_costs({1}, {1, 1}, {1, 1});
        }) == "meshlib::nn::pipeline_plan::bubble_with_costs: 1, 2 and 2 costs for 2 stages; give one forward, backward "
              "and recompute cost per stage");
  // The counts of a real step (accumulation 2: two schedules).
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
    const mesh_t m{1, 1, 2};
    nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)),
                          {.accumulation = 2}, nn::pipeline<"pipeline">{.schedule = kind, .microbatches = 4});
    (void)step(state, 0);
    const nn::pipeline_plan plan(kind, 2, 4);
    for (std::size_t st = 0; st < 2; ++st) {
      std::size_t again = 0;
      for (std::size_t r = 0; r < plan.rounds().size(); ++r) again += plan.recomputes(r, st) ? 1 : 0;
      const auto t = nn::stage_times(state, st);
      CHECK(t.forwards == 8);
      CHECK(t.backwards == 8);
      CHECK(t.recomputes == 2 * again);
      CHECK(t.forward > 0);
      CHECK(t.backward > 0);
      CHECK((t.recompute > 0) == (again > 0));
    }
  }
  const mesh_t one{1, 1, 1};
  nn::train_state flat(one, make_mlp(one), nn::adam(nn::constant(1e-2f)));
  CHECK(nn::stage_times(flat, 0).forwards == 0);
}

TEST_CASE("pipeline with adafactor", "[nn][pipeline][adafactor]") {
  // Adafactor's statistics are summed over a parameter's pieces (nn/train/param_blocks.hpp): the
  // devices of another stage hold none of it and take no part (they threw, as if handed a piece
  // with nothing to sum it over); a stage's tensor-parallel blocks and ZeRO-1 runs are summed.
  const nn::optimizer opt = nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f});
  const auto losses = [&](const shape_t& shape, nn::pipeline<"pipeline"> pipe, nn::data_parallel<"data"> dp = {}) {
    const mesh_t m{shape[0], shape[1], shape[2]};
    state_t<float> state(m, make_mlp(m), opt, {}, dp, pipe);
    return run(state, 5);
  };
  const auto ref = losses({1, 1, 1}, {});
  require_close(losses({1, 1, 2}, {.microbatches = 2}), ref, 1e-5);
  require_close(losses({1, 2, 2}, {.microbatches = 2}), ref, 1e-5);
  require_close(losses({2, 1, 2}, {.microbatches = 2}, {.zero = 1}), losses({2, 1, 1}, {}), 1e-5);
}

}  // namespace MESHLIB_TEST_UNIT
