// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `layer_norm`: normalises each row over its features, `y = (x - mean) / sqrt(var + eps) * g + b`
/// (`flax.linen.LayerNorm`), with forward and backward. The features must not be sharded (a
/// compile error says so): the row statistics are then local, and the cotangent has the input's type.
/// Forward and backward are Kokkos kernels on the running device's instance: one work item per row
/// for the row statistics, and per block of columns for the parameter gradients (sums over rows,
/// added in row order: the same bits on every mesh).
/// @code
/// meshlib::nn::layer_norm<float, mesh_t> ln(m, "ln1", 1024);
/// // inside spmd: auto y = ln.forward(x);  ...  auto dx = ln.backward(dy);
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
consteval bool layer_norm_input_sharded() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: layer_norm normalises over complete, unsharded features: all_gather (or psum) the "
                "feature dimension first (the condition spells out the layer, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief Layer normalisation over the last dimension, scale `g` (init 1) and shift `b` (init 0), replicated.
template <class T, mesh_type Mesh>
class layer_norm : public row_norm<T, Mesh, "layer_norm"> {
  using base = row_norm<T, Mesh, "layer_norm">;

 public:
  /// The shift `b` (named `name + ".b"`, initially 0), `features` values.
  parameter<T, 1, typename base::sharding> b;

  /// Normalises `features` values per row; `eps` keeps the division finite. `local_devices`: this process's devices (empty: all).
  layer_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : base(mesh, name, features, eps, local_devices),
        b(name + ".b", typename base::sharding{mesh}, {features}, rng_key{}, init::zeros(), false, local_devices) {}

  /// `(x - mean) / sqrt(var + eps) * g + b` per row of this device's block.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"layer_norm.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!base::template accepts_input<X>) {
      static_cast<void>(detail::layer_norm_input_sharded<typename base::diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                         typename base::input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto f = this->begin_forward(x);  // stat: 1/std per row
      detail::layer_norm_forward<default_memory_space>(f.y, f.xhat, f.stat, f.x, f.g, b.value.local(f.dev).data(),
                                                       f.rows, f.n, this->eps_);
      return X(typename X::view_type(f.y, f.rows, f.n), x.mesh(), f.dev);
    }
  }

  /// The cotangent of the input; accumulates the gradients of `g` and `b`. The second argument (need_dx) is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"layer_norm.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto k = this->begin_backward(dy);
      detail::layer_norm_backward<default_memory_space>(k.dx, k.dg, b.grad.local(k.dev).data(), k.dy, k.xhat, k.stat,
                                                        k.g, k.rows, k.n);
      return DY(typename DY::view_type(k.dx, k.rows, k.n), dy.mesh(), k.dev);
    }
  }

  /// Appends `g` and `b` to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(this->g.ref());
    out.push_back(b.ref());
  }
};

}  // namespace meshlib::nn
