// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `axis<"name">`: a named mesh axis. The name is part of the type, so collectives and
/// partition specs that name an axis are checked against the mesh at compile time.

#include <cstddef>
#include <ostream>
#include <span>

#include "meshlib/core/fixed_string.hpp"

namespace meshlib {

/// @brief The size of an axis known only at run time (mdspan's convention).
inline constexpr std::size_t dynamic_extent = std::dynamic_extent;

/// @brief A mesh axis named `Name`, of a size given at run time, or fixed at compile time by `Size`.
/// @code
/// using data  = meshlib::axis<"data">;      // size given when the mesh is built
/// using model = meshlib::axis<"model", 2>;  // always 2
/// @endcode
template <fixed_string Name, std::size_t Size = dynamic_extent>
struct axis {
  static_assert(!Name.empty(), "meshlib: a mesh axis needs a non-empty name");
  static_assert(Size != 0, "meshlib: a mesh axis of static size 0 holds no device");
  using is_mesh_axis = void;  // opt-in tag of the mesh_axis concept
  static constexpr fixed_string name = Name;
  static constexpr std::size_t static_size = Size;

  friend std::ostream& operator<<(std::ostream& os, axis) { return os << "axis<\"" << Name.view() << "\">"; }
};

/// @brief A type that names a mesh axis: `axis<...>` or a type that carries the same nested tag.
template <class T>
concept mesh_axis = requires {
  typename T::is_mesh_axis;
  { T::name.view() };
  { T::static_size } -> std::convertible_to<std::size_t>;
};

}  // namespace meshlib
