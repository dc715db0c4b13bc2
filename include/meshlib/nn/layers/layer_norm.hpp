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
#include <vector>

#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/detail/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/norm_kernels.hpp"
#include "meshlib/nn/detail/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

/// @brief Layer normalisation over the last dimension, scale `g` (init 1) and shift `b` (init 0), replicated.
template <class T, mesh_type Mesh>
class layer_norm {
 public:
  /// Scale and shift are replicated on every device.
  using sharding = named_sharding<Mesh, P<none>>;
  /// The scale `g` (named `name + ".g"`, initially 1), `features` values.
  parameter<T, 1, sharding> g, b;
  /// @var b
  /// The shift `b` (named `name + ".b"`, initially 0), `features` values.

  /// Normalises `features` values per row; `eps` keeps the division finite. `local_devices`: this process's devices (empty: all).
  layer_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : g(name + ".g", sharding{mesh}, {features}, rng_key{}, init::constant(1.0f), false, local_devices),
        b(name + ".b", sharding{mesh}, {features}, rng_key{}, init::zeros(), false, local_devices),
        name_(name),
        eps_(eps),
        shape_(mesh.size()),
        xhat_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// The layer's name: its parameters are `name() + ".g"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The number of features it normalises over: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return g.value.global_shape()[0]; }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// `"ln1 (layer_norm over 16 features)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (layer_norm over " + std::to_string(in_features()) + " features)";
  }
  /// Complete, unsharded features (see the file comment).
  template <class X>
  static constexpr bool accepts_input = X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0;
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<"layer_norm">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `(x - mean) / sqrt(var + eps) * g + b` per row of this device's block.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"layer_norm.forward", "x", X>());
    static_assert(X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0,
                  "meshlib::nn: layer_norm normalises over complete, unsharded features: all_gather (or psum) the "
                  "feature dimension first");
    const std::size_t dev = x.device(), rows = x.extent(0), n = x.extent(1);
    if (n != in_features())
      throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(n) + " features; feed it " +
                           std::to_string(in_features()) + " features or declare " + name_ + " with " + std::to_string(n) +
                           " features");
    shape_[dev] = {rows, n, true};
    T* xh = xhat_.get(dev, rows * n + rows);  // xhat, then 1/std per row
    T* rstd = xh + rows * n;
    T* y = out_.get(dev, rows * n);
    const T* gv = g.value.local(dev).data();
    const T* bv = b.value.local(dev).data();
    const T* xp = x.data();
    const T eps = eps_;
    detail::layer_norm_forward<default_memory_space>(y, xh, rstd, xp, gv, bv, rows, n, eps);
    return X(typename X::view_type(y, rows, n), x.mesh(), dev);
  }

  /// The cotangent of the input; accumulates the gradients of `g` and `b`. The second argument (need_dx) is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"layer_norm.backward", "dy", DY>());
    const std::size_t dev = dy.device(), rows = dy.extent(0), n = dy.extent(1);
    detail::check_same_shape_cotangent(to_string(), dev, rows, n, shape_[dev].ran, shape_[dev].rows, shape_[dev].cols);
    const T* xh = xhat_.get(dev, rows * n + rows);
    const T* rstd = xh + rows * n;
    const T* gv = g.value.local(dev).data();
    T* gg = g.grad.local(dev).data();
    T* gb = b.grad.local(dev).data();
    T* dx = dx_.get(dev, rows * n);
    const T* dyp = dy.data();
    detail::layer_norm_backward<default_memory_space>(dx, gg, gb, dyp, xh, rstd, gv, rows, n);
    return DY(typename DY::view_type(dx, rows, n), dy.mesh(), dev);
  }

  /// Appends `g` and `b` to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) const {
    out.push_back(g.ref());
    out.push_back(b.ref());
  }

 private:
  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::string name_;
  T eps_;
  std::vector<shape> shape_;  // per device: the last forward's input shape
  detail::device_buffers<T> xhat_, out_, dx_;
};

}  // namespace meshlib::nn
