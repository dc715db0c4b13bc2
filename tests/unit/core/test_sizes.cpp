// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Bad sizes, as a new user types them: huge, zero and negative values converted to std::size_t,
// through every public constructor and creation function. Each either works, with the size the
// exact (128-bit) product says, or throws a meshlib::error naming the dimension or axis and the
// value: never a wrapped count, never a write past a buffer (this file also runs under ASan, as
// meshlib_sizes_tests_asan).
#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "meshlib/core.hpp"
#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

using namespace meshlib;
using meshlib_test::message_of;

namespace {

__extension__ typedef unsigned __int128 u128;  // the exact product of two sizes
using mesh1 = mesh<axis<"x">>;
using mesh2 = mesh<axis<"data">, axis<"model">>;

/// Random sizes of every kind: small, zero, around 2^32 and 2^62, negative values converted.
std::size_t random_size(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: return 0;
    case 1: return 1 + rng() % 4;
    case 2: return (std::size_t{1} << 32) + rng() % 3 - 1;
    case 3: return (std::size_t{1} << 62) + rng() % 3 - 1;
    case 4: return static_cast<std::size_t>(-static_cast<long long>(1 + rng() % 16));  // a negative int
    case 5: return rng();
    case 6: return std::size_t{1} << (rng() % 64);
    default: return 2 + rng() % 6;
  }
}

bool sane(std::size_t s) { return s <= (std::size_t{1} << 62); }

}  // namespace

TEST_CASE("the issue's bad sizes get clear errors naming the dimension or axis and the value", "[core][sizes]") {
  CHECK(message_of<mesh_error>([] { mesh1 m{-1}; }) ==
        "meshlib: axis 'x' has size 18446744073709551615 (-1 as a signed number); a mesh axis size must be positive");
  CHECK(message_of<mesh_error>([] { mesh2 m{std::size_t{1} << 32, std::size_t{1} << 32}; }) ==
        "meshlib: the device count of the mesh overflows at axis 'model' (size 4294967296): the product of the axis "
        "sizes does not fit in 64 bits");
  const named_sharding<mesh2, P<"data">> s{mesh2{2, 2}};
  CHECK(message_of<sharding_error>([&] {
          (void)from_host(s, std::array<std::size_t, 2>{std::size_t{1} << 62, 4}, std::vector<float>{});
        }) == "meshlib: the global shape (4611686018427387904, 4): the element count overflows at dimension 1 (size "
              "4): it does not fit in 64 bits");
  CHECK(message_of<sharding_error>([&] { (void)zeros<float>(s, std::array<std::size_t, 2>{std::size_t(-8), 4}); }) ==
        "meshlib: the global shape (18446744073709551608, 4): dimension 0 has size 18446744073709551608 (-8 as a "
        "signed number), larger than 2^62: a negative or overflowed size?");
  // local_tensor's own block allocation (what shard_map bodies and tests build directly).
  CHECK(message_of<sharding_error>([] {
          (void)local_tensor<float, 2, mesh2>(std::array<std::size_t, 2>{std::size_t{1} << 40, std::size_t{1} << 30},
                                              mesh2{2, 2}, 0);
        }) == "meshlib: the local_tensor block shape (1099511627776, 1073741824): the element count overflows at "
              "dimension 1 (size 1073741824): it does not fit in 64 bits");
  CHECK(message_of<sharding_error>([] {
          (void)local_tensor<float, 2, mesh2>(std::array<std::size_t, 2>{3, std::size_t(-1)}, mesh2{2, 2}, 0);
        }) == "meshlib: the local_tensor block shape (3, 18446744073709551615): dimension 1 has size "
              "18446744073709551615 (-1 as a signed number), larger than 2^62: a negative or overflowed size?");
  CHECK(message_of<sharding_error>([] {
          (void)local_tensor<double, 1, mesh2>(std::array<std::size_t, 1>{std::size_t{1} << 62}, mesh2{2, 2}, 0);
        }) == "meshlib: the byte count of the local_tensor block overflows: 4611686018427387904 x 8 does not fit in 64 "
              "bits");
  // A count that fits but whose bytes do not: 2^61 doubles.
  CHECK(message_of<sharding_error>([&] { (void)zeros<double>(s, std::array<std::size_t, 2>{std::size_t{1} << 61, 2}); }) ==
        "meshlib: the byte count of the global shape overflows: 4611686018427387904 x 8 does not fit in 64 bits");
}

TEST_CASE("a mesh of more devices than an int counts cannot run, naming the axis that passes the limit",
          "[core][sizes]") {
  // spmd / shard_map / reshard call this before allocating anything per device.
  CHECK(message_of<mesh_error>([] { core::detail::require_runnable(mesh1{(std::size_t{1} << 32) + 2}, "spmd"); }) ==
        "meshlib: spmd on mesh{'x': 4294967298}: the mesh has 4294967298 devices, more than the 2147483647 that a "
        "communicator's int ranks can number; axis 'x' (size 4294967298) takes the device count past it: use a mesh "
        "of at most 2147483647 devices");
  CHECK(message_of<mesh_error>([] { core::detail::require_runnable(mesh2{65536, 32768}, "shard_map"); }) ==
        "meshlib: shard_map on mesh{'data': 65536, 'model': 32768}: the mesh has 2147483648 devices, more than the "
        "2147483647 that a communicator's int ranks can number; axis 'model' (size 32768) takes the device count "
        "past it: use a mesh of at most 2147483647 devices");
  CHECK(message_of<mesh_error>([] { core::detail::require_runnable(mesh2{std::size_t{1} << 31, 1}, "spmd"); })
            .find("axis 'data' (size 2147483648) takes the device count past it") != std::string::npos);
  // The largest runnable counts pass (nothing is allocated by the check).
  core::detail::require_runnable(mesh1{2147483647}, "spmd");
  core::detail::require_runnable(mesh2{65536, 32767}, "spmd");
  // The law over random meshes: refused exactly when the count passes INT_MAX.
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::size_t a = 1 + rng() % (std::size_t{1} << (rng() % 34)), b = 1 + rng() % (std::size_t{1} << (rng() % 34));
    if (u128{a} * u128{b} >= (u128{1} << 64)) continue;
    const mesh2 m{a, b};
    const std::string msg = message_of<mesh_error>([&] { core::detail::require_runnable(m, "spmd"); });
    CHECK((msg == "(no exception)") == (m.size() <= 2147483647u));
    if (m.size() > 2147483647u)
      CHECK(msg.find(a > 2147483647u ? "axis 'data'" : "axis 'model'") != std::string::npos);
  }
}

TEST_CASE("random huge, zero and negative-converted sizes through every constructor and creation function",
          "[core][sizes][property]") {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::size_t a = random_size(rng), b = random_size(rng);
    const u128 product = u128{a} * u128{b};
    // Meshes: the exact device count, or mesh_error.
    try {
      mesh2 m{a, b};
      CHECK((a != 0 && b != 0 && sane(a) && sane(b) && product < (u128{1} << 64)));
      CHECK(u128{m.size()} == product);
    } catch (const mesh_error& e) {
      CHECK(!(a != 0 && b != 0 && sane(a) && sane(b) && product < (u128{1} << 64)));
      CHECK(std::string(e.what()).rfind("meshlib: ", 0) == 0);
    }
    // Tensors on a 2 x 2 mesh, sharded on dim 0 with the uneven rule (so any size fits the split).
    const named_sharding<mesh2, P<"data">> s{mesh2{2, 2}, shard_rule::uneven};
    const std::array<std::size_t, 2> shape{a, b};
    const bool bad = !sane(a) || !sane(b) || product >= (u128{1} << 64);
    if (!bad && product > (1u << 16)) continue;  // a real size, too big to allocate here
    std::vector<float> host(bad ? 0 : static_cast<std::size_t>(product), 1.0f);
    const auto expect = [&](auto&& make) {
      if (bad) {
        const std::string m = message_of<sharding_error>(make);
        CHECK(m.rfind("meshlib: the global shape (", 0) == 0);
      } else {
        make();
      }
    };
    expect([&] { (void)zeros<float>(s, shape); });
    expect([&] { (void)full<float>(s, shape, 2.0f); });
    expect([&] { (void)sharded_tensor<float, 2, decltype(s)>(s, shape); });
    expect([&] { (void)from_host(s, shape, host); });
    expect([&] { (void)make_array_from_callback<float>(shape, s, [](const std::array<std::size_t, 2>&) { return 1.0f; }); });
    expect([&] { (void)shard_layout(s, shape); });
    // A local block of the same shape: the exact element count, or sharding_error naming its shape.
    if (bad) {
      const std::string m = message_of<sharding_error>([&] { (void)local_tensor<float, 2, mesh2>(shape, mesh2{2, 2}, 0); });
      CHECK(m.rfind("meshlib: the local_tensor block shape (", 0) == 0);
    } else {
      const local_tensor<float, 2, mesh2> block(shape, mesh2{2, 2}, 0);
      CHECK(block.size() == static_cast<std::size_t>(product));
    }
    if (!bad) {
      auto x = from_host(s, shape, host);
      CHECK(x.size() == static_cast<std::size_t>(product));
      CHECK(x.to_host() == host);
    }
  }
}
