// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// sharded_tensor: scatter / gather / callback / fill, checked element by element against blocks
// computed here with plain index arithmetic (not with shard_layout).
#include <array>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using namespace meshlib;
using mesh1 = mesh<axis<"x">>;
using mesh2 = mesh<axis<"data">, axis<"model">>;

template <class T>
std::vector<T> iota_vec(std::size_t n, T start = T{1}) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + static_cast<T>(i));
  return v;
}

// Device dev's expected 2-D block of `host` (rows r x cols c), with rows split into `rs` shards and
// cols into `cs`, the device holding row shard `ri` and col shard `ci`, ceil-div blocks.
template <class T>
std::vector<T> expected_block(const std::vector<T>& host, std::size_t rows, std::size_t cols, std::size_t rs,
                              std::size_t ri, std::size_t cs, std::size_t ci, std::array<std::size_t, 2>& ext) {
  const std::size_t rc = (rows + rs - 1) / rs, cc = (cols + cs - 1) / cs;
  const std::size_t r0 = std::min(ri * rc, rows), r1 = std::min(r0 + rc, rows);
  const std::size_t c0 = std::min(ci * cc, cols), c1 = std::min(c0 + cc, cols);
  ext = {r1 - r0, c1 - c0};
  std::vector<T> out;
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t c = c0; c < c1; ++c) out.push_back(host[r * cols + c]);
  return out;
}

template <class T, class X>
std::vector<T> block_values(const X& x, std::size_t dev) {
  const auto& v = x.local(dev);
  return std::vector<T>(v.data(), v.data() + v.size());
}

template <class T>
void check_2d_mesh_roundtrip(std::size_t rows, std::size_t cols, shard_rule rule) {
  mesh2 m{2, 3};
  const auto host = iota_vec<T>(rows * cols);
  const std::array<std::size_t, 2> shape{rows, cols};
  // P<"data", "model">: rows over data (2), cols over model (3).
  {
    named_sharding<mesh2, P<"data", "model">> s{m, rule};
    auto x = from_host(s, shape, host);
    for (std::size_t dev = 0; dev < 6; ++dev) {
      std::array<std::size_t, 2> ext{};
      const auto c = m.coords(dev);
      const auto want = expected_block(host, rows, cols, 2, c[0], 3, c[1], ext);
      CHECK(x.local_shape(dev) == ext);
      CHECK(block_values<T>(x, dev) == want);
    }
    CHECK(x.to_host() == host);
  }
  // P<none, axes("data","model")>: cols over 6 shards, data major.
  {
    named_sharding<mesh2, P<none, axes("data", "model")>> s{m, rule};
    auto x = from_host(s, shape, host);
    for (std::size_t dev = 0; dev < 6; ++dev) {
      std::array<std::size_t, 2> ext{};
      const auto c = m.coords(dev);
      const auto want = expected_block(host, rows, cols, 1, 0, 6, c[0] * 3 + c[1], ext);
      CHECK(block_values<T>(x, dev) == want);
    }
    CHECK(x.to_host() == host);
  }
  // P<"model">: rows over model, replicated over data.
  {
    named_sharding<mesh2, P<"model">> s{m, rule};
    auto x = from_host(s, shape, host);
    for (std::size_t dev = 0; dev < 6; ++dev) {
      std::array<std::size_t, 2> ext{};
      const auto want = expected_block(host, rows, cols, 3, m.coords(dev)[1], 1, 0, ext);
      CHECK(block_values<T>(x, dev) == want);
    }
    CHECK(x.to_host() == host);
  }
}

}  // namespace

TEST_CASE("from_host scatters blocks and to_host gathers them back", "[tensor][sharded_tensor]") {
  SECTION("even shapes, four dtypes") {
    check_2d_mesh_roundtrip<float>(6, 12, shard_rule::even);
    check_2d_mesh_roundtrip<double>(12, 6, shard_rule::even);
    check_2d_mesh_roundtrip<std::int32_t>(6, 6, shard_rule::even);
    check_2d_mesh_roundtrip<std::int64_t>(6, 18, shard_rule::even);
  }
  SECTION("uneven shapes") {
    check_2d_mesh_roundtrip<float>(5, 7, shard_rule::uneven);
    check_2d_mesh_roundtrip<std::int64_t>(3, 13, shard_rule::uneven);
    check_2d_mesh_roundtrip<double>(1, 4, shard_rule::uneven);  // some blocks empty
  }
  SECTION("1-D mesh, rank 1 and rank 3") {
    mesh1 m{4};
    const auto h1 = iota_vec<std::int32_t>(12);
    auto x = from_host(named_sharding<mesh1, P<"x">>{m}, std::array<std::size_t, 1>{12}, h1);
    for (std::size_t dev = 0; dev < 4; ++dev) {
      CHECK(x.local(dev).extent(0) == 3);
      for (std::size_t i = 0; i < 3; ++i) CHECK(x.local(dev)(i) == h1[dev * 3 + i]);
      CHECK(x.offsets(dev)[0] == dev * 3);
    }
    CHECK(x.to_host() == h1);

    const auto h3 = iota_vec<double>(2 * 8 * 3);
    auto y = from_host(named_sharding<mesh1, P<none, "x">>{m}, std::array<std::size_t, 3>{2, 8, 3}, h3);
    for (std::size_t dev = 0; dev < 4; ++dev)
      for (std::size_t a = 0; a < 2; ++a)
        for (std::size_t b = 0; b < 2; ++b)
          for (std::size_t c = 0; c < 3; ++c) CHECK(y.local(dev)(a, b, c) == h3[(a * 8 + dev * 2 + b) * 3 + c]);
    CHECK(y.to_host() == h3);
  }
}

TEST_CASE("make_array_from_callback, full and zeros", "[tensor][sharded_tensor]") {
  mesh2 m{2, 2};
  named_sharding<mesh2, P<"model", "data">> s{m};
  const std::array<std::size_t, 2> shape{4, 6};
  SECTION("per-element callback") {
    auto x = make_array_from_callback<std::int64_t>(shape, s, [](const std::array<std::size_t, 2>& g) {
      return static_cast<std::int64_t>(g[0] * 100 + g[1]);
    });
    const auto h = x.to_host();
    for (std::size_t r = 0; r < 4; ++r)
      for (std::size_t c = 0; c < 6; ++c) CHECK(h[r * 6 + c] == static_cast<std::int64_t>(r * 100 + c));
  }
  SECTION("per-block callback sees its offsets") {
    std::vector<std::size_t> seen;
    auto x = make_array_from_callback<float>(shape, s, [&](std::size_t dev, const block<2>& b, const auto& v) {
      seen.push_back(dev);
      for (std::size_t i = 0; i < b.extent[0]; ++i)
        for (std::size_t j = 0; j < b.extent[1]; ++j) v(i, j) = static_cast<float>((b.offset[0] + i) * 10 + b.offset[1] + j);
    });
    CHECK(seen == std::vector<std::size_t>{0, 1, 2, 3});
    // device 1 = (data 0, model 1): rows over model -> rows 2..3, cols over data -> cols 0..2
    CHECK(x.block_of(1).offset == std::array<std::size_t, 2>{2, 0});
    CHECK(x.local(1)(0, 0) == 20.0f);
    const auto h = x.to_host();
    for (std::size_t r = 0; r < 4; ++r)
      for (std::size_t c = 0; c < 6; ++c) CHECK(h[r * 6 + c] == static_cast<float>(r * 10 + c));
  }
  SECTION("full and zeros") {
    auto f = full(s, shape, 2.5);
    for (double v : f.to_host()) CHECK(v == 2.5);
    auto z = zeros<std::int32_t>(s, shape);
    for (auto v : z.to_host()) CHECK(v == 0);
  }
}

TEST_CASE("a process may hold only its own devices' blocks", "[tensor][sharded_tensor]") {
  mesh1 m{4};
  named_sharding<mesh1, P<"x">> s{m};
  const auto h = iota_vec<float>(8);
  const std::vector<std::size_t> mine{1, 2};
  auto x = from_host(s, std::array<std::size_t, 1>{8}, h, mine);
  CHECK(x.local_devices() == mine);
  CHECK(!x.fully_local());
  CHECK(x.local(2)(1) == h[5]);
  REQUIRE_THROWS_AS(x.local(0), sharding_error);
  REQUIRE_THROWS_AS(x.to_host(), sharding_error);
  // replicated data: a single local replica is enough to gather.
  named_sharding<mesh1, P<>> r{m};
  auto y = from_host(r, std::array<std::size_t, 1>{8}, h, std::vector<std::size_t>{3});
  CHECK(y.to_host() == h);
}

TEST_CASE("sharded_tensor errors and printing", "[tensor][sharded_tensor]") {
  mesh2 m{2, 3};
  named_sharding<mesh2, P<"data", "model">> s{m};
  std::vector<float> h(5 * 6);
  try {
    (void)from_host(s, std::array<std::size_t, 2>{5, 6}, h);
    FAIL("expected sharding_error");
  } catch (const sharding_error& e) {
    CHECK(std::string(e.what()).find("not divisible") != std::string::npos);
  }
  REQUIRE_THROWS_AS(from_host(s, std::array<std::size_t, 2>{4, 6}, h), sharding_error);  // wrong element count
  auto x = zeros<float>(s, std::array<std::size_t, 2>{4, 6});
  CHECK(x.to_string() == "sharded_tensor<(4, 6), named_sharding(mesh{'data': 2, 'model': 3}, P<\"data\", \"model\">)>");
}

TEST_CASE("wrapping blocks checks their shapes against the layout", "[tensor][sharded_tensor]") {
  mesh1 m{2};
  named_sharding<mesh1, P<"x">> s{m};
  using t = sharded_tensor<float, 1, named_sharding<mesh1, P<"x">>>;
  std::vector<t::view_type> blocks{meshlib::tensor::detail::allocate<float, 1>({3}), meshlib::tensor::detail::allocate<float, 1>({2})};
  try {
    t x(s, std::array<std::size_t, 1>{6}, blocks, std::vector<bool>{true, true});
    FAIL("expected sharding_error");
  } catch (const sharding_error& e) {
    CHECK(std::string(e.what()).find("device 1's block has shape (2,)") != std::string::npos);
  }
  blocks[1] = meshlib::tensor::detail::allocate<float, 1>({3});
  t ok(s, std::array<std::size_t, 1>{6}, blocks, std::vector<bool>{true, true});
  CHECK(ok.local(1).data() == blocks[1].data());  // wrapped, not copied
}

}  // namespace MESHLIB_TEST_UNIT
