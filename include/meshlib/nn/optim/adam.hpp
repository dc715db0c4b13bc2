// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `scale_by_adam(b1, b2, eps)` (optax's): Adam's bias-corrected moment ratio
/// `m_hat / (sqrt(v_hat) + eps)`, two state slots per element (first and second moments).
/// `nn::adam` is `chain(scale_by_adam(...), scale_by_learning_rate(lr))`.

#include <array>
#include <cmath>
#include <cstddef>
#include <string>

#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief See the file comment.
struct scale_by_adam {
  float b1 = 0.9f;    ///< decay rate of the first moment (the gradient's running mean)
  float b2 = 0.999f;  ///< decay rate of the second moment (the squared gradient's running mean)
  float eps = 1e-8f;  ///< added to the denominator's square root so the update stays finite

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 2; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_adam"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_adam"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::adam_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 7> constants(const update_run& r) const {
    // The bias corrections 1 / (1 - b^t), in double as the fused kernel before them did.
    const double t = static_cast<double>(r.step + 1);
    const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), t)));
    const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
    return {b1, 1.0f - b1, b2, 1.0f - b2, c1, c2, eps};
  }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
