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
  friend constexpr bool operator==(none_t, none_t) noexcept { return true; }
};
/// @brief A replicated dimension in a partition spec: JAX's `None` in `P("data", None)`.
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
