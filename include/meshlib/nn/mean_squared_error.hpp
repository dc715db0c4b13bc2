// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `mean_squared_error`: the regression loss, a `loss_function` for `train_step`.
/// For a model output `z` of global shape `(B, F)` (B rows of the global batch, F features) and
/// targets `t` of the same shape:
///
///     loss = 1/(B F) * sum_{i < B, j < F} (z_ij - t_ij)^2        dloss/dz_ij = 2 (z_ij - t_ij) / (B F)
///
/// the mean over batch *and* features, without a factor 1/2: `jnp.mean(optax.squared_error(z, t))`
/// and PyTorch's `F.mse_loss(z, t)` (reduction "mean"); `optax.l2_loss` is half of it.
///
/// Sharding: the rows are this device's rows of the batch (sharded over the data axis), and the
/// columns may be a block of the features sharded over a model axis (read from the output's type);
/// the targets are every row's complete `F` values (replicated over the model axis, as the input
/// batch is), and each device reads its block's columns. The gradient needs no communication; the
/// loss's partial sum over a device's columns is completed with one `psum` of one number over the
/// axes that shard the columns, so every device returns its rows' share of the global mean, which
/// `train_step` adds over the data axis.
///
/// The gradient pass is a Kokkos kernel on the running device's instance, one work item per row;
/// the squared differences are added (in double) by one work item in row-major order, as the
/// cross-entropy adds its rows: the same chain of additions on every backend.
/// @code
/// // targets: rows x 4 floats, row-major, for a model whose last layer has 4 outputs
/// auto m = meshlib::nn::train_step(state, x, std::span<const float>(targets), rows, 0, rows,
///                                  meshlib::nn::mean_squared_error{});
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/loss_kernels.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief Mean squared error over batch and features (see the file comment). Stateless.
template <class T = float>
struct mean_squared_error {
  /// Targets are one value per output column, row-major.
  using target_type = T;

  /// This device's rows' share of the mean (complete over the axes that shard the columns), and
  /// `grad = dloss/doutput` of this device's block. `targets`: this device's rows, `F` values each.
  /// @throws sharding_error when the targets are not `F` values per row (naming both shapes), or
  /// `grad` is not of the output's shape.
  template <local_tensor_type Z>
  loss_part operator()(const Z& output, std::span<const T> targets, std::size_t global_batch, Z& grad) const {
    static_assert(Z::rank == 2 && Z::partial == 0,
                  "meshlib::nn: mean_squared_error needs a complete rank-2 model output (psum a pending sum first)");
    static_assert(std::is_same_v<typename Z::value_type, T>,
                  "meshlib::nn: mean_squared_error<T>: T must be the model output's element type");
    constexpr axis_mask col_axes = Z::dims_type::at(1);
    const std::size_t rows = output.extent(0), cols = output.extent(1), width = output.global_extent(1);
    if (targets.size() != rows * width) throw sharding_error(shape_message(targets.size(), rows, width, global_batch));
    if (grad.extent(0) != rows || grad.extent(1) != cols)
      throw sharding_error("meshlib::nn: mean_squared_error: the gradient buffer's block is (" +
                           std::to_string(grad.extent(0)) + ", " + std::to_string(grad.extent(1)) +
                           ") but the output's is (" + std::to_string(rows) + ", " + std::to_string(cols) +
                           "); pass a buffer of the output's shape");
    const std::size_t col0 = detail::global_offset(output, 1);
    const double scale = 1.0 / (static_cast<double>(global_batch) * static_cast<double>(width));
    const T two_scale = static_cast<T>(2.0 * scale);
    const T* z = output.data();
    // Kernels read the targets and write the sum in the kernels' memory: the caller's host targets
    // and a local on the host; on a device, a copy of the targets and one element after them (an
    // allocation per call: this stateless loss keeps no per-device buffers).
    double local_sum = 0;
    const T* t = targets.data() + col0;  // row i's block of columns starts at t[i * width]
    double* res = &local_sum;
    [[maybe_unused]] meshlib::block_view<T, 1, space> staged;
    [[maybe_unused]] meshlib::block_view<double, 1, space> staged_sum;
    if constexpr (!meshlib::host_accessible_v<space>) {
      staged = meshlib::allocate<T, 1, space>({targets.size()}, "meshlib::nn::mean_squared_error", false);
      staged_sum = meshlib::allocate<double, 1, space>({1}, "meshlib::nn::mean_squared_error", false);
      meshlib::copy_from_host<space>(staged.data(), targets.data(), targets.size());
      t = staged.data() + col0;
      res = staged_sum.data();
    }
    detail::squared_error<space>(z, t, rows, cols, width, two_scale, scale, grad.data(), res);
    if constexpr (col_axes != 0) {  // the other column blocks' sums: one number over the axes that shard them
      using share_t = local_tensor<double, 1, typename Z::mesh_type, Z::vary, 0, replicated_dims<1>, space>;
      (void)detail::psum_over<col_axes>(detail::wrap1<share_t>(res, 1, output.mesh(), output.device()));
    }
    return loss_part{meshlib::read_back<space>(res), 0};
  }

 private:
  using space = default_memory_space;

  static std::string shape_message(std::size_t values, std::size_t rows, std::size_t width, std::size_t batch) {
    const std::string b = std::to_string(batch), w = std::to_string(width);
    const std::string given = rows != 0 && values % rows == 0
                                  ? "the targets have shape (" + b + ", " + std::to_string(values / rows) + ")"
                                  : "the targets hold " + std::to_string(values) + " values for " +
                                        std::to_string(rows) + " rows";
    return "meshlib::nn: mean_squared_error: " + given + " but the model output has shape (" + b + ", " + w +
           "); give one target per output column (" + b + " x " + w +
           " values, row-major) or a model with as many outputs as target columns; class labels need "
           "softmax_cross_entropy";
  }
};

}  // namespace meshlib::nn
