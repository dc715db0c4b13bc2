// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `add_decayed_weights(wd, mask)` (optax's): `update += wd * param` on the parameters of
/// `mask` (default: those whose layer marks them for decay, `decay_mask()`). Before the learning
/// rate in a chain, this is AdamW's decoupled weight decay.
/// @code
/// auto no_norms = [](std::string_view name) { return !name.ends_with(".scale"); };
/// auto tx = meshlib::nn::add_decayed_weights(1e-4f, no_norms);
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <utility>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief See the file comment.
class add_decayed_weights {
 public:
  /// Decay `weight_decay` on the parameters of `mask`.
  explicit add_decayed_weights(float weight_decay, param_mask mask = decay_mask())
      : wd_(weight_decay), mask_(std::move(mask)) {}
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "add_decayed_weights(" + detail::number_text(wd_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "add_decayed_weights"; }
  /// The decay rate.
  [[nodiscard]] float weight_decay() const noexcept { return wd_; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::decay_step;
  /// Fused into a chain's kernel, a parameter outside the mask decays by 0 (`update + 0 * param`,
  /// which is `update` for any finite parameter; the fused AdamW kernel did the same).
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {mask_(r.param) ? wd_ : 0.0f}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if (mask_(r.param)) detail::run_step(*this, r);
  }

 private:
  float wd_;
  param_mask mask_;
};

}  // namespace meshlib::nn
