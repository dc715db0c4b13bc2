// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The mesh-shape advisor (nn/advise_mesh.hpp, issue 26 item 6): the enumeration of shapes against
// loops written here, the memory estimate against a count from the layers' shapes, refusals with
// the library's own reasons, and its ranking on injected step times (no verdict depends on timing;
// `train_bench --advisor` compares its measured ranking with longer runs).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
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
  o.threads_per_device = {1};  // one row per shape (the candidates have their own test case)
  o.overlap = {false};
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
  CHECK(table.find("| rank | mesh (data, model) | threads/device | overlap | step time | samples/s | sync share | bubble | "
                   "memory per device |") == 0);
  CHECK(table.find(" | 0% | ") != std::string::npos);  // no pipeline axis: no bubble
  CHECK(table.find("| 1 | " + a.best.to_string() + " | 1 | off | ") != std::string::npos);
}

TEST_CASE("advise_mesh: shapes the model or the batch refuse are listed with the library's reason", "[nn][advisor][errors]") {
  nn::advise_options o;
  o.warmup_steps = 0;
  o.timed_steps = 1;
  o.threads_per_device = {1};
  o.overlap = {false};
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
  // The table cell is short; the reason is under the table, numbered.
  const std::string why = last.refused.substr(std::string("not possible: ").size());
  const std::string md = a.markdown();
  INFO(md);
  CHECK(md.find("| - | (1, 8) | 1 | off | not possible, see below (1) | | | | |\n\nNot possible:\n\n1. (1, 8) is not possible: " +
                why + "\n") != std::string::npos);
  CHECK(md.substr(md.size() - why.size() - 1) == why + "\n");  // the list ends the text
  CHECK(md.find("| not possible: ") == std::string::npos);
  // Each refused shape has its own number, in the table's order.
  nn::advice twice = a;
  twice.rows.push_back(last);
  const std::string md2 = twice.markdown();
  CHECK(md2.find("| - | (1, 8) | 1 | off | not possible, see below (1) | | | | |\n| - | (1, 8) | 1 | off | not possible, see "
                 "below (2) | | | | |\n") !=
        std::string::npos);
  CHECK(md2.find("\n1. (1, 8) is not possible: " + why + "\n2. (1, 8) is not possible: " + why + "\n") != std::string::npos);
  // 6 windows over 4 data devices: train_step's message in sequences (before any layer runs); the
  // other shapes still run.
  const auto b = nn::advise_mesh<mesh_t>(4, one_block_gpt, gpt_batch(6), o);
  REQUIRE(b.rows.size() == 3);
  CHECK(b.rows.back().shape.to_string() == "(4, 1)");
  CHECK(b.rows.back().refused ==
        "not possible: train_step: the global batch of 6 sequences (of 8 tokens) does not split evenly over the 4 "
        "devices of the data axis; choose a batch size that is a multiple of 4 sequences");
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
  const auto two_layers = [](const piped& m) {
    return nn::sequential(nn::dense<float, piped>(m, "fc1", 4, 8, nn::rng_key{1}), nn::relu<float>(m),
                          nn::dense<float, piped>(m, "fc2", 8, 2, nn::rng_key{2}));
  };
  const auto p2 = nn::advise_mesh<piped>(2, two_layers, batch_of(4, 4, 2), o);
  REQUIRE(p2.rows.size() == 2);
  for (const auto& r : p2.rows) {
    INFO(r.shape.to_string() << " " << r.refused);
    CHECK(r.possible());
    CHECK((r.bubble > 0) == (r.shape.size("pipeline") > 1));  // (2, 1) has no pipeline: no bubble
  }
  CHECK(p2.markdown().find("| bubble |") != std::string::npos);
  // A pipelined shape is not tried with the overlap (no layer hook starts the buckets of a pipelined
  // step: the train state refuses it), and stays possible; a shape without a pipeline is tried both ways.
  o.overlap.clear();
  const auto p4 = nn::advise_mesh<piped>(4, two_layers, batch_of(4, 4, 2), o);
  std::vector<std::string> tried;
  for (const auto& r : p4.rows)
    tried.push_back(r.shape.to_string() + (r.overlap ? " on" : " off") + (r.possible() ? "" : " refused"));
  std::sort(tried.begin(), tried.end());
  CHECK(tried == std::vector<std::string>{"(1, 4) off refused", "(2, 2) off", "(4, 1) off", "(4, 1) on"});
  o.overlap = {false};
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

TEST_CASE("advise_mesh ranks shapes by the step times it is given", "[nn][advisor]") {
  // The ranking is checked on injected step times (advise_options::step_time), so that its verdict
  // does not depend on the machine's load; `train_bench --advisor` compares the advisor's ranking on
  // measured times with longer interleaved runs (a benchmark, not a test: that comparison is only as
  // good as the machine is quiet).
  auto model = [](const mesh_t& m) { return nn::sequential(nn::dense<float, mesh_t>(m, "fc", 4, 2, nn::rng_key{1})); };
  const auto shapes = nn::mesh_shapes<mesh_t>(4);  // (4, 1), (2, 2), (1, 4)
  REQUIRE(shapes.size() == 3);
  const auto b = batch_of(8, 4, 2);
  nn::advise_options o;
  o.warmup_steps = 0;
  o.timed_steps = 3;
  o.threads_per_device = {1};
  o.overlap = {false};
  // Every order of three distinct times: the rows come out sorted by them, the best is the fastest,
  // and a row's step time is the median of its steps' times (the middle step is 100x slower, an
  // outlier the median ignores).
  std::array<double, 3> times{1e-3, 2e-3, 3e-3};
  std::sort(times.begin(), times.end());
  do {
    std::vector<std::pair<std::size_t, std::size_t>> calls;  // (shape, step) of every call
    o.step_time = [&](const nn::advice_row& candidate, std::size_t step, double measured) {
      const auto k = static_cast<std::size_t>(std::find(shapes.begin(), shapes.end(), candidate.shape) - shapes.begin());
      REQUIRE(k < shapes.size());
      CHECK(measured > 0);
      calls.emplace_back(k, step);
      return step == 1 ? 100 * times[k] : times[k];
    };
    const auto a = nn::advise_mesh<mesh_t>(4, model, b, o);
    INFO(times[0] << " " << times[1] << " " << times[2] << "\n" << a.markdown());
    REQUIRE(a.rows.size() == 3);
    const std::vector<std::pair<std::size_t, std::size_t>> want{{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1},
                                                                {1, 2}, {2, 0}, {2, 1}, {2, 2}};
    CHECK(calls == want);  // once per timed step, in enumeration order
    std::vector<std::pair<double, std::size_t>> sorted;
    for (std::size_t k = 0; k < 3; ++k) sorted.emplace_back(times[k], k);
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t r = 0; r < 3; ++r) {
      INFO("rank " << r);
      CHECK(a.rows[r].shape == shapes[sorted[r].second]);
      CHECK(a.rows[r].step_seconds == sorted[r].first);
      CHECK(a.rows[r].samples_per_second == 8.0 / sorted[r].first);
      CHECK(a.rows[r].sync_share >= 0);
      CHECK(a.rows[r].sync_share <= 1);  // measured, whatever the injected times
    }
    CHECK(a.best == shapes[sorted[0].second]);
    CHECK(a.markdown().find("| 1 | " + a.best.to_string() + " | 1 | off | " + std::to_string(static_cast<int>(1e3 * sorted[0].first)) +
                            ".00 ms | ") != std::string::npos);
  } while (std::next_permutation(times.begin(), times.end()));
  // Equal times: enumeration order.
  o.step_time = [](const nn::advice_row&, std::size_t, double) { return 5e-3; };
  const auto tied = nn::advise_mesh<mesh_t>(4, model, b, o);
  REQUIRE(tied.rows.size() == 3);
  for (std::size_t r = 0; r < 3; ++r) CHECK(tied.rows[r].shape == shapes[r]);
  // A refused shape is last whatever time it would have been given, and is never timed: 6 rows do
  // not split over the 4 devices of (4, 1)'s data axis.
  std::size_t timed_41 = 0;
  o.step_time = [&](const nn::advice_row& candidate, std::size_t, double) {
    timed_41 += candidate.shape == shapes[0];
    return candidate.shape == shapes[2] ? 1e-3 : 2e-3;
  };
  const auto r = nn::advise_mesh<mesh_t>(4, model, batch_of(6, 4, 2), o);
  REQUIRE(r.rows.size() == 3);
  CHECK(timed_41 == 0);
  CHECK(r.rows[0].shape == shapes[2]);
  CHECK(r.rows[1].shape == shapes[1]);
  CHECK(r.rows[2].shape == shapes[0]);
  CHECK_FALSE(r.rows[2].possible());
  CHECK(r.best == shapes[2]);
}

TEST_CASE("advise_mesh tries every threads-per-device count and both overlap settings on each shape", "[nn][advisor]") {
  auto model = [](const mesh_t& m) { return nn::sequential(nn::dense<float, mesh_t>(m, "fc", 4, 2, nn::rng_key{1})); };
  nn::advise_options o;
  o.warmup_steps = 0;
  o.timed_steps = 1;
  o.threads_per_device = {1, 2};
  // Every candidate once, in enumeration order (shape, then threads, then overlap); the overlap is
  // tried only where a data axis has something to synchronise: (2, 1) twice per thread count,
  // (1, 2) once (with the base option, off). The BLAS threads of each candidate are set while it runs.
  std::vector<std::string> seen;
  o.step_time = [&](const nn::advice_row& c, std::size_t, double) {
    seen.push_back(c.shape.to_string() + " t" + std::to_string(c.threads_per_device) + (c.overlap ? " on" : " off"));
    CHECK(meshlib::blas_threads_per_device() == static_cast<int>(c.threads_per_device));
    // The fastest: (2, 1) with 2 threads and the overlap on; the rest slower by how far they are from it.
    return 1e-3 * (1 + (c.shape.size("data") == 2 ? 0 : 4) + (c.threads_per_device == 2 ? 0 : 2) + (c.overlap ? 0 : 1));
  };
  meshlib::set_blas_threads_per_device(1);
  const auto a = nn::advise_mesh<mesh_t>(2, model, batch_of(4, 4, 2), o);
  CHECK(seen == std::vector<std::string>{"(2, 1) t1 off", "(2, 1) t1 on", "(2, 1) t2 off", "(2, 1) t2 on", "(1, 2) t1 off",
                                         "(1, 2) t2 off"});
  REQUIRE(a.rows.size() == 6);
  CHECK(a.best.to_string() == "(2, 1)");
  CHECK(a.best_threads_per_device == 2);
  CHECK(a.best_overlap);
  CHECK(a.rows[0].step_seconds == 1e-3);
  CHECK(a.rows[1].threads_per_device == 2);  // (2, 1) t2 off: 2 ms
  CHECK_FALSE(a.rows[1].overlap);
  CHECK(a.markdown().find("| 1 | (2, 1) | 2 | on | 1.00 ms | ") != std::string::npos);
  CHECK(meshlib::blas_threads_per_device() == 1);  // the caller's setting is back
  // The default counts: 1 and, where larger, the cores this process may run on / the devices.
  o.threads_per_device.clear();
  o.overlap = {false};
  seen.clear();
  (void)nn::advise_mesh<mesh_t>(1, model, batch_of(4, 4, 2), o);
  std::vector<std::string> want{"(1, 1) t1 off"};
  if (meshlib::available_cores() > 1) want.push_back("(1, 1) t" + std::to_string(meshlib::available_cores()) + " off");
  CHECK(seen == want);
  // A shape the library refuses is one row, whatever the candidates: 3 rows do not split over the
  // data axis of (2, 1).
  o.threads_per_device = {1, 2};
  o.overlap.clear();
  const auto r = nn::advise_mesh<mesh_t>(2, model, batch_of(3, 4, 2), o);
  REQUIRE(r.rows.size() == 3);  // (1, 2) with 1 and 2 threads, then (2, 1) once
  CHECK(r.rows[0].shape.to_string() == "(1, 2)");
  CHECK(r.rows[1].shape.to_string() == "(1, 2)");
  CHECK(r.rows[2].shape.to_string() == "(2, 1)");
  CHECK_FALSE(r.rows[2].possible());
  // A count of 0 is refused before anything runs.
  o.threads_per_device = {0};
  CHECK(meshlib_test::message_of<std::invalid_argument>([&] { (void)nn::advise_mesh<mesh_t>(2, model, batch_of(4, 4, 2), o); }) ==
        "meshlib::nn: advise_mesh: advise_options::threads_per_device holds 0; give counts of 1 or more");
}

}  // namespace MESHLIB_TEST_UNIT
