// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#include <array>
#include <string>
#include <vector>

#include "meshlib/core.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {
using mesh_2d = mesh<axis<"data">, axis<"model">>;
using shape2 = std::array<std::size_t, 2>;

using meshlib_test::message_of;
}  // namespace

TEST_CASE("even layout of a 2-D array over a 2x4 mesh", "[core][layout]") {
  const named_sharding<mesh_2d, P<"data", "model">> s{mesh_2d{2, 4}};
  const shard_layout layout{s, shape2{6, 8}};
  for (std::size_t dev = 0; dev < 8; ++dev) {
    const auto b = layout.block_of(dev);
    CHECK(b.offset == shape2{3 * (dev / 4), 2 * (dev % 4)});
    CHECK(b.extent == shape2{3, 2});
    CHECK(layout.replicas(dev) == std::vector<std::size_t>{dev});
  }
  CHECK(global_shape_from_local(s, shape2{3, 2}) == shape2{6, 8});
}

TEST_CASE("replicated axes give replica groups", "[core][layout]") {
  const named_sharding<mesh_2d, P<none, "model">> s{mesh_2d{2, 4}};
  const shard_layout layout{s, shape2{5, 8}};
  CHECK(layout.replicas(6) == std::vector<std::size_t>{2, 6});
  CHECK(layout.block_of(2) == layout.block_of(6));
  CHECK(layout.owners(shape2{4, 7}) == std::vector<std::size_t>{3, 7});
}

TEST_CASE("uneven rule: ceil-div blocks, trailing ones smaller or empty", "[core][layout]") {
  const named_sharding<mesh_2d, P<axes("data", "model")>> s{mesh_2d{2, 4}, shard_rule::uneven};
  const shard_layout layout{s, std::array<std::size_t, 1>{10}};
  // ceil(10 / 8) = 2: blocks of 2, 2, 2, 2, 2, then three empty ones, as torch.chunk.
  const std::vector<std::size_t> ext{2, 2, 2, 2, 2, 0, 0, 0};
  for (std::size_t dev = 0; dev < 8; ++dev) CHECK(layout.block_of(dev).extent[0] == ext[dev]);
  CHECK(layout.block_of(7).offset[0] == 10);
  CHECK(layout.max_local_shape()[0] == 2);
}

TEST_CASE("even rule rejects an indivisible dimension, naming dimension, axis and sizes", "[core][layout]") {
  const named_sharding<mesh_2d, P<"data", "model">> s{mesh_2d{2, 4}};
  CHECK(message_of<sharding_error>([&] { shard_layout layout{s, shape2{6, 10}}; }) ==
        "meshlib: dimension 1 of global shape (6, 10) has size 10, which is not divisible by the 4 shards of axis "
        "'model' (size 4) in P<\"data\", \"model\">; use a size divisible by 4 or shard_rule::uneven");
  const named_sharding<mesh_2d, P<axes("data", "model")>> multi{mesh_2d{2, 4}};
  CHECK(message_of<sharding_error>([&] { shard_layout layout{multi, std::array<std::size_t, 1>{12}}; }) ==
        "meshlib: dimension 0 of global shape (12,) has size 12, which is not divisible by the 8 shards of axes "
        "'data' x 'model' (sizes 2 x 4) in P<axes(\"data\", \"model\")>; use a size divisible by 8 or "
        "shard_rule::uneven");
}

TEST_CASE("global shape from every device's local shape", "[core][layout]") {
  const named_sharding<mesh_2d, P<"model">> s{mesh_2d{2, 2}, shard_rule::uneven};
  std::vector<std::array<std::size_t, 1>> locals{{3}, {2}, {3}, {2}};
  CHECK(global_shape_from_locals<decltype(s), 1>(s, locals)[0] == 5);

  std::vector<std::array<std::size_t, 1>> replicas_disagree{{3}, {2}, {2}, {2}};
  CHECK(message_of<sharding_error>([&] { (void)global_shape_from_locals<decltype(s), 1>(s, replicas_disagree); }) ==
        "meshlib: devices 0 and 2 hold the same block of dimension 0 but report sizes 3 and 2");

  std::vector<std::array<std::size_t, 1>> against_rule{{1}, {3}, {1}, {3}};
  CHECK(message_of<sharding_error>([&] { (void)global_shape_from_locals<decltype(s), 1>(s, against_rule); }) ==
        "meshlib: dimension 0 split over axis 'model' (size 2): shard 0 (device 0) has size 1, but a global size "
        "of 4 under the uneven rule gives 2");

  const named_sharding<mesh_2d, P<"model">> even{mesh_2d{2, 2}};
  CHECK(message_of<sharding_error>([&] { (void)global_shape_from_locals<decltype(even), 1>(even, locals); }) ==
        "meshlib: dimension 0 split over axis 'model' (size 2): shard 0 (device 0) has size 3, but a global size "
        "of 5 under the even rule gives no even split");
  std::vector<std::array<std::size_t, 1>> too_few{{3}};
  CHECK(message_of<sharding_error>([&] { (void)global_shape_from_locals<decltype(even), 1>(even, too_few); }) ==
        "meshlib: global_shape_from_locals needs one local shape per device: the mesh mesh{'data': 2, 'model': 2} "
        "has 4 devices, 1 shapes were given");
}

namespace {
/// Checks `block::global_index` and `block::for_each_global_run` on every element of every
/// device's block of `layout` against the coordinates walked by hand, and that every global
/// element is hit by exactly the devices `owners` names.
template <class Layout>
void check_global_indices(const Layout& layout) {
  const auto shape = layout.global_shape();
  std::size_t total = 1;
  for (auto e : shape) total *= e;
  std::vector<std::size_t> hits(total, 0);
  for (std::size_t dev = 0; dev < layout.num_devices(); ++dev) {
    const auto b = layout.block_of(dev);
    auto idx = b.offset;  // the global coordinate of block element i, walked row-major
    for (std::size_t i = 0; i < b.size(); ++i) {
      std::size_t flat = 0;
      for (std::size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + idx[d];
      CHECK(b.global_index(shape, i) == flat);
      ++hits[flat];
      for (std::size_t d = shape.size(); d-- > 0;) {
        if (++idx[d] < b.offset[d] + b.extent[d]) break;
        idx[d] = b.offset[d];
      }
    }
    // Runs over every window of the block: contiguous in both arrays, covering the window in order.
    for (std::size_t first = 0; first <= b.size(); ++first)
      for (std::size_t len = 0; first + len <= b.size(); len += 3) {
        std::size_t next = first;
        b.for_each_global_run(shape, first, len, [&](std::size_t k, std::size_t g, std::size_t n) {
          CHECK(k == next);
          CHECK(n > 0);
          for (std::size_t j = 0; j < n; ++j) CHECK(b.global_index(shape, k + j) == g + j);
          next += n;
        });
        CHECK(next == first + len);
      }
  }
  for (std::size_t g = 0; g < total; ++g) CHECK(hits[g] == layout.replicas(0).size());
}
}  // namespace

TEST_CASE("block::global_index and for_each_global_run agree with the block's coordinates", "[core][layout]") {
  const mesh_2d m{2, 4};
  check_global_indices(shard_layout{named_sharding<mesh_2d, P<"data", "model">>{m}, shape2{6, 8}});
  check_global_indices(shard_layout{named_sharding<mesh_2d, P<"model", "data">>{m}, shape2{4, 6}});
  check_global_indices(shard_layout{named_sharding<mesh_2d, P<none, "model">>{m}, shape2{3, 8}});
  check_global_indices(shard_layout{named_sharding<mesh_2d, P<"model", none>>{m, shard_rule::uneven}, shape2{7, 5}});
  check_global_indices(
      shard_layout{named_sharding<mesh_2d, P<axes("data", "model")>>{m, shard_rule::uneven}, std::array<std::size_t, 1>{10}});
  check_global_indices(shard_layout{named_sharding<mesh_2d, P<none, "data", "model">>{m, shard_rule::uneven},
                                    std::array<std::size_t, 3>{2, 3, 9}});
  // The block's own rule: a run stops at the end of a row of the block, not of the global array.
  const block<2> b{{1, 2}, {2, 3}};
  std::vector<std::array<std::size_t, 3>> runs;
  b.for_each_global_run(shape2{4, 8}, 1, 5, [&](std::size_t k, std::size_t g, std::size_t n) { runs.push_back({k, g, n}); });
  CHECK(runs == std::vector<std::array<std::size_t, 3>>{{1, 11, 2}, {3, 18, 3}});
}

}  // namespace MESHLIB_TEST_UNIT
