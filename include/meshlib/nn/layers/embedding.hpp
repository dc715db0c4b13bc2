// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `embedding`: a token embedding whose table is sharded over the vocabulary along a model
/// axis (Megatron's `VocabParallelEmbedding`; `flax.linen.Embed` / `torch.nn.Embedding` when the
/// model axis has one device), with forward and backward.
///
/// Why sharded over the vocabulary: the table is the largest parameter of a small language model
/// (vocabulary x width), and an output layer tied to it has the same shape; split by rows, each
/// device of a model group holds `vocab / n` rows and the lookup costs one `psum` of the output.
///
/// Forward: each device looks up the ids that fall in its vocabulary range `[v0, v0 + vocab / n)` and
/// writes zeros for the others: the rows of the result are a pending sum over the model axis, which
/// one `psum` completes (every id lies in exactly one range, so the sum is the looked-up row).
/// Backward: the cotangent of that `psum` is its `pvary` (no data moves); each device adds the
/// cotangent rows of its own ids into its own rows of the table's gradient, and no other.
///
/// The ids are an `std::int32_t` tensor of rank 1 (one id per token: for a batch of sequences, the
/// rows `batch * sequence`, sequence-major as the other Transformer layers take them), sharded like
/// the rows of the activations (over the data axis) and replicated over the model axis. The output
/// is `(tokens, features)`, its rows sharded as the ids, its features complete. The ids have no
/// cotangent: `backward` returns the ids it looked up, so that `sequential`'s type check (every
/// layer hands back its input's type) holds for a network that starts at the ids.
/// Kernels: one work item per token for the lookup; for the gradient, one per block of columns
/// adding the tokens in token order (deterministic, no atomics: the same bits on every mesh).
/// @code
/// meshlib::nn::embedding<float, mesh_t> tok(m, "tok", 256, 128, meshlib::nn::rng_key{0});   // vocab 256, width 128
/// // inside spmd: auto h = tok.forward(ids);   // ids: (tokens) int32, h: (tokens, 128)
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/reductions.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/detail/loss_kernels.hpp"
#include "meshlib/nn/layers/dense.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

namespace detail {
/// The one error of `embedding::forward` given ids it cannot take: not a rank-1 tensor of
/// `std::int32_t`, or not complete and replicated over the model axis.
template <class Layer, class ModelAxis, class Ids, class Id>
consteval bool embedding_ids_do_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, ModelAxis, Ids, Id>,
                "meshlib::nn: embedding: the ids must be complete and replicated over the model axis, one "
                "std::int32_t per token in a rank-1 tensor (every device of a model group looks up the same tokens "
                "in its own vocabulary range; the condition spells out the layer, its model axis, the ids' layout "
                "(one dims<...> entry per dimension) and their element type): shard the ids over the data axis "
                "only, flatten (batch, sequence) ids to batch * sequence (sequence-major) and convert them to "
                "std::int32_t");
  return false;
}
}  // namespace detail

/// @brief A token embedding sharded over the vocabulary along `Model` (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model">
class embedding {
 public:
  /// The table is split by rows (the vocabulary) over `Model`.
  /// (The spec of a `row_dense` weight: spelled through `dense_specs`, as GCC 12 fails on
  /// `P<dim_spec(Model.chars), none>` written in a class template of several parameters.)
  using sharding = named_sharding<Mesh, typename detail::dense_specs<dense_kind::row, Model>::w>;
  /// The table's block on a device: `vocab / n` rows.
  using table_type = parameter<T, 2, sharding>;
  /// The mesh axes of `Model`.
  static constexpr axis_mask model_mask = Mesh::template mask_of<Model>();

 private:
  std::string name_;  // first: its initialiser checks the sizes before the table is made

 public:
  /// The table, `vocab x features`, named `name + ".embedding"` (flax's name), initialised normal
  /// with standard deviation `stddev` (0.02: GPT-2's and Megatron's default).
  table_type table;

  /// `vocab` ids to `features` values each. `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `vocab` is not divisible by the size of `Model`, naming the layer,
  /// both sizes and the fix.
  embedding(const Mesh& mesh, const std::string& name, std::size_t vocab, std::size_t features, rng_key key,
            float stddev = 0.02f, std::span<const std::size_t> local_devices = {})
      : name_(checked_name(mesh, name, vocab, features)),
        table(name + ".embedding", sharding{mesh}, {vocab, features}, key, init::normal(stddev), true, local_devices),
        saved_(mesh.size()),
        out_(mesh.size()),
        bad_(mesh.size()) {}

  /// The layer's name: its parameter is `name() + ".embedding"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The number of ids (the table's rows, over all devices).
  [[nodiscard]] std::size_t vocab_size() const noexcept { return table.value.global_shape()[0]; }
  /// The width of an embedding: what it outputs.
  [[nodiscard]] std::size_t out_features() const noexcept { return table.value.global_shape()[1]; }
  /// `"tok (embedding 256 x 128, vocabulary sharded over 'model')"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (embedding " + std::to_string(vocab_size()) + " x " + std::to_string(out_features()) +
           ", vocabulary" + detail::sharded_over_text<Mesh>(model_mask) + ")";
  }
  /// Ids: complete `std::int32_t` values of rank 1, replicated over `Model`.
  template <class Ids>
  static constexpr bool accepts_input = std::is_same_v<typename Ids::value_type, std::int32_t> && Ids::rank == 1 &&
                                        Ids::partial == 0 && (Ids::vary & model_mask) == 0;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"embedding">;

  /// The output type for ids of type `Ids`: a row per id, rows sharded as the ids, features complete.
  template <class Ids>
  using output_t = rebind_local_t<Ids, T, 2, Ids::vary, 0, dim_masks<Ids::dims_type::at(0), axis_mask{0}>>;

  /// `table[ids[i]]` for every token `i` of this device (one `psum` over `Model`).
  /// @throws std::out_of_range naming the layer, the token and the id when an id is not in `[0, vocab)`.
  template <local_tensor_type Ids>
  output_t<Ids> forward(const Ids& ids) {
    static_cast<void>(require_kernel_can_read<"embedding.forward", "ids", Ids>());
    if constexpr (!accepts_input<Ids>) {
      static_cast<void>(detail::embedding_ids_do_not_fit<diagnostic_name, meshlib::diagnostic::axis_t<Model>,
                                                         meshlib::diagnostic::value_t<Ids>, typename Ids::value_type>());
      return {};  // the one diagnostic above has fired; nothing else may
    } else {
      using Z = with_partial_t<output_t<Ids>, model_mask>;  // this device's share: zeros outside its range
      const std::size_t dev = ids.device(), rows = ids.extent(0);
      const auto tl = table.local(dev);
      const std::size_t vl = tl.extent(0), d = tl.extent(1);
      const std::size_t v0 = ids.mesh().group_rank(dev, model_mask) * vl;
      check_ids(ids.data(), rows, dev);
      saved_[dev] = {ids.data(), rows};
      T* y = out_.get(dev, rows * d);
      const T* w = tl.data();
      const std::int32_t* id = ids.data();
      detail::lookup_rows<default_memory_space>(y, w, id, rows, d, v0, vl);
      if constexpr (model_mask != 0)
        static_cast<void>(meshlib::psum<Model>(detail::wrap2<Z>(y, rows, d, ids.mesh(), dev)));  // donated: in place
      return detail::wrap2<output_t<Ids>>(y, rows, d, ids.mesh(), dev);
    }
  }

  /// Adds the cotangent rows of this device's ids into its rows of the table's gradient. Returns
  /// the ids of the last forward (ids have no cotangent; see the file comment).
  /// @throws sharding_error when `dy` is not shaped as the last forward's output on this device.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"embedding.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      using Ids = rebind_local_t<DY, std::int32_t, 1, DY::vary, 0, dim_masks<DY::dims_type::at(0)>>;
      const std::size_t dev = dy.device();
      const auto [ids, rows] = saved_[dev];
      const auto tl = table.local(dev);
      const std::size_t vl = tl.extent(0), d = tl.extent(1);
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ids != nullptr, rows, d);
      const std::size_t v0 = dy.mesh().group_rank(dev, model_mask) * vl;
      T* g = table.grad.local(dev).data();
      const T* dyp = dy.data();
      const std::int32_t* id = ids;  // copies: Clang before 16 cannot capture a structured binding
      const std::size_t n = rows;
      detail::scatter_add_rows<default_memory_space>(g, dyp, id, n, d, v0, vl);
      return Ids(typename Ids::view_type(const_cast<std::int32_t*>(ids), rows), dy.mesh(), dev);
    }
  }

  /// Appends the table to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) { out.push_back(table.ref()); }

 private:
  static std::string checked_name(const Mesh& mesh, const std::string& name, std::size_t vocab, std::size_t features) {
    const std::size_t n = mesh.axes_size(model_mask);
    if (vocab % n != 0) {
      const std::size_t up = (vocab + n - 1) / n * n;
      throw sharding_error("meshlib::nn: " + name + " (embedding " + std::to_string(vocab) + " x " +
                           std::to_string(features) + "): the vocabulary of " + std::to_string(vocab) +
                           " is not divisible by the " + std::to_string(n) + " devices of the model axis '" +
                           std::string(Model.view()) + "' it is sharded over; pad the vocabulary to " +
                           std::to_string(up) + " (ids that never occur) or use a model axis whose size divides " +
                           std::to_string(vocab));
    }
    return name;
  }

  /// Throws `std::out_of_range` naming the first of the `rows` ids (this device's) that is outside the
  /// vocabulary; called by `forward`.
  void check_ids(const std::int32_t* id, std::size_t rows, std::size_t dev) {
    // The first bad token, found by one work item on the device's instance (nn/detail/loss_kernels.hpp);
    // the host reads back its index, and its id to name it.
    const std::size_t bad = detail::first_id_outside<default_memory_space>(
        id, rows, static_cast<std::int32_t>(vocab_size()), bad_.get(dev, 1));
    if (bad != rows)
      throw std::out_of_range("meshlib::nn: " + to_string() + ": token " + std::to_string(bad) + " on device " +
                              std::to_string(dev) + " has id " +
                              std::to_string(meshlib::read_back<default_memory_space>(id + bad)) +
                              ", not in [0, " + std::to_string(vocab_size()) +
                              "); map the text to ids below the vocabulary size");
  }

  struct saved {
    const std::int32_t* ids = nullptr;
    std::size_t rows = 0;
  };
  std::vector<saved> saved_;
  detail::device_buffers<T> out_;
  detail::device_buffers<std::size_t> bad_;  // check_ids' result, one per device
};

}  // namespace meshlib::nn
