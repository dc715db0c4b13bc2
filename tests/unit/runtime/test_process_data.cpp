// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Per-process data loading: the rows each process reads, and the split of those rows into its
// devices' shards, checked against the global array element by element for several meshes,
// specs and process sizes.
#include <meshlib/runtime/process_data.hpp>

#include <array>
#include <numeric>
#include <set>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace dist = meshlib::distributed;
using meshlib::axis;
using meshlib::mesh;
using meshlib::named_sharding;
using meshlib::none;
using meshlib::P;

namespace {

/// Checks process_rows and split_process_local_data for every process of a run of
/// `layout.num_devices() / t` processes with `t` devices each, against the global array
/// g(i, j) = i * cols + j.
template <class Layout>
void check_all_processes(const Layout& layout, std::size_t t) {
  const auto g = layout.global_shape();
  const std::size_t rows = g[0], cols = g[1];
  const std::size_t procs = layout.num_devices() / t;
  std::set<std::size_t> covered;
  for (std::size_t p = 0; p < procs; ++p) {
    const auto ranges = dist::process_rows(layout, p, t);
    // Sorted, disjoint, non-adjacent, and exactly the rows this process's devices hold.
    std::set<std::size_t> expected_rows;
    for (std::size_t k = 0; k < t; ++k) {
      const auto b = layout.block_of(p * t + k);
      for (std::size_t r = b.offset[0]; r < b.offset[0] + b.extent[0]; ++r) expected_rows.insert(r);
    }
    std::set<std::size_t> got_rows;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      CHECK(ranges[i].begin < ranges[i].end);
      if (i) CHECK(ranges[i - 1].end < ranges[i].begin);
      for (std::size_t r = ranges[i].begin; r < ranges[i].end; ++r) got_rows.insert(r);
    }
    CHECK(got_rows == expected_rows);
    covered.insert(got_rows.begin(), got_rows.end());

    // The process reads its rows (whole rows), then splits them into its devices' shards.
    std::vector<long> local;
    for (const auto& r : ranges)
      for (std::size_t i = r.begin; i < r.end; ++i)
        for (std::size_t j = 0; j < cols; ++j) local.push_back(static_cast<long>(i * cols + j));
    const auto shards = dist::split_process_local_data<long>(layout, local, p, t);
    REQUIRE(shards.size() == t);
    for (std::size_t k = 0; k < t; ++k) {
      const auto b = layout.block_of(p * t + k);
      REQUIRE(shards[k].size() == b.size());
      std::size_t n = 0;
      for (std::size_t i = 0; i < b.extent[0]; ++i)
        for (std::size_t j = 0; j < b.extent[1]; ++j)
          CHECK(shards[k][n++] == static_cast<long>((b.offset[0] + i) * cols + b.offset[1] + j));
    }
  }
  CHECK(covered.size() == rows);
}

}  // namespace

TEST_CASE("data parallel: each process reads its contiguous share of the batch", "[runtime][data]") {
  using mesh_t = mesh<axis<"data">>;
  const named_sharding<mesh_t, P<"data">> s{mesh_t{8}};
  const meshlib::shard_layout layout{s, std::array<std::size_t, 2>{32, 3}};
  // 4 processes x 2 devices: process p reads rows [8p, 8p+8), like ds.shard(4, p).
  for (std::size_t p = 0; p < 4; ++p)
    CHECK(dist::process_rows(layout, p, 2) == std::vector<dist::row_range>{{8 * p, 8 * p + 8}});
  check_all_processes(layout, 2);
  check_all_processes(layout, 1);
  check_all_processes(layout, 8);
}

TEST_CASE("data x model: replicas over the in-process axis read the same rows once", "[runtime][data]") {
  using mesh_t = mesh<axis<"data">, axis<"model">>;
  const named_sharding<mesh_t, P<"data", "model">> s{mesh_t{2, 4}};
  const meshlib::shard_layout layout{s, std::array<std::size_t, 2>{6, 8}};
  // Processes of 4 devices: each holds one data row-block, split over model columns.
  CHECK(dist::process_rows(layout, 0, 4) == std::vector<dist::row_range>{{0, 3}});
  CHECK(dist::process_rows(layout, 1, 4) == std::vector<dist::row_range>{{3, 6}});
  check_all_processes(layout, 4);
  check_all_processes(layout, 2);
  check_all_processes(layout, 1);
}

TEST_CASE("a batch split over an axis inside the process gives non-contiguous rows", "[runtime][data]") {
  using mesh_t = mesh<axis<"a">, axis<"b">, axis<"c">>;
  // Rows split over (c, a): c is minor in the device order but major in the spec.
  const named_sharding<mesh_t, P<meshlib::axes("c", "a")>> s{mesh_t{2, 2, 2}};
  const meshlib::shard_layout layout{s, std::array<std::size_t, 2>{8, 2}};
  // Process 0 with 2 devices holds (a0,b0,c0) -> shard 0 and (a0,b0,c1) -> shard 2.
  CHECK(dist::process_rows(layout, 0, 2) == std::vector<dist::row_range>{{0, 2}, {4, 6}});
  check_all_processes(layout, 2);
  check_all_processes(layout, 4);
}

TEST_CASE("uneven batches leave trailing processes fewer or no rows", "[runtime][data]") {
  using mesh_t = mesh<axis<"data">>;
  const named_sharding<mesh_t, P<"data">> s{mesh_t{4}, meshlib::shard_rule::uneven};
  const meshlib::shard_layout layout{s, std::array<std::size_t, 2>{5, 2}};
  CHECK(dist::process_rows(layout, 0, 1) == std::vector<dist::row_range>{{0, 2}});
  CHECK(dist::process_rows(layout, 2, 1) == std::vector<dist::row_range>{{4, 5}});
  CHECK(dist::process_rows(layout, 3, 1).empty());
  check_all_processes(layout, 1);
  check_all_processes(layout, 2);
}

TEST_CASE("wrong process-local data is rejected", "[runtime][data]") {
  using mesh_t = mesh<axis<"data">>;
  const named_sharding<mesh_t, P<"data">> s{mesh_t{4}};
  const meshlib::shard_layout layout{s, std::array<std::size_t, 2>{8, 2}};
  std::vector<int> too_short(3);
  REQUIRE_THROWS_AS(dist::split_process_local_data<int>(layout, too_short, 0, 2), meshlib::sharding_error);
  REQUIRE_THROWS_AS(dist::process_rows(layout, 2, 2), meshlib::mesh_error);
}

TEST_CASE("defaults use this process's index and device count", "[runtime][data]") {
  dist::options o;
  o.process_id = 1;
  o.num_processes = 2;
  o.local_device_count = 2;
  o.env = dist::map_env({});
  dist::guard g(o);
  using mesh_t = mesh<axis<"data">>;
  const named_sharding<mesh_t, P<"data">> s{mesh_t{4}};
  const meshlib::shard_layout layout{s, std::array<std::size_t, 1>{8}};
  CHECK(dist::process_rows(layout) == std::vector<dist::row_range>{{4, 8}});
  std::vector<float> mine{4, 5, 6, 7};
  const auto shards = dist::split_process_local_data<float>(layout, mine);
  CHECK(shards == std::vector<std::vector<float>>{{4, 5}, {6, 7}});
}

}  // namespace MESHLIB_TEST_UNIT
