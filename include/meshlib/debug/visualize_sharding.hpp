// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief A text picture of which devices hold which block of a global array, in the spirit of
/// `jax.debug.visualize_array_sharding`: 1-D and 2-D arrays as a grid of blocks, arrays of higher
/// rank as a table with one row per device (its coordinates and its block).
///
/// @code
/// std::cout << meshlib::visualize_sharding(sharding, std::array<std::size_t, 2>{4, 8});
/// // +-------------+-------------+
/// // |  dev 0,1    |  dev 2,3    |   <- devices that hold the block (replicas)
/// // | [0:4, 0:4]  | [0:4, 4:8]  |   <- the block, in NumPy slice notation
/// // +-------------+-------------+
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/core/shard_layout.hpp"

namespace meshlib {

namespace debug::detail {

/// Rank 3 and up: one row per device, `device | coordinates | block`.
template <sharding_type S, std::size_t Rank>
std::string block_table(const S& sharding, const shard_layout<S, Rank>& layout) {
  using Mesh = typename S::mesh_type;
  const auto& m = sharding.mesh();
  std::vector<std::array<std::string, 3>> rows{{"device", "coords", "block"}};
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    std::string coords;
    const auto c = m.coords(dev);
    for (std::size_t a = 0; a < Mesh::ndim; ++a)
      coords += (a ? ", " : "") + std::string(Mesh::axis_names[a]) + "=" + std::to_string(c[a]);
    std::ostringstream os;
    os << layout.block_of(dev);
    rows.push_back({std::to_string(dev), coords, os.str()});
  }
  std::array<std::size_t, 3> w{};
  for (const auto& r : rows)
    for (std::size_t k = 0; k < 3; ++k) w[k] = std::max(w[k], r[k].size());
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t k = 0; k < 3; ++k) line += (k ? " | " : "") + r[k] + std::string(w[k] - r[k].size(), ' ');
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace debug::detail

/// @brief Renders the blocks of a global array of shape `global_shape` under `sharding`. 1-D and
/// 2-D: one cell per block (rows: blocks of dimension 0; columns: blocks of dimension 1), each
/// naming the devices that hold it and its slice of the global array. Rank 3 and up: one row per
/// device with its mesh coordinates and its block.
/// @throws sharding_error as `shard_layout` does for a shape the sharding's rule cannot split.
template <sharding_type S, std::size_t Rank>
std::string visualize_sharding(const S& sharding, const std::array<std::size_t, Rank>& global_shape) {
  static_assert(Rank >= 1, "meshlib: visualize_sharding draws arrays of rank 1 and up");
  const shard_layout<S, Rank> layout(sharding, global_shape);
  if constexpr (Rank > 2) {
    return debug::detail::block_table(sharding, layout);
  } else {
  const std::size_t rows = Rank == 2 ? sharding.num_shards(0) : 1;
  const std::size_t cols = sharding.num_shards(Rank - 1);

  std::vector<std::vector<std::string>> devs(rows, std::vector<std::string>(cols));
  std::vector<std::vector<std::string>> slices(rows, std::vector<std::string>(cols));
  for (std::size_t dev = 0; dev < sharding.mesh().size(); ++dev) {
    const std::size_t r = Rank == 2 ? sharding.shard_index(dev, 0) : 0;
    const std::size_t c = sharding.shard_index(dev, Rank - 1);
    devs[r][c] += (devs[r][c].empty() ? "dev " : ",") + std::to_string(dev);
    if (slices[r][c].empty()) {
      const auto b = layout.block_of(dev);
      std::ostringstream os;
      os << b;
      slices[r][c] = b.size() == 0 && global_shape[Rank - 1] != 0 ? "(empty)" : os.str();
    }
  }
  std::size_t width = 0;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) width = std::max({width, devs[r][c].size(), slices[r][c].size()});
  width += 2;

  std::string rule = "+";
  for (std::size_t c = 0; c < cols; ++c) rule += std::string(width, '-') + "+";
  rule += '\n';
  auto cell = [width](const std::string& s) { return " " + s + std::string(width - 1 - s.size(), ' ') + "|"; };
  std::string out = rule;
  for (std::size_t r = 0; r < rows; ++r) {
    std::string a = "|", b = "|";
    for (std::size_t c = 0; c < cols; ++c) {
      a += cell(devs[r][c]);
      b += cell(slices[r][c]);
    }
    out += a + "\n" + b + "\n" + rule;
  }
  return out;
  }
}

}  // namespace meshlib
