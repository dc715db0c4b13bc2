// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `step_metrics`, what one `train_step` or `evaluate` reports (equal on every device), and
/// `detail::sum_over`, the host-value sums over mesh axes that make it equal: the step, the
/// evaluation, the pipelined schedule and the gradient clipping all sum through it.

#include <cstddef>

#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

namespace detail {
/// Sums the `N` numbers `v` (the squared norm; `(loss, correct)`) over the axes `Axes` with the
/// public donated `psum`, in `v` itself (a host-memory value that differs over every axis); every
/// device of the group gets the totals. Runs on device `dev` inside `spmd`.
template <axis_mask Axes, mesh_type Mesh, std::size_t N>
void sum_over(const Mesh& mesh, std::size_t dev, double (&v)[N]) {
  if constexpr (Axes != 0) {
    if constexpr (meshlib::host_accessible_v<default_memory_space>) {
      using sums_t = local_tensor<double, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, Kokkos::HostSpace>;
      (void)psum_over<Axes>(wrap1<sums_t>(v, N, mesh, dev));
    } else {
      // A device communicator (NCCL, shared GPU) moves device memory only: the sums go through a
      // device block of the running device (reduced in place, then read back).
      using sums_t = local_tensor<double, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, default_memory_space>;
      const sums_t d(typename sums_t::shape_type{N}, mesh, dev);
      meshlib::copy_from_host<default_memory_space>(d.data(), v, N);
      (void)psum_over<Axes>(wrap1<sums_t>(d.data(), N, mesh, dev));  // donated: in place
      meshlib::copy_to_host<default_memory_space>(v, d.data(), N);
    }
  }
}
}  // namespace detail

/// @brief What one `train_step` (or `evaluate`) reports; equal on every device.
struct step_metrics {
  double loss = 0;             ///< mean loss over the global batch
  std::size_t correct = 0;     ///< rows whose prediction was right
  std::size_t rows = 0;        ///< rows of the global batch
  double grad_norm = 0;        ///< global gradient norm before clipping (train_step)
  /// Time the first local device's thread spent in the gradient synchronisation: blocked in its
  /// collectives, or (overlapped) starting them during backward and waiting for them after it: the
  /// synchronisation the step exposes.
  double sync_seconds = 0;
  bool skipped = false;        ///< dynamic loss scaling: the gradients were not finite, no update
  double loss_scale = 1;       ///< the loss scale this step used (1 without loss scaling)
  // ---- activation memory (nn/remat.hpp), of the first local device ----
  /// Bytes of the model's layer buffers (activations, outputs, cotangents, workspaces) live when the
  /// last micro-batch's forward returned: what is held between forward and backward.
  std::size_t activation_bytes = 0;
  /// The most bytes of the model's layer buffers live at any time during the step's forward and
  /// backward passes (what `remat` lowers).
  std::size_t peak_activation_bytes = 0;
};

}  // namespace meshlib::nn
