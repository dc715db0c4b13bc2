// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `transformer_block`: the pre-norm decoder block of GPT-2 and its successors,
/// `h = x + attn(norm1(x))`, `y = h + mlp(norm2(h))` with `mlp = row_dense(gelu(column_dense(.)))`,
/// with forward and backward, a layer of `sequential` like any other.
///
/// Tensor parallelism is Megatron's: the attention's heads and the MLP's hidden units are sharded
/// over the model axis, each half a column-parallel then a row-parallel product, so a block costs two
/// `psum`s forward (one per half) and two backward; the norms and the residual additions are
/// replicated over the model axis and need none. The residual branches' cotangents are added (the
/// cotangent of `x + f(x)` is `dy + f'(x)^T dy`) by a Kokkos kernel on the running device's instance.
///
/// `Norm` is `layer_norm` (GPT-2, the default) or `rms_norm` (Llama); GELU is the tanh form
/// (`jax.nn.gelu`'s default). Layout: as `causal_self_attention` (rows `batch * sequence` tokens,
/// sequence-major, whole sequences per device). Parameters: `name + ".ln1"`, `".attn"`, `".ln2"`,
/// `".mlp.fc1"`, `".mlp.fc2"` and their own suffixes.
/// @code
/// meshlib::nn::transformer_block<float, mesh_t> blk(m, "h0", 128, 4, 512, 64, key);  // width 128, 4 heads, MLP 512, sequences of 64
/// // inside spmd: auto y = blk.forward(x);
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/activation.hpp"
#include "meshlib/nn/layers/attention.hpp"
#include "meshlib/nn/layers/dense.hpp"
#include "meshlib/nn/layers/layer_norm.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"

namespace meshlib::nn {

/// @brief A pre-norm Transformer decoder block (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model", class Norm = layer_norm<T, Mesh>>
class transformer_block {
 public:
  Norm ln1;                                   ///< before the attention
  causal_self_attention<T, Mesh, Model> attn;  ///< heads sharded over `Model`
  Norm ln2;                                   ///< before the MLP
  column_dense<T, Mesh, Model> fc1;           ///< `features -> mlp_features`, hidden units sharded
  gelu<T> act;                                ///< tanh GELU
  row_dense<T, Mesh, Model> fc2;              ///< `mlp_features -> features`, one psum

  /// `features` values per token, `heads` heads, an MLP of `mlp_features` hidden units (4 x
  /// features in GPT-2), sequences of `sequence_length` tokens.
  /// @throws sharding_error when the heads or the MLP's hidden units do not divide over `Model`.
  transformer_block(const Mesh& mesh, const std::string& name, std::size_t features, std::size_t heads,
                    std::size_t mlp_features, std::size_t sequence_length, rng_key key,
                    std::span<const std::size_t> local_devices = {})
      : ln1(mesh, name + ".ln1", features, T(1e-5), local_devices),
        attn(mesh, name + ".attn", features, heads, sequence_length, key, local_devices),
        ln2(mesh, name + ".ln2", features, T(1e-5), local_devices),
        fc1(mesh, name + ".mlp.fc1", features, mlp_features, key, local_devices),
        act(mesh),
        fc2(mesh, name + ".mlp.fc2", mlp_features, features, key, local_devices),
        name_(name),
        h_(mesh.size()),
        y_(mesh.size()),
        dh_(mesh.size()),
        dx_(mesh.size()) {}

  /// The block's name: the prefix of its parameters.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width of a token: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return attn.in_features(); }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// `"h0 (transformer_block 128 features, 4 heads, MLP 512)"`: how messages name the block.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (transformer_block " + std::to_string(in_features()) + " features, " +
           std::to_string(attn.heads()) + " heads, MLP " + std::to_string(fc1.out_features()) + ")";
  }
  /// Sets the tokens per sequence of the next inputs (the attention's).
  void set_sequence_length(std::size_t s) { attn.set_sequence_length(s); }

  /// Complete, unsharded features (the attention's input).
  template <class X>
  static constexpr bool accepts_input = causal_self_attention<T, Mesh, Model>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"transformer_block">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `h = x + attn(ln1(x))`, then `h + fc2(gelu(fc1(ln2(h))))`.
  template <local_tensor_type X>
  X forward(const X& x) {
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(
          detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else if constexpr ((X::vary & causal_self_attention<T, Mesh, Model>::model_mask) != 0) {
      // The attention's output is the same on every device of the model axis, the input is not: no sum.
      using needs = diagnostic::replicated_over<
          meshlib::diagnostic::axes_t<Mesh, causal_self_attention<T, Mesh, Model>::model_mask>>;
      static_cast<void>(detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, needs>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.size();
      auto a = attn.forward(ln1.forward(x));
      // Holds once the checks above pass (an internal invariant, not a user error).
      static_assert(std::is_same_v<decltype(a), X>, "meshlib::nn: transformer_block: the attention returns its input's type");
      T* h = h_.get(dev, n);
      detail::sum_values<default_memory_space>(h, x.data(), a.data(), n);
      const X hx(typename X::view_type(h, x.extent(0), x.extent(1)), x.mesh(), dev);
      auto m = fc2.forward(act.forward(fc1.forward(ln2.forward(hx))));
      T* y = y_.get(dev, n);
      detail::sum_values<default_memory_space>(y, h, m.data(), n);
      return X(typename X::view_type(y, x.extent(0), x.extent(1)), x.mesh(), dev);
    }
  }

  /// The cotangent of the input (`need_dx` is passed to the first product, whose input is `ln1`'s
  /// output, so the cotangent is always computed: the residual needs it).
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device(), n = dy.size();
      auto dm = ln2.backward(fc1.backward(act.backward(fc2.backward(dy, true)), true));
      T* dh = dh_.get(dev, n);
      detail::sum_values<default_memory_space>(dh, dy.data(), dm.data(), n);
      const DY dhx(typename DY::view_type(dh, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
      auto da = ln1.backward(attn.backward(dhx, true));
      T* dx = dx_.get(dev, n);
      detail::sum_values<default_memory_space>(dx, dh, da.data(), n);
      return DY(typename DY::view_type(dx, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
    }
  }

  /// Appends the parameters in order: `ln1`, `attn`, `ln2`, `fc1`, `fc2`.
  void collect(std::vector<param_ref<T>>& out) {
    ln1.collect(out);
    attn.collect(out);
    ln2.collect(out);
    fc1.collect(out);
    fc2.collect(out);
  }

 private:

  std::string name_;
  detail::device_buffers<T> h_, y_, dh_, dx_;
};

}  // namespace meshlib::nn
