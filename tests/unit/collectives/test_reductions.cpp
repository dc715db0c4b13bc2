// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// psum / pmean / pmax / pmin on 1-D and 2-D meshes, several shapes and element types, against
// host-computed references; the result types (vary / partial / dims) they compute at compile time.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "collectives_support.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;
using coll_test::value;

namespace {

using mesh1 = mesh<axis<"x">>;
using mesh2 = mesh<axis<"data">, axis<"model">>;

// ---- result types: checked at compile time -----------------------------------------------------
using l2 = local_tensor<float, 2, mesh2, mesh2::mask_of<"data", "model">(), 0,
                       dim_masks<mesh2::mask_of<"data">(), mesh2::mask_of<"model">()>>;
using psum_model_t = decltype(psum<"model">(std::declval<l2>()));
static_assert(psum_model_t::vary == mesh2::mask_of<"data">() && psum_model_t::partial == 0);
static_assert(std::is_same_v<psum_model_t::dims_type, dim_masks<mesh2::mask_of<"data">(), 0>>);
using psum_both_t = decltype(psum<"data", "model">(std::declval<l2>()));
static_assert(psum_both_t::vary == 0 && std::is_same_v<psum_both_t::dims_type, dim_masks<0, 0>>);
// A partial value: psum completes it.
using partial_t = local_tensor<double, 1, mesh2, mesh2::mask_of<"data">(), mesh2::mask_of<"model">()>;
using completed_t = decltype(psum<"model">(std::declval<partial_t>()));
static_assert(completed_t::vary == mesh2::mask_of<"data">() && completed_t::partial == 0);
using pmean_t = decltype(pmean<"model">(std::declval<partial_t>()));
static_assert(pmean_t::partial == 0);
using pmax_t = decltype(pmax<"data">(std::declval<l2>()));
static_assert(pmax_t::vary == mesh2::mask_of<"model">());

template <class T>
void check_1d_reductions(std::size_t n, std::array<std::size_t, 2> shape) {
  mesh1 m{n};
  using L = local_tensor<T, 2, mesh1, mesh1::mask_of<"x">()>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, shape);
    // pmean of integers is a floating value (JAX's true division); seen here as T's mean type U.
    auto mean = pmean<"x">(x);
    static_assert(std::is_same_v<typename decltype(mean)::value_type, collectives::detail::mean_value_t<T>>);
    return std::pair{std::array{coll_test::capture(psum<"x">(x)), coll_test::capture(pmax<"x">(x)),
                                coll_test::capture(pmin<"x">(x))},
                     coll_test::capture(mean)};
  });
  const std::size_t size = shape[0] * shape[1];
  for (std::size_t dev = 0; dev < n; ++dev) {
    const auto& r = out[dev].first;
    const auto& mean = out[dev].second;
    for (std::size_t k = 0; k < 3; ++k) REQUIRE(r[k].shape == std::vector<std::size_t>{shape[0], shape[1]});
    REQUIRE(mean.shape == std::vector<std::size_t>{shape[0], shape[1]});
    for (std::size_t i = 0; i < size; ++i) {
      long long sum = 0, mx = std::numeric_limits<long long>::min(), mn = std::numeric_limits<long long>::max();
      for (std::size_t d = 0; d < n; ++d) {
        const long long v = static_cast<long long>(d) * 1000 + static_cast<long long>(i) * 3 - 7;
        sum += v;
        mx = std::max(mx, v);
        mn = std::min(mn, v);
      }
      CHECK(r[0].data[i] == static_cast<T>(sum));
      // pmean: the sum (in T) divided by n in U, as JAX's psum(x) / n: never truncated for integers.
      using U = collectives::detail::mean_value_t<T>;
      CHECK(mean.data[i] == static_cast<U>(static_cast<U>(static_cast<T>(sum)) / static_cast<U>(n)));
      CHECK(r[1].data[i] == static_cast<T>(mx));
      CHECK(r[2].data[i] == static_cast<T>(mn));
    }
  }
}

}  // namespace

TEST_CASE("psum / pmean / pmax / pmin over a 1-D mesh match host references", "[collectives][reductions]") {
  SECTION("float, 4 devices, (3, 5)") { check_1d_reductions<float>(4, {3, 5}); }
  SECTION("double, 3 devices, (1, 7)") { check_1d_reductions<double>(3, {1, 7}); }
  SECTION("int32, 8 devices, (2, 2)") { check_1d_reductions<std::int32_t>(8, {2, 2}); }
  SECTION("int64, 2 devices, (4, 1)") { check_1d_reductions<std::int64_t>(2, {4, 1}); }
  SECTION("float, 1 device") { check_1d_reductions<float>(1, {2, 3}); }
}

TEST_CASE("psum over one axis of a 2-D mesh sums exactly that axis group", "[collectives][reductions]") {
  for (auto [a, b] : {std::pair<std::size_t, std::size_t>{2, 2}, {2, 3}, {3, 2}, {1, 4}}) {
    mesh2 m{a, b};
    using L = local_tensor<std::int64_t, 1, mesh2, mesh2::all_axes>;
    auto out = spmd(m, [&] {
      auto x = coll_test::make_block<L>(m, {5});
      return std::array{coll_test::capture(psum<"model">(x)), coll_test::capture(psum<"data">(x)),
                        coll_test::capture(psum<"data", "model">(x)), coll_test::capture(pmax<"model">(x))};
    });
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      const auto c = m.coords(dev);
      for (std::size_t i = 0; i < 5; ++i) {
        std::int64_t over_model = 0, over_data = 0, over_all = 0, max_model = std::numeric_limits<std::int64_t>::min();
        for (std::size_t d = 0; d < m.size(); ++d) {
          const auto cd = m.coords(d);
          const auto v = value<std::int64_t>(d, i);
          if (cd[0] == c[0]) over_model += v, max_model = std::max(max_model, v);
          if (cd[1] == c[1]) over_data += v;
          over_all += v;
        }
        CHECK(out[dev][0].data[i] == over_model);
        CHECK(out[dev][1].data[i] == over_data);
        CHECK(out[dev][2].data[i] == over_all);
        CHECK(out[dev][3].data[i] == max_model);
      }
    }
  }
}

TEST_CASE("psum completes a partial value and leaves other axes varying", "[collectives][reductions]") {
  mesh2 m{2, 2};
  using P_t = local_tensor<float, 1, mesh2, mesh2::mask_of<"data">(), mesh2::mask_of<"model">()>;
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<P_t>(m, {3});
    auto y = psum<"model">(x);
    static_assert(decltype(y)::partial == 0 && decltype(y)::vary == mesh2::mask_of<"data">());
    return coll_test::capture(y);
  });
  for (std::size_t dev = 0; dev < 4; ++dev) {
    const std::size_t row = m.coords(dev)[0];
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(out[dev].data[i] == value<float>(row * 2, i) + value<float>(row * 2 + 1, i));
  }
}

TEST_CASE("psum and pmax of bfloat16 blocks (small integers, exact in bfloat16)", "[collectives][reductions]") {
  mesh1 m{4};
  using L = local_tensor<bfloat16, 1, mesh1, mesh1::mask_of<"x">()>;
  auto out = spmd(m, [&] {
    L x(std::array<std::size_t, 1>{6}, m, device_index());
    for (std::size_t i = 0; i < 6; ++i) x(i) = bfloat16(static_cast<float>(device_index() * 3 + i) - 4.0f);
    auto s = psum<"x">(x);
    auto mx = pmax<"x">(x);
    std::vector<float> r;
    for (std::size_t i = 0; i < 6; ++i) r.push_back(static_cast<float>(s(i)));
    for (std::size_t i = 0; i < 6; ++i) r.push_back(static_cast<float>(mx(i)));
    return r;
  });
  for (std::size_t dev = 0; dev < 4; ++dev)
    for (std::size_t i = 0; i < 6; ++i) {
      float sum = 0;
      for (std::size_t d = 0; d < 4; ++d) sum += static_cast<float>(d * 3 + i) - 4.0f;
      CHECK(out[dev][i] == sum);
      CHECK(out[dev][6 + i] == static_cast<float>(9 + i) - 4.0f);
    }
}

// A donated psum (an rvalue) sums in the value's own buffer when nothing else holds it: the result
// has the input's data pointer and the right sums. A value something else still holds is copied
// first, so the holder keeps its data.
TEST_CASE("psum of a donated value reuses its buffer; of a shared one, copies", "[collectives][psum][donation]") {
  mesh1 m{3};
  using L = local_tensor<std::int64_t, 2, mesh1, mesh1::mask_of<"x">()>;
  const std::array<std::size_t, 2> shape{2, 5};
  auto out = spmd(m, [&] {
    auto x = coll_test::make_block<L>(m, shape);
    const auto* before = x.data();
    auto donated = psum<"x">(std::move(x));
    const bool reused = donated.data() == before;
    auto y = coll_test::make_block<L>(m, shape);
    const L holder = y;  // a second holder: y's buffer must survive unchanged
    auto copied = psum<"x">(std::move(y));
    const bool fresh = copied.data() != holder.data();
    return std::tuple{reused, fresh, coll_test::capture(donated), coll_test::capture(copied), coll_test::capture(holder)};
  });
  for (std::size_t dev = 0; dev < 3; ++dev) {
    INFO("device " << dev);
    CHECK(std::get<0>(out[dev]));
    CHECK(std::get<1>(out[dev]));
    for (std::size_t i = 0; i < 10; ++i) {
      long long sum = 0;
      for (std::size_t d = 0; d < 3; ++d) sum += static_cast<long long>(d) * 1000 + static_cast<long long>(i) * 3 - 7;
      CHECK(std::get<2>(out[dev]).data[i] == sum);
      CHECK(std::get<3>(out[dev]).data[i] == sum);
      CHECK(std::get<4>(out[dev]).data[i] == static_cast<long long>(dev) * 1000 + static_cast<long long>(i) * 3 - 7);
    }
  }
}

// A value over a caller's buffer (a view made from a pointer: no holder count) is the caller's to
// donate: psum / pmax / pmin of it reduce in that buffer, and the result is a view of it; the
// lvalue forms leave the buffer alone. Every device checks its numbers against the host sums.
TEST_CASE("donated values over a caller's buffer reduce in that buffer", "[collectives][psum][donation]") {
  mesh1 m{3};
  using L = local_tensor<std::int64_t, 1, mesh1, mesh1::mask_of<"x">()>;
  constexpr std::size_t n = 7;
  auto out = spmd(m, [&] {
    const std::size_t dev = device_index();
    std::array<std::int64_t, 3 * n> buf{};
    for (std::size_t k = 0; k < 3; ++k)
      for (std::size_t i = 0; i < n; ++i) buf[k * n + i] = value<std::int64_t>(dev, i + k);
    const auto before = buf;
    auto over = [&](std::size_t k) { return L(L::view_type(buf.data() + k * n, n), m, dev); };
    // lvalue: out of place, the caller's buffer keeps its values
    const L kept = over(0);
    auto copied = psum<"x">(kept);
    const bool lvalue_untouched = copied.data() != buf.data() && std::equal(buf.begin(), buf.end(), before.begin());
    auto s = psum<"x">(over(0));
    auto mx = pmax<"x">(over(1));
    auto mn = pmin<"x">(over(2));
    const bool in_place = s.data() == buf.data() && mx.data() == buf.data() + n && mn.data() == buf.data() + 2 * n;
    static_assert(decltype(s)::vary == 0 && decltype(mx)::vary == 0 && decltype(mn)::vary == 0);
    return std::tuple{lvalue_untouched, in_place, buf, coll_test::capture(copied)};
  });
  for (std::size_t dev = 0; dev < 3; ++dev) {
    INFO("device " << dev);
    CHECK(std::get<0>(out[dev]));
    CHECK(std::get<1>(out[dev]));
    const auto& buf = std::get<2>(out[dev]);
    for (std::size_t i = 0; i < n; ++i) {
      std::int64_t sum = 0, hi = std::numeric_limits<std::int64_t>::min(), lo = std::numeric_limits<std::int64_t>::max();
      for (std::size_t d = 0; d < 3; ++d) {
        sum += value<std::int64_t>(d, i);
        hi = std::max(hi, value<std::int64_t>(d, i + 1));
        lo = std::min(lo, value<std::int64_t>(d, i + 2));
      }
      CHECK(buf[i] == sum);
      CHECK(std::get<3>(out[dev]).data[i] == sum);
      CHECK(buf[n + i] == hi);
      CHECK(buf[2 * n + i] == lo);
    }
  }
}

}  // namespace MESHLIB_TEST_UNIT
