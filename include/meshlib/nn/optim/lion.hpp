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

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 1; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_lion"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_lion"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::lion_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 4> constants(const update_run&) const { return {b1, 1.0f - b1, b2, 1.0f - b2}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
