// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The JAX forms added for parity: collectives over several axes in the order written
// (axis_group), untiled psum_scatter and all_to_all, negative dimension numbers, forget_dims,
// reshape, axis_index as a per-device value, and pmean of integers. Every expected element is
// computed on the host from index formulas: the group position p of a device is row-major over
// the group's axes in the order written, and p names which device's element must land where.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "collectives_support.hpp"

using namespace meshlib;
using coll_test::value;

namespace {

/// The members of `dev`'s group over the mesh positions `axes` (in the order written), indexed by
/// group position: member[p] differs from `dev` only in those axes, whose coordinates are p
/// decomposed row-major over `axes`.
template <class Mesh>
std::vector<std::size_t> members(const Mesh& m, std::size_t dev, const std::vector<std::size_t>& axes) {
  std::size_t n = 1;
  for (auto a : axes) n *= m.axis_size(a);
  std::vector<std::size_t> out(n);
  for (std::size_t p = 0; p < n; ++p) {
    auto c = m.coords(dev);
    std::size_t rest = p;
    for (std::size_t k = axes.size(); k-- > 0;) {
      c[axes[k]] = rest % m.axis_size(axes[k]);
      rest /= m.axis_size(axes[k]);
    }
    out[p] = m.device_at(c);
  }
  return out;
}

/// The group position of `dev`: its coordinates over `axes`, row-major in the order written.
template <class Mesh>
std::size_t position(const Mesh& m, std::size_t dev, const std::vector<std::size_t>& axes) {
  std::size_t p = 0;
  const auto c = m.coords(dev);
  for (auto a : axes) p = p * m.axis_size(a) + c[a];
  return p;
}

template <class T>
using seen = coll_test::seen<T>;

/// Every form over group `G` of mesh `m` whose written axes are at mesh positions `axes`. Blocks
/// have `k` elements per chunk; the group size is n.
template <class G, class Mesh>
void check_group_forms(const Mesh& m, const std::vector<std::size_t>& axes, std::size_t k) {
  using T = std::int32_t;
  constexpr axis_mask all = Mesh::all_axes;
  std::size_t n = 1;
  for (auto a : axes) n *= m.axis_size(a);
  using L1 = local_tensor<T, 1, Mesh, all>;
  using L2 = local_tensor<T, 2, Mesh, all>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L1>(m, {k});          // (k,)
    auto y = coll_test::make_block<L1>(m, {n * k});      // (n*k,)
    auto z = coll_test::make_block<L2>(m, {n, k});       // (n, k)
    std::vector<seen<T>> r;
    r.push_back(coll_test::capture(all_gather<G, 0>(x)));                    // 0: (n*k,)
    r.push_back(coll_test::capture(all_gather<G, -1>(x, untiled)));          // 1: (k, n)
    r.push_back(coll_test::capture(psum_scatter<G, 0>(y)));                  // 2: (k,)
    r.push_back(coll_test::capture(psum_scatter<G, -2>(z, untiled)));        // 3: (k,)
    r.push_back(coll_test::capture(all_to_all<G, 0, 1>(z)));                 // 4: (1, n*k)
    r.push_back(coll_test::capture(all_to_all<G, 0, -1>(z, untiled)));      // 5: (k, n)
    std::vector<std::pair<std::size_t, std::size_t>> shift;
    for (std::size_t p = 0; p < n; ++p) shift.push_back({p, (p + 1) % n});
    r.push_back(coll_test::capture(ppermute<G>(x, shift)));                  // 6: (k,)
    return r;
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    const auto g = members(m, dev, axes);
    const std::size_t w = position(m, dev, axes);
    const auto& r = out[dev];
    // all_gather tiled: chunk p is member p's block.
    REQUIRE(r[0].shape == std::vector<std::size_t>{n * k});
    for (std::size_t p = 0; p < n; ++p)
      for (std::size_t i = 0; i < k; ++i) CHECK(r[0].data[p * k + i] == value<T>(g[p], i));
    // all_gather untiled at -1: (k, n), [i][p] = member p's element i.
    REQUIRE(r[1].shape == std::vector<std::size_t>{k, n});
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t p = 0; p < n; ++p) CHECK(r[1].data[i * n + p] == value<T>(g[p], i));
    // psum_scatter tiled and untiled: element i of chunk w of the sum over the group.
    for (int form : {2, 3}) {
      REQUIRE(r[form].shape == std::vector<std::size_t>{k});
      for (std::size_t i = 0; i < k; ++i) {
        T sum = 0;
        for (auto src : g) sum += value<T>(src, w * k + i);
        CHECK(r[form].data[i] == sum);
      }
    }
    // all_to_all tiled, split 0 concat 1: (1, n*k), [0][p*k + i] = member p's z[w][i].
    REQUIRE(r[4].shape == std::vector<std::size_t>{1, n * k});
    for (std::size_t p = 0; p < n; ++p)
      for (std::size_t i = 0; i < k; ++i) CHECK(r[4].data[p * k + i] == value<T>(g[p], w * k + i));
    // all_to_all untiled, split 0 (size n) removed, new dim n at -1: (k, n), [i][p] = member p's z[w][i].
    REQUIRE(r[5].shape == std::vector<std::size_t>{k, n});
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t p = 0; p < n; ++p) CHECK(r[5].data[i * n + p] == value<T>(g[p], w * k + i));
    // ppermute p -> p + 1: this device holds the block of position w - 1.
    for (std::size_t i = 0; i < k; ++i) CHECK(r[6].data[i] == value<T>(g[(w + n - 1) % n], i));
  }
}

template <class Mesh, fixed_string... Names>
std::vector<std::size_t> positions_of() {
  return {Mesh::find_axis(Names.view())...};
}

}  // namespace

// ---- types: the rules of the new forms ---------------------------------------------------------
namespace {
using mesh2 = mesh<axis<"i">, axis<"j">>;
constexpr axis_mask I = mesh2::mask_of<"i">();
constexpr axis_mask J = mesh2::mask_of<"j">();
using rows_t = local_tensor<float, 2, mesh2, I | J, 0, dim_masks<I, 0>>;
// Several axes: all leave vary and every dimension.
static_assert(std::is_same_v<decltype(all_gather<axis_group<"j", "i">, 0>(std::declval<rows_t>())),
                             local_tensor<float, 2, mesh2, 0, 0, dim_masks<0, 0>>>);
// Untiled psum_scatter removes the dimension; the result varies over the axis.
using partial_t = local_tensor<float, 2, mesh2, I, J, dim_masks<I, 0>>;
static_assert(std::is_same_v<decltype(psum_scatter<"j", 1>(std::declval<partial_t>(), untiled)),
                             local_tensor<float, 1, mesh2, I | J, 0, dim_masks<I>>>);
// Untiled all_to_all: split removed, a replicated dimension inserted at concat, the axis forgotten.
static_assert(std::is_same_v<decltype(all_to_all<"i", 1, 0>(std::declval<rows_t>(), untiled)),
                             local_tensor<float, 2, mesh2, I | J, 0, dim_masks<0, 0>>>);
// Negative numbers count from the end (untiled all_gather: of the result).
static_assert(std::is_same_v<decltype(all_gather<"i", -2>(std::declval<rows_t>())),
                             decltype(all_gather<"i", 0>(std::declval<rows_t>()))>);
static_assert(decltype(all_gather<"j", -1>(std::declval<rows_t>(), untiled))::rank == 3);
// forget_dims drops the record only; then the tutorial's psum_scatter of a scattered block types.
static_assert(std::is_same_v<decltype(forget_dims<"i">(std::declval<rows_t>())), local_tensor<float, 2, mesh2, I | J>>);
static_assert(std::is_same_v<decltype(psum_scatter<"i", 0>(forget_dims<"i">(std::declval<rows_t>()))),
                             local_tensor<float, 2, mesh2, I | J, 0, dim_masks<I, 0>>>);
// pmean of integers is a true division (JAX: float32 for int32); of floats, the same type.
static_assert(std::is_same_v<decltype(pmean<"i">(std::declval<local_tensor<std::int32_t, 1, mesh2, I>>()))::value_type, float>);
static_assert(std::is_same_v<decltype(pmean<"i">(std::declval<local_tensor<std::int64_t, 1, mesh2, I>>()))::value_type, double>);
static_assert(std::is_same_v<decltype(pmean<"i">(std::declval<local_tensor<double, 1, mesh2, I>>()))::value_type, double>);
// axis_index as a value: an int32 scalar varying over the axes.
static_assert(std::is_same_v<decltype(axis_index<"j", "i">(std::declval<rows_t>())),
                             local_tensor<std::int32_t, 0, mesh2, I | J>>);
}  // namespace

TEST_CASE("collectives over several axes in the order written, tiled and untiled, on 1-, 2- and 3-axis meshes",
          "[collectives][axis_group]") {
  SECTION("1 axis") {
    using m1 = mesh<axis<"x">>;
    for (std::size_t n : {1u, 3u, 4u}) check_group_forms<axis_group<"x">>(m1{n}, {0}, 2);
  }
  SECTION("2 axes, in mesh order and reversed") {
    for (auto [a, b] : {std::pair<std::size_t, std::size_t>{2, 3}, {3, 2}, {1, 4}}) {
      const mesh2 m{a, b};
      check_group_forms<axis_group<"i", "j">>(m, positions_of<mesh2, "i", "j">(), 2);
      check_group_forms<axis_group<"j", "i">>(m, positions_of<mesh2, "j", "i">(), 3);
    }
  }
  SECTION("3 axes with a size-1 axis, groups of two and three axes in orders other than the mesh's") {
    using m3 = mesh<axis<"a">, axis<"b">, axis<"c">>;
    for (auto sizes : {std::array<std::size_t, 3>{2, 1, 3}, {2, 2, 2}}) {
      const m3 m{sizes};
      check_group_forms<axis_group<"c", "a">>(m, positions_of<m3, "c", "a">(), 2);
      check_group_forms<axis_group<"b", "c", "a">>(m, positions_of<m3, "b", "c", "a">(), 1);
      check_group_forms<axis_group<"c", "b">>(m, positions_of<m3, "c", "b">(), 2);
    }
  }
}

TEST_CASE("axis_index: several axes in the order written, and as a per-device int32 value", "[collectives][axis_index]") {
  using m3 = mesh<axis<"a">, axis<"b">, axis<"c">>;
  const m3 m{2, 1, 3};
  auto out = spmd(m, [&] {
    local_tensor<float, 1, m3, m3::all_axes> x({1}, m, device_index());
    auto v = axis_index<"c", "a">(x);
    auto one = axis_index<"c">(x);
    return std::array<std::size_t, 4>{axis_index<"c", "a">(), static_cast<std::size_t>(*v.data()),
                                      static_cast<std::size_t>(*one.data()), axis_size<"c", "a">()};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    const auto c = m.coords(dev);
    CHECK(out[dev][0] == c[2] * 2 + c[0]);
    CHECK(out[dev][1] == c[2] * 2 + c[0]);
    CHECK(out[dev][2] == c[2]);
    CHECK(out[dev][3] == 6);
  }
}

TEST_CASE("forget_dims: the JAX tutorial's psum_scatter of an already scattered block, and all_to_all with split = concat",
          "[collectives][forget_dims]") {
  const mesh2 m{2, 2};
  using x_t = local_tensor<std::int32_t, 1, mesh2, I | J, 0, dim_masks<I>>;  // dim 0 is a block of 'i'
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<x_t>(m, {4});
    auto s = psum_scatter<"i", 0>(forget_dims<"i">(x));
    auto t = all_to_all<"i", 0, 0>(forget_dims<"i">(x));
    return std::array{coll_test::capture(s), coll_test::capture(t)};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    const auto g = members(m, dev, {0});
    const std::size_t w = position(m, dev, {0});
    REQUIRE(out[dev][0].shape == std::vector<std::size_t>{2});
    for (std::size_t i = 0; i < 2; ++i) CHECK(out[dev][0].data[i] == value<std::int32_t>(g[0], w * 2 + i) + value<std::int32_t>(g[1], w * 2 + i));
    REQUIRE(out[dev][1].shape == std::vector<std::size_t>{4});
    for (std::size_t p = 0; p < 2; ++p)
      for (std::size_t i = 0; i < 2; ++i) CHECK(out[dev][1].data[p * 2 + i] == value<std::int32_t>(g[p], w * 2 + i));
  }
}

TEST_CASE("pmean of integers is a true division, as JAX's (never truncated)", "[collectives][pmean]") {
  using m1 = mesh<axis<"x">>;
  const m1 m{4};
  using L = local_tensor<std::int32_t, 1, m1, m1::all_axes>;
  auto out = spmd(m, [&] {
    L x({1}, m, device_index());
    x.data()[0] = static_cast<std::int32_t>(device_index() == 0 ? 1 : 0);  // mean 0.25, truncated 0
    auto mean = pmean<"x">(x);
    return static_cast<double>(mean.data()[0]);
  });
  for (double v : out) CHECK(v == 0.25);
}

TEST_CASE("reshape of a local block keeps row-major order; a wrong element count is a sharding_error",
          "[collectives][reshape]") {
  using m1 = mesh<axis<"x">>;
  const m1 m{2};
  using L = local_tensor<std::int32_t, 2, m1, m1::all_axes, 0, dim_masks<m1::all_axes, 0>>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, {2, 3});
    auto r = reshape(x, std::array<std::size_t, 3>{3, 1, 2});
    static_assert(std::is_same_v<decltype(r), local_tensor<std::int32_t, 3, m1, m1::all_axes>>);
    const std::string bad = coll_test::message_of<sharding_error>([&] { (void)reshape(x, std::array<std::size_t, 1>{5}); });
    return std::pair{coll_test::capture(r), bad};
  });
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    CHECK(out[dev].first.shape == std::vector<std::size_t>{3, 1, 2});
    for (std::size_t i = 0; i < 6; ++i) CHECK(out[dev].first.data[i] == value<std::int32_t>(dev, i));
    CHECK(out[dev].second ==
          "meshlib: reshape of a local block of shape (2, 3) (6 elements) to shape (5,) (5 elements); the element "
          "counts must agree");
  }
}

TEST_CASE("untiled forms refuse a split dimension other than the group size; messages name the group",
          "[collectives][untiled]") {
  using m3 = mesh<axis<"a">, axis<"b">, axis<"c">>;
  const m3 m{2, 1, 3};
  using L = local_tensor<float, 2, m3, m3::all_axes>;
  auto out = spmd(m, [&] {
    L z({4, 2}, m, device_index());
    return std::array{
        coll_test::message_of<sharding_error>([&] { (void)psum_scatter<axis_group<"c", "a">, 0>(z, untiled); }),
        coll_test::message_of<sharding_error>([&] { (void)all_to_all<axis_group<"c", "a">, 0, 1>(z, untiled); }),
        coll_test::message_of<sharding_error>([&] { (void)all_to_all<"c", 1, 0>(z); })};
  });
  CHECK(out[0][0] == "meshlib: psum_scatter over ('c', 'a') (group size 6) splits dimension 0 of size 4, which the "
                     "untiled form needs to equal 6");
  CHECK(out[0][1] == "meshlib: all_to_all over ('c', 'a') (group size 6) splits dimension 0 of size 4, which the "
                     "untiled form needs to equal 6");
  CHECK(out[0][2] == "meshlib: all_to_all over 'c' (group size 3) splits dimension 1 of size 2, which is not "
                     "divisible by 3");
}

TEST_CASE("shard_map of an uneven input explains shard_map's own rule", "[collectives][shard_map]") {
  using m1 = mesh<axis<"x">>;
  const m1 m{4};
  auto x = zeros<float>(named_sharding<m1, P<"x">>{m, shard_rule::uneven}, std::array<std::size_t, 1>{6});
  auto f = shard_map([](auto b) { return b; }, m, P<"x">{}, P<"x">{});
  CHECK(coll_test::message_of<sharding_error>([&] { (void)f(x); }) ==
        "meshlib: shard_map: input 0 has global shape (6,), whose dimension 0 (size 6) does not split evenly into "
        "the 4 shards of axis 'x' (size 4) in its in_spec P<\"x\">; shard_map needs equal blocks on every device (as "
        "JAX's): pad the dimension to a multiple of 4, or shard it over fewer devices");
}
