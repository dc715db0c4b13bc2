// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How built-in transforms share one kernel: a transform with a `step_type` (an elementwise
/// step of optim/detail/kernels.hpp) and its `constants(run)` is `fusable`; a chain of fusable
/// transforms runs their steps as one kernel (optim/chain.hpp), and its last stage adds the result
/// to the parameter in that same pass (`update_and_apply`). A transform without them (a user's)
/// runs on its own, and the parameter is updated by a pass of its own.

#include <array>
#include <cstddef>

#include "meshlib/nn/optim/detail/kernels.hpp"
#include "meshlib/nn/optim/transform.hpp"

namespace meshlib::nn::detail {

/// A transform whose update is one elementwise step.
template <class T>
concept fusable = requires(const T& t, const update_run& r) {
  typename T::step_type;
  { t.constants(r) } -> std::same_as<std::array<float, T::step_type::constants>>;
};

/// `t`'s step alone over the run.
template <fusable T>
void run_step(const T& t, const update_run& r) {
  using step = typename T::step_type;
  std::array<float, 1 + step::constants> k{};
  const auto kt = t.constants(r);
  for (std::size_t j = 0; j < step::constants; ++j) k[1 + j] = kt[j];
  run_steps<false, step>(r.updates, r.params, nullptr, r.state.data(), r.size, k);
}

/// `t.update(r)`, then `params += updates`: in one pass where `t` can (`update_and_apply`).
template <class T>
void update_and_apply_of(const T& t, const update_run& r, float* params) {
  if constexpr (requires { t.update_and_apply(r, params); }) {
    t.update_and_apply(r, params);
  } else {
    t.update(r);
    apply_updates(params, r.updates, r.size);
  }
}

}  // namespace meshlib::nn::detail
