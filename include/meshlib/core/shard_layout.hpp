// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/core/checked_size.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"

namespace meshlib {

/// @brief A rectangular block of a global array: an offset and an extent per dimension.
template <std::size_t Rank>
struct block {
  /// Where the block starts in the global array, per dimension.
  std::array<std::size_t, Rank> offset{};
  /// The block's size per dimension.
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
  /// The global row-major index, in an array of shape `global_shape`, of element `i` of the block
  /// (the block's own elements counted row-major, as its storage holds them).
  /// @pre `i < size()` and the block lies inside `global_shape`.
  /// @post `contains(g)` for the coordinate `g` of the result, and distinct `i` give distinct results.
  [[nodiscard]] constexpr std::size_t global_index(const std::array<std::size_t, Rank>& global_shape,
                                                   std::size_t i) const noexcept {
    std::array<std::size_t, Rank> g{};
    for (std::size_t d = Rank; d-- > 0;) {
      g[d] = offset[d] + i % extent[d];
      i /= extent[d];
    }
    std::size_t flat = 0;
    for (std::size_t d = 0; d < Rank; ++d) flat = flat * global_shape[d] + g[d];
    return flat;
  }
  /// Calls `f(k, g, n)` for the runs of the block's elements `[first, first + len)` that are
  /// contiguous in the global row-major array of shape `global_shape`: block elements `k` to `k + n`
  /// (exclusive) are global elements `g` to `g + n`. A run never crosses a row of the last dimension, so a copy
  /// between a block and its global array is one `copy_n` per run (checkpoints, gathers).
  /// @pre `first + len <= size()`.
  template <class F>
  constexpr void for_each_global_run(const std::array<std::size_t, Rank>& global_shape, std::size_t first,
                                     std::size_t len, F&& f) const {
    std::size_t row = len;
    if constexpr (Rank > 0) row = extent[Rank - 1];
    for (std::size_t k = first, end = first + len; k < end;) {
      const std::size_t n = std::min(row - k % row, end - k);
      f(k, global_index(global_shape, k), n);
      k += n;
    }
  }
  /// Blocks are equal when offsets and extents are.
  friend constexpr bool operator==(const block&, const block&) = default;

  /// Prints `[0:4, 2:4]` (NumPy slice notation).
  friend std::ostream& operator<<(std::ostream& os, const block& b) {
    os << '[';
    for (std::size_t d = 0; d < Rank; ++d) os << (d ? ", " : "") << b.offset[d] << ':' << b.offset[d] + b.extent[d];
    return os << ']';
  }
};

namespace core::detail {

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

/// A list of devices as error messages show it: "{2, 3}".
inline std::string describe_devices(std::span<const std::size_t> devices) {
  std::string s = "{";
  for (std::size_t i = 0; i < devices.size(); ++i) s += (i ? ", " : "") + std::to_string(devices[i]);
  return s + "}";
}

}  // namespace core::detail

namespace experimental {
/// The dimension of a spec that an axis splits, or none: the lookup collectives and reshard plans share.
using core::detail::split_dim;

/// Writes the axes a dimension is split over, as a message names them.
using core::detail::describe_dim_axes;

/// Writes a list of device numbers for a message: the one spelling every layer uses.
using core::detail::describe_devices;

/// Writes a shape as `[4, 8]`: how every layer prints an extent in messages.
using core::detail::describe_shape;
}  // namespace experimental

/// @brief A list of devices as meshlib's error messages show it: "{2, 3}" (for the messages of
/// layers above core, and a user's).
using core::detail::describe_devices;

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
  /// A global or local shape: one extent per dimension.
  using shape_type = std::array<std::size_t, Rank>;
  /// The mesh of the sharding.
  using mesh_type = typename S::mesh_type;

  /// @throws sharding_error when a size is negative-converted (above 2^62) or the element count
  /// overflows (naming the dimension and its size), and under `shard_rule::even` when a sharded dimension does not divide
  /// evenly; the message names the dimension, its size, the axes and their sizes.
  shard_layout(const S& sharding, const shape_type& global_shape) : sharding_(sharding), global_(global_shape) {
    core::detail::checked_product(global_, "the global shape");
    for (std::size_t d = 0; d < Rank; ++d) {
      const std::size_t shards = sharding_.num_shards(d);
      if (sharding_.rule() == shard_rule::even && global_[d] % shards != 0) {
        std::ostringstream os;
        os << "meshlib: dimension " << d << " of global shape " << core::detail::describe_shape(global_) << " has size "
           << global_[d] << ", which is not divisible by the " << shards << " shards of "
           << core::detail::describe_dim_axes(sharding_, d) << " in " << typename S::spec_type{}
           << "; use a size divisible by " << shards << " or shard_rule::uneven";
        throw sharding_error(os.str());
      }
    }
  }

  /// The sharding the layout was computed for.
  [[nodiscard]] const S& sharding() const noexcept { return sharding_; }
  /// The shape of the whole (global) array.
  [[nodiscard]] const shape_type& global_shape() const noexcept { return global_; }
  /// The number of devices of the mesh, each with one block.
  [[nodiscard]] std::size_t num_devices() const noexcept { return sharding_.mesh().size(); }

  /// The block device `device` holds.
  [[nodiscard]] block<Rank> block_of(std::size_t device) const noexcept {
    block<Rank> b;
    for (std::size_t d = 0; d < Rank; ++d) {
      const auto [off, ext] = core::detail::split_dim(global_[d], sharding_.num_shards(d), sharding_.shard_index(device, d),
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
    for (std::size_t d = 0; d < Rank; ++d) s[d] = core::detail::split_dim(global_[d], sharding_.num_shards(d), 0, sharding_.rule()).second;
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

/// @brief Deduces the rank from the global shape: `shard_layout{sharding, std::array<std::size_t, 2>{8, 6}}`.
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
      const auto expected = core::detail::split_dim(g[d], shards, i, sharding.rule()).second;
      const bool divisible = sharding.rule() == shard_rule::uneven || g[d] % shards == 0;
      if (!divisible || expected != extent[i]) {
        throw sharding_error("meshlib: dimension " + std::to_string(d) + " split over " +
                             core::detail::describe_dim_axes(sharding, d) + ": shard " + std::to_string(i) + " (device " +
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
