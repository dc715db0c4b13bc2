// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#include <algorithm>
#include <set>
#include <sstream>
#include <string>

#include "meshlib/core.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {
using mesh_2d = mesh<axis<"data">, axis<"model">>;
using mesh_3d = mesh<axis<"a">, axis<"b">, axis<"c">>;

using meshlib_test::message_of;
}  // namespace

TEST_CASE("mesh numbers devices row-major, the last axis fastest", "[core][mesh]") {
  const mesh_3d m{2, 3, 4};
  REQUIRE(m.size() == 24);
  std::size_t expected = 0;
  for (std::size_t a = 0; a < 2; ++a)
    for (std::size_t b = 0; b < 3; ++b)
      for (std::size_t c = 0; c < 4; ++c, ++expected) {
        const std::array<std::size_t, 3> coord{a, b, c};
        CHECK(m.device_at(coord) == expected);
        CHECK(m.coords(expected) == coord);
      }
}

TEST_CASE("mesh names and positions of axes", "[core][mesh]") {
  STATIC_REQUIRE(mesh_2d::ndim == 2);
  STATIC_REQUIRE(mesh_2d::axis_position<"data"> == 0);
  STATIC_REQUIRE(mesh_2d::axis_position<"model"> == 1);
  STATIC_REQUIRE(mesh_2d::has_axis<"model">);
  STATIC_REQUIRE(!mesh_2d::has_axis<"pipe">);
  STATIC_REQUIRE(mesh_2d::mask_of<"model">() == 2u);
  STATIC_REQUIRE(mesh_2d::mask_of<"data", "model">() == 3u);
  const mesh_2d m{2, 4};
  CHECK(m.axis_size<"data">() == 2);
  CHECK(m.axis_size<"model">() == 4);
  std::ostringstream os;
  os << m;
  CHECK(os.str() == "mesh{'data': 2, 'model': 4}");
}

TEST_CASE("static and dynamic axis sizes share one code path", "[core][mesh]") {
  using mixed = mesh<axis<"data", 2>, axis<"model">>;
  const mixed only_dynamic{3};
  const mixed all_given{2, 3};
  CHECK(only_dynamic == all_given);
  CHECK(only_dynamic.size() == 6);
  using all_static = mesh<axis<"x", 2>, axis<"y", 2>>;
  constexpr all_static s{};
  STATIC_REQUIRE(s.size() == 4);
  STATIC_REQUIRE(s.coords(3)[0] == 1);
  const auto msg = message_of<mesh_error>([] { mixed bad{4, 3}; });
  CHECK(msg == "meshlib: axis 'data' has static size 2 but was given size 4");
}

TEST_CASE("mesh rejects zero-sized axes and wrong device counts", "[core][mesh]") {
  CHECK(message_of<mesh_error>([] { mesh_2d bad{2, 0}; }) ==
        "meshlib: axis 'model' has size 0; every mesh axis needs at least one device");
  CHECK(message_of<mesh_error>([] { (void)make_mesh<axis<"data">, axis<"model">>(8, 2, 3); }) ==
        "meshlib: mesh mesh{'data': 2, 'model': 3} has 6 devices but 8 devices are available; choose axis sizes "
        "whose product is 8");
  CHECK_NOTHROW(make_mesh<axis<"data">, axis<"model">>(8, 2, 4));
}

// Law: for every device and every subset of axes, the group is exactly the devices that agree with
// it on every other axis, ordered by their coordinates over the subset (row-major), and group_rank /
// group_color place it consistently.
TEST_CASE("device groups along every subset of axes", "[core][mesh]") {
  const mesh_3d m{2, 3, 2};
  for (axis_mask mask = 0; mask <= mesh_3d::all_axes; ++mask) {
    std::set<std::size_t> colors;
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      const auto g = m.group(dev, mask);
      std::vector<std::size_t> expected;
      for (std::size_t other = 0; other < m.size(); ++other) {
        bool same = true;
        for (std::size_t i = 0; i < 3; ++i)
          if (!(mask & (1u << i)) && m.coords(other)[i] != m.coords(dev)[i]) same = false;
        if (same) expected.push_back(other);
      }
      // Mesh order is row-major, so sorting by device id is sorting by coordinates over the subset.
      REQUIRE(g == expected);
      REQUIRE(g[m.group_rank(dev, mask)] == dev);
      for (auto member : g) REQUIRE(m.group_color(member, mask) == m.group_color(dev, mask));
      colors.insert(m.group_color(dev, mask));
    }
    CHECK(colors.size() == m.size() / m.axes_size(mask));
  }
  CHECK(m.group<"b">(3) == std::vector<std::size_t>{1, 3, 5});
  CHECK(m.group<"a", "c">(3) == std::vector<std::size_t>{2, 3, 8, 9});
}

}  // namespace MESHLIB_TEST_UNIT
