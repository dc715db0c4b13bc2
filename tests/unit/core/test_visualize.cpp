// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#include <array>
#include <string>

#include "meshlib/core.hpp"
#include "meshlib/debug.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {
using mesh_2d = mesh<axis<"data">, axis<"model">>;
}

TEST_CASE("visualize_sharding draws a 2-D array's blocks and their devices", "[core][debug]") {
  const named_sharding<mesh_2d, P<"model", "data">> s{mesh_2d{2, 2}};
  CHECK(visualize_sharding(s, std::array<std::size_t, 2>{4, 8}) ==
        "+------------+------------+\n"
        "| dev 0      | dev 2      |\n"
        "| [0:2, 0:4] | [0:2, 4:8] |\n"
        "+------------+------------+\n"
        "| dev 1      | dev 3      |\n"
        "| [2:4, 0:4] | [2:4, 4:8] |\n"
        "+------------+------------+\n");
}

TEST_CASE("visualize_sharding shows replicas and empty uneven blocks", "[core][debug]") {
  const named_sharding<mesh_2d, P<"model">> s{mesh_2d{2, 3}, shard_rule::uneven};
  CHECK(visualize_sharding(s, std::array<std::size_t, 1>{4}) ==
        "+---------+---------+---------+\n"
        "| dev 0,3 | dev 1,4 | dev 2,5 |\n"
        "| [0:2]   | [2:4]   | (empty) |\n"
        "+---------+---------+---------+\n");
}

}  // namespace MESHLIB_TEST_UNIT
