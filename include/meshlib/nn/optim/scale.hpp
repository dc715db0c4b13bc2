// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Scaling transforms: `scale(c)`, `scale_by_schedule(f)` with any callable `f(step) ->
/// float` (optax's `scale_by_schedule`) and `scale_by_learning_rate(lr)`, which multiplies by
/// `-lr(step)` so that the train state's `param += update` descends (optax's convention).
/// @code
/// auto lr = meshlib::nn::scale_by_learning_rate([](std::size_t step) { return 1e-3f / std::sqrt(step + 1.0f); });
/// auto tx = meshlib::nn::chain(meshlib::nn::scale_by_adam(), lr);
/// @endcode

#include <array>
#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/nn/schedule.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief A function of the step (0-based) to a float: a number, `nn::schedule` or any callable.
using step_function = std::function<float(std::size_t)>;

/// @brief `update *= factor(step)`, no state (optax's `scale_by_schedule`; `scale` for a number).
class scale_by_schedule {
 public:
  /// Multiplies by `f(step)`; a number is a constant.
  template <class F>
    requires std::is_invocable_r_v<float, const F&, std::size_t>
  explicit scale_by_schedule(F f, std::string name = "scale_by_schedule") : f_(std::move(f)), name_(std::move(name)) {}
  /// Multiplies by `c` at every step.
  explicit scale_by_schedule(float c) : f_(schedule(c)), name_("scale(" + detail::number_text(c) + ")") {}

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return name_; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_schedule"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::scale_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {f_(r.step)}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }

 private:
  step_function f_;
  std::string name_;
};

/// @brief `update *= c` (optax's `scale`).
inline scale_by_schedule scale(float c) { return scale_by_schedule(c); }

/// @brief `update *= -lr(step)` (optax's `scale_by_learning_rate`): `lr` a number, an
/// `nn::schedule` (`warmup_cosine`, ...) or any callable `float(std::size_t step)`.
class scale_by_learning_rate {
 public:
  /// The rate `lr` (a number, a schedule or any callable of the step).
  template <class F>
    requires std::is_invocable_r_v<float, const F&, std::size_t>
  explicit scale_by_learning_rate(F lr) : lr_(std::move(lr)) {}
  /// A constant rate.
  explicit scale_by_learning_rate(float lr) : lr_(schedule(lr)) {}

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_learning_rate"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_learning_rate"; }
  /// The rate at `step`.
  [[nodiscard]] float rate(std::size_t step) const { return lr_(step); }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::scale_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {-lr_(r.step)}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }

 private:
  step_function lr_;
};

}  // namespace meshlib::nn
