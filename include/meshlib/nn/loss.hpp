// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `softmax_cross_entropy`: the mean over the *global* batch of `-log softmax(logits)[label]`,
/// with its gradient, for logits whose rows (the batch) are sharded over the data axis and whose
/// columns (the classes) may be sharded over a model axis. Sharded classes are never gathered: the
/// row maximum is a `pmax`, the normaliser and the target logit are `psum`s of one number per row
/// over the axes that shard the classes (read from the logits' type), as Megatron's vocab-parallel
/// cross-entropy does.
///
/// Each device's `loss` is its rows' share of the mean (a pending sum over the data axis); the
/// gradient `(softmax - onehot) / global_batch` has the logits' type. The row passes are Kokkos
/// kernels on the running device's instance, one work item per row (each row's sums in column
/// order, and the loss added over the rows in row order, as a plain loop: the same bits on every mesh).
/// @code
/// meshlib::nn::softmax_cross_entropy<float> ce(mesh.size());
/// // inside spmd, logits (B/4, 10) varying over data:
/// auto r = ce.forward(logits, my_labels, 256);   // r.loss: this device's share; r.correct: argmax hits
/// auto dlogits = ce.backward(logits);
/// // or as a loss_function (what train_step calls): the gradient into a buffer of the caller's
/// loss_part r2 = ce(logits, my_labels, 256, dlogits_buffer);
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/loss_kernels.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/pointer_check.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief Softmax cross-entropy on (possibly class-sharded) logits (see the file comment).
template <class T>
class softmax_cross_entropy {
 public:
  /// Targets are class labels, one per row (a `loss_function`).
  using target_type = std::int32_t;

  /// Holds per-device scratch for `devices` devices.
  explicit softmax_cross_entropy(std::size_t devices)
      : grad_(devices), terms_(devices), labels_(devices), rows_(devices) {}
  /// Holds per-device scratch for every device of `mesh`.
  template <mesh_type Mesh>
  explicit softmax_cross_entropy(const Mesh& mesh) : softmax_cross_entropy(mesh.size()) {}

  /// Loss of this device's rows; `labels[i]` is the class of local row `i`; `global_batch` the
  /// number of rows over all data devices (the mean's denominator). Keeps the gradient for `backward`.
  /// @throws std::out_of_range when a label is not a class index.
  template <local_tensor_type Z>
  loss_part forward(const Z& logits, std::span<const std::int32_t> labels, std::size_t global_batch) {
    static_cast<void>(require_kernel_can_read<"softmax_cross_entropy.forward", "logits", Z>());
    T* buf = grad_.get(logits.device(), logits.size() + 3 * logits.extent(0));
    const loss_part out = compute(logits, labels, global_batch, buf, buf + logits.size());
    rows_[logits.device()] = logits.extent(0);
    return out;
  }

  /// The `loss_function` call `train_step` makes: `forward`'s loss, with the gradient of the mean
  /// loss written into `grad` (the logits' shape) instead of this object's buffer.
  /// @throws std::out_of_range when a label is not a class index; sharding_error when `grad`'s
  /// shape is not the logits'.
  template <local_tensor_type Z>
  loss_part operator()(const Z& logits, std::span<const std::int32_t> labels, std::size_t global_batch, Z& grad) {
    static_cast<void>(require_kernel_can_read<"softmax_cross_entropy", "logits", Z>());
    if (grad.extent(0) != logits.extent(0) || grad.extent(1) != logits.extent(1))
      throw sharding_error("meshlib::nn: softmax_cross_entropy: the gradient buffer's block is (" +
                           std::to_string(grad.extent(0)) + ", " + std::to_string(grad.extent(1)) +
                           ") but the logits' is (" + std::to_string(logits.extent(0)) + ", " +
                           std::to_string(logits.extent(1)) + "); pass a buffer of the logits' shape");
    return compute(logits, labels, global_batch, grad.data(), grad_.get(logits.device(), 3 * logits.extent(0)));
  }

  /// The gradient of the mean loss with respect to `logits` (the tensor given to `forward`).
  template <local_tensor_type Z>
  Z backward(const Z& logits) {
    const std::size_t dev = logits.device();
    T* g = grad_.get(dev, logits.size() + 3 * logits.extent(0));
    return Z(typename Z::view_type(g, logits.extent(0), logits.extent(1)), logits.mesh(), dev);
  }

  /// The loss of `forward`, the gradient written to `g` (the logits' size), with `3 * rows`
  /// elements of scratch at `scratch`. Public only because nvcc refuses an extended device lambda
  /// in a private member function; call `forward` or `forward_backward`.
  template <local_tensor_type Z>
  loss_part compute(const Z& logits, std::span<const std::int32_t> labels, std::size_t global_batch, T* g,
                    T* scratch) {
    static_assert(Z::rank == 2 && Z::partial == 0,
                  "meshlib::nn: softmax_cross_entropy needs complete rank-2 logits (psum a pending sum first)");
    constexpr axis_mask class_axes = Z::dims_type::at(1);
    const std::size_t dev = logits.device(), rows = logits.extent(0), cols = logits.extent(1);
    if (labels.size() != rows)
      throw sharding_error("meshlib::nn: softmax_cross_entropy: " + std::to_string(labels.size()) + " labels for " +
                           std::to_string(rows) + " rows of logits on device " + std::to_string(dev));
    const std::size_t col0 = detail::global_offset(logits, 1);
    const std::size_t classes = cols * logits.mesh().axes_size(class_axes);
    T* mx = scratch;  // per row: max, then normaliser, then target logit
    T* sum = mx + rows;
    T* tgt = sum + rows;
    const T* z = logits.data();
    // The labels are the caller's host data: checked here, before any kernel reads them.
    for (std::size_t i = 0; i < rows; ++i)
      if (labels[i] < 0 || static_cast<std::size_t>(labels[i]) >= classes)
        throw std::out_of_range("meshlib::nn: softmax_cross_entropy: label " + std::to_string(labels[i]) + " of row " +
                                std::to_string(i) + " on device " + std::to_string(dev) + " is not in [0, " +
                                std::to_string(classes) + ")");
    const std::int32_t* lab = labels_.readable(dev, labels.data(), rows);  // copied across for device memory
    // Every class here: one kernel per row does the three passes (no maximum or normaliser to share).
    if constexpr (class_axes == 0)
      return detail::softmax_cross_entropy_rows<space>(z, rows, cols, lab, global_batch, g, mx, sum, tgt,
                                                       terms_.get(dev, rows + 2));
    detail::row_max<space>(z, rows, cols, mx);
    if constexpr (class_axes != 0)
      (void)detail::pmax_over<class_axes>(detail::wrap1<row_values<Z>>(mx, rows, logits.mesh(), dev));
    detail::exp_and_target<space>(z, rows, cols, col0, lab, mx, g, sum, tgt);
    if constexpr (class_axes != 0)  // normaliser and target
      (void)detail::psum_over<class_axes>(detail::wrap1<row_values<Z>>(sum, 2 * rows, logits.mesh(), dev));
    // per row: its loss / global batch; then the two totals the host reads back
    return detail::cross_entropy_terms<space>(rows, cols, col0, lab, mx, sum, tgt, global_batch, g,
                                              terms_.get(dev, rows + 2));
  }

 private:
  /// One number per row (or two rows' worth) as the collectives see it: it differs over the axes
  /// the logits vary over; the donated `pmax` / `psum` reduce it in the loss's own buffer.
  template <class Z>
  using row_values = local_tensor<T, 1, typename Z::mesh_type, Z::vary, 0, replicated_dims<1>, typename Z::memory_space>;
  // The kernels' memory: the loss's scratch buffers (the labels copied across, the totals read back).
  using space = default_memory_space;
  detail::device_buffers<T> grad_;
  detail::device_buffers<double> terms_;
  detail::device_buffers<std::int32_t> labels_;  // the labels in device memory (unused on the host)
  std::vector<std::size_t> rows_;
};

}  // namespace meshlib::nn
