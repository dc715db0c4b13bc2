// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `loss_function`: what `train_step` needs of a loss. `train_step` does not differentiate
/// the loss it is given (automatic differentiation, `nn::value_and_grad` in nn/autodiff/ and
/// docs/autodiff.md, is for programs written with meshlib's ops and for `function_layer`s), so a
/// loss is its value *and* its gradient with respect to the model output, as `jax.value_and_grad(loss_fn)`
/// would give them: an object `loss` with a nested `target_type` (the element type of the targets:
/// `std::int32_t` for class labels, `float` for regression targets) that `train_step` calls on
/// every device, once per micro-batch:
/// @code
/// loss_part r = loss(output, targets, global_batch, grad);   // or: double value = loss(...)
/// @endcode
/// - `output` (`const Z&`): this device's block of the model output, its rows this device's rows
///   of the micro-batch, its columns possibly a block of the features sharded over a model axis
///   (`Z::dims_type::at(1)`, `output.global_extent(1)` the global width);
/// - `targets` (`std::span<const target_type>`): this device's rows' targets, every row complete
///   (all global columns: targets are replicated over the model axis, as the input batch is);
/// - `global_batch`: the rows of the whole global batch, the mean's denominator;
/// - `grad` (`Z&`, the output's type and shape, a buffer `train_step` owns): to be filled with
///   the gradient of the *global mean* loss with respect to this device's block of `output`.
/// It returns this device's rows' share of the global mean: `train_step` adds the shares over the
/// data axis (a `psum`), so the share must already be complete over the axes that shard the
/// columns (a loss of column-sharded outputs `psum`s its partial sums over them, as the built-in
/// losses do). Returning a `loss_part` also reports `correct` (rows predicted right, for accuracy).
///
/// The built-in losses model it: `softmax_cross_entropy` (labels) and `mean_squared_error`
/// (regression targets). A user-written loss is any struct with that call operator:
/// @code
/// struct my_mse {   // mean over batch and features of (z - t)^2, for a replicated output
///   using target_type = float;
///   template <meshlib::local_tensor_type Z>
///   double operator()(const Z& z, std::span<const float> t, std::size_t global_batch, Z& grad) const {
///     const std::size_t rows = z.extent(0), cols = z.extent(1);
///     const double n = static_cast<double>(global_batch * cols);
///     double sum = 0;
///     for (std::size_t i = 0; i < rows; ++i)
///       for (std::size_t j = 0; j < cols; ++j) {
///         const double d = z(i, j) - t[i * cols + j];
///         sum += d * d;
///         grad(i, j) = static_cast<float>(2 * d / n);
///       }
///     return sum / n;
///   }
/// };
/// auto m = meshlib::nn::train_step(state, x, targets, rows, 0, rows, my_mse{});
/// @endcode
/// A loss of the wrong shape is one compile error from `train_step` naming this concept
/// (`loss_does_not_satisfy_loss_function<...>`).

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>

#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief What one device's rows contribute to the loss of a batch (see the file comment).
struct loss_part {
  double loss = 0;            ///< sum over this device's rows of the per-row loss, / global batch
  std::size_t correct = 0;    ///< rows whose prediction is right (classification; 0 for regression)
};

/// @brief What a loss may return: a `loss_part`, or the value alone (a number).
template <class R>
concept loss_result = std::same_as<std::remove_cvref_t<R>, loss_part> || std::convertible_to<R, double>;

/// @brief A loss declares the element type of its targets (`target_type`).
template <class L>
concept has_target_type = requires { typename std::remove_cvref_t<L>::target_type; };

/// @brief The targets' element type of loss `L`.
template <has_target_type L>
using loss_target_t = typename std::remove_cvref_t<L>::target_type;

/// @brief `L` is a loss for model outputs `Z`: `loss(output, targets, global_batch, grad)` gives
/// this device's share of the mean loss and writes the output's gradient (see the file comment).
template <class L, class Z>
concept loss_function =
    local_tensor_type<Z> && has_target_type<L> &&
    requires(L& loss, const Z& output, std::span<const loss_target_t<L>> targets, std::size_t global_batch, Z& grad) {
      { loss(output, targets, global_batch, grad) } -> loss_result;
    };

namespace detail {
/// The one diagnostic of `train_step` for a loss that is not a `loss_function` of the model's
/// output (instantiated once; the step's body is then not compiled, so nothing else is reported).
template <bool Ok, class Loss, class Output>
struct loss_does_not_satisfy_loss_function {
  static_assert(Ok,
                "meshlib::nn: train_step: the loss does not satisfy meshlib::nn::loss_function<Loss, Output> (the "
                "types in loss_does_not_satisfy_loss_function<ok, Loss, Output>): it needs a nested target_type and "
                "a call loss(const Output& output, std::span<const target_type> targets, std::size_t global_batch, "
                "Output& grad) returning a loss_part or a double (see meshlib/nn/loss_function.hpp)");
  static constexpr bool value = Ok;
};

/// The one diagnostic of `train_step` for targets whose element type is not the loss's.
template <bool Ok, class Loss, class Given, class Expected>
struct targets_type_differs_from_loss_target_type {
  static_assert(Ok,
                "meshlib::nn: train_step: the targets' element type is not the loss's target_type (the types in "
                "targets_type_differs_from_loss_target_type<ok, Loss, given, expected>): class labels "
                "(std::int32_t) go to softmax_cross_entropy, float regression targets (one per output column) to "
                "mean_squared_error; convert the targets or pass the loss that takes them");
  static constexpr bool value = Ok;
};

/// `r` as a `loss_part` (a loss that returns only the value reports no correct rows).
template <class R>
loss_part as_loss_part(R&& r) {
  if constexpr (std::same_as<std::remove_cvref_t<R>, loss_part>) return r;
  else return loss_part{static_cast<double>(r), 0};
}
}  // namespace detail

}  // namespace meshlib::nn
