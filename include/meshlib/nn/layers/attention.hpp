// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `causal_self_attention`: multi-head causal self-attention with its heads sharded over a
/// model axis (Megatron's `ParallelAttention`; `flax.linen.MultiHeadDotProductAttention` with a
/// causal mask, `torch.nn.MultiheadAttention(..., is_causal=True)` when the axis has one device),
/// with forward and backward.
///
/// Layout: the rows are tokens, `batch * sequence` of them, sequence-major (row `i` of a device's
/// block is position `i % sequence_length()` of sequence `i / sequence_length()`), the features
/// complete; the rows may be sharded over the data axis as long as each device holds whole sequences.
/// The output has the input's type and shape.
///
/// Tensor parallelism, as Megatron splits it (one `psum` forward, one backward):
/// - the fused Q, K, V projection is a `column_dense` (`features -> 3 features`, no communication),
///   its columns ordered head by head (`[head][q, k, v][head_dim]`), so a device's block of columns
///   is exactly its `heads / n` heads' queries, keys and values;
/// - each device attends with its own heads: `softmax(mask(Q K^T / sqrt(head_dim))) V` per sequence
///   and head, no communication;
/// - the heads' outputs, concatenated (sharded over the model axis), go through a `row_dense`
///   (`features -> features`) whose `psum` completes the output. Backward is the transpose: a `pvary`
///   into the output projection, the `psum` of the input's cotangent in the QKV projection.
///
/// The softmax runs in the layer's element type (float for a float model) with each row's maximum
/// subtracted, over the positions `j <= i` only (the causal mask: those above are exactly 0).
/// Products are `matmul_into` calls on each (sequence, head) block; the rearrangements between the
/// fused projection's layout and per-head contiguous blocks, the softmax and its backward are
/// Kokkos kernels on the running device's instance.
///
/// Parameters: `name + ".qkv.w"`, `".qkv.b"` (the fused projection) and `".out.w"`, `".out.b"`.
/// The number of heads must be divisible by the size of the model axis (a `sharding_error` at
/// construction names the layer, the heads, the axis size and the fix), and the width by the heads.
/// @code
/// meshlib::nn::causal_self_attention<float, mesh_t> attn(m, "attn", 128, 4, 64, key);  // width 128, 4 heads, sequences of 64
/// // inside spmd: auto y = attn.forward(x);   // x: (batch * 64, 128), rows sharded over data
/// @endcode

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/attention_kernels.hpp"
#include "meshlib/nn/layers/dense.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

/// @brief Multi-head causal self-attention, heads sharded over `Model` (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model">
class causal_self_attention {
 public:
  /// The mesh axes of `Model`.
  static constexpr axis_mask model_mask = Mesh::template mask_of<Model>();

 private:
  std::string name_;  // first: its initialiser checks the sizes before the projections are made

 public:
  /// The fused Q, K, V projection, `features -> 3 features`, columns `[head][q, k, v][head_dim]`.
  column_dense<T, Mesh, Model> qkv;
  /// The output projection, `features -> features`, rows `[head][head_dim]`.
  row_dense<T, Mesh, Model> proj;

  /// `features` values per token, split into `heads` heads of `features / heads`; sequences of
  /// `sequence_length` tokens. `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `heads` is not divisible by the size of `Model`, or `features` by `heads`.
  causal_self_attention(const Mesh& mesh, const std::string& name, std::size_t features, std::size_t heads,
                        std::size_t sequence_length, rng_key key, std::span<const std::size_t> local_devices = {})
      : name_(checked_name(mesh, name, features, heads)),
        qkv(mesh, name + ".qkv", features, 3 * features, key, local_devices),
        proj(mesh, name + ".out", features, features, key, local_devices),
        heads_(heads),
        saved_(mesh.size()),
        qkvh_(mesh.size()),
        probs_(mesh.size()),
        oh_(mesh.size()),
        ocat_(mesh.size()),
        doh_(mesh.size()),
        dqkvh_(mesh.size()),
        dprobs_(mesh.size()),
        dqkv_(mesh.size()) {
    set_sequence_length(sequence_length);
  }

  /// The layer's name: its parameters are `name() + ".qkv.w"`, `".qkv.b"`, `".out.w"`, `".out.b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width of a token: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return proj.out_features(); }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// The number of heads (over all devices of the model axis).
  [[nodiscard]] std::size_t heads() const noexcept { return heads_; }
  /// The tokens per sequence of the inputs.
  [[nodiscard]] std::size_t sequence_length() const noexcept { return seq_; }
  /// Sets the tokens per sequence of the next inputs (a shorter context for generation).
  /// @throws sharding_error when `s` is 0.
  void set_sequence_length(std::size_t s) {
    if (s == 0)
      throw sharding_error("meshlib::nn: " + to_string() + ": a sequence length of 0; give it the tokens per sequence");
    seq_ = s;
  }
  /// `"attn (causal_self_attention 128 features, 4 heads sharded over 'model', sequences of 64)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (causal_self_attention " + std::to_string(in_features()) + " features, " + std::to_string(heads_) +
           " heads" + detail::sharded_over_text<Mesh>(model_mask) + ", sequences of " + std::to_string(seq_) + ")";
  }

  /// The input of a `column_dense`: complete, unsharded features.
  template <class X>
  static constexpr bool accepts_input = column_dense<T, Mesh, Model>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"causal_self_attention">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The attention of every token of this device to the tokens before it in its sequence.
  /// @throws sharding_error when `x` is not whole sequences of the layer's width.
  template <local_tensor_type X>
  auto forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"causal_self_attention.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(
          detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0), seq = seq_;
      detail::check_whole_sequences(to_string(), rows, seq, dev);
      auto y = qkv.forward(x);  // checks the width; (rows, 3 * local heads * head_dim)
      using H = decltype(y);    // features sharded over Model: the layout of the heads' outputs too
      const std::size_t hl = heads_ / x.mesh().axes_size(model_mask), hd = in_features() / heads_, nb = rows / seq;
      saved_[dev] = {rows, seq, true};
      // [q, k, v][local head][token][head_dim]: each (sequence, head) block contiguous, for the products.
      T* qh = qkvh_.get(dev, 3 * hl * rows * hd);
      const T* yp = y.data();
      detail::split_heads<default_memory_space>(qh, yp, rows, hl, hd);
      T* p = probs_.get(dev, hl * nb * seq * seq);  // [head][sequence][i][j]
      T* oh = oh_.get(dev, hl * rows * hd);         // [head][token][head_dim]
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      // One batch of hl * nb products each (a strided-batched cuBLAS call on a GPU): S = scale Q K^T, O = P V.
      const std::size_t g = hl * nb;
      matmul_into(view3(p, g, seq, seq), cview3(part(qh, 0, hl, rows, hd), g, seq, hd), cview3(part(qh, 1, hl, rows, hd), g, seq, hd),
                  {.transpose_b = true, .alpha = scale});
      detail::causal_softmax<default_memory_space>(p, hl * nb * seq, seq);
      matmul_into(view3(oh, g, seq, hd), cview3(p, g, seq, seq), cview3(part(qh, 2, hl, rows, hd), g, seq, hd));
      T* oc = ocat_.get(dev, rows * hl * hd);  // (token, [head][head_dim]): the output projection's input
      const T* ohp = oh;
      detail::merge_heads<default_memory_space>(oc, ohp, rows, hl, hd);
      return proj.forward(detail::wrap2<H>(oc, rows, hl * hd, x.mesh(), dev));
    }
  }

  /// The cotangent of the input (when `need_dx`); accumulates the projections' gradients.
  /// @throws sharding_error when no forward ran on this device or `dy` is not its output's shape.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"causal_self_attention.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      if (!saved_[dev].ran)
        throw sharding_error("meshlib::nn: " + to_string() + ".backward ran on device " + std::to_string(dev) +
                             " before any forward there; run forward first (backward uses what it saved)");
      const std::size_t rows = saved_[dev].rows, seq = saved_[dev].seq;  // the forward's, whatever was set since
      auto dout = proj.backward(dy, true);  // checks dy; (rows, local heads * head_dim)
      using H = decltype(dout);
      const std::size_t hl = heads_ / dy.mesh().axes_size(model_mask), hd = in_features() / heads_, nb = rows / seq;
      const T* qh = qkvh_.get(dev, 3 * hl * rows * hd);
      const T* p = probs_.get(dev, hl * nb * seq * seq);
      T* doh = doh_.get(dev, hl * rows * hd);
      const T* dop = dout.data();
      detail::unmerge_heads<default_memory_space>(doh, dop, rows, hl, hd);
      T* dqh = dqkvh_.get(dev, 3 * hl * rows * hd);  // [dq, dk, dv][head][token][head_dim]
      T* dp = dprobs_.get(dev, hl * nb * seq * seq);
      const std::size_t g = hl * nb;
      const auto pb = cview3(p, g, seq, seq);
      const auto dob = cview3(doh, g, seq, hd);
      // dV = P^T dO; dP = dO V^T (each a batch over heads and sequences)
      matmul_into(view3(part(dqh, 2, hl, rows, hd), g, seq, hd), pb, dob, {.transpose_a = true});
      matmul_into(view3(dp, g, seq, seq), dob, cview3(part(qh, 2, hl, rows, hd), g, seq, hd), {.transpose_b = true});
      detail::causal_softmax_backward<default_memory_space>(p, dp, hl * nb * seq, seq, static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd))));
      const auto dsb = cview3(dp, g, seq, seq);
      // dQ = dS K; dK = dS^T Q (dS already holds the scale)
      matmul_into(view3(part(dqh, 0, hl, rows, hd), g, seq, hd), dsb, cview3(part(qh, 1, hl, rows, hd), g, seq, hd));
      matmul_into(view3(part(dqh, 1, hl, rows, hd), g, seq, hd), dsb, cview3(part(qh, 0, hl, rows, hd), g, seq, hd),
                  {.transpose_a = true});
      T* dq = dqkv_.get(dev, rows * 3 * hl * hd);  // back to the fused projection's column order
      const T* dqhp = dqh;
      detail::unsplit_heads<default_memory_space>(dq, dqhp, rows, hl, hd);
      return qkv.backward(detail::wrap2<H>(dq, rows, 3 * hl * hd, dy.mesh(), dev), need_dx);
    }
  }

  /// Appends the projections' parameters to `out`: `.qkv.w`, `.qkv.b`, `.out.w`, `.out.b`.
  void collect(std::vector<param_ref<T>>& out) {
    qkv.collect(out);
    proj.collect(out);
  }

 private:
  using cview3 = meshlib::unmanaged_block_view<const T, 3, default_memory_space>;
  using view3 = meshlib::unmanaged_block_view<T, 3, default_memory_space>;

  /// Part `t` (q, k, v) of a `[part][head][token][head_dim]` buffer: `hl * rows / seq` blocks of
  /// `seq x head_dim`, one per (head, sequence), each contiguous and `seq * head_dim` apart, the
  /// batch the products run over (the probabilities' `[head][sequence][i][j]` blocks likewise).
  static T* part(T* base, std::size_t t, std::size_t hl, std::size_t rows, std::size_t hd) {
    return base + t * hl * rows * hd;
  }
  static const T* part(const T* base, std::size_t t, std::size_t hl, std::size_t rows, std::size_t hd) {
    return base + t * hl * rows * hd;
  }


 private:
  static std::string checked_name(const Mesh& mesh, const std::string& name, std::size_t features, std::size_t heads) {
    const std::size_t n = mesh.axes_size(model_mask);
    const std::string who = "meshlib::nn: " + name + " (causal_self_attention " + std::to_string(features) +
                            " features, " + std::to_string(heads) + " heads)";
    if (heads == 0 || heads % n != 0)
      throw sharding_error(who + ": " + std::to_string(heads) + " heads are not divisible by the " + std::to_string(n) +
                           " devices of the model axis '" + std::string(Model.view()) +
                           "' the heads are sharded over; use a number of heads divisible by " + std::to_string(n) +
                           " or a model axis whose size divides " + std::to_string(heads));
    if (features % heads != 0)
      throw sharding_error(who + ": " + std::to_string(features) + " features do not split into " +
                           std::to_string(heads) + " heads; use a width divisible by the number of heads");
    return name;
  }

  struct saved {
    std::size_t rows = 0, seq = 0;
    bool ran = false;
  };
  std::size_t heads_, seq_ = 0;
  std::vector<saved> saved_;
  detail::device_buffers<T> qkvh_, probs_, oh_, ocat_, doh_, dqkvh_, dprobs_, dqkv_;
};

}  // namespace meshlib::nn
