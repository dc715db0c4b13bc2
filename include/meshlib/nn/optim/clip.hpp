// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `clip_by_global_norm(max_norm)` (optax's, PyTorch's `clip_grad_norm_`): scales every
/// update by `max_norm / norm` when the norm of all of them together exceeds `max_norm`. The norm
/// is over every parameter and every device, each element counted once (the train state sums the
/// squares over the mesh, `update_run::global_norm`), so it is the same on any sharding.
/// @code
/// auto opt = meshlib::nn::chain(meshlib::nn::clip_by_global_norm(1.0f), meshlib::nn::adamw(3e-4f, 0.1f));
/// @endcode

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief See the file comment.
class clip_by_global_norm {
 public:
  /// Clips to `max_norm` (> 0).
  /// @throws std::invalid_argument when `max_norm` is not positive.
  explicit clip_by_global_norm(float max_norm) : max_norm_(max_norm) {
    if (!(max_norm > 0.0f))
      throw std::invalid_argument("meshlib::nn: clip_by_global_norm: max_norm is " + detail::number_text(max_norm) +
                                  "; it must be positive (leave the transform out to not clip)");
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// True: the stage reads `update_run::global_norm`, the updates' norm over every device.
  [[nodiscard]] bool reads_global_norm(std::size_t) const noexcept { return true; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "clip_by_global_norm(" + detail::number_text(max_norm_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "clip_by_global_norm"; }
  /// The factor for updates of norm `norm`: `max_norm / norm` when larger, else 1.
  [[nodiscard]] float factor(double norm) const noexcept {
    return norm > max_norm_ ? static_cast<float>(max_norm_ / norm) : 1.0f;
  }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::scale_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {factor(r.global_norm)}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if (factor(r.global_norm) != 1.0f) detail::run_step(*this, r);
  }

 private:
  float max_norm_;
};

}  // namespace meshlib::nn
