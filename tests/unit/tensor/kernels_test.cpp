// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Local kernels and their sharding propagation, global and local view, checked against the plain
// loops of reference.hpp on 1-D and 2-D meshes, even and uneven shapes, four dtypes.
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"
#include "reference.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {
using namespace meshlib;
using mesh1 = mesh<axis<"x">>;
using mesh2 = mesh<axis<"data">, axis<"model">>;
using shape2 = std::array<std::size_t, 2>;

template <class T>
bool near(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (std::abs(x - y) > 1e-5 * (1.0 + std::abs(y))) return false;
  }
  return true;
}

template <class V>
auto values(const V& v) {
  return std::vector<typename V::non_const_value_type>(v.data(), v.data() + v.size());
}

// --- static sharding propagation -----------------------------------------------------------------
using s_dm = named_sharding<mesh2, P<"data", "model">>;
using s_md = named_sharding<mesh2, P<"model", "data">>;
using s_m0 = named_sharding<mesh2, P<"model">>;
using s_0m = named_sharding<mesh2, P<none, "model">>;
using s_d = named_sharding<mesh2, P<"data">>;
using s_r = named_sharding<mesh2, P<>>;
using l_dm = entry_local_t<float, 2, s_dm>;
using l_m0 = entry_local_t<float, 2, s_m0>;
using l_r = entry_local_t<float, 2, s_r>;
using l_0m = entry_local_t<float, 2, s_0m>;
constexpr axis_mask D = 1, M = 2;

// reductions
static_assert(std::is_same_v<decltype(sum<1>(std::declval<l_dm>())), local_tensor<float, 1, mesh2, D, M, dim_masks<D>>>);
static_assert(std::is_same_v<decltype(sum<0>(std::declval<l_dm>())), local_tensor<float, 1, mesh2, M, D, dim_masks<M>>>);
static_assert(std::is_same_v<decltype(mean<1>(std::declval<l_dm>())), local_tensor<float, 1, mesh2, D, M, dim_masks<D>>>);
static_assert(std::is_same_v<decltype(max<1>(std::declval<l_dm>())), local_tensor<float, 1, mesh2, D | M, 0, dim_masks<D>>>);
static_assert(std::is_same_v<decltype(sum<0>(std::declval<entry_local_t<int, 1, s_r>>())), local_tensor<int, 0, mesh2, 0, 0, dim_masks<>>>);
static_assert(std::is_same_v<decltype(mean<0>(std::declval<entry_local_t<int, 2, s_r>>()))::value_type, double>);
// a sum of a partial value stays partial (linear); sum over a replicated dim changes nothing
using l_partial = decltype(sum<1>(std::declval<l_dm>()));
static_assert(std::is_same_v<decltype(sum<0>(std::declval<l_partial>())), local_tensor<float, 0, mesh2, 0, D | M, dim_masks<>>>);
// elementwise keeps the layout; linear ops allowed on partial values
static_assert(std::is_same_v<decltype(std::declval<l_dm>() * 2.0f + 1.0f), l_dm>);
static_assert(std::is_same_v<decltype(std::declval<l_partial>() * 2.0f - std::declval<l_partial>()), l_partial>);
static_assert(std::is_same_v<decltype(map([](float v) { return static_cast<double>(v); }, std::declval<l_dm>())),
                             with_value_t<l_dm, double>>);
// transpose swaps dims
static_assert(std::is_same_v<decltype(transpose(std::declval<l_dm>()))::dims_type, dim_masks<M, D>>);
static_assert(std::is_same_v<decltype(transpose(std::declval<sharded_tensor<float, 2, s_d>>()))::spec_type, P<none, "data">>);
static_assert(std::is_same_v<decltype(transpose(std::declval<sharded_tensor<float, 2, s_0m>>()))::spec_type, P<"model">>);
// matmul (GSPMD): batch x replicated, column-sharded weights, contraction sharded on both sides
static_assert(std::is_same_v<decltype(matmul(std::declval<entry_local_t<float, 2, s_d>>(), std::declval<l_r>())),
                             local_tensor<float, 2, mesh2, D, 0, dim_masks<D, 0>>>);
static_assert(std::is_same_v<decltype(matmul(std::declval<l_r>(), std::declval<l_0m>())),
                             local_tensor<float, 2, mesh2, M, 0, dim_masks<0, M>>>);
static_assert(std::is_same_v<decltype(matmul(std::declval<l_dm>(), std::declval<l_m0>())),
                             local_tensor<float, 2, mesh2, D, M, dim_masks<D, 0>>>);
static_assert(std::is_same_v<decltype(matmul(std::declval<sharded_tensor<float, 2, s_dm>>(),
                                             std::declval<sharded_tensor<float, 2, s_m0>>()))::spec_type,
                             P<"data">>);
static_assert(std::is_same_v<decltype(sum<0>(std::declval<sharded_tensor<float, 2, s_dm>>()))::spec_type, P<"model">>);
static_assert(std::is_same_v<decltype(sum<1>(std::declval<sharded_tensor<float, 2, s_dm>>()))::spec_type, P<"data">>);

// --- elementwise ---------------------------------------------------------------------------------
template <class T>
void check_elementwise_2d() {
  mesh2 m{2, 3};
  s_dm s{m};
  const shape2 shape{6, 9};
  const auto hx = ref::iota<T>(54, 1, 17);
  const auto hy = ref::iota<T>(54, 5, 13);
  auto x = from_host(s, shape, hx);
  auto y = from_host(s, shape, hy);
  std::vector<T> e1(54), e2(54), e3(54), e4(54), e5(54);
  for (std::size_t i = 0; i < 54; ++i) {
    e1[i] = static_cast<T>(hx[i] * T{2} + T{1});
    e2[i] = static_cast<T>(hx[i] - hy[i]);
    e3[i] = static_cast<T>(hx[i] * hy[i]);
    e4[i] = hx[i] > hy[i] ? hx[i] : hy[i];
    e5[i] = static_cast<T>(T{3} - hx[i]);
  }
  CHECK((x * 2 + 1).to_host() == e1);
  CHECK((x - y).to_host() == e2);
  CHECK((x * y).to_host() == e3);
  CHECK(zip([](T a, T b) { return a > b ? a : b; }, x, y).to_host() == e4);
  CHECK((3 - x).to_host() == e5);
  CHECK((-(-x)).to_host() == hx);
  auto as_double = map([](T v) { return static_cast<double>(v) / 2; }, x);
  static_assert(std::is_same_v<typename decltype(as_double)::value_type, double>);
  for (std::size_t i = 0; i < 54; ++i) CHECK(as_double.to_host()[i] == static_cast<double>(hx[i]) / 2);
  // local view: each device's block of x * 2 + 1 is the block of the expected array
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    const auto c = m.coords(dev);
    auto l = x.local_value(dev) * 2 + 1;
    CHECK(values(l.view()) == ref::block2(e1, 9, c[0] * 3, c[0] * 3 + 3, c[1] * 3, c[1] * 3 + 3));
    auto z = zip([](T a, T b) { return a > b ? a : b; }, x.local_value(dev), y.local_value(dev));
    CHECK(values(z.view()) == ref::block2(e4, 9, c[0] * 3, c[0] * 3 + 3, c[1] * 3, c[1] * 3 + 3));
  }
}

}  // namespace

TEST_CASE("elementwise kernels keep the sharding and compute exactly", "[tensor][elementwise]") {
  check_elementwise_2d<float>();
  check_elementwise_2d<double>();
  check_elementwise_2d<std::int32_t>();
  check_elementwise_2d<std::int64_t>();
  SECTION("1-D mesh, uneven blocks") {
    mesh1 m{4};
    named_sharding<mesh1, P<"x">> s{m, shard_rule::uneven};
    const auto h = ref::iota<std::int64_t>(10);
    auto x = from_host(s, std::array<std::size_t, 1>{10}, h);
    auto y = x * 3 - 1;
    for (std::size_t i = 0; i < 10; ++i) CHECK(y.to_host()[i] == h[i] * 3 - 1);
    CHECK(y.local(3).extent(0) == 1);
  }
  SECTION("shapes must agree at run time") {
    mesh1 m{2};
    named_sharding<mesh1, P<"x">> s{m};
    auto a = zeros<float>(s, std::array<std::size_t, 1>{4});
    auto b = zeros<float>(s, std::array<std::size_t, 1>{6});
    REQUIRE_THROWS_AS(a + b, sharding_error);
  }
}

namespace {
template <class T>
void check_reductions_2d() {
  using U = std::conditional_t<std::is_floating_point_v<T>, T, double>;
  mesh2 m{2, 3};
  const shape2 shape{6, 12};
  const auto h = ref::iota<T>(72, 3, 23);
  auto run = [&](auto sharding) {
    auto x = from_host(sharding, shape, h);
    CHECK(sum<0>(x).to_host() == ref::reduce<T>(h, shape, 0, ref::op::sum));
    CHECK(sum<1>(x).to_host() == ref::reduce<T>(h, shape, 1, ref::op::sum));
    CHECK(max<0>(x).to_host() == ref::reduce<T>(h, shape, 0, ref::op::max));
    CHECK(max<1>(x).to_host() == ref::reduce<T>(h, shape, 1, ref::op::max));
    CHECK(near(mean<0>(x).to_host(), ref::reduce<U>(h, shape, 0, ref::op::mean)));
    CHECK(near(mean<1>(x).to_host(), ref::reduce<U>(h, shape, 1, ref::op::mean)));
  };
  run(s_dm{m});
  run(s_md{m});
  run(named_sharding<mesh2, P<none, axes("data", "model")>>{m});
  run(s_r{m});
}

// Local view: device results are partial (sum, mean) or varying (max) over the reduced dimension's
// axes; completing them over the group by hand gives the global answer.
template <class T>
void check_local_reductions() {
  mesh2 m{2, 3};
  const shape2 shape{4, 9};
  s_dm s{m};
  const auto h = ref::iota<T>(36, -4, 19);
  auto x = from_host(s, shape, h);
  const auto rs = ref::reduce<T>(h, shape, 1, ref::op::sum);
  const auto rm = ref::reduce<T>(h, shape, 1, ref::op::max);
  const auto ra = ref::reduce<double>(h, shape, 1, ref::op::mean);
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    std::vector<T> total(2, T{}), best(2, std::numeric_limits<T>::lowest());
    std::vector<double> avg(2, 0.0);
    for (std::size_t g : m.group<"model">(dev)) {
      auto l = x.local_value(g);
      auto ps = sum<1>(l);
      auto pm = max<1>(l);
      auto pa = mean<1>(l);
      for (std::size_t i = 0; i < 2; ++i) {
        total[i] += ps(i);
        best[i] = std::max(best[i], pm(i));
        avg[i] += static_cast<double>(pa(i));
      }
    }
    const std::size_t r0 = m.coords(dev)[0] * 2;
    CHECK(total == std::vector<T>(rs.begin() + r0, rs.begin() + r0 + 2));
    CHECK(best == std::vector<T>(rm.begin() + r0, rm.begin() + r0 + 2));
    CHECK(near(avg, std::vector<double>(ra.begin() + r0, ra.begin() + r0 + 2)));
  }
}
}  // namespace

TEST_CASE("reductions along a dimension", "[tensor][reduce]") {
  check_reductions_2d<float>();
  check_reductions_2d<double>();
  check_reductions_2d<std::int32_t>();
  check_reductions_2d<std::int64_t>();
  check_local_reductions<float>();
  check_local_reductions<std::int64_t>();
  SECTION("rank 3 on a 1-D mesh, uneven") {
    mesh1 m{4};
    const std::array<std::size_t, 3> shape{3, 10, 2};
    const auto h = ref::iota<double>(60, 1, 11);
    named_sharding<mesh1, P<none, "x">> s{m, shard_rule::uneven};
    auto x = from_host(s, shape, h);
    CHECK(sum<1>(x).to_host() == ref::reduce<double>(h, shape, 1, ref::op::sum));
    CHECK(max<1>(x).to_host() == ref::reduce<double>(h, shape, 1, ref::op::max));
    CHECK(near(mean<1>(x).to_host(), ref::reduce<double>(h, shape, 1, ref::op::mean)));
    CHECK(sum<2>(x).to_host() == ref::reduce<double>(h, shape, 2, ref::op::sum));
    auto r0 = sum<0>(x);
    static_assert(std::is_same_v<decltype(r0)::spec_type, P<"x">>);
    CHECK(r0.to_host() == ref::reduce<double>(h, shape, 0, ref::op::sum));
  }
  SECTION("a rank-1 reduction gives a replicated scalar") {
    mesh1 m{4};
    named_sharding<mesh1, P<"x">> s{m};
    const auto h = ref::iota<std::int32_t>(8);
    auto t = sum<0>(from_host(s, std::array<std::size_t, 1>{8}, h));
    static_assert(decltype(t)::rank == 0);
    for (std::size_t dev = 0; dev < 4; ++dev) CHECK(t.local(dev)() == 36);
  }
}

TEST_CASE("transpose swaps dimensions with their sharding", "[tensor][transpose]") {
  mesh2 m{2, 3};
  const auto h = ref::iota<std::int32_t>(6 * 33);  // not a multiple of the 32-tile
  auto x = from_host(s_dm{m}, shape2{6, 33}, h);
  auto t = transpose(x);
  static_assert(std::is_same_v<decltype(t)::spec_type, P<"model", "data">>);
  CHECK(t.global_shape() == shape2{33, 6});
  CHECK(t.to_host() == ref::transpose(h, 6, 33));
  auto lt = transpose(x.local_value(4));
  CHECK(values(lt.view()) == ref::transpose(values(x.local(4)), 3, 11));
}

namespace {
template <class T, class SA, class SB>
void check_matmul(const SA& sa, const SB& sb, std::size_t mm, std::size_t k, std::size_t n) {
  const auto ha = ref::iota<T>(mm * k, 1, 7);
  const auto hb = ref::iota<T>(k * n, 2, 5);
  auto a = from_host(sa, shape2{mm, k}, ha);
  auto b = from_host(sb, shape2{k, n}, hb);
  auto c = matmul(a, b);
  CHECK(c.global_shape() == shape2{mm, n});
  CHECK(c.to_host() == ref::matmul(ha, hb, mm, k, n));
}

template <class T>
void check_matmul_all() {
  mesh2 m{2, 3};
  check_matmul<T>(s_d{m}, s_r{m}, 6, 5, 7);                          // batch x replicated
  check_matmul<T>(s_r{m}, s_0m{m}, 4, 5, 9);                         // column-sharded weights
  check_matmul<T>(s_dm{m}, s_m0{m}, 6, 9, 4);                        // contraction on 'model'
  check_matmul<T>(named_sharding<mesh2, P<none, axes("data", "model")>>{m},
                  named_sharding<mesh2, P<axes("data", "model")>>{m}, 3, 12, 5);  // contraction on both axes
  check_matmul<T>(s_d{m}, s_0m{m}, 4, 3, 6);                         // rows on data, columns on model
  mesh1 m1{4};
  check_matmul<T>(named_sharding<mesh1, P<"x">>{m1, shard_rule::uneven}, named_sharding<mesh1, P<>>{m1, shard_rule::uneven},
                  10, 5, 3);
  check_matmul<T>(named_sharding<mesh1, P<none, "x">>{m1, shard_rule::uneven},
                  named_sharding<mesh1, P<"x">>{m1, shard_rule::uneven}, 3, 10, 2);  // uneven contraction
}
}  // namespace

TEST_CASE("matmul follows GSPMD's rules and computes exactly", "[tensor][matmul]") {
  check_matmul_all<float>();
  check_matmul_all<double>();
  check_matmul_all<std::int32_t>();
  check_matmul_all<std::int64_t>();
  SECTION("local view: contraction sharded on 'model' gives a partial product whose psum is the answer") {
    mesh2 m{2, 3};
    const auto ha = ref::iota<double>(4 * 6, 1, 9);
    const auto hb = ref::iota<double>(6 * 5, 0, 7);
    auto a = from_host(s_dm{m}, shape2{4, 6}, ha);
    auto b = from_host(s_m0{m}, shape2{6, 5}, hb);
    const auto want = ref::matmul(ha, hb, 4, 6, 5);
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      std::vector<double> total(2 * 5, 0.0);
      for (std::size_t g : m.group<"model">(dev)) {
        auto p = matmul(a.local_value(g), b.local_value(g));
        static_assert(decltype(p)::partial == M && decltype(p)::vary == D);
        for (std::size_t i = 0; i < total.size(); ++i) total[i] += p.data()[i];
      }
      const std::size_t r0 = m.coords(dev)[0] * 2;
      CHECK(total == ref::block2(want, 5, r0, r0 + 2, 0, 5));
    }
  }
  SECTION("empty contraction gives zeros") {
    mesh1 m{2};
    named_sharding<mesh1, P<"x">> s{m};
    named_sharding<mesh1, P<>> r{m};
    auto a = zeros<float>(s, shape2{4, 0});
    auto b = zeros<float>(r, shape2{0, 3});
    for (float v : matmul(a, b).to_host()) CHECK(v == 0.0f);
  }
#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
  SECTION("OpenBLAS is found for the per-device thread setting") { CHECK(set_blas_threads_per_device(1)); }
#endif
}

TEST_CASE("transpose<P...> permutes dimensions of any rank with their sharding", "[tensor][transpose]") {
  mesh2 m{2, 3};
  const std::array<std::size_t, 3> shape{4, 3, 5};
  const auto h = ref::iota<double>(60);
  named_sharding<mesh2, P<"data", "model">> s{m};
  auto x = from_host(s, shape, h);
  // reference: out[a][b][c] with out dims (2, 0, 1) = in[b][c][a]
  std::vector<double> want;
  for (std::size_t a = 0; a < 5; ++a)
    for (std::size_t b = 0; b < 4; ++b)
      for (std::size_t c = 0; c < 3; ++c) want.push_back(h[(b * 3 + c) * 5 + a]);
  auto t = transpose<2, 0, 1>(x);
  static_assert(std::is_same_v<decltype(t)::spec_type, P<none, "data", "model">>);
  CHECK(t.global_shape() == std::array<std::size_t, 3>{5, 4, 3});
  CHECK(t.to_host() == want);
  CHECK(transpose<0, 1, 2>(x).to_host() == h);
  CHECK(transpose<0, 1>(from_host(s_dm{m}, shape2{2, 3}, std::vector<int>{1, 2, 3, 4, 5, 6})).to_host() ==
        std::vector<int>{1, 2, 3, 4, 5, 6});
  auto lt = transpose<1, 2, 0>(x.local_value(5));
  static_assert(std::is_same_v<decltype(lt)::dims_type, dim_masks<M, 0u, D>>);
  CHECK(lt.shape() == std::array<std::size_t, 3>{1, 5, 2});
  // device 5 = (data 1, model 2): rows 2..3, column 2, all of dim 2
  for (std::size_t i = 0; i < 5; ++i)
    for (std::size_t j = 0; j < 2; ++j) CHECK(lt(0, i, j) == h[((2 + j) * 3 + 2) * 5 + i]);
}

TEST_CASE("linear operators on partial local values: the parts still sum to the right answer", "[tensor][elementwise]") {
  mesh2 m{2, 3};
  const auto h = ref::iota<double>(4 * 9, 1, 10);
  auto x = from_host(s_dm{m}, shape2{4, 9}, h);
  const auto rs = ref::reduce<double>(h, shape2{4, 9}, 1, ref::op::sum);
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    std::vector<double> total(2, 0.0);
    for (std::size_t g : m.group<"model">(dev)) {
      auto p = sum<1>(x.local_value(g));            // partial over 'model'
      auto q = (3.0 * p - p / 2.0 + (-p)) * 2.0;    // = 3 p, still partial
      static_assert(decltype(q)::partial == M);
      for (std::size_t i = 0; i < 2; ++i) total[i] += q(i);
    }
    const std::size_t r0 = m.coords(dev)[0] * 2;
    CHECK(total == std::vector<double>{3 * rs[r0], 3 * rs[r0 + 1]});
  }
}

}  // namespace MESHLIB_TEST_UNIT
