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

namespace meshlib::nn {

namespace detail {
/// A dimension number as the collectives take it (negative: from the end) made non-negative.
template <int Dim, std::size_t Rank>
inline constexpr std::size_t dim_index_v = Dim < 0 ? static_cast<std::size_t>(Dim + static_cast<int>(Rank))
                                                   : static_cast<std::size_t>(Dim);
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
