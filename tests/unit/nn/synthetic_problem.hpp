// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// A learnable synthetic classification problem shared by the training tests: the class of a row is
// the argmax of `classes` fixed projections of its features.
#include <meshlib/nn.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace meshlib_test {

inline meshlib::nn::dataset synthetic_problem(std::size_t count, std::size_t features, std::size_t classes) {
  meshlib::nn::dataset ds;
  ds.count = count;
  ds.features = features;
  ds.classes = classes;
  ds.x.resize(count * features);
  ds.y.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    double best = -1e9;
    for (std::size_t f = 0; f < features; ++f)
      ds.x[i * features + f] = static_cast<float>(0.5 + 0.5 * std::sin(1.7 * static_cast<double>(i * features + f) + 0.3));
    for (std::size_t c = 0; c < classes; ++c) {
      double s = 0;
      for (std::size_t f = 0; f < features; ++f) s += ds.x[i * features + f] * std::cos(static_cast<double>(c * 7 + f));
      if (s > best) {
        best = s;
        ds.y[i] = static_cast<std::int32_t>(c);
      }
    }
  }
  return ds;
}

}  // namespace meshlib_test
