// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// FSDP (fully_shard<"fsdp">): per-step losses equal replicated training on meshes with an fsdp axis
// (with and without a data and a model axis, resharding after forward or not, with accumulation);
// checkpoints cross between FSDP and replicated states both ways; the bytes per device are 1/fsdp
// of the replicated ones plus the largest layer's unsharded parameters and gradients; an fsdp axis
// that does not divide a parameter is refused with the parameter, its shape, the axis and the fix.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh3_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"model">>;
using mesh2_t = meshlib::mesh<meshlib::axis<"fsdp">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
namespace fs = std::filesystem;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32, steps = 5;

const nn::dataset& problem() {
  static const nn::dataset ds = meshlib_test::synthetic_problem(batch * steps, features, classes);
  return ds;
}

template <class Mesh>
auto make_net(const Mesh& m, std::size_t outputs = classes) {
  const nn::rng_key key{5};
  return nn::sequential(nn::column_dense<float, Mesh>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, Mesh>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, Mesh>(m, "fc3", hidden, outputs, key));
}

template <class State>
double step(State& s, std::size_t i) {
  const auto& ds = problem();
  return nn::train_step(s, std::span<const float>(ds.x).subspan(i * batch * features, batch * features),
                        std::span<const std::int32_t>(ds.y).subspan(i * batch, batch), batch, 0, batch)
      .loss;
}

nn::optimizer clipped_adam() {
  return nn::chain(nn::clip_by_global_norm(0.5f), nn::adamw(nn::constant(1e-2f), 1e-2f));  // norm over the shards
}

template <class Mesh, class... Policies>
std::vector<double> run(const Mesh& m, nn::train_options o, nn::optimizer opt = clipped_adam(),
                        const Policies&... policies) {
  nn::train_state state(m, make_net(m), opt, o, nn::rng_key{5}, {}, policies...);
  std::vector<double> losses;
  for (std::size_t i = 0; i < steps; ++i) losses.push_back(step(state, i));
  return losses;
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

fs::path scratch(const std::string& name) {
  auto p = fs::temp_directory_path() / ("meshlib_nn_fsdp_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

}  // namespace

TEST_CASE("FSDP gives the per-step losses of replicated training", "[nn][training][fsdp]") {
  for (const auto& opt : {clipped_adam(), nn::sgd(nn::constant(5e-2f), 0.9f)}) {
    INFO(opt.name());
    const auto ref = run(mesh3_t{1, 1, 1}, {}, opt);
    CHECK(ref.back() < ref.front());  // it learns
    for (const bool reshard : {true, false})
      for (auto [d, f, mo] : {std::array<std::size_t, 3>{1, 2, 1}, {2, 2, 1}, {1, 2, 2}, {1, 4, 1}, {2, 2, 2}}) {
        INFO("mesh (" << d << ", " << f << ", " << mo << "), reshard_after_forward " << reshard);
        require_close(run(mesh3_t{d, f, mo}, {}, opt, nn::fully_shard<"fsdp">{.reshard_after_forward = reshard}), ref, 1e-5);
      }
    // k micro-batches: the shards' gradients accumulate over them.
    require_close(run(mesh3_t{1, 2, 2}, {.accumulation = 2}, opt, nn::fully_shard<"fsdp">{}), ref, 1e-5);
    // A mesh of only ('fsdp', 'model'): the fsdp axis is the data-parallel axis.
    require_close(run(mesh2_t{2, 2}, {}, opt, nn::fully_shard<"fsdp">{}), ref, 1e-5);
    require_close(run(mesh2_t{4, 1}, {}, opt, nn::fully_shard<"fsdp">{.reshard_after_forward = false}), ref, 1e-5);
    // No fully_shard on a mesh with an fsdp axis: plain data parallelism over ('data', 'fsdp').
    require_close(run(mesh3_t{2, 2, 1}, {}, opt, nn::data_parallel<"data", "fsdp">{}), ref, 1e-5);
  }
}

TEST_CASE("FSDP stores parameters and optimizer state as shards of core's blocks", "[nn][training][fsdp]") {
  const mesh3_t m{1, 2, 2};
  nn::train_state state(m, make_net(m), clipped_adam(), nn::fully_shard<"fsdp">{});
  // The train state's parameters are the shards: fc1.w (12 x 16, P(None, 'model')) is stored as
  // 6 x 8 blocks, rows split over 'fsdp', columns over 'model'.
  REQUIRE(state.params.size() == 6);
  const auto& w = state.params[0];
  CHECK(w.name == "fc1.w");
  CHECK(w.sharding == "named_sharding(mesh{'data': 1, 'fsdp': 2, 'model': 2}, P<\"fsdp\", \"model\">)");
  CHECK(state.params[2].sharding ==
        "named_sharding(mesh{'data': 1, 'fsdp': 2, 'model': 2}, P<axes(\"model\", \"fsdp\"), none>)");
  CHECK(state.params[5].sharding == "named_sharding(mesh{'data': 1, 'fsdp': 2, 'model': 2}, P<\"fsdp\">)");
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    const auto c = m.coords(dev);
    CHECK(w.count[dev] == 48);
    CHECK(w.offset[dev][0] == c[1] * 6);
    CHECK(w.offset[dev][1] == c[2] * 8);
    // fc1.w 6x8, fc1.b 4, fc2.w 4x16 (rows split over 'model' then 'fsdp'), fc2.b 8, fc3.w 8x4, fc3.b 2; two slots.
    CHECK(state.optimizer_state_size(dev) == 2 * (48 + 4 + 64 + 8 + 32 + 2));
  }
  // params(state) reads the same global arrays as a replicated state's.
  const mesh3_t one{1, 1, 1};
  nn::train_state replicated(one, make_net(one), clipped_adam(), {});
  const auto a = nn::params(state), b = nn::params(replicated);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(a[i].shape == b[i].shape);
    CHECK(a[i].values == b[i].values);
  }
}

TEST_CASE("FSDP checkpoints restore on a replicated mesh and the reverse", "[nn][training][fsdp][checkpoint]") {
  const auto opt = clipped_adam();
  const auto ref = run(mesh3_t{1, 1, 1}, {}, opt);
  const mesh3_t sharded{1, 2, 2}, replicated{2, 1, 1};
  for (const bool from_fsdp : {true, false}) {
    INFO("saved " << (from_fsdp ? "under FSDP, restored replicated" : "replicated, restored under FSDP"));
    const auto dir = scratch(from_fsdp ? "from" : "to");
    const mesh3_t& a = from_fsdp ? sharded : replicated;
    const mesh3_t& b = from_fsdp ? replicated : sharded;
    // The same state type with and without the policy: fully_shard over the state's own fsdp axis.
    using state_t = decltype(nn::train_state(a, make_net(a), opt));
    const auto make = [&](const mesh3_t& m, bool fsdp) {
      return fsdp ? state_t(m, make_net(m), opt, nn::fully_shard<"fsdp">{}) : state_t(m, make_net(m), opt);
    };
    state_t first = make(a, from_fsdp);
    for (std::size_t i = 0; i < 3; ++i) CHECK(std::abs(step(first, i) - ref[i]) <= 1e-5 * ref[i]);
    nn::save_checkpoint(dir, first);
    state_t second = make(b, !from_fsdp);
    nn::restore_checkpoint(dir, second);
    CHECK(second.step == 3);
    for (std::size_t i = 3; i < steps; ++i) {
      INFO("step " << i);
      CHECK(std::abs(step(second, i) - ref[i]) <= 1e-5 * ref[i]);
    }
    fs::remove_all(dir);
  }
}

TEST_CASE("FSDP holds 1/fsdp of the replicated bytes plus the largest layer", "[nn][training][fsdp][memory]") {
  // Elements of each layer's parameters (W and b), computed here from the widths.
  const std::size_t layers[3] = {features * hidden + hidden, hidden * hidden + hidden, hidden * classes + classes};
  const std::size_t total = layers[0] + layers[1] + layers[2], largest = std::max({layers[0], layers[1], layers[2]});
  for (const std::size_t f : {2u, 4u}) {
    INFO("fsdp " << f);
    const mesh3_t m{1, f, 1};
    nn::train_state replicated(m, make_net(m), nn::adam(nn::constant(1e-3f)), nn::data_parallel<"data", "fsdp">{});
    nn::train_state sharded(m, make_net(m), nn::adam(nn::constant(1e-3f)), nn::fully_shard<"fsdp">{});
    nn::train_state kept(m, make_net(m), nn::adam(nn::constant(1e-3f)), nn::fully_shard<"fsdp">{.reshard_after_forward = false});
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      const nn::training_memory r = replicated.memory(dev), s = sharded.memory(dev), k = kept.memory(dev);
      // Replicated: value, gradient and Adam's two slots of every element.
      CHECK(r.parameters == total * 4);
      CHECK(r.gradients == total * 4);
      CHECK(r.optimizer_state == 2 * total * 4);
      CHECK(r.unsharded == 0);
      CHECK(s.parameters == total / f * 4);
      CHECK(s.gradients == total / f * 4);
      CHECK(s.optimizer_state == 2 * total / f * 4);
      CHECK(s.unsharded == 2 * largest * 4);  // the largest layer's values and gradients, gathered
      CHECK(s.total() <= r.total() / f + 2 * largest * 4);
      CHECK(s.total() < r.total());
      // Kept from forward to backward: every layer's values unsharded, one layer's gradients.
      CHECK(k.unsharded == (total + largest) * 4);
    }
    // Training still works after the storage moved.
    CHECK(std::isfinite(step(sharded, 0)));
  }
}

TEST_CASE("FSDP refuses an fsdp axis that does not divide a parameter", "[nn][training][fsdp][errors]") {
  const mesh3_t m{1, 4, 1};
  const auto msg = meshlib_test::message_of<meshlib::sharding_error>(
      [&] { nn::train_state s(m, make_net(m, 3), nn::adam(nn::constant(1e-3f)), nn::fully_shard<"fsdp">{}); });
  CHECK(msg ==
        "meshlib::nn: train_state: FSDP cannot shard parameter 'fc3.b' (shape 3, " +
            nn::params(nn::train_state(m, make_net(m, 3), nn::adam(nn::constant(1e-3f)), nn::data_parallel<"data", "fsdp">{}))[5].sharding +
            ") over the 4 devices of the fsdp axis 'fsdp': its dimension 0 (3 per device) is not divisible by 4; use "
            "an fsdp axis whose size divides 3, or make that dimension a multiple of 4 (e.g. 4)");
  const mesh3_t two{1, 2, 1};
  CHECK_NOTHROW(nn::train_state(two, make_net(two, 6), nn::adam(nn::constant(1e-3f)), nn::fully_shard<"fsdp">{}));

  // fully_shard over an axis the mesh lacks does not compile (compile_fail/nn/policy_axis_not_in_mesh.cpp).
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(m, make_net(m), nn::adam(nn::constant(1e-3f)), nn::data_parallel<"data">{.zero = 1},
                            nn::fully_shard<"fsdp">{});
        }) == "meshlib::nn: train_state: data_parallel<\"data\">{.zero = 1} and fully_shard<\"fsdp\"> both shard the "
              "optimizer state; fully_shard already shards it (over 'fsdp', the data_parallel<\"data\"> axis holding "
              "replicas of the shards: HSDP): drop .zero");
}

}  // namespace MESHLIB_TEST_UNIT
