// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief An in-memory classification data set: `count` examples of `features` floats each and one
/// integer label per example.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace meshlib::nn {

/// @brief A classification data set held in memory, row-major: example `i` is
/// `x[i * features, (i + 1) * features)` and its label is `y[i]`, in `[0, classes)`.
///
/// @code
/// meshlib::nn::dataset ds = meshlib::nn::read_idx("train-images-idx3-ubyte.gz",
///                                                 "train-labels-idx1-ubyte.gz");
/// std::span<const float> first = ds.row(0);   // 784 pixels scaled to [0, 1]
/// int label = ds.y[0];
/// @endcode
struct dataset {
  std::size_t count = 0;     ///< number of examples
  std::size_t features = 0;  ///< floats per example (28 * 28 = 784 for Fashion-MNIST)
  std::size_t classes = 0;   ///< labels are in [0, classes)
  std::vector<float> x{};         ///< count * features values, row-major; IDX pixels scaled to [0, 1]
  std::vector<std::int32_t> y{};  ///< count labels

  /// @brief The features of example `i`.
  [[nodiscard]] std::span<const float> row(std::size_t i) const noexcept {
    return {x.data() + i * features, features};
  }
};

}  // namespace meshlib::nn
