// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `scale_by_lion(b1, b2)` (optax's; Chen et al. 2023, "Symbolic Discovery of Optimization
/// Algorithms"): `update = sign(b1 m + (1 - b1) g)`, then `m = b2 m + (1 - b2) g`; one state slot.
/// `nn::lion` is `chain(scale_by_lion(...), add_decayed_weights(wd), scale_by_learning_rate(lr))`.

#include <array>
#include <cstddef>
#include <string>

#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief See the file comment.
struct scale_by_lion {
  float b1 = 0.9f;   ///< the interpolation of the sign's argument
  float b2 = 0.99f;  ///< decay rate of the momentum

  [[nodiscard]] std::size_t slots() const noexcept { return 1; }
  [[nodiscard]] std::string name() const { return "scale_by_lion"; }
  [[nodiscard]] std::string kind() const { return "scale_by_lion"; }
  using step_type = detail::lion_step;
  [[nodiscard]] std::array<float, 4> constants(const update_run&) const { return {b1, 1.0f - b1, b2, 1.0f - b2}; }
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
