// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `tied_head`: a language model's output layer that shares its weight with the token
/// `embedding` (weight tying, as GPT-2; flax's `Embed.attend`, PyTorch's `lm_head.weight =
/// wte.weight`): `logits = x E^T`, with forward and backward.
///
/// The table `E` (`vocab x features`) is sharded over the vocabulary along the model axis, so each
/// device's block of logits is `x E_b^T`: the logits come out sharded over the vocabulary, as a
/// `column_dense` head's do, with no communication, and go to `softmax_cross_entropy` without being
/// gathered. Backward is the transpose: `dE_b += dy^T x` (into the embedding's own gradient, which
/// therefore sums the lookup's and the head's contributions, the gradient of a tied weight), and
/// `dx = dy E_b`, a pending sum over the model axis that one `psum` completes (the transpose of the
/// replicated input's implicit `pvary`, as in `column_dense`).
///
/// The head holds a copy of the embedding's `parameter`: copies share the value and gradient blocks
/// (tensors are handles), so the two layers read and update one array, and `collect` lists it once
/// (from the embedding). Both add into the gradient: `train_step` zeroes it before a step.
/// @code
/// meshlib::nn::embedding<float, mesh_t> tok(m, "tok", 256, 128, key);
/// meshlib::nn::tied_head<float, mesh_t> head(tok);   // logits over the same 256 ids
/// meshlib::nn::sequential gpt(tok, /* ... blocks, final norm ... */ head);
/// @endcode

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/layers/dense.hpp"
#include "meshlib/nn/layers/embedding.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

namespace detail {
template <class Layer, class ModelAxis, class Receives, class Needs>
consteval bool tied_head_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, ModelAxis, Receives, Needs>,
                "meshlib::nn: tied_head takes complete, unsharded features of its mesh (the output of a norm or a "
                "row_dense) and returns logits sharded over its model axis: all_gather (or psum) the features first "
                "(the condition spells out the layer, its model axis, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief The output layer tied to an `embedding` (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model">
class tied_head {
 public:
  /// The embedding it is tied to.
  using embedding_type = embedding<T, Mesh, Model>;
  /// The mesh axes of `Model`.
  static constexpr axis_mask model_mask = embedding_type::model_mask;

  /// Ties the head to `tok`'s table (shared, not copied: see the file comment).
  explicit tied_head(const embedding_type& tok)
      : table_(tok.table), name_(tok.name() + ".attend"), saved_(tok.table.value.num_devices()),
        out_(tok.table.value.num_devices()), dx_(tok.table.value.num_devices()) {}

  /// `"tok.attend"`: the embedding's name and flax's method name.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width it takes.
  [[nodiscard]] std::size_t in_features() const noexcept { return table_.value.global_shape()[1]; }
  /// The vocabulary: the logits' width (over all devices).
  [[nodiscard]] std::size_t out_features() const noexcept { return table_.value.global_shape()[0]; }
  /// `"tok.attend (tied_head 128 -> 256, vocabulary sharded over 'model')"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (tied_head " + std::to_string(in_features()) + " -> " + std::to_string(out_features()) +
           ", vocabulary" + detail::sharded_over_text<Mesh>(model_mask) + ")";
  }

  /// The input of a `column_dense`: complete, unsharded features.
  template <class X>
  static constexpr bool accepts_input = column_dense<T, Mesh, Model>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"tied_head">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `x E_b^T`: this device's block of the logits, sharded over the vocabulary.
  /// @throws sharding_error when `x`'s width is not the embedding's.
  template <local_tensor_type X>
  auto forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"tied_head.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::tied_head_input_does_not_fit<diagnostic_name, meshlib::diagnostic::axis_t<Model>,
                                                             meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      // The logits' type: a column_dense head's for this input (the matmul's sharding rules).
      using W = typename parameter<T, 2, named_sharding<Mesh, typename detail::dense_specs<dense_kind::column, Model>::w>>::local_type;
      using Y = decltype(meshlib::matmul(x, std::declval<const W&>()));
      const std::size_t dev = x.device(), rows = x.extent(0), d = x.extent(1);
      const auto tl = table_.local(dev);
      const std::size_t vl = tl.extent(0);
      if (d != tl.extent(1))
        throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(d) + " features; feed it " +
                             std::to_string(tl.extent(1)) + " features (the width of the embedding it is tied to)");
      saved_[dev] = {x.data(), rows};
      T* y = out_.get(dev, rows * vl);
      matmul_into(view(y, rows, vl), cview(x.data(), rows, d), cview(tl.data(), vl, d), {.transpose_b = true});
      return detail::wrap2<Y>(y, rows, vl, x.mesh(), dev);
    }
  }

  /// Adds `dy^T x` to the embedding's gradient and returns `dx = psum<Model>(dy E_b)` (when `need_dx`).
  /// @throws sharding_error when no forward ran on this device or `dy` is not the logits' shape.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"tied_head.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      using DX = rebind_local_t<DY, T, 2, DY::vary & ~model_mask, 0, dim_masks<DY::dims_type::at(0), axis_mask{0}>>;
      using DXP = with_partial_t<DX, model_mask>;
      const std::size_t dev = dy.device();
      const auto [x, rows] = saved_[dev];
      const auto tl = table_.local(dev);
      const std::size_t vl = tl.extent(0), d = tl.extent(1);
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), x != nullptr, rows, vl);
      const cview dyv(dy.data(), rows, vl);
      matmul_into(view(table_.grad.local(dev).data(), vl, d), dyv, cview(x, rows, d), {.transpose_a = true, .beta = 1});
      T* dx = dx_.get(dev, rows * d);
      if (!need_dx) return detail::wrap2<DX>(dx, rows, d, dy.mesh(), dev);
      matmul_into(view(dx, rows, d), dyv, cview(tl.data(), vl, d));
      if constexpr (model_mask != 0)
        return meshlib::psum<Model>(detail::wrap2<DXP>(dx, rows, d, dy.mesh(), dev));  // donated: in place
      else
        return detail::wrap2<DX>(dx, rows, d, dy.mesh(), dev);
    }
  }

  /// Nothing: the table is the embedding's, which lists it.
  void collect(std::vector<param_ref<T>>&) {}
  /// The embedding's table, which it reads and adds gradients to without listing it: a pipeline
  /// stage that holds this head but not the embedding mirrors the table (nn/parallel/pipeline.hpp).
  void collect_tied(std::vector<param_ref<T>>& out) { out.push_back(table_.ref()); }

 private:
  using cview = meshlib::unmanaged_block_view<const T, 2, default_memory_space>;
  using view = meshlib::unmanaged_block_view<T, 2, default_memory_space>;
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0;
  };
  typename embedding_type::table_type table_;  // shares the embedding's blocks
  std::string name_;
  std::vector<saved> saved_;
  detail::device_buffers<T> out_, dx_;
};

}  // namespace meshlib::nn
