// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `mesh<Axes...>`: an N-dimensional grid of devices with named axes, as JAX's `Mesh`.
///
/// Devices are numbered in row-major order over the axes: the last axis varies fastest, as in
/// `jax.make_mesh`. The group of a device along a set of axes is the device and every device that
/// differs from it only in those axes; groups are what per-axis communicators are built from.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/core/axis.hpp"
#include "meshlib/core/checked_size.hpp"
#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/fixed_string.hpp"

namespace meshlib {

namespace core::detail {

/// The position of the first of `Axes` whose name an earlier one already has (`sizeof...(Axes)`: none).
template <class... Axes>
consteval std::size_t first_repeated_axis() {
  constexpr std::array<std::string_view, sizeof...(Axes)> names{Axes::name.view()...};
  for (std::size_t j = 1; j < names.size(); ++j)
    for (std::size_t i = 0; i < j; ++i)
      if (names[i] == names[j]) return j;
  return names.size();
}

/// The name of axis `I` of `Axes`, with static storage (what `diag_name` reads).
template <std::size_t I, class... Axes>
struct nth_axis_name {
  static constexpr std::string_view value = std::array<std::string_view, sizeof...(Axes)>{Axes::name.view()...}[I];
};

/// The name of `Axis`, with static storage.
template <class Axis>
struct axis_name_of {
  static constexpr std::string_view value = Axis::name.view();
};

template <class Axis, class MeshAxes>
consteval bool mesh_names_an_axis_twice() {
  static_assert(always_false<Axis, MeshAxes>,
                "meshlib: two axes of this mesh have the same name (the name and the mesh's axes are spelled out in "
                "the condition); each axis name must be unique");
  return false;
}

/// True when the names of `Axes` are unique; otherwise fires the one diagnostic, naming the axis.
template <class... Axes>
consteval bool diagnose_axis_names() {
  constexpr std::size_t at = first_repeated_axis<Axes...>();
  if constexpr (at == sizeof...(Axes)) {
    return true;
  } else {
    return mesh_names_an_axis_twice<typename diag_name<nth_axis_name<at, Axes...>>::axis,
                                    diagnostic::axes<typename diag_name<axis_name_of<Axes>>::axis...>>();
  }
}

template <class Axis, class MeshAxes>
consteval bool mesh_has_no_axis() {
  static_assert(always_false<Axis, MeshAxes>,
                "meshlib: the mesh has no axis of this name (the name and the mesh's axes are spelled out in the "
                "condition); name one of the mesh's axes");
  return false;
}

}  // namespace core::detail

/// @brief A set of mesh axes, given by their positions in the mesh (bit i: axis i).
/// Used for the device groups of collectives over several axes at once.
using axis_mask = unsigned;

/// @brief A device mesh with named axes `Axes...` (each an `axis<"name">` or `axis<"name", size>`).
/// @code
/// meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">> m{2, 4};  // 8 devices
/// m.coords(5);                    // {1, 1}
/// m.group<"model">(5);            // {4, 5, 6, 7}: device 5 and all that differ only in "model"
/// @endcode
template <mesh_axis... Axes>
class mesh {
  static_assert(sizeof...(Axes) > 0, "meshlib: a mesh needs at least one axis");
  static_assert(core::detail::diagnosed(core::detail::diagnose_axis_names<Axes...>()));
  static_assert(sizeof...(Axes) <= 8 * sizeof(axis_mask), "meshlib: too many mesh axes");

 public:
  /// Tag that opts the mesh into the `mesh_type` concept.
  using is_mesh = void;
  /// The number of axes.
  static constexpr std::size_t ndim = sizeof...(Axes);
  /// A device coordinate: one index per axis, in mesh order.
  using coord_type = std::array<std::size_t, ndim>;

  /// The axis names, in mesh order.
  static constexpr std::array<std::string_view, ndim> axis_names{Axes::name.view()...};
  /// The compile-time sizes (`dynamic_extent` where the size is given at run time).
  static constexpr std::array<std::size_t, ndim> static_sizes{Axes::static_size...};
  /// How many axes take their size at run time (the constructor's arguments).
  static constexpr std::size_t num_dynamic = ((Axes::static_size == dynamic_extent ? 1 : 0) + ...);

  /// Position of the axis called `name`, or `ndim` when the mesh has no such axis.
  static constexpr std::size_t find_axis(std::string_view name) noexcept {
    for (std::size_t i = 0; i < ndim; ++i)
      if (axis_names[i] == name) return i;
    return ndim;
  }
  /// True when the mesh has an axis called `Name`; for `if constexpr` and `requires`.
  template <fixed_string Name>
  static constexpr bool has_axis = find_axis(Name.view()) < ndim;
  /// Position of axis `Name` in the mesh; naming an axis the mesh lacks does not compile.
  template <fixed_string Name>
  static constexpr std::size_t axis_position = [] {
    if constexpr (!has_axis<Name>)
      core::detail::mesh_has_no_axis<core::detail::diag_axis_t<Name>, core::detail::diag_axes_t<mesh, (ndim == 8 * sizeof(axis_mask) ? ~axis_mask{0} : (axis_mask{1} << ndim) - 1)>>();
    return find_axis(Name.view());
  }();

  /// A mesh whose every axis has a static size.
  constexpr mesh() requires(num_dynamic == 0) : sizes_{static_sizes} { finish(); }

  /// Sizes for every axis, or only for the axes of dynamic size (mdspan's extents convention).
  template <class... Sizes>
    requires(sizeof...(Sizes) > 0 && (std::convertible_to<Sizes, std::size_t> && ...) &&
             (sizeof...(Sizes) == ndim || sizeof...(Sizes) == num_dynamic))
  constexpr explicit mesh(Sizes... sizes) {
    std::array<std::size_t, sizeof...(Sizes)> given{static_cast<std::size_t>(sizes)...};
    assign(std::span<const std::size_t>(given));
  }

  /// Sizes for every axis, in mesh order.
  constexpr explicit mesh(const coord_type& sizes) { assign(std::span<const std::size_t>(sizes)); }

  /// Number of devices.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  /// The sizes of all axes, in mesh order.
  [[nodiscard]] constexpr const coord_type& shape() const noexcept { return sizes_; }
  /// Size of the axis at position `i`.
  [[nodiscard]] constexpr std::size_t axis_size(std::size_t i) const noexcept { return sizes_[i]; }
  /// Size of the axis called `Name`.
  template <fixed_string Name>
  [[nodiscard]] constexpr std::size_t axis_size() const noexcept { return sizes_[axis_position<Name>]; }
  /// Product of the sizes of the axes in `mask`.
  [[nodiscard]] constexpr std::size_t axes_size(axis_mask mask) const noexcept {
    std::size_t n = 1;
    for (std::size_t i = 0; i < ndim; ++i)
      if (mask & (axis_mask{1} << i)) n *= sizes_[i];
    return n;
  }

  /// Mesh coordinates of `device` (row-major: the last axis varies fastest).
  [[nodiscard]] constexpr coord_type coords(std::size_t device) const noexcept {
    coord_type c{};
    for (std::size_t i = ndim; i-- > 0;) {
      c[i] = device % sizes_[i];
      device /= sizes_[i];
    }
    return c;
  }
  /// Device at mesh coordinates `c`.
  [[nodiscard]] constexpr std::size_t device_at(const coord_type& c) const noexcept {
    std::size_t d = 0;
    for (std::size_t i = 0; i < ndim; ++i) d = d * sizes_[i] + c[i];
    return d;
  }

  /// Mask of the axes named `Names...`.
  template <fixed_string... Names>
  static constexpr axis_mask mask_of() noexcept {
    return ((axis_mask{1} << axis_position<Names>) | ... | axis_mask{0});
  }
  /// Mask of every axis.
  static constexpr axis_mask all_axes = ndim == 8 * sizeof(axis_mask) ? ~axis_mask{0} : (axis_mask{1} << ndim) - 1;

  /// Rank of `device` within its group along `mask`: its row-major index over the axes in `mask`.
  [[nodiscard]] constexpr std::size_t group_rank(std::size_t device, axis_mask mask) const noexcept {
    return linear_over(coords(device), mask);
  }
  /// Which group along `mask` the device belongs to: its row-major index over the other axes.
  /// Equal for exactly the members of one group (the `color` of a communicator split).
  [[nodiscard]] constexpr std::size_t group_color(std::size_t device, axis_mask mask) const noexcept {
    return linear_over(coords(device), all_axes & ~mask);
  }
  /// The group of `device` along the axes in `mask`, in group-rank order.
  [[nodiscard]] std::vector<std::size_t> group(std::size_t device, axis_mask mask) const {
    const coord_type base = coords(device);
    const std::size_t n = axes_size(mask);
    std::vector<std::size_t> out;
    out.reserve(n);
    for (std::size_t r = 0; r < n; ++r) {
      coord_type c = base;
      std::size_t rest = r;
      for (std::size_t i = ndim; i-- > 0;) {
        if (!(mask & (axis_mask{1} << i))) continue;
        c[i] = rest % sizes_[i];
        rest /= sizes_[i];
      }
      out.push_back(device_at(c));
    }
    return out;
  }
  /// The group of `device` along the axes named `Names...`.
  template <fixed_string... Names>
  [[nodiscard]] std::vector<std::size_t> group(std::size_t device) const {
    return group(device, mask_of<Names...>());
  }

  /// Throws `mesh_error` unless the mesh has exactly `device_count` devices.
  void check_device_count(std::size_t device_count) const {
    if (size_ != device_count) {
      std::ostringstream os;
      os << "meshlib: mesh " << *this << " has " << size_ << " devices but " << device_count
         << " devices are available; choose axis sizes whose product is " << device_count;
      throw mesh_error(os.str());
    }
  }

  /// Meshes of one type are equal when their axis sizes are.
  friend constexpr bool operator==(const mesh& a, const mesh& b) noexcept { return a.sizes_ == b.sizes_; }

  /// Prints `mesh{'data': 2, 'model': 4}`, as JAX prints a mesh's shape.
  friend std::ostream& operator<<(std::ostream& os, const mesh& m) {
    os << "mesh{";
    for (std::size_t i = 0; i < ndim; ++i) os << (i ? ", " : "") << '\'' << axis_names[i] << "': " << m.sizes_[i];
    return os << '}';
  }
  /// The mesh as `operator<<` prints it: each axis name with its size, in mesh order.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  constexpr std::size_t linear_over(const coord_type& c, axis_mask mask) const noexcept {
    std::size_t r = 0;
    for (std::size_t i = 0; i < ndim; ++i)
      if (mask & (axis_mask{1} << i)) r = r * sizes_[i] + c[i];
    return r;
  }

  constexpr void assign(std::span<const std::size_t> given) {
    if (given.size() == ndim) {
      for (std::size_t i = 0; i < ndim; ++i) {
        if (static_sizes[i] != dynamic_extent && given[i] != static_sizes[i]) {
          throw mesh_error("meshlib: axis '" + std::string(axis_names[i]) + "' has static size " +
                           std::to_string(static_sizes[i]) + " but was given size " + std::to_string(given[i]));
        }
        sizes_[i] = given[i];
      }
    } else {
      std::size_t k = 0;
      for (std::size_t i = 0; i < ndim; ++i) sizes_[i] = static_sizes[i] == dynamic_extent ? given[k++] : static_sizes[i];
    }
    finish();
  }

  constexpr void finish() {
    size_ = 1;
    for (std::size_t i = 0; i < ndim; ++i) {
      if (sizes_[i] == 0)
        throw mesh_error("meshlib: axis '" + std::string(axis_names[i]) + "' has size 0; every mesh axis needs at least one device");
      // A negative size converted to std::size_t (mesh{-1}) reads as a number near 2^64.
      if (sizes_[i] > core::detail::max_sane_size)
        throw mesh_error("meshlib: axis '" + std::string(axis_names[i]) + "' has size " + std::to_string(sizes_[i]) +
                         " (" + std::to_string(static_cast<long long>(sizes_[i])) +
                         " as a signed number); a mesh axis size must be positive");
      if (__builtin_mul_overflow(size_, sizes_[i], &size_))
        throw mesh_error("meshlib: the device count of the mesh overflows at axis '" + std::string(axis_names[i]) +
                         "' (size " + std::to_string(sizes_[i]) + "): the product of the axis sizes does not fit in 64 bits");
    }
  }

  coord_type sizes_{};
  std::size_t size_ = 1;
};

/// @brief A type that is a `mesh<...>`.
template <class T>
concept mesh_type = requires { typename T::is_mesh; };

namespace core::detail {

/// Throws `mesh_error` unless the devices of `m` can run: every communicator numbers its ranks
/// with an `int` (MPI's, NCCL's, the thread communicator's), so `what` (`spmd`, `shard_map`,
/// `reshard`) refuses a mesh of more than `INT_MAX` devices, naming the axis at which the count
/// passes it, before anything is allocated per device (`spmd` on `mesh{2^32 + 2}` otherwise ends
/// in `std::bad_alloc`). A mesh as a description (layouts, shardings) may be larger.
template <mesh_type Mesh>
void require_runnable(const Mesh& m, std::string_view what) {
  constexpr std::size_t limit = static_cast<std::size_t>(std::numeric_limits<int>::max());
  if (m.size() <= limit) return;
  std::size_t n = 1;
  std::size_t at = 0;
  for (; at < Mesh::ndim; ++at) {
    n *= m.axis_size(at);  // a prefix of the product that the mesh checked fits in 64 bits
    if (n > limit) break;
  }
  throw mesh_error("meshlib: " + std::string(what) + " on " + m.to_string() + ": the mesh has " +
                   std::to_string(m.size()) + " devices, more than the " + std::to_string(limit) +
                   " that a communicator's int ranks can number; axis '" + std::string(Mesh::axis_names[at]) +
                   "' (size " + std::to_string(m.axis_size(at)) + ") takes the device count past it: use a mesh "
                   "of at most " + std::to_string(limit) + " devices");
}

}  // namespace core::detail

namespace experimental {
/// Throws a `mesh_error` when a mesh cannot be run (no devices, a zero-size axis), naming the caller.
using core::detail::require_runnable;
}  // namespace experimental

/// @brief Builds a mesh and checks it against the number of devices, as `jax.make_mesh`.
/// @throws mesh_error when the product of `sizes` is not `device_count`.
template <mesh_axis... Axes, class... Sizes>
mesh<Axes...> make_mesh(std::size_t device_count, Sizes... sizes) {
  mesh<Axes...> m(sizes...);
  m.check_device_count(device_count);
  return m;
}

}  // namespace meshlib
