// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Mixed precision: training computing in bfloat16 (and float16 where the compiler has it) with float
// master weights tracks the float run; bfloat16 training is mesh-invariant; dynamic loss scaling
// skips a step whose gradients overflow on any one device (on every device alike) and halves the
// scale, and doubles it after the configured run of good steps.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <limits>
#include <vector>

#include <unistd.h>

#include "meshlib_catch.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32, steps = 5;

nn::dataset synthetic(std::size_t count) { return meshlib_test::synthetic_problem(count, features, classes); }

auto make_net(const mesh_t& m) {
  const nn::rng_key key{5};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, classes, key));
}
using net_t = decltype(make_net(std::declval<const mesh_t&>()));

template <class Compute>
using state_t = nn::train_state<mesh_t, net_t, "data", float, Compute>;

template <class State>
nn::step_metrics step_on(State& s, const nn::dataset& ds, std::size_t i) {
  return nn::train_step(s, std::span<const float>(ds.x).subspan(i * batch * features, batch * features),
                        std::span<const std::int32_t>(ds.y).subspan(i * batch, batch), batch, 0, batch);
}

template <class Compute, class... Policies>
std::vector<double> losses(const mesh_t& m, nn::train_options o = {}, const Policies&... policies) {
  const auto ds = synthetic(batch * steps);
  state_t<Compute> s(m, make_net(m), nn::adam(nn::constant(1e-2f)), o, policies...);
  std::vector<double> out;
  for (std::size_t i = 0; i < steps; ++i) out.push_back(step_on(s, ds, i).loss);
  return out;
}

bool on_bf16_grid(float f) { return (std::bit_cast<std::uint32_t>(f) & 0xffffu) == 0; }

}  // namespace

TEST_CASE("training in bfloat16 tracks float within 0.2% per step and learns", "[nn][precision]") {
  const auto ref = losses<float>(mesh_t{4, 1});
  const auto got = losses<meshlib::bfloat16>(mesh_t{4, 1});
  for (std::size_t i = 0; i < steps; ++i) {
    INFO("step " << i << ": bf16 " << got[i] << " vs float " << ref[i]);
    CHECK(got[i] != ref[i]);  // it really computes on the bfloat16 grid
    CHECK(std::abs(got[i] - ref[i]) <= 2e-3 * ref[i]);
  }
  CHECK(got.back() < got.front());
}

TEST_CASE("bfloat16 training is mesh-invariant within 0.03% (data, tensor and hybrid parallel, ZeRO-1)", "[nn][precision]") {
  const auto ref = losses<meshlib::bfloat16>(mesh_t{1, 1});
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{4, 1}, {2, 2}, {1, 4}}) {
    const auto got = losses<meshlib::bfloat16>(mesh_t{d, mo});
    for (std::size_t i = 0; i < steps; ++i) {
      INFO("mesh (" << d << ", " << mo << ") step " << i << ": " << got[i] << " vs " << ref[i]);
      CHECK(std::abs(got[i] - ref[i]) <= 3e-4 * ref[i]);
    }
  }
  // ZeRO-1 updates slices of the float masters and all-gathers them: the same losses.
  const auto zero = losses<meshlib::bfloat16>(mesh_t{4, 1}, {}, nn::data_parallel<"data">{.zero = 1});
  const auto replicated = losses<meshlib::bfloat16>(mesh_t{4, 1});
  for (std::size_t i = 0; i < steps; ++i) {
    INFO("ZeRO-1 step " << i << ": " << zero[i] << " vs " << replicated[i]);
    CHECK(std::abs(zero[i] - replicated[i]) <= 3e-4 * replicated[i]);
  }
}

TEST_CASE("bfloat16 compute keeps float master weights; parameters are their rounding", "[nn][precision]") {
  const mesh_t m{2, 2};
  const auto ds = synthetic(batch * 2);
  state_t<meshlib::bfloat16> s(m, make_net(m), nn::adam(nn::constant(1e-2f)));
  for (std::size_t i = 0; i < 2; ++i) step_on(s, ds, i);
  std::size_t off_grid = 0, total = 0;
  for (std::size_t i = 0; i < s.params.size(); ++i)
    for (std::size_t dev = 0; dev < m.size(); ++dev)
      for (std::size_t k = 0; k < s.params[i].count[dev]; ++k) {
        const float master = s.master(i, dev)[k], value = s.params[i].value[dev][k];
        REQUIRE(on_bf16_grid(value));
        REQUIRE(value == static_cast<float>(meshlib::bfloat16(master)));
        off_grid += on_bf16_grid(master) ? 0 : 1;
        ++total;
      }
  CHECK(off_grid > total / 2);  // the masters hold the float updates the bfloat16 values round away
  CHECK(!s.loss_scaling());     // bfloat16 has float's range: no loss scaling by default
}

TEST_CASE("a bfloat16 checkpoint holds the float masters and resumes on another mesh", "[nn][precision][checkpoint]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_mixed_ckpt_" + std::to_string(::getpid()));
  const auto ds = synthetic(batch * 3);
  const mesh_t m1{2, 2}, m2{4, 1};
  state_t<meshlib::bfloat16> a(m1, make_net(m1), nn::adam(nn::constant(1e-2f)));
  step_on(a, ds, 0);
  step_on(a, ds, 1);
  nn::save_checkpoint(dir, a);
  state_t<meshlib::bfloat16> b(m2, make_net(m2), nn::adam(nn::constant(1e-2f)));
  nn::restore_checkpoint(dir, b);
  fs::remove_all(dir);
  // Parameter 0 (fc1.w, 12 x 16): its masters, gathered by global index, agree on both meshes
  // (not just the bfloat16 values), and the values are their rounding.
  for (std::size_t i = 0; i < b.params.size(); ++i)
    for (std::size_t dev = 0; dev < m2.size(); ++dev)
      for (std::size_t k = 0; k < b.params[i].count[dev]; ++k)
        REQUIRE(b.params[i].value[dev][k] == static_cast<float>(meshlib::bfloat16(b.master(i, dev)[k])));
  std::size_t off_grid = 0;
  for (std::size_t k = 0; k < b.params[0].count[0]; ++k) off_grid += on_bf16_grid(b.master(0, 0)[k]) ? 0 : 1;
  CHECK(off_grid > b.params[0].count[0] / 2);
  const double la = step_on(a, ds, 2).loss, lb = step_on(b, ds, 2).loss;
  CHECK(std::abs(la - lb) <= 3e-4 * la);
}

#if MESHLIB_HAS_FLOAT16
TEST_CASE("float16 training with dynamic loss scaling tracks float within 0.03%", "[nn][precision][float16]") {
  const auto ref = losses<float>(mesh_t{2, 2});
  const auto got = losses<meshlib::float16>(mesh_t{2, 2});
  for (std::size_t i = 0; i < steps; ++i) {
    INFO("step " << i << ": f16 " << got[i] << " vs float " << ref[i]);
    CHECK(std::abs(got[i] - ref[i]) <= 3e-4 * ref[i]);
  }
}

TEST_CASE("loss scaling: an overflow on one device skips the step on every device and halves the scale",
          "[nn][precision][float16]") {
  const mesh_t m{2, 2};
  auto ds = synthetic(batch * 4);
  state_t<meshlib::float16> s(m, make_net(m), nn::adam(nn::constant(1e-2f)), {.scale_growth_interval = 2});
  REQUIRE(s.loss_scaling());
  REQUIRE(s.loss_scale() == 32768.0f);
  // Step 1 is good; the growth interval is 2, so the scale holds.
  auto r = step_on(s, ds, 0);
  CHECK_FALSE(r.skipped);
  CHECK(s.step == 1);
  CHECK(s.loss_scale() == 32768.0f);
  // Step 2 holds 1e6 in one input element of the first row: only data-replica 0 (devices 0, 1) sees
  // it; float16 overflows there (65504 is its largest finite value).
  ds.x[1 * batch * features + 3] = 1e6f;
  std::vector<std::vector<float>> before, masters_before;
  for (std::size_t i = 0; i < s.params.size(); ++i)
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      before.emplace_back(s.params[i].value[dev], s.params[i].value[dev] + s.params[i].count[dev]);
      masters_before.emplace_back(s.master(i, dev), s.master(i, dev) + s.params[i].count[dev]);
    }
  std::vector<float> opt_before = s.optimizer_state(3);
  r = step_on(s, ds, 1);
  CHECK(r.skipped);
  CHECK(!std::isfinite(r.grad_norm));
  CHECK(r.loss_scale == 32768.0);
  CHECK(s.loss_scale() == 16384.0f);
  CHECK(s.step == 1);  // not advanced: the optimizer's bias correction does not count a skipped step
  std::size_t j = 0;
  for (std::size_t i = 0; i < s.params.size(); ++i)
    for (std::size_t dev = 0; dev < m.size(); ++dev, ++j) {
      INFO("parameter " << s.params[i].name << " on device " << dev);
      CHECK(std::vector<float>(s.params[i].value[dev], s.params[i].value[dev] + s.params[i].count[dev]) == before[j]);
      CHECK(std::vector<float>(s.master(i, dev), s.master(i, dev) + s.params[i].count[dev]) == masters_before[j]);
    }
  CHECK(s.optimizer_state(3) == opt_before);  // device 3 never saw the overflow and skipped too
  // Two good steps in a row double the scale.
  r = step_on(s, ds, 2);
  CHECK_FALSE(r.skipped);
  CHECK(s.loss_scale() == 16384.0f);
  CHECK(s.good_steps() == 1);
  r = step_on(s, ds, 3);
  CHECK_FALSE(r.skipped);
  CHECK(r.loss_scale == 16384.0);
  CHECK(s.loss_scale() == 32768.0f);
  CHECK(s.step == 3);
}

TEST_CASE("loss scaling: a scale too large for float16 halves until the gradients fit", "[nn][precision][float16]") {
  const mesh_t m{2, 1};
  const auto ds = synthetic(batch * 4);
  state_t<meshlib::float16> s(m, make_net(m), nn::adam(nn::constant(1e-2f)), {.loss_scale = 1e12f});
  std::size_t skipped = 0;
  for (std::size_t i = 0; s.step == 0 && i < 40; ++i) skipped += step_on(s, ds, 0).skipped ? 1 : 0;
  CHECK(s.step == 1);
  CHECK(skipped >= 10);  // 1e12 / 2^k times gradients of order 1e-2 .. 1 fit in 65504 only after many halvings
  CHECK(s.loss_scale() == 1e12f / static_cast<float>(1ull << skipped));
}
#endif

}  // namespace MESHLIB_TEST_UNIT
