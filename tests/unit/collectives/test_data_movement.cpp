// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// all_gather (tiled, untiled), psum_scatter, all_to_all, ppermute, broadcast, pvary on 1-D and
// 2-D meshes: every output element is checked against the element of the device it must come
// from, computed on the host from the mesh's group order.
#include <algorithm>
#include <cstdint>

#include "collectives_support.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;
using coll_test::value;

namespace {

using mesh1 = mesh<axis<"x">>;
using mesh2 = mesh<axis<"data">, axis<"model">>;

constexpr axis_mask X = mesh1::mask_of<"x">();
constexpr axis_mask D = mesh2::mask_of<"data">();
constexpr axis_mask M = mesh2::mask_of<"model">();

// ---- result types ------------------------------------------------------------------------------
using rows_t = local_tensor<float, 2, mesh2, D | M, 0, dim_masks<D, M>>;
using gathered_t = decltype(all_gather<"model", 1>(std::declval<rows_t>()));
static_assert(gathered_t::vary == D && std::is_same_v<gathered_t::dims_type, dim_masks<D, 0>>);
using stacked_t = decltype(all_gather<"model", 0>(std::declval<rows_t>(), untiled));
static_assert(stacked_t::rank == 3 && stacked_t::vary == D && std::is_same_v<stacked_t::dims_type, dim_masks<0, D, 0>>);
using moved_t = decltype(all_to_all<"model", 0, 1>(std::declval<local_tensor<float, 2, mesh2, M, 0, dim_masks<0, M>>>()));
static_assert(std::is_same_v<moved_t::dims_type, dim_masks<M, 0>> && moved_t::vary == M);
using partial_t = local_tensor<float, 2, mesh2, D, M, dim_masks<D, 0>>;
using scattered_t = decltype(psum_scatter<"model", 1>(std::declval<partial_t>()));
static_assert(scattered_t::vary == (D | M) && scattered_t::partial == 0 &&
              std::is_same_v<scattered_t::dims_type, dim_masks<D, M>>);
using replicated_t = local_tensor<float, 1, mesh2, D>;
using varied_t = decltype(pvary<"model">(std::declval<replicated_t>()));
static_assert(varied_t::vary == (D | M));
using bcast_t = decltype(broadcast<"model">(std::declval<rows_t>(), 0));
static_assert(bcast_t::vary == D && std::is_same_v<bcast_t::dims_type, dim_masks<D, 0>>);
static_assert(std::is_same_v<decltype(ppermute<"data">(std::declval<rows_t>(), {})), rows_t>);

/// Index of `dev` along the axes in `mask`, and the member at index `j`.
std::size_t index_in(const mesh2& m, std::size_t dev, axis_mask mask) { return m.group_rank(dev, mask); }
std::size_t member(const mesh2& m, std::size_t dev, axis_mask mask, std::size_t j) { return m.group(dev, mask)[j]; }

template <class T>
void check_gathers_2d(std::size_t a, std::size_t b, std::size_t r, std::size_t c) {
  mesh2 m{a, b};
  using L = local_tensor<T, 2, mesh2, D | M, 0, dim_masks<D, M>>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, {r, c});
    return std::array{coll_test::capture(all_gather<"model", 1>(x)), coll_test::capture(all_gather<"data", 0>(x)),
                      coll_test::capture(all_gather<"model", 0>(x, untiled)),
                      coll_test::capture(all_gather<"data", 1>(x, untiled))};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    // tiled over model along dim 1: (r, b*c)
    REQUIRE(out[dev][0].shape == std::vector<std::size_t>{r, b * c});
    for (std::size_t i = 0; i < r; ++i)
      for (std::size_t j = 0; j < b; ++j)
        for (std::size_t k = 0; k < c; ++k)
          CHECK(out[dev][0].data[coll_test::at2(i, j * c + k, b * c)] == value<T>(member(m, dev, M, j), i * c + k));
    // tiled over data along dim 0: (a*r, c)
    REQUIRE(out[dev][1].shape == std::vector<std::size_t>{a * r, c});
    for (std::size_t j = 0; j < a; ++j)
      for (std::size_t i = 0; i < r; ++i)
        for (std::size_t k = 0; k < c; ++k)
          CHECK(out[dev][1].data[coll_test::at2(j * r + i, k, c)] == value<T>(member(m, dev, D, j), i * c + k));
    // untiled over model at 0: (b, r, c)
    REQUIRE(out[dev][2].shape == std::vector<std::size_t>{b, r, c});
    for (std::size_t j = 0; j < b; ++j)
      for (std::size_t e = 0; e < r * c; ++e) CHECK(out[dev][2].data[j * r * c + e] == value<T>(member(m, dev, M, j), e));
    // untiled over data at 1: (r, a, c)
    REQUIRE(out[dev][3].shape == std::vector<std::size_t>{r, a, c});
    for (std::size_t i = 0; i < r; ++i)
      for (std::size_t j = 0; j < a; ++j)
        for (std::size_t k = 0; k < c; ++k)
          CHECK(out[dev][3].data[(i * a + j) * c + k] == value<T>(member(m, dev, D, j), i * c + k));
  }
}

template <class T>
void check_scatter_and_all_to_all_1d(std::size_t n, std::size_t r, std::size_t k) {
  mesh1 m{n};
  using L = local_tensor<T, 2, mesh1, X>;
  using Lsh = local_tensor<T, 2, mesh1, X, 0, dim_masks<0, X>>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, {n * r, k});
    auto y = coll_test::make_block<Lsh>(m, {r, n * k});
    return std::array{coll_test::capture(psum_scatter<"x", 0>(x)), coll_test::capture(all_to_all<"x", 0, 1>(y)),
                      coll_test::capture(all_to_all<"x", 1, 0>(x))};
  });
  for (std::size_t dev = 0; dev < n; ++dev) {
    // psum_scatter along 0: (r, k); rows [dev*r, dev*r + r) of the sum
    REQUIRE(out[dev][0].shape == std::vector<std::size_t>{r, k});
    for (std::size_t i = 0; i < r; ++i)
      for (std::size_t j = 0; j < k; ++j) {
        long long s = 0;
        for (std::size_t d = 0; d < n; ++d) s += static_cast<long long>(value<T>(d, (dev * r + i) * k + j));
        CHECK(out[dev][0].data[coll_test::at2(i, j, k)] == static_cast<T>(s));
      }
    // all_to_all split 0, concat 1 of y (r, n*k): chunk j of rows... r must be divisible by n
    // (checked by the caller's choice of r); result (r/n, n*n*k)
    const std::size_t rr = r / n;
    REQUIRE(out[dev][1].shape == std::vector<std::size_t>{rr, n * n * k});
    for (std::size_t i = 0; i < rr; ++i)
      for (std::size_t src = 0; src < n; ++src)
        for (std::size_t j = 0; j < n * k; ++j)
          CHECK(out[dev][1].data[coll_test::at2(i, src * n * k + j, n * n * k)] ==
                value<T>(src, (dev * rr + i) * (n * k) + j));
    // all_to_all split 1, concat 0 of x (n*r, k): k divisible by n; result (n*n*r, k/n)
    const std::size_t kk = k / n;
    REQUIRE(out[dev][2].shape == std::vector<std::size_t>{n * n * r, kk});
    for (std::size_t src = 0; src < n; ++src)
      for (std::size_t i = 0; i < n * r; ++i)
        for (std::size_t j = 0; j < kk; ++j)
          CHECK(out[dev][2].data[coll_test::at2(src * n * r + i, j, kk)] == value<T>(src, i * k + dev * kk + j));
  }
}

}  // namespace

TEST_CASE("all_gather tiled and untiled on a 2-D mesh", "[collectives][all_gather]") {
  SECTION("float 2x2, (2, 3)") { check_gathers_2d<float>(2, 2, 2, 3); }
  SECTION("int32 2x3, (1, 4)") { check_gathers_2d<std::int32_t>(2, 3, 1, 4); }
  SECTION("double 3x2, (3, 1)") { check_gathers_2d<double>(3, 2, 3, 1); }
  SECTION("int64 1x4, (2, 2)") { check_gathers_2d<std::int64_t>(1, 4, 2, 2); }
}

TEST_CASE("psum_scatter and all_to_all on a 1-D mesh", "[collectives][psum_scatter][all_to_all]") {
  SECTION("float, 2 devices") { check_scatter_and_all_to_all_1d<float>(2, 2, 4); }
  SECTION("int32, 4 devices") { check_scatter_and_all_to_all_1d<std::int32_t>(4, 4, 8); }
  SECTION("double, 3 devices") { check_scatter_and_all_to_all_1d<double>(3, 3, 3); }
  SECTION("int64, 1 device") { check_scatter_and_all_to_all_1d<std::int64_t>(1, 2, 3); }
}

TEST_CASE("psum_scatter over one axis of a 2-D mesh", "[collectives][psum_scatter]") {
  mesh2 m{2, 3};
  using L = local_tensor<double, 1, mesh2, D | M>;
  auto out = spmd(m, [&] { return coll_test::capture(psum_scatter<"model", 0>(coll_test::make_block<L>(m, {6}))); });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    REQUIRE(out[dev].shape == std::vector<std::size_t>{2});
    const std::size_t idx = index_in(m, dev, M);
    for (std::size_t i = 0; i < 2; ++i) {
      double s = 0;
      for (std::size_t j = 0; j < 3; ++j) s += value<double>(member(m, dev, M, j), idx * 2 + i);
      CHECK(out[dev].data[i] == s);
    }
  }
}

TEST_CASE("ppermute: ring shift, partial permutation with zeros, on 1-D and 2-D meshes", "[collectives][ppermute]") {
  SECTION("ring over a 1-D mesh of 5") {
    mesh1 m{5};
    using L = local_tensor<std::int32_t, 1, mesh1, X>;
    std::vector<std::pair<std::size_t, std::size_t>> ring;
    for (std::size_t i = 0; i < 5; ++i) ring.push_back({i, (i + 1) % 5});
    auto out = spmd(m, [&] { return coll_test::capture(ppermute<"x">(coll_test::make_block<L>(m, {4}), ring)); });
    for (std::size_t dev = 0; dev < 5; ++dev)
      for (std::size_t i = 0; i < 4; ++i) CHECK(out[dev].data[i] == value<std::int32_t>((dev + 4) % 5, i));
  }
  SECTION("one pair over 'model' of a 2x3 mesh: the others get zeros") {
    mesh2 m{2, 3};
    using L = local_tensor<float, 2, mesh2, D | M>;
    auto out = spmd(m, [&] { return coll_test::capture(ppermute<"model">(coll_test::make_block<L>(m, {2, 2}), {{2, 0}})); });
    for (std::size_t dev = 0; dev < m.size(); ++dev)
      for (std::size_t i = 0; i < 4; ++i) {
        const float want = index_in(m, dev, M) == 0 ? value<float>(member(m, dev, M, 2), i) : 0.0f;
        CHECK(out[dev].data[i] == want);
      }
  }
}

TEST_CASE("broadcast from one index of an axis; pvary moves no data", "[collectives][broadcast][pvary]") {
  mesh2 m{3, 2};
  using L = local_tensor<std::int64_t, 1, mesh2, D | M>;
  using R = local_tensor<std::int64_t, 1, mesh2, 0>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, {3});
    auto r = R(std::array<std::size_t, 1>{3}, m, device_index());
    for (std::size_t i = 0; i < 3; ++i) r(i) = static_cast<std::int64_t>(i + 40);
    auto v = pvary<"data", "model">(r);
    static_assert(decltype(v)::vary == (D | M));
    const bool shares = v.data() == r.data();
    return std::pair{std::array{coll_test::capture(broadcast<"data">(x, 2)), coll_test::capture(broadcast<"model">(x, 1)),
                                coll_test::capture(v)},
                     shares};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    CHECK(out[dev].second);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(out[dev].first[0].data[i] == value<std::int64_t>(member(m, dev, D, 2), i));
      CHECK(out[dev].first[1].data[i] == value<std::int64_t>(member(m, dev, M, 1), i));
      CHECK(out[dev].first[2].data[i] == static_cast<std::int64_t>(i + 40));
    }
  }
}

TEST_CASE("run-time misuse: indivisible sizes and bad roots throw, naming the axis", "[collectives][errors]") {
  mesh1 m{3};
  using L = local_tensor<float, 1, mesh1, X>;
  const std::string msg = coll_test::message_of([&] {
    spmd(m, [&] { (void)psum_scatter<"x", 0>(coll_test::make_block<L>(m, {4})); });
  });
  CHECK(msg.find("psum_scatter over 'x' (group size 3) splits dimension 0 of size 4, which is not divisible by 3") !=
        std::string::npos);
  CHECK(msg.find("not divisible by 3") != std::string::npos);
  const std::string msg2 = coll_test::message_of([&] { spmd(m, [&] { (void)broadcast<"x">(coll_test::make_block<L>(m, {4}), 3); }); });
  CHECK(msg2.find("root index 3 is out of range") != std::string::npos);
}

TEST_CASE("collectives over non-adjacent axes of a 3-axis mesh use the mesh's group order", "[collectives][mesh3]") {
  using mesh3 = mesh<axis<"a">, axis<"b">, axis<"c">>;
  constexpr axis_mask AC = mesh3::mask_of<"a", "c">();
  mesh3 m{2, 3, 2};
  using L = local_tensor<std::int32_t, 1, mesh3, mesh3::all_axes>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, {2});
    return std::array{coll_test::capture(psum<"a", "c">(x)), coll_test::capture(all_gather<"b", 0>(x)),
                      coll_test::capture(pmin<"c", "a">(x))};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    const auto group = m.group(dev, AC);  // 4 devices: same b coordinate
    REQUIRE(group.size() == 4);
    for (std::size_t i = 0; i < 2; ++i) {
      std::int32_t s = 0, mn = value<std::int32_t>(group[0], i);
      for (auto g : group) s += value<std::int32_t>(g, i), mn = std::min(mn, value<std::int32_t>(g, i));
      CHECK(out[dev][0].data[i] == s);
      CHECK(out[dev][2].data[i] == mn);
    }
    const auto bgroup = m.group(dev, mesh3::mask_of<"b">());
    REQUIRE(out[dev][1].shape == std::vector<std::size_t>{6});
    for (std::size_t j = 0; j < 3; ++j)
      for (std::size_t i = 0; i < 2; ++i) CHECK(out[dev][1].data[j * 2 + i] == value<std::int32_t>(bgroup[j], i));
  }
}

TEST_CASE("every collective from 8 device threads, many rounds, exact (also run under TSan)", "[collectives][stress]") {
#if defined(MESHLIB_UNDER_TSAN)
  const std::size_t rounds = 10;
#else
  const std::size_t rounds = 50;
#endif
  mesh2 m{2, 4};
  using L = local_tensor<float, 2, mesh2, D | M, 0, dim_masks<D, M>>;
  std::vector<std::pair<std::size_t, std::size_t>> ring{{0, 1}, {1, 2}, {2, 3}, {3, 0}};
  auto out = spmd(m, [&] {
    std::size_t bad = 0;
    for (std::size_t r = 0; r < rounds; ++r) {
      auto x = coll_test::make_block<L>(m, {4, 4});
      const std::size_t dev = device_index();
      const std::size_t mi = axis_index<"model">();
      auto s = psum<"model">(x);
      auto g = all_gather<"model", 1>(x);
      auto t = all_to_all<"model", 0, 1>(x);
      auto p = ppermute<"model">(x, ring);
      auto b = broadcast<"data">(x, 1);
      auto sc = psum_scatter<"data", 1>(s);  // s still varies over data
      for (std::size_t i = 0; i < 16; ++i) {
        float want = 0;
        for (std::size_t j = 0; j < 4; ++j) want += value<float>(m.group(dev, M)[j], i);
        bad += s.data()[i] != want;
      }
      bad += g(1, 5) != value<float>(m.group(dev, M)[1], 1 * 4 + 1);
      bad += t(0, 4) != value<float>(m.group(dev, M)[1], mi * 4 + 0);
      bad += p(0, 0) != value<float>(m.group(dev, M)[(mi + 3) % 4], 0);
      bad += b(3, 3) != value<float>(m.group(dev, D)[1], 15);
      // psum_scatter over data of the model-sums: device (di, mi) keeps columns [2 di, 2 di + 2) of
      // the sum over every device of the mesh
      float all = 0;
      for (std::size_t d = 0; d < m.size(); ++d) all += value<float>(d, axis_index<"data">() * 2);
      bad += sc.extent(1) != 2 || sc(0, 0) != all;
    }
    return bad;
  });
  for (auto b : out) CHECK(b == 0);
}

// The _into forms write the result into the caller's block: the result is a view of it, with the
// type of the plain form, and the numbers of the plain form (checked against host sums and blocks).
// A block of the wrong shape is refused with a message that names both shapes.
TEST_CASE("psum_scatter_into and all_gather_into write the caller's block", "[collectives][psum_scatter][all_gather]") {
  mesh2 m{2, 3};
  using L = local_tensor<double, 1, mesh2, D | M>;
  using R = decltype(psum_scatter<"model", 0>(std::declval<L>()));
  using G = decltype(all_gather<"model", 0>(std::declval<R>()));
  auto out = spmd(m, [&] {
    const std::size_t dev = device_index();
    auto x = coll_test::make_block<L>(m, {6});
    std::array<double, 2> slice{};
    std::array<double, 6> full{};
    auto s = psum_scatter_into<"model", 0>(x, L(L::view_type(slice.data(), 2), m, dev));
    static_assert(std::is_same_v<decltype(s), R>);
    auto g = all_gather_into<"model", 0>(s, L(L::view_type(full.data(), 6), m, dev));
    static_assert(std::is_same_v<decltype(g), G>);
    const bool placed = s.data() == slice.data() && g.data() == full.data();
    return std::tuple{placed, slice, full};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    INFO("device " << dev);
    CHECK(std::get<0>(out[dev]));
    const std::size_t idx = index_in(m, dev, M);
    for (std::size_t j = 0; j < 6; ++j) {
      double s = 0;
      for (std::size_t k = 0; k < 3; ++k) s += value<double>(member(m, dev, M, k), j);
      if (j / 2 == idx) CHECK(std::get<1>(out[dev])[j % 2] == s);
      CHECK(std::get<2>(out[dev])[j] == s);  // every chunk of the gathered sum
    }
  }
  mesh1 m1{3};
  using L1 = local_tensor<float, 1, mesh1, X>;
  // Every device fails alike; spmd reports one of them, naming it, with the collective's message.
  const std::string msg = coll_test::message_of([&] {
    spmd(m1, [&] {
      std::array<float, 3> small{};
      (void)psum_scatter_into<"x", 0>(coll_test::make_block<L1>(m1, {6}), L1(L1::view_type(small.data(), 3), m1, device_index()));
    });
  });
  const std::string expected =
      "failed: meshlib: psum_scatter_into: the output block has shape (3,), but the result has shape (2,) (a "
      "contiguous block is needed); pass a block of the result's shape";
  CHECK(msg.size() >= expected.size());
  CHECK(msg.substr(msg.size() - std::min(msg.size(), expected.size())) == expected);
}

}  // namespace MESHLIB_TEST_UNIT
