// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `sequential`: layers run forward in order and backward in reverse, as `flax.linen.Sequential`
/// / `torch.nn.Sequential`, so a user writes no gradient for them. A layer is any type with
/// `forward(x)`, `backward(dy, need_dx)` and `collect(params)` (and, optionally,
/// `begin_step(key, train)`, which dropout uses): a user-written struct of layers works the same way.
///
/// `backward<X>(dy)` checks at compile time that every layer hands back a cotangent of exactly the
/// type (vary, partial and per-dimension sharding) its forward input had, so a backward pass whose
/// communication does not mirror the forward's does not compile.
///
/// Compositions are checked before anything runs (nn/layers/shape_checks.hpp has the protocol):
/// - at compile time, `forward<X>` / `backward<X>` first walk the layers with the types they would
///   receive; the first layer that cannot take its input (a `row_dense` after a layer whose features
///   are complete, a `column_dense` after one whose features are sharded) is one `static_assert`
///   naming it and the layer before it (index and kind), the layout it receives and what it needs;
/// - at construction, consecutive layers that expose their widths (`in_features()`,
///   `out_features()`; activations and dropout pass the width through) must agree, else
///   `sharding_error` names both layers (index, name, kind), both widths and the fix.
/// @code
/// meshlib::nn::sequential net(meshlib::nn::column_dense<float, mesh_t>(m, "fc1", 784, 1024, key),
///                             meshlib::nn::relu<float>(m),
///                             meshlib::nn::row_dense<float, mesh_t>(m, "fc2", 1024, 10, key));
/// // inside spmd: auto logits = net.forward(x); ... net.backward<decltype(x)>(dlogits);
/// @endcode

#include <concepts>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

namespace detail {
/// What a `sequential` calls around each layer when `hooks` is set: FSDP (nn/parallel/fsdp.hpp) gathers a
/// layer's parameters just before it runs and reduce-scatters its gradients just after its backward.
/// `layer` is the layer's index, `dev` the running device.
struct layer_hooks {
  virtual ~layer_hooks() = default;
  virtual void before_forward(std::size_t layer, std::size_t dev) = 0;
  virtual void before_backward(std::size_t layer, std::size_t dev) = 0;
  virtual void after_backward(std::size_t layer, std::size_t dev) = 0;
};

template <class Layer, class Input, class Cotangent>
consteval bool backward_cotangent_type_differs_from_input() {
  static_assert(meshlib::diagnostic::always_false<Layer, Input, Cotangent>,
                "meshlib::nn: sequential: the backward of a layer returns a cotangent whose type (vary, partial, "
                "dims) differs from its forward input's: its backward pass does not transpose its forward "
                "collectives. The condition spells out backward_cotangent_type_differs_from_input<the layer (index, "
                "kind), its input's layout, the cotangent's layout> (the whole types where the layouts agree)");
  return false;
}

/// True when the backward of layer `I` (of type `L`) returned `DX`, its input's type `In`; otherwise
/// fires the one diagnostic, naming the layer and both layouts.
template <std::size_t I, class L, class In, class DX>
consteval bool check_cotangent_type() {
  if constexpr (std::is_same_v<In, DX>)
    return true;
  else
    return backward_cotangent_type_differs_from_input<meshlib::diagnostic::layer<I, typename layer_diagnostic_name<L>::type>,
                                                      typename diagnostic_of<In, DX>::type,
                                                      typename diagnostic_of<DX, In>::type>();
}

/// Whether `sequential` fuses the backward of `Above`, an elementwise activation, with that of
/// `Below`, the dense layer whose output it takes (`basic_dense::backward_through`).
template <class Below, class Above>
inline constexpr bool fuses_backward = requires {
  requires Below::fuses_activation_backward;
  typename Above::activation_function;
};
}  // namespace detail

/// @brief Layers in order (see the file comment).
template <class... Layers>
class sequential {
 public:
  /// The number of layers.
  static constexpr std::size_t size = sizeof...(Layers);
  /// The layers, in the order the input goes through them.
  std::tuple<Layers...> layers;
  /// Mixed precision: when set (a `train_state` computing in bfloat16 or float16 sets it), every
  /// layer's output and every cotangent is rounded to the compute type in place.
  void (*round_activations)(float*, std::size_t) noexcept = nullptr;
  /// When set (a `train_state` with FSDP sets it), called around every layer's forward and
  /// backward; not owned.
  detail::layer_hooks* hooks = nullptr;

  /// Chains `ls` in order: each layer receives the previous layer's output.
  /// @throws sharding_error when a layer's `in_features()` is not the `out_features()` of the last
  /// layer before it that has widths (with only width-keeping layers between them).
  explicit sequential(Layers... ls) : layers(std::move(ls)...) { check_widths(std::make_index_sequence<size>{}); }

  /// The global number of input features, when the first layer has widths.
  [[nodiscard]] std::size_t in_features() const
    requires(size > 0 && detail::has_widths<std::tuple_element_t<0, std::tuple<Layers...>>>)
  {
    return std::get<0>(layers).in_features();
  }

  /// The type layer `I` receives when the network receives `X`.
  template <class X, std::size_t I>
  struct input_of {
    /// What layer `I - 1` receives.
    using prev = typename input_of<X, I - 1>::type;
    /// What layer `I - 1` returns, so what layer `I` receives.
    using type = std::remove_cvref_t<decltype(std::declval<std::tuple_element_t<I - 1, std::tuple<Layers...>>&>().forward(
        std::declval<const prev&>()))>;
  };
  /// Layer 0 receives the network's own input `X`.
  template <class X>
  struct input_of<X, 0> {
    using type = X;  ///< `X` itself
  };

  /// Forward through every layer, first to last; returns the last layer's output.
  template <local_tensor_type X>
  auto forward(const X& x) {
    if constexpr (!diagnose_chain<X, 0>()) return x;  // the one diagnostic has fired; nothing else may
    else return forward_from<0>(x);
  }

  /// Its backward names its input type (`backward<X>(dy)`), so a sequential nests in a sequential.
  static constexpr bool backward_names_input = true;

  /// Backward through every layer, last first; returns the cotangent of the input `X` when
  /// `need_dx` (else its contents are unspecified: the first layer skips that product).
  template <local_tensor_type X, local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = false) {
    if constexpr (!diagnose_chain<X, 0>()) return;  // the same diagnostic as forward's, fired once
    else return backward_from<X, size - 1>(dy, need_dx);
  }

  /// Tells layers that draw random numbers (dropout) the step's key and whether this is training.
  void begin_step(rng_key key, bool train) {
    std::apply([&](auto&... l) { (begin_one(l, key, train), ...); }, layers);
  }

  /// Appends every layer's parameters to `out`, in layer order.
  template <class T>
  void collect(std::vector<param_ref<T>>& out) {
    std::apply([&](auto&... l) { (l.collect(out), ...); }, layers);
  }
  /// Appends every layer's buffers (running statistics: what checkpoints keep beside the
  /// parameters, see `detail::tensor_ref`) to `out`, in layer order.
  template <class T>
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    std::apply([&](const auto&... l) { (detail::collect_buffers_of(l, out), ...); }, layers);
  }

  /// How many parameters each layer appends in `collect`, in layer order (FSDP's units).
  template <class T>
  [[nodiscard]] std::vector<std::size_t> params_per_layer() {
    std::vector<std::size_t> counts;
    std::apply([&](auto&... l) { (counts.push_back(count_params<T>(l)), ...); }, layers);
    return counts;
  }

 private:
  template <std::size_t I>
  using layer_t = std::tuple_element_t<I, std::tuple<Layers...>>;

  /// Walks the layers with the types they receive from `X`; fires one diagnostic at the first
  /// layer that cannot take its input (one instantiation per `X`: forward and backward share it).
  template <class X, std::size_t I>
  static consteval bool diagnose_chain() {
    if constexpr (I == size) {
      return true;
    } else {
      using in_t = typename input_of<X, I>::type;
      using L = layer_t<I>;
      if constexpr (!detail::layer_accepts<L, in_t>()) {
        using from_t = typename std::conditional_t<I == 0, std::type_identity<diagnostic::network_input>,
                                                   prev_layer_diagnostic<I>>::type;
        return detail::sequential_layers_do_not_chain<
            diagnostic::layer<I, typename detail::layer_diagnostic_name<L>::type>, meshlib::diagnostic::value_t<in_t>,
            from_t, typename detail::layer_input_requirement<L>::type>();
      } else {
        return diagnose_chain<X, I + 1>();
      }
    }
  }
  template <std::size_t I>
  struct prev_layer_diagnostic {
    using type = diagnostic::layer<I - 1, typename detail::layer_diagnostic_name<layer_t<I - 1>>::type>;
  };

  /// The run-time width check of the constructor (see the file comment): the last layer with
  /// widths whose output reaches the next layer, and how messages name it.
  struct width_source {
    bool known = false;
    std::size_t width = 0;
    std::string text, name;
  };
  template <std::size_t... I>
  void check_widths(std::index_sequence<I...>) const {
    width_source from;
    (check_width<I>(from), ...);
  }
  template <std::size_t I>
  void check_width(width_source& from) const {
    const auto& l = std::get<I>(layers);
    if constexpr (detail::has_widths<layer_t<I>>) {
      if (from.known && from.width != l.in_features())
        throw sharding_error("meshlib::nn: sequential: " + detail::layer_text(I, l) + " takes " +
                             std::to_string(l.in_features()) + " features, but " + from.text + " before it outputs " +
                             std::to_string(from.width) + "; declare " + detail::layer_name(I, l) + " with " +
                             std::to_string(from.width) + " inputs or " + from.name + " with " +
                             std::to_string(l.in_features()) + " outputs");
      from = {true, l.out_features(), detail::layer_text(I, l), detail::layer_name(I, l)};
    } else if constexpr (!detail::keeps_features<layer_t<I>>()) {
      from.known = false;  // a layer of unknown width: nothing to compare across it
    }
  }

  template <std::size_t I, class X>
  auto forward_from(const X& x) {
    if constexpr (I == size) {
      return x;
    } else {
      if (hooks != nullptr) hooks->before_forward(I, x.device());
      auto y = std::get<I>(layers).forward(x);
      round(y);
      return forward_from<I + 1>(y);
    }
  }

  template <class X, std::size_t I, class DY>
  auto backward_from(const DY& dy, bool need_dx) {
    // A dense layer and the activation after it: one kernel for the activation's cotangent and the
    // bias gradient. Not with hooks (FSDP gathers and scatters around each layer on its own) nor
    // with rounding (the unfused path rounds the activation's cotangent before the bias sums it).
    if constexpr (I > 0) {
      if constexpr (detail::fuses_backward<layer_t<I - 1>, layer_t<I>>)
        if (hooks == nullptr && round_activations == nullptr) return backward_fused<X, I>(dy, need_dx);
    }
    using in_t = typename input_of<X, I>::type;
    if (hooks != nullptr) hooks->before_backward(I, dy.device());
    auto dx = detail::layer_backward<in_t>(std::get<I>(layers), dy, I > 0 || need_dx);
    if (hooks != nullptr) hooks->after_backward(I, dy.device());
    if (I > 0 || need_dx) round(dx);
    constexpr bool transposed = detail::check_cotangent_type<I, layer_t<I>, in_t, decltype(dx)>();  // one error, its own
    if constexpr (I == 0 || !transposed) return dx;  // (not into the layers below: no second error)
    else return backward_from<X, I - 1>(dx, need_dx);
  }

  /// Layers `I - 1` (dense) and `I` (its activation) backward in one step (`backward_from`).
  template <class X, std::size_t I, class DY>
  auto backward_fused(const DY& dy, bool need_dx) {
    using in_t = typename input_of<X, I - 1>::type;
    using Fn = typename layer_t<I>::activation_function;
    const auto act = std::get<I>(layers).fused_backward_operands(dy);
    auto dx = std::get<I - 1>(layers).template backward_through<Fn>(dy, act.x, act.dx, I > 1 || need_dx);
    constexpr bool transposed = detail::check_cotangent_type<I - 1, layer_t<I - 1>, in_t, decltype(dx)>();
    if constexpr (I == 1 || !transposed) return dx;
    else return backward_from<X, I - 2>(dx, need_dx);
  }

  template <class Y>
  void round(Y& y) const noexcept {
    if constexpr (requires { { y.data() } -> std::same_as<float*>; y.size(); })
      if (round_activations != nullptr) round_activations(y.data(), y.size());
  }

  template <class T, class L>
  static std::size_t count_params(L& l) {
    std::vector<param_ref<T>> v;
    l.collect(v);
    return v.size();
  }

  template <class L>
  static void begin_one(L& l, rng_key key, bool train) {
    if constexpr (requires { l.begin_step(key, train); }) l.begin_step(key, train);
  }
};

}  // namespace meshlib::nn
