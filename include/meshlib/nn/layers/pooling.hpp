// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Pooling on NHWC images (see image_shape.hpp): `max_pool2d` and `avg_pool2d` over
/// `window x window` windows with a stride (`flax.linen.max_pool` / `avg_pool` with padding
/// "VALID", `torch.nn.MaxPool2d` / `AvgPool2d`), and `global_avg_pool`, the mean over all pixels of
/// each channel (`N x HWC -> N x C`, the head of a ResNet before its dense classifier).
///
/// Pooling works on each image alone: a data-parallel block of rows pools locally, no communication.
/// Forward and backward are Kokkos kernels on the running device's instance. The backward passes
/// are gathers, one work item per input pixel adding the output cotangents of the windows that
/// contain it (max pooling: only those whose maximum it was, the first in window order on ties,
/// as PyTorch), in a fixed order: no atomics, the same bits on every run.
/// @code
/// meshlib::nn::max_pool2d<float, mesh_t> pool(m, "pool1", {28, 28, 16}, 2);   // -> 14x14x16
/// meshlib::nn::global_avg_pool<float, mesh_t> gap(m, "gap", {7, 7, 64});      // -> 64 features
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/pool_kernels.hpp"
#include "meshlib/nn/layers/conv2d.hpp"
#include "meshlib/nn/layers/image_shape.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

/// @brief How a `pool2d` reduces its windows.
enum class pool_kind { max, average };

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool pool_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: max_pool2d, avg_pool2d and global_avg_pool take a complete rank-2 block of rows "
                "(images, NHWC, flattened) of their mesh, with unsharded features: shard the batch over the data "
                "axis, not the pixels (the condition spells out the layer, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief Max or average pooling over `window x window` windows (see the file comment).
template <class T, mesh_type Mesh, pool_kind Kind>
class pool2d {
 public:
  /// Pools images of shape `in` over `window x window` windows every `stride` pixels (0: `window`,
  /// non-overlapping windows, PyTorch's default). No padding: the last window must fit.
  /// @throws sharding_error when the window is larger than the image or a size is zero.
  pool2d(const Mesh& mesh, const std::string& name, image_shape in, std::size_t window, std::size_t stride = 0)
      : name_(name), in_(in), window_(window), stride_(stride == 0 ? window : stride),
        out_{checked(in, window) ? (in.height - window) / stride_ + 1 : 0, (in.width - window) / stride_ + 1, in.channels},
        saved_(mesh.size()), arg_(mesh.size()), out_buf_(mesh.size()), dx_(mesh.size()) {}

  /// The name messages use.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// `((H - window) / stride + 1) x ((W - window) / stride + 1) x C`.
  [[nodiscard]] image_shape output_shape() const noexcept { return out_; }
  /// Features per input row.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// Features per output row.
  [[nodiscard]] std::size_t out_features() const noexcept { return out_.size(); }
  /// `"pool1 (max_pool2d 2x2, stride 2, 28x28x16 -> 14x14x16)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (" + kind_text() + " " + std::to_string(window_) + "x" + std::to_string(window_) + ", stride " +
           std::to_string(stride_) + ", " + in_.to_string() + " -> " + out_.to_string() + ")";
  }
  /// A complete rank-2 block of rows with unsharded features.
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>();
  /// The kind, as messages spell it: `max_pool2d` or `avg_pool2d`.
  static constexpr fixed_string kind_name = Kind == pool_kind::max ? fixed_string("max_pool2d") : fixed_string("avg_pool2d");
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<kind_name>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The maximum (or mean) of every window of every channel.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"pool2d.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::pool_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.extent(0);
      if (x.extent(1) != in_.size()) throw sharding_error(detail::image_width_error(to_string(), name_, x.extent(1), in_));
      saved_[dev] = {n, true};
      const std::size_t ho = out_.height, wo = out_.width, c = in_.channels, wd = in_.width, h = in_.height;
      const std::size_t k = window_, s = stride_;
      T* y = out_buf_.get(dev, n * out_.size());
      std::uint32_t* arg = Kind == pool_kind::max ? arg_.get(dev, n * out_.size()) : nullptr;
      const T* xp = x.data();
      const T inv = T{1} / static_cast<T>(k * k);
      detail::pool_forward<default_memory_space, Kind == pool_kind::max>(y, arg, xp, n, h, wd, c, ho, wo, k, s, inv);
      return X(typename X::view_type(y, n, out_.size()), x.mesh(), dev);
    }
  }

  /// The cotangent of the input; the second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"pool2d.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      const auto [n, ran] = saved_[dev];
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, n, out_.size());
      const std::size_t ho = out_.height, wo = out_.width, c = in_.channels, wd = in_.width, h = in_.height;
      const std::size_t k = window_, s = stride_;
      const std::uint32_t* arg = Kind == pool_kind::max ? arg_.get(dev, n * out_.size()) : nullptr;
      const T* d = dy.data();
      T* dx = dx_.get(dev, n * in_.size());
      const T inv = T{1} / static_cast<T>(k * k);
      detail::pool_backward<default_memory_space, Kind == pool_kind::max>(dx, arg, d, n, h, wd, c, ho, wo, k, s, inv);
      return DY(typename DY::view_type(dx, n, in_.size()), dy.mesh(), dev);
    }
  }

  /// Adds nothing: pooling has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  static std::string kind_text() { return std::string(kind_name.view()); }
  bool checked(const image_shape& in, std::size_t window) const {
    const std::string head = "meshlib::nn: " + name_ + " (" + kind_text() + " " + std::to_string(window) + "x" +
                             std::to_string(window) + " on " + in.to_string() + " images)";
    if (window == 0 || in.size() == 0)
      throw sharding_error(head + ": the window and the image's height, width and channels must be at least 1");
    detail::check_window_fits(head, in, window, 0, false, "window");
    return true;
  }

  struct saved {
    std::size_t rows = 0;
    bool ran = false;
  };
  std::string name_;
  image_shape in_;
  std::size_t window_, stride_;
  image_shape out_;
  std::vector<saved> saved_;
  detail::device_buffers<std::uint32_t> arg_;  // max: per output value, the input pixel it came from
  detail::device_buffers<T> out_buf_, dx_;
};

/// @brief Max pooling (`torch.nn.MaxPool2d`, padding 0).
template <class T, mesh_type Mesh>
using max_pool2d = pool2d<T, Mesh, pool_kind::max>;
/// @brief Average pooling (`torch.nn.AvgPool2d`, padding 0).
template <class T, mesh_type Mesh>
using avg_pool2d = pool2d<T, Mesh, pool_kind::average>;

/// @brief The mean of each channel over all pixels: `N x (H*W*C) -> N x C`.
template <class T, mesh_type Mesh>
class global_avg_pool {
 public:
  /// Averages images of shape `in` to one value per channel.
  global_avg_pool(const Mesh& mesh, const std::string& name, image_shape in)
      : name_(name), in_(in), saved_(mesh.size()), out_buf_(mesh.size()), dx_(mesh.size()) {
    if (in.size() == 0)
      throw sharding_error("meshlib::nn: " + name + " (global_avg_pool on " + in.to_string() +
                           " images): the image's height, width and channels must be at least 1");
  }

  /// The name messages use.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// `1 x 1 x C`.
  [[nodiscard]] image_shape output_shape() const noexcept { return {1, 1, in_.channels}; }
  /// Features per input row.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// The channels.
  [[nodiscard]] std::size_t out_features() const noexcept { return in_.channels; }
  /// `"gap (global_avg_pool 7x7x64 -> 64)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (global_avg_pool " + in_.to_string() + " -> " + std::to_string(in_.channels) + ")";
  }
  /// A complete rank-2 block of rows with unsharded features.
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>();
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"global_avg_pool">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The mean of every channel of every image.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"global_avg_pool.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::pool_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.extent(0);
      if (x.extent(1) != in_.size()) throw sharding_error(detail::image_width_error(to_string(), name_, x.extent(1), in_));
      saved_[dev] = {n, true};
      const std::size_t c = in_.channels, hw = in_.pixels();
      T* y = out_buf_.get(dev, n * c);
      const T* xp = x.data();
      const T inv = T{1} / static_cast<T>(hw);
      detail::global_pool_forward<default_memory_space>(y, xp, n, hw, c, inv);
      return X(typename X::view_type(y, n, c), x.mesh(), dev);
    }
  }

  /// `dx = dy / (H * W)` on every pixel; the second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"global_avg_pool.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      const auto [n, ran] = saved_[dev];
      const std::size_t c = in_.channels, hw = in_.pixels();
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, n, c);
      const T* d = dy.data();
      T* dx = dx_.get(dev, n * in_.size());
      const T inv = T{1} / static_cast<T>(hw);
      detail::global_pool_backward<default_memory_space>(dx, d, n, hw, c, inv);
      return DY(typename DY::view_type(dx, n, in_.size()), dy.mesh(), dev);
    }
  }

  /// Adds nothing: pooling has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  struct saved {
    std::size_t rows = 0;
    bool ran = false;
  };
  std::string name_;
  image_shape in_;
  std::vector<saved> saved_;
  detail::device_buffers<T> out_buf_, dx_;
};

}  // namespace meshlib::nn
