// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Sub-communicators along mesh axes: for every device and every subset of axes, the communicator
// holds exactly the device's group, ranked in the group's stable order.
#include <vector>

#include "comm_test_support.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace comm_test;
using meshlib::thread_communicator;

TEST_CASE("axis_communicators: every device, every subset of axes", "[comm][axes][repeat]") {
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">, meshlib::axis<"pipe">>;
  const mesh_t m{2, 3, 2};
  const int n = static_cast<int>(m.size());
  // For each device and mask: (rank, size, gathered device ids) as the communicator saw them.
  struct seen {
    int rank = -1, size = -1;
    std::vector<std::int64_t> members;
  };
  std::vector<std::vector<seen>> got(static_cast<std::size_t>(n), std::vector<seen>(8));
  std::vector<int> cached(static_cast<std::size_t>(n));
  meshlib::run_on_threads(n, [&](thread_communicator& world) {
    meshlib::axis_communicators axes(world, m);
    for (int pass = 0; pass < 2; ++pass)  // the second pass uses the cached communicators
      for (meshlib::axis_mask mask = 0; mask < 8; ++mask) {
        auto& c = axes.over(mask);
        std::int64_t me = world.rank();
        std::vector<std::int64_t> all(static_cast<std::size_t>(c.size()));
        c.all_gather(std::span<const std::int64_t>(&me, 1), std::span<std::int64_t>(all));
        got[static_cast<std::size_t>(world.rank())][mask] = {c.rank(), c.size(), all};
      }
    cached[static_cast<std::size_t>(world.rank())] = &axes.over<"model">() == &axes.over(mesh_t::mask_of<"model">());
  });
  for (int d = 0; d < n; ++d) CHECK(cached[static_cast<std::size_t>(d)] == 1);
  for (int d = 0; d < n; ++d)
    for (meshlib::axis_mask mask = 0; mask < 8; ++mask) {
      INFO("device " << d << ", mask " << mask);
      const auto group = m.group(static_cast<std::size_t>(d), mask);
      const auto& s = got[static_cast<std::size_t>(d)][mask];
      CHECK(s.size == static_cast<int>(group.size()));
      CHECK(s.rank == static_cast<int>(m.group_rank(static_cast<std::size_t>(d), mask)));
      std::vector<std::int64_t> expected(group.begin(), group.end());
      CHECK(s.members == expected);
    }
}

TEST_CASE("axis_communicators: psum over one axis of a 2x2 mesh", "[comm][axes]") {
  meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">> m{2, 2};
  std::vector<float> got(4);
  meshlib::run_on_threads(4, [&](thread_communicator& world) {
    meshlib::axis_communicators axes(world, m);
    float x = 1.0f + static_cast<float>(world.rank());
    axes.over<"data">().all_reduce(std::span<float>(&x, 1), reduce_op::sum);
    got[static_cast<std::size_t>(world.rank())] = x;
  });
  // data groups: {0, 2} and {1, 3}
  CHECK(got == std::vector<float>{4, 6, 4, 6});
  std::vector<int> refused(2);
  meshlib::run_on_threads(2, [&](thread_communicator& world) {
    try {
      meshlib::axis_communicators axes(world, m);  // 2 ranks, 4 devices
    } catch (const meshlib::comm_argument_error&) {
      refused[static_cast<std::size_t>(world.rank())] = 1;
    }
  });
  CHECK(refused == std::vector<int>{1, 1});
}

TEST_CASE("axis_communicators: a group of every device is the world communicator, no split", "[comm][axes]") {
  // (4, 1, 1): the data group holds every device; the model group is each device alone. An NCCL
  // split costs a communicator's creation, so the whole-mesh group must not be split.
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">, meshlib::axis<"pipe">>;
  const mesh_t m{4, 1, 1};
  std::vector<int> is_world(4), data_ranks(4), model_sizes(4);
  meshlib::run_on_threads(4, [&](thread_communicator& world) {
    meshlib::axis_communicators axes(world, m);
    const auto r = static_cast<std::size_t>(world.rank());
    is_world[r] = &axes.over<"data">() == &world && &axes.over<"data", "pipe">() == &world;
    data_ranks[r] = axes.over<"data">().rank();
    model_sizes[r] = axes.over<"model">().size();
  });
  CHECK(is_world == std::vector<int>{1, 1, 1, 1});
  CHECK(data_ranks == std::vector<int>{0, 1, 2, 3});
  CHECK(model_sizes == std::vector<int>{1, 1, 1, 1});
}

}  // namespace MESHLIB_TEST_UNIT
