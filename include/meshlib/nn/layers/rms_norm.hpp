// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `rms_norm`: scales each row by the reciprocal of its root mean square,
/// `y = x / sqrt(mean(x^2) + eps) * g` (`flax.linen.RMSNorm`, `torch.nn.RMSNorm`; no mean is
/// subtracted and there is no shift, which is what Transformers of the Llama family use in place of
/// `layer_norm`), with forward and backward. As for `layer_norm`, the features must not be sharded
/// (a compile error says so): the row statistic is then local, and the cotangent has the input's type.
/// Forward and backward are Kokkos kernels on the running device's instance: one work item per row
/// for the row statistic, and per block of columns for the scale's gradient (a sum over rows, added
/// in row order: the same bits on every mesh).
/// @code
/// meshlib::nn::rms_norm<float, mesh_t> norm(m, "norm1", 128);   // eps = 1e-6, flax's default
/// // inside spmd: auto y = norm.forward(x);  ...  auto dx = norm.backward(dy);
/// @endcode

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/nn/detail/norm_kernels.hpp"
#include "meshlib/nn/layers/row_norm.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool rms_norm_input_sharded() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: rms_norm normalises over complete, unsharded features: all_gather (or psum) the "
                "feature dimension first (the condition spells out the layer, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief RMS normalisation over the last dimension with a scale `g` (init 1), replicated.
template <class T, mesh_type Mesh>
class rms_norm : public row_norm<T, Mesh, "rms_norm"> {
  using base = row_norm<T, Mesh, "rms_norm">;

 public:
  /// Normalises `features` values per row; `eps` keeps the division finite (flax's default, 1e-6).
  /// `local_devices`: this process's devices (empty: all).
  rms_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps = T(1e-6),
           std::span<const std::size_t> local_devices = {})
      : base(mesh, name, features, eps, local_devices) {}

  /// `x / sqrt(mean(x^2) + eps) * g` per row of this device's block.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"rms_norm.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!base::template accepts_input<X>) {
      static_cast<void>(detail::rms_norm_input_sharded<typename base::diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                       typename base::input_requirement>());
      return x;
    } else {
      const auto f = this->begin_forward(x);  // xhat = x / rms, stat: 1/rms per row
      detail::rms_norm_forward<default_memory_space>(f.y, f.xhat, f.stat, f.x, f.g, f.rows, f.n, this->eps_);
      return X(typename X::view_type(f.y, f.rows, f.n), x.mesh(), f.dev);
    }
  }

  /// The cotangent of the input, `r (dy g - xhat mean(dy g xhat))` per row (`r = 1/rms`); adds
  /// `sum_rows dy xhat` to the scale's gradient (each column's rows in row order). The second
  /// argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"rms_norm.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto k = this->begin_backward(dy);
      detail::rms_norm_backward<default_memory_space>(k.dx, k.dg, k.dy, k.xhat, k.stat, k.g, k.rows, k.n);
      return DY(typename DY::view_type(k.dx, k.rows, k.n), dy.mesh(), k.dev);
    }
  }

  /// Appends `g` to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) { out.push_back(this->g.ref()); }
};

}  // namespace meshlib::nn
