// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `trace(decay)` (optax's): heavy-ball momentum, `m = decay m + update; update = m`; one
/// state slot. `nn::sgd` is `chain(trace(momentum), scale_by_learning_rate(lr))`.

#include <array>
#include <cstddef>
#include <string>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief See the file comment.
struct trace {
  float decay = 0.9f;  ///< the momentum

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 1; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "trace(" + detail::number_text(decay) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "trace"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::trace_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run&) const { return {decay}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
