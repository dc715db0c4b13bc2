// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Local steps that change what the type says about a per-device value, without
/// communication: `forget_dims` (drop the record of which dimension is a block of which axis),
/// `reshape` (a new local shape for the same elements: the tensor layer's, tensor/reshape.hpp,
/// included here) and `axis_index(x)` (this device's group
/// position as a per-device int32 scalar, as JAX's `lax.axis_index`).
///
/// Why `forget_dims` exists: meshlib tracks, per dimension, the axes it is a block of, and uses it
/// to refuse a gather or scatter along the wrong dimension. JAX does not track it, so some valid JAX
/// programs split a dimension that is already a block of the axis (the tutorial's `psum_scatter` of
/// a scattered block) or concatenate along another one. `forget_dims<"i">(x)` says "treat this block
/// as unlabelled along 'i'": the value still varies over 'i', only the per-dimension record goes.
/// @code
/// auto y = meshlib::psum_scatter<"i", 0>(meshlib::forget_dims<"i">(x));  // x's dim 0 was a block of 'i'
/// auto r = meshlib::reshape(x, std::array<std::size_t, 1>{x.size()});    // flatten the local block
/// auto k = meshlib::axis_index<"i">(x);   // local_tensor<std::int32_t, 0, ...> varying over 'i'
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "meshlib/collectives/axis_group.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/reshape.hpp"

namespace meshlib {

/// @brief `x` with no dimension recorded as a block of the axes `Names...` (see the file comment).
/// The value, its `vary` and `partial` sets are unchanged and no data moves.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto forget_dims(const L& x) {
  static_assert(sizeof...(Names) > 0, "meshlib: forget_dims needs at least one axis: forget_dims<\"data\">(x)");
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = (collectives::detail::check_axis_in_mesh<"forget_dims", Names, mesh_t>() && ...);
  using result_t = with_dims_t<L, collectives::detail::dims_without_t<typename L::dims_type, collectives::detail::safe_mask_v<mesh_t, Names...>>>;
  if constexpr (!ok) return result_t{};
  else return result_t(x.view(), x.mesh(), x.device());
}

/// @brief This device's position in the group of the axes `Names...` (row-major in the order
/// written) as a per-device value on `like`'s mesh: an `std::int32_t` scalar that varies over those
/// axes, as JAX's `lax.axis_index` inside `shard_map`. `like` only names the mesh and device.
/// @throws spmd_context_error outside `shard_map` / `spmd`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto axis_index(const L& like) {
  static_assert(sizeof...(Names) > 0, "meshlib: axis_index needs at least one axis: axis_index<\"data\">(x)");
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = (collectives::detail::check_axis_in_mesh<"axis_index", Names, mesh_t>() && ...);
  using result_t = local_tensor<std::int32_t, 0, mesh_t, collectives::detail::safe_mask_v<mesh_t, Names...>, 0, replicated_dims<0>,
                                typename L::memory_space>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    std::size_t p = 0;
    if constexpr (sizeof...(Names) == 1) p = (axis_index<Names>(), ...);
    else p = axis_index<Names...>();
    auto out = allocate<std::int32_t, 0, typename L::memory_space>({}, "meshlib::axis_index", false);
    *out.data() = static_cast<std::int32_t>(p);
    return result_t(out, like.mesh(), like.device());
  }
}

}  // namespace meshlib
