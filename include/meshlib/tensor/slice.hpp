// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Slicing along one dimension of a device's block, and its two companions: `slice<D>(x,
/// start, stop)` (`lax.slice_in_dim`, `x[..., start:stop, ...]`), `pad<D>(x, before, after)`
/// (`lax.pad` with zeros along one dimension: the transpose of `slice`), and `concatenate<D>(xs...)`
/// (`jnp.concatenate(xs, axis=D)`). Each is one copy kernel on the device's instance.
///
/// Sharding propagation: dimension `D` must be whole on every device (not sharded), so the slice of
/// the block is the block of the slice, and every other dimension keeps its extent and sharding;
/// slicing a sharded dimension does not compile (reshard it to none first). Vary and partial are
/// unchanged (all three are linear). `concatenate` takes operands of one type (one layout).
/// @pre `start <= stop <= x.extent(D)`; the operands of `concatenate` agree in every dimension but
/// `D` (a `sharding_error` naming the dimension otherwise).
/// @post `slice<D>(pad<D>(x, b, a), b, b + x.extent(D))` equals `x`, and `concatenate<D>(slice<D>(x,
/// 0, k), slice<D>(x, k, n))` equals `x`; `pad<D>(slice<D>(x, s, e), s, n - e)` is `x` with the
/// elements outside `[s, e)` along `D` set to zero.
/// @code
/// // qkv: (B / 4, 3 C) rows sharded over "data"; split the columns into q, k and v
/// auto q = meshlib::slice<1>(qkv, 0, c), k = meshlib::slice<1>(qkv, c, 2 * c), v = meshlib::slice<1>(qkv, 2 * c, 3 * c);
/// auto back = meshlib::concatenate<1>(q, k, v);   // qkv again
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <type_traits>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

/// With the block seen as `(outer, n, inner)` around dimension `D`: `out[o, out_off + k, j] = in[o,
/// in_off + k, j]` for `k < count`; one iteration per element moved.
template <class T>
struct copy_along_functor {
  const T* in;
  T* out;
  std::size_t n_in, n_out, inner, in_off, out_off, count;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const std::size_t j = i % inner, k = (i / inner) % count, o = i / (inner * count);
    out[(o * n_out + out_off + k) * inner + j] = in[(o * n_in + in_off + k) * inner + j];
  }
};

/// The block `in` (shape `shape`) copied into `out` (same shape but `n_out` along `D`): `count`
/// entries of dimension `D` from `in_off` to `out_off`.
template <class Space, std::size_t D, class T, std::size_t R>
void copy_along(const T* in, T* out, const std::array<std::size_t, R>& shape, std::size_t n_out, std::size_t in_off,
                std::size_t out_off, std::size_t count) {
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d != D; ++d) outer *= shape[d];  // (d < D warns under nvcc for D = 0)
  for (std::size_t d = D + 1; d < R; ++d) inner *= shape[d];
  if (outer * count * inner == 0) return;
  launch<Space>(outer * count * inner, copy_along_functor<T>{in, out, shape[D], n_out, inner, in_off, out_off, count});
}

template <class Op, class Dim, class Value>
consteval bool slice_of_sharded_dim() {
  static_assert(diagnostic::always_false<Op, Dim, Value>,
                "meshlib: slice / pad / concatenate along a dimension that is sharded (the dimension and the value's "
                "layout are spelled out in the condition): each device holds only its block of that dimension; "
                "reshard the dimension to none first (reshard<P<..., none, ...>>), or slice another dimension");
  return false;
}

template <class Op, class Dim, class Rank>
consteval bool slice_dim_past_rank() {
  static_assert(diagnostic::always_false<Op, Dim, Rank>,
                "meshlib: slice / pad / concatenate: the dimension is past the rank (both are spelled out in the "
                "condition); name a dimension 0 .. rank-1");
  return false;
}

template <class Op, class... Values>
consteval bool concatenate_needs_one_layout() {
  static_assert(diagnostic::always_false<Op, Values...>,
                "meshlib: concatenate: the operands have different types (their layouts are spelled out in the "
                "condition); concatenate blocks of one element type, rank, layout and memory space (pvary or psum "
                "one of them first)");
  return false;
}

/// True when the operands of `concatenate` have one type; otherwise fires the diagnostic.
template <class X, class... Xs>
consteval bool check_concatenate_types() {
  if constexpr ((std::is_same_v<X, Xs> && ...)) return true;
  else return concatenate_needs_one_layout<diagnostic::op_t<"concatenate">, diagnostic::value_t<X>, diagnostic::value_t<Xs>...>();
}

/// True when dimension `D` of `X` can be sliced; otherwise fires the one diagnostic that says why.
template <std::size_t D, class X, class Op>
consteval bool check_slice_dim() {
  if constexpr (D >= X::rank) return slice_dim_past_rank<Op, diagnostic::dim<D>, diagnostic::size<X::rank>>();
  else if constexpr (X::dims_type::at(D) != 0) return slice_of_sharded_dim<Op, diagnostic::dim<D>, diagnostic::value_t<X>>();
  else return true;
}

}  // namespace tensor::detail

/// @brief Entries `[start, stop)` of dimension `D` of `x`'s block (`x[..., start:stop, ...]`), as a
/// new block of `x`'s type. `D` must not be sharded (a compile-time error says so).
/// @throws sharding_error when `start > stop` or `stop > x.extent(D)`
template <std::size_t D, local_tensor_type X>
auto slice(const X& x, std::size_t start, std::size_t stop) {
  if constexpr (!tensor::detail::check_slice_dim<D, X, diagnostic::op_t<"slice">>()) {
    return x;  // the diagnostic above has fired
  } else {
    if (start > stop || stop > x.extent(D))
      throw sharding_error("meshlib: slice<" + std::to_string(D) + ">: [" + std::to_string(start) + ", " +
                           std::to_string(stop) + ") is not within dimension " + std::to_string(D) + " of the block " +
                           experimental::describe_shape(x.shape()) + " on device " + std::to_string(x.device()) +
                           "; give 0 <= start <= stop <= " + std::to_string(x.extent(D)));
    using T = typename X::value_type;
    using space = typename X::memory_space;
    auto shape = x.shape();
    shape[D] = stop - start;
    auto out = tensor::detail::allocate<T, X::rank, space>(shape, "meshlib::slice", false);
    tensor::detail::copy_along<space, D>(x.data(), out.data(), x.shape(), shape[D], start, 0, shape[D]);
    return X(out, x.mesh(), x.device());
  }
}

/// @brief `x`'s block with `before` zero entries ahead of it and `after` behind it along dimension
/// `D` (`lax.pad` with zero padding in one dimension), as a new block of `x`'s type. `D` must not
/// be sharded.
template <std::size_t D, local_tensor_type X>
auto pad(const X& x, std::size_t before, std::size_t after) {
  if constexpr (!tensor::detail::check_slice_dim<D, X, diagnostic::op_t<"pad">>()) {
    return x;  // the diagnostic above has fired
  } else {
    using T = typename X::value_type;
    using space = typename X::memory_space;
    auto shape = x.shape();
    shape[D] += before + after;
    auto out = tensor::detail::allocate<T, X::rank, space>(shape, "meshlib::pad", before + after != 0);
    tensor::detail::copy_along<space, D>(x.data(), out.data(), x.shape(), shape[D], 0, before, x.extent(D));
    return X(out, x.mesh(), x.device());
  }
}

/// @brief The blocks `xs...` (one type) joined along dimension `D` (`jnp.concatenate(xs, axis=D)`),
/// as a new block of that type. `D` must not be sharded.
/// @throws sharding_error when two operands differ in a dimension other than `D`
template <std::size_t D, local_tensor_type X, local_tensor_type... Xs>
auto concatenate(const X& x, const Xs&... xs) {
  if constexpr (!tensor::detail::check_concatenate_types<X, Xs...>()) {
    return x;  // the diagnostic above has fired
  } else if constexpr (!tensor::detail::check_slice_dim<D, X, diagnostic::op_t<"concatenate">>()) {
    return x;  // the diagnostic above has fired
  } else {
    using T = typename X::value_type;
    using space = typename X::memory_space;
    auto shape = x.shape();
    const auto agree = [&](const X& y) {
      for (std::size_t d = 0; d < X::rank; ++d)
        if (d != D && y.extent(d) != shape[d])
          throw sharding_error("meshlib: concatenate<" + std::to_string(D) + ">: the blocks " +
                               experimental::describe_shape(x.shape()) + " and " +
                               experimental::describe_shape(y.shape()) + " on device " + std::to_string(x.device()) +
                               " differ in dimension " + std::to_string(d) +
                               "; the operands may differ only in the dimension they are joined along");
      shape[D] += y.extent(D);
    };
    (agree(xs), ...);
    auto out = tensor::detail::allocate<T, X::rank, space>(shape, "meshlib::concatenate", false);
    std::size_t at = 0;
    const auto place = [&](const X& y) {
      tensor::detail::copy_along<space, D>(y.data(), out.data(), y.shape(), shape[D], 0, at, y.extent(D));
      at += y.extent(D);
    };
    place(x);
    (place(xs), ...);
    return X(out, x.mesh(), x.device());
  }
}

}  // namespace meshlib
