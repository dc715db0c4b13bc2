// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `check_replicated(x)`: meshlib's `checkify` for sharding. A `local_tensor` whose type says
/// it is invariant over some mesh axes must hold the same bits on every device of each group along
/// those axes; this gathers the copies and compares them, naming the first differing device, the
/// element and both values. Debug mode runs it on every `shard_map` output.
/// @code
/// meshlib::spmd(m, [&] {
///   auto w = meshlib::psum<"data">(g);     // invariant over 'data'
///   meshlib::check_replicated(w);          // throws replica_mismatch if a kernel made copies diverge
/// });
/// @endcode

#include <array>
#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/debug/errors.hpp"
#include "meshlib/debug/observe.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib {

namespace debug::detail {

template <local_tensor_type L>
void check_replicated_over(const L& x, axis_mask mask, std::string_view what) {
  using T = typename L::value_type;
  using Mesh = typename L::mesh_type;
  mask &= Mesh::all_axes;
  if (mask == 0) return;
  experimental::device_context& ctx = experimental::current_device(what);
  const std::size_t count = x.size();
  std::vector<T> mine(count);
  const auto shape = x.shape();
  {
    // Copy out in row-major order (the block may be a strided view).
    std::array<std::size_t, L::rank> idx{};
    for (std::size_t k = 0; k < count; ++k) {
      mine[k] = std::apply([&](auto... i) { return x.view()(i...); }, idx);
      for (std::size_t d = L::rank; d-- > 0;) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  experimental::unobserved_scope quiet;
  auto& comm = ctx.comm(mask);
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<T> all(count * n);
  comm.all_gather(mine.data(), all.data(), count, datatype_of<T>);
  const std::vector<std::size_t> group = x.mesh().group(ctx.device(), mask);
  for (std::size_t r = 1; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) {
      const T& a = all[i];
      const T& b = all[r * count + i];
      if (std::memcmp(&a, &b, sizeof(T)) == 0) continue;
      std::ostringstream os;
      os << "meshlib: " << what << ": the value is replicated over " << describe_axes<Mesh>(mask) << " (devices ";
      for (std::size_t g = 0; g < group.size(); ++g) os << (g ? ", " : "") << group[g];
      os << ") but device " << group[r] << " differs from device " << group[0] << " at element " << i << " (index (";
      std::size_t rest = i;
      std::array<std::size_t, L::rank> idx{};
      for (std::size_t d = L::rank; d-- > 0;) {
        idx[d] = shape[d] ? rest % shape[d] : 0;
        rest = shape[d] ? rest / shape[d] : 0;
      }
      for (std::size_t d = 0; d < L::rank; ++d) os << (d ? ", " : "") << idx[d];
      os << ")): " << b << " on device " << group[r] << " vs " << a << " on device " << group[0]
         << "; a kernel computed different values on replicas";
      throw replica_mismatch(os.str());
    }
}

}  // namespace debug::detail

/// @brief Checks, inside `shard_map` / `spmd`, that `x` is bitwise identical on every device of its
/// groups along the axes its type says it is invariant over (all mesh axes it neither varies over
/// nor is partial over). Collective over those groups: every device must call it.
/// @throws replica_mismatch naming the first differing device (in group order), the element and both values.
template <local_tensor_type L>
void check_replicated(const L& x) {
  debug::detail::check_replicated_over(x, L::mesh_type::all_axes & ~L::vary & ~L::partial, "check_replicated");
}

/// @brief `check_replicated` over the axes `Names...` only; `x` must be invariant over each.
template <fixed_string... Names, local_tensor_type L>
  requires(sizeof...(Names) > 0)
void check_replicated(const L& x) {
  using Mesh = typename L::mesh_type;
  static_assert((Mesh::template has_axis<Names> && ...), "meshlib: check_replicated<...>: the mesh has no such axis");
  constexpr axis_mask mask = Mesh::template mask_of<Names...>();
  static_assert((mask & (L::vary | L::partial)) == 0,
                "meshlib: check_replicated<...>: the value varies over (or is a pending sum over) one of these axes, "
                "so its copies are not expected to agree; check only axes its type is invariant over");
  debug::detail::check_replicated_over(x, mask, "check_replicated");
}

namespace debug::detail {

/// Debug mode's check of `shard_map` outputs (a tuple of local tensors), called on every device.
template <class Tuple>
void debug_check_outputs(const Tuple& outputs) {
  if (!debug_mode()) [[likely]]
    return;
  {
    auto& s = debug_state::get();
    std::lock_guard lk(s.m);
    if (!s.options.check_replicas) return;
  }
  std::apply(
      [](const auto&... o) {
        (check_replicated_over(o, std::remove_cvref_t<decltype(o)>::mesh_type::all_axes &
                                      ~std::remove_cvref_t<decltype(o)>::vary & ~std::remove_cvref_t<decltype(o)>::partial,
                               "shard_map output (debug mode)"),
         ...);
      },
      outputs);
}

}  // namespace debug::detail

namespace experimental {
/// In debug mode, checks that outputs declared replicated are identical on every device of their group (exec calls it after a run).
using debug::detail::debug_check_outputs;
}  // namespace experimental
}  // namespace meshlib
