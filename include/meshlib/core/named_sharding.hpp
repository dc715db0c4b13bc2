// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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

#include "meshlib/core/mesh.hpp"
#include "meshlib/core/partition_spec.hpp"

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
