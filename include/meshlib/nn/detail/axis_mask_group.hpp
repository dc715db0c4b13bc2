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
template <axis_mask Mask, std::size_t I, fixed_string... Names, class A, class... Rest>
struct select_axes<Mask, I, axis_group<Names...>, A, Rest...>
    : select_axes<Mask, I + 1,
                  std::conditional_t<((Mask >> I) & 1) != 0, axis_group<Names..., A::name>, axis_group<Names...>>,
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

template <fixed_string... Names, class L>
auto psum_names(axis_group<Names...>, L&& x) {
  return meshlib::psum<Names...>(std::forward<L>(x));
}
template <fixed_string... Names, class L>
auto psum_start_names(axis_group<Names...>, L&& x) {
  return meshlib::psum_start<Names...>(std::forward<L>(x));
}
template <fixed_string... Names, class L>
auto pmax_names(axis_group<Names...>, L&& x) {
  return meshlib::pmax<Names...>(std::forward<L>(x));
}

template <fixed_string... Names>
void prepare_group_names(axis_group<Names...>) {
  meshlib::prepare_group<Names...>();
}

/// `prepare_group<names of Mask...>()`: makes the group's communicator now.
template <mesh_type Mesh, axis_mask Mask>
void prepare_group_over() {
  prepare_group_names(group_of_t<Mesh, Mask>{});
}
/// `psum<names of Mask...>(x)` (an rvalue `x` is donated).
template <axis_mask Mask, local_tensor_type L>
auto psum_over(L&& x) {
  return psum_names(group_of_t<typename std::remove_cvref_t<L>::mesh_type, Mask>{}, std::forward<L>(x));
}
/// `psum_start<names of Mask...>(x)` (an rvalue `x` is donated): the asynchronous `psum_over`.
template <axis_mask Mask, local_tensor_type L>
auto psum_start_over(L&& x) {
  return psum_start_names(group_of_t<typename std::remove_cvref_t<L>::mesh_type, Mask>{}, std::forward<L>(x));
}
/// `pmax<names of Mask...>(x)` (an rvalue `x` is donated).
template <axis_mask Mask, local_tensor_type L>
auto pmax_over(L&& x) {
  return pmax_names(group_of_t<typename std::remove_cvref_t<L>::mesh_type, Mask>{}, std::forward<L>(x));
}

}  // namespace meshlib::nn::detail
