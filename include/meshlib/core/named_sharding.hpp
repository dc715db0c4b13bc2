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
#include <utility>

#include "meshlib/core/diagnostics.hpp"
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

namespace core::detail {

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

/// The name of the `K`-th axis of dimension `D` of `Spec`, as a name class of `diag_name`.
template <class Spec, std::size_t D, std::size_t K>
struct spec_axis_name {
  static constexpr std::string_view value = Spec::dims[D].axis(K);
};

template <class Spec, std::size_t D, class Seq = std::make_index_sequence<Spec::dim(D).size()>>
struct diag_spec_entry;
template <class Spec, std::size_t D, std::size_t... K>
struct diag_spec_entry<Spec, D, std::index_sequence<K...>> {
  using type = diagnostic::axes<typename diag_name<spec_axis_name<Spec, D, K>>::axis...>;
};
template <class Spec, class Seq = std::make_index_sequence<Spec::size>>
struct diag_spec_impl;
template <class Spec, std::size_t... D>
struct diag_spec_impl<Spec, std::index_sequence<D...>> {
  using type = diagnostic::spec<typename diag_spec_entry<Spec, D>::type...>;
};
/// A partition spec spelled out for a diagnostic: `spec<axes<axis<'d','a','t','a'>>, axes<>>`.
template <class Spec>
using diag_spec_t = typename diag_spec_impl<Spec>::type;

// The diagnostics below name the offending axis and spec in their failing condition (see
// core/diagnostics.hpp): one error on GCC and Clang.
template <class Axis, class Spec, class MeshAxes>
consteval bool spec_names_axis_not_in_mesh() {
  static_assert(always_false<Axis, Spec, MeshAxes>,
                "meshlib: named_sharding: the partition spec names an axis that the mesh does not have (the axis, "
                "the spec and the mesh's axes are spelled out in the condition); add the axis to the mesh or fix its "
                "name in the spec");
  return false;
}

template <class Spec>
consteval bool spec_uses_an_axis_twice() {
  static_assert(always_false<Spec>,
                "meshlib: named_sharding: the partition spec uses a mesh axis twice; a mesh axis can split at most "
                "one dimension, once");
  return false;
}

template <class Rank, class Spec>
consteval bool spec_longer_than_rank() {
  static_assert(always_false<Rank, Spec>,
                "meshlib: the partition spec has more entries than the tensor has dimensions; drop the extra entries");
  return false;
}

/// True when `Spec` fits `Mesh`; otherwise fires the one diagnostic and returns false.
template <class Mesh, class Spec>
consteval bool diagnose_sharding() {
  constexpr auto bad = first_unknown_axis<Mesh, Spec>();
  if constexpr (bad.first < Spec::size) {
    return spec_names_axis_not_in_mesh<typename diag_name<spec_axis_name<Spec, bad.first, bad.second>>::axis,
                                       diag_spec_t<Spec>, diag_axes_t<Mesh, Mesh::all_axes>>();
  } else if constexpr (has_repeated_axis<Spec>()) {
    return spec_uses_an_axis_twice<diag_spec_t<Spec>>();
  } else {
    return true;
  }
}

}  // namespace core::detail

namespace experimental {
/// The one compile-time check of a (mesh, spec, rank) triple, fired as a single diagnostic; entry points above core call it first.
using core::detail::diagnose_sharding;
}  // namespace experimental

namespace diagnostic {
/// A partition spec spelled out for an error message: `spec<axes<axis<..."data"...>>, axes<>>`.
template <class Spec>
using spec_t = core::detail::diag_spec_t<Spec>;
}  // namespace diagnostic

/// @brief A partition spec `Spec` bound to a mesh of type `Mesh`.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// meshlib::named_sharding<mesh_t, meshlib::P<"data", none>> s{mesh_t{2, 4}};
/// @endcode
template <mesh_type Mesh, partition_spec_type Spec>
class named_sharding {
  static_assert(core::detail::diagnosed(core::detail::diagnose_sharding<Mesh, Spec>()));

 public:
  /// Tag that opts the sharding into the `sharding_type` concept.
  using is_named_sharding = void;
  /// The mesh the sharding places blocks on.
  using mesh_type = Mesh;
  /// The partition spec: which mesh axes each array dimension is split over.
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
    // True either way: a spec that is too long fires its one diagnostic here, and the
    // static_assert(check_rank<R>()) of every caller stays quiet.
    if constexpr (Spec::size <= Rank) return true;
    else return core::detail::diagnosed(core::detail::spec_longer_than_rank<diagnostic::size<Rank>, core::detail::diag_spec_t<Spec>>());
  }

  named_sharding() requires(Mesh::num_dynamic == 0) = default;
  /// @brief The sharding of `Spec` over `mesh`; `rule` says how an extent the axes do not divide is split (see `shard_rule`).
  explicit named_sharding(Mesh mesh, shard_rule rule = shard_rule::even) : mesh_(mesh), rule_(rule) {}

  /// The mesh the blocks lie on.
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }
  /// How an extent that the axis size does not divide is split.
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

  /// Equal when the meshes and rules are equal (the spec is part of the type).
  friend bool operator==(const named_sharding& a, const named_sharding& b) noexcept {
    return a.mesh_ == b.mesh_ && a.rule_ == b.rule_;
  }
  /// Prints `named_sharding(mesh{'data': 2}, P<"data">)`.
  friend std::ostream& operator<<(std::ostream& os, const named_sharding& s) {
    return os << "named_sharding(" << s.mesh_ << ", " << Spec{} << (s.rule_ == shard_rule::uneven ? ", uneven" : "")
              << ')';
  }
  /// The sharding as printed by `operator<<`: the spec and the mesh.
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
