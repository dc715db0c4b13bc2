// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `trace(decay)` (optax's): heavy-ball momentum, `m = decay m + update; update = m`; one
/// state slot. `nn::sgd` is `chain(trace(momentum), scale_by_learning_rate(lr))`.

#include <array>
#include <cstddef>
#include <string>

#include "meshlib/nn/detail/number_text.hpp"
#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief See the file comment.
struct trace {
  float decay = 0.9f;  ///< the momentum

  [[nodiscard]] std::size_t slots() const noexcept { return 1; }
  [[nodiscard]] std::string name() const { return "trace(" + detail::number_text(decay) + ")"; }
  [[nodiscard]] std::string kind() const { return "trace"; }
  using step_type = detail::trace_step;
  [[nodiscard]] std::array<float, 1> constants(const update_run&) const { return {decay}; }
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
