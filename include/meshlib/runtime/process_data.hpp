// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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

#include "meshlib/core/errors.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/runtime/distributed.hpp"

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

/// @brief The global rows (dimension 0) this process's devices hold, merged into ranges: what it must load.
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

/// @brief Splits the rows this process loaded (`process_rows`, row-major) into one block per local device.
template <class T, sharding_type S, std::size_t Rank>
std::vector<std::vector<T>> split_process_local_data(const shard_layout<S, Rank>& layout, std::span<const T> local) {
  return split_process_local_data<T>(layout, local, process_index(), local_device_count());
}

}  // namespace meshlib::distributed
