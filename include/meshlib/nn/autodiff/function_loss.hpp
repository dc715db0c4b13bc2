// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `function_loss(f)`: a regression loss written as plain forward code, as a JAX user writes
/// `loss_fn` and takes `jax.value_and_grad` of it: `f(z, t, global_batch)` over a device's block of
/// the model output `z` (traced) and its targets `t` (a constant tensor of `z`'s type: one float
/// target per output column) returns the mean loss over the *global* batch, one value every device
/// agrees on (reduced over the data axes with `nn::psum`, as `value_and_grad` requires). The
/// result is a `loss_function` (nn/loss_function.hpp) that `train_step` takes like the built-in
/// losses: its gradient with respect to `z` comes from the tape (nn/autodiff/value_and_grad.hpp).
/// @code
/// auto mse = meshlib::nn::function_loss([](const auto& z, const auto& t, std::size_t batch) {
///   auto d = z - t;                                           // (rows, F), rows sharded over 'data'
///   return meshlib::nn::psum<"data">(meshlib::nn::sum<0>(meshlib::nn::sum<1>(meshlib::nn::square(d)))) *
///          (1.0f / static_cast<float>(batch * F));             // mean over the global batch and F
/// });
/// auto m = meshlib::nn::train_step(state, x, targets, rows, 0, rows, mse);
/// @endcode
/// The output's columns must be complete (not sharded over a model axis: the last layer of a
/// tensor-parallel model is a `row_dense` or replicated); a step's loss is the value `f` returns,
/// added over the micro-batches of an accumulated step.

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/autodiff/value_and_grad.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief A loss of float targets written as forward code `F` (see the file comment).
template <class F>
struct function_loss {
  /// One float target per output column, row-major (as `mean_squared_error`).
  using target_type = float;
  /// `f(z, t, global_batch)`: the mean loss over the global batch (see the file comment).
  F f;

  /// The loss computed by `fn`.
  explicit function_loss(F fn) : f(std::move(fn)) {}

  /// This device's rows' share of the value `f` returns, and `grad = d value / d output` of this
  /// device's block (from the tape).
  /// @throws sharding_error when the targets are not one per output element of this device's rows.
  template <local_tensor_type Z>
  double operator()(const Z& z, std::span<const float> targets, std::size_t global_batch, Z& grad) const {
    static_assert(Z::dims_type::at(1) == 0 && Z::partial == 0,
                  "meshlib::nn: function_loss takes complete output rows: the model's last layer leaves its "
                  "columns sharded over a model axis (or a pending sum); end the model with a row_dense or a "
                  "replicated layer");
    using T = typename Z::value_type;
    using Space = typename Z::memory_space;
    const std::size_t rows = z.extent(0), cols = z.extent(1);
    if (targets.size() != rows * cols)
      throw sharding_error("meshlib::nn: function_loss: device " + std::to_string(z.device()) + " received " +
                           std::to_string(targets.size()) + " targets for its " + std::to_string(rows) + " rows of " +
                           std::to_string(cols) + " outputs; pass one float target per output column of every row");
    Z t(std::array<std::size_t, 2>{rows, cols}, z.mesh(), z.device());
    if constexpr (std::is_same_v<T, float>) {
      meshlib::copy_from_host<Space>(t.data(), targets.data(), targets.size());
    } else {
      std::vector<T> converted(targets.begin(), targets.end());
      meshlib::copy_from_host<Space>(t.data(), converted.data(), converted.size());
    }
    const auto vg = value_and_grad([&](const auto& zs) { return f(zs, t, global_batch); })(z);
    // (A kernel of nn's, not a lambda here: nvcc refuses an extended lambda in a function whose
    // template arguments include a type local to a function, as the user's `F` often is.)
    detail::convert_copy<Space>(grad.data(), vg.grad.data(), grad.size());
    // The value is the whole (micro-)batch's; train_step adds the devices' shares over the data
    // axes, so each device reports its rows' fraction of it.
    const double whole = static_cast<double>(to_host(vg.value)[0]);
    return whole * static_cast<double>(rows) / static_cast<double>(z.global_extent(0));
  }
};

}  // namespace meshlib::nn
