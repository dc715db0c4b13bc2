// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `all_gather`, `psum_scatter`, `all_to_all`: the collectives that change a block's shape,
/// as `jax.lax.all_gather`, `jax.lax.psum_scatter` and `jax.lax.all_to_all`, tiled (meshlib's
/// default) or untiled (`meshlib::untiled`, JAX's default `tiled=False`), over one axis (`"i"`) or
/// several in the order written (`axis_group<"j", "i">`). Blocks are placed in group-position order:
/// the block of the device at position `p` of the group (`axis_index<...>()`) is chunk `p` of the
/// gathered (or scattered) dimension. Dimension numbers may be negative and count from the end, as
/// in JAX (for the untiled all_gather, from the end of the result).
/// @code
/// // x: block of a P<"data", none> array, shape (2, 6) on each of 4 devices of axis "data"
/// auto full   = meshlib::all_gather<"data", 0>(x);                    // (8, 6), invariant over data
/// auto stack  = meshlib::all_gather<"data", 0>(x, meshlib::untiled);  // (4, 2, 6)
/// auto moved  = meshlib::all_to_all<"data", 1, 0>(x);                 // (8, 6/4): now sharded on dim 1
/// auto shard  = meshlib::psum_scatter<"data", 0>(y);                  // sum over data, scattered on dim 0
/// auto both   = meshlib::all_gather<meshlib::axis_group<"model", "data">, -1>(z);  // ('model', 'data')
/// @endcode

#include <any>
#include <array>
#include <bit>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/axis_group.hpp"
#include "meshlib/collectives/block_ops.hpp"
#include "meshlib/collectives/collective_request.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib {

/// @brief Tag of the untiled forms (JAX `tiled=False`): `all_gather` stacks the blocks along a new
/// dimension, `psum_scatter` removes the scattered dimension, `all_to_all` removes the split
/// dimension and inserts one of the group size at the concat position.
struct untiled_t {
  explicit untiled_t() = default;
};
/// @brief Tag for the untiled all_gather (a new leading dimension, as `lax.all_gather(tiled=False)`).
inline constexpr untiled_t untiled{};

namespace collectives::detail {

/// What a collective needs of the value, per axis of its group.
enum class axis_rule {
  moves,  ///< varies over the axis, not partial over it (all_gather, all_to_all, ppermute)
  sums,   ///< varies over or is partial over the axis (psum_scatter)
};

template <fixed_string Op, class L, fixed_string Axis, axis_rule Rule>
consteval bool check_group_axis() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!mesh_t::template has_axis<Axis>) {
    return check_axis_in_mesh<Op, Axis, mesh_t>();
  } else {
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    if constexpr (Rule == axis_rule::sums && ((L::vary | L::partial) & bit) == 0)
      return psum_over_invariant_axis<diagnostic::op_t<Op>, diagnostic::axis_t<Axis>, diagnostic::value_t<L>>();
    else if constexpr (Rule == axis_rule::moves && (L::partial & bit) != 0)
      return collective_of_partial_value<diagnostic::op_t<Op>, diagnostic::axis_t<Axis>, diagnostic::value_t<L>>();
    else if constexpr (Rule == axis_rule::moves && (L::vary & bit) == 0)
      return collective_needs_varying_input<diagnostic::op_t<Op>, diagnostic::axis_t<Axis>, diagnostic::value_t<L>>();
    else return true;
  }
}

template <fixed_string... Names>
struct group_checks_of {
  /// Element type, each axis in the mesh and as `Rule` wants it, no axis twice.
  template <fixed_string Op, class L, axis_rule Rule>
  static consteval bool run() {
    using mesh_t = typename L::mesh_type;
    if constexpr (!check_element_type<Op, typename L::value_type>()) return false;
    else if constexpr (!(check_group_axis<Op, L, Names, Rule>() && ...)) return false;
    else if constexpr (std::popcount(safe_mask_v<mesh_t, Names...>) != sizeof...(Names))
      return collective_axis_repeated<diagnostic::op_t<Op>, diagnostic::axes_t<mesh_t, safe_mask_v<mesh_t, Names...>>>();
    else return true;
  }
  template <class Mesh>
  static constexpr axis_mask mask = safe_mask_v<Mesh, Names...>;
};

/// The checks of group `G` (`axis_group::apply`: nvcc matches no specialisation on the group).
template <class G>
using group_checks = typename G::template apply<group_checks_of>;

/// Mask of the axes of group `G` (those the mesh has).
template <class Mesh, class G>
inline constexpr axis_mask group_mask_v = group_checks<G>::template mask<Mesh>;

/// The first dimension other than `Keep` that is a block of an axis of `Mask`, or `Dims::size`.
template <class Dims>
constexpr std::size_t other_dim_sharded_on(axis_mask mask, std::size_t keep) noexcept {
  for (std::size_t d = 0; d < Dims::size; ++d)
    if (d != keep && (Dims::at(d) & mask) != 0) return d;
  return Dims::size;
}

template <class L, class G, int DimArg>
consteval bool check_all_gather() {
  constexpr std::size_t dim = norm_dim_v<DimArg, L::rank>;
  if constexpr (!group_checks<G>::template run<"all_gather", L, axis_rule::moves>()) return false;
  else if constexpr (!check_dim<"all_gather", DimArg, L::rank>()) return false;
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    constexpr std::size_t other = other_dim_sharded_on<typename L::dims_type>(mask, dim);
    if constexpr (other != L::rank)
      return gather_along_unsharded_dim<diagnostic::op_t<"all_gather">, diagnostic::axes_t<mesh_t, mask & L::dims_type::at(other)>,
                                        diagnostic::dim<dim>, diagnostic::dim<other>, diagnostic::value_t<L>>();
    else return true;
  }
}

template <class L, class G, int DimArg>
consteval bool check_all_gather_untiled() {
  if constexpr (!group_checks<G>::template run<"all_gather", L, axis_rule::moves>()) return false;
  else return check_dim<"all_gather", DimArg, L::rank + 1>();
}

template <class L, class G, int DimArg, bool Tiled>
consteval bool check_psum_scatter() {
  constexpr std::size_t dim = norm_dim_v<DimArg, L::rank>;
  if constexpr (!group_checks<G>::template run<"psum_scatter", L, axis_rule::sums>()) return false;
  else if constexpr (!check_dim<"psum_scatter", DimArg, L::rank>()) return false;
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    if constexpr (Tiled && (L::dims_type::at(dim) & mask) != 0)
      return dimension_already_sharded_on_axis<diagnostic::op_t<"psum_scatter">, diagnostic::axes_t<mesh_t, mask & L::dims_type::at(dim)>,
                                               diagnostic::dim<dim>, diagnostic::value_t<L>>();
    else return true;
  }
}

template <class L, class G, int SplitArg, int ConcatArg, bool Tiled>
consteval bool check_all_to_all() {
  constexpr std::size_t split = norm_dim_v<SplitArg, L::rank>;
  constexpr std::size_t concat = norm_dim_v<ConcatArg, L::rank>;
  if constexpr (!group_checks<G>::template run<"all_to_all", L, axis_rule::moves>()) return false;
  else if constexpr (!check_dim<"all_to_all", SplitArg, L::rank>()) return false;
  else if constexpr (!check_dim<"all_to_all", ConcatArg, L::rank>()) return false;
  else if constexpr (!Tiled) return true;  // the untiled form forgets the per-dimension labels of its axes
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    constexpr std::size_t other = other_dim_sharded_on<typename L::dims_type>(mask, concat);
    if constexpr (split != concat && (L::dims_type::at(split) & mask) != 0)
      return dimension_already_sharded_on_axis<diagnostic::op_t<"all_to_all">, diagnostic::axes_t<mesh_t, mask & L::dims_type::at(split)>,
                                               diagnostic::dim<split>, diagnostic::value_t<L>>();
    else if constexpr (other != L::rank)
      return concat_along_unsharded_dim<diagnostic::op_t<"all_to_all">, diagnostic::axes_t<mesh_t, mask & L::dims_type::at(other)>,
                                        diagnostic::dim<concat>, diagnostic::dim<other>, diagnostic::value_t<L>>();
    else return true;
  }
}

/// Throws unless dimension `dim` of size `extent` splits into `n` chunks (tiled: `n` divides it;
/// untiled: it equals `n`).
template <class G>
void check_split(std::string_view op, std::size_t dim, std::size_t extent, std::size_t n, bool tiled) {
  if (tiled ? extent % n != 0 : extent != n)
    throw sharding_error("meshlib: " + std::string(op) + " over " + describe_group<G>() + " (group size " +
                         std::to_string(n) + ") splits dimension " + std::to_string(dim) + " of size " +
                         std::to_string(extent) + (tiled ? ", which is not divisible by " : ", which the untiled form needs to equal ") +
                         std::to_string(n));
}

/// `shape` without dimension `d`.
template <std::size_t Rank>
std::array<std::size_t, Rank - 1> without_dim(const std::array<std::size_t, Rank>& shape, std::size_t d) {
  std::array<std::size_t, Rank - 1> out{};
  for (std::size_t i = 0, j = 0; i < Rank; ++i)
    if (i != d) out[j++] = shape[i];
  return out;
}

/// `shape` with a dimension of size `v` inserted at position `d`.
template <std::size_t Rank>
std::array<std::size_t, Rank + 1> with_dim(const std::array<std::size_t, Rank>& shape, std::size_t d, std::size_t v) {
  std::array<std::size_t, Rank + 1> out{};
  for (std::size_t i = 0, j = 0; i < Rank + 1; ++i) out[i] = i == d ? v : shape[j++];
  return out;
}

/// Whether the chunks of `shape` along dimension `d` are consecutive blocks in memory (every
/// dimension before `d` of extent 1), so that a collective's packed buffer is the block itself.
template <std::size_t Rank>
constexpr bool chunks_contiguous(const std::array<std::size_t, Rank>& shape, std::size_t d) noexcept {
  for (std::size_t k = 0; k < d; ++k)
    if (shape[k] != 1) return false;
  return true;
}

/// All-gathers `src` (a block of shape `chunk`) over `comm` into `out`, the `n` blocks side by side
/// along dimension `dim` in the order written (`order`, see `written_order`): straight into `out`
/// when its chunks are consecutive in memory, else through a workspace staging buffer.
template <class Space, class T, std::size_t Rank>
void gather_into(device_context& ctx, device_comm& comm, const T* src, const std::array<std::size_t, Rank>& chunk,
                 std::size_t dim, std::size_t n, const std::vector<std::size_t>& order, T* out) {
  const std::size_t count = box_size(chunk);
  if (order.empty() && chunks_contiguous(chunk, dim)) {
    comm.all_gather(src, out, count, datatype_of<T>);
    return;
  }
  auto recv = ctx.workspace().template scratch<T, Space>(count * n);
  comm.all_gather(src, recv.data(), count, datatype_of<T>);
  unpack_chunks<Space>(recv.data(), chunk, dim, n, out, order);
}

/// The block a collective writes its result of `shape` into: `into`'s own when the caller gave
/// one (`Into` a local tensor: its shape must be `shape`, contiguous), else one from the workspace.
template <class T, std::size_t Rank, class Space, class Into>
block_view<T, Rank, Space> result_block(device_context& ctx, std::string_view op, const std::array<std::size_t, Rank>& shape,
                                          const Into& into) {
  if constexpr (std::is_same_v<Into, std::nullptr_t>) {
    return workspace_view<T, Rank, Space>(ctx, shape);
  } else {
    static_assert(std::is_same_v<typename Into::value_type, T> && Into::rank == Rank &&
                      std::is_same_v<typename Into::memory_space, Space>,
                  "meshlib: the output block of a collective's _into form needs the result's element type, rank "
                  "and memory space");
    if (into.shape() != shape || (into.size() != 0 && !into.view().span_is_contiguous()))
      throw sharding_error("meshlib: " + std::string(op) + "_into: the output block has shape " +
                           experimental::describe_shape(into.shape()) + ", but the result has shape " + experimental::describe_shape(shape) +
                           " (a contiguous block is needed); pass a block of the result's shape");
    return into.view();
  }
}

template <class G, int DimArg, class L, class Into = std::nullptr_t, bool Async = false>
auto all_gather_tiled(const L& x, const Into& into = nullptr, std::bool_constant<Async> = {}) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_all_gather<L, G, DimArg>();
  constexpr std::size_t dim = norm_dim_v<DimArg, L::rank>;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  using result_t = with_vary_t<with_dims_t<L, dims_without_t<typename L::dims_type, mask>>, L::vary & ~mask>;
  if constexpr (!ok) {
    if constexpr (Async) return collective_request<result_t>{};
    else return result_t{};
  } else if constexpr (Async) {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_gather");
    device_context& ctx = current_device("all_gather");
    const std::size_t n = x.mesh().axes_size(mask);  // (comm(mask) would wait for the started ones)
    auto out = result_block<T, L::rank, space_t>(ctx, "all_gather", with_extent(x.shape(), dim, x.extent(dim) * n), into);
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    if (order.empty() && chunks_contiguous(x.shape(), dim)) {  // the blocks land where they belong: started
      T* dst = out.data();
      const std::size_t count = x.size();
      return issue<true>(ctx, mask, result_t(out, x.mesh(), x.device()),
                         [src, dst, count](device_comm& c) { c.all_gather(src, dst, count, datatype_of<T>); },
                         std::any(x));
    }
    // Reordered or strided chunks are unpacked by a kernel on this thread: gathered now, complete.
    gather_into<space_t>(ctx, ctx.comm(mask), src, x.shape(), dim, n, order, out.data());
    return collective_request<result_t>(ctx.stream(), completed_op(), result_t(out, x.mesh(), x.device()));
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_gather");
    device_context& ctx = current_device("all_gather");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    auto out = result_block<T, L::rank, space_t>(ctx, "all_gather", with_extent(x.shape(), dim, x.extent(dim) * n), into);
    gather_into<space_t>(ctx, comm, src, x.shape(), dim, n, written_order_of<mesh_t, G>(x.mesh()), out.data());
    return result_t(out, x.mesh(), x.device());
  }
}

template <class G, int DimArg, class L>
auto all_gather_untiled(const L& x) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_all_gather_untiled<L, G, DimArg>();
  constexpr std::size_t dim = ok ? norm_dim_v<DimArg, L::rank + 1> : 0;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  using dims_t = dims_insert_t<dims_without_t<typename L::dims_type, mask>, dim>;
  using result_t = rebind_local_t<L, typename L::value_type, L::rank + 1, L::vary & ~mask, L::partial, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_gather");
    device_context& ctx = current_device("all_gather");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const auto chunk = with_dim(x.shape(), dim, 1);
    auto out = workspace_view<T, L::rank + 1, space_t>(ctx, with_extent(chunk, dim, n));
    gather_into<space_t>(ctx, comm, src, chunk, dim, n, written_order_of<mesh_t, G>(x.mesh()), out.data());
    return result_t(out, x.mesh(), x.device());
  }
}

template <class G, int DimArg, bool Tiled, class L, class Into = std::nullptr_t>
auto psum_scatter_impl(const L& x, const Into& into = nullptr) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_psum_scatter<L, G, DimArg, Tiled>();
  constexpr std::size_t dim = ok ? norm_dim_v<DimArg, L::rank> : 0;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  constexpr std::size_t out_rank = Tiled || L::rank == 0 ? L::rank : L::rank - 1;
  using dims_t = std::conditional_t<Tiled, dims_moved_to_t<typename L::dims_type, mask, dim>,
                                    remove_dim_or_self_t<typename L::dims_type, dim>>;
  using result_t = rebind_local_t<L, typename L::value_type, out_rank, L::vary | mask, L::partial & ~mask, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "psum_scatter");
    device_context& ctx = current_device("psum_scatter");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    check_split<G>("psum_scatter", dim, x.extent(dim), n, Tiled);
    auto out = [&] {
      if constexpr (Tiled)
        return result_block<T, L::rank, space_t>(ctx, "psum_scatter", with_extent(x.shape(), dim, x.extent(dim) / n), into);
      else return result_block<T, out_rank, space_t>(ctx, "psum_scatter", without_dim(x.shape(), dim), into);
    }();
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    if (order.empty() && chunks_contiguous(x.shape(), dim)) {
      comm.reduce_scatter(src, out.data(), x.size() / n, datatype_of<T>, reduce_op::sum);  // x is packed already
    } else {
      auto send = ctx.workspace().template scratch<T, space_t>(x.size());
      pack_chunks<space_t>(src, x.shape(), dim, n, send.data(), order);
      comm.reduce_scatter(send.data(), out.data(), x.size() / n, datatype_of<T>, reduce_op::sum);
    }
    return result_t(out, x.mesh(), x.device());
  }
}

template <class G, int SplitArg, int ConcatArg, bool Tiled, class L>
auto all_to_all_impl(const L& x) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_all_to_all<L, G, SplitArg, ConcatArg, Tiled>();
  constexpr std::size_t split = ok ? norm_dim_v<SplitArg, L::rank> : 0;
  constexpr std::size_t concat = ok ? norm_dim_v<ConcatArg, L::rank> : 0;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  constexpr bool tracked = (L::dims_type::at(concat) & mask) != 0;
  using dims_t = std::conditional_t<
      Tiled, std::conditional_t<tracked, dims_moved_to_t<typename L::dims_type, mask, split>, typename L::dims_type>,
      dims_insert_t<remove_dim_or_self_t<dims_without_t<typename L::dims_type, mask>, split>, concat>>;
  using result_t = with_dims_t<L, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_to_all");
    device_context& ctx = current_device("all_to_all");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    check_split<G>("all_to_all", split, x.extent(split), n, Tiled);
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    const std::size_t block = x.size() / n;
    // Tiled: chunk j has the input's shape with split cut by n. Untiled: the split dimension
    // (now of size 1) removed and a size-1 dimension inserted at concat: the same elements in the
    // same order, stacked along concat.
    const auto chunk = [&] {
      if constexpr (Tiled) return with_extent(x.shape(), split, x.extent(split) / n);
      else return with_dim(without_dim(x.shape(), split), concat, 1);
    }();
    auto out = workspace_view<T, L::rank, space_t>(ctx, with_extent(chunk, concat, chunk[concat] * n));
    // Staging only where a packed buffer is not the block itself (chunks_contiguous).
    const bool direct_send = order.empty() && chunks_contiguous(x.shape(), split);
    const bool direct_recv = order.empty() && chunks_contiguous(chunk, concat);
    block_view<T, 1, space_t> send, recv;
    if (!direct_send) {
      send = ctx.workspace().template scratch<T, space_t>(x.size());
      pack_chunks<space_t>(src, x.shape(), split, n, send.data(), order);
    }
    if (!direct_recv) recv = ctx.workspace().template scratch<T, space_t>(x.size());
    comm.all_to_all(direct_send ? src : send.data(), direct_recv ? out.data() : recv.data(), block, datatype_of<T>);
    if (!direct_recv) unpack_chunks<space_t>(recv.data(), chunk, concat, n, out.data(), order);
    return result_t(out, x.mesh(), x.device());
  }
}

}  // namespace collectives::detail

/// @brief Tiled all-gather over axis `Axis` along dimension `Dim` (JAX `all_gather(x, axis, axis=Dim,
/// tiled=True)`): the blocks of the axis group, concatenated along `Dim` in axis-index order. `x`
/// must vary over `Axis`, and if some dimension is sharded on `Axis` it must be `Dim`; the result
/// is invariant over `Axis` and dimension `Dim` is no longer sharded on it.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x) {
  return collectives::detail::all_gather_tiled<axis_group<Axis>, Dim>(x);
}
/// @brief The tiled all-gather over several axes, in the order written (JAX `axis_name=('i', 'j')`).
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x) {
  return collectives::detail::all_gather_tiled<G, Dim>(x);
}

/// @brief `all_gather<Axis, Dim>(x)` written into the caller's block `out` (the result's shape,
/// element type and memory space; contiguous) instead of a fresh one: the result is a view of
/// `out`'s buffer with the all_gather's type (`out`'s own vary / partial sets are not read).
/// For a caller that keeps its own buffers, as a training step's flat parameter vector.
/// @code
/// using F = meshlib::local_tensor<float, 1, mesh_t, mesh_t::mask_of<"data">()>;
/// auto full = meshlib::all_gather_into<"data", 0>(F(F::view_type(mine, n), mesh, dev),
///                                                  F(F::view_type(all, n * dp), mesh, dev));
/// @endcode
/// @throws sharding_error when `out` does not have the result's shape.
template <fixed_string Axis, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into(const L& x, const O& out) {
  return collectives::detail::all_gather_tiled<axis_group<Axis>, Dim>(x, out);
}
/// @brief `all_gather_into` over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into(const L& x, const O& out) {
  return collectives::detail::all_gather_tiled<G, Dim>(x, out);
}

/// @brief `all_gather_into` started asynchronously (see `psum_start`): returns a
/// `collective_request` whose `wait()` returns what `all_gather_into<Axis, Dim>(x, out)` returns;
/// the gather runs on the device's communication worker. FSDP prefetches the next layer's
/// parameters with it. Chunks that need reordering (axes written out of mesh order, a dimension
/// other than the leading non-trivial one) are gathered at once and the request is complete.
/// @code
/// auto r = meshlib::all_gather_into_start<"fsdp", 0>(shard, whole);  // whole: the caller's buffer
/// compute_this_layer();
/// auto full = r.wait();                                             // a view of whole
/// @endcode
template <fixed_string Axis, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into_start(const L& x, const O& out) {
  return collectives::detail::all_gather_tiled<axis_group<Axis>, Dim>(x, out, std::true_type{});
}
/// @brief `all_gather_into_start` over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into_start(const L& x, const O& out) {
  return collectives::detail::all_gather_tiled<G, Dim>(x, out, std::true_type{});
}

/// @brief Untiled all-gather (JAX `tiled=False`): the blocks stacked along a new dimension inserted
/// at position `Dim` of the result (`Dim = 0`: a leading dimension of the group size; `-1`: a
/// trailing one). The type rule of the tiled form.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x, untiled_t) {
  return collectives::detail::all_gather_untiled<axis_group<Axis>, Dim>(x);
}
/// @brief The untiled all-gather over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x, untiled_t) {
  return collectives::detail::all_gather_untiled<G, Dim>(x);
}

/// @brief Reduce-scatter over axis `Axis` along dimension `Dim` (JAX `psum_scatter(x, axis,
/// scatter_dimension=Dim, tiled=True)`): the sum over the group, of which the device at axis index
/// `i` keeps chunk `i` of dimension `Dim`. `x` must vary over or be partial over `Axis`; the result
/// varies over `Axis`, is no longer partial over it, and dimension `Dim` is sharded on it. A
/// dimension already sharded on `Axis` is refused: `forget_dims<Axis>(x)` first to scatter it again.
/// @throws sharding_error when the axis size does not divide dimension `Dim`.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x) {
  return collectives::detail::psum_scatter_impl<axis_group<Axis>, Dim, true>(x);
}
/// @brief The tiled reduce-scatter over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x) {
  return collectives::detail::psum_scatter_impl<G, Dim, true>(x);
}
/// @brief `psum_scatter<Axis, Dim>(x)` written into the caller's block `out` (the result's shape,
/// element type and memory space; contiguous): the result is a view of `out`'s buffer with the
/// psum_scatter's type. For a caller that keeps its own buffers (ZeRO's gradient slices).
/// @throws sharding_error when the axis size does not divide dimension `Dim`, or when `out` does
/// not have the result's shape.
template <fixed_string Axis, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto psum_scatter_into(const L& x, const O& out) {
  return collectives::detail::psum_scatter_impl<axis_group<Axis>, Dim, true>(x, out);
}
/// @brief `psum_scatter_into` over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto psum_scatter_into(const L& x, const O& out) {
  return collectives::detail::psum_scatter_impl<G, Dim, true>(x, out);
}

/// @brief Untiled reduce-scatter (JAX `tiled=False`): dimension `Dim`, whose size must equal the
/// group size, is removed; the device at group position `i` keeps slice `i` of the sum.
/// @throws sharding_error when dimension `Dim` is not the group size.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x, untiled_t) {
  return collectives::detail::psum_scatter_impl<axis_group<Axis>, Dim, false>(x);
}
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x, untiled_t) {
  return collectives::detail::psum_scatter_impl<G, Dim, false>(x);
}

/// @brief All-to-all over axis `Axis` (JAX `all_to_all(x, axis, split_axis=Split,
/// concat_axis=Concat, tiled=True)`): dimension `Split` is cut into axis-size chunks, chunk `j` goes
/// to the device at axis index `j`, and the received chunks are concatenated along `Concat` in
/// axis-index order. Moves sharding on `Axis` from dimension `Concat` to dimension `Split`.
/// @throws sharding_error when the axis size does not divide dimension `Split`.
template <fixed_string Axis, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x) {
  return collectives::detail::all_to_all_impl<axis_group<Axis>, Split, Concat, true>(x);
}
/// @brief The tiled all-to-all over several axes, in the order written.
template <axis_group_type G, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x) {
  return collectives::detail::all_to_all_impl<G, Split, Concat, true>(x);
}
/// @brief Untiled all-to-all (JAX `tiled=False`): dimension `Split`, whose size must equal the group
/// size `n`, is removed, and a dimension of size `n` is inserted at position `Concat` of the result;
/// entry `j` along it is what the device at group position `j` sent. The result's dimensions carry
/// no sharding on the group's axes (as after `forget_dims`).
/// @throws sharding_error when dimension `Split` is not the group size.
template <fixed_string Axis, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x, untiled_t) {
  return collectives::detail::all_to_all_impl<axis_group<Axis>, Split, Concat, false>(x);
}
template <axis_group_type G, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x, untiled_t) {
  return collectives::detail::all_to_all_impl<G, Split, Concat, false>(x);
}

}  // namespace meshlib
