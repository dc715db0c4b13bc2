// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// The small MLP the pipeline tests share (test_pipeline.cpp, test_pipeline_more.cpp) on a
// ('data', 'model', 'pipeline') mesh, and the data it learns: written once, so that both files cut
// the same five layers into stages and compare them with the same one-device run.
#include <meshlib/nn.hpp>

#include <array>
#include <cstddef>
#include <utility>

#include "synthetic_problem.hpp"

namespace meshlib_test::pipeline_mlp {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">, meshlib::axis<"pipeline">>;
using shape_t = std::array<std::size_t, 3>;

inline constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 16;

/// Five layers (three with parameters): enough for four stages.
inline auto make_mlp(const mesh_t& m) {
  namespace nn = meshlib::nn;
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key));
}
using mlp_t = decltype(make_mlp(std::declval<const mesh_t&>()));

/// 20 batches of `batch` rows.
inline const meshlib::nn::dataset& data() {
  static const meshlib::nn::dataset ds = synthetic_problem(batch * 20, features, classes);
  return ds;
}

}  // namespace meshlib_test::pipeline_mlp
