// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `remat`: activation recomputation (`jax.checkpoint` / `jax.remat`,
/// `torch.utils.checkpoint`). `remat(mesh, block)` is a layer that runs `block` forward and then
/// frees every buffer the block used except the one holding its output, so between forward and
/// backward it holds only its output (its input is the previous layer's output, which that layer
/// keeps anyway); its backward reruns the block's forward from the saved input to rebuild the
/// activations, runs the block's backward, and frees them again, keeping only the buffer that holds
/// the input's cotangent (until its next forward).
///
/// The result is the same bits as without remat: the rerun forward is the same kernels on the same
/// input, dropout draws the same mask (its key is set once per step by `begin_step`, and the mask
/// is a function of the key and the element's global index), and the running statistics of the
/// block's batch norms, which a training forward updates, are saved before the rerun and put back
/// after it, so they move once per step as without remat (torch.utils.checkpoint updates them twice).
///
/// What it costs: one more forward of the block per step, including the block's own collectives
/// (a tensor-parallel block's psums run again in backward, on every device alike). What it saves:
/// the block's internal buffers between forward and backward; `step_metrics::peak_activation_bytes`
/// measures it (the bytes of layer buffers live on a device during a step, nn/buffers.hpp).
///
/// A block is anything `sequential` takes (a layer, a `transformer_block`, a `basic_block`, a
/// `residual`, a nested `sequential`, another `remat`); something without `forward(x)` and
/// `backward(dy, need_dx)` is one compile error naming its type. The mesh is taken, as every layer
/// takes it, to size the per-device state at construction (device threads never resize it).
/// Elementwise rounding of mixed precision is applied by the enclosing `sequential` to the block's
/// output only, as for any layer.
/// @code
/// auto net = nn::sequential(tok, pos, nn::remat(m, nn::transformer_block<float, mesh_t>(m, "h0", 128, 4, 512, 64, key)),
///                           nn::remat(m, nn::transformer_block<float, mesh_t>(m, "h1", 128, 4, 512, 64, key)),
///                           nn::layer_norm<float, mesh_t>(m, "ln_f", 128), nn::tied_head<float, mesh_t>(tok));
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

namespace detail {
/// The one compile error of `remat`: the wrapped type is named in the condition.
template <bool Ok, class Wrapped, class Input>
struct remat_wraps_a_type_without_forward_and_backward {
  static_assert(Ok,
                "meshlib::nn: remat: the wrapped type has no forward(x) taking this input and backward(dy, need_dx) "
                "returning its cotangent; the condition spells out remat_wraps_a_type_without_forward_and_backward<"
                "ok, the wrapped type, the input>. Wrap a layer, a block (transformer_block, basic_block, residual) "
                "or a sequential: anything sequential accepts");
  static constexpr bool value = Ok;
};

/// Whether `L` runs forward on `X` and backward on its output's cotangent.
template <class L, class X>
consteval bool remat_can_wrap() {
  if constexpr (!std::is_class_v<L>) {
    return false;
  } else if constexpr (!requires(L& l, const X& x) { l.forward(x); }) {
    return false;
  } else {
    using Y = std::remove_cvref_t<decltype(std::declval<L&>().forward(std::declval<const X&>()))>;
    return requires(L& l, const Y& dy) { l.template backward<X>(dy, true); } ||
           requires(L& l, const Y& dy) { l.backward(dy, true); };
  }
}

/// A tensor of type `L` over `data` with the extents `e` (an unmanaged view of a layer's buffer).
template <local_tensor_type L, std::size_t... I>
L rewrap(const void* data, const std::array<std::size_t, 8>& e, const typename L::mesh_type& mesh,
         std::size_t dev, std::index_sequence<I...>) {
  using V = typename L::value_type;
  return L(typename L::view_type(const_cast<V*>(static_cast<const V*>(data)), e[I]...), mesh, dev);
}
}  // namespace detail

/// @brief Recomputes `Layer`'s activations in backward instead of keeping them (see the file comment).
template <class Layer>
class remat {
 public:
  /// The wrapped layer or block.
  Layer layer;

  /// Wraps `l`; `mesh` sizes the per-device state.
  template <mesh_type Mesh>
  remat(const Mesh& mesh, Layer l)
      : layer(std::move(l)), saved_(mesh.size()), scopes_(mesh.size()), stash_(mesh.size()) {}

  /// `"remat(h0 (transformer_block ...))"`: how messages name it.
  [[nodiscard]] std::string to_string() const {
    if constexpr (requires { layer.to_string(); }) return "remat(" + std::string(layer.to_string()) + ")";
    else if constexpr (requires { layer.name(); }) return "remat(" + std::string(layer.name()) + ")";
    else return "remat";
  }
  /// The wrapped layer's name, when it has one.
  [[nodiscard]] std::string name() const
    requires requires(const Layer& l) { l.name(); }
  {
    return std::string(layer.name());
  }
  /// The wrapped layer's input width.
  [[nodiscard]] std::size_t in_features() const
    requires detail::has_widths<Layer>
  {
    return layer.in_features();
  }
  /// The wrapped layer's output width.
  [[nodiscard]] std::size_t out_features() const
    requires detail::has_widths<Layer>
  {
    return layer.out_features();
  }
  /// As the wrapped layer.
  static constexpr bool keeps_features = detail::keeps_features<Layer>();
  /// What the wrapped layer accepts.
  template <class X>
  static constexpr bool accepts_input = detail::layer_accepts<Layer, X>();
  /// For compile-time messages: the wrapped layer's.
  using diagnostic_name = typename detail::layer_diagnostic_name<Layer>::type;
  /// @copydoc diagnostic_name
  using input_requirement = typename detail::layer_input_requirement<Layer>::type;

  /// Passes the step's key and mode on (dropout keeps the key, so the rerun draws the same mask).
  void begin_step(rng_key key, bool train) {
    if constexpr (requires { layer.begin_step(key, train); }) layer.begin_step(key, train);
  }

  /// The wrapped layer's forward; afterwards only the buffer holding the output is kept.
  template <local_tensor_type X>
  auto forward(const X& x) {
    constexpr bool ok = detail::remat_can_wrap<Layer, X>();
    static_assert(sizeof(detail::remat_wraps_a_type_without_forward_and_backward<ok, Layer, X>) > 0);  // one error, its own
    if constexpr (!ok) {
      return x;  // the one diagnostic above has fired
    } else {
      const std::size_t dev = x.device();
      auto& s = saved_[dev];
      s.input = x.data();
      for (std::size_t d = 0; d < X::rank; ++d) s.extents[d] = x.extent(d);
      s.ran = true;
      detail::release_scope& scope = scopes_[dev];
      scope.enter();
      auto y = layer.forward(x);
      scope.leave();
      scope.release_except(y.data());
      return y;
    }
  }

  /// Tells `sequential` to name the forward's input type: `backward<X>(dy, need_dx)`.
  static constexpr bool backward_names_input = true;

  /// Reruns the forward from the saved input, then the wrapped layer's backward; afterwards only the
  /// buffer holding the input's cotangent is kept. `X` is the forward's input type (a `sequential`
  /// names it; left out, it is `DY`'s, right for a block that returns its input's type).
  /// @throws sharding_error when no forward ran on this device.
  template <class X = void, local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    using In = std::conditional_t<std::is_void_v<X>, DY, X>;
    if constexpr (!detail::remat_can_wrap<Layer, In>()) {
      return dy;  // forward's diagnostic has fired (or fires now)
    } else {
      return backward_impl<In>(dy, need_dx);
    }
  }

  /// The wrapped layer's parameters.
  template <class T>
  void collect(std::vector<param_ref<T>>& out) {
    if constexpr (requires { layer.collect(out); }) layer.collect(out);
  }
  /// The wrapped layer's buffers (running statistics).
  template <class T>
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    detail::collect_buffers_of(layer, out);
  }

 private:
  template <class In, class DY>
  auto backward_impl(const DY& dy, bool need_dx) {
    const std::size_t dev = dy.device();
    const auto& s = saved_[dev];
    if (!s.ran)
      throw sharding_error("meshlib::nn: " + to_string() + ": backward on device " + std::to_string(dev) +
                           " before any forward there; run forward first (backward reruns it from its saved input)");
    const In x = detail::rewrap<In>(s.input, s.extents, dy.mesh(), dev, std::make_index_sequence<In::rank>{});
    // The rerun must not move running statistics (batch norm) a second time: keep them and put them back.
    std::vector<param_ref<float>> buffers;
    detail::collect_buffers_of(layer, buffers);
    std::size_t total = 0;
    for (const auto& b : buffers) total += b.count[dev];
    float* stash = total > 0 ? stash_.get(dev, total) : nullptr;
    for (std::size_t i = 0, off = 0; i < buffers.size(); off += buffers[i].count[dev], ++i)
      detail::convert_copy<default_memory_space>(stash + off, buffers[i].value[dev], buffers[i].count[dev]);
    detail::release_scope& scope = scopes_[dev];
    scope.enter();
    (void)layer.forward(x);
    for (std::size_t i = 0, off = 0; i < buffers.size(); off += buffers[i].count[dev], ++i)
      detail::convert_copy<default_memory_space>(buffers[i].value[dev], stash + off, buffers[i].count[dev]);
    auto dx = detail::layer_backward<In>(layer, dy, need_dx);
    scope.leave();
    scope.release_except(dx.data());
    return dx;
  }

  struct saved {
    const void* input = nullptr;
    std::array<std::size_t, 8> extents{};
    bool ran = false;
  };
  std::vector<saved> saved_;                  // per device: the last forward's input
  std::vector<detail::release_scope> scopes_;  // per device: the buffers the wrapped layer used
  detail::device_buffers<float> stash_;        // per device: running statistics across the rerun
};

/// `remat(mesh, block)` deduces the block's type.
template <mesh_type Mesh, class Layer>
remat(const Mesh&, Layer) -> remat<Layer>;

}  // namespace meshlib::nn
