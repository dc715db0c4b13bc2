// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Learning-rate schedules (optax's `constant_schedule`, `linear_schedule` warm-up and
/// `warmup_cosine_decay_schedule`): a pure function of the step, so every device computes the same.
/// @code
/// auto lr = meshlib::nn::warmup_cosine(1e-3f, 100, 1000);   // 0 -> 1e-3 over 100 steps, cosine to 0 at 1000
/// float now = lr(250);
/// @endcode

#include <cmath>
#include <cstddef>

namespace meshlib::nn {

/// @brief `lr(step)`: `peak` after a linear warm-up of `warmup` steps, then constant (`total == 0`)
/// or a cosine decay to `peak * final_fraction` at step `total`. A plain number converts to the
/// constant schedule, as optax takes a float wherever it takes a schedule: `adam(1e-3f)` is
/// `adam(constant(1e-3f))`.
struct schedule {
  /// The default: a constant 1e-3.
  constexpr schedule() noexcept = default;
  /// The constant rate `lr` (implicit: a number is a schedule).
  constexpr schedule(float lr) noexcept : peak(lr), final_fraction(1.0f) {}  // NOLINT(google-explicit-constructor)
  /// Every field, in declaration order.
  constexpr schedule(float peak_, std::size_t warmup_, std::size_t total_, float final_fraction_) noexcept
      : peak(peak_), warmup(warmup_), total(total_), final_fraction(final_fraction_) {}

  /// The learning rate after warm-up.
  float peak = 1e-3f;
  /// Steps of linear warm-up from `peak / warmup` to `peak`.
  std::size_t warmup = 0;
  /// The step where the cosine decay ends (0: no decay).
  std::size_t total = 0;
  /// The final rate as a fraction of `peak`.
  float final_fraction = 0.0f;

  /// The learning rate at `step` (counted from 0).
  [[nodiscard]] float operator()(std::size_t step) const noexcept {
    if (step < warmup) return peak * static_cast<float>(step + 1) / static_cast<float>(warmup);
    if (total == 0) return peak;
    if (step >= total) return peak * final_fraction;
    const double t = static_cast<double>(step - warmup) / static_cast<double>(total > warmup ? total - warmup : 1);
    const double c = 0.5 * (1.0 + std::cos(3.141592653589793 * t));
    return static_cast<float>(peak * (final_fraction + (1.0 - final_fraction) * c));
  }
};

/// @brief A constant rate (`optax.constant_schedule`).
inline schedule constant(float lr) { return schedule{lr, 0, 0, 1.0f}; }
/// @brief A linear warm-up to `lr` over `warmup` steps, then constant.
inline schedule linear_warmup(float lr, std::size_t warmup) { return schedule{lr, warmup, 0, 1.0f}; }
/// @brief Linear warm-up, then cosine decay to 0 at `total` (`optax.warmup_cosine_decay_schedule`).
inline schedule warmup_cosine(float lr, std::size_t warmup, std::size_t total, float final_fraction = 0.0f) {
  return schedule{lr, warmup, total, final_fraction};
}

}  // namespace meshlib::nn
