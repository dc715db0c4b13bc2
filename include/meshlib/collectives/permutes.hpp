// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `ppermute`, `broadcast`, `pvary` / `pbroadcast`: the collectives that keep a block's shape.
/// @code
/// // ring shift over axis "x" of size n: device i sends to i + 1
/// std::vector<std::pair<std::size_t, std::size_t>> ring;
/// for (std::size_t i = 0; i < n; ++i) ring.push_back({i, (i + 1) % n});
/// auto y = meshlib::ppermute<"x">(x, ring);
/// auto z = meshlib::broadcast<"x">(x, 0);   // every device of the group gets index 0's block
/// auto v = meshlib::pvary<"x">(w);          // w replicated over x, now typed as varying (no copy)
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/collectives/block_ops.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/gathers.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib {

namespace collectives::detail {

template <class L, fixed_string Axis>
consteval bool check_pvary_axis() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!mesh_t::template has_axis<Axis>) return check_axis_in_mesh<"pvary", Axis, mesh_t>();
  else if constexpr (((L::vary | L::partial) & (axis_mask{1} << mesh_t::find_axis(Axis.view()))) != 0)
    return pvary_of_varying_value<diagnostic::op_t<"pvary">, diagnostic::axis_t<Axis>, diagnostic::value_t<L>>();
  else return true;
}

template <class L, fixed_string Axis>
consteval bool check_broadcast() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!check_element_type<"broadcast", typename L::value_type>()) return false;
  else if constexpr (!mesh_t::template has_axis<Axis>) return check_axis_in_mesh<"broadcast", Axis, mesh_t>();
  else if constexpr ((L::partial & (axis_mask{1} << mesh_t::find_axis(Axis.view()))) != 0)
    return broadcast_of_partial_value<diagnostic::op_t<"broadcast">, diagnostic::axis_t<Axis>, diagnostic::value_t<L>>();
  else return true;
}

template <class G, class L>
auto ppermute_impl(const L& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = group_checks<G>::template run<"ppermute", L, axis_rule::moves>();
  if constexpr (!ok) {
    return L{};
  } else {
    using T = typename L::value_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    const T* src = contiguous_data(x, "ppermute");
    device_context& ctx = current_device("ppermute");
    auto& comm = ctx.comm(mask);
    // perm names group positions in the order written; the communicator ranks run in mesh order.
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    std::vector<std::size_t> rank_of(order.size());
    for (std::size_t r = 0; r < order.size(); ++r) rank_of[order[r]] = r;
    const auto to_rank = [&](std::size_t p) { return p < rank_of.size() ? rank_of[p] : p; };  // out of range: the communicator says so
    std::vector<permute_pair> pairs;
    pairs.reserve(perm.size());
    for (const auto& [s, d] : perm) pairs.push_back(permute_pair{static_cast<int>(to_rank(s)), static_cast<int>(to_rank(d))});
    auto out = workspace_view<T, L::rank, typename L::memory_space>(ctx, x.shape());
    comm.ppermute(src, out.data(), x.size(), datatype_of<T>, pairs);  // zeros where nothing arrives
    return L(out, x.mesh(), x.device());
  }
}

}  // namespace collectives::detail

/// @brief Sends this device's block to another index of axis `Axis` (JAX `lax.ppermute(x, axis,
/// perm)`): `perm` holds (source, destination) axis indices; a device that no pair sends to gets
/// zeros. No index may appear twice as a source or twice as a destination. `x` must vary over
/// `Axis`; the result has the same type.
/// @throws comm_argument_error for an index out of range or repeated (from the communicator).
template <fixed_string Axis, local_tensor_type L>
[[nodiscard]] auto ppermute(const L& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  return collectives::detail::ppermute_impl<axis_group<Axis>>(x, perm);
}
/// @brief `ppermute` over several axes: `perm` holds group positions, row-major over the axes in
/// the order written (JAX `ppermute(x, ('i', 'j'), perm)`).
template <axis_group_type G, local_tensor_type L>
[[nodiscard]] auto ppermute(const L& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  return collectives::detail::ppermute_impl<G>(x, perm);
}

/// @brief Every device of the `Axis` group gets the block of the device at axis index `root`
/// (MPI's / NCCL's broadcast; in JAX, `all_gather(x, axis)[root]`). The result is invariant over
/// `Axis`; `x` must not be partial over it. A value already invariant over `Axis` passes through.
template <fixed_string Axis, local_tensor_type L>
[[nodiscard]] auto broadcast(const L& x, std::size_t root) {
  constexpr bool ok = collectives::detail::check_broadcast<L, Axis>();
  constexpr axis_mask bit = collectives::detail::safe_mask_v<typename L::mesh_type, Axis>;
  using result_t = with_vary_t<with_dims_t<L, collectives::detail::dims_without_t<typename L::dims_type, bit>>, L::vary & ~bit>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    const T* src = collectives::detail::contiguous_data(x, "broadcast");
    auto& ctx = collectives::detail::current_device("broadcast");
    auto& comm = ctx.comm(bit);
    if (root >= static_cast<std::size_t>(comm.size()))
      throw sharding_error("meshlib: broadcast<\"" + std::string(Axis.view()) + "\">: root index " + std::to_string(root) +
                           " is out of range for an axis of size " + std::to_string(comm.size()));
    using space_t = typename L::memory_space;
    auto out = collectives::detail::workspace_view<T, L::rank, space_t>(ctx, x.shape());
    collectives::detail::copy_elements<space_t>(src, x.size(), out.data());
    comm.broadcast(out.data(), x.size(), datatype_of<T>, static_cast<int>(root));
    return result_t(out, x.mesh(), x.device());
  }
}

/// @brief Marks a value invariant over the axes `Names...` as varying over them (JAX `lax.pvary`,
/// formerly `pbroadcast`): no data moves, only the type changes, so that it can meet varying values
/// (`x + axis-dependent value`) or go into a collective that needs a varying input.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pvary(const L& x) {
  static_assert(sizeof...(Names) > 0, "meshlib: pvary needs at least one axis: pvary<\"data\">(x)");
  constexpr bool ok = (collectives::detail::check_pvary_axis<L, Names>() && ...);
  constexpr axis_mask mask = collectives::detail::safe_mask_v<typename L::mesh_type, Names...>;
  using result_t = with_vary_t<L, L::vary | mask>;
  if constexpr (!ok) return result_t{};
  else return result_t(x.view(), x.mesh(), x.device());
}

/// @brief The older JAX name of `pvary`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pbroadcast(const L& x) {
  return pvary<Names...>(x);
}

}  // namespace meshlib
