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
/// Why a diagnostic struct per rule: C++20 cannot put the axis name into a `static_assert` message,
/// so the message states the rule and the fix, and the struct's template arguments (printed by the
/// compiler on the "required from" line right above it) name the operation, the axis and the value.

#include <array>
#include <cstddef>

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::detail {

template <fixed_string Op, fixed_string Axis, class Mesh>
struct collective_axis_not_in_mesh {
  static_assert(Mesh::template has_axis<Axis>,
                "meshlib: a collective names an axis that the mesh does not have (the operation, axis and mesh are "
                "the arguments of collective_axis_not_in_mesh<op, axis, mesh>); name one of the mesh's axes");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct psum_over_invariant_axis {
  static_assert(sizeof(Value) == 0,
                "meshlib: psum / pmean over an axis the value neither varies over nor is partial over (see "
                "psum_over_invariant_axis<op, axis, value>): it is already equal on every device of that axis, so "
                "the sum would only scale it by the axis size; drop the axis, or pvary over it first");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct reduction_over_invariant_axis {
  static_assert(sizeof(Value) == 0,
                "meshlib: pmax / pmin over an axis the value does not vary over (see "
                "reduction_over_invariant_axis<op, axis, value>): it is already equal on every device of that axis; "
                "drop the axis");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct extremum_of_partial_value {
  static_assert(sizeof(Value) == 0,
                "meshlib: pmax / pmin of a value that is a pending sum (partial) over some axis (see "
                "extremum_of_partial_value<op, axis, value>): the max of the summands is not the max of the sum; "
                "psum over the partial axes first");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct collective_of_partial_value {
  static_assert(sizeof(Value) == 0,
                "meshlib: a data-movement collective over an axis the value is a pending sum (partial) over (see "
                "collective_of_partial_value<op, axis, value>): moving summands does not move the sum; psum or "
                "psum_scatter over that axis first");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct collective_needs_varying_input {
  static_assert(sizeof(Value) == 0,
                "meshlib: all_gather / all_to_all / ppermute over an axis the value does not vary over (see "
                "collective_needs_varying_input<op, axis, value>): every device of that axis already holds the same "
                "block; drop the collective, or pvary over the axis first if you mean it");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, std::size_t Dim, std::size_t ShardedDim, class Value>
struct gather_along_unsharded_dim {
  static_assert(sizeof(Value) == 0,
                "meshlib: all_gather over an axis along a dimension that is not sharded on that axis (see "
                "gather_along_unsharded_dim<op, axis, dim, sharded_dim, value>: sharded_dim is the one sharded on the "
                "axis); gather along sharded_dim, or all_to_all to move the sharding first");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, std::size_t Dim, class Value>
struct dimension_already_sharded_on_axis {
  static_assert(sizeof(Value) == 0,
                "meshlib: psum_scatter / all_to_all would split a dimension over an axis that dimension is already "
                "sharded on (see dimension_already_sharded_on_axis<op, axis, dim, value>); scatter along another "
                "dimension");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct pvary_of_varying_value {
  static_assert(sizeof(Value) == 0,
                "meshlib: pvary / pbroadcast over an axis the value already varies over or is partial over (see "
                "pvary_of_varying_value<op, axis, value>); drop the axis");
  static constexpr bool value = true;
};

template <fixed_string Op, fixed_string Axis, class Value>
struct broadcast_of_partial_value {
  static_assert(sizeof(Value) == 0,
                "meshlib: broadcast over an axis the value is a pending sum (partial) over (see "
                "broadcast_of_partial_value<op, axis, value>): one summand is not the sum; psum first");
  static constexpr bool value = true;
};

template <fixed_string Op, std::size_t Dim, std::size_t Rank>
struct collective_dimension_out_of_range {
  static_assert(Dim < Rank,
                "meshlib: a collective names a dimension past the value's rank (see "
                "collective_dimension_out_of_range<op, dim, rank>)");
  static constexpr bool value = true;
};

template <class T>
struct collective_element_type {
  static_assert(comm_element<T>,
                "meshlib: collectives move float, double, bfloat16 and 32- or 64-bit signed integers only (see "
                "collective_element_type<T>)");
  static constexpr bool value = true;
};

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

/// `Dims` with the axes of `Mask` removed from every dimension.
template <class Dims, axis_mask Mask>
using dims_without_t = typename dims_without_impl<Dims, Mask>::type;
/// `Dims` with `Bit` removed everywhere and added to dimension `D`.
template <class Dims, axis_mask Bit, std::size_t D>
using dims_moved_to_t = typename dims_moved_impl<Dims, Bit, D>::type;
/// `Dims` with a replicated dimension inserted at position `D` (untiled all_gather).
template <class Dims, std::size_t D>
using dims_insert_t = typename dims_insert_impl<Dims, D>::type;

}  // namespace meshlib::detail
