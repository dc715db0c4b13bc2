// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `dropout` with a mesh-invariant mask: element `(r, c)` of the *global* activation is kept
/// iff `uniform(key.fold_in(step).fold_in(id), r * cols + c) >= rate`, computed by whichever device
/// holds it, so a sharded activation drops exactly the elements the single-device run drops
/// (`flax.linen.Dropout`, but with JAX's values independent of the sharding). Identity in evaluation.
/// Mask, forward and backward are Kokkos kernels on the running device's instance.
/// @code
/// meshlib::nn::dropout<float> drop(m, "drop1", 0.1f);
/// // train_step calls begin_step(key, true) on the model; then inside spmd: auto y = drop.forward(x);
/// @endcode

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/pointer_check.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief Inverted dropout: kept elements are scaled by `1 / (1 - rate)`.
template <class T>
class dropout {
 public:
  /// Drops each value with probability `rate` in training; `name` seeds its own random stream.
  template <mesh_type Mesh>
  dropout(const Mesh& mesh, const std::string& name, float rate)
      : name_(name), id_(detail::name_id(name)), rate_(rate), shape_(mesh.size()), mask_(mesh.size()), out_(mesh.size()),
        dx_(mesh.size()) {}

  /// The width out is the width in (sequential compares the layers around it).
  static constexpr bool keeps_features = true;
  /// The name that seeds its random stream.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// `"drop1 (dropout 0.1)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (dropout " + detail::number_text(rate_) + ")";
  }

  /// A rank-2 block (rows, features), of any layout: the mask is a function of the global element.
  template <class X>
  static constexpr bool accepts_input = X::rank == 2;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"dropout">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::rank<2>;

  /// The step's key and mode (called by `sequential::begin_step` before the devices run).
  void begin_step(rng_key key, bool train) {
    key_ = key.fold_in(id_);
    train_ = train;
  }

  /// Zeroes each value with probability `rate` and scales the rest by `1 / (1 - rate)`; the identity outside training.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"dropout.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(
          detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0), cols = x.extent(1);
      if (!train_ || rate_ <= 0.0f) return x;
      shape_[dev] = {rows, cols, true};
      const std::size_t r0 = detail::global_offset(x, 0), c0 = detail::global_offset(x, 1);
      const std::size_t gcols = x.global_extent(1);
      T* mask = mask_.get(dev, rows * cols);
      T* y = out_.get(dev, rows * cols);
      const T keep = T{1} / static_cast<T>(1.0f - rate_);
      const T* xp = x.data();
      const rng_key key = key_;
      const float rate = rate_;
      // One work item per row (the row's global index is computed once, as in the loop).
      detail::dropout_forward<default_memory_space>(y, mask, xp, rows, cols, r0, c0, gcols, key, rate, keep);
      return X(typename X::view_type(y, rows, cols), x.mesh(), dev);
    }
  }

  /// Applies the forward step's mask to the cotangent `dy`; the second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input (in training).
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"dropout.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      if (!train_ || rate_ <= 0.0f) return dy;
      const std::size_t dev = dy.device(), n = dy.size();
      const auto [rows, cols, ran] = shape_[dev];
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, rows, cols);
      const T* mask = mask_.get(dev, n);
      T* dx = dx_.get(dev, n);
      const T* d = dy.data();
      detail::multiply_values<default_memory_space>(dx, d, mask, n);
      return DY(typename DY::view_type(dx, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
    }
  }

  /// Adds nothing: dropout has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::string name_;
  std::uint64_t id_;
  float rate_;
  rng_key key_{};
  bool train_ = false;
  std::vector<shape> shape_;  // per device: the last training forward's input shape (backward's mask)
  detail::device_buffers<T> mask_, out_, dx_;
};

}  // namespace meshlib::nn
