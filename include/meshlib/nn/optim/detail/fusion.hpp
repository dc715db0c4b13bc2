// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How built-in transforms share one kernel: a transform with a `step_type` (an elementwise
/// step of optim/detail/kernels.hpp) and its `constants(run)` is `fusable`; a chain of fusable
/// transforms runs their steps as one kernel (optim/chain.hpp), and its last stage adds the result
/// to the parameter in that same pass (`update_and_apply`). A transform without them (a user's)
/// runs on its own, and the parameter is updated by a pass of its own.
///
/// The train state hands the last stage every run of a device at once (`update_batch`): a chain of
/// fusable transforms updates and applies them all in one multi-tensor kernel (a run table, as the
/// gradient norm's), other transforms run by run (`update_and_apply_all_of`).

#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "meshlib/nn/buffers.hpp"
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

/// Every run of one device in the last stage of a step, updated and applied together: `runs[i]`'s
/// updates are added to `params[i]`. `tables` and `words` (device `dev`'s) hold the run table a
/// multi-tensor kernel reads (`run_table_buffers`: copied to the device only when it changed).
struct update_batch {
  std::span<const update_run> runs;    ///< the runs, none overlapping another
  std::span<float* const> params;      ///< per run: where its updates are added
  run_table_buffers* tables = nullptr;  ///< the device's table in the kernels' memory
  std::vector<std::size_t>* words = nullptr;  ///< the device's table on the host (scratch)
  std::size_t dev = 0;                 ///< the device
};

/// `t.update_and_apply_all(b)` where `t` has it (a chain of fusable transforms: one kernel), else
/// `update_and_apply_of` run by run.
template <class T>
void update_and_apply_all_of(const T& t, const update_batch& b) {
  if constexpr (requires { t.update_and_apply_all(b); }) {
    t.update_and_apply_all(b);
  } else {
    for (std::size_t i = 0; i < b.runs.size(); ++i) update_and_apply_of(t, b.runs[i], b.params[i]);
  }
}

}  // namespace meshlib::nn::detail
