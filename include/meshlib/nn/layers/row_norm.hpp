// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `row_norm`: what `layer_norm` and `rms_norm` share, written once. Both normalise each row
/// of a device's block over its complete features with a replicated scale `g`; they differ only in
/// the row statistic (mean and variance, or the mean square), the shift `b` that `layer_norm` adds,
/// and their kernels (nn/detail/norm_kernels.hpp). This base holds the scale, the per-device
/// buffers, the shape checks and the names messages use; each layer's `forward` / `backward` takes
/// its buffers from `begin_forward` / `begin_backward` and launches its own kernel.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"

namespace meshlib::nn {

/// @brief The common part of the row normalisations `layer_norm` and `rms_norm` (named `Kind` in
/// messages): a replicated scale `g` (init 1) over `features` complete, unsharded features.
template <class T, mesh_type Mesh, fixed_string Kind>
class row_norm {
 public:
  /// The parameters are replicated on every device.
  using sharding = named_sharding<Mesh, P<none>>;
  /// The scale `g` (named `name + ".g"`, initially 1), `features` values.
  parameter<T, 1, sharding> g;

  /// The layer's name: its parameters are `name() + ".g"` (and `layer_norm`'s `name() + ".b"`).
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The number of features it normalises over: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return g.value.global_shape()[0]; }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// `"ln1 (layer_norm over 16 features)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (" + std::string(Kind.view()) + " over " + std::to_string(in_features()) + " features)";
  }
  /// Complete, unsharded features: the row statistics are then local and the cotangent has the
  /// input's type.
  template <class X>
  static constexpr bool accepts_input = X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0;
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<Kind>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

 protected:
  /// `features` values per row, `eps` in the statistic's square root; `local_devices`: this
  /// process's devices (empty: all).
  row_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps,
           std::span<const std::size_t> local_devices)
      : g(name + ".g", sharding{mesh}, {features}, rng_key{}, init::constant(1.0f), false, local_devices),
        eps_(eps),
        name_(name),
        shape_(mesh.size()),
        xhat_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// One device's pointers for a forward kernel: `y` the output, `xhat` the normalised input and
  /// then one statistic per row (`stat`), both kept for the backward pass.
  struct forward_block {
    std::size_t dev;   ///< the device
    std::size_t rows;  ///< rows of its block
    std::size_t n;     ///< features per row
    const T* x;        ///< the input block
    const T* g;        ///< the scale
    T* y;              ///< the output block
    T* xhat;           ///< the normalised input (kept for backward)
    T* stat;           ///< one statistic per row (kept for backward)
  };
  /// One device's pointers for a backward kernel: `dx` the cotangent of the input, `dg` the scale's
  /// gradient, and what the forward pass kept.
  struct backward_block {
    std::size_t dev;   ///< the device
    std::size_t rows;  ///< rows of its block
    std::size_t n;     ///< features per row
    const T* dy;       ///< the cotangent of the output
    const T* g;        ///< the scale
    const T* xhat;     ///< the forward pass's normalised input
    const T* stat;     ///< the forward pass's per-row statistic
    T* dx;             ///< the cotangent of the input
    T* dg;             ///< the scale's gradient
  };

  /// Checks `x`'s width, records its shape for the backward pass and hands out the buffers.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <class X>
  forward_block begin_forward(const X& x) {
    const std::size_t dev = x.device(), rows = x.extent(0), n = x.extent(1);
    if (n != in_features())
      throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(n) + " features; feed it " +
                           std::to_string(in_features()) + " features or declare " + name_ + " with " + std::to_string(n) +
                           " features");
    shape_[dev] = {rows, n, true};
    T* xh = xhat_.get(dev, rows * n + rows);
    return {dev, rows, n, x.data(), g.value.local(dev).data(), out_.get(dev, rows * n), xh, xh + rows * n};
  }

  /// Checks that `dy` is shaped as this device's last forward input and hands out the buffers.
  /// @throws sharding_error naming the layer otherwise.
  template <class DY>
  backward_block begin_backward(const DY& dy) {
    const std::size_t dev = dy.device(), rows = dy.extent(0), n = dy.extent(1);
    detail::check_output_cotangent(to_string(), dev, rows, n, shape_[dev].ran, shape_[dev].rows, shape_[dev].cols);
    const T* xh = xhat_.get(dev, rows * n + rows);
    return {dev, rows, n, dy.data(), g.value.local(dev).data(), xh, xh + rows * n, dx_.get(dev, rows * n),
            g.grad.local(dev).data()};
  }

  T eps_;  ///< keeps the division finite

 private:
  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::string name_;
  std::vector<shape> shape_;  // per device: the last forward's input shape
  detail::device_buffers<T> xhat_, out_, dx_;
};

}  // namespace meshlib::nn
