// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `positional_embedding`: a learned position table added to the token embeddings, as GPT-2's
/// `wpe` (`flax`: a `nn.Embed` over `jnp.arange(seq)` added to the tokens), with forward and backward.
///
/// Layout: the rows are tokens, `batch * sequence` of them, sequence-major (row `i` of a device's
/// block is position `i % sequence_length()` of sequence `i / sequence_length()`), the layout every
/// Transformer layer here takes; a device's rows must be whole sequences (a sharding of the rows over
/// the data axis that splits a sequence is an error naming the sizes). The table is replicated, so
/// the layer needs no communication; its gradient is, as a weight's, a pending sum over the data axis.
/// The sequence length is set at construction or later (`set_sequence_length`, for generation with a
/// shorter context); a sequence longer than the table is refused naming both sizes.
/// Kernels: one work item per token forward; per block of columns for the table's gradient, the
/// tokens added in token order (deterministic: the same bits on every mesh).
/// @code
/// meshlib::nn::positional_embedding<float, mesh_t> pos(m, "pos", 64, 128, 64, key);   // table 64 x 128, sequences of 64
/// // inside spmd: auto h = pos.forward(tok.forward(ids));
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool positional_embedding_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: positional_embedding adds its replicated table to complete, unsharded features (rows "
                "of tokens): all_gather (or psum) the feature dimension first (the condition spells out the layer, "
                "the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief A learned positional embedding added to its input (see the file comment).
template <class T, mesh_type Mesh>
class positional_embedding {
 public:
  /// The table is replicated on every device.
  using sharding = named_sharding<Mesh, P<none, none>>;
  /// The table, `max_length x features`, named `name + ".embedding"`, normal with standard deviation `stddev`.
  parameter<T, 2, sharding> table;

  /// Positions 0 to `max_length - 1` of `features` values; sequences of `sequence_length` tokens
  /// (0: `max_length`). `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `sequence_length > max_length` (see `set_sequence_length`).
  positional_embedding(const Mesh& mesh, const std::string& name, std::size_t max_length, std::size_t features,
                       std::size_t sequence_length, rng_key key, float stddev = 0.02f,
                       std::span<const std::size_t> local_devices = {})
      : table(name + ".embedding", sharding{mesh}, {max_length, features}, key, init::normal(stddev), true, local_devices),
        name_(name),
        shape_(mesh.size()),
        out_(mesh.size()) {
    set_sequence_length(sequence_length == 0 ? max_length : sequence_length);
  }

  /// The layer's name: its parameter is `name() + ".embedding"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width it adds to: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return table.value.global_shape()[1]; }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// The longest sequence the table covers.
  [[nodiscard]] std::size_t max_length() const noexcept { return table.value.global_shape()[0]; }
  /// The tokens per sequence of the inputs.
  [[nodiscard]] std::size_t sequence_length() const noexcept { return seq_; }
  /// `"pos (positional_embedding of 64 positions x 128, sequences of 64)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (positional_embedding of " + std::to_string(max_length()) + " positions x " +
           std::to_string(in_features()) + ", sequences of " + std::to_string(seq_) + ")";
  }

  /// Sets the tokens per sequence of the next inputs.
  /// @throws sharding_error naming the layer, both sizes and the fix when `s` exceeds the table (or is 0).
  void set_sequence_length(std::size_t s) {
    if (s == 0)
      throw sharding_error("meshlib::nn: " + name_ + " (positional_embedding of " + std::to_string(max_length()) +
                           " positions): a sequence length of 0; use sequences of 1 to " +
                           std::to_string(max_length()) + " tokens");
    if (s > max_length())
      throw sharding_error("meshlib::nn: " + name_ + " (positional_embedding of " + std::to_string(max_length()) +
                           " positions): a sequence of " + std::to_string(s) + " tokens does not fit its table of " +
                           std::to_string(max_length()) + " positions; use sequences of at most " +
                           std::to_string(max_length()) + " tokens or declare " + name_ + " with max_length " +
                           std::to_string(s));
    seq_ = s;
  }

  /// Complete, unsharded features.
  template <class X>
  static constexpr bool accepts_input = X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"positional_embedding">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `x[i] + table[i % sequence_length()]` for every token `i` of this device.
  /// @throws sharding_error when `x` is not whole sequences of this width.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"positional_embedding.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::positional_embedding_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                                        input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0), d = x.extent(1), seq = seq_;
      if (d != in_features())
        throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(d) + " features; feed it " +
                             std::to_string(in_features()) + " features or declare " + name_ + " with " +
                             std::to_string(d) + " features");
      detail::check_whole_sequences(to_string(), rows, seq, dev);
      shape_[dev] = {rows, d, seq, true};
      T* y = out_.get(dev, rows * d);
      const T* xp = x.data();
      const T* w = table.local(dev).data();
      detail::add_positions<default_memory_space>(y, xp, w, rows, d, seq);
      return X(typename X::view_type(y, rows, d), x.mesh(), dev);
    }
  }

  /// Adds the cotangent of every token to its position's row of the table's gradient; returns `dy`
  /// (the cotangent of an addition passes through unchanged). The second argument is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"positional_embedding.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device(), rows = dy.extent(0), d = dy.extent(1), seq = shape_[dev].seq;
      detail::check_output_cotangent(to_string(), dev, rows, d, shape_[dev].ran, shape_[dev].rows, shape_[dev].cols);
      T* g = table.grad.local(dev).data();
      const T* dyp = dy.data();
      detail::position_grad<default_memory_space>(g, dyp, rows, d, seq);
      return dy;
    }
  }

  /// Appends the table to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) { out.push_back(table.ref()); }

 private:
  struct shape {
    std::size_t rows = 0, cols = 0, seq = 0;  // the last forward's (the sequence length may change since)
    bool ran = false;
  };
  std::string name_;
  std::size_t seq_ = 0;
  std::vector<shape> shape_;
  detail::device_buffers<T> out_;
};

}  // namespace meshlib::nn
