// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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
  /// All `none` values are equal.
  friend constexpr bool operator==(none_t, none_t) noexcept { return true; }
};
/// @brief A replicated dimension in a partition spec: JAX's `None` in `P("data", None)`.
inline constexpr none_t none{};

/// @brief One entry of a partition spec: the mesh axes (0 to `max_axes`) a dimension is split over.
/// A structural type, so specs are template arguments; built implicitly from `"name"` or `none`,
/// and by `axes(...)` for several axes.
struct dim_spec {
  /// The most mesh axes one dimension can be split over.
  static constexpr std::size_t max_axes = 4;
  /// The longest axis name, NUL included, a dim_spec can hold.
  static constexpr std::size_t max_name = 32;

  /// The axis names, in the order given; the first `count` are used.
  char names[max_axes][max_name] = {};
  /// How many axes the dimension is split over (0: replicated).
  std::size_t count = 0;

  constexpr dim_spec() = default;
  /// Member by member. nvcc's front end (13.0) writes a `dim_spec` template argument into the host
  /// code as `{names, count}`, which needs this constructor (the type is not an aggregate).
  constexpr dim_spec(const char (&n)[max_axes][max_name], std::size_t c) noexcept : count(c) {
    for (std::size_t i = 0; i < max_axes; ++i)
      for (std::size_t j = 0; j < max_name; ++j) names[i][j] = n[i][j];
  }
  /// A replicated dimension: `P<none>`.
  constexpr dim_spec(none_t) noexcept {}
  /// A dimension split over one axis: `P<"data">`.
  template <std::size_t N>
  constexpr dim_spec(const char (&name)[N]) {  // NOLINT: implicit on purpose, P<"data">
    push(name);
  }

  /// Appends axis `name`; used by `axes(...)` to split a dimension over several axes.
  template <std::size_t N>
  constexpr void push(const char (&name)[N]) {
    static_assert(N <= max_name, "meshlib: axis names in a partition spec are limited to 31 characters");
    static_assert(N > 1, "meshlib: an empty axis name in a partition spec; use meshlib::none for a replicated dimension");
    if (count == max_axes) throw "meshlib: a dimension can be split over at most 4 mesh axes";
    for (std::size_t i = 0; i < N; ++i) names[count][i] = name[i];
    ++count;
  }

  /// The name of the `i`-th axis (`i < size()`).
  [[nodiscard]] constexpr std::string_view axis(std::size_t i) const noexcept {
    return std::string_view(names[i]);
  }
  /// How many axes the dimension is split over.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return count; }
  /// True when the dimension is not split (`none`).
  [[nodiscard]] constexpr bool replicated() const noexcept { return count == 0; }
  /// True when the dimension is split over axis `name`.
  [[nodiscard]] constexpr bool uses(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < count; ++i)
      if (axis(i) == name) return true;
    return false;
  }

  /// Equal when they name the same axes in the same order.
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

/// @brief A partition spec: entry `i` says how tensor dimension `i` is split. JAX's `P`
/// (`PartitionSpec`); `partition_spec` is the long name.
///
/// `P` is the class and `partition_spec` the alias, not the other way round: nvcc's front end (13.0)
/// loses the values of an alias template's class-type arguments (`P<"data", none>` through an
/// alias reaches the host compiler as `partition_spec<__T2, __T3>`, undeclared names), and `P` is
/// what users write, in CUDA translation units too.
template <dim_spec... Dims>
struct P {
  /// Tag that opts the spec into the `partition_spec_type` concept.
  using is_partition_spec = void;
  /// The number of dimensions the spec describes.
  static constexpr std::size_t size = sizeof...(Dims);
  /// The per-dimension entries, in dimension order.
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
  friend std::ostream& operator<<(std::ostream& os, P) {
    os << "P<";
    for (std::size_t i = 0; i < size; ++i) os << (i ? ", " : "") << dims[i];
    return os << '>';
  }
  /// The spec as `operator<<` prints it, such as `P<"data", none>`.
  static std::string to_string() {
    std::ostringstream os;
    os << P{};
    return os.str();
  }
};

/// @brief The long name of `P`.
template <dim_spec... Dims>
using partition_spec = P<Dims...>;

/// @brief A type that is a `partition_spec<...>`.
template <class T>
concept partition_spec_type = requires { typename T::is_partition_spec; };

}  // namespace meshlib
