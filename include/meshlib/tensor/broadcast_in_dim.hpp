// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `broadcast_in_dim<D>(x, n)`: a device's block repeated `n` times along a new dimension
/// `D` (NumPy's broadcasting of a bias row over a batch, `jnp.broadcast_to(b, (n, k))` for one new
/// leading dimension, `lax.broadcast_in_dim` with one new dimension), as a new block.
///
/// Sharding propagation: the new dimension is whole on every device (not sharded), or, in the form
/// `broadcast_in_dim<D>(x, like)`, recorded as `like`'s dimension `D` is (so the result combines
/// with `like`; `x` must vary over its axes); the others keep their sharding; vary and partial are unchanged (the map is
/// linear). Its transpose is `sum<D>`.
/// @post `sum<D>(broadcast_in_dim<D>(x, n))` is `n * x`; element `(..., k, ...)` of the result
/// (index `k` in dimension `D`) is `x`'s element `(..., ...)` for every `k < n`.
/// @code
/// // y = x W + b with b (k,) a row added to each of the n rows of x W (n, k)
/// auto xw = meshlib::matmul(x, w);
/// auto y = xw + meshlib::broadcast_in_dim<0>(b, xw);   // or broadcast_in_dim<0>(b, n): unsharded rows
/// @endcode

#include <array>
#include <cstddef>
#include <utility>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

/// `out[o, k, j] = in[o, j]` for `k < n`, `j < inner`: one iteration per output element.
template <class T>
struct broadcast_in_dim_functor {
  const T* in;
  T* out;
  std::size_t n, inner;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const std::size_t j = i % inner, o = i / (n * inner);
    out[i] = in[o * inner + j];
  }
};

/// `Dims` with a dimension sharded over `Mask` (0: unsharded) inserted at `D`.
template <class Dims, std::size_t D, axis_mask Mask, class Seq = std::make_index_sequence<Dims::size + 1>>
struct insert_dim_impl;
template <class Dims, std::size_t D, axis_mask Mask, std::size_t... I>
struct insert_dim_impl<Dims, D, Mask, std::index_sequence<I...>> {
  using type = dim_masks<(I < D ? Dims::at(I) : I == D ? Mask : Dims::at(I - 1))...>;
};

template <class Op, class Like, class Value>
consteval bool broadcast_like_needs_varying() {
  static_assert(diagnostic::always_false<Op, Like, Value>,
                "meshlib: broadcast_in_dim<D>(x, like): dimension D of like is a block of mesh axes that x does not "
                "vary over (both layouts are spelled out in the condition); pvary x over those axes first (psum a "
                "pending sum first), or give the extent: broadcast_in_dim<D>(x, n)");
  return false;
}

template <class Op, class Dim, class Rank>
consteval bool broadcast_dim_past_rank() {
  static_assert(diagnostic::always_false<Op, Dim, Rank>,
                "meshlib: broadcast_in_dim<D>: the new dimension D is past the rank of the result (both are spelled "
                "out in the condition); name a dimension 0 .. rank of x");
  return false;
}

}  // namespace tensor::detail

namespace tensor::detail {
template <std::size_t D, axis_mask Mask, class X>
auto broadcast_in_dim_impl(const X& x, std::size_t n) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  using dims = typename insert_dim_impl<typename X::dims_type, D, Mask>::type;
  using out_t = rebind_local_t<X, T, X::rank + 1, X::vary, X::partial, dims>;
  std::array<std::size_t, X::rank + 1> shape{};
  std::size_t inner = 1;
  for (std::size_t d = 0; d < X::rank + 1; ++d) shape[d] = d < D ? x.extent(d) : d == D ? n : x.extent(d - 1);
  for (std::size_t d = D; d < X::rank; ++d) inner *= x.extent(d);
  auto out = allocate<T, X::rank + 1, space>(shape, "meshlib::broadcast_in_dim", false);
  if (inner != 0 && n != 0) launch<space>(out.size(), broadcast_in_dim_functor<T>{x.data(), out.data(), n, inner});
  return out_t(out, x.mesh(), x.device());
}
}  // namespace tensor::detail

/// @brief `x`'s block repeated `n` times along a new, unsharded dimension `D` (`0 <= D <= rank`),
/// as a new block of rank `rank + 1` (see the file comment).
template <std::size_t D, local_tensor_type X>
auto broadcast_in_dim(const X& x, std::size_t n) {
  if constexpr (D > X::rank) {
    static_cast<void>(tensor::detail::broadcast_dim_past_rank<diagnostic::op_t<"broadcast_in_dim">, diagnostic::dim<D>,
                                                              diagnostic::size<X::rank + 1>>());
    return x;  // the diagnostic above has fired; x is returned so that the caller sees one error only
  } else {
    return tensor::detail::broadcast_in_dim_impl<D, 0>(x, n);
  }
}

/// @brief `x`'s block repeated along a new dimension `D` as `like`'s dimension `D` is: its extent,
/// and its sharding record, so that the result combines with `like` elementwise (a bias over a
/// batch whose rows are sharded: `matmul(x, w) + broadcast_in_dim<0>(b, y)`). `x` must vary over
/// the axes that dimension is a block of (a compile-time error says to pvary it otherwise; a value
/// that is a pending sum over them has no rows of its own to spread: psum it first).
template <std::size_t D, local_tensor_type X, local_tensor_type Like>
auto broadcast_in_dim(const X& x, const Like& like) {
  constexpr axis_mask mask = Like::dims_type::at(D);
  if constexpr (D > X::rank) {
    static_cast<void>(tensor::detail::broadcast_dim_past_rank<diagnostic::op_t<"broadcast_in_dim">, diagnostic::dim<D>,
                                                              diagnostic::size<X::rank + 1>>());
    return x;  // the diagnostic above has fired
  } else if constexpr ((mask & ~X::vary) != 0) {
    static_cast<void>(tensor::detail::broadcast_like_needs_varying<diagnostic::op_t<"broadcast_in_dim">,
                                                                   diagnostic::value_t<Like>, diagnostic::value_t<X>>());
    return x;  // the diagnostic above has fired
  } else {
    return tensor::detail::broadcast_in_dim_impl<D, mask>(x, like.extent(D));
  }
}

}  // namespace meshlib
