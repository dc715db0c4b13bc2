// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `all_gather`, `psum_scatter`, `all_to_all`: the collectives that change a block's shape,
/// as `jax.lax.all_gather`, `jax.lax.psum_scatter(..., tiled=True)` and `jax.lax.all_to_all`.
/// Blocks are placed in axis-index order: the block of the device at index `i` of the axis is
/// chunk `i` of the gathered (or scattered) dimension.
/// @code
/// // x: block of a P<"data", none> array, shape (2, 6) on each of 4 devices of axis "data"
/// auto full   = meshlib::all_gather<"data", 0>(x);                    // (8, 6), invariant over data
/// auto stack  = meshlib::all_gather<"data", 0>(x, meshlib::untiled);  // (4, 2, 6)
/// auto moved  = meshlib::all_to_all<"data", 1, 0>(x);                 // (8, 6/4): now sharded on dim 1
/// auto shard  = meshlib::psum_scatter<"data", 0>(y);                  // sum over data, scattered on dim 0
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "meshlib/collectives/block_ops.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib {

/// @brief Tag of the untiled `all_gather`: stack the blocks along a new dimension (JAX `tiled=False`).
struct untiled_t {
  explicit untiled_t() = default;
};
/// @brief Tag for the untiled all_gather (a new leading dimension, as `lax.all_gather(tiled=False)`).
inline constexpr untiled_t untiled{};

namespace detail {

/// Common checks: element type, axis in mesh, dimension in range, not partial over the axis, and
/// (when `NeedVary`) varying over it.
template <fixed_string Op, class L, fixed_string Axis, std::size_t Dim, bool NeedVary = true>
consteval bool check_moving_collective() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!collective_element_type<typename L::value_type>::value) return false;
  else if constexpr (!mesh_t::template has_axis<Axis>) return collective_axis_not_in_mesh<Op, Axis, mesh_t>::value;
  else if constexpr (Dim >= L::rank) return collective_dimension_out_of_range<Op, Dim, L::rank>::value;
  else {
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    if constexpr ((L::partial & bit) != 0) return collective_of_partial_value<Op, Axis, L>::value;
    else if constexpr (NeedVary && (L::vary & bit) == 0) return collective_needs_varying_input<Op, Axis, L>::value;
    else return true;
  }
}

template <class L, fixed_string Axis, std::size_t Dim>
consteval bool check_all_gather() {
  if constexpr (!check_moving_collective<"all_gather", L, Axis, Dim>()) return false;
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    constexpr std::size_t sharded = dim_sharded_on<typename L::dims_type>(bit);
    if constexpr (sharded != L::rank && sharded != Dim)
      return gather_along_unsharded_dim<"all_gather", Axis, Dim, sharded, L>::value;
    else return true;
  }
}

template <class L, fixed_string Axis, std::size_t Dim>
consteval bool check_psum_scatter() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!collective_element_type<typename L::value_type>::value) return false;
  else if constexpr (!mesh_t::template has_axis<Axis>) return collective_axis_not_in_mesh<"psum_scatter", Axis, mesh_t>::value;
  else if constexpr (Dim >= L::rank) return collective_dimension_out_of_range<"psum_scatter", Dim, L::rank>::value;
  else {
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    if constexpr (((L::vary | L::partial) & bit) == 0) return psum_over_invariant_axis<"psum_scatter", Axis, L>::value;
    else if constexpr ((L::dims_type::at(Dim) & bit) != 0)
      return dimension_already_sharded_on_axis<"psum_scatter", Axis, Dim, L>::value;
    else return true;
  }
}

template <class L, fixed_string Axis, std::size_t Split, std::size_t Concat>
consteval bool check_all_to_all() {
  if constexpr (!check_moving_collective<"all_to_all", L, Axis, Split>()) return false;
  else if constexpr (Concat >= L::rank) return collective_dimension_out_of_range<"all_to_all", Concat, L::rank>::value;
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    constexpr std::size_t sharded = dim_sharded_on<typename L::dims_type>(bit);
    if constexpr (Split != Concat && (L::dims_type::at(Split) & bit) != 0)
      return dimension_already_sharded_on_axis<"all_to_all", Axis, Split, L>::value;
    else if constexpr (sharded != L::rank && sharded != Concat)
      return gather_along_unsharded_dim<"all_to_all", Axis, Concat, sharded, L>::value;
    else return true;
  }
}

template <class L, fixed_string Axis>
constexpr axis_mask axis_bit_v = safe_mask_v<typename L::mesh_type, Axis>;

/// Throws unless `n` divides dimension `dim` of size `extent`.
inline void check_divides(std::string_view op, std::string_view axis, std::size_t dim, std::size_t extent, std::size_t n) {
  if (extent % n != 0)
    throw sharding_error("meshlib: " + std::string(op) + " over axis '" + std::string(axis) + "' (size " +
                         std::to_string(n) + ") splits dimension " + std::to_string(dim) + " of size " +
                         std::to_string(extent) + ", which is not divisible by " + std::to_string(n));
}

}  // namespace detail

/// @brief Tiled all-gather over axis `Axis` along dimension `Dim` (JAX `all_gather(x, axis, axis=Dim,
/// tiled=True)`): the blocks of the axis group, concatenated along `Dim` in axis-index order. `x`
/// must vary over `Axis`, and if some dimension is sharded on `Axis` it must be `Dim`; the result
/// is invariant over `Axis` and dimension `Dim` is no longer sharded on it.
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x) {
  constexpr bool ok = detail::check_all_gather<L, Axis, Dim>();
  constexpr axis_mask bit = detail::axis_bit_v<L, Axis>;
  using result_t = with_vary_t<with_dims_t<L, detail::dims_without_t<typename L::dims_type, bit>>, L::vary & ~bit>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    const T* src = detail::contiguous_data(x, "all_gather");
    auto& comm = detail::current_device("all_gather").comm(bit);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    std::vector<T> recv(x.size() * n);
    comm.all_gather(src, recv.data(), x.size(), datatype_of<T>);
    auto out = detail::result_view<L>(detail::with_extent(x.shape(), Dim, x.extent(Dim) * n));
    detail::unpack_chunks(recv.data(), x.shape(), Dim, n, out.data());
    return result_t(out, x.mesh(), x.device());
  }
}

/// @brief Untiled all-gather (JAX `tiled=False`): the blocks stacked along a new dimension inserted
/// at position `Dim` (`Dim = 0`: a leading dimension of the axis size). The type rule of the tiled form.
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x, untiled_t) {
  static_assert(Dim <= L::rank, "meshlib: untiled all_gather inserts its new dimension at a position past the rank");
  constexpr bool ok = detail::check_moving_collective<"all_gather", L, Axis, 0>();
  constexpr axis_mask bit = detail::axis_bit_v<L, Axis>;
  using dims_t = detail::dims_insert_t<detail::dims_without_t<typename L::dims_type, bit>, Dim>;
  using result_t = rebind_local_t<L, typename L::value_type, L::rank + 1, L::vary & ~bit, L::partial, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    const T* src = detail::contiguous_data(x, "all_gather");
    auto& comm = detail::current_device("all_gather").comm(bit);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    std::array<std::size_t, L::rank + 1> chunk{};
    for (std::size_t i = 0, j = 0; i < L::rank + 1; ++i) chunk[i] = i == Dim ? 1 : x.extent(j++);
    auto out = detail::result_view<L, L::rank + 1>(detail::with_extent(chunk, Dim, n));
    if constexpr (Dim == 0) {
      comm.all_gather(src, out.data(), x.size(), datatype_of<T>);
    } else {
      std::vector<T> recv(x.size() * n);
      comm.all_gather(src, recv.data(), x.size(), datatype_of<T>);
      detail::unpack_chunks(recv.data(), chunk, Dim, n, out.data());
    }
    return result_t(out, x.mesh(), x.device());
  }
}

/// @brief Reduce-scatter over axis `Axis` along dimension `Dim` (JAX `psum_scatter(x, axis,
/// scatter_dimension=Dim, tiled=True)`): the sum over the group, of which the device at axis index
/// `i` keeps chunk `i` of dimension `Dim`. `x` must vary over or be partial over `Axis`; the result
/// varies over `Axis`, is no longer partial over it, and dimension `Dim` is sharded on it.
/// @throws sharding_error when the axis size does not divide dimension `Dim`.
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x) {
  constexpr bool ok = detail::check_psum_scatter<L, Axis, Dim>();
  constexpr axis_mask bit = detail::axis_bit_v<L, Axis>;
  using dims_t = std::conditional_t<ok, detail::dims_moved_to_t<typename L::dims_type, bit, (Dim < L::rank ? Dim : 0)>,
                                    typename L::dims_type>;
  using result_t = with_vary_partial_t<with_dims_t<L, dims_t>, L::vary | bit, L::partial & ~bit>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    const T* src = detail::contiguous_data(x, "psum_scatter");
    auto& comm = detail::current_device("psum_scatter").comm(bit);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    detail::check_divides("psum_scatter", Axis.view(), Dim, x.extent(Dim), n);
    std::vector<T> send(x.size());
    detail::pack_chunks(src, x.shape(), Dim, n, send.data());
    auto out = detail::result_view<L>(detail::with_extent(x.shape(), Dim, x.extent(Dim) / n));
    comm.reduce_scatter(send.data(), out.data(), x.size() / n, datatype_of<T>, reduce_op::sum);
    return result_t(out, x.mesh(), x.device());
  }
}

/// @brief All-to-all over axis `Axis` (JAX `all_to_all(x, axis, split_axis=Split,
/// concat_axis=Concat, tiled=True)`): dimension `Split` is cut into axis-size chunks, chunk `j` goes
/// to the device at axis index `j`, and the received chunks are concatenated along `Concat` in
/// axis-index order. Moves sharding on `Axis` from dimension `Concat` to dimension `Split`.
/// @throws sharding_error when the axis size does not divide dimension `Split`.
template <fixed_string Axis, std::size_t Split, std::size_t Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x) {
  constexpr bool ok = detail::check_all_to_all<L, Axis, Split, Concat>();
  constexpr axis_mask bit = detail::axis_bit_v<L, Axis>;
  constexpr bool tracked = ok && (L::dims_type::at(Concat < L::rank ? Concat : 0) & bit) != 0;
  using dims_t = std::conditional_t<tracked, detail::dims_moved_to_t<typename L::dims_type, bit, (Split < L::rank ? Split : 0)>,
                                    typename L::dims_type>;
  using result_t = with_dims_t<L, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    const T* src = detail::contiguous_data(x, "all_to_all");
    auto& comm = detail::current_device("all_to_all").comm(bit);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    detail::check_divides("all_to_all", Axis.view(), Split, x.extent(Split), n);
    std::vector<T> send(x.size()), recv(x.size());
    detail::pack_chunks(src, x.shape(), Split, n, send.data());
    comm.all_to_all(send.data(), recv.data(), x.size() / n, datatype_of<T>);
    const auto chunk = detail::with_extent(x.shape(), Split, x.extent(Split) / n);
    auto out = detail::result_view<L>(detail::with_extent(chunk, Concat, chunk[Concat] * n));
    detail::unpack_chunks(recv.data(), chunk, Concat, n, out.data());
    return result_t(out, x.mesh(), x.device());
  }
}

}  // namespace meshlib
