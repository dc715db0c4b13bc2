// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `function_layer`: a layer written as plain forward code, as a flax `nn.Module`'s
/// `__call__` or a haiku function: a forward function over traced values and the `parameter`s it
/// owns; its backward is derived by the tape (nn/autodiff), so it goes into `nn::sequential`,
/// `train_state` and `train_step` like any built-in layer, with no backward written by hand.
///
/// `forward(x)` records `f(x, p...)` on a tape of the running device (each parameter entering as
/// its block on that device); `backward<X>(dy)` walks that tape back from `dy`, writes (or adds,
/// as `parameter::grad_beta` says) every parameter's gradient into its `grad` block and returns the
/// input's cotangent. One forward's tape is kept per device until its backward.
///
/// Gradients follow the built-in layers' convention, not `value_and_grad`'s: the parameters enter
/// varying over the axes that shard the batch (the input's first dimension), so each device's
/// gradient is its share of the batch's gradient, a pending sum that the data-parallel policy
/// (or FSDP, ZeRO) completes, exactly as for `dense`. Axes that shard a parameter or that the
/// forward function reduces over itself (`nn::psum<"model">`) are handled by the tape as in
/// `value_and_grad`.
/// @code
/// using w_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, meshlib::none>>;
/// using b_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none>>;
/// auto fc1 = meshlib::nn::function_layer(m, "fc1",
///     [](const auto& x, const auto& w, const auto& b) {          // relu(x w + b), written forward only
///       namespace nn = meshlib::nn;
///       return nn::maximum(nn::matmul(x, w) + nn::broadcast_in_dim<0>(b, x.extent(0)), 0.0f);
///     },
///     meshlib::nn::parameter<float, 2, w_s>("fc1.w", w_s{m}, {784, 256}, key, meshlib::nn::init::uniform(0.08f)),
///     meshlib::nn::parameter<float, 1, b_s>("fc1.b", b_s{m}, {256}, key, meshlib::nn::init::zeros(), false));
/// meshlib::nn::sequential net(std::move(fc1), meshlib::nn::dense<float, mesh_t>(m, "fc2", 256, 10, key));
/// @endcode

#include <any>
#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/nn/autodiff/value_and_grad.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

namespace detail {

/// `g[i] = c[i]` (`add` false: the first write of a step) or `g[i] += c[i]`.
template <class T>
struct grad_write_functor {
  T* g;
  const T* c;
  bool add;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { g[i] = add ? g[i] + c[i] : c[i]; }
};

/// How parameter `P`'s block enters the tape when the batch is sharded over `Batch`: varying over
/// those axes too (see the file comment).
template <class P, axis_mask Batch>
using entered_param_t = with_vary_t<typename P::local_type, P::local_type::vary | (Batch & ~P::local_type::partial)>;

template <class Returned, class Forward>
consteval bool function_layer_returned_untraced() {
  static_assert(always_false_v<Returned, Forward>,
                "meshlib::nn: function_layer: the forward function returned a value the tape never saw (the forward "
                "function and the type it returned are spelled out in the condition), so no backward can be derived; "
                "compute the output from the traced arguments with meshlib::nn operations (nn::matmul(x, w), "
                "nn::tanh(h), ...), not with meshlib:: operations on .primal() or on local_tensors of your own");
  return false;
}

/// The output type of a forward that returned `R` for an input of type `X`: its primal type, or
/// `X` when `R` is not traced (`forward` then fires the one diagnostic, and the layers after it
/// are not checked against a type that does not exist).
template <class R, class X>
struct function_layer_output {
  using type = X;
};
template <traced_type R, class X>
struct function_layer_output<R, X> {
  using type = typename R::primal_type;
};

}  // namespace detail

/// @brief A layer whose forward is `f(x, params...)` over traced values and whose backward the
/// tape derives (see the file comment).
/// @tparam Mesh   the mesh type
/// @tparam F      the forward function: called with the traced input and one traced block per parameter
/// @tparam Params `parameter<T, Rank, Sharding>` types, owned by the layer
template <mesh_type Mesh, class F, class... Params>
class function_layer {
 public:
  /// The parameters, in the order `f` receives them.
  std::tuple<Params...> params;

  /// A layer named `name` on `mesh` computing `f(x, params...)`.
  function_layer(const Mesh& mesh, std::string name, F f, Params... ps)
      : params(std::move(ps)...), f_(std::move(f)), name_(std::move(name)), state_(mesh.size()) {}

  /// The layer's name (for messages).
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// `"fc1 (function_layer, 2 parameters)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (function_layer, " + std::to_string(sizeof...(Params)) + " parameters)";
  }

  /// The layer's output type for an input of type `X` (a `local_tensor`).
  template <local_tensor_type X>
  using output_t = typename detail::function_layer_output<
      std::remove_cvref_t<decltype(std::declval<const F&>()(
          std::declval<const traced<X>&>(),
          std::declval<const traced<detail::entered_param_t<Params, X::dims_type::at(0)>>&>()...))>,
      X>::type;

  /// `f(x, params...)`, recorded on this device's tape for the backward.
  template <local_tensor_type X>
  auto forward(const X& x) {
    const std::size_t dev = x.device();
    auto st = std::make_shared<device_state>();
    detail::tape& t = st->tape;
    const traced<X> tx(x, &t, t.leaf());
    constexpr axis_mask batch = X::dims_type::at(0);
    // Braced: the parameters enter the tape in order.
    std::tuple<traced<detail::entered_param_t<Params, batch>>...> tp = std::apply(
        [&](const auto&... p) {
          return std::tuple<traced<detail::entered_param_t<Params, batch>>...>{
              enter<detail::entered_param_t<Params, batch>>(p, dev, t)...};
        },
        params);
    auto y = std::apply([&](const auto&... p) { return f_(tx, p...); }, tp);
    using R = decltype(y);
    if constexpr (!traced_type<R>) {
      static_cast<void>(detail::function_layer_returned_untraced<R, F>());
      return x;  // the diagnostic above has fired
    } else {
      st->x = x;
      st->x_id = tx.id();
      st->out_id = y.id();
      std::apply([&](const auto&... p) { st->param_ids = {p.id()...}; }, tp);
      // The output is a tensor of the tape's, not a buffer of the layer's: the state holds it until
      // the backward, as a built-in layer's buffer lives until its next forward. The next layer
      // keeps only an unmanaged view of its input (nn/buffers.hpp); without this reference the
      // memory was freed when the caller's copy died and that layer's backward read whatever
      // reused it (a NaN gradient in a few runs of docs/autodiff.md's example).
      auto out = y.primal();
      st->y = out;
      state_[dev] = std::move(st);
      return out;
    }
  }

  /// Its backward names its input type (`backward<X>(dy)`), as `sequential` does.
  static constexpr bool backward_names_input = true;

  /// Walks the last forward's tape on `dy`'s device back from `dy`: writes (or adds, per
  /// `parameter::grad_beta`) each parameter's gradient into its `grad` block and returns the
  /// input's cotangent (zeros where the output does not depend on it; `need_dx` is not needed to
  /// skip work: the tape computes only what reaches the input).
  /// @throws sharding_error when no forward ran on the device since the last backward.
  template <local_tensor_type X, local_tensor_type DY>
  cotangent_t<X> backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(need_dx);
    const std::size_t dev = dy.device();
    std::shared_ptr<device_state> st = std::move(state_[dev]);
    if (!st)
      throw sharding_error("meshlib::nn: " + to_string() + ".backward ran on device " + std::to_string(dev) +
                           " without a forward there since the last backward; run forward first");
    using Y = output_t<X>;
    detail::tape& t = st->tape;
    t.accumulate<cotangent_t<Y>>(st->out_id, detail::retype<cotangent_t<Y>>(dy));
    t.run_backward();
    constexpr axis_mask batch = X::dims_type::at(0);
    write_grads<batch>(t, *st, dev, std::index_sequence_for<Params...>{});
    return detail::gradient_of(t, st->x_id, std::any_cast<const X&>(st->x));
  }

  /// Appends the parameters' untyped views (optimizers, synchronisation, checkpoints); the
  /// gradients are written with `grad_beta`.
  template <class T>
  void collect(std::vector<param_ref<T>>& out) {
    std::apply([&](auto&... p) { (out.push_back(p.ref(true)), ...); }, params);
  }

 private:
  struct device_state {
    detail::tape tape;
    std::any x;  // the input (its shape gives a zero cotangent where none arrives)
    std::any y;  // the output the next layer reads (and keeps an unmanaged view of) until the backward
    std::size_t x_id = 0, out_id = 0;
    std::array<std::size_t, sizeof...(Params)> param_ids{};
  };

  template <class E, class P>
  static traced<E> enter(const P& p, std::size_t dev, detail::tape& t) {
    return traced<E>(detail::retype<E>(p.local(dev)), &t, t.leaf());
  }

  template <axis_mask Batch, std::size_t... I>
  void write_grads(const detail::tape& t, const device_state& st, std::size_t dev, std::index_sequence<I...>) {
    (write_grad<Batch>(std::get<I>(params), t, st.param_ids[I], dev), ...);
  }

  template <axis_mask Batch, class P>
  static void write_grad(P& p, const detail::tape& t, std::size_t id, std::size_t dev) {
    using E = detail::entered_param_t<P, Batch>;
    using T = typename E::value_type;
    const E block = detail::retype<E>(p.local(dev));
    const auto g = detail::gradient_of(t, id, block);
    const bool add = p.grad_beta(dev) != T{0};
    meshlib::launch<typename E::memory_space>(g.size(), detail::grad_write_functor<T>{p.grad.local(dev).data(), g.data(), add});
  }

  F f_;
  std::string name_;
  std::vector<std::shared_ptr<device_state>> state_;  // per device: the last forward's tape
};

}  // namespace meshlib::nn
