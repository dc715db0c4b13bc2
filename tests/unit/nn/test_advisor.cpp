// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The mesh-shape advisor (nn/advise_mesh.hpp, issue 26 item 6): the enumeration of shapes against
// loops written here, the memory estimate against a count from the layers' shapes, refusals with
// the library's own reasons, and its ranking of three shapes against longer measured runs.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "small_gpt.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

/// A wide tensor-parallel MLP on a tiny batch: two column/row pairs of width 512 (hidden 1024), so
/// a step is mostly the optimizer's update and the gradient synchronisation of the parameters a
/// device holds, which the model axis divides: on 4 devices (1, 4) holds a quarter of them, (2, 2)
/// half, (4, 1) all. Measured on the 2 shared cores of the development machine (load average 3 to
/// 5): 12-19 ms, 27-40 ms and 45-70 ms a step, at least 1.7x apart from one to the next.
auto tp_mlp(const mesh_t& m) {
  const nn::rng_key key{3};
  auto blk = [&](int i) {
    return nn::sequential(nn::column_dense<float, mesh_t>(m, "c" + std::to_string(i), 512, 1024, key), nn::relu<float>(m),
                          nn::row_dense<float, mesh_t>(m, "r" + std::to_string(i), 1024, 512, key));
  };
  return nn::sequential(nn::dense<float, mesh_t>(m, "in", 16, 512, key), blk(0), blk(1),
                        nn::dense<float, mesh_t>(m, "head", 512, 4, key));
}

nn::batch batch_of(std::size_t rows, std::size_t features, std::size_t classes) {
  const auto ds = meshlib_test::synthetic_problem(rows, features, classes);
  nn::batch b;
  b.x = ds.x;
  b.y = ds.y;
  b.rows = b.global_rows = rows;
  b.features = features;
  return b;
}

nn::mesh_shape shape_of(std::vector<std::string> axes, std::vector<std::size_t> sizes) {
  return nn::mesh_shape{std::move(axes), std::move(sizes)};
}

/// The small GPT of small_gpt.hpp with one block (4 heads, vocabulary 32, width 16).
auto one_block_gpt(const mesh_t& m) { return meshlib_test::small_gpt<"model", false, 1>(m); }

nn::token_batch gpt_batch(std::size_t windows) {
  std::vector<std::uint8_t> text(2000);
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<std::uint8_t>((i * 7 + i / 5) % 32);
  return nn::sample_windows(text, windows, 8, nn::rng_key{5});
}

}  // namespace

TEST_CASE("mesh_shapes: every factorisation of the device count over the mesh's axes, in order", "[nn][advisor]") {
  for (std::size_t n = 1; n <= 12; ++n) {
    INFO(n << " devices");
    std::vector<nn::mesh_shape> want;  // the last axis outermost, each ascending
    for (std::size_t mo = 1; mo <= n; ++mo)
      if (n % mo == 0) want.push_back(shape_of({"data", "model"}, {n / mo, mo}));
    CHECK(nn::mesh_shapes<mesh_t>(n) == want);
    using mesh3 = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"model">>;
    std::vector<nn::mesh_shape> want3;
    for (std::size_t mo = 1; mo <= n; ++mo)
      for (std::size_t f = 1; f <= n; ++f)
        if (n % (mo * f) == 0) want3.push_back(shape_of({"data", "fsdp", "model"}, {n / (mo * f), f, mo}));
    CHECK(nn::mesh_shapes<mesh3>(n) == want3);
    for (const auto& s : want3) CHECK(nn::make_mesh<mesh3>(s).size() == n);
  }
  CHECK(nn::mesh_shapes<mesh_t>(8).size() == 4);
  CHECK(nn::mesh_shapes<mesh_t>(8)[1].to_string() == "(4, 2)");
  CHECK(nn::mesh_shapes<mesh_t>(8)[1].flag() == "4x2");
  CHECK(nn::mesh_shapes<mesh_t>(0).empty());
  // A static axis size is kept: only the other axes vary.
  using fixed_model = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model", 2>>;
  CHECK(nn::mesh_shapes<fixed_model>(8) == std::vector<nn::mesh_shape>{shape_of({"data", "model"}, {4, 2})});
  CHECK(nn::mesh_shapes<fixed_model>(3).empty());
}

TEST_CASE("advise_mesh: the memory estimate is the state's bytes plus the step's activation peak", "[nn][advisor]") {
  // A dense + relu stack (N blocks of W, a head of C classes, r rows), Adam: every device holds all
  // P parameters (dense layers are replicated over both axes), their gradients and two moments:
  // 16 P bytes. Activations (see test_remat.cpp for the count): r C + r W + 4 N r W floats on the
  // rows a device gets: r / 2 on (2, 1), all r on (1, 2).
  constexpr std::size_t n = 3, w = 8, c = 4, r = 16;
  auto model = [](const mesh_t& m) {
    const nn::rng_key key{7};
    return nn::sequential(nn::dense<float, mesh_t>(m, "fc0", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "fc1", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "fc2", w, w, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "head", w, c, key));
  };
  nn::advise_options o;
  o.warmup_steps = 1;
  o.timed_steps = 2;
  const auto a = nn::advise_mesh<mesh_t>(2, model, batch_of(r, w, c), o);
  REQUIRE(a.rows.size() == 2);
  const std::size_t params = n * (w * w + w) + w * c + c;
  for (const auto& row : a.rows) {
    INFO(row.shape.to_string());
    REQUIRE(row.possible());
    const std::size_t rows = r / row.shape.size("data");
    CHECK(row.state_bytes == 16 * params);
    CHECK(row.activation_bytes == (rows * c + rows * w + 4 * n * rows * w) * sizeof(float));
    CHECK(row.memory_bytes() == row.state_bytes + row.activation_bytes);
    CHECK(row.step_seconds > 0);
    CHECK(row.samples_per_second == static_cast<double>(r) / row.step_seconds);
    CHECK(row.sync_share >= 0);
    CHECK(row.sync_share <= 1);
  }
  CHECK(a.best == a.rows.front().shape);
  CHECK(a.rows.front().step_seconds <= a.rows.back().step_seconds);
  const std::string table = a.markdown();
  CHECK(table.find("| rank | mesh (data, model) | step time | samples/s | sync share | bubble | memory per device |") == 0);
  CHECK(table.find(" | 0% | ") != std::string::npos);  // no pipeline axis: no bubble
  CHECK(table.find("| 1 | " + a.best.to_string() + " | ") != std::string::npos);
}

TEST_CASE("advise_mesh: shapes the model or the batch refuse are listed with the library's reason", "[nn][advisor][errors]") {
  nn::advise_options o;
  o.warmup_steps = 0;
  o.timed_steps = 1;
  // 4 heads over a model axis of 8: the attention's own message.
  const auto a = nn::advise_mesh<mesh_t>(8, one_block_gpt, gpt_batch(8), o);
  REQUIRE(a.rows.size() == 4);
  const auto& last = a.rows.back();
  INFO(last.refused);
  CHECK(last.shape.to_string() == "(1, 8)");
  CHECK_FALSE(last.possible());
  CHECK(last.refused.find("not possible: h0.attn (causal_self_attention 16 features, 4 heads): ") == 0);
  CHECK(last.refused.find("4 heads are not divisible by the 8 devices of the model axis 'model'") != std::string::npos);
  for (std::size_t i = 0; i + 1 < a.rows.size(); ++i) CHECK(a.rows[i].possible());
  CHECK(a.markdown().find("| - | (1, 8) | not possible: h0.attn") != std::string::npos);
  // 6 windows over 4 data devices: the layers' own message (a device's tokens are not whole
  // sequences); the other shapes still run.
  const auto b = nn::advise_mesh<mesh_t>(4, one_block_gpt, gpt_batch(6), o);
  REQUIRE(b.rows.size() == 3);
  CHECK(b.rows.back().shape.to_string() == "(4, 1)");
  INFO(b.rows.back().refused);
  CHECK(b.rows.back().refused.find("not a whole number of sequences of 8") !=
        std::string::npos);
  // 6 rows over 4 data devices: train_step's own message.
  const auto d = nn::advise_mesh<mesh_t>(4, [](const mesh_t& m) {
    return nn::sequential(nn::dense<float, mesh_t>(m, "fc", 4, 2, nn::rng_key{1}));
  }, batch_of(6, 4, 2), o);
  REQUIRE(d.rows.size() == 3);
  CHECK(d.rows.back().refused ==
        "not possible: train_step: the global batch of 6 rows does not split evenly over the 4 devices of the data "
        "axis; choose a batch size that is a multiple of 4");
  CHECK(d.rows[0].possible());
  CHECK(d.rows[1].possible());
  // A pipeline axis larger than 1: the model is cut into stages. One layer cannot fill two stages
  // (the pipeline's own message); two layers can, and the pipelined shape has a bubble.
  using piped = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"pipeline">>;
  const auto c = nn::advise_mesh<piped>(2, [](const piped& m) {
    return nn::sequential(nn::dense<float, piped>(m, "fc", 4, 2, nn::rng_key{1}));
  }, batch_of(4, 4, 2), o);
  REQUIRE(c.rows.size() == 2);
  CHECK(c.best.to_string() == "(2, 1)");
  CHECK(c.rows.back().refused.find("not possible: pipeline: the mesh's 'pipeline' axis has 2 devices (one stage each) "
                                   "but the model has 1 layers") == 0);
  const auto p2 = nn::advise_mesh<piped>(2, [](const piped& m) {
    return nn::sequential(nn::dense<float, piped>(m, "fc1", 4, 8, nn::rng_key{1}), nn::relu<float>(m),
                          nn::dense<float, piped>(m, "fc2", 8, 2, nn::rng_key{2}));
  }, batch_of(4, 4, 2), o);
  REQUIRE(p2.rows.size() == 2);
  for (const auto& r : p2.rows) {
    INFO(r.shape.to_string() << " " << r.refused);
    CHECK(r.possible());
    CHECK((r.bubble > 0) == (r.shape.size("pipeline") > 1));  // (2, 1) has no pipeline: no bubble
  }
  CHECK(p2.markdown().find("| bubble |") != std::string::npos);
  // Nothing possible: one error listing every shape's reason.
  const std::string msg = meshlib_test::message_of<meshlib::sharding_error>(
      [&] { (void)nn::advise_mesh<mesh_t>(8, one_block_gpt, gpt_batch(3), o); });
  CHECK(msg.find("meshlib::nn: advise_mesh: no mesh shape of 8 devices can train this model on this batch; (8, 1): "
                 "not possible: ") == 0);
  CHECK(msg.find("(1, 8): not possible: h0.attn") != std::string::npos);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          (void)nn::advise_mesh<mesh_t>(0, one_block_gpt, gpt_batch(3), o);
        }) == "meshlib::nn: advise_mesh: 0 devices; give the number of devices to split over");
}

TEST_CASE("advise_mesh ranks three shapes as longer measured runs do", "[nn][advisor][timing]") {
  // Three shapes whose step times differ by 1.7x or more (measured first, see tp_mlp): only the
  // order is checked, so machine load shifts the times but not the answer.
  const auto b = batch_of(4, 16, 4);
  nn::advise_options o;
  o.only = {shape_of({"data", "model"}, {4, 1}), shape_of({"data", "model"}, {2, 2}), shape_of({"data", "model"}, {1, 4})};
  o.timed_steps = 9;  // a median of 9: a burst of load on one shape's steps moves it less
  const auto a = nn::advise_mesh<mesh_t>(4, tp_mlp, b, o);
  REQUIRE(a.rows.size() == 3);
  // The longer runs: 2 warm-up steps each, then 5 rounds of 5 timed steps that visit the shapes in
  // turn; a shape's time is its fastest round (load from elsewhere only ever adds time, and
  // interleaving spreads it over the shapes rather than over one of them).
  std::vector<mesh_t> meshes;
  meshes.reserve(o.only.size());  // the states keep no pointer into it, but no reallocation either
  using state_t = decltype(nn::train_state(std::declval<const mesh_t&>(), tp_mlp(std::declval<const mesh_t&>()), o.opt));
  std::vector<std::unique_ptr<state_t>> states;
  for (const auto& s : o.only) {
    meshes.push_back(nn::make_mesh<mesh_t>(s));
    states.push_back(std::make_unique<state_t>(meshes.back(), tp_mlp(meshes.back()), o.opt));
    for (int i = 0; i < 2; ++i) (void)nn::train_step(*states.back(), b);
  }
  std::vector<double> fastest(o.only.size(), std::numeric_limits<double>::infinity());
  for (int round = 0; round < 5; ++round)
    for (std::size_t k = 0; k < states.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 5; ++i) (void)nn::train_step(*states[k], b);
      fastest[k] = std::min(fastest[k], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  std::vector<std::pair<double, std::string>> measured;
  for (std::size_t k = 0; k < o.only.size(); ++k) measured.emplace_back(fastest[k], o.only[k].to_string());
  std::sort(measured.begin(), measured.end());
  INFO(a.markdown());
  for (std::size_t i = 0; i < 3; ++i) {
    INFO("rank " << i << ": measured " << measured[i].second << " in " << measured[i].first / 5 << " s a step");
    CHECK(a.rows[i].shape.to_string() == measured[i].second);
  }
  CHECK(a.best.to_string() == "(1, 4)");  // the fewest parameters per device: least update and synchronisation
}

}  // namespace MESHLIB_TEST_UNIT
