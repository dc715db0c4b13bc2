// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `axis_group<"i", "j">`: several mesh axes named together in one collective, as JAX's
/// tuple `axis_name=("i", "j")`. The group position of a device is row-major over the axes *in the
/// order written*, which may differ from the mesh's order; `axis_index<"i", "j">()` returns it.
/// @code
/// // mesh<axis<"i">, axis<"j">>, sizes 2 x 3: device (i, j) is at position j * 2 + i of ("j", "i")
/// auto g = meshlib::all_gather<meshlib::axis_group<"j", "i">, 0>(x);  // blocks in ("j", "i") order
/// std::size_t p = meshlib::axis_index<"j", "i">();                    // this device's position
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"

namespace meshlib {

/// @brief The mesh axes `Names...`, in the order written, as one collective's group (JAX's tuple
/// of axis names). Only a tag: it names axes, it holds nothing.
template <fixed_string... Names>
struct axis_group {
  static_assert(sizeof...(Names) > 0, "meshlib: axis_group needs at least one axis: axis_group<\"data\">");
  /// Tag that opts the group into the `axis_group_type` concept checks.
  using is_axis_group = void;
  /// How many axes the group names.
  static constexpr std::size_t size = sizeof...(Names);
  /// `F<Names...>`: how the library reaches the names. nvcc's front end (EDG, CUDA 13) does not
  /// match a partial specialization on `axis_group<Names...>` (a pack of class-type template
  /// parameters), so the traits below are written over this alias, never specialised on the group.
  template <template <fixed_string...> class F>
  using apply = F<Names...>;
  /// The group with `Name` appended.
  template <fixed_string Name>
  using append = axis_group<Names..., Name>;
};

/// @brief A type that is an `axis_group<...>`.
template <class G>
concept axis_group_type = requires { typename G::is_axis_group; };

namespace collectives::detail {

template <fixed_string... Names>
struct group_traits_of {
  /// Mesh positions of the axes, in the order written (`Mesh::ndim` for a name the mesh lacks).
  template <class Mesh>
  static constexpr std::array<std::size_t, sizeof...(Names)> positions{Mesh::find_axis(Names.view())...};
  /// The names, in the order written.
  static constexpr std::array<std::string_view, sizeof...(Names)> names{Names.view()...};
};

/// The traits of group `G` (`axis_group::apply`: see there why not a specialisation).
template <class G>
using group_traits = typename G::template apply<group_traits_of>;

/// Mesh positions of the axes of `G`, in the order written.
template <class Mesh, class G>
inline constexpr auto group_positions_v = group_traits<G>::template positions<Mesh>;

/// "'i'" or "('j', 'i')": the group as a message names it.
template <class G>
std::string describe_group() {
  const auto& n = group_traits<G>::names;
  if (n.size() == 1) return "'" + std::string(n[0]) + "'";
  std::string s = "(";
  for (std::size_t k = 0; k < n.size(); ++k) s += (k ? ", '" : "'") + std::string(n[k]) + "'";
  return s + ")";
}

/// Whether the axes at mesh positions `pos`, written in that order, are in mesh order: then the
/// communicator's rank is the group position and nothing needs reordering.
template <std::size_t K>
constexpr bool in_mesh_order(const std::array<std::size_t, K>& pos) noexcept {
  for (std::size_t k = 1; k < K; ++k)
    if (pos[k] < pos[k - 1]) return false;
  return true;
}

/// The position, row-major over the axes `pos` in the order written, of the device with mesh
/// coordinates `coord` (JAX's axis_index of a tuple of axes).
template <class Coord, std::size_t K>
std::size_t written_position(const Coord& coord, const std::vector<std::size_t>& sizes, const std::array<std::size_t, K>& pos) {
  std::size_t w = 0;
  for (std::size_t k = 0; k < K; ++k) w = w * sizes[pos[k]] + coord[pos[k]];
  return w;
}

/// For each rank `r` of the communicator over the axes `pos` (whose ranks run row-major in mesh
/// order), its position in the order written. Empty when the two orders agree.
template <std::size_t K>
std::vector<std::size_t> written_order(const std::vector<std::size_t>& axis_sizes, std::array<std::size_t, K> pos) {
  if (in_mesh_order(pos)) return {};
  std::array<std::size_t, K> sorted = pos;
  std::sort(sorted.begin(), sorted.end());
  std::size_t n = 1;
  for (auto p : pos) n *= axis_sizes[p];
  std::vector<std::size_t> coord(axis_sizes.size(), 0), out(n);
  for (std::size_t r = 0; r < n; ++r) {
    std::size_t rest = r;
    for (std::size_t k = K; k-- > 0;) {
      coord[sorted[k]] = rest % axis_sizes[sorted[k]];
      rest /= axis_sizes[sorted[k]];
    }
    out[r] = written_position(coord, axis_sizes, pos);
  }
  return out;
}

/// `written_order` for the group `G` on the running device's mesh.
template <class Mesh, class G>
std::vector<std::size_t> written_order_of(const Mesh& mesh) {
  std::vector<std::size_t> sizes(Mesh::ndim);
  for (std::size_t a = 0; a < Mesh::ndim; ++a) sizes[a] = mesh.axis_size(a);
  return written_order(sizes, group_positions_v<Mesh, G>);
}

}  // namespace collectives::detail

/// @brief This device's position in the group of the axes `A, B, More...`, row-major over them in
/// the order written (JAX's `lax.axis_index(("i", "j"))`). One axis: see `axis_index<"i">()`.
/// @throws spmd_context_error outside `shard_map` / `spmd`, or for an axis the running mesh lacks.
template <fixed_string A, fixed_string B, fixed_string... More>
[[nodiscard]] std::size_t axis_index() {
  constexpr std::array<std::string_view, 2 + sizeof...(More)> names{A.view(), B.view(), More.view()...};
  std::size_t w = 0;
  for (auto name : names) {
    const std::size_t a = collectives::detail::current_axis("axis_index", name);
    auto& dev = collectives::detail::current_device("axis_index");
    w = w * dev.axis_size(a) + dev.coord(a);
  }
  return w;
}

/// @brief The size of the group of the axes `A, B, More...` (the product of their sizes).
template <fixed_string A, fixed_string B, fixed_string... More>
[[nodiscard]] std::size_t axis_size() {
  return axis_size<A>() * axis_size<B>() * (std::size_t{1} * ... * axis_size<More>());
}

}  // namespace meshlib
