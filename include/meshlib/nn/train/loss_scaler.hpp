// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `loss_scaler`: dynamic loss scaling (PyTorch's `GradScaler`): the loss is multiplied by
/// the scale before backward and the summed gradients divided by it; a step whose gradients hold an
/// inf or NaN on any device is skipped on every device and halves the scale, and `growth_interval`
/// good steps in a row double it. A `train_state` holds one (`train_options::loss_scale`).
/// @code
/// meshlib::nn::loss_scaler s(0.0f, true);   // float16 compute: on, from 32768
/// const bool counts = s.update(skipped, 2000);  // after each step, with every device's verdict
/// @endcode

#include <algorithm>
#include <cstddef>

#include "meshlib/nn/precision.hpp"

namespace meshlib::nn {

/// @brief Dynamic loss scaling's state and rules (see the file comment).
class loss_scaler {
 public:
  /// Off: a scale of 1.
  loss_scaler() = default;
  /// `initial > 0`: on, from that scale; 0: on from 32768 when `needed` (a float16 compute type),
  /// off otherwise.
  loss_scaler(float initial, bool needed) noexcept
      : scale_(initial > 0 ? initial : (needed ? 32768.0f : 1.0f)), on_(initial > 0 || needed) {}

  /// The current scale (1 when off).
  [[nodiscard]] float scale() const noexcept { return scale_; }
  /// Whether loss scaling is on.
  [[nodiscard]] bool enabled() const noexcept { return on_; }
  /// Consecutive good steps since the scale last changed.
  [[nodiscard]] std::size_t good_steps() const noexcept { return good_steps_; }

  /// After a step, with every device's verdict (equal on all of them): on a skipped step halves the
  /// scale (not below 2^-16) and returns false; otherwise counts the good step, doubles the scale
  /// after `growth_interval` of them, and returns true (the step counts). Off: always true.
  bool update(bool skipped, std::size_t growth_interval) noexcept {
    if (!on_) return true;
    if (skipped) {
      scale_ = std::max(scale_ * 0.5f, 1.0f / 65536.0f);
      good_steps_ = 0;
      return false;
    }
    if (++good_steps_ >= growth_interval) {
      scale_ *= 2.0f;
      good_steps_ = 0;
    }
    return true;
  }
  /// Divides the `n` gradients at `g` by the scale (nothing when off or at 1).
  void unscale(float* g, std::size_t n) const noexcept {
    if (on_ && scale_ != 1.0f) detail::scale_in_place(g, n, 1.0f / scale_);
  }

 private:
  float scale_ = 1.0f;
  bool on_ = false;
  std::size_t good_steps_ = 0;
};

}  // namespace meshlib::nn
