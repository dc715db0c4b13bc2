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
/// @code
/// meshlib::nn::sequential net(meshlib::nn::column_dense<float, mesh_t>(m, "fc1", 784, 1024, key),
///                             meshlib::nn::relu<float>(m),
///                             meshlib::nn::row_dense<float, mesh_t>(m, "fc2", 1024, 10, key));
/// // inside spmd: auto logits = net.forward(x); ... net.backward<decltype(x)>(dlogits);
/// @endcode

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

namespace detail {
template <bool Ok, std::size_t Layer, class Input, class Cotangent>
struct backward_cotangent_type_differs_from_input {
  static_assert(Ok,
                "meshlib::nn: sequential: the backward of the layer numbered in "
                "backward_cotangent_type_differs_from_input<ok, layer, input type, cotangent type> returns a "
                "cotangent whose type (vary, partial, dims) differs from its forward input's: its backward pass "
                "does not transpose its forward collectives");
  static constexpr bool value = Ok;
};
}  // namespace detail

/// @brief Layers in order (see the file comment).
template <class... Layers>
class sequential {
 public:
  static constexpr std::size_t size = sizeof...(Layers);
  std::tuple<Layers...> layers;

  explicit sequential(Layers... ls) : layers(std::move(ls)...) {}

  /// The type layer `I` receives when the network receives `X`.
  template <class X, std::size_t I>
  struct input_of {
    using prev = typename input_of<X, I - 1>::type;
    using type = std::remove_cvref_t<decltype(std::declval<std::tuple_element_t<I - 1, std::tuple<Layers...>>&>().forward(
        std::declval<const prev&>()))>;
  };
  /// Layer 0 receives the network's own input `X`.
  template <class X>
  struct input_of<X, 0> {
    using type = X;  ///< `X` itself
  };

  template <local_tensor_type X>
  auto forward(const X& x) {
    return forward_from<0>(x);
  }

  /// Backward through every layer, last first; returns the cotangent of the input `X` when
  /// `need_dx` (else its contents are unspecified: the first layer skips that product).
  template <local_tensor_type X, local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = false) {
    return backward_from<X, size - 1>(dy, need_dx);
  }

  /// Tells layers that draw random numbers (dropout) the step's key and whether this is training.
  void begin_step(rng_key key, bool train) {
    std::apply([&](auto&... l) { (begin_one(l, key, train), ...); }, layers);
  }

  template <class T>
  void collect(std::vector<param_ref<T>>& out) const {
    std::apply([&](const auto&... l) { (l.collect(out), ...); }, layers);
  }

 private:
  template <std::size_t I, class X>
  auto forward_from(const X& x) {
    if constexpr (I == size) return x;
    else return forward_from<I + 1>(std::get<I>(layers).forward(x));
  }

  template <class X, std::size_t I, class DY>
  auto backward_from(const DY& dy, bool need_dx) {
    using in_t = typename input_of<X, I>::type;
    auto dx = std::get<I>(layers).backward(dy, I > 0 || need_dx);
    static_assert(detail::backward_cotangent_type_differs_from_input<std::is_same_v<decltype(dx), in_t>, I, in_t,
                                                                     decltype(dx)>::value);
    if constexpr (I == 0) return dx;
    else return backward_from<X, I - 1>(dx, need_dx);
  }

  template <class L>
  static void begin_one(L& l, rng_key key, bool train) {
    if constexpr (requires { l.begin_step(key, train); }) l.begin_step(key, train);
  }
};

}  // namespace meshlib::nn
