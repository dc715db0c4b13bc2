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
#include <vector>

#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/detail/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/norm_kernels.hpp"
#include "meshlib/nn/detail/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

/// @brief RMS normalisation over the last dimension with a scale `g` (init 1), replicated.
template <class T, mesh_type Mesh>
class rms_norm {
 public:
  /// The scale is replicated on every device.
  using sharding = named_sharding<Mesh, P<none>>;
  /// The scale `g` (named `name + ".g"`, initially 1), `features` values.
  parameter<T, 1, sharding> g;

  /// Normalises `features` values per row; `eps` keeps the division finite (flax's default, 1e-6).
  /// `local_devices`: this process's devices (empty: all).
  rms_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps = T(1e-6),
           std::span<const std::size_t> local_devices = {})
      : g(name + ".g", sharding{mesh}, {features}, rng_key{}, init::constant(1.0f), false, local_devices),
        name_(name),
        eps_(eps),
        shape_(mesh.size()),
        xhat_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// The layer's name: its parameter is `name() + ".g"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The number of features it normalises over: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return g.value.global_shape()[0]; }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// `"norm1 (rms_norm over 16 features)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (rms_norm over " + std::to_string(in_features()) + " features)";
  }
  /// Complete, unsharded features (see the file comment).
  template <class X>
  static constexpr bool accepts_input = X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0;
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<"rms_norm">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `x / sqrt(mean(x^2) + eps) * g` per row of this device's block.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"rms_norm.forward", "x", X>());
    static_assert(X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0,
                  "meshlib::nn: rms_norm normalises over complete, unsharded features: all_gather (or psum) the "
                  "feature dimension first");
    const std::size_t dev = x.device(), rows = x.extent(0), n = x.extent(1);
    if (n != in_features())
      throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(n) + " features; feed it " +
                           std::to_string(in_features()) + " features or declare " + name_ + " with " + std::to_string(n) +
                           " features");
    shape_[dev] = {rows, n, true};
    T* xh = xhat_.get(dev, rows * n + rows);  // xhat = x / rms, then 1/rms per row
    T* rinv = xh + rows * n;
    T* y = out_.get(dev, rows * n);
    const T* gv = g.value.local(dev).data();
    const T* xp = x.data();
    const T eps = eps_;
    detail::rms_norm_forward<default_memory_space>(y, xh, rinv, xp, gv, rows, n, eps);
    return X(typename X::view_type(y, rows, n), x.mesh(), dev);
  }

  /// The cotangent of the input, `r (dy g - xhat mean(dy g xhat))` per row (`r = 1/rms`); adds
  /// `sum_rows dy xhat` to the scale's gradient. The second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"rms_norm.backward", "dy", DY>());
    const std::size_t dev = dy.device(), rows = dy.extent(0), n = dy.extent(1);
    detail::check_same_shape_cotangent(to_string(), dev, rows, n, shape_[dev].ran, shape_[dev].rows, shape_[dev].cols);
    const T* xh = xhat_.get(dev, rows * n + rows);
    const T* rinv = xh + rows * n;
    const T* gv = g.value.local(dev).data();
    T* gg = g.grad.local(dev).data();
    T* dx = dx_.get(dev, rows * n);
    const T* dyp = dy.data();
    detail::rms_norm_backward<default_memory_space>(dx, gg, dyp, xh, rinv, gv, rows, n);
    // dg += sum_rows dy * xhat: each column's rows in row order.
    return DY(typename DY::view_type(dx, rows, n), dy.mesh(), dev);
  }

  /// Appends `g` to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) const { out.push_back(g.ref()); }

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
