// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The compile-time rules of the typed collectives: what each accepts, the type it returns,
/// and the one `static_assert` a misuse fires.
///
/// A `local_tensor` carries `vary` (axes it may differ over), `partial` (axes over which it is a
/// pending sum) and `Dims` (per dimension, the axes it is a block of). The rules, as JAX's
/// `check_vma` plus the pending-sum set:
///
/// | op | needs, for its axis `a` | result |
/// | --- | --- | --- |
/// | `psum`, `pmean` | `a` in vary or partial | `a` out of vary, partial and every dim |
/// | `pmax`, `pmin` | `a` in vary; partial over no axis | `a` out of vary and every dim |
/// | `all_gather<a, d>` | `a` in vary; no dim but `d` a block of `a` | `a` out of vary and dim `d` |
/// | `psum_scatter<a, d>` | `a` in vary or partial; `d` not already a block of `a` | `a` in vary and dim `d`, out of partial |
/// | `all_to_all<a, s, c>` | `a` in vary; no dim but `c` a block of `a` | dim `c`'s `a` moves to dim `s` |
/// | `ppermute<a>` | `a` in vary | unchanged |
/// | `broadcast<a>` | `a` not in partial | `a` out of vary and every dim |
/// | `pvary<a>` | `a` in neither vary nor partial | `a` in vary |
///
/// Every collective other than psum / pmean / psum_scatter refuses a value partial over its axis,
/// because moving summands around does not move the sum; and pmax / pmin refuse any partial value,
/// because the max of summands is not the max of the sum.
///
/// Why a diagnostic function per rule: C++20 cannot put the axis name into a `static_assert` message,
/// so the message states the rule and the fix, and the failing condition (printed by GCC and Clang
/// on the error line or the note right under it) spells the operation, the axis and the value's
/// layout as `meshlib::diagnostic` types (see core/diagnostics.hpp): one error on either compiler.

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::collectives::detail {

// diagnostic::value_t (a local value's layout spelled out) lives in tensor/local_tensor.hpp.

// Each diagnostic is a function whose one static_assert names, in its failing condition, the
// operation, the axis and the value's layout (see core/diagnostics.hpp); it returns false.

template <class Op, class Axis, class MeshAxes>
consteval bool collective_axis_not_in_mesh() {
  static_assert(diagnostic::always_false<Op, Axis, MeshAxes>,
                "meshlib: a collective names an axis that the mesh does not have (the operation, the axis and the "
                "mesh's axes are spelled out in the condition); name one of the mesh's axes");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool psum_over_invariant_axis() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: psum / pmean / psum_scatter over an axis the value neither varies over nor is partial over: "
                "it is already equal on every device of that axis, so the sum would only scale it by the axis size; "
                "drop the axis, or write pvary<axis>(x) first if you mean the scaled sum");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool reduction_over_invariant_axis() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: pmax / pmin over an axis the value does not vary over: it is already equal on every device "
                "of that axis; drop the axis, or write pvary<axis>(x) first");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool extremum_of_partial_value() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: pmax / pmin of a value that is a pending sum (partial) over some axis: the max of the "
                "summands is not the max of the sum; psum over the partial axes first");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool collective_of_partial_value() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: a data-movement collective over an axis the value is a pending sum (partial) over: moving "
                "summands does not move the sum; psum or psum_scatter over that axis first");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool collective_needs_varying_input() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: all_gather / all_to_all / ppermute over an axis the value does not vary over: every device "
                "of that axis already holds the same block; drop the collective, or write pvary<axis>(x) first if you "
                "mean it");
  return false;
}

template <class Op, class Axis, class Dim, class ShardedDim, class Value>
consteval bool gather_along_unsharded_dim() {
  static_assert(diagnostic::always_false<Op, Axis, Dim, ShardedDim, Value>,
                "meshlib: all_gather along a dimension that is not the one sharded on the axis (the second "
                "diagnostic::dim is the sharded one); gather along the sharded dimension, all_to_all to move the "
                "sharding first, or forget_dims<axis>(x) first to treat the block as unlabelled, as JAX does");
  return false;
}

template <class Op, class Axis, class Dim, class ShardedDim, class Value>
consteval bool concat_along_unsharded_dim() {
  static_assert(diagnostic::always_false<Op, Axis, Dim, ShardedDim, Value>,
                "meshlib: all_to_all concatenates along a dimension that is not the one sharded on the axis (the "
                "second diagnostic::dim is the sharded one); concatenate along the sharded dimension, or "
                "forget_dims<axis>(x) first to treat the block as unlabelled, as JAX does");
  return false;
}

template <class Op, class Axis, class Dim, class Value>
consteval bool dimension_already_sharded_on_axis() {
  static_assert(diagnostic::always_false<Op, Axis, Dim, Value>,
                "meshlib: psum_scatter / all_to_all would split a dimension over an axis that dimension is already "
                "sharded on; split another dimension, or forget_dims<axis>(x) first to treat the block as "
                "unlabelled (the JAX tutorial's psum_scatter of an already scattered block)");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool pvary_of_varying_value() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: pvary / pbroadcast over an axis the value already varies over or is partial over; drop the "
                "axis");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool broadcast_of_partial_value() {
  static_assert(diagnostic::always_false<Op, Axis, Value>,
                "meshlib: broadcast over an axis the value is a pending sum (partial) over: one summand is not the "
                "sum; psum first");
  return false;
}

template <class Op, class Dim, class Rank>
consteval bool collective_dimension_out_of_range() {
  static_assert(diagnostic::always_false<Op, Dim, Rank>,
                "meshlib: a collective names a dimension past the value's rank (negative numbers count from the "
                "end, as in JAX)");
  return false;
}

template <class Op, class Axis>
consteval bool collective_axis_repeated() {
  static_assert(diagnostic::always_false<Op, Axis>, "meshlib: a collective names the same axis twice; name each axis once");
  return false;
}

template <class Op, class T>
consteval bool collective_element_type() {
  static_assert(diagnostic::always_false<Op, T>,
                "meshlib: collectives move float, double, bfloat16 and 32- or 64-bit signed integers only");
  return false;
}

/// The element-type check: true, or the diagnostic.
template <fixed_string Op, class T>
consteval bool check_element_type() {
  if constexpr (comm_element<T>) return true;
  else return collective_element_type<diagnostic::op_t<Op>, T>();
}

/// The axis-in-mesh check: true, or the diagnostic.
template <fixed_string Op, fixed_string Axis, class Mesh>
consteval bool check_axis_in_mesh() {
  if constexpr (Mesh::template has_axis<Axis>) return true;
  else return collective_axis_not_in_mesh<diagnostic::op_t<Op>, diagnostic::axis_t<Axis>, diagnostic::axes_t<Mesh, Mesh::all_axes>>();
}

/// A dimension number as JAX counts it: negative numbers count from `Rank` (the rank, or the rank
/// plus one where a dimension is inserted). Out of range maps to `Rank` (diagnosed by the caller).
template <int Dim, std::size_t Rank>
inline constexpr std::size_t norm_dim_v =
    Dim < 0 ? (static_cast<long long>(Rank) + Dim < 0 ? Rank : static_cast<std::size_t>(static_cast<long long>(Rank) + Dim))
            : (static_cast<std::size_t>(Dim) < Rank ? static_cast<std::size_t>(Dim) : Rank);

/// The range check of a dimension number: true, or the diagnostic.
template <fixed_string Op, int Dim, std::size_t Rank>
consteval bool check_dim() {
  if constexpr (norm_dim_v<Dim, Rank> < Rank) return true;
  else {
    using dim_t = std::conditional_t<(Dim < 0), diagnostic::dim<static_cast<std::size_t>(-Dim)>, diagnostic::dim<static_cast<std::size_t>(Dim)>>;
    return collective_dimension_out_of_range<diagnostic::op_t<Op>, dim_t, diagnostic::size<Rank>>();
  }
}

/// Mask of the axes `Names...` of `Mesh` that exist (unknown names are diagnosed separately, so that
/// computing a result type never fires a second error).
template <class Mesh, fixed_string... Names>
inline constexpr axis_mask safe_mask_v =
    ((Mesh::template has_axis<Names> ? axis_mask{1} << Mesh::find_axis(Names.view()) : axis_mask{0}) | ... | axis_mask{0});

/// The first dimension of `Dims` that is a block of an axis in `bit`, or `Dims::size`.
template <class Dims>
constexpr std::size_t dim_sharded_on(axis_mask bit) noexcept {
  for (std::size_t d = 0; d < Dims::size; ++d)
    if (Dims::at(d) & bit) return d;
  return Dims::size;
}

// ---- result Dims ------------------------------------------------------------------------------

// (Written with index packs, not std::array template arguments, which crash GCC 12.)
template <class Dims, axis_mask Mask, class Seq = std::make_index_sequence<Dims::size>>
struct dims_without_impl;
template <class Dims, axis_mask Mask, std::size_t... I>
struct dims_without_impl<Dims, Mask, std::index_sequence<I...>> {
  using type = dim_masks<static_cast<axis_mask>(Dims::at(I) & ~Mask)...>;
};
template <class Dims, axis_mask Bit, std::size_t D, class Seq = std::make_index_sequence<Dims::size>>
struct dims_moved_impl;
template <class Dims, axis_mask Bit, std::size_t D, std::size_t... I>
struct dims_moved_impl<Dims, Bit, D, std::index_sequence<I...>> {
  using type = dim_masks<static_cast<axis_mask>((Dims::at(I) & ~Bit) | (I == D ? Bit : axis_mask{0}))...>;
};
template <class Dims, std::size_t D, class Seq = std::make_index_sequence<Dims::size + 1>>
struct dims_insert_impl;
template <class Dims, std::size_t D, std::size_t... I>
struct dims_insert_impl<Dims, D, std::index_sequence<I...>> {
  using type = dim_masks<(I == D ? axis_mask{0} : Dims::at(I < D ? I : I - 1))...>;
};

template <class Dims, std::size_t D, bool = (Dims::size > 0)>
struct remove_dim_or_self {
  using type = Dims;
};
template <class Dims, std::size_t D>
struct remove_dim_or_self<Dims, D, true> {
  using type = typename experimental::remove_dim_impl<Dims, D>::type;
};
/// `Dims` without dimension `D` (itself when it has no dimension: only in a refused call).
template <class Dims, std::size_t D>
using remove_dim_or_self_t = typename remove_dim_or_self<Dims, D>::type;

/// `Dims` with the axes of `Mask` removed from every dimension.
template <class Dims, axis_mask Mask>
using dims_without_t = typename dims_without_impl<Dims, Mask>::type;
/// `Dims` with `Bit` removed everywhere and added to dimension `D`.
template <class Dims, axis_mask Bit, std::size_t D>
using dims_moved_to_t = typename dims_moved_impl<Dims, Bit, D>::type;
/// `Dims` with a replicated dimension inserted at position `D` (untiled all_gather).
template <class Dims, std::size_t D>
using dims_insert_t = typename dims_insert_impl<Dims, D>::type;

}  // namespace meshlib::collectives::detail
