// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Differentiable collectives on traced values, each with meshlib's typed result and, as
/// backward, its transpose (nn/collective_transpose.hpp); the varying / pending-sum state in the
/// types decides which, as JAX's `vma` does at trace time:
/// | forward | backward of `ct` |
/// | --- | --- |
/// | `psum<a>` (varying or pending sum -> invariant) | `ct` itself, now typed as the operand's cotangent (no data moves) |
/// | `pmean<a>` | `ct / n`, `n` the size of the group |
/// | `pvary<a>` (invariant -> varying) | `psum<a>(ct)` |
/// | `all_gather<a, d>` (the result invariant over `a`) | this device's chunk of `ct` (no data moves) |
/// | `psum_scatter<a, d>` | `all_gather<a, d>(ct)` |
/// | `all_to_all<a, s, c>` | `all_to_all<a, c, s>(ct)` |
/// | `ppermute<a>(x, perm)` | `ppermute<a>(ct, inverse(perm))` |
/// | `pmax<a>`, `pmin<a>` (varying -> invariant) | `ct * (x == y) / psum<a>(x == y)`: `ct` to the devices holding the extremum, split equally between ties |
/// Every device records the same collectives, so the backward ones run in the same order on all.
/// @code
/// auto s = meshlib::nn::psum<"data">(meshlib::nn::sum<0>(x));     // x traced, sharded on dim 0
/// auto g = meshlib::nn::all_gather<"model", 1>(h);
/// @endcode

#include <cstddef>
#include <utility>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/collectives/permutes.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/nn/collective_transpose.hpp"
#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn {

namespace detail {
/// A dimension number as the collectives take it (negative: from the end) made non-negative.
template <int Dim, std::size_t Rank>
inline constexpr std::size_t dim_index_v = Dim < 0 ? static_cast<std::size_t>(Dim + static_cast<int>(Rank))
                                                   : static_cast<std::size_t>(Dim);

/// `e[i] = 1` where `x[i]` equals the reduced value `y[i]` (this device holds the extremum), else
/// 0. A function object, which nvcc compiles for the device where a lambda in a deduced-return
/// function would not be.
template <class T>
struct extremum_indicator_functor {
  const T* x;
  const T* y;
  T* e;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { e[i] = x[i] == y[i] ? T(1) : T(0); }
};

/// `out[i] = ct[i] / c[i]` where `e[i]` is 1 (`c[i] >= 1` devices hold the extremum), else 0.
template <class T>
struct extremum_share_functor {
  const T* e;
  const T* ct;
  const T* c;
  T* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = e[i] != T(0) ? ct[i] / c[i] : T(0); }
};

/// The cotangent of `x` for `y = pmax<Names...>(x)` (or `pmin`) with cotangent `ct` of `y`: JAX's
/// tie rule for a max, across the devices of the group. The count of ties is the one collective:
/// a `psum` of the indicator, which every device of the group issues in the same backward step.
template <fixed_string... Names, local_tensor_type X, local_tensor_type Y, local_tensor_type C>
cotangent_t<X> extremum_backward(const X& x, const Y& y, const C& ct) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  auto e = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  meshlib::launch<space>(x.size(), extremum_indicator_functor<T>{x.data(), y.data(), e.data()});
  const auto count = meshlib::psum<Names...>(X(e, x.mesh(), x.device()));  // x varies over Names, partial over none
  auto out = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  meshlib::launch<space>(x.size(), extremum_share_functor<T>{e.data(), ct.data(), count.data(), out.data()});
  return cotangent_t<X>(out, x.mesh(), x.device());
}

}  // namespace detail

/// @brief `meshlib::psum<Names...>` of a traced value; backward: `ct`, retyped (no communication).
template <fixed_string... Names, traced_type X>
auto psum(const X& x) {
  auto y = meshlib::psum<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}

/// @brief `meshlib::pmean<Names...>` of a traced value; backward: `ct / n`, `n` the group's size.
template <fixed_string... Names, traced_type X>
auto pmean(const X& x) {
  auto y = meshlib::pmean<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    using T = typename X::value_type;
    const T n = static_cast<T>((meshlib::axis_size<Names>() * ... * std::size_t{1}));
    detail::send(t, x, ct / n);
  });
}

/// @brief `meshlib::pmax<Names...>` of a traced value (JAX's `lax.pmax` under `grad`); backward:
/// `ct` to the devices whose `x` equals the max, split equally between ties across the group
/// (`ct * (x == y) / psum<Names...>(x == y)`), 0 elsewhere. The shift of a softmax over classes
/// sharded on `a`, its gradient stopped:
/// @code
/// auto shift = meshlib::nn::stop_gradient(meshlib::nn::pmax<"a">(meshlib::nn::max<1>(x)));  // invariant over a
/// @endcode
template <fixed_string... Names, traced_type X>
auto pmax(const X& x) {
  auto y = meshlib::pmax<Names...>(x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, detail::extremum_backward<Names...>(x.primal(), y, ct));
  });
}

/// @brief `meshlib::pmin<Names...>` of a traced value (JAX's `lax.pmin` under `grad`); backward:
/// `ct` to the devices whose `x` equals the min, split equally between ties across the group.
template <fixed_string... Names, traced_type X>
auto pmin(const X& x) {
  auto y = meshlib::pmin<Names...>(x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, detail::extremum_backward<Names...>(x.primal(), y, ct));
  });
}

/// @brief `meshlib::pvary<Names...>` of a traced value; backward: `psum<Names...>(ct)`.
template <fixed_string... Names, traced_type X>
auto pvary(const X& x) {
  auto y = meshlib::pvary<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, pvary_transpose<Names...>(ct));
  });
}

/// @brief `meshlib::all_gather<Axis, Dim>` (tiled) of a traced value; backward: this device's chunk
/// of the (invariant) cotangent.
template <fixed_string Axis, int Dim, traced_type X>
auto all_gather(const X& x) {
  auto y = meshlib::all_gather<Axis, Dim>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, all_gather_transpose<Axis, detail::dim_index_v<Dim, X::rank>>(ct));
  });
}

/// @brief `meshlib::psum_scatter<Axis, Dim>` (tiled) of a traced value; backward: `all_gather<Axis, Dim>(ct)`.
template <fixed_string Axis, int Dim, traced_type X>
auto psum_scatter(const X& x) {
  auto y = meshlib::psum_scatter<Axis, Dim>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, psum_scatter_transpose<Axis, detail::dim_index_v<Dim, X::rank>>(ct));
  });
}

/// @brief `meshlib::all_to_all<Axis, Split, Concat>` (tiled) of a traced value; backward: the reverse all-to-all.
template <fixed_string Axis, int Split, int Concat, traced_type X>
auto all_to_all(const X& x) {
  auto y = meshlib::all_to_all<Axis, Split, Concat>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x,
                 all_to_all_transpose<Axis, detail::dim_index_v<Split, X::rank>, detail::dim_index_v<Concat, X::rank>>(ct));
  });
}

/// @brief `meshlib::ppermute<Axis>(x, perm)` of a traced value; backward: the inverse permutation of `ct`.
template <fixed_string Axis, traced_type X>
auto ppermute(const X& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  auto y = meshlib::ppermute<Axis>(x.primal(), perm);
  return detail::record(x.tape(), y, [x, perm](detail::tape& t, const auto& ct) {
    detail::send(t, x, ppermute_transpose<Axis>(ct, perm));
  });
}

}  // namespace meshlib::nn
