// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Dense layers `y = x W + b` with forward and backward: replicated (`dense`), and the two
/// halves of Megatron's tensor-parallel MLP, `column_dense` (W sharded on its output dimension, no
/// communication forward) and `row_dense` (W sharded on its input dimension, one `psum` forward).
///
/// Every type of the backward pass comes from the tensor algebra: the cotangent of the output has
/// the output's type; the transpose of the forward's collective gives the next type (the `psum` of
/// `row_dense` transposes to a `pvary`, the implicit `pvary` of `column_dense`'s replicated input to
/// a `psum`), and `sequential` checks that each layer hands back a cotangent of exactly its input's
/// type, so a sharding mistake in a backward pass is a compile error.
///
/// | layer | W | b | forward | backward (dx) |
/// | --- | --- | --- | --- | --- |
/// | `dense` | `P<none, none>` | `P<none>` | `x W + b` | `dy W^T` |
/// | `column_dense<Model>` | `P<none, Model>` | `P<Model>` | `x W_b + b_b`: output columns sharded | `psum<Model>(dy W_b^T)` |
/// | `row_dense<Model>` | `P<Model, none>` | `P<none>` | `psum<Model>(x_b W_b) + b` | `pvary<Model>(dy) W_b^T`: sharded |
///
/// Weight gradients are `x^T dy`: a contraction over the batch, so a pending sum over the data axis
/// (what the data-parallel synchronisation completes); they accumulate (`+=`) over the micro-batches
/// of a step, and the first backward of a `train_step` overwrites them (`parameter::grad_beta`).
/// Every product is one `matmul_into` into the layer's own buffers (transposes read, not made).
///
/// Shapes are checked, never taken on trust: an input whose sharding does not fit the weight does
/// not compile (one error); an input or cotangent whose width is not the weight's throws
/// `sharding_error` naming the layer, both widths (global, and per device when sharded) and the fix.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// mesh_t m{4, 2};
/// meshlib::nn::column_dense<float, mesh_t> fc1(m, "fc1", 784, 1024, meshlib::nn::rng_key{0});
/// meshlib::nn::row_dense<float, mesh_t> fc2(m, "fc2", 1024, 1024, meshlib::nn::rng_key{0});
/// // inside spmd: auto h = fc1.forward(x); auto y = fc2.forward(h);   // y replicated over model
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/reductions.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/matmul.hpp"
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

/// @brief How a dense layer's weight is split (see the file comment).
enum class dense_kind { replicated, column, row };

namespace detail {
// Conditionals, not specialisations on <dense_kind::column, Model>: nvcc's front end matches no
// partial specialisation that deduces a fixed_string (collectives/axis_group.hpp), and would give
// every kind the unsharded specs.
template <dense_kind K, fixed_string Model>
struct dense_specs {
  using w = std::conditional_t<K == dense_kind::column, P<none, dim_spec(Model.chars)>,
                               std::conditional_t<K == dense_kind::row, P<dim_spec(Model.chars), none>, P<none, none>>>;
  using b = std::conditional_t<K == dense_kind::column, P<dim_spec(Model.chars)>, P<none>>;
};

/// The local type of `W^T` for a weight block of type `W` (dims swapped; nothing runs).
template <class W>
using transposed_t = with_dims_t<W, dim_masks<W::dims_type::at(1), W::dims_type::at(0)>>;

template <dense_kind K>
struct dense_kind_name {
  static constexpr fixed_string value = "dense";
};
template <>
struct dense_kind_name<dense_kind::column> {
  static constexpr fixed_string value = "column_dense";
};
template <>
struct dense_kind_name<dense_kind::row> {
  static constexpr fixed_string value = "row_dense";
};

/// See `basic_dense::accepts_input`.
template <class X, class Mesh, class T, axis_mask WRows, axis_mask WCols>
consteval bool dense_accepts() {
  if constexpr (!std::is_same_v<typename X::mesh_type, Mesh> ||
                !std::is_same_v<typename X::value_type, T>) {
    return false;
  } else if constexpr (X::rank != 2) {
    return false;
  } else {
    return X::partial == 0 && X::dims_type::at(1) == WRows && (X::dims_type::at(0) & WCols) == 0;
  }
}

template <class Layer, class Receives, class Needs>
consteval bool dense_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: a dense layer cannot take this input: the condition spells out "
                "dense_input_does_not_fit<the layer's kind, the input's layout, what it needs>. A row_dense needs its "
                "features sharded over its model axis (the output of a column_dense); a dense or column_dense needs "
                "complete, unsharded features (the output of a dense or row_dense, or all_gather them); no dense "
                "layer takes a pending sum (psum it first)");
  return false;
}
}  // namespace detail

/// @brief A dense layer; see `dense`, `column_dense`, `row_dense`.
template <class T, mesh_type Mesh, dense_kind Kind, fixed_string Model = "model">
class basic_dense {
 public:
  /// The sharding of the weight: replicated (`dense`), split over `Model` by output columns
  /// (`column_dense`) or by input rows (`row_dense`).
  using w_sharding = named_sharding<Mesh, typename detail::dense_specs<Kind, Model>::w>;
  /// The sharding of the bias: split over `Model` with the output columns (`column_dense`), else replicated.
  using b_sharding = named_sharding<Mesh, typename detail::dense_specs<Kind, Model>::b>;
  /// The weight, `in x out`.
  using weight_type = parameter<T, 2, w_sharding>;
  /// The bias, `out`.
  using bias_type = parameter<T, 1, b_sharding>;
  /// A device's block of the weight.
  using w_local = typename weight_type::local_type;

  /// The weight `W` (`y = x W + b`); its name is `name + ".w"`.
  weight_type w;
  /// The bias `b`; its name is `name + ".b"`.
  bias_type b;

  /// `in -> out` features; W ~ Glorot uniform from `key` (mesh-invariant), b = 0. Parameters are
  /// named `name + ".w"` / `".b"`. `local_devices`: this process's devices (empty: all).
  basic_dense(const Mesh& mesh, const std::string& name, std::size_t in, std::size_t out, rng_key key,
              std::span<const std::size_t> local_devices = {})
      : w(name + ".w", w_sharding{mesh}, {checked_split(mesh, name, in, out), out}, key,
          init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out)))), true, local_devices),
        b(name + ".b", b_sharding{mesh}, {out}, key, init::zeros(), false, local_devices),
        name_(name),
        saved_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// The layer's name: its parameters are `name() + ".w"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The global number of input features (rows of W).
  [[nodiscard]] std::size_t in_features() const noexcept { return w.value.global_shape()[0]; }
  /// The global number of output features (columns of W).
  [[nodiscard]] std::size_t out_features() const noexcept { return w.value.global_shape()[1]; }
  /// `"fc2 (row_dense 32 -> 4, input sharded over 'model')"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    std::string s = name_ + " (" + std::string(kind_name.view()) + " " + std::to_string(in_features()) + " -> " +
                    std::to_string(out_features());
    if constexpr (w_sharding::dim_mask(0) != 0) s += ", input" + detail::sharded_over_text<Mesh>(w_sharding::dim_mask(0));
    if constexpr (w_sharding::dim_mask(1) != 0) s += ", output" + detail::sharded_over_text<Mesh>(w_sharding::dim_mask(1));
    return s + ")";
  }

  /// The kind, as messages spell it: `dense`, `column_dense` or `row_dense`.
  static constexpr fixed_string kind_name = detail::dense_kind_name<Kind>::value;
  /// Whether `forward(X)` is legal: the rules of `matmul(x, W)` (the input's features sharded as W's
  /// rows, no axis on both the rows and W's columns), for a complete (not pending-sum) input of
  /// this mesh and element type.
  template <class X>
  static constexpr bool accepts_input = detail::dense_accepts<X, Mesh, T, w_sharding::dim_mask(0), w_sharding::dim_mask(1)>();
  /// For compile-time messages: the kind, and what the input's features must be sharded over.
  using diagnostic_name = meshlib::diagnostic::op_t<kind_name>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<meshlib::diagnostic::axes_t<Mesh, w_sharding::dim_mask(0)>>;

  /// `y = x W + b` (`row`: `psum<Model>(x W) + b`). Saves `x` for the backward pass.
  /// @throws sharding_error when `x`'s width is not the weight's input width.
  template <local_tensor_type X>
  auto forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"dense.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::dense_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = x.device();
      const w_local wl = w.local(dev);
      using Z = decltype(meshlib::matmul(x, wl));  // the GSPMD rules check the shardings here
      using Y = typename detail::psum_if<Kind == dense_kind::row, Z, Model>::type;
      const std::size_t rows = x.extent(0), in = x.extent(1), out = wl.extent(1);
      if (in != wl.extent(0)) throw sharding_error(input_width_error(in, wl.extent(0), x.mesh()));
      saved_[dev] = {x.data(), rows, in};
      T* y = out_.get(dev, rows * out);
      const T* bias = b.value.local(dev).data();
      const cview xv(x.data(), rows, in), wv(wl.data(), in, out);
      if constexpr (Kind == dense_kind::row) {
        matmul_into(view(y, rows, out), xv, wv);
        // Donated: z wraps the layer's own buffer (an unmanaged view), so the sum lands in it.
        static_cast<void>(meshlib::psum<Model>(detail::wrap2<Z>(y, rows, out, x.mesh(), dev)));
        detail::add_bias<default_memory_space>(y, bias, rows, out, true);
      } else {
        detail::add_bias<default_memory_space>(y, bias, rows, out, false);  // y = b, then y += x W
        matmul_into(view(y, rows, out), xv, wv, {.beta = 1});
      }
      return detail::wrap2<Y>(y, rows, out, x.mesh(), dev);
    }
  }

  /// Accumulates `dW += x^T dy`, `db += sum_rows dy` (overwrites them when `grad_beta` says so) and returns `dx` (when `need_dx`; otherwise a
  /// tensor of the right type and shape whose contents are unspecified).
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output, or no
  /// forward ran on this device.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"dense.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved s = checked_saved(dy);
    // db (+)= the column sums of dy, each column's rows added in row order (bitwise the same on every mesh).
    detail::bias_grad<default_memory_space>(b.grad.local(dev).data(), dy.data(), s.rows, s.out, b.grad_beta(dev) == T{0});
    return backward_products(dy, s, need_dx);
  }

  /// `backward` fused with the backward of the elementwise activation `Fn` that ran on this layer's
  /// output (`sequential` calls it for a dense layer followed by `relu` or `gelu`): `dy` is the
  /// cotangent of the activation's output, `act_x` the activation's saved input (this layer's
  /// output) and `d` where the activation's cotangent goes (the activation's buffer). The
  /// activation's cotangent and this layer's bias gradient are one kernel
  /// (`detail::activation_bias_backward`) where they were two; the results are bitwise those of
  /// the activation's `backward` followed by this `backward`.
  /// @throws sharding_error as `backward` does.
  template <class Fn, local_tensor_type DY>
  auto backward_through(const DY& dy, const T* act_x, T* d, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"dense.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved s = checked_saved(dy);
    detail::activation_bias_backward<default_memory_space, Fn>(d, b.grad.local(dev).data(), dy.data(), act_x, s.rows,
                                                               s.out, b.grad_beta(dev) == T{0});
    return backward_products(DY(typename DY::view_type(d, s.rows, s.out), dy.mesh(), dev), s, need_dx);
  }

  /// Whether `sequential` may fuse the backward of an elementwise activation after this layer into
  /// this layer's (`backward_through`).
  static constexpr bool fuses_activation_backward = true;

  /// Appends the parameters' untyped views (optimizers, synchronisation, checkpoints).
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(w.ref(true));  // backward writes them with grad_beta
    out.push_back(b.ref(true));
  }

 private:
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0, in = 0, out = 0;
  };

  /// This device's saved forward, after checking `dy` against it (`out`: the weight block's width).
  template <class DY>
  saved checked_saved(const DY& dy) const {
    saved s = saved_[dy.device()];
    s.out = w.local(dy.device()).extent(1);
    check_cotangent(dy, s.x, s.rows, s.out);
    return s;
  }

  /// The products of the backward pass, after the bias gradient: `dW (+)= x^T dy`, and `dx = dy W^T`
  /// when `need_dx` (completed by a `psum` over `Model` for `column_dense`).
  template <class DY>
  auto backward_products(const DY& dy, const saved& s, bool need_dx) {
    const std::size_t dev = dy.device();
    // The cotangent of psum's input is pvary of the cotangent (no data moves).
    using DYV = typename detail::pvary_if<Kind == dense_kind::row, DY, Model>::type;
    using DXP = decltype(meshlib::matmul(std::declval<const DYV&>(), std::declval<const detail::transposed_t<w_local>&>()));
    // dy W^T is a pending sum over the axes that shard W's output dimension (column_dense): the
    // transpose of the implicit pvary of the replicated input is the psum that completes it.
    constexpr axis_mask pending = DXP::partial & w_sharding::dim_mask(1);
    using DX = typename detail::psum_if<pending != 0, DXP, Model>::type;
    const w_local wl = w.local(dev);
    const std::size_t rows = s.rows, in = s.in, out = s.out;
    T* gw = w.grad.local(dev).data();
    const cview dyv(dy.data(), rows, out);
    matmul_into(view(gw, in, out), cview(s.x, rows, in), dyv, {.transpose_a = true, .beta = static_cast<double>(w.grad_beta(dev))});
    T* dx = dx_.get(dev, rows * in);
    if (need_dx) {
      matmul_into(view(dx, rows, in), dyv, cview(wl.data(), in, out), {.transpose_b = true});
      if constexpr (pending != 0) {
        return meshlib::psum<Model>(detail::wrap2<DXP>(dx, rows, in, dy.mesh(), dev));  // donated: in place
      } else {
        return detail::wrap2<DX>(dx, rows, in, dy.mesh(), dev);
      }
    }
    return detail::wrap2<DX>(dx, rows, in, dy.mesh(), dev);
  }
  // Unmanaged views of the layer's buffers and the tensors' blocks (no reference count touched).
  using cview = meshlib::unmanaged_block_view<const T, 2, default_memory_space>;
  using view = meshlib::unmanaged_block_view<T, 2, default_memory_space>;
  /// `in`, after checking that the width the layer splits over `Model` divides evenly (the output of
  /// a `column_dense`, such as a language model's vocabulary, the input of a `row_dense`): the
  /// message names the layer, the width and the fix, where the sharding's own would name only a
  /// dimension of the weight.
  static std::size_t checked_split(const Mesh& mesh, const std::string& name, std::size_t in, std::size_t out) {
    if constexpr (Kind != dense_kind::replicated) {
      constexpr bool column = Kind == dense_kind::column;
      const std::size_t n = mesh.axes_size(Mesh::template mask_of<Model>()), width = column ? out : in;
      if (width % n != 0)
        throw sharding_error("meshlib::nn: " + name + " (" + std::string(kind_name.view()) + " " + std::to_string(in) +
                             " -> " + std::to_string(out) + "): its " + std::to_string(width) +
                             (column ? " outputs" : " inputs") + " are not divisible by the " + std::to_string(n) +
                             " devices of the model axis '" + std::string(Model.view()) +
                             "' it splits them over; use a width divisible by " + std::to_string(n) +
                             (column ? " (pad a vocabulary to " + std::to_string((width + n - 1) / n * n) +
                                           " with ids that never occur)"
                                     : std::string()) +
                             " or a model axis whose size divides " + std::to_string(width));
    }
    return in;
  }

  std::string input_width_error(std::size_t got, std::size_t want, const Mesh& mesh) const {
    constexpr axis_mask axes = w_sharding::dim_mask(0);
    const std::size_t n = mesh.axes_size(axes);
    std::string fix = "; it takes " + std::to_string(in_features());
    if (axes != 0 && n != 1) fix += " (" + std::to_string(want) + " per device)";
    return "meshlib::nn: " + to_string() + " received " + detail::width_text(got, axes, mesh) + fix + ": feed it " +
           std::to_string(in_features()) + " features or declare " + name_ + " with " + std::to_string(got * n) +
           " inputs";
  }

  template <class DY>
  void check_cotangent(const DY& dy, const T* x, std::size_t rows, std::size_t out) const {
    const std::string head = "meshlib::nn: " + to_string() + ".backward";
    if (x == nullptr)
      throw sharding_error(head + " ran on device " + std::to_string(dy.device()) +
                           " before any forward there; run forward first (backward uses its saved input)");
    constexpr axis_mask axes = w_sharding::dim_mask(1);
    if (dy.extent(1) != out) {
      const std::size_t n = dy.mesh().axes_size(axes);
      std::string outputs = std::to_string(out_features());
      if (axes != 0 && n != 1) outputs += " (" + std::to_string(out) + " per device)";
      throw sharding_error(head + " received a cotangent of " + detail::width_text(dy.extent(1), axes, dy.mesh()) +
                           ", but the layer outputs " + outputs + "; pass the cotangent of this layer's output");
    }
    if (dy.extent(0) != rows)
      throw sharding_error(head + " received a cotangent of " + std::to_string(dy.extent(0)) + " rows on device " +
                           std::to_string(dy.device()) + ", but the forward input there had " + std::to_string(rows) +
                           "; pass the cotangent of the last forward's output");
  }

  std::string name_;
  std::vector<saved> saved_;
  detail::device_buffers<T> out_, dx_;
};

/// @brief A dense layer with replicated parameters.
template <class T, mesh_type Mesh>
using dense = basic_dense<T, Mesh, dense_kind::replicated>;
/// @brief Megatron's column-parallel dense: W `P<none, Model>`, output columns sharded over `Model`.
template <class T, mesh_type Mesh, fixed_string Model = "model">
using column_dense = basic_dense<T, Mesh, dense_kind::column, Model>;
/// @brief Megatron's row-parallel dense: W `P<Model, none>`, input columns sharded, output replicated.
template <class T, mesh_type Mesh, fixed_string Model = "model">
using row_dense = basic_dense<T, Mesh, dense_kind::row, Model>;

}  // namespace meshlib::nn
