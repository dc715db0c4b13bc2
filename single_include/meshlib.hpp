// meshlib: JAX-style SPMD sharding for C++ -- single-header distribution.
// Generated from include/ by scripts/amalgamate.py; do not edit by hand:
// change the headers in include/ and run `python3 scripts/amalgamate.py`.
#ifndef MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
#define MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
// begin meshlib.hpp
/// @file
/// @brief meshlib: JAX-style SPMD sharding for C++. Everything that needs no optional dependency.
/// The MPI and NCCL backends come in through <meshlib/mpi.hpp> and <meshlib/nccl.hpp>.

// begin meshlib/core.hpp
/// @file
/// @brief The core layer: axes, meshes, partition specs, shardings and shard layout math.
/// Standard library only.

// begin meshlib/core/fixed_string.hpp
/// @file
/// @brief `fixed_string`: a string usable as a C++20 class-type template parameter, so that mesh
/// axis names (`axis<"data">`) are part of a type and checked by the compiler.

#include <algorithm>
#include <cstddef>
#include <ostream>
#include <string_view>

namespace meshlib {

/// @brief A compile-time string literal: `fixed_string{"data"}`.
/// @tparam N the size of the literal including its terminating zero.
template <std::size_t N>
struct fixed_string {
  char chars[N] = {};

  constexpr fixed_string() = default;
  constexpr fixed_string(const char (&s)[N]) noexcept { std::copy_n(s, N, chars); }

  [[nodiscard]] constexpr std::string_view view() const noexcept { return {chars, N - 1}; }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return N - 1; }
  [[nodiscard]] constexpr bool empty() const noexcept { return N == 1; }
  constexpr operator std::string_view() const noexcept { return view(); }

  template <std::size_t M>
  [[nodiscard]] friend constexpr bool operator==(const fixed_string& a, const fixed_string<M>& b) noexcept {
    return a.view() == b.view();
  }

  friend std::ostream& operator<<(std::ostream& os, const fixed_string& s) { return os << s.view(); }
};

template <std::size_t N>
fixed_string(const char (&)[N]) -> fixed_string<N>;

}  // namespace meshlib
// end meshlib/core/fixed_string.hpp
// begin meshlib/core/errors.hpp
/// @file
/// @brief The exception types of meshlib's core: what a run-time fact (a size, a shape, a device
/// count) can get wrong. Each `what()` names what was expected, what was found, and where.

#include <stdexcept>
#include <string>

namespace meshlib {

/// @brief Base of every exception meshlib throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A mesh that cannot exist: a zero-sized axis, sizes that disagree with the static sizes of
/// the mesh type, or sizes whose product is not the number of devices.
class mesh_error : public error {
 public:
  using error::error;
};

/// @brief A sharding that does not fit a shape: wrong rank, a dimension not divisible where the
/// chosen rule requires it, local shapes that do not assemble into a global one.
class sharding_error : public error {
 public:
  using error::error;
};

}  // namespace meshlib
// end meshlib/core/errors.hpp
// begin meshlib/core/axis.hpp
/// @file
/// @brief `axis<"name">`: a named mesh axis. The name is part of the type, so collectives and
/// partition specs that name an axis are checked against the mesh at compile time.

#include <cstddef>
#include <ostream>
#include <span>


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
// end meshlib/core/axis.hpp
// begin meshlib/core/mesh.hpp
/// @file
/// @brief `mesh<Axes...>`: an N-dimensional grid of devices with named axes, as JAX's `Mesh`.
///
/// Devices are numbered in row-major order over the axes: the last axis varies fastest, as in
/// `jax.make_mesh`. The group of a device along a set of axes is the device and every device that
/// differs from it only in those axes; groups are what per-axis communicators are built from.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>


namespace meshlib {

namespace detail {

template <class... Axes>
consteval bool axis_names_unique() {
  constexpr std::array<std::string_view, sizeof...(Axes)> names{Axes::name.view()...};
  for (std::size_t i = 0; i < names.size(); ++i)
    for (std::size_t j = i + 1; j < names.size(); ++j)
      if (names[i] == names[j]) return false;
  return true;
}

}  // namespace detail

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
  static_assert(detail::axis_names_unique<Axes...>(),
                "meshlib: two axes of this mesh have the same name; each axis name must be unique");
  static_assert(sizeof...(Axes) <= 8 * sizeof(axis_mask), "meshlib: too many mesh axes");

 public:
  using is_mesh = void;
  static constexpr std::size_t ndim = sizeof...(Axes);
  using coord_type = std::array<std::size_t, ndim>;

  /// The axis names, in mesh order.
  static constexpr std::array<std::string_view, ndim> axis_names{Axes::name.view()...};
  /// The compile-time sizes (`dynamic_extent` where the size is given at run time).
  static constexpr std::array<std::size_t, ndim> static_sizes{Axes::static_size...};
  static constexpr std::size_t num_dynamic = ((Axes::static_size == dynamic_extent ? 1 : 0) + ...);

  /// Position of the axis called `name`, or `ndim` when the mesh has no such axis.
  static constexpr std::size_t find_axis(std::string_view name) noexcept {
    for (std::size_t i = 0; i < ndim; ++i)
      if (axis_names[i] == name) return i;
    return ndim;
  }
  template <fixed_string Name>
  static constexpr bool has_axis = find_axis(Name.view()) < ndim;
  /// Position of axis `Name` in the mesh; naming an axis the mesh lacks does not compile.
  template <fixed_string Name>
  static constexpr std::size_t axis_position = [] {
    static_assert(has_axis<Name>, "meshlib: the mesh has no axis of this name (see the axis named in the instantiation)");
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

  friend constexpr bool operator==(const mesh& a, const mesh& b) noexcept { return a.sizes_ == b.sizes_; }

  /// Prints `mesh{'data': 2, 'model': 4}`, as JAX prints a mesh's shape.
  friend std::ostream& operator<<(std::ostream& os, const mesh& m) {
    os << "mesh{";
    for (std::size_t i = 0; i < ndim; ++i) os << (i ? ", " : "") << '\'' << axis_names[i] << "': " << m.sizes_[i];
    return os << '}';
  }
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
      size_ *= sizes_[i];
    }
  }

  coord_type sizes_{};
  std::size_t size_ = 1;
};

/// @brief A type that is a `mesh<...>`.
template <class T>
concept mesh_type = requires { typename T::is_mesh; };

/// @brief Builds a mesh and checks it against the number of devices, as `jax.make_mesh`.
/// @throws mesh_error when the product of `sizes` is not `device_count`.
template <mesh_axis... Axes, class... Sizes>
mesh<Axes...> make_mesh(std::size_t device_count, Sizes... sizes) {
  mesh<Axes...> m(sizes...);
  m.check_device_count(device_count);
  return m;
}

}  // namespace meshlib
// end meshlib/core/mesh.hpp
// begin meshlib/core/partition_spec.hpp
/// @file
/// @brief `partition_spec` / `P<...>`: how each dimension of a tensor is split over mesh axes, as
/// JAX's `PartitionSpec`. One entry per dimension: an axis name (`"data"`), `none` (that dimension
/// is replicated), or several axes at once (`axes("data", "fsdp")`, major to minor). Dimensions past
/// the last entry are replicated, as in JAX.
///
/// @code
/// using batch_sharded = meshlib::P<"data", meshlib::none>;          // rows over 'data'
/// using fsdp          = meshlib::P<meshlib::axes("data", "fsdp")>;  // rows over data x fsdp
/// @endcode

#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>

namespace meshlib {

/// @brief The value that marks a replicated dimension in a partition spec (JAX's `None`).
struct none_t {
  friend constexpr bool operator==(none_t, none_t) noexcept { return true; }
};
inline constexpr none_t none{};

/// @brief One entry of a partition spec: the mesh axes (0 to `max_axes`) a dimension is split over.
/// A structural type, so specs are template arguments; built implicitly from `"name"` or `none`,
/// and by `axes(...)` for several axes.
struct dim_spec {
  static constexpr std::size_t max_axes = 4;
  static constexpr std::size_t max_name = 32;

  char names[max_axes][max_name] = {};
  std::size_t count = 0;

  constexpr dim_spec() = default;
  constexpr dim_spec(none_t) noexcept {}
  template <std::size_t N>
  constexpr dim_spec(const char (&name)[N]) {  // NOLINT: implicit on purpose, P<"data">
    push(name);
  }

  template <std::size_t N>
  constexpr void push(const char (&name)[N]) {
    static_assert(N <= max_name, "meshlib: axis names in a partition spec are limited to 31 characters");
    static_assert(N > 1, "meshlib: an empty axis name in a partition spec; use meshlib::none for a replicated dimension");
    if (count == max_axes) throw "meshlib: a dimension can be split over at most 4 mesh axes";
    for (std::size_t i = 0; i < N; ++i) names[count][i] = name[i];
    ++count;
  }

  [[nodiscard]] constexpr std::string_view axis(std::size_t i) const noexcept {
    return std::string_view(names[i]);
  }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return count; }
  [[nodiscard]] constexpr bool replicated() const noexcept { return count == 0; }
  [[nodiscard]] constexpr bool uses(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < count; ++i)
      if (axis(i) == name) return true;
    return false;
  }

  friend constexpr bool operator==(const dim_spec& a, const dim_spec& b) noexcept {
    if (a.count != b.count) return false;
    for (std::size_t i = 0; i < a.count; ++i)
      if (a.axis(i) != b.axis(i)) return false;
    return true;
  }

  /// Prints `"data"`, `none`, or `axes("data", "fsdp")`.
  friend std::ostream& operator<<(std::ostream& os, const dim_spec& d) {
    if (d.count == 0) return os << "none";
    if (d.count == 1) return os << '"' << d.axis(0) << '"';
    os << "axes(";
    for (std::size_t i = 0; i < d.count; ++i) os << (i ? ", " : "") << '"' << d.axis(i) << '"';
    return os << ')';
  }
};

/// @brief A dimension split over several mesh axes, the first major: `axes("data", "fsdp")` is JAX's
/// `('data', 'fsdp')` entry.
template <std::size_t... N>
  requires(sizeof...(N) >= 1 && sizeof...(N) <= dim_spec::max_axes)
constexpr dim_spec axes(const char (&... names)[N]) {
  dim_spec d;
  (d.push(names), ...);
  return d;
}

/// @brief A partition spec: entry `i` says how tensor dimension `i` is split.
template <dim_spec... Dims>
struct partition_spec {
  using is_partition_spec = void;
  static constexpr std::size_t size = sizeof...(Dims);
  static constexpr std::array<dim_spec, sizeof...(Dims)> dims{Dims...};

  /// The entry for dimension `d` (`none` past the end: trailing dimensions are replicated).
  static constexpr dim_spec dim(std::size_t d) noexcept { return d < size ? dims[d] : dim_spec{}; }

  /// True when some dimension is split over `name`.
  static constexpr bool uses(std::string_view name) noexcept {
    for (const auto& d : dims)
      if (d.uses(name)) return true;
    return false;
  }
  /// The dimension split over `name`, or `size` when none is.
  static constexpr std::size_t dim_of(std::string_view name) noexcept {
    for (std::size_t i = 0; i < size; ++i)
      if (dims[i].uses(name)) return i;
    return size;
  }

  /// Prints `P<"data", none>`.
  friend std::ostream& operator<<(std::ostream& os, partition_spec) {
    os << "P<";
    for (std::size_t i = 0; i < size; ++i) os << (i ? ", " : "") << dims[i];
    return os << '>';
  }
  static std::string to_string() {
    std::ostringstream os;
    os << partition_spec{};
    return os.str();
  }
};

/// @brief The short name of `partition_spec`, as JAX's `P`.
template <dim_spec... Dims>
using P = partition_spec<Dims...>;

/// @brief A type that is a `partition_spec<...>`.
template <class T>
concept partition_spec_type = requires { typename T::is_partition_spec; };

}  // namespace meshlib
// end meshlib/core/partition_spec.hpp
// begin meshlib/core/named_sharding.hpp
/// @file
/// @brief `named_sharding<Mesh, Spec>`: a partition spec bound to a mesh, as JAX's `NamedSharding`.
/// The pairing is checked when the type is formed: every axis the spec names must be in the mesh,
/// and no axis may appear twice. A spec longer than a tensor's rank is rejected where the rank is
/// known (`check_rank<Rank>()`, used by the tensor layer).

#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>


namespace meshlib {

/// @brief How a dimension whose size is not a multiple of its number of shards is split.
enum class shard_rule {
  /// Every dimension must divide evenly (the default; JAX's shard_map requires it).
  even,
  /// Blocks of ceil(size / shards) elements; trailing blocks are smaller or empty, as
  /// `torch.chunk` and DTensor's `Shard` do. Never loses or duplicates an element.
  uneven,
};

namespace detail {

/// Position in `Mesh` of the first axis `Spec` names that the mesh lacks, as (dim, axis-in-dim),
/// or {Spec::size, 0} when every axis exists.
template <class Mesh, class Spec>
consteval std::pair<std::size_t, std::size_t> first_unknown_axis() {
  for (std::size_t d = 0; d < Spec::size; ++d)
    for (std::size_t k = 0; k < Spec::dims[d].size(); ++k)
      if (Mesh::find_axis(Spec::dims[d].axis(k)) == Mesh::ndim) return {d, k};
  return {Spec::size, 0};
}

/// Whether some axis appears twice in `Spec` (in one dimension or in two).
template <class Spec>
consteval bool has_repeated_axis() {
  for (std::size_t d = 0; d < Spec::size; ++d)
    for (std::size_t k = 0; k < Spec::dims[d].size(); ++k)
      for (std::size_t e = d; e < Spec::size; ++e)
        for (std::size_t l = (e == d ? k + 1 : 0); l < Spec::dims[e].size(); ++l)
          if (Spec::dims[d].axis(k) == Spec::dims[e].axis(l)) return true;
  return false;
}

/// The name of axis `K` of dimension `D` of `Spec` as a `fixed_string`, for diagnostics.
template <class Spec, std::size_t D, std::size_t K>
inline constexpr auto spec_axis_name = [] {
  constexpr std::string_view name = Spec::dims[D].axis(K);
  fixed_string<name.size() + 1> s;
  for (std::size_t i = 0; i < name.size(); ++i) s.chars[i] = name[i];
  return s;
}();

// The diagnostics below carry the offending axis and spec in their template arguments, so that the
// compiler's "in instantiation of" line names them next to the static_assert message.
template <fixed_string Axis, class Spec, class Mesh>
struct spec_names_axis_not_in_mesh {
  static_assert(Mesh::template has_axis<Axis>,
                "meshlib: named_sharding: the partition spec names an axis that the mesh does not have "
                "(the axis, spec and mesh are the arguments of spec_names_axis_not_in_mesh<axis, spec, mesh>); "
                "add the axis to the mesh or fix its name in the spec");
  static constexpr bool value = true;
};

template <class Spec>
struct spec_uses_an_axis_twice {
  static_assert(!has_repeated_axis<Spec>(),
                "meshlib: named_sharding: the partition spec uses a mesh axis twice (see spec_uses_an_axis_twice<spec>); "
                "a mesh axis can split at most one dimension, once");
  static constexpr bool value = true;
};

template <std::size_t Rank, class Spec>
struct spec_longer_than_rank {
  static_assert(Spec::size <= Rank,
                "meshlib: the partition spec has more entries than the tensor has dimensions "
                "(see spec_longer_than_rank<rank, spec>); drop the extra entries");
  static constexpr bool value = true;
};

template <class Mesh, class Spec>
consteval bool diagnose_sharding() {
  constexpr auto bad = first_unknown_axis<Mesh, Spec>();
  if constexpr (bad.first < Spec::size) {
    return spec_names_axis_not_in_mesh<spec_axis_name<Spec, bad.first, bad.second>, Spec, Mesh>::value;
  } else {
    return spec_uses_an_axis_twice<Spec>::value;
  }
}

}  // namespace detail

/// @brief A partition spec `Spec` bound to a mesh of type `Mesh`.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// meshlib::named_sharding<mesh_t, meshlib::P<"data", none>> s{mesh_t{2, 4}};
/// @endcode
template <mesh_type Mesh, partition_spec_type Spec>
class named_sharding {
  static_assert(detail::diagnose_sharding<Mesh, Spec>());

 public:
  using is_named_sharding = void;
  using mesh_type = Mesh;
  using spec_type = Spec;

  /// Mesh positions of the axes that split dimension `d`, major to minor.
  static constexpr std::array<std::size_t, dim_spec::max_axes> dim_axes(std::size_t d) noexcept {
    std::array<std::size_t, dim_spec::max_axes> out{};
    const dim_spec ds = Spec::dim(d);
    for (std::size_t k = 0; k < ds.size(); ++k) out[k] = Mesh::find_axis(ds.axis(k));
    return out;
  }
  /// Number of mesh axes that split dimension `d`.
  static constexpr std::size_t dim_axis_count(std::size_t d) noexcept { return Spec::dim(d).size(); }
  /// Mask of the mesh axes that split dimension `d`.
  static constexpr axis_mask dim_mask(std::size_t d) noexcept {
    axis_mask m = 0;
    const auto ax = dim_axes(d);
    for (std::size_t k = 0; k < dim_axis_count(d); ++k) m |= axis_mask{1} << ax[k];
    return m;
  }
  /// Mask of every mesh axis the spec uses: a sharded value varies over exactly these.
  static constexpr axis_mask sharded_axes = [] {
    axis_mask m = 0;
    for (std::size_t d = 0; d < Spec::size; ++d) m |= dim_mask(d);
    return m;
  }();
  /// Mask of the mesh axes the spec does not use: the value is replicated over these.
  static constexpr axis_mask replicated_axes = Mesh::all_axes & ~sharded_axes;

  /// Rejects, at compile time, a spec longer than a tensor of rank `Rank`.
  template <std::size_t Rank>
  static constexpr bool check_rank() noexcept {
    return detail::spec_longer_than_rank<Rank, Spec>::value;
  }

  named_sharding() requires(Mesh::num_dynamic == 0) = default;
  explicit named_sharding(Mesh mesh, shard_rule rule = shard_rule::even) : mesh_(mesh), rule_(rule) {}

  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }
  [[nodiscard]] shard_rule rule() const noexcept { return rule_; }

  /// Number of shards dimension `d` is split into.
  [[nodiscard]] std::size_t num_shards(std::size_t d) const noexcept { return mesh_.axes_size(dim_mask(d)); }
  /// Which shard of dimension `d` device `device` holds: its row-major index over the axes that split
  /// `d`, in spec order (the first axis major, as JAX).
  [[nodiscard]] std::size_t shard_index(std::size_t device, std::size_t d) const noexcept {
    const auto c = mesh_.coords(device);
    const auto ax = dim_axes(d);
    std::size_t i = 0;
    for (std::size_t k = 0; k < dim_axis_count(d); ++k) i = i * mesh_.axis_size(ax[k]) + c[ax[k]];
    return i;
  }

  friend bool operator==(const named_sharding& a, const named_sharding& b) noexcept {
    return a.mesh_ == b.mesh_ && a.rule_ == b.rule_;
  }
  /// Prints `named_sharding(mesh{'data': 2}, P<"data">)`.
  friend std::ostream& operator<<(std::ostream& os, const named_sharding& s) {
    return os << "named_sharding(" << s.mesh_ << ", " << Spec{} << (s.rule_ == shard_rule::uneven ? ", uneven" : "")
              << ')';
  }
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  Mesh mesh_{};
  shard_rule rule_ = shard_rule::even;
};

/// @brief A type that is a `named_sharding<...>`.
template <class T>
concept sharding_type = requires { typename T::is_named_sharding; };

/// @brief Names the axes in `mask` of mesh type `Mesh`: `{'data', 'model'}`.
template <mesh_type Mesh>
std::string describe_axes(axis_mask mask) {
  std::string s = "{";
  bool first = true;
  for (std::size_t i = 0; i < Mesh::ndim; ++i) {
    if (!(mask & (axis_mask{1} << i))) continue;
    s += (first ? "'" : ", '") + std::string(Mesh::axis_names[i]) + "'";
    first = false;
  }
  return s + "}";
}

}  // namespace meshlib
// end meshlib/core/named_sharding.hpp
// begin meshlib/core/shard_layout.hpp
/// @file
/// @brief Shard layout math: for a global shape and a sharding, which block of the global array
/// each device holds, which devices hold copies of the same block, and the global shape from local
/// ones.
///
/// The rule for one dimension of size `n` split into `s` shards (shard `i` held by the devices
/// whose coordinates over the dimension's axes, in spec order, give index `i`):
/// - `shard_rule::even`: `n % s == 0` is required; block `i` is `[i*n/s, (i+1)*n/s)`.
/// - `shard_rule::uneven`: `c = ceil(n / s)`; block `i` is `[min(i*c, n), min((i+1)*c, n))`, so the
///   trailing blocks are smaller or empty, as `torch.chunk` / DTensor's `Shard`.
/// @post Under either rule the blocks of one dimension are disjoint and cover `[0, n)`: every
/// element of the global array is held by exactly the devices of one replica group.

#include <array>
#include <cstddef>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <vector>


namespace meshlib {

/// @brief A rectangular block of a global array: an offset and an extent per dimension.
template <std::size_t Rank>
struct block {
  std::array<std::size_t, Rank> offset{};
  std::array<std::size_t, Rank> extent{};

  /// Number of elements.
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    std::size_t n = 1;
    for (auto e : extent) n *= e;
    return n;
  }
  /// Whether the global coordinate `g` lies in the block.
  [[nodiscard]] constexpr bool contains(const std::array<std::size_t, Rank>& g) const noexcept {
    for (std::size_t d = 0; d < Rank; ++d)
      if (g[d] < offset[d] || g[d] >= offset[d] + extent[d]) return false;
    return true;
  }
  friend constexpr bool operator==(const block&, const block&) = default;

  /// Prints `[0:4, 2:4]` (NumPy slice notation).
  friend std::ostream& operator<<(std::ostream& os, const block& b) {
    os << '[';
    for (std::size_t d = 0; d < Rank; ++d) os << (d ? ", " : "") << b.offset[d] << ':' << b.offset[d] + b.extent[d];
    return os << ']';
  }
};

namespace detail {

/// Offset and extent of shard `i` of `shards` of a dimension of size `n` (see the file comment).
constexpr std::pair<std::size_t, std::size_t> split_dim(std::size_t n, std::size_t shards, std::size_t i,
                                                        shard_rule rule) noexcept {
  const std::size_t chunk = rule == shard_rule::even ? n / shards : (n + shards - 1) / shards;
  const std::size_t lo = std::min(i * chunk, n);
  const std::size_t hi = std::min(lo + chunk, n);
  return {lo, hi - lo};
}

/// "axis 'model' (size 4)" or "axes 'data' x 'fsdp' (sizes 2 x 2)".
template <sharding_type S>
std::string describe_dim_axes(const S& s, std::size_t d) {
  using mesh_t = typename S::mesh_type;
  const auto ax = S::dim_axes(d);
  const std::size_t k = S::dim_axis_count(d);
  std::string names, sizes;
  for (std::size_t j = 0; j < k; ++j) {
    names += (j ? " x '" : "'") + std::string(mesh_t::axis_names[ax[j]]) + "'";
    sizes += (j ? " x " : "") + std::to_string(s.mesh().axis_size(ax[j]));
  }
  return (k == 1 ? "axis " : "axes ") + names + (k == 1 ? " (size " : " (sizes ") + sizes + ")";
}

template <std::size_t Rank>
std::string describe_shape(const std::array<std::size_t, Rank>& shape) {
  std::string s = "(";
  for (std::size_t d = 0; d < Rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + (Rank == 1 ? ",)" : ")");
}

}  // namespace detail

/// @brief The blocks of a global array of shape `global_shape` laid out by sharding `S`.
/// @code
/// meshlib::shard_layout layout{sharding, std::array<std::size_t, 2>{8, 6}};
/// layout.block_of(3);    // offset and extent of device 3's block
/// layout.replicas(3);    // the devices that hold the same block
/// @endcode
template <sharding_type S, std::size_t Rank>
class shard_layout {
  static_assert(S::template check_rank<Rank>());

 public:
  using shape_type = std::array<std::size_t, Rank>;
  using mesh_type = typename S::mesh_type;

  /// @throws sharding_error under `shard_rule::even` when a sharded dimension does not divide
  /// evenly; the message names the dimension, its size, the axes and their sizes.
  shard_layout(const S& sharding, const shape_type& global_shape) : sharding_(sharding), global_(global_shape) {
    for (std::size_t d = 0; d < Rank; ++d) {
      const std::size_t shards = sharding_.num_shards(d);
      if (sharding_.rule() == shard_rule::even && global_[d] % shards != 0) {
        std::ostringstream os;
        os << "meshlib: dimension " << d << " of global shape " << detail::describe_shape(global_) << " has size "
           << global_[d] << ", which is not divisible by the " << shards << " shards of "
           << detail::describe_dim_axes(sharding_, d) << " in " << typename S::spec_type{}
           << "; use a size divisible by " << shards << " or shard_rule::uneven";
        throw sharding_error(os.str());
      }
    }
  }

  [[nodiscard]] const S& sharding() const noexcept { return sharding_; }
  [[nodiscard]] const shape_type& global_shape() const noexcept { return global_; }
  [[nodiscard]] std::size_t num_devices() const noexcept { return sharding_.mesh().size(); }

  /// The block device `device` holds.
  [[nodiscard]] block<Rank> block_of(std::size_t device) const noexcept {
    block<Rank> b;
    for (std::size_t d = 0; d < Rank; ++d) {
      const auto [off, ext] = detail::split_dim(global_[d], sharding_.num_shards(d), sharding_.shard_index(device, d),
                                                sharding_.rule());
      b.offset[d] = off;
      b.extent[d] = ext;
    }
    return b;
  }
  /// The shape of device `device`'s block.
  [[nodiscard]] shape_type local_shape(std::size_t device) const noexcept { return block_of(device).extent; }
  /// The largest local shape (every device's under the even rule): what a padded buffer needs.
  [[nodiscard]] shape_type max_local_shape() const noexcept {
    shape_type s;
    for (std::size_t d = 0; d < Rank; ++d) s[d] = detail::split_dim(global_[d], sharding_.num_shards(d), 0, sharding_.rule()).second;
    return s;
  }

  /// The devices that hold the same block as `device` (itself included), in mesh order: the group
  /// along every axis the spec does not use.
  [[nodiscard]] std::vector<std::size_t> replicas(std::size_t device) const {
    return sharding_.mesh().group(device, S::replicated_axes);
  }
  /// The devices that hold the element at global coordinate `g`.
  [[nodiscard]] std::vector<std::size_t> owners(const shape_type& g) const {
    std::vector<std::size_t> out;
    for (std::size_t dev = 0; dev < num_devices(); ++dev)
      if (block_of(dev).contains(g)) out.push_back(dev);
    return out;
  }

 private:
  S sharding_;
  shape_type global_;
};

template <sharding_type S, std::size_t Rank>
shard_layout(const S&, const std::array<std::size_t, Rank>&) -> shard_layout<S, Rank>;

/// @brief The global shape of an evenly sharded array whose every block has shape `local_shape`.
template <sharding_type S, std::size_t Rank>
std::array<std::size_t, Rank> global_shape_from_local(const S& sharding, const std::array<std::size_t, Rank>& local_shape) {
  static_assert(S::template check_rank<Rank>());
  std::array<std::size_t, Rank> g;
  for (std::size_t d = 0; d < Rank; ++d) g[d] = local_shape[d] * sharding.num_shards(d);
  return g;
}

/// @brief The global shape from every device's local shape (`local_shapes[device]`).
/// @throws sharding_error when the local shapes cannot come from one global array under the
/// sharding and its rule: a count other than one per device, replicas of one block that disagree,
/// or blocks of a dimension that do not follow the rule. The message names the dimension, the
/// devices and the sizes.
template <sharding_type S, std::size_t Rank>
std::array<std::size_t, Rank> global_shape_from_locals(const S& sharding,
                                                       std::span<const std::array<std::size_t, Rank>> local_shapes) {
  static_assert(S::template check_rank<Rank>());
  const std::size_t n = sharding.mesh().size();
  if (local_shapes.size() != n)
    throw sharding_error("meshlib: global_shape_from_locals needs one local shape per device: the mesh " +
                         sharding.mesh().to_string() + " has " + std::to_string(n) + " devices, " +
                         std::to_string(local_shapes.size()) + " shapes were given");
  std::array<std::size_t, Rank> g{};
  for (std::size_t d = 0; d < Rank; ++d) {
    const std::size_t shards = sharding.num_shards(d);
    std::vector<std::size_t> extent(shards, 0), holder(shards, n);
    for (std::size_t dev = 0; dev < n; ++dev) {
      const std::size_t i = sharding.shard_index(dev, d);
      if (holder[i] == n) {
        holder[i] = dev;
        extent[i] = local_shapes[dev][d];
      } else if (extent[i] != local_shapes[dev][d]) {
        throw sharding_error("meshlib: devices " + std::to_string(holder[i]) + " and " + std::to_string(dev) +
                             " hold the same block of dimension " + std::to_string(d) + " but report sizes " +
                             std::to_string(extent[i]) + " and " + std::to_string(local_shapes[dev][d]));
      }
    }
    for (auto e : extent) g[d] += e;
    for (std::size_t i = 0; i < shards; ++i) {
      const auto expected = detail::split_dim(g[d], shards, i, sharding.rule()).second;
      const bool divisible = sharding.rule() == shard_rule::uneven || g[d] % shards == 0;
      if (!divisible || expected != extent[i]) {
        throw sharding_error("meshlib: dimension " + std::to_string(d) + " split over " +
                             detail::describe_dim_axes(sharding, d) + ": shard " + std::to_string(i) + " (device " +
                             std::to_string(holder[i]) + ") has size " + std::to_string(extent[i]) +
                             ", but a global size of " + std::to_string(g[d]) + " under the " +
                             (sharding.rule() == shard_rule::even ? "even" : "uneven") + " rule gives " +
                             (divisible ? std::to_string(expected) : std::string("no even split")));
      }
    }
  }
  return g;
}

}  // namespace meshlib
// end meshlib/core/shard_layout.hpp
// end meshlib/core.hpp
// begin meshlib/comm.hpp
/// @file
/// @brief The comm layer: the communicator concept, reduce ops, datatypes, errors, and the
/// always-built thread communicator. Depends on core only.
// end meshlib/comm.hpp
// begin meshlib/tensor.hpp
/// @file
/// @brief The tensor layer: `sharded_tensor` (global view), `local_tensor` (the value a device sees
/// inside `shard_map` / `spmd`), and local kernels with sharding propagation. Needs Kokkos.

// begin meshlib/tensor/view.hpp
/// @file
/// @brief The Kokkos side of the tensor layer: the view type of a block, allocation that is safe
/// from many device threads, and the one way meshlib launches a kernel.
///
/// Why this file exists: with the thread communicator every device is a thread, and Debian's
/// Kokkos 3.4.1 is not safe to launch from several threads at once. Its Serial backend keeps one
/// process-wide scratch buffer (`serial_resize_thread_team_data`) that every team-policy kernel,
/// scan and reduction resizes and writes, so concurrent launches of those race (wrong results,
/// aborts). What is safe in 3.4.1 Serial (read in Kokkos_Serial.hpp, Kokkos_Parallel.hpp,
/// impl/Kokkos_SharedAlloc.hpp):
/// - `parallel_for` over a `RangePolicy`: `ParallelFor<..., RangePolicy, Serial>` is a plain loop
///   over the functor copy; the launch only flips the *thread-local* `t_tracking_enabled` flag and
///   calls the profiling hooks, which read one global and do nothing when no tool is loaded.
/// - View reference counting: `SharedAllocationRecord` counts with atomics, and without
///   `KOKKOS_ENABLE_DEBUG` (Debian's build) no global record list exists.
/// So meshlib launches *only* RangePolicy `parallel_for` with plain functors (`detail::launch`),
/// computes every reduction and scan itself with deterministic per-element loops, and serialises
/// only View allocation (`detail::allocate`) behind one mutex: allocation goes through the
/// uninstrumented libkokkoscore (HostSpace::allocate, record construction, the labels), where
/// ThreadSanitizer cannot see, and it is cheap next to the kernels, so the lock costs no speedup.
/// Deallocation (the last reference dropping) is an atomic decrement and a `free`, safe as is.

#include <array>
#include <cstddef>
#include <mutex>
#include <string>
#include <type_traits>

#include <Kokkos_Core.hpp>

namespace meshlib {

/// @brief The memory space meshlib puts blocks in unless told otherwise.
using default_memory_space = Kokkos::DefaultExecutionSpace::memory_space;

namespace detail {

/// `T*...*` with `N` stars: the Kokkos data type of a rank-`N` view.
template <class T, std::size_t N>
struct add_pointers {
  using type = typename add_pointers<T, N - 1>::type*;
};
template <class T>
struct add_pointers<T, 0> {
  using type = T;
};

/// The view type of a rank-`Rank` block: row-major, as NumPy and JAX lay arrays out.
template <class T, std::size_t Rank, class Space>
using block_view_t = Kokkos::View<typename add_pointers<T, Rank>::type, Kokkos::LayoutRight, Space>;

/// The execution space that runs kernels on memory of `Space`.
template <class Space>
using exec_space_for_t = std::conditional_t<
    Kokkos::Impl::SpaceAccessibility<Kokkos::DefaultExecutionSpace, Space>::accessible, Kokkos::DefaultExecutionSpace,
    Kokkos::DefaultHostExecutionSpace>;

template <class Space>
inline constexpr bool host_accessible_v = Kokkos::Impl::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible;

/// The one lock around Kokkos global state (see the file comment).
inline std::mutex& kokkos_state_mutex() {
  static std::mutex m;
  return m;
}

/// A rank-`Rank` view of `extent`, zero-filled by meshlib (not by Kokkos' initialising kernel), with
/// the allocation itself under `kokkos_state_mutex()`.
template <class T, std::size_t Rank, class Space = default_memory_space>
block_view_t<T, Rank, Space> allocate(const std::array<std::size_t, Rank>& extent, const char* label = "meshlib::block",
                                      bool zero = true) {
  using view_t = block_view_t<T, Rank, Space>;
  static_assert(Rank <= 8, "meshlib: Kokkos views have at most 8 dimensions");
  view_t v;
  {
    std::lock_guard<std::mutex> lock(kokkos_state_mutex());
    v = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return view_t(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), extent[I]...);
    }(std::make_index_sequence<Rank>{});
  }
  if (zero) {
    T* p = v.data();
    const std::size_t n = v.span();
    if constexpr (host_accessible_v<Space>) {
      for (std::size_t i = 0; i < n; ++i) p[i] = T{};
    } else {
      Kokkos::parallel_for(Kokkos::RangePolicy<exec_space_for_t<Space>>(0, n), KOKKOS_LAMBDA(std::size_t i) { p[i] = T{}; });
      Kokkos::fence();
    }
  }
  return v;
}

/// The extents of a view as an array.
template <class View>
std::array<std::size_t, View::rank> extents_of(const View& v) {
  std::array<std::size_t, View::rank> e{};
  for (std::size_t d = 0; d < View::rank; ++d) e[d] = v.extent(d);
  return e;
}

/// Runs `f(i)` for `i` in `[0, n)` as a RangePolicy `parallel_for`: the only launch meshlib makes,
/// because it is the only one safe from concurrent device threads on Kokkos 3.4.1 Serial.
template <class Space, class F>
void launch(std::size_t n, const F& f) {
  if (n == 0) return;
  Kokkos::parallel_for(Kokkos::RangePolicy<exec_space_for_t<Space>, Kokkos::IndexType<std::size_t>>(0, n), f);
}

}  // namespace detail
}  // namespace meshlib
// end meshlib/tensor/view.hpp
// begin meshlib/tensor/local_tensor.hpp
/// @file
/// @brief `local_tensor`: the value one device sees inside `shard_map` / `spmd`, its block of a
/// sharded array, with the layout facts the type system tracks, as JAX's `vma` (varying manual axes)
/// plus a pending-sum set.
///
/// Three compile-time facts ride in the type:
/// - `Vary`: the mesh axes the value may differ over. Invariant over an axis means every device of
///   that axis group holds the same value (JAX: not in `vma`).
/// - `Partial`: the mesh axes over which the value is a pending sum: the true value is the sum of
///   the blocks over that axis group (what `psum` completes). Disjoint from `Vary`.
/// - `Dims`: for each dimension, the mesh axes of which that dimension is a block (its entry in the
///   partition spec the value came in with). Kernels use it to propagate sharding (GSPMD's rules):
///   reducing a dimension sharded over `a` makes the result partial over `a`; a matmul whose
///   contraction dimension is sharded over `a` on both sides is partial over `a`.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// // a block of a P<"data", none> array, entering shard_map:
/// using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;
/// static_assert(x_t::vary == mesh_t::mask_of<"data">() && x_t::partial == 0);
/// @endcode

#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>


namespace meshlib {

/// @brief For each dimension of a local block, the mask of mesh axes that dimension is a block of.
template <axis_mask... M>
struct dim_masks {
  using is_dim_masks = void;
  static constexpr std::size_t size = sizeof...(M);
  static constexpr std::array<axis_mask, sizeof...(M)> values{M...};
  /// Every axis some dimension is sharded over.
  static constexpr axis_mask all = (axis_mask{0} | ... | M);
  static constexpr axis_mask at(std::size_t d) noexcept { return d < size ? values[d] : axis_mask{0}; }
};

namespace detail {

template <class T>
concept dim_masks_type = requires { typename T::is_dim_masks; };

template <std::size_t Rank, class Seq = std::make_index_sequence<Rank>>
struct replicated_dims_impl;
template <std::size_t Rank, std::size_t... I>
struct replicated_dims_impl<Rank, std::index_sequence<I...>> {
  using type = dim_masks<(static_cast<void>(I), axis_mask{0})...>;
};

template <class S, std::size_t Rank, class Seq = std::make_index_sequence<Rank>>
struct dims_of_impl;
template <class S, std::size_t Rank, std::size_t... I>
struct dims_of_impl<S, Rank, std::index_sequence<I...>> {
  using type = dim_masks<S::dim_mask(I)...>;
};

/// `Dims` without dimension `D`.
template <class Dims, std::size_t D, class Seq = std::make_index_sequence<Dims::size - 1>>
struct remove_dim_impl;
template <class Dims, std::size_t D, std::size_t... I>
struct remove_dim_impl<Dims, D, std::index_sequence<I...>> {
  using type = dim_masks<Dims::at(I < D ? I : I + 1)...>;
};

/// `Dims` permuted: entry `i` of the result is entry `Perm[i]` of `Dims`.
template <class Dims, std::array Perm, class Seq = std::make_index_sequence<Dims::size>>
struct permute_dims_impl;
template <class Dims, std::array Perm, std::size_t... I>
struct permute_dims_impl<Dims, Perm, std::index_sequence<I...>> {
  using type = dim_masks<Dims::at(Perm[I])...>;
};

}  // namespace detail

/// @brief `dim_masks` of rank `Rank` with no sharded dimension.
template <std::size_t Rank>
using replicated_dims = typename detail::replicated_dims_impl<Rank>::type;

/// @brief The `dim_masks` of a rank-`Rank` array laid out by sharding `S`.
template <sharding_type S, std::size_t Rank>
using dims_of_t = typename detail::dims_of_impl<S, Rank>::type;

/// @brief The value of type `T` one device holds inside `shard_map` / `spmd`.
/// @tparam Vary    mesh axes the value varies over (see the file comment).
/// @tparam Partial mesh axes over which the value is a pending sum; disjoint from `Vary`.
/// @tparam Dims    `dim_masks<...>`: per dimension, the axes it is a block of; each within `Vary | Partial`.
/// @tparam Space   the Kokkos memory space of the block.
/// A `local_tensor` is a handle: copies share the block, as `Kokkos::View` copies do.
template <class T, std::size_t Rank, mesh_type Mesh, axis_mask Vary = 0, axis_mask Partial = 0,
          class Dims = replicated_dims<Rank>, class Space = default_memory_space>
class local_tensor {
  static_assert(detail::dim_masks_type<Dims> && Dims::size == Rank,
                "meshlib: local_tensor: Dims must be a dim_masks<...> with one mask per dimension");
  static_assert((Vary & Partial) == 0,
                "meshlib: local_tensor: a value cannot both vary over an axis and be a pending sum over it");
  static_assert((Vary & ~Mesh::all_axes) == 0 && (Partial & ~Mesh::all_axes) == 0,
                "meshlib: local_tensor: Vary / Partial name axes the mesh does not have");

 public:
  using is_local_tensor = void;
  using value_type = T;
  using mesh_type = Mesh;
  using dims_type = Dims;
  using memory_space = Space;
  using view_type = detail::block_view_t<T, Rank, Space>;
  using shape_type = std::array<std::size_t, Rank>;
  static constexpr std::size_t rank = Rank;
  static constexpr axis_mask vary = Vary;
  static constexpr axis_mask partial = Partial;

  local_tensor() = default;
  /// Wraps `view`, device `device`'s block on `mesh` (no copy).
  local_tensor(view_type view, const Mesh& mesh, std::size_t device) : view_(std::move(view)), mesh_(mesh), device_(device) {}
  /// A zero block of `shape` on `device`.
  local_tensor(const shape_type& shape, const Mesh& mesh, std::size_t device)
      : view_(detail::allocate<T, Rank, Space>(shape, "meshlib::local_tensor")), mesh_(mesh), device_(device) {}

  [[nodiscard]] const view_type& view() const noexcept { return view_; }
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }
  [[nodiscard]] std::size_t device() const noexcept { return device_; }
  [[nodiscard]] shape_type shape() const { return detail::extents_of(view_); }
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return view_.extent(d); }
  [[nodiscard]] std::size_t size() const noexcept { return view_.size(); }
  [[nodiscard]] T* data() const noexcept { return view_.data(); }
  /// Size of dimension `d` of the global array this block belongs to (even rule: every block of a
  /// dimension has the same size, as `shard_map` requires).
  [[nodiscard]] std::size_t global_extent(std::size_t d) const noexcept {
    return view_.extent(d) * mesh_.axes_size(Dims::at(d));
  }

  /// Element access (host-accessible spaces).
  template <class... I>
    requires(sizeof...(I) == Rank)
  [[nodiscard]] T& operator()(I... i) const {
    return view_(i...);
  }

  /// Prints `local_tensor<(4, 6) on device 3, vary {'data'}, partial {}>`.
  friend std::ostream& operator<<(std::ostream& os, const local_tensor& t) {
    return os << "local_tensor<" << detail::describe_shape(t.shape()) << " on device " << t.device_
              << ", vary " << describe_axes<Mesh>(Vary) << ", partial " << describe_axes<Mesh>(Partial) << '>';
  }
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  view_type view_{};
  Mesh mesh_{[] {
    if constexpr (Mesh::num_dynamic == 0) return Mesh{};
    else return Mesh{typename Mesh::coord_type{[] {
      typename Mesh::coord_type c{};
      for (auto& x : c) x = 1;
      return c;
    }()}};
  }()};
  std::size_t device_ = 0;
};

/// @brief A type that is a `local_tensor<...>`.
template <class T>
concept local_tensor_type = requires { typename std::remove_cvref_t<T>::is_local_tensor; };

template <class T>
inline constexpr bool is_local_tensor_v = local_tensor_type<T>;

namespace detail {
template <class L, class U, std::size_t R, axis_mask V, axis_mask P, class D>
struct rebind_local;
template <class T, std::size_t Rank, class M, axis_mask V0, axis_mask P0, class D0, class S, class U, std::size_t R,
          axis_mask V, axis_mask P, class D>
struct rebind_local<local_tensor<T, Rank, M, V0, P0, D0, S>, U, R, V, P, D> {
  using type = local_tensor<U, R, M, V, P, D, S>;
};
}  // namespace detail

/// @brief `L` with every field but the named ones kept: the result types collectives and kernels compute.
template <local_tensor_type L, axis_mask NewVary>
using with_vary_t = typename detail::rebind_local<L, typename L::value_type, L::rank, NewVary, L::partial,
                                                  typename L::dims_type>::type;
template <local_tensor_type L, axis_mask NewPartial>
using with_partial_t = typename detail::rebind_local<L, typename L::value_type, L::rank, L::vary, NewPartial,
                                                     typename L::dims_type>::type;
/// @brief `L` with vary and partial both replaced (collectives move axes from one to the other).
template <local_tensor_type L, axis_mask NewVary, axis_mask NewPartial>
using with_vary_partial_t =
    typename detail::rebind_local<L, typename L::value_type, L::rank, NewVary, NewPartial, typename L::dims_type>::type;
template <local_tensor_type L, class NewDims>
using with_dims_t =
    typename detail::rebind_local<L, typename L::value_type, NewDims::size, L::vary, L::partial, NewDims>::type;
template <local_tensor_type L, class U>
using with_value_t = typename detail::rebind_local<L, U, L::rank, L::vary, L::partial, typename L::dims_type>::type;
/// @brief The general form: element type, rank, vary, partial and dims all given.
template <local_tensor_type L, class U, std::size_t R, axis_mask V, axis_mask P, class D>
using rebind_local_t = typename detail::rebind_local<L, U, R, V, P, D>::type;

/// @brief `Dims` without dimension `D`, and `Dims` permuted (`Perm[i]`: the source of entry `i`).
template <class Dims, std::size_t D>
using remove_dim_t = typename detail::remove_dim_impl<Dims, D>::type;
template <class Dims, std::array Perm>
using permute_dims_t = typename detail::permute_dims_impl<Dims, Perm>::type;

/// @brief The local type of a block of a rank-`Rank` array laid out by `S`, entering `shard_map`:
/// varying over every axis the spec uses, partial over none.
template <class T, std::size_t Rank, sharding_type S, class Space = default_memory_space>
using entry_local_t = local_tensor<T, Rank, typename S::mesh_type, S::sharded_axes, 0, dims_of_t<S, Rank>, Space>;

}  // namespace meshlib
// end meshlib/tensor/local_tensor.hpp
// begin meshlib/tensor/sharded_tensor.hpp
/// @file
/// @brief `sharded_tensor`: one logical array of a global shape laid out over a mesh, each device
/// holding its block in a `Kokkos::View` (row-major), as a `jax.Array` with a `NamedSharding`.
///
/// Blocks are indexed by device id. A process holds the blocks of its *local* devices only: with
/// the thread communicator that is every device; with one process per rank (MPI) it is that rank's
/// devices, and the other entries stay empty. Operations that need another device's block
/// (`to_host`) throw `sharding_error` when it is not local.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">> s{mesh_t{2, 2}};
/// std::vector<float> host(8 * 6);                       // row-major 8 x 6
/// auto x = meshlib::from_host(s, std::array<std::size_t, 2>{8, 6}, std::span<const float>(host));
/// x.local(3);        // device 3's 4 x 3 block, a Kokkos::View
/// x.block_of(3);     // its offsets and extents: [4:8, 3:6]
/// auto back = x.to_host();                              // == host
/// @endcode

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <functional>
#include <numeric>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib {

namespace detail {

/// Calls `f(local_index, global_index)` for every element of block `b`, row-major.
template <std::size_t Rank, class F>
void for_each_in_block(const block<Rank>& b, F&& f) {
  if (b.size() == 0) return;
  std::array<std::size_t, Rank> g = b.offset;
  const std::size_t n = b.size();
  for (std::size_t i = 0; i < n; ++i) {
    f(i, static_cast<const std::array<std::size_t, Rank>&>(g));
    for (std::size_t d = Rank; d-- > 0;) {
      if (++g[d] < b.offset[d] + b.extent[d]) break;
      g[d] = b.offset[d];
    }
  }
}

/// Row-major flat index of `g` in an array of `shape`.
template <std::size_t Rank>
constexpr std::size_t flat_index(const std::array<std::size_t, Rank>& shape, const std::array<std::size_t, Rank>& g) {
  std::size_t k = 0;
  for (std::size_t d = 0; d < Rank; ++d) k = k * shape[d] + g[d];
  return k;
}

template <std::size_t Rank>
constexpr std::size_t shape_size(const std::array<std::size_t, Rank>& s) {
  std::size_t n = 1;
  for (auto e : s) n *= e;
  return n;
}

}  // namespace detail

/// @brief A global array of `T` of rank `Rank`, laid out by `Sharding` (a `named_sharding`), each
/// local device's block in a row-major `Kokkos::View` in `Space`.
/// A `sharded_tensor` is a handle: copies share the blocks (as `Kokkos::View` and `jax.Array`).
template <class T, std::size_t Rank, sharding_type Sharding, class Space = default_memory_space>
class sharded_tensor {
  static_assert(Sharding::template check_rank<Rank>());

 public:
  using is_sharded_tensor = void;
  using value_type = T;
  using sharding_type = Sharding;
  using mesh_type = typename Sharding::mesh_type;
  using spec_type = typename Sharding::spec_type;
  using memory_space = Space;
  using view_type = detail::block_view_t<T, Rank, Space>;
  using shape_type = std::array<std::size_t, Rank>;
  using layout_type = shard_layout<Sharding, Rank>;
  /// The type of a block inside `shard_map`: varying over the spec's axes.
  using local_type = entry_local_t<T, Rank, Sharding, Space>;
  static constexpr std::size_t rank = Rank;

  /// Zero blocks for every device of the mesh (the thread-communicator case).
  /// @throws sharding_error when the shape does not fit the sharding (see `shard_layout`).
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape)
      : sharded_tensor(sharding, global_shape, all_devices(sharding)) {}

  /// Zero blocks for the devices in `local_devices` only (one process of a multi-process run).
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape, std::span<const std::size_t> local_devices)
      : layout_(sharding, global_shape), blocks_(sharding.mesh().size()), local_(sharding.mesh().size(), false) {
    for (std::size_t dev : local_devices) {
      if (dev >= blocks_.size())
        throw sharding_error("meshlib: sharded_tensor: local device " + std::to_string(dev) + " is not in mesh " +
                             sharding.mesh().to_string());
      blocks_[dev] = detail::allocate<T, Rank, Space>(layout_.local_shape(dev), "meshlib::sharded_tensor");
      local_[dev] = true;
    }
  }

  /// Wraps existing blocks: `blocks[dev]` is device `dev`'s block (or an empty view where not local).
  /// @throws sharding_error when a local block's shape is not the one the layout gives.
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape, std::vector<view_type> blocks,
                 std::vector<bool> local)
      : layout_(sharding, global_shape), blocks_(std::move(blocks)), local_(std::move(local)) {
    if (blocks_.size() != sharding.mesh().size() || local_.size() != blocks_.size())
      throw sharding_error("meshlib: sharded_tensor needs one block entry per device of " + sharding.mesh().to_string());
    for (std::size_t dev = 0; dev < blocks_.size(); ++dev)
      if (local_[dev] && detail::extents_of(blocks_[dev]) != layout_.local_shape(dev))
        throw sharding_error("meshlib: sharded_tensor: device " + std::to_string(dev) + "'s block has shape " +
                             detail::describe_shape(detail::extents_of(blocks_[dev])) + " but " + to_string_of_spec() +
                             " on global shape " + detail::describe_shape(global_shape) + " gives it shape " +
                             detail::describe_shape(layout_.local_shape(dev)));
  }

  [[nodiscard]] const Sharding& sharding() const noexcept { return layout_.sharding(); }
  [[nodiscard]] const mesh_type& mesh() const noexcept { return layout_.sharding().mesh(); }
  [[nodiscard]] const layout_type& layout() const noexcept { return layout_; }
  [[nodiscard]] const shape_type& global_shape() const noexcept { return layout_.global_shape(); }
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return layout_.global_shape()[d]; }
  /// Number of elements of the global array.
  [[nodiscard]] std::size_t size() const noexcept { return detail::shape_size(global_shape()); }
  [[nodiscard]] std::size_t num_devices() const noexcept { return blocks_.size(); }

  /// Whether this process holds device `dev`'s block.
  [[nodiscard]] bool is_local(std::size_t dev) const noexcept { return dev < local_.size() && local_[dev]; }
  /// The devices whose blocks this process holds, ascending.
  [[nodiscard]] std::vector<std::size_t> local_devices() const {
    std::vector<std::size_t> out;
    for (std::size_t d = 0; d < local_.size(); ++d)
      if (local_[d]) out.push_back(d);
    return out;
  }
  /// Whether this process holds every block.
  [[nodiscard]] bool fully_local() const noexcept { return std::all_of(local_.begin(), local_.end(), [](bool b) { return b; }); }

  /// Device `dev`'s block. @throws sharding_error when it is not local.
  [[nodiscard]] const view_type& local(std::size_t dev) const {
    check_local(dev, "local");
    return blocks_[dev];
  }
  /// Device `dev`'s block as the value `shard_map` hands the device (shares memory).
  [[nodiscard]] local_type local_value(std::size_t dev) const { return local_type(local(dev), mesh(), dev); }
  /// Offsets and extents of device `dev`'s block in the global array.
  [[nodiscard]] block<Rank> block_of(std::size_t dev) const noexcept { return layout_.block_of(dev); }
  [[nodiscard]] shape_type offsets(std::size_t dev) const noexcept { return layout_.block_of(dev).offset; }
  [[nodiscard]] shape_type local_shape(std::size_t dev) const noexcept { return layout_.local_shape(dev); }

  /// The global array, row-major, each element read from the first local device holding it.
  /// @throws sharding_error when some element has no local holder.
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size());
    const std::size_t n = num_devices();
    // Walk replica groups: the first local member of each group supplies the block.
    std::vector<bool> covered(n, false);
    for (std::size_t dev = 0; dev < n; ++dev) {
      if (covered[dev]) continue;
      const auto reps = layout_.replicas(dev);
      std::size_t src = n;
      for (auto r : reps) {
        covered[r] = true;
        if (src == n && local_[r]) src = r;
      }
      const block<Rank> b = layout_.block_of(dev);
      if (b.size() == 0) continue;
      if (src == n)
        throw sharding_error("meshlib: to_host: block " + block_string(b) + " is held by devices " +
                             list_string(reps) + ", none of them local to this process");
      copy_block_out(src, b, out.data());
    }
    return out;
  }

  /// Prints `sharded_tensor<(8, 6), named_sharding(mesh{'data': 2}, P<"data">)>`.
  friend std::ostream& operator<<(std::ostream& os, const sharded_tensor& t) {
    return os << "sharded_tensor<" << detail::describe_shape(t.global_shape()) << ", " << t.sharding() << '>';
  }
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  static std::vector<std::size_t> all_devices(const Sharding& s) {
    std::vector<std::size_t> d(s.mesh().size());
    std::iota(d.begin(), d.end(), std::size_t{0});
    return d;
  }
  std::string to_string_of_spec() const { return sharding().to_string(); }
  static std::string block_string(const block<Rank>& b) {
    std::ostringstream os;
    os << b;
    return os.str();
  }
  static std::string list_string(const std::vector<std::size_t>& v) {
    std::string s = "{";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "}";
  }
  void check_local(std::size_t dev, const char* what) const {
    if (dev >= local_.size() || !local_[dev])
      throw sharding_error(std::string("meshlib: sharded_tensor::") + what + ": device " + std::to_string(dev) +
                           (dev >= local_.size() ? " is not in mesh " + mesh().to_string()
                                                 : std::string(" is not local to this process")));
  }

  void copy_block_out(std::size_t dev, const block<Rank>& b, T* out) const {
    auto host = Kokkos::create_mirror_view(blocks_[dev]);
    if constexpr (!detail::host_accessible_v<Space>) Kokkos::deep_copy(host, blocks_[dev]);
    const T* src = host.data();
    detail::for_each_in_block(b, [&](std::size_t i, const shape_type& g) { out[detail::flat_index(global_shape(), g)] = src[i]; });
  }

  layout_type layout_;
  std::vector<view_type> blocks_;
  std::vector<bool> local_;
};

/// @brief A type that is a `sharded_tensor<...>`.
template <class T>
concept sharded_tensor_type = requires { typename std::remove_cvref_t<T>::is_sharded_tensor; };
template <class T>
inline constexpr bool is_sharded_tensor_v = sharded_tensor_type<T>;

namespace detail {

/// Builds a tensor whose local blocks `fill(dev, block, T* host_data)` writes, row-major.
template <class T, std::size_t Rank, sharding_type S, class Space, class F>
sharded_tensor<T, Rank, S, Space> fill_blocks(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                              std::span<const std::size_t> local_devices, F&& fill) {
  sharded_tensor<T, Rank, S, Space> t(sharding, shape, local_devices);
  for (std::size_t dev : local_devices) {
    const auto& v = t.local(dev);
    auto host = Kokkos::create_mirror_view(v);
    fill(dev, t.block_of(dev), host.data());
    if constexpr (!host_accessible_v<Space>) Kokkos::deep_copy(v, host);
  }
  return t;
}

template <class S>
std::vector<std::size_t> every_device(const S& s) {
  std::vector<std::size_t> d(s.mesh().size());
  std::iota(d.begin(), d.end(), std::size_t{0});
  return d;
}

}  // namespace detail

/// @brief Scatters a global row-major host array into blocks (`jax.device_put(x, sharding)`).
/// @throws sharding_error when `data.size()` is not the product of `shape`, or the shape does not fit.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
sharded_tensor<std::remove_const_t<T>, Rank, S, Space> from_host(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                                                 std::span<T> data,
                                                                 std::span<const std::size_t> local_devices = {}) {
  using U = std::remove_const_t<T>;
  if (data.size() != detail::shape_size(shape))
    throw sharding_error("meshlib: from_host: global shape " + detail::describe_shape(shape) + " has " +
                         std::to_string(detail::shape_size(shape)) + " elements but the host array has " +
                         std::to_string(data.size()));
  const auto all = detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  return detail::fill_blocks<U, Rank, S, Space>(sharding, shape, local_devices,
                                                [&](std::size_t, const block<Rank>& b, U* out) {
                                                  detail::for_each_in_block(b, [&](std::size_t i, const auto& g) {
                                                    out[i] = data[detail::flat_index(shape, g)];
                                                  });
                                                });
}

/// @brief `from_host` for a `std::vector`.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> from_host(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                            const std::vector<T>& data, std::span<const std::size_t> local_devices = {}) {
  return from_host<Space>(sharding, shape, std::span<const T>(data), local_devices);
}

/// @brief Builds each local block by a callback, as `jax.make_array_from_callback(shape, sharding, cb)`.
/// `cb` is called either per block as `cb(device, block<Rank> b, Kokkos::View host_block)` (fill the
/// view: `b.offset` / `b.extent` say where it lies in the global array), or per element as
/// `cb(std::array<std::size_t, Rank> global_index) -> T`.
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S, class F>
sharded_tensor<T, Rank, S, Space> make_array_from_callback(const std::array<std::size_t, Rank>& shape, const S& sharding,
                                                           F&& cb, std::span<const std::size_t> local_devices = {}) {
  const auto all = detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  using view_t = detail::block_view_t<T, Rank, Space>;
  using host_t = typename view_t::HostMirror;
  if constexpr (std::invocable<F&, const std::array<std::size_t, Rank>&>) {
    return detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t, const block<Rank>& b, T* out) {
      detail::for_each_in_block(b, [&](std::size_t i, const auto& g) { out[i] = static_cast<T>(cb(g)); });
    });
  } else {
    static_assert(std::invocable<F&, std::size_t, const block<Rank>&, const host_t&>,
                  "meshlib: make_array_from_callback: the callback must be invocable as cb(global_index) -> T or as "
                  "cb(device, block, host_view)");
    return detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t dev, const block<Rank>& b, T* out) {
      host_t v = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return host_t(out, b.extent[I]...);
      }(std::make_index_sequence<Rank>{});
      cb(dev, b, static_cast<const host_t&>(v));
    });
  }
}

/// @brief A tensor whose every element is `value` (`jnp.full` with a sharding).
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> full(const S& sharding, const std::array<std::size_t, Rank>& shape, const T& value,
                                       std::span<const std::size_t> local_devices = {}) {
  const auto all = detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  return detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t, const block<Rank>& b, T* out) {
    std::fill(out, out + b.size(), value);
  });
}

/// @brief A tensor of zeros (`jnp.zeros` with a sharding).
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> zeros(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                        std::span<const std::size_t> local_devices = {}) {
  if (local_devices.empty()) return sharded_tensor<T, Rank, S, Space>(sharding, shape);
  return sharded_tensor<T, Rank, S, Space>(sharding, shape, local_devices);
}

/// @brief The global array as a row-major host vector (`jax.device_get` / `np.asarray`).
template <sharded_tensor_type X>
auto to_host(const X& x) {
  return x.to_host();
}

}  // namespace meshlib
// end meshlib/tensor/sharded_tensor.hpp
// end meshlib/tensor.hpp
// begin meshlib/runtime.hpp
/// @file
/// @brief The runtime layer: the processes of a run (`distributed::initialize`, launcher
/// detection, process index and count, local devices, global mesh checks), per-process data
/// loading, and Kokkos initialisation. Depends on core and comm; the MPI transport comes in through
/// <meshlib/mpi.hpp>.

// begin meshlib/runtime/errors.hpp
/// @file
/// @brief The exception types of the runtime layer: what a launch can get wrong before any data
/// moves. Both are thrown at start-up so that a bad launch fails loudly instead of hanging later.


namespace meshlib {

/// @brief A launch meshlib cannot make sense of: contradictory launcher environments (OpenMPI says
/// rank 1 of 4, torchrun says rank 2 of 4), a rank outside its world, a variable that is not a
/// number, explicit arguments that contradict the launcher, or `initialize` called again with other
/// arguments. `what()` names every variable and value involved.
class distributed_error : public error {
 public:
  using error::error;
};

/// @brief Processes that disagree about something every process must share (the process count,
/// the local device count, a mesh's shape or axis names). Thrown on every process, with each
/// disagreeing process's value, by the start-up checks that exchange a description of the value.
class process_mismatch : public distributed_error {
 public:
  using distributed_error::distributed_error;
};

}  // namespace meshlib
// end meshlib/runtime/errors.hpp
// begin meshlib/runtime/launcher.hpp
/// @file
/// @brief Launcher detection: which process this is, out of how many, read from explicit arguments
/// or from the environment a launcher sets, as `jax.distributed.initialize` does. Pure: the
/// environment comes in through an `env_source`, so every launcher is testable in one process.
///
/// Sources, and the variables each reads:
///
/// | source        | process index         | process count        | local rank                    |
/// | ------------- | --------------------- | -------------------- | ----------------------------- |
/// | meshlib       | `MESHLIB_PROCESS_ID`  | `MESHLIB_PROCESS_COUNT` | `MESHLIB_LOCAL_RANK`       |
/// | OpenMPI       | `OMPI_COMM_WORLD_RANK`| `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
/// | MPICH / PMI   | `PMI_RANK`            | `PMI_SIZE`           | `MPI_LOCALRANKID`             |
/// | torchrun      | `RANK`                | `WORLD_SIZE`         | `LOCAL_RANK`                  |
/// | Slurm         | `SLURM_PROCID`        | `SLURM_NTASKS`       | `SLURM_LOCALID`               |
///
/// Rules (the same in `docs/multi-process.md`):
/// - A source counts as present when its process-index variable is set; its count must then be set
///   too, both must be decimal numbers, and index < count, else `distributed_error`.
/// - Explicit arguments, meshlib's variables, OpenMPI, MPICH/PMI and torchrun each describe the
///   process itself: every one that is present must agree on (index, count), else
///   `distributed_error` naming both sources and values. The first present in that order wins.
/// - Slurm describes the task `srun` started, which may itself start several processes (`mpirun`
///   or `torchrun` inside an allocation). So when another source is present, Slurm is checked
///   against it only when it claims at least as many processes: the same count must give the same
///   index, and more tasks than processes is a contradiction.
/// - No source at all: one process (index 0 of 1), the embedded default.

#include <charconv>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>


namespace meshlib::distributed {

/// @brief Where the process index and count came from.
enum class launcher {
  none,                ///< nothing set: one process
  explicit_arguments,  ///< `initialize(options{.process_id = ..., .num_processes = ...})`
  communicator,        ///< an adopted communicator (an `MPI_Comm` handed to meshlib)
  meshlib_env,         ///< `MESHLIB_PROCESS_ID` / `MESHLIB_PROCESS_COUNT`
  openmpi,             ///< `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE` (`mpirun` of OpenMPI)
  mpich,               ///< `PMI_RANK` / `PMI_SIZE` (MPICH's Hydra, Intel MPI, PMI launchers)
  torchrun,            ///< `RANK` / `WORLD_SIZE` (torchrun, torch.distributed.launch)
  slurm,               ///< `SLURM_PROCID` / `SLURM_NTASKS` (`srun`)
};

[[nodiscard]] constexpr std::string_view to_string(launcher l) noexcept {
  switch (l) {
    case launcher::none: return "none";
    case launcher::explicit_arguments: return "explicit arguments";
    case launcher::communicator: return "communicator";
    case launcher::meshlib_env: return "meshlib environment";
    case launcher::openmpi: return "OpenMPI";
    case launcher::mpich: return "MPICH/PMI";
    case launcher::torchrun: return "torchrun";
    case launcher::slurm: return "Slurm";
  }
  return "unknown";
}
inline std::ostream& operator<<(std::ostream& os, launcher l) { return os << to_string(l); }

/// @brief What detection found: this process's index, the process count, the local rank on its
/// node when the launcher says, and which source decided.
struct launch_info {
  std::size_t process_index = 0;
  std::size_t process_count = 1;
  std::optional<std::size_t> local_rank;
  launcher source = launcher::none;

  friend bool operator==(const launch_info&, const launch_info&) = default;
  /// Prints `process 1 of 4 (OpenMPI, local rank 1)`.
  friend std::ostream& operator<<(std::ostream& os, const launch_info& i) {
    os << "process " << i.process_index << " of " << i.process_count << " (" << i.source;
    if (i.local_rank) os << ", local rank " << *i.local_rank;
    return os << ')';
  }
};

/// @brief Looks up an environment variable: its value, or nothing when unset.
using env_source = std::function<std::optional<std::string>(std::string_view)>;

/// @brief The process's own environment (`std::getenv`).
inline env_source process_env() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

/// @brief An environment given as a map, for tests and for programs that read their configuration
/// elsewhere.
inline env_source map_env(std::map<std::string, std::string, std::less<>> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

/// @brief Values given to `initialize` that override or must agree with the environment.
struct explicit_launch {
  std::optional<std::size_t> process_id;
  std::optional<std::size_t> num_processes;
};

namespace detail {

struct launcher_vars {
  launcher source;
  std::string_view index, count, local;
};

inline constexpr launcher_vars launcher_table[] = {
    {launcher::meshlib_env, "MESHLIB_PROCESS_ID", "MESHLIB_PROCESS_COUNT", "MESHLIB_LOCAL_RANK"},
    {launcher::openmpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {launcher::mpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

/// A decimal number of the whole (trimmed) string, or `distributed_error` naming the variable.
inline std::size_t parse_count(std::string_view var, const std::string& raw) {
  std::string_view s = raw;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  std::size_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size())
    throw distributed_error("meshlib: environment variable " + std::string(var) + "='" + raw +
                            "' is not a non-negative decimal number");
  return v;
}

/// One source's claim, with the text that names it in errors.
struct claim {
  launch_info info;
  std::string what;  // "OpenMPI (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=4)"
};

inline std::optional<claim> read_launcher(const launcher_vars& v, const env_source& env) {
  const auto idx = env(v.index);
  if (!idx) return std::nullopt;
  const auto cnt = env(v.count);
  if (!cnt)
    throw distributed_error("meshlib: " + std::string(to_string(v.source)) + " launch detected (" +
                            std::string(v.index) + "=" + *idx + ") but " + std::string(v.count) +
                            " is not set; set both or neither");
  claim c;
  c.info.source = v.source;
  c.info.process_index = parse_count(v.index, *idx);
  c.info.process_count = parse_count(v.count, *cnt);
  c.what = std::string(to_string(v.source)) + " (" + std::string(v.index) + "=" + *idx + ", " + std::string(v.count) +
           "=" + *cnt + ")";
  if (c.info.process_count == 0 || c.info.process_index >= c.info.process_count)
    throw distributed_error("meshlib: " + c.what + " names a process outside its world: the index must be less than "
                            "the count, and the count at least 1");
  if (const auto loc = env(v.local)) c.info.local_rank = parse_count(v.local, *loc);
  return c;
}

inline std::string describe_claim(const claim& c) {
  return c.what + ": process " + std::to_string(c.info.process_index) + " of " + std::to_string(c.info.process_count);
}

}  // namespace detail

/// @brief Detects this process's index and the process count from explicit values, an adopted
/// communicator's rank and size (`comm`, index then count), and the environment, by the rules in
/// this file's comment.
/// @throws distributed_error on contradictory or malformed sources, naming every one involved.
inline launch_info detect_launch(const env_source& env, const explicit_launch& given = {},
                                 std::optional<std::pair<std::size_t, std::size_t>> comm = std::nullopt) {
  std::vector<detail::claim> direct;
  if (given.process_id || given.num_processes) {
    if (!given.process_id || !given.num_processes)
      throw distributed_error(
          "meshlib: initialize was given only one of process_id and num_processes; give both or neither");
    detail::claim c;
    c.info = {*given.process_id, *given.num_processes, std::nullopt, launcher::explicit_arguments};
    c.what = "explicit arguments (process_id=" + std::to_string(*given.process_id) +
             ", num_processes=" + std::to_string(*given.num_processes) + ")";
    if (c.info.process_count == 0 || c.info.process_index >= c.info.process_count)
      throw distributed_error("meshlib: " + c.what + " name a process outside its world: process_id must be less "
                              "than num_processes, and num_processes at least 1");
    direct.push_back(std::move(c));
  }
  if (comm) {
    detail::claim c;
    c.info = {comm->first, comm->second, std::nullopt, launcher::communicator};
    c.what = "the adopted communicator (rank " + std::to_string(comm->first) + ", size " +
             std::to_string(comm->second) + ")";
    direct.push_back(std::move(c));
  }
  std::optional<detail::claim> slurm;
  std::vector<detail::claim> env_claims;
  for (const auto& v : detail::launcher_table) {
    auto c = detail::read_launcher(v, env);
    if (!c) continue;
    if (v.source == launcher::slurm)
      slurm = std::move(c);
    else
      env_claims.push_back(std::move(*c));
  }
  // An adopted communicator is authoritative for the index and count: an application may hand
  // meshlib a sub-communicator whose ranks differ from the launcher's world, so the environment is
  // only consulted for the local rank then.
  const bool have_comm = comm.has_value();
  if (!have_comm) direct.insert(direct.end(), env_claims.begin(), env_claims.end());

  for (std::size_t i = 1; i < direct.size(); ++i) {
    const auto& a = direct[0].info;
    const auto& b = direct[i].info;
    if (a.process_index != b.process_index || a.process_count != b.process_count)
      throw distributed_error("meshlib: contradictory launch information: " + detail::describe_claim(direct[0]) +
                              ", but " + detail::describe_claim(direct[i]) +
                              "; unset the stale variables or fix the arguments");
  }

  launch_info out;
  if (!direct.empty()) {
    out = direct[0].info;
    if (slurm && !have_comm) {
      const auto& s = slurm->info;
      const bool contradicts = s.process_count > out.process_count ||
                               (s.process_count == out.process_count && s.process_index != out.process_index);
      if (contradicts)
        throw distributed_error("meshlib: contradictory launch information: " + detail::describe_claim(direct[0]) +
                                ", but " + detail::describe_claim(*slurm) +
                                "; a Slurm step may start several processes per task but never fewer processes "
                                "than tasks");
    }
  } else if (slurm) {
    out = slurm->info;
  }
  // The local rank: from the winning source, else from any other that sets one.
  if (!out.local_rank) {
    for (const auto& c : direct)
      if (c.info.local_rank) {
        out.local_rank = c.info.local_rank;
        break;
      }
    if (!out.local_rank)
      for (const auto& c : env_claims)
        if (c.info.local_rank) {
          out.local_rank = c.info.local_rank;
          break;
        }
    if (!out.local_rank && slurm && slurm->info.process_count == out.process_count) out.local_rank = slurm->info.local_rank;
  }
  return out;
}

}  // namespace meshlib::distributed
// end meshlib/runtime/launcher.hpp
// begin meshlib/runtime/process_exchange.hpp
/// @file
/// @brief `process_exchange`: the one thing the runtime needs from a transport between processes,
/// to check at start-up that every process was given the same arguments, and to abort them all
/// with a reason. The MPI backend provides one over an `MPI_Comm` (`meshlib::mpi::exchange`); a
/// single process needs none.

#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace meshlib::distributed {

/// @brief A transport between the processes of one run.
class process_exchange {
 public:
  virtual ~process_exchange() = default;
  /// This process's rank in the transport.
  [[nodiscard]] virtual std::size_t rank() const = 0;
  /// Number of processes in the transport.
  [[nodiscard]] virtual std::size_t size() const = 0;
  /// Every process's `mine`, in rank order. Collective: every process calls it.
  [[nodiscard]] virtual std::vector<std::string> all_gather(std::string_view mine) = 0;
  /// Ends every process of the run with `reason` printed by the caller first (`MPI_Abort`).
  [[noreturn]] virtual void abort(int exit_code, std::string_view reason) = 0;
};

/// @brief The exchange of a run of one process: gathers its own value, aborts with `std::abort`.
class single_process_exchange final : public process_exchange {
 public:
  [[nodiscard]] std::size_t rank() const override { return 0; }
  [[nodiscard]] std::size_t size() const override { return 1; }
  [[nodiscard]] std::vector<std::string> all_gather(std::string_view mine) override { return {std::string(mine)}; }
  [[noreturn]] void abort(int, std::string_view) override { std::abort(); }
};

}  // namespace meshlib::distributed
// end meshlib/runtime/process_exchange.hpp
// begin meshlib/runtime/distributed.hpp
/// @file
/// @brief `meshlib::distributed`: the processes of one run, modelled on `jax.distributed`.
///
/// @code
/// meshlib::distributed::guard run;                 // detects mpirun / srun / torchrun / nothing
/// auto m = meshlib::distributed::make_global_mesh<meshlib::axis<"data">>(meshlib::distributed::device_count());
/// for (std::size_t d : meshlib::distributed::local_devices()) { /* this process's devices */ }
/// @endcode
///
/// Devices. Each process owns `local_device_count()` devices (threads on a CPU, GPUs with NCCL;
/// the same count on every process, checked at start-up). The global devices are numbered
/// process-major: process `p` owns devices `[p*T, (p+1)*T)` with `T = local_device_count()`. A
/// mesh numbers its devices row-major (the last axis varies fastest), so in
/// `mesh<axis<"process">, axis<"thread">>{P, T}` the last axis is the one inside a process and the
/// first one spans processes; more generally, the trailing axes whose sizes multiply to `T` stay
/// inside a process.
///
/// Before `initialize` (and after `shutdown`) every query answers for the embedded default: one
/// process, index 0, one local device, as JAX does.
///
/// This header needs neither Kokkos nor MPI. Kokkos is initialised by `initialize` only when
/// `<meshlib/runtime/kokkos_runtime.hpp>` is included (it is by `<meshlib/runtime.hpp>`), and a
/// transport to check and abort other processes comes from `<meshlib/mpi.hpp>`.

#include <cstddef>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>


namespace meshlib::distributed {

/// @brief The arguments of `initialize`, all optional (`jax.distributed.initialize`'s).
struct options {
  /// This process's index; with `num_processes`, overrides detection (and must agree with any
  /// launcher or communicator that is present).
  std::optional<std::size_t> process_id;
  std::optional<std::size_t> num_processes;
  /// Devices this process owns; default `MESHLIB_LOCAL_DEVICE_COUNT` from the environment, else 1.
  std::optional<std::size_t> local_device_count;
  /// Initialise Kokkos when the program has not (and finalise it in `shutdown`). Needs
  /// `<meshlib/runtime/kokkos_runtime.hpp>`; without it this flag does nothing.
  bool initialize_kokkos = true;
  /// A transport to the other processes (`meshlib::mpi::exchange`): its rank and size decide the
  /// process index and count, and the start-up consistency checks run over it.
  std::shared_ptr<process_exchange> exchange;
  /// Where launcher variables are read; default the process environment.
  env_source env;
};

namespace detail {

/// Filled by optional headers (Kokkos) so that this one depends on neither.
struct runtime_hooks {
  /// Initialises Kokkos when it is not; returns whether it did.
  bool (*start_kokkos)() = nullptr;
  void (*stop_kokkos)() = nullptr;
};
inline runtime_hooks& hooks() {
  static runtime_hooks h;
  return h;
}

struct runtime_state {
  bool initialized = false;
  launch_info launch;
  std::size_t local_devices = 1;
  std::shared_ptr<process_exchange> exchange;
  bool owns_kokkos = false;
  /// Kokkos 3.x cannot be initialised again in a process once finalised.
  bool finalized_kokkos = false;
};
inline runtime_state& state() {
  static runtime_state s;
  return s;
}
inline std::recursive_mutex& state_mutex() {
  static std::recursive_mutex m;
  return m;
}

inline std::string describe(const launch_info& l, std::size_t local) {
  std::ostringstream os;
  os << l << " with " << local << " local device" << (local == 1 ? "" : "s");
  return os.str();
}

/// Throws `process_mismatch` on every process unless every element of `all` equals the first.
inline void require_equal(std::string_view what, const std::vector<std::string>& all) {
  bool same = true;
  for (const auto& v : all) same = same && v == all.front();
  if (same) return;
  // Group processes by value so a 1024-process run prints each distinct value once.
  std::map<std::string, std::vector<std::size_t>> by_value;
  for (std::size_t p = 0; p < all.size(); ++p) by_value[all[p]].push_back(p);
  std::ostringstream os;
  os << "meshlib: the processes disagree about " << what << ": ";
  bool first = true;
  for (const auto& [value, procs] : by_value) {
    os << (first ? "" : "; ") << (procs.size() == 1 ? "process " : "processes ");
    for (std::size_t i = 0; i < procs.size() && i < 8; ++i) os << (i ? "," : "") << procs[i];
    if (procs.size() > 8) os << ",... (" << procs.size() << " in all)";
    os << (procs.size() == 1 ? " has " : " have ") << value;
    first = false;
  }
  os << "; every process must pass the same value";
  throw process_mismatch(os.str());
}

}  // namespace detail

/// @brief Whether `initialize` has run (and `shutdown` has not since).
[[nodiscard]] inline bool is_initialized() {
  std::lock_guard lock(detail::state_mutex());
  return detail::state().initialized;
}

/// @brief Starts this process's part of a run: detects the process index and count (see
/// launcher.hpp for the rules), sets the local device count, initialises Kokkos when asked and
/// the program has not, and, with a transport, checks that every process agrees on the process
/// count and local device count and that no two claim the same index.
///
/// Idempotent: a second call with arguments that resolve to the same values does nothing; one that
/// resolves to other values throws `distributed_error` (call `shutdown` first).
/// @throws distributed_error on a contradictory launch; process_mismatch (on every process) when
/// processes disagree.
inline void initialize(const options& opt = {}) {
  std::lock_guard lock(detail::state_mutex());
  auto& st = detail::state();
  const env_source env = opt.env ? opt.env : process_env();

  std::optional<std::pair<std::size_t, std::size_t>> comm;
  if (opt.exchange) comm = std::pair{opt.exchange->rank(), opt.exchange->size()};
  const launch_info launch = detect_launch(env, {opt.process_id, opt.num_processes}, comm);

  std::size_t local = 1;
  if (opt.local_device_count) {
    local = *opt.local_device_count;
  } else if (const auto v = env("MESHLIB_LOCAL_DEVICE_COUNT")) {
    local = detail::parse_count("MESHLIB_LOCAL_DEVICE_COUNT", *v);
  }
  if (local == 0) throw distributed_error("meshlib: a process needs at least one local device; local_device_count is 0");

  if (st.initialized) {
    if (st.launch.process_index == launch.process_index && st.launch.process_count == launch.process_count &&
        st.local_devices == local)
      return;
    throw distributed_error("meshlib: distributed::initialize was already called as " +
                            detail::describe(st.launch, st.local_devices) + " and is now called as " +
                            detail::describe(launch, local) + "; call distributed::shutdown() first");
  }

  if (opt.exchange && launch.process_count > 1) {
    // Every process must see the same world and the same number of devices per process, and the
    // indices must be a permutation: two processes with one index would hang the first collective.
    detail::require_equal("the process count and local device count",
                          opt.exchange->all_gather(std::to_string(launch.process_count) + " processes x " +
                                                   std::to_string(local) + " local devices"));
    const auto indices = opt.exchange->all_gather(std::to_string(launch.process_index));
    std::map<std::string, std::vector<std::size_t>> seen;
    for (std::size_t r = 0; r < indices.size(); ++r) seen[indices[r]].push_back(r);
    for (const auto& [idx, ranks] : seen)
      if (ranks.size() > 1)
        throw process_mismatch("meshlib: transport ranks " + std::to_string(ranks[0]) + " and " +
                               std::to_string(ranks[1]) + " both claim process index " + idx +
                               "; every process needs its own index");
  }

  bool owns_kokkos = false;
  if (opt.initialize_kokkos && detail::hooks().start_kokkos) {
    if (st.finalized_kokkos)
      throw distributed_error(
          "meshlib: distributed::initialize would initialise Kokkos again, but meshlib finalised it in an earlier "
          "shutdown() and Kokkos 3.x cannot be initialised twice in one process; initialise Kokkos in main() "
          "instead (Kokkos::ScopeGuard), or pass initialize_kokkos = false");
    owns_kokkos = detail::hooks().start_kokkos();
  }

  st.initialized = true;
  st.launch = launch;
  st.local_devices = local;
  st.exchange = opt.exchange;
  st.owns_kokkos = owns_kokkos;
}

/// @brief Ends this process's part of the run: finalises Kokkos if `initialize` initialised it,
/// and releases the transport (the MPI exchange never frees a communicator it did not create).
/// Does nothing when not initialised.
inline void shutdown() {
  std::lock_guard lock(detail::state_mutex());
  auto& st = detail::state();
  if (!st.initialized) return;
  if (st.owns_kokkos && detail::hooks().stop_kokkos) {
    detail::hooks().stop_kokkos();
    st.finalized_kokkos = true;
  }
  const bool finalized = st.finalized_kokkos;
  st = detail::runtime_state{};
  st.finalized_kokkos = finalized;
}

/// @brief Initialises in its constructor and shuts down in its destructor, but only when it was
/// the one that initialised: a guard inside an already initialised program changes nothing.
class guard {
 public:
  explicit guard(const options& opt = {}) : owner_(!is_initialized()) { initialize(opt); }
  guard(const guard&) = delete;
  guard& operator=(const guard&) = delete;
  ~guard() {
    if (owner_) shutdown();
  }

 private:
  bool owner_;
};

/// @brief How this process was launched (the embedded default before `initialize`).
[[nodiscard]] inline launch_info launch() {
  std::lock_guard lock(detail::state_mutex());
  return detail::state().launch;
}
/// @brief This process's index, `0 <= process_index() < process_count()` (`jax.process_index`).
[[nodiscard]] inline std::size_t process_index() { return launch().process_index; }
/// @brief Number of processes in the run (`jax.process_count`).
[[nodiscard]] inline std::size_t process_count() { return launch().process_count; }
/// @brief Devices each process owns (`jax.local_device_count`).
[[nodiscard]] inline std::size_t local_device_count() {
  std::lock_guard lock(detail::state_mutex());
  return detail::state().local_devices;
}
/// @brief Devices in the run: `process_count() * local_device_count()` (`jax.device_count`).
[[nodiscard]] inline std::size_t device_count() { return process_count() * local_device_count(); }
/// @brief Every device of the run, in global order `0 .. device_count()-1` (`jax.devices`).
[[nodiscard]] inline std::vector<std::size_t> devices() {
  std::vector<std::size_t> out(device_count());
  for (std::size_t d = 0; d < out.size(); ++d) out[d] = d;
  return out;
}
/// @brief The process that owns global device `device`.
[[nodiscard]] inline std::size_t process_of(std::size_t device) { return device / local_device_count(); }
/// @brief This process's devices, in global order: `[i*T, (i+1)*T)` (`jax.local_devices`).
[[nodiscard]] inline std::vector<std::size_t> local_devices() {
  const std::size_t t = local_device_count();
  const std::size_t first = process_index() * t;
  std::vector<std::size_t> out(t);
  for (std::size_t i = 0; i < t; ++i) out[i] = first + i;
  return out;
}
/// @brief Whether global device `device` belongs to this process.
[[nodiscard]] inline bool is_local(std::size_t device) { return process_of(device) == process_index(); }

/// @brief The transport given to `initialize`, or a single-process one.
[[nodiscard]] inline std::shared_ptr<process_exchange> exchange() {
  std::lock_guard lock(detail::state_mutex());
  if (detail::state().exchange) return detail::state().exchange;
  static const auto single = std::make_shared<single_process_exchange>();
  return single;
}

/// @brief Ends the whole run because of `reason`: prints
/// `meshlib: process i of N aborts the run: <reason>` on this process's stderr, then aborts every
/// process through the transport (`MPI_Abort` under MPI; `std::abort` for one process).
[[noreturn]] inline void abort(std::string_view reason, int exit_code = 1) {
  const auto l = launch();
  std::cerr << "meshlib: process " << l.process_index << " of " << l.process_count << " aborts the run: " << reason
            << std::endl;
  exchange()->abort(exit_code, reason);
}

/// @brief Checks that every process passes the same `value` for `what`: a collective over the
/// transport that throws `process_mismatch` on every process, naming each process's value, so a
/// disagreement fails at start-up instead of hanging the first collective. Does nothing for one
/// process or without a transport.
inline void check_same_on_all_processes(std::string_view what, std::string_view value) {
  std::shared_ptr<process_exchange> ex;
  {
    std::lock_guard lock(detail::state_mutex());
    ex = detail::state().exchange;
  }
  if (!ex || ex->size() <= 1) return;
  detail::require_equal(what, ex->all_gather(value));
}

/// @brief Checks that `m` covers every device of the run and that every process built the same
/// mesh (axis names and sizes).
/// @throws mesh_error when the mesh has another number of devices; process_mismatch (on every
/// process) when processes built different meshes.
template <mesh_type Mesh>
void check_mesh(const Mesh& m) {
  const std::size_t n = device_count();
  if (m.size() != n) {
    std::ostringstream os;
    os << "meshlib: mesh " << m << " has " << m.size() << " devices but the run has " << n << " (" << process_count()
       << " processes x " << local_device_count() << " local devices); choose axis sizes whose product is " << n;
    throw mesh_error(os.str());
  }
  check_same_on_all_processes("the mesh", m.to_string());
}

/// @brief Builds a mesh over every device of the run and checks it on every process, as
/// `jax.make_mesh` over `jax.devices()`.
template <mesh_axis... Axes, class... Sizes>
mesh<Axes...> make_global_mesh(Sizes... sizes) {
  mesh<Axes...> m(sizes...);
  check_mesh(m);
  return m;
}

/// @brief The mesh coordinates of this process's devices, in `local_devices()` order.
template <mesh_type Mesh>
std::vector<typename Mesh::coord_type> local_coords(const Mesh& m) {
  std::vector<typename Mesh::coord_type> out;
  for (std::size_t d : local_devices()) out.push_back(m.coords(d));
  return out;
}

}  // namespace meshlib::distributed
// end meshlib/runtime/distributed.hpp
// begin meshlib/runtime/process_data.hpp
/// @file
/// @brief Per-process data loading: which rows of a global batch this process's devices own under
/// a sharding, so a data pipeline reads only its share (JAX's `ds.shard(num_shards=process_count(),
/// index=process_index())`), and how the rows a process read split into its devices' shards
/// (`jax.make_array_from_process_local_data`).
///
/// @code
/// meshlib::shard_layout layout{sharding, std::array<std::size_t, 2>{global_batch, features}};
/// auto rows = meshlib::distributed::process_rows(layout);             // e.g. {[64, 128)}
/// std::vector<float> mine = read_rows(rows);                          // rows x features, row-major
/// auto shards = meshlib::distributed::split_process_local_data<float>(layout, mine);
/// // shards[i]: the row-major block of local device i (local_devices()[i])
/// @endcode
///
/// The process-local data is the concatenation, in `process_rows` order, of the global rows this
/// process's devices hold, each row complete in the other dimensions (a process reads whole
/// examples; devices that split the other dimensions take their columns from them).

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <span>
#include <string>
#include <vector>


namespace meshlib::distributed {

/// @brief Rows `[begin, end)` of dimension 0 of a global array.
struct row_range {
  std::size_t begin = 0;
  std::size_t end = 0;
  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  friend constexpr bool operator==(const row_range&, const row_range&) = default;
  friend std::ostream& operator<<(std::ostream& os, const row_range& r) { return os << '[' << r.begin << ", " << r.end << ')'; }
};

/// @brief The rows of dimension 0 that the devices of process `process` (each process owning
/// `local_devices` consecutive global devices) hold under `layout`: sorted, disjoint, adjacent
/// ranges merged, empty blocks skipped. Defaults: this process, `local_device_count()`.
/// @post The ranges of all processes cover every row; processes that hold replicas of one block
/// (the batch is replicated over an axis that spans processes) get the same rows.
template <sharding_type S, std::size_t Rank>
std::vector<row_range> process_rows(const shard_layout<S, Rank>& layout, std::size_t process,
                                    std::size_t local_devices) {
  static_assert(Rank >= 1, "meshlib: process_rows needs an array of rank at least 1");
  if (local_devices == 0 || (process + 1) * local_devices > layout.num_devices())
    throw mesh_error("meshlib: process_rows: process " + std::to_string(process) + " with " +
                     std::to_string(local_devices) + " local devices lies outside the mesh " +
                     layout.sharding().mesh().to_string() + " of " + std::to_string(layout.num_devices()) +
                     " devices");
  std::vector<row_range> r;
  for (std::size_t i = 0; i < local_devices; ++i) {
    const auto b = layout.block_of(process * local_devices + i);
    if (b.extent[0] > 0) r.push_back({b.offset[0], b.offset[0] + b.extent[0]});
  }
  std::sort(r.begin(), r.end(), [](const row_range& a, const row_range& b) { return a.begin < b.begin; });
  std::vector<row_range> merged;
  for (const auto& x : r) {
    if (!merged.empty() && x.begin <= merged.back().end)
      merged.back().end = std::max(merged.back().end, x.end);
    else
      merged.push_back(x);
  }
  return merged;
}

template <sharding_type S, std::size_t Rank>
std::vector<row_range> process_rows(const shard_layout<S, Rank>& layout) {
  return process_rows(layout, process_index(), local_device_count());
}

/// @brief Number of rows in `ranges`: the rows of the process-local data.
[[nodiscard]] inline std::size_t row_count(const std::vector<row_range>& ranges) noexcept {
  std::size_t n = 0;
  for (const auto& r : ranges) n += r.size();
  return n;
}

/// @brief Splits the process-local data (the rows of `process_rows`, concatenated, row-major over
/// the global shape's other dimensions) into the row-major block of each of the process's devices.
/// Defaults: this process, `local_device_count()`.
/// @throws sharding_error when `local` has another number of elements than the process's rows.
template <class T, sharding_type S, std::size_t Rank>
std::vector<std::vector<T>> split_process_local_data(const shard_layout<S, Rank>& layout, std::span<const T> local,
                                                     std::size_t process, std::size_t local_devices) {
  const auto rows = process_rows(layout, process, local_devices);
  const auto& g = layout.global_shape();
  std::size_t row_elems = 1;
  for (std::size_t d = 1; d < Rank; ++d) row_elems *= g[d];
  if (local.size() != row_count(rows) * row_elems)
    throw sharding_error("meshlib: split_process_local_data: process " + std::to_string(process) + " holds rows " +
                         std::to_string(row_count(rows)) + " x " + std::to_string(row_elems) + " = " +
                         std::to_string(row_count(rows) * row_elems) + " elements under " +
                         layout.sharding().to_string() + ", but " + std::to_string(local.size()) + " were given");
  // Local row of global row `gr`: its position within the concatenated ranges.
  auto local_row = [&](std::size_t gr) {
    std::size_t base = 0;
    for (const auto& r : rows) {
      if (gr < r.end) return base + (gr - r.begin);
      base += r.size();
    }
    return base;  // unreachable for rows the process holds
  };
  std::vector<std::vector<T>> out;
  out.reserve(local_devices);
  for (std::size_t i = 0; i < local_devices; ++i) {
    const auto b = layout.block_of(process * local_devices + i);
    std::vector<T> shard;
    shard.reserve(b.size());
    std::array<std::size_t, Rank> idx{};
    for (std::size_t k = 0; k < b.size(); ++k) {
      // idx runs row-major over the block; the source is row-major over (local rows, g[1..]).
      std::size_t src = local_row(b.offset[0] + idx[0]);
      for (std::size_t d = 1; d < Rank; ++d) src = src * g[d] + b.offset[d] + idx[d];
      shard.push_back(local[src]);
      for (std::size_t d = Rank; d-- > 0;) {
        if (++idx[d] < b.extent[d]) break;
        idx[d] = 0;
      }
    }
    out.push_back(std::move(shard));
  }
  return out;
}

template <class T, sharding_type S, std::size_t Rank>
std::vector<std::vector<T>> split_process_local_data(const shard_layout<S, Rank>& layout, std::span<const T> local) {
  return split_process_local_data<T>(layout, local, process_index(), local_device_count());
}

}  // namespace meshlib::distributed
// end meshlib/runtime/process_data.hpp
// begin meshlib/runtime/kokkos_runtime.hpp
/// @file
/// @brief The Kokkos part of `distributed::initialize`, kept out of distributed.hpp so that launcher
/// detection and the process queries build without Kokkos. Including this header makes
/// `initialize` initialise Kokkos when the program has not (`options::initialize_kokkos`), and
/// `shutdown` finalise it only when `initialize` was the one that initialised it.
///
/// Kokkos 3.x (3.4.1 here) cannot be initialised again in a process after `Kokkos::finalize`: a
/// program that shuts meshlib down and initialises it again must own Kokkos itself
/// (`Kokkos::ScopeGuard` in `main`); `initialize` says so with a `distributed_error` instead of
/// letting Kokkos fail.

#include <Kokkos_Core.hpp>


namespace meshlib::distributed::detail {

inline bool start_kokkos() {
  if (Kokkos::is_initialized()) return false;
  Kokkos::initialize();
  return true;
}

inline void stop_kokkos() {
  if (Kokkos::is_initialized()) Kokkos::finalize();
}

/// Registers the hooks before `main` (an inline variable is initialised once per program).
inline const bool kokkos_hooks_registered = [] {
  hooks().start_kokkos = &start_kokkos;
  hooks().stop_kokkos = &stop_kokkos;
  return true;
}();

}  // namespace meshlib::distributed::detail
// end meshlib/runtime/kokkos_runtime.hpp
// end meshlib/runtime.hpp
// end meshlib.hpp
#endif  // MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
