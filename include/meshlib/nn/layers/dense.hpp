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
#include "meshlib/nn/detail/buffers.hpp"
#include "meshlib/nn/detail/gemm.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/matmul.hpp"

namespace meshlib::nn {

/// @brief How a dense layer's weight is split (see the file comment).
enum class dense_kind { replicated, column, row };

namespace detail {
template <dense_kind K, fixed_string Model>
struct dense_specs {
  using w = P<none, none>;
  using b = P<none>;
};
template <fixed_string Model>
struct dense_specs<dense_kind::column, Model> {
  using w = P<none, dim_spec(Model.chars)>;
  using b = P<dim_spec(Model.chars)>;
};
template <fixed_string Model>
struct dense_specs<dense_kind::row, Model> {
  using w = P<dim_spec(Model.chars), none>;
  using b = P<none>;
};

/// The local type of `W^T` for a weight block of type `W` (dims swapped; nothing runs).
template <class W>
using transposed_t = with_dims_t<W, dim_masks<W::dims_type::at(1), W::dims_type::at(0)>>;
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
      : w(name + ".w", w_sharding{mesh}, {in, out}, key,
          init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out)))), true, local_devices),
        b(name + ".b", b_sharding{mesh}, {out}, key, init::zeros(), false, local_devices),
        saved_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// `y = x W + b` (`row`: `psum<Model>(x W) + b`). Saves `x` for the backward pass.
  template <local_tensor_type X>
  auto forward(const X& x) {
    const std::size_t dev = x.device();
    const w_local wl = w.local(dev);
    using Z = decltype(meshlib::matmul(x, wl));  // the GSPMD rules check the shardings here
    using Y = typename detail::psum_if<Kind == dense_kind::row, Z, Model>::type;
    const std::size_t rows = x.extent(0), in = x.extent(1), out = wl.extent(1);
    saved_[dev] = {x.data(), rows, in};
    T* y = out_.get(dev, rows * out);
    const T* bias = b.value.local(dev).data();
    if constexpr (Kind == dense_kind::row) {
      nn::detail::gemm<T>(false, false, rows, out, in, T{1}, x.data(), wl.data(), T{0}, y);
      auto z = detail::wrap2<Z>(y, rows, out, x.mesh(), dev);
      static_cast<void>(detail::psum_in_place<Model>(z));
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = 0; j < out; ++j) y[i * out + j] += bias[j];
    } else {
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = 0; j < out; ++j) y[i * out + j] = bias[j];
      nn::detail::gemm<T>(false, false, rows, out, in, T{1}, x.data(), wl.data(), T{1}, y);
    }
    return detail::wrap2<Y>(y, rows, out, x.mesh(), dev);
  }

  /// Accumulates `dW += x^T dy`, `db += sum_rows dy` (overwrites them when `grad_beta` says so) and returns `dx` (when `need_dx`; otherwise a
  /// tensor of the right type and shape whose contents are unspecified).
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    const std::size_t dev = dy.device();
    // The cotangent of psum's input is pvary of the cotangent (no data moves).
    using DYV = typename detail::pvary_if<Kind == dense_kind::row, DY, Model>::type;
    using DXP = decltype(meshlib::matmul(std::declval<const DYV&>(), std::declval<const detail::transposed_t<w_local>&>()));
    // dy W^T is a pending sum over the axes that shard W's output dimension (column_dense): the
    // transpose of the implicit pvary of the replicated input is the psum that completes it.
    constexpr axis_mask pending = DXP::partial & w_sharding::dim_mask(1);
    using DX = typename detail::psum_if<pending != 0, DXP, Model>::type;
    const auto [x, rows, in] = saved_[dev];
    const std::size_t out = dy.extent(1);
    if (dy.extent(0) != rows)
      throw sharding_error("meshlib::nn: " + w.name + ".backward: the cotangent has " + std::to_string(dy.extent(0)) +
                           " rows but the forward input had " + std::to_string(rows));
    const w_local wl = w.local(dev);
    T* gw = w.grad.local(dev).data();
    T* gb = b.grad.local(dev).data();
    nn::detail::gemm<T>(true, false, in, out, rows, T{1}, x, dy.data(), w.grad_beta(dev), gw);
    if (b.grad_beta(dev) == T{0}) std::fill_n(gb, out, T{0});
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < out; ++j) gb[j] += dy.data()[i * out + j];
    T* dx = dx_.get(dev, rows * in);
    if (need_dx) {
      nn::detail::gemm<T>(false, true, rows, in, out, T{1}, dy.data(), wl.data(), T{0}, dx);
      if constexpr (pending != 0) {
        return detail::psum_in_place<Model>(detail::wrap2<DXP>(dx, rows, in, dy.mesh(), dev));
      } else {
        return detail::wrap2<DX>(dx, rows, in, dy.mesh(), dev);
      }
    }
    return detail::wrap2<DX>(dx, rows, in, dy.mesh(), dev);
  }

  /// Appends the parameters' untyped views (optimizers, synchronisation, checkpoints).
  void collect(std::vector<param_ref<T>>& out) const {
    out.push_back(w.ref(true));  // backward writes them with grad_beta
    out.push_back(b.ref(true));
  }

 private:
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0, in = 0;
  };
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
