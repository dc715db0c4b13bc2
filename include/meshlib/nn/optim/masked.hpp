// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `masked(inner, mask)` (optax's `masked`): `inner` on the parameters of `mask`, the others'
/// updates passed through unchanged. Its state is `inner`'s, held for every parameter (the train
/// state's slots are per element of all of them) and left at zero where the mask is false.
/// @code
/// namespace nn = meshlib::nn;
/// auto embeddings = [](std::string_view name) { return name.starts_with("embed"); };
/// auto tx = nn::chain(nn::masked(nn::scale(0.1f), embeddings), nn::scale_by_learning_rate(1e-3f));
/// @endcode

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include "meshlib/nn/optim/transform.hpp"

namespace meshlib::nn {

/// @brief The transform `masked` returns (see the file comment).
template <gradient_transform T>
class masked_transform {
 public:
  /// `inner` where `mask` holds.
  /// @throws std::invalid_argument when `inner` reads the global norm (a clip): that norm is over
  /// every parameter, which a mask cannot restrict.
  masked_transform(T inner, param_mask mask) : inner_(std::move(inner)), mask_(std::move(mask)) {
    for (std::size_t s = 0; s < detail::stages_of(inner_); ++s)
      if (detail::reads_global_norm_of(inner_, s))
        throw std::invalid_argument("meshlib::nn: masked: " + detail::name_of(inner_) +
                                    " reads the global norm of every parameter's updates, which a mask cannot "
                                    "restrict; put it outside masked, in the chain");
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const { return inner_.slots(); }
  /// Floats of per-parameter state for `p`: `inner`'s (kept for every parameter, as its slots).
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const {
    return detail::param_state_size_of(inner_, p);
  }
  /// How many stages `update` runs in (the train state runs each over every run before the next).
  [[nodiscard]] std::size_t stages() const { return detail::stages_of(inner_); }
  /// Whether `inner` reads statistics of whole parameters (`adafactor`).
  [[nodiscard]] bool whole_parameters() const { return detail::whole_parameters_of(inner_); }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "masked(" + detail::name_of(inner_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "masked(" + detail::kind_of(inner_) + ")"; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if (mask_(r.param)) inner_.update(r);
  }

 private:
  T inner_;
  param_mask mask_;
};

/// @brief `inner` on the parameters of `mask` only (see the file comment).
template <class T>
auto masked(T inner, param_mask mask) {
  if constexpr (gradient_transform<T>) {
    return masked_transform<T>(std::move(inner), std::move(mask));
  } else {
    (void)detail::diagnose_gradient_transform<T>();
    return detail::not_a_transform{};
  }
}

}  // namespace meshlib::nn
