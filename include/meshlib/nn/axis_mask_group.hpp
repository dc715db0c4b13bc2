// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The public typed collectives over a compile-time *mask* of mesh axes. The training layer
/// reads its axes from types as masks (`State::data_axes`, the axes that shard a dimension of the
/// logits, every axis of the mesh), while `psum<Names...>` and friends take names: `group_of_t`
/// turns a mask into the `axis_group` of its names in mesh order, and `psum_over<Mask>(x)` /
/// `pmax_over<Mask>(x)` call the public collective with those names, so nn goes through the same
/// path as a user's `shard_map` (the donated forms: a value over nn's own buffer is reduced in it).

#include <cstddef>
#include <type_traits>
#include <utility>

#include "meshlib/collectives/axis_group.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn::detail {

template <axis_mask Mask, std::size_t I, class Acc, class... Axes>
struct select_axes {
  using type = Acc;
};
// Over the group's `append`, not a specialisation on axis_group<Names...>, which nvcc does not match.
template <axis_mask Mask, std::size_t I, class Acc, class A, class... Rest>
struct select_axes<Mask, I, Acc, A, Rest...>
    : select_axes<Mask, I + 1, std::conditional_t<((Mask >> I) & 1) != 0, typename Acc::template append<A::name>, Acc>,
                  Rest...> {};

template <class Mesh, axis_mask Mask>
struct group_of;
template <mesh_axis... Axes, axis_mask Mask>
struct group_of<mesh<Axes...>, Mask> {
  static_assert(Mask != 0, "meshlib::nn: a collective over no axis (the caller skips it)");
  // An empty axis_group<> cannot be named, so the first selected axis seeds the list.
  template <std::size_t I, class... Rest>
  struct first;
  template <std::size_t I, class A, class... Rest>
  struct first<I, A, Rest...> {
    using type = std::conditional_t<((Mask >> I) & 1) != 0,
                                    typename select_axes<Mask, I + 1, axis_group<A::name>, Rest...>::type,
                                    typename first<I + 1, Rest...>::type>;
  };
  template <std::size_t I>
  struct first<I> {
    using type = void;
  };
  using type = typename first<0, Axes...>::type;
};

/// The `axis_group` of the axes of `Mask` of `Mesh`, in mesh order.
template <class Mesh, axis_mask Mask>
using group_of_t = typename group_of<Mesh, Mask>::type;

/// The reductions over the axes `Names...` (and the group's communicator made ahead), reached through `axis_group::apply` (nvcc deduces no
/// `axis_group<Names...>` function argument: collectives/axis_group.hpp).
template <fixed_string... Names>
struct reductions_over_names {
  template <class L>
  static auto sum(L&& x) {
    return meshlib::psum<Names...>(std::forward<L>(x));
  }
  template <class L>
  static auto sum_start(L&& x) {
    return meshlib::psum_start<Names...>(std::forward<L>(x));
  }
  template <class L>
  static auto max(L&& x) {
    return meshlib::pmax<Names...>(std::forward<L>(x));
  }
  static void prepare() { meshlib::prepare_group<Names...>(); }
};

/// The reductions over the axes of `Mask` of the mesh of `L`.
template <axis_mask Mask, class L>
using reductions_over_t =
    typename group_of_t<typename std::remove_cvref_t<L>::mesh_type, Mask>::template apply<reductions_over_names>;

/// `prepare_group<names of Mask...>()`: makes the group's communicator now.
template <mesh_type Mesh, axis_mask Mask>
void prepare_group_over() {
  group_of_t<Mesh, Mask>::template apply<reductions_over_names>::prepare();
}
/// `psum<names of Mask...>(x)` (an rvalue `x` is donated).
template <axis_mask Mask, local_tensor_type L>
auto psum_over(L&& x) {
  return reductions_over_t<Mask, L>::sum(std::forward<L>(x));
}
/// `psum_start<names of Mask...>(x)` (an rvalue `x` is donated): the asynchronous `psum_over`.
template <axis_mask Mask, local_tensor_type L>
auto psum_start_over(L&& x) {
  return reductions_over_t<Mask, L>::sum_start(std::forward<L>(x));
}
/// `pmax<names of Mask...>(x)` (an rvalue `x` is donated).
template <axis_mask Mask, local_tensor_type L>
auto pmax_over(L&& x) {
  return reductions_over_t<Mask, L>::max(std::forward<L>(x));
}

}  // namespace meshlib::nn::detail
