// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Pipeline-parallel training over a 'pipeline' mesh axis (nn/parallel/pipeline.hpp, issue 26): per-step
// losses of an MLP and of a small GPT (its head tied to the embedding across stages) on pipeline
// axes of 2 and 4, with data and tensor axes beside, GPipe and 1F1B, equal to the 1-device run; the
// lockstep plans against the closed-form bubble; stages balanced by parameter count; each device
// holding only its stage's parameters; checkpoints moving between pipeline shapes; bad input refused
// with the exact error.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "pipeline_mlp.hpp"
#include "small_gpt.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

namespace nn = meshlib::nn;
// The five-layer MLP and its data (pipeline_mlp.hpp).
using namespace meshlib_test::pipeline_mlp;  // mesh_t, shape_t, the sizes, make_mlp, data()
inline const nn::dataset& mlp_data() { return meshlib_test::pipeline_mlp::data(); }

template <class State>
double mlp_step(State& state, std::size_t s) {
  const auto& ds = mlp_data();
  return nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                        std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch)
      .loss;
}

/// The MLP's per-step losses with the pipeline policy `pipe` (on a pipeline axis of one device: no
/// pipeline) and the data-parallel policy `dp`, then evaluate's loss and correct rows + 1.
std::vector<double> mlp_losses(const shape_t& shape, nn::train_options o = {}, nn::pipeline<"pipeline"> pipe = {},
                               std::size_t steps = 12, nn::optimizer opt = nn::adam(nn::constant(1e-2f)),
                               nn::data_parallel<"data"> dp = {}) {
  const mesh_t m{shape[0], shape[1], shape[2]};
  nn::train_state state(m, make_mlp(m), opt, o, dp, pipe);
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(mlp_step(state, s));
  // evaluate: batches of 44 rows (the last one smaller, split unevenly over the data axis).
  const auto v = nn::evaluate(state, mlp_data(), 44);
  out.push_back(v.loss);
  out.push_back(static_cast<double>(v.correct) + 1.0);
  return out;
}

/// The small GPT (small_gpt.hpp): six layers, the head tied to the embedding (on another stage
/// once the model is cut: the table is mirrored there).
using meshlib_test::gpt_validation;
using meshlib_test::gpt_windows;
using meshlib_test::small_gpt;

/// The small GPT on the seed's 4-axis mesh: its tensor-parallel layers over 'tensor'.
using mesh4_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"tensor">,
                              meshlib::axis<"pipeline">>;
using shape4_t = std::array<std::size_t, 4>;
auto small_gpt4(const mesh4_t& m) { return small_gpt<"tensor">(m); }

/// Per-step losses of `steps` steps of the small GPT, then the validation loss.
std::vector<double> gpt_losses(const shape_t& shape, nn::train_options o = {}, nn::pipeline<"pipeline"> pipe = {},
                               std::size_t steps = 10) {
  const mesh_t m{shape[0], shape[1], shape[2]};
  nn::train_state state(m, small_gpt(m), nn::adam(nn::constant(1e-2f)), o, pipe);
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(nn::train_step(state, gpt_windows(s)).loss);
  out.push_back(nn::evaluate(state, gpt_validation(), 4).loss);
  return out;
}

/// The MLP and an untied GPT (a column_dense head: FSDP shards no tied parameter) on the 4-axis mesh.
auto make_mlp4(const mesh4_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, mesh4_t, "tensor">(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh4_t, "tensor">(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, mesh4_t>(m, "fc3", hidden, classes, key));
}
auto untied_gpt4(const mesh4_t& m) {
  const nn::rng_key key{21};
  return nn::sequential(nn::embedding<float, mesh4_t, "tensor">(m, "tok", 32, 16, key, 0.5f),
                        nn::positional_embedding<float, mesh4_t>(m, "pos", 8, 16, 8, key, 0.1f),
                        nn::transformer_block<float, mesh4_t, "tensor">(m, "h0", 16, 4, 32, 8, key),
                        nn::transformer_block<float, mesh4_t, "tensor">(m, "h1", 16, 4, 32, 8, key),
                        nn::layer_norm<float, mesh4_t>(m, "ln_f", 16),
                        nn::column_dense<float, mesh4_t, "tensor">(m, "head", 16, 32, key));
}

/// `small_gpt4` with each Transformer block in `nn::remat` (its activations recomputed in backward).
auto small_gpt4_remat(const mesh4_t& m) { return small_gpt<"tensor", true>(m); }

/// Per-step losses of the GPT on a 4-axis mesh, then the validation loss (`remat`: every block in
/// `nn::remat`); the batch over data x fsdp (`data_parallel<"data", "fsdp">`: the tied embedding
/// keeps the parameters replicated).
std::vector<double> gpt4_losses(const shape4_t& shape, nn::train_options o = {}, nn::pipeline<"pipeline"> pipe = {},
                                std::size_t steps = 8, bool remat = false) {
  const mesh4_t m{shape[0], shape[1], shape[2], shape[3]};
  const nn::data_parallel<"data", "fsdp"> dp{};
  if (remat) {
    nn::train_state state(m, small_gpt4_remat(m), nn::adam(nn::constant(1e-2f)), o, dp, pipe);
    std::vector<double> out;
    for (std::size_t s = 0; s < steps; ++s) out.push_back(nn::train_step(state, gpt_windows(s)).loss);
    out.push_back(nn::evaluate(state, gpt_validation(), 4).loss);
    return out;
  }
  nn::train_state state(m, small_gpt4(m), nn::adam(nn::constant(1e-2f)), o, dp, pipe);
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(nn::train_step(state, gpt_windows(s)).loss);
  out.push_back(nn::evaluate(state, gpt_validation(), 4).loss);
  return out;
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

}  // namespace

TEST_CASE("pipeline: an MLP's losses on pipeline axes of 2 and 4 equal the 1-device run", "[nn][pipeline]") {
  const auto ref = mlp_losses({1, 1, 1});  // 12 losses, then evaluate's loss and correct rows + 1
  CHECK(ref[11] < ref[0]);
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (auto shape : {shape_t{1, 1, 2}, shape_t{1, 1, 4}, shape_t{2, 1, 2}, shape_t{1, 2, 2}})
      for (std::size_t mb : {1, 2, 4}) {
        INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ") micro-batches " << mb << " "
                      << (kind == nn::pipeline_kind::gpipe ? "GPipe" : "1F1B"));
        require_close(mlp_losses(shape, {}, {.schedule = kind, .microbatches = mb}), ref, 1e-5);
      }
}

TEST_CASE("pipeline: clipping over every stage's gradients, and ZeRO-1 over the data axis within each stage",
          "[nn][pipeline][zero]") {
  // The global norm sums every stage's blocks once.
  const nn::optimizer opt = nn::chain(nn::clip_by_global_norm(0.5f), nn::adamw(nn::constant(1e-2f), 1e-2f));
  const auto ref = mlp_losses({1, 1, 1}, {}, {}, 12, opt);
  for (bool zero : {false, true})
    for (auto shape : {shape_t{2, 1, 2}, shape_t{1, 1, 4}, shape_t{2, 2, 2}}) {
      INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ") zero " << zero);
      require_close(mlp_losses(shape, {}, {.microbatches = 2}, 12, opt, {.zero = zero ? 1 : 0}), ref, 1e-5);
    }
}

TEST_CASE("pipeline: a small GPT (head tied across stages) trains as on one device, GPipe and 1F1B",
          "[nn][pipeline][gpt]") {
  const auto ref = gpt_losses({1, 1, 1});
  CHECK(ref[9] < ref[0] - 0.3);  // it learns
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (auto shape : {shape_t{1, 1, 2}, shape_t{1, 1, 4}, shape_t{2, 1, 2}, shape_t{1, 2, 2}}) {
      // 8 sequences: per device of the data axis 8 / data; micro-batches of one sequence or more.
      const std::size_t mb = shape[0] == 2 ? 2 : 4;
      INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ") micro-batches " << mb << " "
                    << (kind == nn::pipeline_kind::gpipe ? "GPipe" : "1F1B"));
      require_close(gpt_losses(shape, {}, {.schedule = kind, .microbatches = mb}), ref, 1e-5);
    }
}

TEST_CASE("pipeline: the GPT on ('data', 'fsdp', 'tensor', 'pipeline') meshes of 8 devices trains as on one",
          "[nn][pipeline][gpt][mesh4]") {
  const auto ref = gpt4_losses({1, 1, 1, 1});
  CHECK(ref[7] < ref[0] - 0.2);
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (auto shape : {shape4_t{1, 2, 2, 2}, shape4_t{2, 1, 2, 2}, shape4_t{2, 2, 1, 2}, shape4_t{1, 1, 2, 4}}) {
      // 8 sequences over data x fsdp; micro-batches of whole sequences.
      const std::size_t mb = 8 / (shape[0] * shape[1]) >= 4 ? 4 : 2;
      INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ", " << shape[3] << ") micro-batches " << mb
                    << " " << (kind == nn::pipeline_kind::gpipe ? "GPipe" : "1F1B"));
      require_close(gpt4_losses(shape, {}, {.schedule = kind, .microbatches = mb}), ref, 1e-5);
    }
}

TEST_CASE("pipeline: the GPT with every block in remat on 4-axis meshes trains as on one device without remat",
          "[nn][pipeline][gpt][mesh4][remat]") {
  const auto ref = gpt4_losses({1, 1, 1, 1});
  require_close(gpt4_losses({1, 1, 1, 1}, {}, {}, 8, true), ref, 1e-5);
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (auto shape : {shape4_t{1, 2, 2, 2}, shape4_t{2, 1, 2, 2}}) {
      INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ", " << shape[3] << ") remat "
                    << (kind == nn::pipeline_kind::gpipe ? "GPipe" : "1F1B"));
      require_close(gpt4_losses(shape, {}, {.schedule = kind, .microbatches = 2}, 8, true), ref, 1e-5);
    }
}

TEST_CASE("pipeline with FSDP: parameters sharded over 'fsdp' within each stage, the 1-device losses",
          "[nn][pipeline][fsdp][mesh4]") {
  std::vector<double> mlp_ref, gpt_ref;
  {
    const mesh4_t one{1, 1, 1, 1};
    nn::train_state a(one, make_mlp4(one), nn::adam(nn::constant(1e-2f)));
    nn::train_state b(one, untied_gpt4(one), nn::adam(nn::constant(1e-2f)));
    for (std::size_t s = 0; s < 8; ++s) {
      mlp_ref.push_back(mlp_step(a, s));
      gpt_ref.push_back(nn::train_step(b, gpt_windows(s)).loss);
    }
  }
  for (bool keep : {false, true})
    for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
      for (auto shape : {shape4_t{1, 2, 2, 2}, shape4_t{2, 2, 1, 2}, shape4_t{1, 2, 1, 4}}) {
        const mesh4_t m{shape[0], shape[1], shape[2], shape[3]};
        INFO("mesh " << m << (kind == nn::pipeline_kind::gpipe ? " GPipe" : " 1F1B") << " reshard_after_forward "
                     << !keep);
        const nn::fully_shard<"fsdp"> fsdp{.reshard_after_forward = !keep};
        const nn::pipeline<"pipeline"> pipe{.schedule = kind, .microbatches = 2};
        nn::train_state a(m, make_mlp4(m), nn::adam(nn::constant(1e-2f)), fsdp, pipe);
        nn::train_state b(m, untied_gpt4(m), nn::adam(nn::constant(1e-2f)), fsdp, pipe);
        for (std::size_t s = 0; s < 8; ++s) {
          INFO("step " << s);
          CHECK(std::abs(mlp_step(a, s) - mlp_ref[s]) <= 1e-5 * mlp_ref[s]);
          CHECK(std::abs(nn::train_step(b, gpt_windows(s)).loss - gpt_ref[s]) <= 1e-5 * gpt_ref[s]);
        }
        // A device stores a 1/fsdp shard of its own stage's parameters only.
        std::size_t total = 0;
        for (const auto& p : a.params) total += p.count[0];
        CHECK(a.memory(0).parameters == total * sizeof(float));
      }
  // A tied head is refused under FSDP.
  const mesh4_t m{1, 2, 1, 2};
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(m, small_gpt4(m), nn::adam(nn::constant(1e-2f)), nn::fully_shard<"fsdp">{},
                            nn::pipeline<"pipeline">{});
        }).find("FSDP does not shard a tied parameter") != std::string::npos);
}

TEST_CASE("pipeline: a checkpoint of the GPT moves between 4-axis meshes", "[nn][pipeline][gpt][mesh4][checkpoint]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_pipeline_ckpt4_" + std::to_string(::getpid()));
  const auto ref = gpt4_losses({1, 1, 1, 1}, {}, {}, 6);
  for (auto from : {shape4_t{1, 2, 2, 2}, shape4_t{2, 1, 2, 2}}) {
    fs::remove_all(dir);
    const mesh4_t a{from[0], from[1], from[2], from[3]};
    nn::train_state first(a, small_gpt4(a), nn::adam(nn::constant(1e-2f)), nn::data_parallel<"data", "fsdp">{},
                          nn::pipeline<"pipeline">{.microbatches = 2});
    for (std::size_t s = 0; s < 3; ++s) REQUIRE(std::abs(nn::train_step(first, gpt_windows(s)).loss - ref[s]) <= 1e-5 * ref[s]);
    nn::save_checkpoint(dir, first);
    for (auto to : {shape4_t{2, 1, 2, 2}, shape4_t{1, 2, 2, 2}, shape4_t{1, 1, 2, 4}, shape4_t{1, 1, 1, 1}}) {
      const mesh4_t b{to[0], to[1], to[2], to[3]};
      INFO("saved on " << a << ", restored on " << b);
      nn::train_state second(b, small_gpt4(b), nn::adam(nn::constant(1e-2f)), nn::data_parallel<"data", "fsdp">{},
                             nn::pipeline<"pipeline">{.schedule = nn::pipeline_kind::gpipe, .microbatches = 2});
      nn::restore_checkpoint(dir, second);
      for (std::size_t s = 3; s < 6; ++s) {
        INFO("step " << s);
        CHECK(std::abs(nn::train_step(second, gpt_windows(s)).loss - ref[s]) <= 1e-5 * ref[s]);
      }
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("pipeline_plan: each stage runs every micro-batch once each way, after its input arrived, with the "
          "bubble (p - 1) / (m + p - 1)",
          "[nn][pipeline]") {
  constexpr auto none = nn::pipeline_slot::none;
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (std::size_t p = 1; p <= 6; ++p)
      for (std::size_t m = 1; m <= 12; ++m) {
        const nn::pipeline_plan plan(kind, p, m);
        INFO(plan.timeline());
        const auto& rounds = plan.rounds();
        // f[s][j] / b[s][j]: the round stage s runs micro-batch j's forward / backward in.
        std::vector<std::vector<std::size_t>> f(p, std::vector<std::size_t>(m, none)), b = f;
        for (std::size_t r = 0; r < rounds.size(); ++r)
          for (std::size_t st = 0; st < p; ++st) {
            if (const auto j = rounds[r][st].forward; j != none) {
              REQUIRE(f[st][j] == none);
              f[st][j] = r;
            }
            if (const auto j = rounds[r][st].backward; j != none) {
              REQUIRE(b[st][j] == none);
              b[st][j] = r;
            }
          }
        for (std::size_t st = 0; st < p; ++st)
          for (std::size_t j = 0; j < m; ++j) {
            REQUIRE(f[st][j] != none);
            REQUIRE(b[st][j] != none);
            if (st > 0) REQUIRE(f[st][j] > f[st - 1][j]);      // the activation came in an earlier round
            if (st + 1 < p) REQUIRE(b[st][j] > b[st + 1][j]);  // so did the gradient
            REQUIRE(b[st][j] >= f[st][j]);
          }
        // Rounds cost a forward (1) when any stage runs one plus a backward (2) when any runs one.
        CHECK(std::abs(plan.bubble_fraction(1.0, 2.0) - nn::pipeline_schedule::ideal_bubble(p, m)) < 1e-12);
        CHECK(std::abs(plan.bubble_fraction(1.0, 1.0) - nn::pipeline_schedule::ideal_bubble(p, m)) < 1e-12);
        // A backward recomputes unless its stage's last forward was its micro-batch's: under GPipe
        // every one when there are several micro-batches (B0 follows the last forward); under 1F1B
        // never on the last stage.
        for (std::size_t st = 0; st < p; ++st) {
          std::size_t again = 0;
          for (std::size_t r = 0; r < rounds.size(); ++r) again += plan.recomputes(r, st) ? 1 : 0;
          if (kind == nn::pipeline_kind::gpipe) CHECK(again == (m > 1 ? m : 0));
          else if (st + 1 == p) CHECK(again == 0);
        }
        CHECK(plan.bubble_with_recompute(1.0, 2.0) >= plan.bubble_fraction(1.0, 2.0) - 1e-12);
        for (std::size_t st = 0; st < p; ++st)
          CHECK(plan.peak_in_flight(st) == (kind == nn::pipeline_kind::gpipe ? m : std::min(2 * (p - st) - 1, m)));
      }
  CHECK(nn::pipeline_plan(nn::pipeline_kind::gpipe, 2, 2).timeline() ==
        "GPipe, 2 stages x 2 micro-batches, 5 rounds\n"
        "stage 0 | F0 .. F1 .. .. .. .. B0 .. B1\n"
        "stage 1 | .. .. F0 .. F1 B0 .. B1 .. ..\n");
  CHECK(nn::pipeline_plan(nn::pipeline_kind::one_f_one_b, 2, 3).timeline() ==
        "1F1B, 2 stages x 3 micro-batches, 5 rounds\n"
        "stage 0 | F0 .. F1 .. F2 B0 .. B1 .. B2\n"
        "stage 1 | .. .. F0 B0 F1 B1 F2 B2 .. ..\n");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([] { nn::pipeline_plan(nn::pipeline_kind::gpipe, 2, 0); }) ==
        "meshlib::nn::pipeline_plan: 2 stages x 0 micro-batches; a pipeline needs at least one of each");
}

TEST_CASE("pipeline_stages: balanced by parameter count (the smallest largest stage), or at the split points",
          "[nn][pipeline]") {
  using bounds = std::vector<std::pair<std::size_t, std::size_t>>;
  CHECK(nn::pipeline_stages({10, 10, 10, 10}, 2) == bounds{{0, 2}, {2, 4}});
  CHECK(nn::pipeline_stages({1, 1, 1, 1, 1, 1}, 3) == bounds{{0, 2}, {2, 4}, {4, 6}});
  CHECK(nn::pipeline_stages({40, 10, 10, 10, 10}, 2) == bounds{{0, 1}, {1, 5}});
  CHECK(nn::pipeline_stages({5, 0, 7, 0, 3}, 5) == bounds{{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}});
  CHECK(nn::pipeline_stages({5, 0, 7, 0, 3}, 2, {3}) == bounds{{0, 3}, {3, 5}});
  // Against every split of random layer sizes: no split has a smaller largest stage.
  std::uint64_t seed = 7;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::size_t> sizes(3 + trial % 5);
    for (auto& v : sizes) v = (seed = seed * 6364136223846793005ull + 1442695040888963407ull) >> 58;
    const std::size_t p = 1 + trial % 3;
    if (p > sizes.size()) continue;
    const auto got = nn::pipeline_stages(sizes, p);
    const auto largest = [&](const bounds& bs) {
      std::size_t w = 0;
      for (auto [b, e] : bs) {
        std::size_t t = 0;
        for (std::size_t i = b; i < e; ++i) t += sizes[i];
        w = std::max(w, t);
      }
      return w;
    };
    std::size_t best = static_cast<std::size_t>(-1);
    const std::size_t n = sizes.size();
    for (std::size_t mask = 0; mask < (std::size_t{1} << (n - 1)); ++mask) {  // cut after layer i when bit i
      if (static_cast<std::size_t>(__builtin_popcountll(mask)) != p - 1) continue;
      bounds bs;
      std::size_t begin = 0;
      for (std::size_t i = 0; i + 1 < n; ++i)
        if (mask >> i & 1) {
          bs.push_back({begin, i + 1});
          begin = i + 1;
        }
      bs.push_back({begin, n});
      best = std::min(best, largest(bs));
    }
    INFO("trial " << trial);
    REQUIRE(got.size() == p);
    REQUIRE(got.front().first == 0);
    REQUIRE(got.back().second == n);
    for (std::size_t i = 0; i < p; ++i) REQUIRE(got[i].first < got[i].second);
    for (std::size_t i = 1; i < p; ++i) REQUIRE(got[i].first == got[i - 1].second);
    REQUIRE(largest(got) == best);
  }
}

TEST_CASE("pipeline: each device holds, and keeps optimizer state for, only its stage's parameters",
          "[nn][pipeline]") {
  const mesh_t one{1, 1, 1}, m{2, 1, 2};
  nn::train_state ref(one, make_mlp(one), nn::adam(nn::constant(1e-2f)));
  nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), nn::pipeline<"pipeline">{.split_points = {2}});
  REQUIRE(state.pipeline_stages() == std::vector<std::pair<std::size_t, std::size_t>>{{0, 2}, {2, 5}});
  // fc1 (layer 0) on stage 0, fc2 and fc3 (layers 2 and 4) on stage 1; device d is at stage d % 2.
  for (std::size_t i = 0; i < state.params.size(); ++i)
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      INFO(state.params[i].name << " device " << dev);
      const bool mine = (i < 2) == (dev % 2 == 0);
      CHECK(state.params[i].count[dev] == (mine ? ref.params[i].count[0] : 0));
      CHECK((state.params[i].value[dev] != nullptr) == mine);  // the layers' storage elsewhere is gone
      CHECK((state.params[i].grad[dev] != nullptr) == mine);
    }
  std::size_t first = 0, second = 0;
  for (std::size_t i = 0; i < ref.params.size(); ++i) (i < 2 ? first : second) += ref.params[i].count[0];
  CHECK(state.optimizer_state_size(0) == 2 * first);  // adam: two slots
  CHECK(state.optimizer_state_size(1) == 2 * second);
  CHECK(state.memory(0).parameters == first * sizeof(float));
  CHECK(state.memory(1).parameters + state.memory(0).parameters == ref.memory(0).parameters);
}

TEST_CASE("pipeline: a GPT checkpoint saved on one pipeline shape continues on others and on one device",
          "[nn][pipeline][gpt][checkpoint]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_pipeline_ckpt_" + std::to_string(::getpid()));
  const auto opts = [](std::size_t mb, nn::pipeline_kind k) { return nn::pipeline<"pipeline">{.schedule = k, .microbatches = mb}; };
  std::vector<double> ref;
  {
    const mesh_t one{1, 1, 1};
    nn::train_state r(one, small_gpt(one), nn::adam(nn::constant(1e-2f)));
    for (std::size_t s = 0; s < 6; ++s) ref.push_back(nn::train_step(r, gpt_windows(s)).loss);
  }
  for (auto from : {shape_t{1, 1, 2}, shape_t{1, 1, 1}, shape_t{2, 1, 2}}) {
    fs::remove_all(dir);
    const mesh_t a{from[0], from[1], from[2]};
    nn::train_state first(a, small_gpt(a), nn::adam(nn::constant(1e-2f)), opts(2, nn::pipeline_kind::gpipe));
    for (std::size_t s = 0; s < 3; ++s) REQUIRE(std::abs(nn::train_step(first, gpt_windows(s)).loss - ref[s]) <= 1e-5 * ref[s]);
    nn::save_checkpoint(dir, first);
    for (auto to : {shape_t{1, 1, 4}, shape_t{2, 1, 2}, shape_t{1, 2, 2}, shape_t{1, 1, 1}}) {
      const mesh_t b{to[0], to[1], to[2]};
      INFO("saved on " << a << ", restored on " << b);
      nn::train_state second(b, small_gpt(b), nn::adam(nn::constant(1e-2f)), opts(2, nn::pipeline_kind::one_f_one_b));
      nn::restore_checkpoint(dir, second);
      CHECK(second.step == 3);
      for (std::size_t s = 3; s < 6; ++s) {
        INFO("step " << s);
        CHECK(std::abs(nn::train_step(second, gpt_windows(s)).loss - ref[s]) <= 1e-5 * ref[s]);
      }
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("pipeline: bad stages, micro-batches and options are refused with the fix", "[nn][pipeline]") {
  using meshlib_test::message_of;
  const auto make = [](shape_t shape, const nn::pipeline<"pipeline">& pipe) {
    const mesh_t m{shape[0], shape[1], shape[2]};
    nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), pipe);
  };
  // More stages than layers (the MLP has five).
  CHECK(message_of<meshlib::sharding_error>([&] {
          const mesh_t m{1, 1, 6};
          nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), nn::pipeline<"pipeline">{});
        }) ==
        "meshlib::nn: pipeline: the mesh's 'pipeline' axis has 6 devices (one stage each) but the model has 5 layers; "
        "a stage needs at least one layer: use a pipeline axis of at most 5 devices or a model with more layers");
  // Split points that do not fit the mesh, do not increase, or lie outside the model.
  CHECK(message_of<meshlib::sharding_error>([&] { make({1, 1, 4}, {.split_points = {2}}); }) ==
        "meshlib::nn: pipeline: split_points {2} make 2 stages but the mesh's 'pipeline' axis has 4 devices (one stage "
        "each); give 3 split points, or none to balance the stages by parameter count");
  CHECK(message_of<meshlib::sharding_error>([&] { make({1, 1, 3}, {.split_points = {3, 2}}); }) ==
        "meshlib::nn: pipeline: split_points {3, 2} must be strictly increasing layer indices in [1, 4] (the first "
        "layer of each stage after the first, for a model of 5 layers); split point 1 is 2");
  CHECK(message_of<meshlib::sharding_error>([&] { make({1, 1, 3}, {.split_points = {2, 2}}); }) ==
        "meshlib::nn: pipeline: split_points {2, 2} must be strictly increasing layer indices in [1, 4] (the first "
        "layer of each stage after the first, for a model of 5 layers); split point 1 is 2");
  CHECK(message_of<meshlib::sharding_error>([&] { make({1, 1, 2}, {.split_points = {5}}); }) ==
        "meshlib::nn: pipeline: split_points {5} must be strictly increasing layer indices in [1, 4] (the first "
        "layer of each stage after the first, for a model of 5 layers); split point 0 is 5");
  CHECK(message_of<meshlib::sharding_error>([&] { make({1, 1, 2}, {.split_points = {0}}); }) ==
        "meshlib::nn: pipeline: split_points {0} must be strictly increasing layer indices in [1, 4] (the first "
        "layer of each stage after the first, for a model of 5 layers); split point 0 is 0");
  // Micro-batches that do not divide a device's rows: 16 rows over data 2 is 8 per device.
  const mesh_t m{2, 1, 2};
  nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), nn::pipeline<"pipeline">{.microbatches = 3});
  CHECK(message_of<meshlib::sharding_error>([&] { mlp_step(state, 0); }) ==
        "meshlib::nn: train_step: the pipeline's 3 micro-batches do not divide the 8 rows each device of the data "
        "axes gets (a global batch of 16 rows over 2 devices); choose pipeline.microbatches dividing 8, or a batch of "
        "a multiple of 6 rows");
  CHECK(state.step == 0);
}

}  // namespace MESHLIB_TEST_UNIT
