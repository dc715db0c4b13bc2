// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `value_and_grad` and `grad`, reverse mode, define by run, as `jax.value_and_grad` /
/// `jax.grad` inside `shard_map` / `spmd`: each device calls the returned function on its
/// `local_tensor`s; the arguments named by `Argnums` (default: the first) enter the loss function
/// as `traced` values, every meshlib::nn operation on them is recorded on the device's tape, and
/// the tape is walked back from the loss.
///
/// The loss must be one value every device agrees on: a traced value invariant over every mesh
/// axis (no `vary`, no pending sum; a compile-time error otherwise) with one element (a run-time
/// `autodiff_error` otherwise). Its value is then the loss of the whole program, and each gradient
/// is this device's block of the gradient of that loss with respect to the global argument: it has
/// the argument's type (the argument's sharding), as JAX's `shard_map` gradients do. An argument
/// that is itself a pending sum gets the gradient of the completed sum (invariant over those axes).
/// @code
/// auto loss_fn = [](const auto& w, const auto& x) {          // w: (in, out), x: (batch / 4, in)
///   namespace nn = meshlib::nn;
///   auto y = nn::matmul(x, w);                               // varies over "data"
///   return nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(y)))) / 2.0;
/// };
/// meshlib::spmd(mesh, [&](std::size_t dev) {
///   auto [loss, dw] = meshlib::nn::value_and_grad(loss_fn)(w_local, x_local);   // dw: w's type
/// });
/// @endcode
///
/// With `nn::has_aux` (JAX's `has_aux=True`) the function returns a pair `(loss, aux)`: `aux` is
/// carried out untouched and not differentiated (traced values in it come back as their primal
/// `local_tensor`s), and the result's `value` is the pair `(loss, aux)`:
/// @code
/// auto [out, dw] = meshlib::nn::value_and_grad(loss_with_logits, meshlib::nn::has_aux)(w, x);
/// auto& [loss, logits] = out;
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/tensor/elementwise.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief A loss function that `value_and_grad` cannot differentiate as called (a loss with more
/// than one element): `what()` says what was returned and how to reduce it.
class autodiff_error : public error {
 public:
  using error::error;
};

/// @brief What the function `value_and_grad` returns gives back: the loss and the gradients
/// (one argument differentiated: its gradient; several: a `std::tuple` of them, in `Argnums` order).
template <class V, class G>
struct value_and_grad_result {
  V value;  ///< the loss, a one-element `local_tensor` invariant over every axis (`to_host(value)[0]`)
  G grad;   ///< the gradient(s), each of its argument's type
};

/// @brief The type of `has_aux`.
struct has_aux_t {
  explicit has_aux_t() = default;
};

/// @brief Passed to `value_and_grad` / `grad` (JAX's `has_aux=True`): the function returns a pair
/// `(loss, aux)` (a `std::pair` or two-element `std::tuple`); `aux` is returned beside the loss,
/// not differentiated (see the file comment).
inline constexpr has_aux_t has_aux{};

namespace detail {

struct one_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T) const { return T(1); }
};

template <std::size_t I, std::size_t... Argnums>
inline constexpr bool differentiated_v = ((I == Argnums) || ...);

template <class Shape>
std::string loss_shape_text(const Shape& shape) {
  std::string s = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

/// The argument `x` as the loss function sees it: traced when differentiated, as given otherwise.
template <std::size_t I, std::size_t... Argnums, class X>
auto enter(const X& x, tape& t) {
  if constexpr (differentiated_v<I, Argnums...>) {
    static_assert(local_tensor_type<X>,
                  "meshlib::nn: value_and_grad: an argument named by Argnums is not a local_tensor; differentiate "
                  "with respect to local_tensor arguments only (pass parameters as local_tensors)");
    return traced<X>(x, &t, t.leaf());
  } else {
    return std::cref(x);
  }
}

template <class... T>
inline constexpr bool always_false_v = false;

template <class Returned>
consteval bool loss_is_not_traced() {
  static_assert(always_false_v<Returned>,
                "meshlib::nn: value_and_grad: the loss function must return a traced value computed from the "
                "differentiated arguments with meshlib::nn operations (nn::sum, nn::psum, nn::matmul, ...); the type "
                "it returned is spelled out in the condition");
  return false;
}

template <class LossLayout>
consteval bool loss_is_not_invariant() {
  static_assert(always_false_v<LossLayout>,
                "meshlib::nn: value_and_grad: the loss varies over, or is a pending sum over, the mesh axes spelled "
                "out in the condition; the loss must be one value every device agrees on: reduce it with nn::psum "
                "or nn::pmean over those axes before returning it");
  return false;
}

/// True when `R` is a loss `value_and_grad` can start from; otherwise fires the one diagnostic that says why.
template <class R>
consteval bool check_loss_type() {
  if constexpr (!traced_type<R>) return loss_is_not_traced<R>();
  else if constexpr (R::vary != 0 || R::partial != 0)
    return loss_is_not_invariant<meshlib::diagnostic::value_t<typename R::primal_type>>();
  else return true;
}

template <class T>
inline constexpr bool is_pair_like_v = false;
template <class A, class B>
inline constexpr bool is_pair_like_v<std::pair<A, B>> = true;
template <class A, class B>
inline constexpr bool is_pair_like_v<std::tuple<A, B>> = true;

template <class Op, class Returned>
consteval bool aux_loss_is_not_a_pair() {
  static_assert(always_false_v<Op, Returned>,
                "meshlib::nn: value_and_grad with nn::has_aux: the loss function must return a pair (loss, aux), "
                "a std::pair or a two-element std::tuple (the condition spells out the call and the type it "
                "returned); return std::pair(loss, aux), or drop nn::has_aux");
  return false;
}

/// The auxiliary output as it leaves `value_and_grad`: traced values (whose tape ends with the
/// call) become their primal `local_tensor`s, pairs and tuples element by element, anything else
/// a copy, untouched (JAX's `aux` comes back as arrays).
template <class A>
auto aux_out(const A& a);
template <class A, class B>
auto aux_out(const std::pair<A, B>& a);
template <class... Ts>
auto aux_out(const std::tuple<Ts...>& a);

template <class A>
auto aux_out(const A& a) {
  if constexpr (traced_type<A>) return a.primal();
  else return a;
}
template <class A, class B>
auto aux_out(const std::pair<A, B>& a) {
  return std::pair<decltype(aux_out(a.first)), decltype(aux_out(a.second))>(aux_out(a.first), aux_out(a.second));
}
template <class... Ts>
auto aux_out(const std::tuple<Ts...>& a) {
  return std::apply([](const auto&... e) { return std::tuple<decltype(aux_out(e))...>(aux_out(e)...); }, a);
}

/// The gradient of argument `x` (node `id`): its cotangent, or zeros when the loss does not use it.
template <local_tensor_type X>
cotangent_t<X> gradient_of(const tape& t, std::size_t id, const X& x) {
  if (const auto* c = t.template cotangent<cotangent_t<X>>(id)) return *c;
  auto zeros = meshlib::allocate<typename X::value_type, X::rank, typename X::memory_space>(x.shape(),
                                                                                            "meshlib::nn::grad");
  return cotangent_t<X>(zeros, x.mesh(), x.device());
}

/// The function `value_and_grad(f)` (`Aux`: `value_and_grad(f, has_aux)`) returns.
template <class F, bool Aux, std::size_t... Argnums>
class value_and_grad_fn {
 public:
  explicit value_and_grad_fn(F f) : f_(std::move(f)) {}

  template <class... Args>
  auto operator()(const Args&... args) const {
    static_assert(((Argnums < sizeof...(Args)) && ...),
                  "meshlib::nn: value_and_grad: an index in Argnums is past the last argument");
    return call(std::index_sequence_for<Args...>{}, args...);
  }

 private:
  template <std::size_t... I, class... Args>
  auto call(std::index_sequence<I...>, const Args&... args) const {
    tape t;
    // Braced: the arguments enter the tape in order.
    std::tuple<decltype(enter<I, Argnums...>(args, t))...> in{enter<I, Argnums...>(args, t)...};
    auto returned = std::apply([this](const auto&... a) { return f_(unwrap(a)...); }, in);
    using Returned = decltype(returned);
    if constexpr (!Aux) {
      auto r = differentiate(t, in, returned, args...);
      if constexpr (std::is_same_v<decltype(r), bool>) return;  // the loss diagnostic has fired
      else return r;
    } else if constexpr (!is_pair_like_v<Returned>) {
      // the one diagnostic fires
      static_cast<void>(aux_loss_is_not_a_pair<meshlib::diagnostic::op_t<"value_and_grad">, Returned>());
    } else {
      // The aux leaves before the tape is walked: it holds the forward values, untouched.
      auto aux = aux_out(std::get<1>(returned));
      auto r = differentiate(t, in, std::get<0>(returned), args...);
      if constexpr (std::is_same_v<decltype(r), bool>) {
        return;  // the loss diagnostic has fired
      } else {
        using L = decltype(r.value);
        return value_and_grad_result<std::pair<L, decltype(aux)>, decltype(r.grad)>{{std::move(r.value), std::move(aux)},
                                                                                    std::move(r.grad)};
      }
    }
  }

  /// Walks the tape back from `out`; returns `{loss, grads}` (`false` when `out` is no loss: the
  /// one diagnostic has fired).
  template <class In, class R, class... Args>
  static auto differentiate(tape& t, const In& in, const R& out, const Args&... args) {
    if constexpr (!check_loss_type<R>()) {
      return false;
    } else {
      if (out.size() != 1)
        throw autodiff_error("meshlib::nn: value_and_grad: the loss must be a scalar (one element), but the function "
                             "returned a block of shape " + loss_shape_text(out.shape()) + " on device " +
                             std::to_string(out.device()) + "; reduce it with nn::sum / nn::mean first");
      using L = typename R::primal_type;
      t.accumulate<cotangent_t<L>>(out.id(), meshlib::map(one_fn{}, out.primal()));
      t.run_backward();
      auto grads = std::make_tuple(gradient_of(t, std::get<Argnums>(in).id(), std::get<Argnums>(std::tie(args...)))...);
      if constexpr (sizeof...(Argnums) == 1) {
        using G = std::tuple_element_t<0, decltype(grads)>;
        return value_and_grad_result<L, G>{out.primal(), std::get<0>(grads)};
      } else {
        return value_and_grad_result<L, decltype(grads)>{out.primal(), std::move(grads)};
      }
    }
  }

  template <class A>
  static const auto& unwrap(const A& a) {
    if constexpr (traced_type<A>) return a;
    else return a.get();
  }

  F f_;
};

}  // namespace detail

/// @brief `jax.value_and_grad(f, argnums=Argnums)`: a function that, called on a device's values,
/// returns `{value, grad}` (see the file comment). `Argnums` defaults to the first argument; one
/// index gives one gradient, several a `std::tuple` in that order.
template <std::size_t... Argnums, class F>
[[nodiscard]] auto value_and_grad(F f) {
  if constexpr (sizeof...(Argnums) == 0) return detail::value_and_grad_fn<F, false, 0>(std::move(f));
  else return detail::value_and_grad_fn<F, false, Argnums...>(std::move(f));
}

/// @brief `jax.value_and_grad(f, argnums=Argnums, has_aux=True)`: `f` returns a pair `(loss, aux)`;
/// the function returned gives back `{value, grad}` with `value` the `std::pair` `(loss, aux)`
/// (JAX's `((value, aux), grads)`); `aux` is not differentiated (see the file comment).
template <std::size_t... Argnums, class F>
[[nodiscard]] auto value_and_grad(F f, has_aux_t) {
  if constexpr (sizeof...(Argnums) == 0) return detail::value_and_grad_fn<F, true, 0>(std::move(f));
  else return detail::value_and_grad_fn<F, true, Argnums...>(std::move(f));
}

/// @brief `jax.grad(f, argnums=Argnums)`: `value_and_grad` without the value.
template <std::size_t... Argnums, class F>
[[nodiscard]] auto grad(F f) {
  return [vg = value_and_grad<Argnums...>(std::move(f))](const auto&... args) { return vg(args...).grad; };
}

/// @brief `jax.grad(f, argnums=Argnums, has_aux=True)`: `f` returns `(loss, aux)`; the function
/// returned gives back the `std::pair` `(grad, aux)`, as JAX's `(grads, aux)`.
template <std::size_t... Argnums, class F>
[[nodiscard]] auto grad(F f, has_aux_t) {
  return [vg = value_and_grad<Argnums...>(std::move(f), has_aux)](const auto&... args) {
    auto r = vg(args...);
    return std::pair<decltype(r.grad), decltype(r.value.second)>(std::move(r.grad), std::move(r.value.second));
  };
}

}  // namespace meshlib::nn
