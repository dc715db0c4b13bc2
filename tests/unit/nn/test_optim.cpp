// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// optax-style gradient transforms (nn/optim/): each built-in transform against hand-computed
// updates of a few elements, chains and their stages, masks and parameter groups, the named
// optimizers bit for bit as the fused kernels they replaced, a clip in the middle of a chain over
// a sharded mesh and ZeRO-1, and a chain's state through a checkpoint; a user-written transform
// with state slots under ZeRO-1, FSDP and through a checkpoint.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

namespace nn = meshlib::nn;
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;

const std::size_t shape_of_w[2] = {2, 2};

/// One call of `t.update` on host vectors: `u` the updates, `p` the parameter, `state` the slots.
template <class T>
void run_update(const T& t, std::vector<float>& u, const std::vector<float>& p, std::vector<std::vector<float>>& state,
                std::size_t step, double norm = 0, std::string_view name = "fc.w", std::size_t stage = 0) {
  std::vector<float*> slots;
  for (auto& s : state) slots.push_back(s.data());
  t.update(nn::update_run{u.data(), p.data(), std::span<float* const>(slots), u.size(), 0, step, stage, norm,
                          nn::param_info{name, shape_of_w, true}});
}

}  // namespace

TEST_CASE("scale_by_adam: bias-corrected moments, by hand", "[nn][optim]") {
  const nn::scale_by_adam adam{0.9f, 0.999f, 1e-8f};
  REQUIRE(adam.slots() == 2);
  std::vector<std::vector<float>> st(2, std::vector<float>(2, 0.0f));
  std::vector<float> u{0.5f, -2.0f};
  const std::vector<float> p{1.0f, 1.0f};
  run_update(adam, u, p, st, 0);
  // Step 0: m = 0.1 g, v = 0.001 g^2, corrections 10 and 1000: m_hat / sqrt(v_hat) = g / |g|.
  CHECK(st[0][0] == Approx(0.05f));
  CHECK(st[0][1] == Approx(-0.2f));
  // (1 - b2 rounds to 0.00099998713 in float: v is that close.)
  CHECK(st[1][0] == Approx(0.00025f).epsilon(2e-5));
  CHECK(st[1][1] == Approx(0.004f).epsilon(2e-5));
  CHECK(u[0] == Approx(1.0f).epsilon(1e-6));
  CHECK(u[1] == Approx(-1.0f).epsilon(1e-6));
  // Step 1 with g = (1, 1): m = 0.9 * 0.05 + 0.1 = 0.145, v = 0.999 * 0.00025 + 0.001 = 0.00124975,
  // m_hat = 0.145 / 0.19 = 0.763158, v_hat = 0.00124975 / 0.001999 = 0.625188, u = 0.965184.
  u = {1.0f, 1.0f};
  run_update(adam, u, p, st, 1);
  CHECK(st[0][0] == Approx(0.145f));
  CHECK(st[1][0] == Approx(0.00124975f).epsilon(2e-5));
  CHECK(u[0] == Approx(0.965184).epsilon(1e-5));
  // m = 0.9 * -0.2 + 0.1 = -0.08, v = 0.999 * 0.004 + 0.001 = 0.004996: m_hat = -0.421053,
  // v_hat = 2.499250, u = -0.266338.
  CHECK(u[1] == Approx(-0.266338).epsilon(1e-5));
}

TEST_CASE("scale_by_lion: the sign of the interpolated momentum, by hand", "[nn][optim]") {
  const nn::scale_by_lion lion{0.9f, 0.99f};
  REQUIRE(lion.slots() == 1);
  std::vector<std::vector<float>> st(1, std::vector<float>(3, 0.0f));
  std::vector<float> u{0.5f, -2.0f, 0.0f};
  const std::vector<float> p(3, 1.0f);
  run_update(lion, u, p, st, 0);
  CHECK(u == std::vector<float>{1.0f, -1.0f, 0.0f});
  CHECK(st[0][0] == Approx(0.005f));
  CHECK(st[0][1] == Approx(-0.02f));
  CHECK(st[0][2] == 0.0f);
  // 0.9 m + 0.1 g = (-0.0055, -0.118, 0.3); m = 0.99 m + 0.01 g = (0.00395, -0.0298, 0.03).
  u = {-0.1f, -1.0f, 3.0f};
  run_update(lion, u, p, st, 1);
  CHECK(u == std::vector<float>{-1.0f, -1.0f, 1.0f});
  CHECK(st[0][0] == Approx(0.00395f));
  CHECK(st[0][1] == Approx(-0.0298f));
  CHECK(st[0][2] == Approx(0.03f));
}

TEST_CASE("clip_by_global_norm, trace, schedules and weight decay, by hand", "[nn][optim]") {
  std::vector<std::vector<float>> none;
  const std::vector<float> p{2.0f, -4.0f};
  SECTION("clip scales to max_norm only above it") {
    const nn::clip_by_global_norm clip(1.0f);
    CHECK(clip.reads_global_norm(0));
    std::vector<float> u{3.0f, 4.0f};
    run_update(clip, u, p, none, 0, 5.0);
    CHECK(u[0] == Approx(0.6f));
    CHECK(u[1] == Approx(0.8f));
    u = {3.0f, 4.0f};
    run_update(nn::clip_by_global_norm(10.0f), u, p, none, 0, 5.0);
    CHECK(u == std::vector<float>{3.0f, 4.0f});
    CHECK(meshlib_test::message_of<std::invalid_argument>([] { (void)nn::clip_by_global_norm(0.0f); }) ==
          "meshlib::nn: clip_by_global_norm: max_norm is 0; it must be positive (leave the transform out to not clip)");
  }
  SECTION("trace is heavy-ball momentum") {
    std::vector<std::vector<float>> st(1, std::vector<float>(2, 0.0f));
    std::vector<float> u{1.0f, 2.0f};
    run_update(nn::trace{0.5f}, u, p, st, 0);
    CHECK(u == std::vector<float>{1.0f, 2.0f});
    u = {1.0f, 2.0f};
    run_update(nn::trace{0.5f}, u, p, st, 1);  // 0.5 * 1 + 1, 0.5 * 2 + 2
    CHECK(u == std::vector<float>{1.5f, 3.0f});
    CHECK(st[0] == std::vector<float>{1.5f, 3.0f});
  }
  SECTION("any callable schedule; the learning rate descends") {
    const nn::scale_by_schedule sched([](std::size_t step) { return step == 3 ? 2.0f : 0.5f; });
    std::vector<float> u{1.0f, -3.0f};
    run_update(sched, u, p, none, 3);
    CHECK(u == std::vector<float>{2.0f, -6.0f});
    run_update(sched, u, p, none, 0);
    CHECK(u == std::vector<float>{1.0f, -3.0f});
    run_update(nn::scale_by_learning_rate([](std::size_t step) { return 0.25f * static_cast<float>(step); }), u, p,
               none, 2);
    CHECK(u == std::vector<float>{-0.5f, 1.5f});
    u = {1.0f, -3.0f};
    run_update(nn::scale_by_learning_rate(nn::linear_warmup(1.0f, 4)), u, p, none, 1);  // rate 2/4
    CHECK(u == std::vector<float>{-0.5f, 1.5f});
  }
  SECTION("add_decayed_weights on the parameters of its mask") {
    const nn::add_decayed_weights decay(0.5f, [](std::string_view name) { return name.ends_with(".w"); });
    std::vector<float> u{1.0f, 1.0f};
    run_update(decay, u, p, none, 0, 0, "fc.w");
    CHECK(u == std::vector<float>{2.0f, -1.0f});
    run_update(decay, u, p, none, 0, 0, "fc.b");
    CHECK(u == std::vector<float>{2.0f, -1.0f});
  }
}

TEST_CASE("masked and multi_transform: per-parameter groups by name", "[nn][optim]") {
  std::vector<std::vector<float>> st(2, std::vector<float>(2, 0.0f));
  const std::vector<float> p{1.0f, 1.0f};
  const auto tx = nn::masked(nn::scale(3.0f), [](std::string_view name) { return name.starts_with("embed"); });
  std::vector<float> u{1.0f, 2.0f};
  run_update(tx, u, p, st, 0, 0, "embed.w");
  CHECK(u == std::vector<float>{3.0f, 6.0f});
  run_update(tx, u, p, st, 0, 0, "fc.w");
  CHECK(u == std::vector<float>{3.0f, 6.0f});
  CHECK(meshlib_test::message_of<std::invalid_argument>([] {
          (void)nn::masked(nn::clip_by_global_norm(1.0f), nn::param_mask());
        }).starts_with("meshlib::nn: masked: clip_by_global_norm(1) reads the global norm"));

  const auto groups =
      nn::multi_transform({{"embed", nn::sgd(0.5f, 0.0f)}, {"rest", nn::adam(0.1f)}},
                          [](std::string_view name) { return name.starts_with("embed") ? "embed" : "rest"; });
  CHECK(groups.slots() == 2);
  CHECK(groups.kind() == "multi_transform(embed:sgd,rest:adam)");
  CHECK(meshlib_test::message_of<std::invalid_argument>([] {
          (void)nn::multi_transform({{"a", nn::chain(nn::clip_by_global_norm(1.0f), nn::adam(0.1f))}},
                                    [](std::string_view) { return "a"; });
        }) ==
        "meshlib::nn: multi_transform: the transform of group 'a' (chain(clip_by_global_norm(1), adam)) reads "
        "the global norm of every parameter's updates, which a group cannot restrict; clip in a chain around "
        "multi_transform");
  u = {1.0f, -2.0f};
  run_update(groups, u, p, st, 0, 0, "embed.w");  // sgd: -0.5 g, its momentum in slot 0
  CHECK(u == std::vector<float>{-0.5f, 1.0f});
  u = {1.0f, -2.0f};
  st.assign(2, std::vector<float>(2, 0.0f));   // another parameter's state
  run_update(groups, u, p, st, 0, 0, "fc.w");  // adam's first step: -0.1 sign(g)
  CHECK(u[0] == Approx(-0.1f).epsilon(1e-6));
  CHECK(u[1] == Approx(0.1f).epsilon(1e-6));
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          run_update(nn::multi_transform({{"rest", nn::adam(0.1f)}}, [](std::string_view) { return "other"; }), u, p,
                     st, 0, 0, "fc.w");
        }) ==
        "meshlib::nn: multi_transform: parameter 'fc.w' has the label 'other', which names no group (the groups are "
        "'rest'); give it a group or change the label function");
}

TEST_CASE("chain: state side by side, a new stage at each transform that reads the global norm", "[nn][optim]") {
  const auto head = nn::chain(nn::clip_by_global_norm(1.0f), nn::scale_by_adam(), nn::add_decayed_weights(1e-4f),
                              nn::scale_by_learning_rate(1e-3f));
  CHECK(head.slots() == 2);
  CHECK(head.stages() == 1);
  CHECK(head.reads_global_norm(0));
  CHECK(head.kind() == "chain(clip_by_global_norm,scale_by_adam,add_decayed_weights,scale_by_learning_rate)");
  const auto mid = nn::chain(nn::trace{0.9f}, nn::scale_by_adam(), nn::clip_by_global_norm(1.0f), nn::scale(2.0f));
  CHECK(mid.slots() == 3);
  CHECK(mid.stages() == 2);
  CHECK(!mid.reads_global_norm(0));
  CHECK(mid.reads_global_norm(1));
  // Stage 1 is the clip and the scale only, with the state of neither.
  std::vector<std::vector<float>> st(3, std::vector<float>(2, 0.0f));
  std::vector<float> u{3.0f, 4.0f};
  run_update(mid, u, {0.0f, 0.0f}, st, 0, 10.0, "fc.w", 1);
  CHECK(u[0] == Approx(0.6f));
  CHECK(u[1] == Approx(0.8f));
  CHECK(st == std::vector<std::vector<float>>(3, std::vector<float>(2, 0.0f)));
  const nn::optimizer nested = nn::chain(nn::clip_by_global_norm(0.5f), nn::adamw(1e-2f, 1e-2f));
  CHECK(nested.name() == "chain(clip_by_global_norm(0.5), adamw(weight decay 0.01))");
  CHECK(nested.kind() == "chain(clip_by_global_norm,adamw)");
  CHECK(nested.slots() == 2);
  CHECK(nested.stages() == 1);
  CHECK(nn::adamw(1e-3f, 1e-4f).name() == "adamw(weight decay 1e-4)");
  CHECK(nn::sgd(0.1f).name() == "sgd(momentum 0.9)");
}

TEST_CASE("adam, adamw and sgd give the fused kernels' numbers bit for bit", "[nn][optim]") {
  // The update rules as they were written before transforms composed (one expression per element).
  const std::size_t n = 37, steps = 5;
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 1e-2f, rate = 3e-2f, clip = 0.7f;
  std::vector<float> p0(n);
  for (std::size_t i = 0; i < n; ++i) p0[i] = std::sin(0.3f * static_cast<float>(i)) + 0.1f;
  const auto grad = [](std::size_t s, std::size_t i) {
    return std::cos(0.7f * static_cast<float>(i * (s + 1))) * 0.4f;
  };
  const std::size_t shape[1] = {n};
  for (const char* which : {"adam", "adamw", "sgd", "clipped adamw", "chain"}) {
    INFO(which);
    const std::string w = which;
    const nn::optimizer opt =
        w == "adam"    ? nn::adam(rate, b1, b2, eps)
        : w == "sgd"   ? nn::sgd(rate, 0.9f)
        : w == "chain" ? nn::optimizer(nn::chain(nn::scale_by_adam{b1, b2, eps}, nn::add_decayed_weights(wd),
                                                 nn::scale_by_learning_rate(rate)))
        : w == "adamw" ? nn::adamw(rate, wd, b1, b2, eps)
                       : nn::optimizer(nn::chain(nn::clip_by_global_norm(clip), nn::adamw(rate, wd, b1, b2, eps)));
    // p: update then apply_updates; q: update_and_apply (one kernel for a chain of built-ins).
    std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f), q = p0, qm(n, 0.0f), qv(n, 0.0f), ref = p0, rm(n, 0.0f),
                       rv(n, 0.0f);
    for (std::size_t s = 0; s < steps; ++s) {
      std::vector<float> g(n);
      double sq = 0;
      for (std::size_t i = 0; i < n; ++i) {
        g[i] = grad(s, i);
        sq += static_cast<double>(g[i]) * g[i];
      }
      const double norm = std::sqrt(sq);
      // The old rule.
      const float scale = w == "clipped adamw" && norm > clip ? static_cast<float>(clip / norm) : 1.0f;
      const double t = static_cast<double>(s + 1);
      const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), t)));
      const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
      const float wdk = w == "adam" ? 0.0f : wd;
      for (std::size_t i = 0; i < n; ++i) {
        if (w == "sgd") {
          rm[i] = 0.9f * rm[i] + g[i] * scale;
          ref[i] = ref[i] - rate * rm[i];
          continue;
        }
        const float gi = g[i] * scale;
        rm[i] = b1 * rm[i] + (1.0f - b1) * gi;
        rv[i] = b2 * rv[i] + (1.0f - b2) * gi * gi;
        ref[i] = ref[i] - rate * ((rm[i] * c1) / (std::sqrt(rv[i] * c2) + eps) + wdk * ref[i]);
      }
      // The chain, in two passes and in one.
      std::vector<float> h = g;
      float* slots[2] = {m.data(), v.data()};
      opt.update(nn::update_run{g.data(), p.data(), std::span<float* const>(slots, opt.slots()), n, 0, s, 0, norm,
                                nn::param_info{"w", shape, true}});
      nn::detail::apply_updates(p.data(), g.data(), n);
      float* qslots[2] = {qm.data(), qv.data()};
      opt.update_and_apply(nn::update_run{h.data(), q.data(), std::span<float* const>(qslots, opt.slots()), n, 0, s, 0,
                                          norm, nn::param_info{"w", shape, true}},
                           q.data());
      REQUIRE(std::memcmp(p.data(), ref.data(), n * sizeof(float)) == 0);
      REQUIRE(std::memcmp(m.data(), rm.data(), n * sizeof(float)) == 0);
      REQUIRE(std::memcmp(q.data(), ref.data(), n * sizeof(float)) == 0);
      REQUIRE(std::memcmp(qm.data(), rm.data(), n * sizeof(float)) == 0);
    }
  }
}

namespace {

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32;

auto make_net(const mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key));
}

template <class State>
std::vector<double> train(State& state, std::size_t first, std::size_t steps) {
  const auto ds = meshlib_test::synthetic_problem(batch * (first + steps), features, classes);
  std::vector<double> losses;
  for (std::size_t s = first; s < first + steps; ++s)
    losses.push_back(nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                                    std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch)
                         .loss);
  return losses;
}

template <class... Policies>
std::vector<double> run(const mesh_t& m, const nn::optimizer& opt, nn::train_options o, std::size_t steps = 6,
                        const Policies&... policies) {
  nn::train_state state(m, make_net(m), opt, o, nn::rng_key{11}, {}, policies...);
  return train(state, 0, steps);
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

}  // namespace

TEST_CASE("a chain trains alike on every mesh and with ZeRO-1, its clip's norm over every shard", "[nn][optim][zero]") {
  // A clip after Adam reads the norm of Adam's updates: a stage of its own, its norm summed over
  // the mesh (each element once) whatever the sharding.
  const nn::optimizer mid = nn::chain(nn::scale_by_adam(), nn::clip_by_global_norm(2.0f),
                                      nn::add_decayed_weights(1e-2f, [](std::string_view n) { return n != "fc3.w"; }),
                                      nn::scale_by_learning_rate([](std::size_t s) { return 1e-2f / (1.0f + s); }));
  for (const nn::optimizer& opt :
       {mid, nn::lion(3e-3f), nn::optimizer(nn::chain(nn::clip_by_global_norm(0.5f), nn::sgd(5e-2f)))}) {
    INFO(opt.name());
    const auto ref = run(mesh_t{1, 1}, opt, {});
    CHECK(ref.back() < ref.front());  // it learns
    require_close(run(mesh_t{4, 2}, opt, {}), ref, 1e-5);
    require_close(run(mesh_t{2, 4}, opt, {}), ref, 1e-5);
    require_close(run(mesh_t{4, 2}, opt, {}, 6, nn::data_parallel<"data">{.zero = 1}), ref, 1e-5);
    require_close(run(mesh_t{2, 1}, opt, {}, 6, nn::data_parallel<"data">{.zero = 1}), ref, 1e-5);
  }
  // The clip binds: without it the run differs.
  const nn::optimizer unclipped =
      nn::chain(nn::scale_by_adam(), nn::add_decayed_weights(1e-2f, [](std::string_view n) { return n != "fc3.w"; }),
                nn::scale_by_learning_rate([](std::size_t s) { return 1e-2f / (1.0f + s); }));
  CHECK(run(mesh_t{1, 1}, unclipped, {}) != run(mesh_t{1, 1}, mid, {}));
}

TEST_CASE("every transform on FSDP shards: the losses of one device", "[nn][optim][fsdp]") {
  using fsdp_mesh_t = meshlib::mesh<meshlib::axis<"fsdp">, meshlib::axis<"model">>;
  const auto fsdp_run = [](const fsdp_mesh_t& m, const nn::optimizer& opt) {
    const nn::rng_key key{11};
    nn::train_state state(m,
                          nn::sequential(nn::column_dense<float, fsdp_mesh_t>(m, "fc1", features, hidden, key),
                                         nn::relu<float>(m),
                                         nn::row_dense<float, fsdp_mesh_t>(m, "fc2", hidden, hidden, key),
                                         nn::gelu<float>(m),
                                         nn::dense<float, fsdp_mesh_t>(m, "fc3", hidden, classes, key)),
                          opt, {}, nn::rng_key{11}, {}, nn::fully_shard<"fsdp">{});
    return train(state, 0, 6);
  };
  const nn::optimizer mid = nn::chain(nn::trace{0.5f}, nn::clip_by_global_norm(0.05f), nn::scale_by_adam(),
                                      nn::scale_by_learning_rate(1e-2f));
  const nn::optimizer groups = nn::chain(
      nn::clip_by_global_norm(0.5f),
      nn::multi_transform({{"out", nn::lion(1e-3f)}, {"rest", nn::adamw(1e-2f, 1e-2f)}},
                          [](std::string_view name) { return name.starts_with("fc3") ? "out" : "rest"; }));
  for (const nn::optimizer& opt : {mid, nn::lion(3e-3f), groups}) {
    INFO(opt.name());
    const auto ref = run(mesh_t{1, 1}, opt, {});
    require_close(fsdp_run(fsdp_mesh_t{4, 1}, opt), ref, 1e-5);
    require_close(fsdp_run(fsdp_mesh_t{2, 2}, opt), ref, 1e-5);
  }
}

TEST_CASE("a chain built by hand is nn::adamw in a train state, bit for bit", "[nn][optim]") {
  const auto hand = nn::chain(nn::scale_by_adam{0.9f, 0.999f, 1e-8f}, nn::add_decayed_weights(1e-2f),
                              nn::scale_by_learning_rate(nn::warmup_cosine(1e-2f, 2, 6)));
  for (const bool zero : {false, true}) {
    INFO("zero " << zero);
    const mesh_t m{4, 2};
    nn::train_state a(m, make_net(m), nn::adamw(nn::warmup_cosine(1e-2f, 2, 6), 1e-2f),
                      nn::data_parallel<"data">{.zero = zero ? 1 : 0});
    nn::train_state b(m, make_net(m), hand, nn::data_parallel<"data">{.zero = zero ? 1 : 0});
    CHECK(train(a, 0, 5) == train(b, 0, 5));
    for (std::size_t i = 0; i < a.params.size(); ++i)
      for (std::size_t dev = 0; dev < m.size(); ++dev)
        REQUIRE(std::memcmp(a.params[i].value[dev], b.params[i].value[dev], a.params[i].count[dev] * sizeof(float)) ==
                0);
  }
}

TEST_CASE("checkpoints hold a chain's state, restored on another mesh with ZeRO-1", "[nn][optim][checkpoint]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_optim_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto make = [] {
    return nn::optimizer(nn::chain(nn::clip_by_global_norm(1.0f), nn::trace{0.5f}, nn::scale_by_adam(),
                                   nn::scale_by_learning_rate(1e-2f)));
  };
  const mesh_t m1{2, 2}, m2{4, 1};
  nn::train_state a(m1, make_net(m1), make(), {});
  (void)train(a, 0, 3);
  nn::save_checkpoint(dir, a);
  nn::train_state b(m2, make_net(m2), make(), nn::data_parallel<"data">{.zero = 1});
  nn::restore_checkpoint(dir, b);
  CHECK(b.step == 3);
  // Every slot of every element came back: three slots, the trace's and Adam's two.
  nn::train_state c(m1, make_net(m1), make(), {});
  nn::restore_checkpoint(dir, c);
  for (std::size_t dev = 0; dev < m1.size(); ++dev) CHECK(c.optimizer_state(dev) == a.optimizer_state(dev));
  require_close(train(b, 3, 3), train(a, 3, 3), 1e-5);
  // Another chain is refused, naming both.
  nn::train_state d(m1, make_net(m1), nn::adam(1e-2f), {});
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, d); }) ==
        "meshlib::nn: restore_checkpoint: '" + (dir / "index").string() +
            "': saved with optimizer chain(clip_by_global_norm,trace,scale_by_adam,scale_by_learning_rate) (3 state "
            "slots), but the train state's optimizer is adam: restore into a train state made with the optimizer it "
            "was saved with");
  fs::remove_all(dir);
}

namespace {

/// A gradient transform written as a user writes one (nn::gradient_transform, docs/optimizers.md),
/// with state: slot 0 the running sum of the updates it has been given, slot 1 their momentum; the
/// update is the momentum plus a pull towards the running mean. Its kernel runs through the public
/// meshlib::launch, on whatever block of state the layout hands it (whole blocks, a ZeRO-1 slice,
/// an FSDP shard).
struct running_sum_momentum {
  float decay = 0.5f;
  float pull = 0.25f;
  struct kernel {
    float* u;
    float* sum;
    float* momentum;
    float decay, pull_per_step;
    KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
      const float g = u[i];
      sum[i] += g;
      momentum[i] = decay * momentum[i] + g;
      u[i] = momentum[i] + pull_per_step * sum[i];
    }
  };
  [[nodiscard]] std::size_t slots() const { return 2; }
  [[nodiscard]] std::string name() const { return "running_sum_momentum"; }
  [[nodiscard]] std::string kind() const { return "running_sum_momentum"; }
  void update(const nn::update_run& r) const {
    meshlib::launch<meshlib::default_memory_space>(
        r.size, kernel{r.updates, r.state[0], r.state[1], decay, pull / static_cast<float>(r.step + 1)});
  }
};

using shard_mesh_t = meshlib::mesh<meshlib::axis<"fsdp">, meshlib::axis<"model">>;

auto make_shard_net(const shard_mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, shard_mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, shard_mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, shard_mesh_t>(m, "fc3", hidden, classes, key));
}

/// The sum of squares of optimizer state slot `s` over every device of `state`, each run where the
/// layout puts it (`for_each_state_run`): each element once on one device, in ZeRO-1's slices or in
/// FSDP's shards (over a model axis of one device).
template <class State>
double slot_sum_of_squares(State& state, std::size_t s) {
  double sq = 0;
  std::vector<float> h;
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t, std::size_t, std::size_t len, std::span<float* const> slot) {
      h.resize(len);
      meshlib::copy_to_host<meshlib::default_memory_space>(h.data(), slot[s], len);
      for (const float v : h) sq += static_cast<double>(v) * static_cast<double>(v);
    });
  return sq;
}

}  // namespace

TEST_CASE("a user's transform with state trains alike replicated, with ZeRO-1 and on FSDP shards, and through a "
          "checkpoint", "[nn][optim][zero][fsdp][checkpoint]") {
  namespace fs = std::filesystem;
  const nn::optimizer opt =
      nn::chain(nn::clip_by_global_norm(1.0f), running_sum_momentum{}, nn::scale_by_learning_rate(2e-2f));
  REQUIRE(opt.slots() == 2);
  const nn::rng_key key{11};
  // One device, replicated: the reference. Two devices: replicated, ZeRO-1 (the slots sliced over
  // "data") and FSDP (the slots sharded with the parameters over "fsdp").
  const mesh_t one{1, 1}, two{2, 1};
  nn::train_state ref(one, make_net(one), opt, {}, key, {}, nn::data_parallel<"data">{});
  nn::train_state replicated(two, make_net(two), opt, {}, key, {}, nn::data_parallel<"data">{});
  nn::train_state zero(two, make_net(two), opt, {}, key, {}, nn::data_parallel<"data">{.zero = 1});
  const shard_mesh_t shards{2, 1};
  nn::train_state fsdp(shards, make_shard_net(shards), opt, {}, key, {}, nn::fully_shard<"fsdp">{});
  const auto losses = train(ref, 0, 6);
  CHECK(losses.back() < losses.front());  // it learns
  require_close(train(replicated, 0, 6), losses, 1e-5);
  require_close(train(zero, 0, 6), losses, 1e-5);
  require_close(train(fsdp, 0, 6), losses, 1e-5);
  // ZeRO-1 and FSDP hold half the state per device, and the same numbers as one device in all.
  CHECK(zero.optimizer_state_size(0) < replicated.optimizer_state_size(0));
  CHECK(fsdp.optimizer_state_size(0) < replicated.optimizer_state_size(0));
  for (std::size_t s = 0; s < 2; ++s) {
    INFO("slot " << s);
    const double want = slot_sum_of_squares(ref, s);
    CHECK(want > 0);
    CHECK(std::abs(slot_sum_of_squares(zero, s) - want) <= 1e-4 * want);
    CHECK(std::abs(slot_sum_of_squares(fsdp, s) - want) <= 1e-4 * want);
  }

  // Through a checkpoint: saved from ZeRO-1's slices after 3 steps, restored into the same layout
  // (every slot of every element back, bit for bit), into one device and into FSDP's shards; each
  // continues as the run that was not interrupted.
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_optim_user_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  nn::train_state a(two, make_net(two), opt, {}, key, {}, nn::data_parallel<"data">{.zero = 1});
  (void)train(a, 0, 3);
  nn::save_checkpoint(dir, a);
  nn::train_state same(two, make_net(two), opt, {}, key, {}, nn::data_parallel<"data">{.zero = 1});
  nn::train_state single(one, make_net(one), opt, {}, key, {}, nn::data_parallel<"data">{});
  nn::train_state sharded(shards, make_shard_net(shards), opt, {}, key, {}, nn::fully_shard<"fsdp">{});
  nn::restore_checkpoint(dir, same);
  nn::restore_checkpoint(dir, single);
  nn::restore_checkpoint(dir, sharded);
  CHECK(same.step == 3);
  CHECK(single.step == 3);
  CHECK(sharded.step == 3);
  for (std::size_t dev = 0; dev < two.size(); ++dev) CHECK(same.optimizer_state(dev) == a.optimizer_state(dev));
  for (std::size_t s = 0; s < 2; ++s) {
    INFO("slot " << s);
    const double want = slot_sum_of_squares(a, s);
    CHECK(want > 0);
    CHECK(std::abs(slot_sum_of_squares(single, s) - want) <= 1e-6 * want);
    CHECK(std::abs(slot_sum_of_squares(sharded, s) - want) <= 1e-6 * want);
  }
  const auto rest = train(a, 3, 3);
  CHECK(train(same, 3, 3) == rest);
  require_close(train(single, 3, 3), rest, 1e-5);
  require_close(train(sharded, 3, 3), rest, 1e-5);
  // Without the restored slots the continuation differs: the state is what the test restores.
  nn::train_state zeroed(two, make_net(two), opt, {}, key, {}, nn::data_parallel<"data">{.zero = 1});
  nn::restore_checkpoint(dir, zeroed);
  for (std::size_t dev = 0; dev < two.size(); ++dev)
    zeroed.for_each_state_run(dev, [&](std::size_t, std::size_t, std::size_t len, std::span<float* const> slot) {
      const std::vector<float> zeros(len, 0.0f);
      for (float* p : slot) meshlib::copy_from_host<meshlib::default_memory_space>(p, zeros.data(), len);
    });
  CHECK(train(zeroed, 3, 3) != rest);
  // The index names the user's transform by its kind(): a state made with another chain is refused.
  nn::train_state other(two, make_net(two), nn::adam(1e-2f), {});
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
        "meshlib::nn: restore_checkpoint: '" + (dir / "index").string() +
            "': saved with optimizer chain(clip_by_global_norm,running_sum_momentum,scale_by_learning_rate) (2 state "
            "slots), but the train state's optimizer is adam: restore into a train state made with the optimizer it "
            "was saved with");
  fs::remove_all(dir);
}

namespace {

/// optax's Adafactor written out with plain loops in double, over any shape: the statistics kept
/// by their coordinates (a map), independent of the library's layout.
struct adafactor_reference {
  std::vector<std::size_t> shape;
  std::size_t min_dim;
  bool factored;
  float decay_rate = 0.8f;
  double eps = 1e-30;
  std::map<std::vector<std::size_t>, double> v_row, v_col;
  std::vector<double> v;

  adafactor_reference(std::vector<std::size_t> s, std::size_t min, bool f)
      : shape(std::move(s)), min_dim(min), factored(f) {}

  [[nodiscard]] std::vector<std::size_t> coords(std::size_t i) const {
    std::vector<std::size_t> c(shape.size());
    for (std::size_t k = shape.size(); k-- > 0;) {
      c[k] = i % shape[k];
      i /= shape[k];
    }
    return c;
  }
  static std::vector<std::size_t> without(std::vector<std::size_t> c, std::size_t d) {
    c.erase(c.begin() + static_cast<std::ptrdiff_t>(d));
    return c;
  }
  /// scale_by_factored_rms at `step` of gradient `g`.
  std::vector<double> scale(const std::vector<double>& g, std::size_t step) {
    const double beta = 1.0 - std::pow(static_cast<double>(step + 1), -static_cast<double>(decay_rate));
    const std::size_t n = g.size();
    std::vector<double> u(n);
    // The two largest dimensions, ties to the later one (numpy's stable argsort).
    std::size_t d0 = 0, d1 = 0;
    bool fact = factored && shape.size() >= 2;
    if (fact) {
      d0 = shape.size() - 1;
      for (std::size_t k = shape.size(); k-- > 0;)
        if (shape[k] > shape[d0]) d0 = k;
      d1 = d0 == 0 ? 1 : 0;
      for (std::size_t k = 0; k < shape.size(); ++k)
        if (k != d0 && shape[k] >= shape[d1]) d1 = k;
      fact = shape[d1] >= min_dim;
    }
    if (!fact) {
      v.resize(n, 0.0);
      for (std::size_t i = 0; i < n; ++i) {
        v[i] = beta * v[i] + (1 - beta) * (g[i] * g[i] + eps);
        u[i] = g[i] / std::sqrt(v[i]);
      }
      return u;
    }
    std::map<std::vector<std::size_t>, double> row_sum, col_sum, row_mean;
    for (std::size_t i = 0; i < n; ++i) {
      const auto c = coords(i);
      row_sum[without(c, d0)] += g[i] * g[i] + eps;
      col_sum[without(c, d1)] += g[i] * g[i] + eps;
    }
    for (auto& [k, s] : row_sum) v_row[k] = beta * v_row[k] + (1 - beta) * s / static_cast<double>(shape[d0]);
    for (auto& [k, s] : col_sum) v_col[k] = beta * v_col[k] + (1 - beta) * s / static_cast<double>(shape[d1]);
    for (const auto& [k, x] : v_row) row_mean[without(k, d1 > d0 ? d1 - 1 : d1)] += x / static_cast<double>(shape[d1]);
    for (std::size_t i = 0; i < n; ++i) {
      const auto c = coords(i);
      const auto r = without(c, d0);
      u[i] = g[i] / std::sqrt(v_row[r] / row_mean[without(r, d1 > d0 ? d1 - 1 : d1)]) / std::sqrt(v_col[without(c, d1)]);
    }
    return u;
  }
};

double rms_of(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s / static_cast<double>(x.size()));
}

/// A deterministic gradient for element `i` at step `s`, of mixed signs and sizes.
float gradient_at(std::size_t i, std::size_t s) {
  return static_cast<float>(std::sin(0.7 * static_cast<double>(i) + 1.3 * static_cast<double>(s)) *
                            (1.0 + static_cast<double>(i % 5)));
}

void require_near(const std::vector<float>& got, const std::vector<double>& want, double rel, double abs = 1e-12) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": " << got[i] << " vs " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]) + abs);
  }
}

}  // namespace

TEST_CASE("scale_by_factored_rms: factored and unfactored, against plain loops", "[nn][optim][adafactor]") {
  struct param_case {
    std::vector<std::size_t> shape;
    bool factored;  // whether the reference factors it (checked against factored_dims)
  };
  const nn::scale_by_factored_rms tx(true, 0.8f, 0, 4);
  CHECK(tx.slots() == 0);  // no state per element: it is per parameter
  for (const param_case& pc : {param_case{{4, 6}, true}, param_case{{6, 4}, true}, param_case{{6, 2, 4}, true},
                               param_case{{3, 5, 4}, true}, param_case{{3, 8}, false}, param_case{{7}, false}}) {
    INFO("shape " << pc.shape.size() << "d, first " << pc.shape[0]);
    CHECK(tx.factored_dims(pc.shape).has_value() == pc.factored);
    adafactor_reference ref{pc.shape, 4, true};
    const std::size_t n = nn::detail::element_count(pc.shape);
    // The state's size: v_row (the shape without the largest dimension) and v_col (without the
    // second largest), or v (every element), as the reference keeps them.
    const std::vector<double> g0(n, 1.0);
    const nn::param_info info{"w", pc.shape, true};
    {
      adafactor_reference sized{pc.shape, 4, true};
      (void)sized.scale(g0, 0);
      CHECK(tx.param_state_size(info) == (pc.factored ? sized.v_row.size() + sized.v_col.size() : n));
    }
    std::vector<float> state(tx.param_state_size(info), 0.0f);
    for (std::size_t step = 0; step < 4; ++step) {
      std::vector<float> u(n);
      std::vector<double> g(n);
      for (std::size_t i = 0; i < n; ++i) g[i] = u[i] = gradient_at(i, step);
      const std::vector<float> p(n, 1.0f);
      tx.update(nn::update_run{u.data(), p.data(), {}, n, 0, step, 0, 0, info, state.data()});
      require_near(u, ref.scale(g, step), 2e-5);
    }
  }
  // The statistics' layout: a [4, 6] matrix keeps v_row (4, over its columns) then v_col (6).
  const std::size_t shape[2] = {4, 6};
  REQUIRE(tx.param_state_size(nn::param_info{"w", shape, true}) == 10);
  std::vector<float> slot(10, 0.0f), u(24);
  for (std::size_t i = 0; i < 24; ++i) u[i] = static_cast<float>(i);
  const std::vector<float> p(24, 1.0f);
  tx.update(nn::update_run{u.data(), p.data(), {}, 24, 0, 0, 0, 0, nn::param_info{"w", shape, true}, slot.data()});
  // Step 0: beta 0, so v_row[r] = mean over c of (6r + c)^2, v_col[c] = mean over r.
  for (std::size_t r = 0; r < 4; ++r) {
    double s = 0;
    for (std::size_t c = 0; c < 6; ++c) s += double(6 * r + c) * double(6 * r + c);
    CHECK(slot[r] == Approx(s / 6).epsilon(1e-6));
  }
  for (std::size_t c = 0; c < 6; ++c) {
    double s = 0;
    for (std::size_t r = 0; r < 4; ++r) s += double(6 * r + c) * double(6 * r + c);
    CHECK(slot[4 + c] == Approx(s / 4).epsilon(1e-6));
  }
  // The decay: beta_t = 1 - (t + 1)^-0.8, and decay_offset shifts t.
  CHECK(tx.decay(0) == 0.0f);
  CHECK(tx.decay(3) == Approx(1.0 - std::pow(4.0, -0.8)));
  CHECK(nn::scale_by_factored_rms(true, 0.5f, 2).decay(5) == Approx(1.0 - std::pow(4.0, -0.5)));
  CHECK(meshlib_test::message_of<std::invalid_argument>([] { (void)nn::scale_by_factored_rms(true, 0.8f, 0, 1); }) ==
        "meshlib::nn: scale_by_factored_rms: min_dim_size_to_factor is 1; it must be at least 2 (pass factored = "
        "false to factor nothing)");
  // A piece of a parameter without update_run::blocks to sum over the other pieces is refused
  // (the train state passes them: see the ZeRO-1 and FSDP tests below).
  std::vector<float> half(12, 1.0f);
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          tx.update(nn::update_run{half.data(), p.data(), {}, 12, 12, 0, 0, 0, nn::param_info{"fc.w", shape, true},
                                   slot.data()});
        }) == "meshlib::nn: scale_by_factored_rms (adafactor): parameter 'fc.w' (24 elements) reached the optimizer "
              "as elements [12, 24) only, with no update_run::blocks to sum its statistics over the devices holding "
              "the rest: pass the whole parameter in one run, or set update_run::blocks (the train state does, under "
              "ZeRO-1, fully_shard and tensor parallelism)");
  // A run without its per-parameter state is refused.
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] {
          tx.update(nn::update_run{u.data(), p.data(), {}, 24, 0, 0, 0, 0, nn::param_info{"fc.w", shape, true}});
        }) == "meshlib::nn: scale_by_factored_rms (adafactor): the run of parameter 'fc.w' has no per-parameter state "
              "(update_run::param_state is null); pass param_state_size(param) floats, zero at the start, as the "
              "train state does");
}

TEST_CASE("adafactor: optax's chain, a few steps against plain loops", "[nn][optim][adafactor]") {
  struct variant {
    nn::adafactor_options o;
    std::string name;
  };
  const auto all = [](const nn::param_info&) { return true; };
  const std::vector<variant> variants{
      {{.min_dim_size_to_factor = 4}, "adafactor"},
      {{.min_dim_size_to_factor = 4, .clipping_threshold = 0.05f, .momentum = 0.9f, .weight_decay_rate = 1e-2f,
        .weight_decay_mask = all},
       "adafactor(momentum 0.9, weight decay 0.01)"},
      {{.min_dim_size_to_factor = 4, .multiply_by_parameter_scale = false, .clipping_threshold = std::nullopt,
        .factored = false},
       "adafactor(unfactored)"},
  };
  const float lr = 0.05f;
  for (const auto& var : variants) {
    const nn::optimizer opt = nn::adafactor(lr, var.o);
    INFO(opt.name());
    CHECK(opt.name() == var.name);
    CHECK(opt.kind() == "adafactor");
    CHECK(opt.slots() == (var.o.momentum ? 1u : 0u));  // momentum's; the second moment is per parameter
    CHECK(opt.whole_parameters());
    for (const std::vector<std::size_t>& shape : {std::vector<std::size_t>{5, 6}, std::vector<std::size_t>{7}}) {
      const std::size_t n = nn::detail::element_count(shape);
      adafactor_reference ref{shape, 4, var.o.factored};
      std::vector<double> want(n), m(n, 0.0);
      std::vector<float> p(n);
      for (std::size_t i = 0; i < n; ++i) want[i] = p[i] = 0.5f - 0.1f * static_cast<float>(i % 7);
      std::vector<std::vector<float>> state(opt.slots(), std::vector<float>(n, 0.0f));
      const nn::param_info info{"w", shape, true};
      // [5, 6] factored: 5 + 6 floats; [7] (and unfactored): one per element.
      CHECK(opt.param_state_size(info) == (var.o.factored && shape.size() == 2 ? 11u : n));
      std::vector<float> per_param(opt.param_state_size(info), 0.0f);
      for (std::size_t step = 0; step < 4; ++step) {
        std::vector<float> u(n);
        std::vector<double> g(n);
        for (std::size_t i = 0; i < n; ++i) g[i] = u[i] = gradient_at(i, step);
        std::vector<double> x = ref.scale(g, step);
        if (var.o.clipping_threshold) {
          const double denom = std::max(1.0, rms_of(x) / *var.o.clipping_threshold);
          for (double& e : x) e /= denom;
        }
        for (double& e : x) e *= lr;
        if (var.o.multiply_by_parameter_scale) {
          const double s = std::max(rms_of(want), 1e-3);
          for (double& e : x) e *= s;
        }
        if (var.o.momentum)
          for (std::size_t i = 0; i < n; ++i) x[i] = m[i] = *var.o.momentum * m[i] + (1 - *var.o.momentum) * x[i];
        if (var.o.weight_decay_rate)
          for (std::size_t i = 0; i < n; ++i) x[i] += *var.o.weight_decay_rate * want[i];
        for (std::size_t i = 0; i < n; ++i) want[i] -= x[i];
        std::vector<float*> slots;
        for (auto& s : state) slots.push_back(s.data());
        opt.update_and_apply(nn::update_run{u.data(), p.data(), std::span<float* const>(slots), n, 0, step, 0, 0, info,
                                            per_param.data()},
                             p.data());
        // (Absolute too: a parameter may pass near 0, where float's rounding of p - x is not
        // relatively small; the updates themselves are ~1e-2, 1e5 times the tolerance.)
        require_near(p, want, 2e-5, 1e-7);
      }
    }
  }
}

TEST_CASE("adafactor trains alike data- and tensor-parallel", "[nn][optim][adafactor]") {
  const nn::optimizer opt = nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f});
  const auto ref = run(mesh_t{1, 1}, opt, {});
  CHECK(ref.back() < 0.9 * ref.front());  // it learns
  require_close(run(mesh_t{4, 1}, opt, {}), ref, 1e-5);
  require_close(run(mesh_t{2, 1}, opt, {}), ref, 1e-5);
  // Tensor-parallel (column_dense fc1 split along its largest dimension, row_dense fc2 along its
  // second largest, fc1's bias unfactored and split): the statistics summed over the blocks give
  // the unsharded update, and every device of a parameter keeps the same statistics.
  const mesh_t one{1, 1};
  nn::train_state single(one, make_net(one), opt, {}, nn::rng_key{11});
  const auto single_losses = train(single, 0, 6);
  for (const mesh_t& m : {mesh_t{1, 2}, mesh_t{2, 2}}) {
    INFO("mesh (" << m.axis_size(0) << ", " << m.axis_size(1) << ")");
    nn::train_state tp(m, make_net(m), opt, {}, nn::rng_key{11});
    require_close(train(tp, 0, 6), single_losses, 1e-6);
    for (std::size_t i = 0; i < tp.params.size(); ++i) {
      INFO(tp.params[i].name);
      const std::size_t n = tp.param_state_size(i);
      REQUIRE(n == single.param_state_size(i));
      const std::vector<float> want(single.param_state(i, 0), single.param_state(i, 0) + n);
      for (std::size_t dev = 0; dev < m.size(); ++dev) {
        const std::vector<float> got(tp.param_state(i, dev), tp.param_state(i, dev) + n);
        CHECK(got == std::vector<float>(tp.param_state(i, 0), tp.param_state(i, 0) + n));  // alike, bit for bit
        for (std::size_t k = 0; k < n; ++k) REQUIRE(std::abs(got[k] - want[k]) <= 1e-5 * std::abs(want[k]) + 1e-12);
      }
    }
  }
  // Factoring matters: an unfactored run differs.
  CHECK(run(mesh_t{1, 1}, nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f, .factored = false}),
            {}) != ref);
  const std::string head = "meshlib::nn: train_state: the optimizer adafactor(momentum 0.5) reads whole parameters "
                           "(its statistics are per parameter, summed over the pieces of a tensor-parallel, FSDP or "
                           "ZeRO-1 parameter), but ";
  // (ZeRO-1 and FSDP: the tests "adafactor: ZeRO-1" and "adafactor: FSDP" below.) A parameter its
  // layer shards over the data axis is none of those pieces: refused.
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          const mesh_t m{2, 1};
          const nn::rng_key key{11};
          nn::train_state state(m,
                                nn::sequential(nn::column_dense<float, mesh_t, "data">(m, "fc1", features, hidden, key),
                                               nn::relu<float>(m),
                                               nn::row_dense<float, mesh_t, "data">(m, "fc2", hidden, classes, key)),
                                opt, {});
        }) == head + "parameter 'fc1.w' is sharded named_sharding(mesh{'data': 2, 'model': 1}, P<none, \"data\">) "
                     "over a data or pipeline axis; shard it over model (tensor-parallel) axes only, or replicate it");
  // Inside masked and multi_transform too.
  CHECK(nn::optimizer(nn::masked(opt, [](std::string_view) { return true; })).whole_parameters());
  const nn::optimizer groups = nn::multi_transform({{"a", nn::adam(1e-3f)}, {"b", opt}}, [](std::string_view) { return "a"; });
  CHECK(groups.whole_parameters());
  CHECK(!nn::optimizer(nn::multi_transform({{"a", nn::adam(1e-3f)}}, [](std::string_view) { return "a"; })).whole_parameters());
  // A group of them under ZeRO-1 (fc1 and fc2 Adafactor, fc3 Adam): as the replicated state.
  const nn::optimizer mixed = nn::multi_transform(
      {{"a", nn::adam(1e-3f)}, {"b", opt}}, [](std::string_view n) { return n.starts_with("fc3") ? "a" : "b"; });
  require_close(run(mesh_t{4, 1}, mixed, {}, 6, nn::data_parallel<"data">{.zero = 1}), run(mesh_t{4, 1}, mixed, {}),
                1e-6);
}

TEST_CASE("adafactor's optimizer state: O(rows + cols) per factored matrix", "[nn][optim][adafactor]") {
  // make_net's parameters: fc1.w [12, 16] and fc2.w [16, 16] factored (both dimensions >= 8),
  // fc3.w [16, 4] and the biases not. Bytes on a device = 4 x (momentum's one float per element of
  // its blocks + per parameter: rows + cols when factored, every element when not).
  const nn::optimizer opt = nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f});
  const std::size_t elements = 12 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4;
  const std::size_t second_moment = (12 + 16) + 16 + (16 + 16) + 16 + 16 * 4 + 4;
  const mesh_t one{1, 1};
  nn::train_state a(one, make_net(one), opt, {});
  CHECK(a.memory(0).optimizer_state == 4 * (elements + second_moment));
  // Unfactored: the second moment is per element again, as Adam's.
  nn::train_state full(one, make_net(one), nn::adafactor(0.1f, {.momentum = 0.5f, .factored = false}), {});
  CHECK(full.memory(0).optimizer_state == 4 * (2 * elements));
  // Tensor-parallel over 2: fc1 (w, b) and fc2.w are split, so momentum holds half of them; the
  // statistics are whole on both devices.
  const mesh_t tp{1, 2};
  nn::train_state b(tp, make_net(tp), opt, {});
  const std::size_t local = (12 * 16 + 16 + 16 * 16) / 2 + 16 + 16 * 4 + 4;
  for (std::size_t dev = 0; dev < 2; ++dev) CHECK(b.memory(dev).optimizer_state == 4 * (local + second_moment));
  // A larger matrix shows the saving: [256, 512] keeps 256 + 512 floats, not 131,072.
  const std::size_t big[2] = {256, 512};
  CHECK(opt.param_state_size(nn::param_info{"w", big, true}) == 768);
  CHECK(nn::adafactor(0.1f).param_state_size(nn::param_info{"w", big, true}) == 768);  // optax's default 128
  const std::size_t narrow[2] = {100, 4096};
  CHECK(nn::adafactor(0.1f).param_state_size(nn::param_info{"w", narrow, true}) == 409600);  // 100 < 128
}

TEST_CASE("checkpoints hold adafactor's state", "[nn][optim][adafactor][checkpoint]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_adafactor_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const nn::optimizer opt = nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f});
  const mesh_t m1{2, 1}, m2{4, 1};
  nn::train_state a(m1, make_net(m1), opt, {});
  (void)train(a, 0, 3);
  nn::save_checkpoint(dir, a);
  nn::train_state b(m2, make_net(m2), opt, {});
  nn::restore_checkpoint(dir, b);
  CHECK(b.step == 3);
  nn::train_state c(m1, make_net(m1), opt, {});
  nn::restore_checkpoint(dir, c);
  for (std::size_t dev = 0; dev < m1.size(); ++dev) CHECK(c.optimizer_state(dev) == a.optimizer_state(dev));
  // The statistics carry on: a resumed run matches the uninterrupted one, and a fresh state does not.
  const auto resumed = train(b, 3, 3);
  require_close(resumed, train(a, 3, 3), 1e-5);
  nn::train_state fresh(m1, make_net(m1), opt, {});
  (void)train(fresh, 0, 3);
  nn::train_state cold(m1, make_net(m1), opt, {});
  for (std::size_t i = 0; i < cold.params.size(); ++i)
    for (std::size_t dev = 0; dev < m1.size(); ++dev)
      std::memcpy(cold.params[i].value[dev], fresh.params[i].value[dev], cold.params[i].count[dev] * sizeof(float));
  cold.step = 3;
  CHECK(train(cold, 3, 3) != resumed);
  // Saved tensor-parallel, restored on one device and data-parallel: the statistics are the same
  // floats on every mesh (one file per parameter, its size in the index).
  const mesh_t tp{1, 2};
  nn::train_state d(tp, make_net(tp), opt, {});
  (void)train(d, 0, 2);
  nn::save_checkpoint(dir, d);
  {
    std::ifstream index(dir / "index");
    const std::string text((std::istreambuf_iterator<char>(index)), std::istreambuf_iterator<char>());
    const auto at = text.find("param fc1.w float32 12x16 ");
    REQUIRE(at != std::string::npos);
    const std::string line = text.substr(at, text.find('\n', at) - at);
    INFO(line);
    CHECK(line.find(" state 28 ") != std::string::npos);  // fc1.w: 12 + 16 floats, then their checksum
  }
  std::vector<std::vector<float>> saved;
  for (std::size_t i = 0; i < d.params.size(); ++i)
    saved.emplace_back(d.param_state(i, 0), d.param_state(i, 0) + d.param_state_size(i));
  const auto continued = train(d, 2, 2);
  for (const mesh_t& m : {mesh_t{1, 1}, mesh_t{2, 1}}) {
    nn::train_state e(m, make_net(m), opt, {});
    nn::restore_checkpoint(dir, e);
    for (std::size_t i = 0; i < e.params.size(); ++i) {
      const std::size_t n = e.param_state_size(i);
      REQUIRE(n == saved[i].size());
      for (std::size_t dev = 0; dev < m.size(); ++dev)
        CHECK(std::vector<float>(e.param_state(i, dev), e.param_state(i, dev) + n) == saved[i]);
    }
    require_close(train(e, 2, 2), continued, 1e-5);
  }
  // Other factoring options keep another state: refused, naming the parameter and the fix.
  nn::train_state other(m1, make_net(m1), nn::adafactor(0.1f, {.min_dim_size_to_factor = 16, .momentum = 0.5f}), {});
  CHECK(meshlib_test::message_of<meshlib::nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
        "meshlib::nn: restore_checkpoint: '" + (dir / "index").string() + "': parameter 'fc1.w' has 28 floats of "
        "per-parameter optimizer state in the checkpoint, the train state's optimizer adafactor(momentum 0.5) keeps "
        "192 (factored or not, min_dim_size_to_factor): restore with the optimizer options it was saved with");
  fs::remove_all(dir);
}

namespace {

/// Every parameter of `state` as a whole host array (its global row-major elements), put together
/// from each device's block where the layout says it lies: replicated, tensor-parallel, ZeRO-1 or
/// FSDP shards alike. Copies of one element on several devices must be the same bits.
template <class State>
std::vector<std::vector<float>> whole_params(State& state) {
  std::vector<std::vector<float>> out;
  std::vector<float> h;
  for (const auto& p : state.params) {
    std::vector<float> w(nn::detail::element_count(p.shape));
    std::vector<bool> seen(w.size(), false);
    for (std::size_t dev : state.local_devices()) {
      h.resize(p.count[dev]);
      meshlib::copy_to_host<meshlib::default_memory_space>(h.data(), p.value[dev], h.size());
      nn::detail::for_each_global_run(p, dev, 0, h.size(), [&](std::size_t k, std::size_t g, std::size_t n) {
        for (std::size_t j = 0; j < n; ++j) {
          if (seen[g + j]) REQUIRE(std::memcmp(&w[g + j], &h[k + j], sizeof(float)) == 0);
          w[g + j] = h[k + j];
          seen[g + j] = true;
        }
      });
    }
    REQUIRE(std::find(seen.begin(), seen.end(), false) == seen.end());
    out.push_back(std::move(w));
  }
  return out;
}

/// The largest relative difference of `got` from `want` (elementwise, each parameter), with
/// `floor` as the smallest magnitude it is relative to.
double max_rel_diff(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want,
                    double floor = 1e-3) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(got[i].size() == want[i].size());
    for (std::size_t j = 0; j < got[i].size(); ++j)
      worst = std::max(worst, std::abs(double(got[i][j]) - double(want[i][j])) /
                                  std::max(floor, std::abs(double(want[i][j]))));
  }
  return worst;
}

/// The optimizers whose statistics are over whole parameters: Adafactor factored (with momentum:
/// a state slot ZeRO-1 slices beside the whole statistics), unfactored, and the block-RMS
/// transforms after Adam (the clip binds: Adam's updates have RMS about 1).
std::vector<nn::optimizer> whole_param_optimizers() {
  return {nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f}),
          nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .clipping_threshold = 0.5f, .factored = false}),
          nn::chain(nn::scale_by_adam(), nn::clip_by_block_rms(0.25f), nn::scale_by_param_block_rms(),
                    nn::scale(-5e-2f))};
}

/// Whether a ZeRO-1 slice of `state` cuts a factored-size matrix (both dimensions at least 8) in
/// the middle of a row: a run of it that starts or ends off a row's first element.
template <class State>
bool cuts_mid_row(State& state) {
  bool cut = false;
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, std::span<float* const>) {
      const auto& p = state.params[i];
      if (p.shape.size() == 2 && p.shape[0] >= 8 && p.shape[1] >= 8 && p.count[dev] == p.shape[0] * p.shape[1] &&
          (off % p.shape[1] != 0 || (off + len) % p.shape[1] != 0))
        cut = true;
    });
  return cut;
}

/// Parameter `i`'s per-parameter state on every device of `state` that holds it: alike bit for bit
/// (the sums over the pieces give every device the same numbers); returns device 0's.
template <class State>
std::vector<float> alike_param_state(State& state, std::size_t i) {
  const std::size_t n = state.param_state_size(i);
  std::vector<float> first;
  for (std::size_t dev : state.local_devices()) {
    const float* v = state.param_state(i, dev);
    if (v == nullptr) continue;
    std::vector<float> got(n);
    meshlib::copy_to_host<meshlib::default_memory_space>(got.data(), v, n);
    if (first.empty()) first = got;
    REQUIRE(got == first);
  }
  return first;
}

}  // namespace

TEST_CASE("adafactor: ZeRO-1", "[nn][optim][adafactor][zero]") {
  // Each device of the data axis updates its slice of the flat vector (548 floats: over 2 devices
  // fc2.w [16, 16] is cut after 66 of its elements, mid-row; over 4, fc1.w [12, 16] after 137 and
  // fc2.w again, and the third device's slice holds fc2.w alone, so it has no run of the others but
  // takes part in their sums). The statistics are summed over the data axis (and the model axis on
  // 2 x 2). Against the replicated state on the same mesh (the same gradients): the sums are in
  // double in another order, so the parameters after 5 steps may differ by a float rounding
  // (tolerance 1e-6 relative; on this machine they are the same bits); the losses are one device's.
  const nn::rng_key key{11};
  for (const nn::optimizer& opt : whole_param_optimizers()) {
    INFO(opt.name());
    const auto ref = run(mesh_t{1, 1}, opt, {}, 5);
    CHECK(ref.back() < ref.front());  // it learns
    for (const mesh_t& m : {mesh_t{2, 1}, mesh_t{4, 1}, mesh_t{2, 2}}) {
      INFO("mesh (" << m.axis_size(0) << ", " << m.axis_size(1) << ")");
      nn::train_state replicated(m, make_net(m), opt, {}, key, {}, nn::data_parallel<"data">{});
      nn::train_state zero(m, make_net(m), opt, {}, key, {}, nn::data_parallel<"data">{.zero = 1});
      if (m.axis_size(1) == 1) CHECK(cuts_mid_row(zero));
      if (opt.slots() > 0) CHECK(zero.optimizer_state_size(0) < replicated.optimizer_state_size(0));
      require_close(train(replicated, 0, 5), ref, 1e-5);
      require_close(train(zero, 0, 5), ref, 1e-5);
      CHECK(max_rel_diff(whole_params(zero), whole_params(replicated)) <= 1e-6);
      for (std::size_t i = 0; i < zero.params.size(); ++i) {
        INFO(zero.params[i].name);
        const auto got = alike_param_state(zero, i), want = alike_param_state(replicated, i);
        REQUIRE(got.size() == want.size());
        for (std::size_t k = 0; k < got.size(); ++k)
          REQUIRE(std::abs(got[k] - want[k]) <= 1e-6 * std::abs(want[k]) + 1e-12);
      }
    }
  }
}

TEST_CASE("adafactor: FSDP", "[nn][optim][adafactor][fsdp]") {
  // FSDP's shards are blocks of each parameter cut along dimension 0 (fc1.w [12, 16] over 4: three
  // rows each, every column statistic summed over the fsdp axis); with a model axis too, blocks of
  // blocks. Against plain data parallelism over the same axis (the same gradients, the state
  // unsharded): within a float rounding of the sums' order (1e-6 relative; here the same bits).
  // Against one device the gradients themselves are summed in another order (Adam's parameters
  // differ by some 1e-6 there too): the losses.
  const nn::rng_key key{11};
  for (const nn::optimizer& opt : whole_param_optimizers()) {
    INFO(opt.name());
    const auto losses = run(mesh_t{1, 1}, opt, {}, 5);
    for (const shard_mesh_t& m : {shard_mesh_t{2, 1}, shard_mesh_t{4, 1}, shard_mesh_t{2, 2}}) {
      INFO("mesh (" << m.axis_size(0) << ", " << m.axis_size(1) << ")");
      nn::train_state fsdp(m, make_shard_net(m), opt, {}, key, {}, nn::fully_shard<"fsdp">{});
      nn::train_state dp(m, make_shard_net(m), opt, {}, key, {}, nn::data_parallel<"fsdp">{});
      if (opt.slots() > 0) CHECK(fsdp.optimizer_state_size(0) < dp.optimizer_state_size(0));  // slots sharded
      require_close(train(fsdp, 0, 5), losses, 1e-5);
      (void)train(dp, 0, 5);
      CHECK(max_rel_diff(whole_params(fsdp), whole_params(dp)) <= 1e-6);
      for (std::size_t i = 0; i < fsdp.params.size(); ++i) {
        INFO(fsdp.params[i].name);
        const auto got = alike_param_state(fsdp, i), want = alike_param_state(dp, i);
        REQUIRE(got.size() == want.size());
        for (std::size_t k = 0; k < got.size(); ++k)
          REQUIRE(std::abs(got[k] - want[k]) <= 1e-6 * std::abs(want[k]) + 1e-12);
      }
    }
  }
}

TEST_CASE("adafactor: ZeRO-1 checkpoints", "[nn][optim][adafactor][zero][checkpoint]") {
  // Saved under ZeRO-1 after 3 steps: restored into ZeRO-1 it continues bit for bit as the run that
  // was not interrupted; restored unsharded on the same mesh, within a rounding of the sums' order
  // (1e-6 relative); on one device and into FSDP's shards, the losses (the gradients are summed in
  // another order there). Saved unsharded, restored into ZeRO-1: the same. The statistics come
  // back whole, the same bits on every device of every layout.
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_adafactor_zero_" + std::to_string(::getpid()));
  const nn::rng_key key{11};
  const nn::optimizer opt = nn::adafactor(0.1f, {.min_dim_size_to_factor = 8, .momentum = 0.5f});
  const mesh_t one{1, 1}, four{4, 1};
  const shard_mesh_t shards{2, 1};
  const auto zero1 = nn::data_parallel<"data">{.zero = 1};
  {
    fs::remove_all(dir);
    nn::train_state a(four, make_net(four), opt, {}, key, {}, zero1);
    (void)train(a, 0, 3);
    nn::save_checkpoint(dir, a);
    nn::train_state same(four, make_net(four), opt, {}, key, {}, zero1);
    nn::train_state replicated(four, make_net(four), opt, {}, key);
    nn::train_state single(one, make_net(one), opt, {}, key);
    nn::train_state sharded(shards, make_shard_net(shards), opt, {}, key, {}, nn::fully_shard<"fsdp">{});
    nn::restore_checkpoint(dir, same);
    nn::restore_checkpoint(dir, replicated);
    nn::restore_checkpoint(dir, single);
    nn::restore_checkpoint(dir, sharded);
    for (std::size_t i = 0; i < a.params.size(); ++i) {
      INFO(a.params[i].name);
      const auto saved = alike_param_state(a, i);
      CHECK(alike_param_state(same, i) == saved);
      CHECK(alike_param_state(replicated, i) == saved);
      CHECK(alike_param_state(single, i) == saved);
      CHECK(alike_param_state(sharded, i) == saved);
    }
    const auto rest = train(a, 3, 3);
    const auto want = whole_params(a);
    CHECK(train(same, 3, 3) == rest);
    CHECK(whole_params(same) == want);
    require_close(train(replicated, 3, 3), rest, 1e-5);
    CHECK(max_rel_diff(whole_params(replicated), want) <= 1e-6);
    require_close(train(single, 3, 3), rest, 1e-5);
    require_close(train(sharded, 3, 3), rest, 1e-5);
    // Without the restored statistics the continuation differs: they are what the test restores.
    nn::train_state cold(four, make_net(four), opt, {}, key, {}, zero1);
    nn::restore_checkpoint(dir, cold);
    for (std::size_t i = 0; i < cold.params.size(); ++i)
      for (std::size_t dev : cold.local_devices())
        if (float* v = cold.param_state(i, dev)) {
          const std::vector<float> zeros(cold.param_state_size(i), 0.0f);
          meshlib::copy_from_host<meshlib::default_memory_space>(v, zeros.data(), zeros.size());
        }
    CHECK(train(cold, 3, 3) != rest);
  }
  {
    fs::remove_all(dir);
    nn::train_state a(four, make_net(four), opt, {}, key);
    (void)train(a, 0, 3);
    nn::save_checkpoint(dir, a);
    nn::train_state b(four, make_net(four), opt, {}, key, {}, zero1);
    nn::restore_checkpoint(dir, b);
    for (std::size_t i = 0; i < a.params.size(); ++i) CHECK(alike_param_state(b, i) == alike_param_state(a, i));
    require_close(train(b, 3, 3), train(a, 3, 3), 1e-5);
    CHECK(max_rel_diff(whole_params(b), whole_params(a)) <= 1e-6);
  }
  fs::remove_all(dir);
}

}  // namespace MESHLIB_TEST_UNIT
