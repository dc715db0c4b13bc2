// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// JAX's names device_put and with_sharding_constraint: each device's block holds exactly the
// elements of the global array its layout says (checked against the host array, element by
// element), the result's type carries the requested sharding, the rule can change, and the errors
// are from_host's and reshard's.
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"
#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {

using mesh2 = mesh<axis<"data">, axis<"model">>;
using meshlib_test::message_of;

constexpr std::array<std::size_t, 2> shape{6, 4};

std::vector<float> host_array() {
  std::vector<float> v(shape[0] * shape[1]);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i * i % 17) - 3.5f;
  return v;
}

/// Every device's block of `t` holds host[r * cols + c] at its global (r, c).
template <class X>
void require_blocks(const X& t, const std::vector<float>& host) {
  for (std::size_t dev = 0; dev < t.num_devices(); ++dev) {
    const auto b = t.block_of(dev);
    const auto& v = t.local(dev);
    REQUIRE(v.extent(0) == b.extent[0]);
    REQUIRE(v.extent(1) == b.extent[1]);
    for (std::size_t r = 0; r < b.extent[0]; ++r)
      for (std::size_t c = 0; c < b.extent[1]; ++c) {
        INFO("device " << dev << ", local (" << r << ", " << c << ")");
        REQUIRE(v(r, c) == host[(b.offset[0] + r) * shape[1] + b.offset[1] + c]);
      }
  }
}

}  // namespace

TEST_CASE("device_put of a host array scatters it as from_host", "[exec][device_put]") {
  const mesh2 m{2, 2};
  const named_sharding<mesh2, P<"data", "model">> tiles{m};
  const auto host = host_array();

  auto x = device_put(host, shape, tiles);
  static_assert(std::is_same_v<decltype(x), sharded_tensor<float, 2, named_sharding<mesh2, P<"data", "model">>>>);
  REQUIRE(x.global_shape() == shape);
  require_blocks(x, host);
  REQUIRE(x.to_host() == host);

  // The span overload, with const elements, gives the same blocks.
  auto y = device_put(std::span<const float>(host), shape, tiles);
  require_blocks(y, host);

  // from_host's check of the element count, with its message.
  const std::vector<float> short_host(5, 1.0f);
  REQUIRE(message_of<sharding_error>([&] { (void)device_put(short_host, shape, tiles); }) ==
          "meshlib: from_host: global shape (6, 4) has 24 elements but the host array has 5");
}

TEST_CASE("device_put of a sharded tensor reshards it, rule included", "[exec][device_put]") {
  const mesh2 m{2, 2};
  const auto host = host_array();
  auto x = device_put(host, shape, named_sharding<mesh2, P<"data", none>>{m});

  // To columns over "model" and rows over "data" swapped: another spec, same array.
  const named_sharding<mesh2, P<"model", "data">> swapped{m};
  auto y = device_put(x, swapped);
  static_assert(std::is_same_v<typename decltype(y)::sharding_type, named_sharding<mesh2, P<"model", "data">>>);
  require_blocks(y, host);

  // Rows over all 4 devices under the uneven rule: 6 rows -> blocks of 2, 2, 2, 0.
  const named_sharding<mesh2, P<axes("data", "model")>> uneven{m, shard_rule::uneven};
  auto z = device_put(x, uneven);
  REQUIRE(z.sharding().rule() == shard_rule::uneven);
  REQUIRE(z.block_of(3).extent[0] == 0);
  REQUIRE(z.block_of(2).offset[0] == 4);
  require_blocks(z, host);

  // Another mesh is refused, as by reshard.
  const mesh2 other{4, 1};
  REQUIRE(message_of<sharding_error>([&] { (void)device_put(x, named_sharding<mesh2, P<"data", none>>{other}); }) ==
          "meshlib: reshard from mesh " + m.to_string() + " to mesh " + other.to_string() +
              ": both shardings must use the same mesh");
}

TEST_CASE("with_sharding_constraint lays out a global-view result as asked", "[exec][with_sharding_constraint]") {
  const mesh2 m{2, 2};
  const auto host = host_array();
  auto x = device_put(host, shape, named_sharding<mesh2, P<"data", none>>{m});

  // Global-view code: an elementwise result keeps x's layout; the constraint moves it to columns.
  auto y = with_sharding_constraint<P<none, "model">>(map([](float v) { return v * 2.0f + 1.0f; }, x));
  static_assert(std::is_same_v<typename decltype(y)::sharding_type, named_sharding<mesh2, P<none, "model">>>);
  std::vector<float> expected(host.size());
  for (std::size_t i = 0; i < host.size(); ++i) expected[i] = host[i] * 2.0f + 1.0f;
  require_blocks(y, expected);

  // The sharding form; a constraint equal to the current layout keeps every block.
  const named_sharding<mesh2, P<"data", none>> rows{m};
  auto same = with_sharding_constraint(x, rows);
  static_assert(std::is_same_v<decltype(same), decltype(x)>);
  require_blocks(same, host);

  // 6 rows do not split over 4 devices under the even rule: reshard's error.
  using four_ways = P<axes("data", "model"), none>;
  REQUIRE_THROWS_AS((void)with_sharding_constraint<four_ways>(x), sharding_error);
}

}  // namespace MESHLIB_TEST_UNIT
