// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief A text picture of which devices hold which block of a 1-D or 2-D global array, in the
/// spirit of `jax.debug.visualize_array_sharding`.
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

/// @brief Renders the blocks of a global array of shape `global_shape` under `sharding`: one cell
/// per block (rows: blocks of dimension 0; columns: blocks of dimension 1), each naming the devices
/// that hold it and its slice of the global array.
/// @throws sharding_error as `shard_layout` does for a shape the sharding's rule cannot split.
template <sharding_type S, std::size_t Rank>
std::string visualize_sharding(const S& sharding, const std::array<std::size_t, Rank>& global_shape) {
  static_assert(Rank == 1 || Rank == 2, "meshlib: visualize_sharding draws 1-D and 2-D arrays only");
  const shard_layout<S, Rank> layout(sharding, global_shape);
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

}  // namespace meshlib
