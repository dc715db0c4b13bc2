// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `residual`: a skip connection, `y = main(x) + shortcut(x)` (ResNet's identity or
/// projection shortcut, a Transformer's residual stream), and `identity`, the default shortcut.
///
/// The branches are any layers of the `sequential` protocol (a `sequential` included); both must
/// return the input's type and width, so the sum is elementwise and the cotangent of the input is
/// the sum of the two branches' cotangents of `dy` (the backward of a fan-out is a sum). Both sums
/// are Kokkos kernels on the running device's instance, into the residual's own buffers; no
/// communication beyond the branches' own.
/// @code
/// auto block = meshlib::nn::make_residual<float>(m, meshlib::nn::sequential(conv_a, bn_a, relu_a, conv_b, bn_b));
/// // inside spmd: auto y = block.forward(x);   // conv_b(...(x)) + x
/// @endcode

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::diagnostic {
/// A `residual`'s main branch, of kind `Kind` (an `op` naming it, or the layer's type).
template <class Kind>
struct main_branch {};
/// A `residual`'s shortcut branch, of kind `Kind`.
template <class Kind>
struct shortcut_branch {};
}  // namespace meshlib::diagnostic

namespace meshlib::nn {

/// @brief The identity layer: returns its input, and the cotangent unchanged.
template <class T>
struct identity {
  /// The width out is the width in.
  static constexpr bool keeps_features = true;
  /// `x` itself (no copy).
  template <local_tensor_type X>
  X forward(const X& x) {
    return x;
  }
  /// `dy` itself; the second argument (need_dx) is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    return dy;
  }
  /// Adds nothing: no parameters.
  void collect(std::vector<param_ref<T>>&) {}
};

namespace detail {
template <class Residual, class Branch, class Input, class Returns>
consteval bool residual_branch_returns_another_type() {
  static_assert(meshlib::diagnostic::always_false<Residual, Branch, Input, Returns>,
                "meshlib::nn: residual: both branches must return their input's type (same sharding, vary and "
                "partial; in backward, the input's cotangent) so their sum is elementwise: the condition spells out "
                "residual_branch_returns_another_type<residual, the branch (main_branch or shortcut_branch, its kind), "
                "the input's layout, what the branch returns> (the whole types where the layouts agree). End the "
                "branch with a layer that returns its input's sharding (a row_dense after a column_dense), or psum "
                "or reshard inside the branch");
  return false;
}

/// True when a residual's branch `Branch` (`main_branch<kind>` / `shortcut_branch<kind>`) given `In`
/// returned `Out`, its input's type; otherwise fires the one diagnostic naming the branch and both layouts.
template <class Branch, class In, class Out>
consteval bool check_branch_type() {
  if constexpr (std::is_same_v<In, Out>)
    return true;
  else
    return residual_branch_returns_another_type<meshlib::diagnostic::op_t<"residual">, Branch,
                                                typename diagnostic_of<In, Out>::type,
                                                typename diagnostic_of<Out, In>::type>();
}

/// `l.backward(dy, need_dx)`, telling a `sequential` (whose backward names its input type) that its
/// input had `dy`'s type: a residual's branches take and return the same type.
template <class L, class DY>
auto branch_backward(L& l, const DY& dy, bool need_dx) {
  if constexpr (requires { l.template backward<DY>(dy, need_dx); }) return l.template backward<DY>(dy, need_dx);
  else return l.backward(dy, need_dx);
}
template <class L>
void branch_begin_step(L& l, rng_key key, bool train) {
  if constexpr (requires { l.begin_step(key, train); }) l.begin_step(key, train);
}
}  // namespace detail

/// @brief `y = main(x) + shortcut(x)` (see the file comment).
template <class T, class Main, class Shortcut = identity<T>>
class residual {
 public:
  /// The residual branch (for ResNet: conv-BN-ReLU-conv-BN).
  Main main;
  /// The shortcut branch (the identity, or a projection where the shape changes).
  Shortcut shortcut;

  /// Sums `main` and `shortcut` applied to the same input.
  /// @throws sharding_error when both branches expose widths (`in_features()`, `out_features()`;
  /// the identity keeps its input's) and they disagree.
  template <mesh_type Mesh>
  residual(const Mesh& mesh, Main main_, Shortcut shortcut_ = Shortcut{})
      : main(std::move(main_)), shortcut(std::move(shortcut_)), rows_(mesh.size()), out_(mesh.size()), dx_(mesh.size()) {
    if constexpr (detail::has_widths<Main> && (detail::has_widths<Shortcut> || detail::keeps_features<Shortcut>())) {
      const std::size_t in = main.in_features(), out = main.out_features();
      std::size_t s_in = in, s_out = in;
      std::string with = "the identity shortcut, which returns its " + std::to_string(in) + " input features";
      if constexpr (detail::has_widths<Shortcut>) {
        s_in = shortcut.in_features();
        s_out = shortcut.out_features();
        with = "its shortcut, which maps " + std::to_string(s_in) + " to " + std::to_string(s_out) + " features";
      }
      if (s_in != in || s_out != out)
        throw sharding_error("meshlib::nn: residual: its main branch maps " + std::to_string(in) + " to " +
                             std::to_string(out) + " features, which cannot be added to " + with +
                             "; give the main branch the input's width (same image shape, stride 1) or use a "
                             "projection shortcut that maps the input to the main branch's output");
    }
  }

  /// The main branch's input width.
  [[nodiscard]] std::size_t in_features() const
    requires detail::has_widths<Main>
  {
    return main.in_features();
  }
  /// The main branch's output width.
  [[nodiscard]] std::size_t out_features() const
    requires detail::has_widths<Main>
  {
    return main.out_features();
  }
  /// `"residual"`, as messages name it.
  [[nodiscard]] std::string name() const { return "residual"; }
  /// What both branches accept.
  template <class X>
  static constexpr bool accepts_input = detail::layer_accepts<Main, X>() && detail::layer_accepts<Shortcut, X>();
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"residual">;
  /// What the main branch needs (`sequential`'s message when a residual cannot take its input).
  using input_requirement = typename detail::layer_input_requirement<Main>::type;

  /// Passes the step's key and mode to both branches (batch norm and dropout read them).
  void begin_step(rng_key key, bool train) {
    detail::branch_begin_step(main, key, train);
    detail::branch_begin_step(shortcut, key, train);
  }

  /// `main(x) + shortcut(x)`.
  /// @throws sharding_error when the branches return blocks of different shapes.
  template <local_tensor_type X>
  X forward(const X& x) {
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto h = main.forward(x);
      const auto s = shortcut.forward(x);
      using H = std::remove_cvref_t<decltype(h)>;
      using S = std::remove_cvref_t<decltype(s)>;
      if constexpr (!detail::check_branch_type<main_branch_t, X, H>() ||
                    !detail::check_branch_type<shortcut_branch_t, X, S>())
        return x;  // the one diagnostic has fired; nothing else may
      else
        return sum(h, s);
    }
  }

  /// The sum of both branches' input cotangents (when `need_dx`; otherwise unspecified contents).
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      detail::check_output_cotangent("residual", dev, dy.extent(0), dy.extent(1), rows_[dev].ran, rows_[dev].rows,
                                     rows_[dev].cols);
      const auto dm = detail::branch_backward(main, dy, need_dx);
      const auto ds = detail::branch_backward(shortcut, dy, need_dx);
      using DM = std::remove_cvref_t<decltype(dm)>;
      using DS = std::remove_cvref_t<decltype(ds)>;
      if constexpr (!detail::check_branch_type<main_branch_t, DY, DM>() ||
                    !detail::check_branch_type<shortcut_branch_t, DY, DS>()) {
        return dy;  // the one diagnostic has fired; nothing else may
      } else {
        const std::size_t n = dm.size();
        T* dx = dx_.get(dev, n);
        if (need_dx) {
          const T* a = dm.data();
          const T* b = ds.data();
          detail::sum_values<default_memory_space>(dx, a, b, n);
        }
        return DY(typename DY::view_type(dx, dm.extent(0), dm.extent(1)), dy.mesh(), dev);
      }
    }
  }

  /// Appends the main branch's parameters, then the shortcut's.
  void collect(std::vector<param_ref<T>>& out) {
    main.collect(out);
    shortcut.collect(out);
  }
  /// Appends the main branch's buffers (batch norms' running statistics), then the shortcut's.
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    detail::collect_buffers_of(main, out);
    detail::collect_buffers_of(shortcut, out);
  }

 private:
  using main_branch_t = meshlib::diagnostic::main_branch<typename detail::layer_diagnostic_name<Main>::type>;
  using shortcut_branch_t = meshlib::diagnostic::shortcut_branch<typename detail::layer_diagnostic_name<Shortcut>::type>;

  /// `h + s` into the residual's buffer, after checking that the branches' blocks have one shape.
  template <class X>
  X sum(const X& h, const X& s) {
    const std::size_t dev = h.device();
    if (h.extent(0) != s.extent(0) || h.extent(1) != s.extent(1))
      throw sharding_error("meshlib::nn: residual: on device " + std::to_string(dev) + " the main branch returned (" +
                           std::to_string(h.extent(0)) + ", " + std::to_string(h.extent(1)) + ") and the shortcut (" +
                           std::to_string(s.extent(0)) + ", " + std::to_string(s.extent(1)) +
                           "); the branches must return the same shape");
    const std::size_t n = h.size();
    rows_[dev] = {h.extent(0), h.extent(1), true};
    T* y = out_.get(dev, n);
    const T* hp = h.data();
    const T* sp = s.data();
    detail::sum_values<default_memory_space>(y, hp, sp, n);
    return X(typename X::view_type(y, h.extent(0), h.extent(1)), h.mesh(), dev);
  }

  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::vector<shape> rows_;  // per device: the last forward's output shape
  detail::device_buffers<T> out_, dx_;
};

/// @brief `residual<T, Main, Shortcut>` with the branch types deduced: `make_residual<float>(mesh, main)`.
template <class T, mesh_type Mesh, class Main, class Shortcut = identity<T>>
residual<T, Main, Shortcut> make_residual(const Mesh& mesh, Main main, Shortcut shortcut = Shortcut{}) {
  return residual<T, Main, Shortcut>(mesh, std::move(main), std::move(shortcut));
}

}  // namespace meshlib::nn
