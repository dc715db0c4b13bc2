// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Elementwise kernels: `map`, `zip`, and the arithmetic operators, on local values (inside
/// `shard_map` / `spmd`) and on global `sharded_tensor`s.
///
/// Sharding propagation: an elementwise result has its operands' layout. Both operands of a binary
/// operation must have the *same* layout (same sharding in the global view; same vary, partial and
/// dims in the local view): meshlib does not move data implicitly, so a mismatch does not compile
/// and the message points to `reshard`.
///
/// Pending sums (`Partial`): only linear operations keep a value partial. `a + b`, `a - b`, `-a`,
/// `a * s`, `s * a`, `a / s` are allowed on partial values (the sum of the parts is still the right
/// answer); `map`, `zip`, `a * b`, `a + s` are not (`psum` first), because e.g. adding 1 to each of
/// n parts adds n to their sum.
/// @code
/// auto y = x * 2.0f + 1.0f;                           // pmap-style x * 2 + 1
/// auto z = meshlib::zip([](float a, float b) { return a > b ? a : b; }, x, y);
/// @endcode

#include <concepts>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"
#include "meshlib/tensor/for_each_device.hpp"
#include "meshlib/tensor/pointer_check.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

// ---- diagnostics ------------------------------------------------------------------------------
// Each is a function whose one static_assert names, in its failing condition, the operands' specs
// or layouts spelled out with axis names (core/diagnostics.hpp): one error on GCC and Clang.

template <class Op, class LhsSpec, class RhsSpec>
consteval bool zip_needs_same_sharding() {
  static_assert(diagnostic::always_false<Op, LhsSpec, RhsSpec>,
                "meshlib: zip / elementwise operator: the operands have different shardings (the two specs are "
                "spelled out in the condition); meshlib moves no data implicitly: reshard one operand with "
                "meshlib::reshard<Spec>(x) so both have the same spec");
  return false;
}

template <class Op, class LhsValue, class RhsValue>
consteval bool zip_needs_same_local_layout() {
  static_assert(diagnostic::always_false<Op, LhsValue, RhsValue>,
                "meshlib: zip / elementwise operator on local values: the operands vary over, are partial over, or are "
                "sharded over different mesh axes (the two layouts are spelled out in the condition); make them "
                "agree first: psum / all_gather the one, pbroadcast the other, or reshard the inputs of shard_map");
  return false;
}

template <class Op, class LhsRank, class RhsRank>
consteval bool zip_of_different_ranks() {
  static_assert(diagnostic::always_false<Op, LhsRank, RhsRank>, "meshlib: zip / elementwise operator on operands of different ranks");
  return false;
}

template <class Op, class LhsMesh, class RhsMesh>
consteval bool zip_of_different_meshes() {
  static_assert(diagnostic::always_false<Op, LhsMesh, RhsMesh>,
                "meshlib: zip / elementwise operator on operands over different mesh types");
  return false;
}

template <class PartialAxes, class Value>
consteval bool operation_is_not_linear_on_partial() {
  static_assert(diagnostic::always_false<PartialAxes, Value>,
                "meshlib: this operation is not linear, but the operand is a pending sum over the axes spelled out in "
                "the condition; complete the sum with psum over those axes first (only +, -, negation, and scaling "
                "by a scalar keep a value partial)");
  return false;
}

/// True when `L` is not partial; otherwise fires `operation_is_not_linear_on_partial`.
template <class L>
consteval bool check_not_partial() {
  if constexpr (L::partial != 0)
    return operation_is_not_linear_on_partial<diagnostic::axes_t<typename L::mesh_type, L::partial>, diag_value_t<L>>();
  else return true;
}

template <class A, class B>
consteval bool diagnose_zip_local() {
  using op_t = diagnostic::op_t<"zip">;
  if constexpr (!std::is_same_v<typename A::mesh_type, typename B::mesh_type>)
    return zip_of_different_meshes<op_t, typename A::mesh_type, typename B::mesh_type>();
  else if constexpr (A::rank != B::rank)
    return zip_of_different_ranks<op_t, diagnostic::size<A::rank>, diagnostic::size<B::rank>>();
  else if constexpr (!std::is_same_v<diag_value_t<A>, diag_value_t<B>>)
    return zip_needs_same_local_layout<op_t, diag_value_t<A>, diag_value_t<B>>();
  else return true;
}

template <class A, class B>
consteval bool diagnose_zip_global() {
  using op_t = diagnostic::op_t<"zip">;
  if constexpr (!std::is_same_v<typename A::mesh_type, typename B::mesh_type>)
    return zip_of_different_meshes<op_t, typename A::mesh_type, typename B::mesh_type>();
  else if constexpr (A::rank != B::rank)
    return zip_of_different_ranks<op_t, diagnostic::size<A::rank>, diagnostic::size<B::rank>>();
  else if constexpr (!std::is_same_v<typename A::spec_type, typename B::spec_type>)
    return zip_needs_same_sharding<op_t, diagnostic::spec_t<typename A::spec_type>, diagnostic::spec_t<typename B::spec_type>>();
  else return true;
}

// ---- kernels on views -------------------------------------------------------------------------

template <class F, class T, class U>
struct map_functor {
  F f;
  const T* in;
  U* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = f(in[i]); }
};

template <class F, class T1, class T2, class U>
struct zip_functor {
  F f;
  const T1* a;
  const T2* b;
  U* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = f(a[i], b[i]); }
};

/// out = f(in), elementwise, into a fresh view of the same shape.
template <class U, class Space, class View, class F>
auto map_view(const View& in, const F& f) {
  constexpr std::size_t rank = View::rank;
  auto out = allocate<U, rank, Space>(extents_of(in), "meshlib::map", false);
  launch<Space>(in.span(), map_functor<F, typename View::value_type, U>{f, in.data(), out.data()});
  return out;
}

template <class U, class Space, class VA, class VB, class F>
auto zip_view(const VA& a, const VB& b, const F& f) {
  // The kernel runs where the first operand lives; the second must be readable there (a host block
  // zipped with a device block would hand a host address to a GPU kernel).
  static_cast<void>(require_kernel_can_read<"zip", "b", VB, Space>());
  constexpr std::size_t rank = VA::rank;
  if (extents_of(a) != extents_of(b))
    throw sharding_error("meshlib: zip: the local blocks have shapes " + experimental::describe_shape(extents_of(a)) + " and " +
                         experimental::describe_shape(extents_of(b)) + "; elementwise operands need equal shapes");
  auto out = allocate<U, rank, Space>(extents_of(a), "meshlib::zip", false);
  launch<Space>(a.span(), zip_functor<F, typename VA::value_type, typename VB::value_type, U>{f, a.data(), b.data(),
                                                                                                out.data()});
  return out;
}

template <class X, class U, class Views>
auto rewrap_global(const X& x, Views&& blocks) {
  using out_t = sharded_tensor<U, X::rank, typename X::sharding_type, typename X::memory_space>;
  std::vector<bool> local(x.num_devices());
  for (std::size_t d = 0; d < local.size(); ++d) local[d] = x.is_local(d);
  return out_t(x.sharding(), x.global_shape(), std::forward<Views>(blocks), std::move(local));
}

template <class X, class Y>
void check_same_global(const X& x, const Y& y, const char* op) {
  if (!(x.sharding() == y.sharding()) || x.global_shape() != y.global_shape())
    throw sharding_error(std::string("meshlib: ") + op + ": operands " + x.to_string() + " and " + y.to_string() +
                         " differ in mesh sizes, shard rule or global shape");
  for (std::size_t d = 0; d < x.num_devices(); ++d)
    if (x.is_local(d) != y.is_local(d))
      throw sharding_error(std::string("meshlib: ") + op + ": device " + std::to_string(d) +
                           " is local to one operand and not the other");
}

}  // namespace tensor::detail

// ---- local view ---------------------------------------------------------------------------------

/// @brief `f` applied to every element of a local value; same layout, element type `f`'s result.
/// @pre `x` is not partial (map is not linear in general).
template <class F, local_tensor_type L>
auto map(F f, const L& x) {
  if constexpr (!tensor::detail::check_not_partial<L>()) {
    return x;  // the diagnostic above has fired
  } else {
    using T = typename L::value_type;
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const T&>>;
    using out_t = with_value_t<L, U>;
    return out_t(tensor::detail::map_view<U, typename L::memory_space>(x.view(), f), x.mesh(), x.device());
  }
}

/// @brief `f(a[i], b[i])` for every element; both operands must have the same layout.
template <class F, local_tensor_type A, local_tensor_type B>
auto zip(F f, const A& a, const B& b) {
  if constexpr (!tensor::detail::diagnose_zip_local<A, B>()) {
    return a;  // the diagnostic above has fired
  } else if constexpr (!tensor::detail::check_not_partial<A>()) {
    return a;  // the diagnostic above has fired
  } else {
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const typename A::value_type&, const typename B::value_type&>>;
    using out_t = with_value_t<A, U>;
    return out_t(tensor::detail::zip_view<U, typename A::memory_space>(a.view(), b.view(), f), a.mesh(), a.device());
  }
}

namespace tensor::detail {
/// Zip allowed on partial operands (for the linear operators +, -).
template <class F, local_tensor_type A, local_tensor_type B>
auto zip_linear(F f, const A& a, const B& b) {
  if constexpr (!diagnose_zip_local<A, B>()) {
    return a;  // the diagnostic above has fired
  } else {
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const typename A::value_type&, const typename B::value_type&>>;
    using out_t = with_value_t<A, U>;
    return out_t(zip_view<U, typename A::memory_space>(a.view(), b.view(), f), a.mesh(), a.device());
  }
}
template <class F, local_tensor_type L>
auto map_linear(F f, const L& x) {
  using T = typename L::value_type;
  using U = std::remove_cvref_t<std::invoke_result_t<F&, const T&>>;
  return with_value_t<L, U>(map_view<U, typename L::memory_space>(x.view(), f), x.mesh(), x.device());
}

struct plus_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a + b; }
};
struct minus_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a - b; }
};
struct times_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a * b; }
};
struct divide_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a / b; }
};
template <class S, class Op, bool ScalarLeft>
struct scalar_fn {
  S s;
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(const T& x) const {
    if constexpr (ScalarLeft) return static_cast<T>(Op{}(static_cast<T>(s), x));
    else return static_cast<T>(Op{}(x, static_cast<T>(s)));
  }
};
struct negate_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(const T& x) const { return static_cast<T>(-x); }
};

template <class S, class T>
concept scalar_for = std::is_arithmetic_v<S> && std::is_arithmetic_v<T>;
}  // namespace tensor::detail

/// @brief Elementwise sum and difference: linear, so allowed on partial values of the same layout.
template <local_tensor_type A, local_tensor_type B>
auto operator+(const A& a, const B& b) {
  return tensor::detail::zip_linear(tensor::detail::plus_fn{}, a, b);
}
/// @brief Elementwise difference: linear, so allowed on partial values of the same layout.
template <local_tensor_type A, local_tensor_type B>
auto operator-(const A& a, const B& b) {
  return tensor::detail::zip_linear(tensor::detail::minus_fn{}, a, b);
}
/// @brief Elementwise product and quotient: not linear in the pair, so not on partial values.
template <local_tensor_type A, local_tensor_type B>
auto operator*(const A& a, const B& b) {
  return zip(tensor::detail::times_fn{}, a, b);
}
/// @brief Elementwise quotient: not linear in the pair, so not on partial values.
template <local_tensor_type A, local_tensor_type B>
auto operator/(const A& a, const B& b) {
  return zip(tensor::detail::divide_fn{}, a, b);
}
/// @brief Negation: linear, allowed on partial values.
template <local_tensor_type L>
L operator-(const L& x) {
  return tensor::detail::map_linear(tensor::detail::negate_fn{}, x);
}

/// @brief Scaling by a scalar: linear, allowed on partial values. The result keeps `x`'s element type.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator*(const L& x, S s) {
  return tensor::detail::map_linear(tensor::detail::scalar_fn<S, tensor::detail::times_fn, false>{s}, x);
}
/// @brief Scaling by a scalar on the left: linear, allowed on partial values.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator*(S s, const L& x) {
  return tensor::detail::map_linear(tensor::detail::scalar_fn<S, tensor::detail::times_fn, true>{s}, x);
}
/// @brief Division by a scalar: linear, allowed on partial values.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator/(const L& x, S s) {
  return tensor::detail::map_linear(tensor::detail::scalar_fn<S, tensor::detail::divide_fn, false>{s}, x);
}
/// @brief Adding a scalar: not linear (it would be added once per part), so not on partial values.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator+(const L& x, S s) {
  return map(tensor::detail::scalar_fn<S, tensor::detail::plus_fn, false>{s}, x);
}
/// @brief Adding a scalar on the left: not linear, so not on partial values.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator+(S s, const L& x) {
  return map(tensor::detail::scalar_fn<S, tensor::detail::plus_fn, true>{s}, x);
}
/// @brief Subtracting a scalar: not linear, so not on partial values.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator-(const L& x, S s) {
  return map(tensor::detail::scalar_fn<S, tensor::detail::minus_fn, false>{s}, x);
}
/// @brief Subtracting from a scalar: not linear, so not on partial values.
template <local_tensor_type L, class S>
  requires tensor::detail::scalar_for<S, typename L::value_type>
L operator-(S s, const L& x) {
  return map(tensor::detail::scalar_fn<S, tensor::detail::minus_fn, true>{s}, x);
}

// ---- global view --------------------------------------------------------------------------------

/// @brief `f` applied to every element of every local block; the result has `x`'s sharding.
template <class F, sharded_tensor_type X>
auto map(F f, const X& x) {
  using T = typename X::value_type;
  using U = std::remove_cvref_t<std::invoke_result_t<F&, const T&>>;
  using view_u = tensor::detail::block_view_t<U, X::rank, typename X::memory_space>;
  std::vector<view_u> out(x.num_devices());
  tensor::detail::for_each_device<typename X::memory_space>(x.local_devices(), x.num_devices(), x.size(), [&](std::size_t d) {
    out[d] = tensor::detail::map_view<U, typename X::memory_space>(x.local(d), f);
  });
  return tensor::detail::rewrap_global<X, U>(x, std::move(out));
}

/// @brief `f(a[i], b[i])` for every element; both tensors must have the same sharding.
template <class F, sharded_tensor_type A, sharded_tensor_type B>
auto zip(F f, const A& a, const B& b) {
  constexpr bool ok = tensor::detail::diagnose_zip_global<A, B>();
  if constexpr (!ok) {
    return;  // the diagnostic above has fired
  } else {
    tensor::detail::check_same_global(a, b, "zip");
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const typename A::value_type&, const typename B::value_type&>>;
    using view_u = tensor::detail::block_view_t<U, A::rank, typename A::memory_space>;
    std::vector<view_u> out(a.num_devices());
    tensor::detail::for_each_device<typename A::memory_space>(a.local_devices(), a.num_devices(), a.size(), [&](std::size_t d) {
      out[d] = tensor::detail::zip_view<U, typename A::memory_space>(a.local(d), b.local(d), f);
    });
    return tensor::detail::rewrap_global<A, U>(a, std::move(out));
  }
}

template <sharded_tensor_type A, sharded_tensor_type B>
auto operator+(const A& a, const B& b) {
  return zip(tensor::detail::plus_fn{}, a, b);
}
template <sharded_tensor_type A, sharded_tensor_type B>
auto operator-(const A& a, const B& b) {
  return zip(tensor::detail::minus_fn{}, a, b);
}
template <sharded_tensor_type A, sharded_tensor_type B>
auto operator*(const A& a, const B& b) {
  return zip(tensor::detail::times_fn{}, a, b);
}
template <sharded_tensor_type A, sharded_tensor_type B>
auto operator/(const A& a, const B& b) {
  return zip(tensor::detail::divide_fn{}, a, b);
}
/// @brief Negation of every element of a sharded tensor.
template <sharded_tensor_type X>
X operator-(const X& x) {
  return map(tensor::detail::negate_fn{}, x);
}

#define MESHLIB_DETAIL_GLOBAL_SCALAR_OP(op, fn)                                                     \
  template <sharded_tensor_type X, class S>                                                        \
    requires tensor::detail::scalar_for<S, typename X::value_type>                                         \
  X operator op(const X& x, S s) {                                                                 \
    return map(tensor::detail::scalar_fn<S, tensor::detail::fn, false>{s}, x);                                     \
  }                                                                                                \
  template <sharded_tensor_type X, class S>                                                        \
    requires tensor::detail::scalar_for<S, typename X::value_type>                                         \
  X operator op(S s, const X& x) {                                                                 \
    return map(tensor::detail::scalar_fn<S, tensor::detail::fn, true>{s}, x);                                      \
  }
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(+, plus_fn)
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(-, minus_fn)
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(*, times_fn)
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(/, divide_fn)
#undef MESHLIB_DETAIL_GLOBAL_SCALAR_OP

}  // namespace meshlib
