// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Elementwise activations with forward and backward: `relu` and `gelu` (tanh form, as
/// `jax.nn.gelu(approximate=True)`). Elementwise maps keep the sharding, so the cotangent has the
/// input's type and no communication happens in either direction. Both directions are Kokkos
/// kernels on the running device's instance (a plain element body). relu's body is branch-free
/// (see `relu_fn`): its input's signs are a coin flip after batch norm, and a branch mispredicts on
/// half of them.
/// @code
/// meshlib::nn::relu<float> act(mesh.size());
/// // inside spmd: auto h = act.forward(x); ... auto dx = act.backward(dh);
/// @endcode

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/pointer_check.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives>
consteval bool activation_of_pending_sum() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives>,
                "meshlib::nn: an activation of a pending sum is not the sum of activations: psum the input first "
                "(the condition spells out the activation and the input's layout, whose partial<...> names the axes "
                "of the pending sum)");
  return false;
}

/// The shared body of elementwise activations: `Fn::f(x)` forward, `Fn::df(x)` its derivative.
template <class T, class Fn>
class elementwise_activation {
 public:
  explicit elementwise_activation(std::size_t devices) : saved_(devices), out_(devices), dx_(devices) {}
  template <class Mesh>
  explicit elementwise_activation(const Mesh& mesh) : elementwise_activation(mesh.size()) {}

  /// The width out is the width in (sequential compares the layers around it).
  static constexpr bool keeps_features = true;
  /// Any complete (not pending-sum) input.
  template <class X>
  static constexpr bool accepts_input = X::partial == 0;
  /// For compile-time messages: the activation's name.
  using diagnostic_name = meshlib::diagnostic::op_t<Fn::name>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::complete_values;

  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"activation.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(activation_of_pending_sum<diagnostic_name, meshlib::diagnostic::value_t<X>>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.size();
      saved_[dev] = {x.data(), x.extent(0), x.extent(1)};
      T* y = out_.get(dev, n);
      const T* xp = x.data();
      detail::activation_forward<default_memory_space, Fn>(y, xp, n);
      return X(typename X::view_type(y, x.extent(0), x.extent(1)), x.mesh(), dev);
    }
  }

  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"activation.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device(), n = dy.size();
      const auto [x, rows, cols] = saved_[dev];
      check_output_cotangent(std::string(Fn::name.view()), dev, dy.extent(0), dy.extent(1), x != nullptr, rows, cols);
      T* dx = dx_.get(dev, n);
      const T* d = dy.data();
      const T* xs = x;  // a copy: Clang before 16 cannot capture a structured binding
      detail::activation_backward<default_memory_space, Fn>(dx, d, xs, n);
      return DY(typename DY::view_type(dx, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
    }
  }

  /// The elementwise function (`relu_fn`, `gelu_fn`): what a dense layer's fused backward
  /// (`basic_dense::backward_through`) evaluates in its kernel.
  using activation_function = Fn;

  /// Where a fused backward (`basic_dense::backward_through`, called by `sequential`) finds this
  /// activation's saved input and puts its cotangent.
  struct fused_operands {
    const T* x;  ///< the last forward's input on the device
    T* dx;       ///< this activation's cotangent buffer on the device, sized for `dy`
  };
  /// The operands of a fused backward for `dy`, after the checks `backward` makes (the same errors).
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  fused_operands fused_backward_operands(const DY& dy) {
    static_cast<void>(require_kernel_can_read<"activation.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved s = saved_[dev];
    check_output_cotangent(std::string(Fn::name.view()), dev, dy.extent(0), dy.extent(1), s.x != nullptr, s.rows, s.cols);
    return {s.x, dx_.get(dev, dy.size())};
  }

  /// Appends nothing: an activation has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0, cols = 0;
  };
  std::vector<saved> saved_;
  device_buffers<T> out_, dx_;
};

/// relu, written so that GCC and Clang at -O2 emit no branch: after batch norm half the inputs are
/// negative in no pattern, and `x > 0 ? x : 0` compiled (GCC 12, -O2) to a compare and a jump that
/// mispredicts on half of them, 15 times slower than the mask below on normal random data (and
/// 15% of a small ResNet's training step). The values are the same: `x` when `x > 0`, else +0
/// (NaN and -0 included).
/// `exp(x)` on the host and in device kernels: `Kokkos::exp` (Kokkos 4), `std::exp` on Kokkos 3,
/// whose builds meshlib runs on the host only.
template <class T>
KOKKOS_INLINE_FUNCTION T exp_of(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::exp(x);
#else
  return std::exp(x);
#endif
}

struct relu_fn {  // (KOKKOS_INLINE_FUNCTION: device kernels call these, nn/detail/layer_kernels.hpp)
  static constexpr fixed_string name = "relu";
  /// `f` and `vjp` take native vectors too (a lane-wise select: `x > 0 ? x : 0` keeps the bits the
  /// scalar mask keeps, +0 for every x <= 0 and NaN).
  static constexpr bool on_lanes = true;
  template <class T>
  KOKKOS_INLINE_FUNCTION static T f(T x) {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      using bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
      const bits keep = bits{0} - static_cast<bits>(x > T{0});  // all ones or all zeros
      return std::bit_cast<T>(static_cast<bits>(std::bit_cast<bits>(x) & keep));
    } else {
      return x > T{0} ? x : T{0};
    }
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION static T df(T x) { return x > T{0} ? T{1} : T{0}; }
  /// The cotangent `dy` where `x > 0`, else 0 (PyTorch's `threshold_backward`): a select, which
  /// compiles to a compare and a mask, where `dy * df(x)` kept a branch.
  template <class T>
  KOKKOS_INLINE_FUNCTION static T vjp(T dy, T x) { return x > T{0} ? dy : T{0}; }
};

struct gelu_fn {
  static constexpr fixed_string name = "gelu";
  static constexpr double c = 0.7978845608028654;  // sqrt(2 / pi)
  // 0.5 (1 + tanh(u)) is the logistic function of 2u: one exp instead of tanh, which glibc
  // computes through expm1 at several times exp's cost (a third of a GPT step's time was tanhf
  // and expm1f). Stable at both ends: exp(-2u) overflows to inf (s = 0) or underflows to 0 (s = 1).
  template <class T>
  KOKKOS_INLINE_FUNCTION static T f(T x) {
    const T u = static_cast<T>(c) * (x + T(0.044715) * x * x * x);
    return x / (T{1} + exp_of(T(-2) * u));
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION static T df(T x) {
    const T u = static_cast<T>(c) * (x + T(0.044715) * x * x * x);
    const T s = T{1} / (T{1} + exp_of(T(-2) * u));  // 0.5 (1 + tanh(u))
    const T du = static_cast<T>(c) * (T{1} + T(3 * 0.044715) * x * x);
    // d/dx [x s(2u)] = s + x * 2 s (1 - s) du, since 1 - tanh^2 = 4 s (1 - s).
    return s + T(2) * x * s * (T{1} - s) * du;
  }
};
}  // namespace detail

/// @brief `max(x, 0)`.
template <class T>
using relu = detail::elementwise_activation<T, detail::relu_fn>;
/// @brief `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
template <class T>
using gelu = detail::elementwise_activation<T, detail::gelu_fn>;

}  // namespace meshlib::nn
