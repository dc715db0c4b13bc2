// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The typed collectives' workspace (collectives/workspace.hpp): after the first call of a shape,
// psum / pmean / pmax / pmin / all_gather / psum_scatter allocate nothing (counted by Kokkos'
// own allocation hook, so every allocation counts, not only the workspace's); a result that is
// still held is never overwritten by a later call; results equal host-computed sums.
#include <atomic>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives_support.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;
using coll_test::value;

namespace {

using mesh1 = mesh<axis<"x">>;

// Kokkos' allocation hook: counts every View allocation in the process while armed.
std::atomic<long> kokkos_allocations{0};
void count_allocation(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t) {
  kokkos_allocations.fetch_add(1, std::memory_order_relaxed);
}

struct allocation_counter {
  allocation_counter() {
    kokkos_allocations = 0;
    Kokkos::Tools::Experimental::set_allocate_data_callback(&count_allocation);
  }
  ~allocation_counter() { Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr); }
  allocation_counter(const allocation_counter&) = delete;
  allocation_counter& operator=(const allocation_counter&) = delete;
};

// Allocations (Kokkos' count, summed over devices) made by 100 calls of `op` after one warm-up
// call, on an n-device mesh; the sum of the results' first elements is checked on the way.
template <class Op>
std::tuple<long, long, std::size_t> allocations_of_100_calls(std::size_t n, Op op) {
  mesh1 m{n};
  std::atomic<long> during{0};
  std::vector<std::size_t> workspace_count(n);
  std::vector<long> bad(n, 0);
  allocation_counter counter;
  spmd(m, [&](std::size_t dev) {
    using L = local_tensor<float, 2, mesh1, mesh1::mask_of<"x">()>;
    auto x = coll_test::make_block<L>(m, {4, 8});
    (void)op(x);  // warm-up: the workspace gets its buffers
    // Every device passes the warm-up before any counts (the counter is process-wide).
    (void)psum<"x">(x);
    const std::size_t before_ws = collectives::detail::current_device("test").workspace().allocations();
    const long start = kokkos_allocations.load();
    (void)psum<"x">(x);
    for (int i = 0; i < 100; ++i) {
      auto r = op(x);
      if (r.size() == 0 || r.data() == nullptr) ++bad[dev];
    }
    (void)psum<"x">(x);  // every device is done calling op before any reads the count
    during += kokkos_allocations.load() - start;
    workspace_count[dev] = collectives::detail::current_device("test").workspace().allocations() - before_ws;
  });
  long bad_total = 0;
  for (auto b : bad) bad_total += b;
  std::size_t ws = 0;
  for (auto w : workspace_count) ws += w;
  return {during.load(), bad_total, ws};
}

}  // namespace

TEST_CASE("typed collectives allocate nothing after warm-up", "[collectives][workspace]") {
  for (std::size_t n : {2u, 4u}) {
    INFO(n << " devices");
    // The hook is live (Kokkos calls it once a tool callback is set): a fresh block is counted.
    bool hook_live = false;
    {
      allocation_counter counter;
      auto v = tensor::detail::allocate<float, 1>(std::array<std::size_t, 1>{3});
      hook_live = kokkos_allocations.load() == 1;
    }
#if KOKKOS_VERSION < 40000
    REQUIRE(hook_live);  // Debian's 3.4.1 calls it; the workspace's own count is checked anyway
#endif
    const auto check = [&](auto op) {
      const auto [during, bad, ws] = allocations_of_100_calls(n, op);
      CHECK(bad == 0);
      if (hook_live) CHECK(during == 0);
      CHECK(ws == 0);
    };
    check([](const auto& x) { return psum<"x">(x); });
    check([](const auto& x) { return pmean<"x">(x); });
    check([](const auto& x) { return pmax<"x">(x); });
    check([](const auto& x) { return pmin<"x">(x); });
    check([](const auto& x) { return all_gather<"x", 0>(x); });
    check([](const auto& x) { return all_gather<"x", 1>(x); });  // staged and unpacked
    check([](const auto& x) { return psum_scatter<"x", 0>(x); });
    check([](const auto& x) { return psum_scatter<"x", 1>(x); });  // packed first
    check([](const auto& x) { return all_to_all<"x", 1, 0>(x); });
  }
}

TEST_CASE("a held collective result is never overwritten by a later call", "[collectives][workspace]") {
  for (std::size_t n : {2u, 3u, 4u}) {
    INFO(n << " devices");
    mesh1 m{n};
    using L = local_tensor<std::int64_t, 2, mesh1, mesh1::mask_of<"x">()>;
    const std::array<std::size_t, 2> shape{3, 4};
    auto out = spmd(m, [&](std::size_t dev) {
      auto x = coll_test::make_block<L>(m, shape);
      L y(shape, m, dev);
      for (std::size_t i = 0; i < y.size(); ++i) y.data()[i] = -5 * static_cast<std::int64_t>(dev + i) + 11;
      auto r1 = psum<"x">(x);
      auto g1 = all_gather<"x", 1>(x);
      auto s1 = psum_scatter<"x", 1>(L(tensor::detail::allocate<std::int64_t, 2>({3, 4 * n}), m, dev));
      auto r2 = psum<"x">(y);  // same shape and type as r1: must not reuse r1's buffer
      auto g2 = all_gather<"x", 1>(y);
      auto r3 = psum<"x">(std::move(y));  // donation must not pick r1's buffer either
      {
        auto tmp = psum<"x">(x);  // dropped at once: its buffer goes back to the workspace
      }
      auto r4 = psum<"x">(x);  // may reuse tmp's buffer, not r1's, r2's or r3's
      const bool distinct = r1.data() != r2.data() && r1.data() != r3.data() && r1.data() != r4.data() &&
                            r2.data() != r3.data() && r2.data() != r4.data() && r3.data() != r4.data();
      return std::tuple{coll_test::capture(r1), coll_test::capture(r2), coll_test::capture(g1), coll_test::capture(g2),
                        coll_test::capture(r4), distinct, coll_test::capture(s1), coll_test::capture(r3)};
    });
    for (std::size_t dev = 0; dev < n; ++dev) {
      INFO("device " << dev);
      const auto& [r1, r2, g1, g2, r4, distinct, s1, r3] = out[dev];
      CHECK(distinct);
      for (std::size_t i = 0; i < 12; ++i) {
        long long sx = 0, sy = 0;
        for (std::size_t d = 0; d < n; ++d) {
          sx += value<long long>(d, i);
          sy += -5 * static_cast<long long>(d + i) + 11;
        }
        CHECK(r1.data[i] == sx);
        CHECK(r4.data[i] == sx);
        CHECK(r2.data[i] == sy);
        CHECK(r3.data[i] == sy);
      }
      // all_gather along dimension 1: row r of the result is [row r of device 0, of device 1, ...].
      REQUIRE(g1.shape == std::vector<std::size_t>{3, 4 * n});
      for (std::size_t r = 0; r < 3; ++r)
        for (std::size_t d = 0; d < n; ++d)
          for (std::size_t c = 0; c < 4; ++c) {
            const std::size_t i = r * 4 + c;
            CHECK(g1.data[r * 4 * n + d * 4 + c] == value<long long>(d, i));
            CHECK(g2.data[r * 4 * n + d * 4 + c] == -5 * static_cast<long long>(d + i) + 11);
          }
      CHECK(s1.shape == std::vector<std::size_t>{3, 4});
      for (auto v : s1.data) CHECK(v == 0);
    }
  }
}

TEMPLATE_TEST_CASE("workspace results equal host sums for every dtype and shape", "[collectives][workspace]", float,
                   double, std::int32_t, std::int64_t) {
  using T = TestType;
  for (std::size_t n : {2u, 4u}) {
    mesh1 m{n};
    for (std::array<std::size_t, 2> shape : {std::array<std::size_t, 2>{1, 1}, {5, 3}, {64, 33}, {0, 4}}) {
      INFO(n << " devices, shape " << shape[0] << "x" << shape[1]);
      using L = local_tensor<T, 2, mesh1, mesh1::mask_of<"x">()>;
      auto out = spmd(m, [&] {
        auto x = coll_test::make_block<L>(m, shape);
        std::vector<coll_test::seen<T>> sums;
        for (int k = 0; k < 3; ++k) sums.push_back(coll_test::capture(psum<"x">(x)));  // reused buffers
        return std::pair{sums, coll_test::capture(pmax<"x">(x))};
      });
      const std::size_t size = shape[0] * shape[1];
      for (std::size_t dev = 0; dev < n; ++dev) {
        for (const auto& s : out[dev].first) {
          REQUIRE(s.shape == std::vector<std::size_t>{shape[0], shape[1]});
          for (std::size_t i = 0; i < size; ++i) {
            long long sum = 0;
            for (std::size_t d = 0; d < n; ++d) sum += static_cast<long long>(value<long long>(d, i));
            CHECK(static_cast<long long>(s.data[i]) == sum);
          }
        }
        for (std::size_t i = 0; i < size; ++i)
          CHECK(static_cast<long long>(out[dev].second.data[i]) == value<long long>(n - 1, i));
      }
    }
  }
}

TEST_CASE("the workspace outlives the call: the next call reuses its buffers, never a result that left",
          "[collectives][workspace]") {
  thread_runner runner;  // device d runs on the same thread in every call (device 0 on this one)
  for (std::size_t n : {2u, 4u}) {
    INFO(n << " devices");
    mesh1 m{n};
    using L = local_tensor<float, 2, mesh1, mesh1::mask_of<"x">()>;
    const std::array<std::size_t, 2> shape{16, 8};
    using R = decltype(psum<"x">(std::declval<const L&>()));
    std::vector<R> left(n);                   // results that leave the first call
    std::vector<const float*> returned(n);    // the buffer of a result dropped within it
    spmd(
        m,
        [&](std::size_t dev) {
          auto x = coll_test::make_block<L>(m, shape);
          left[dev] = psum<"x">(x);
          auto r = psum<"x">(x);
          returned[dev] = r.data();
        },
        runner);
    std::vector<std::size_t> allocations(n);
    std::vector<int> reused(n), overwrote(n);
    std::vector<std::vector<float>> second(n);
    spmd(
        m,
        [&](std::size_t dev) {
          L y(shape, m, dev);
          for (std::size_t i = 0; i < y.size(); ++i) y.data()[i] = 2.0f * static_cast<float>(i) - static_cast<float>(dev);
          auto& ws = collectives::detail::current_device("test").workspace();
          const std::size_t before = ws.allocations();
          auto r = psum<"x">(y);
          allocations[dev] = ws.allocations() - before;
          reused[dev] = r.data() == returned[dev];
          overwrote[dev] = r.data() == left[dev].data();
          second[dev].assign(r.data(), r.data() + r.size());
        },
        runner);
    for (std::size_t dev = 0; dev < n; ++dev) {
      INFO("device " << dev);
      CHECK(allocations[dev] == 0);
      CHECK(reused[dev] == 1);
      CHECK(overwrote[dev] == 0);
      for (std::size_t i = 0; i < 16 * 8; ++i) {
        float sx = 0, sy = 0;
        for (std::size_t d = 0; d < n; ++d) {
          sx += value<float>(d, i);
          sy += 2.0f * static_cast<float>(i) - static_cast<float>(d);
        }
        CHECK(left[dev].data()[i] == sx);  // the first call's result, untouched by the second
        CHECK(second[dev][i] == sy);
      }
    }
  }
}

TEST_CASE("a workspace keeps at most max_shapes shapes", "[collectives][workspace]") {
  mesh1 m{2};
  using L = local_tensor<float, 2, mesh1, mesh1::mask_of<"x">()>;
  std::vector<std::size_t> kept(2);
  std::vector<int> ok(2, 1);
  spmd(m, [&](std::size_t dev) {
    const std::size_t shapes = collectives::detail::collective_workspace::max_shapes + 8;
    for (std::size_t k = 1; k <= shapes; ++k) {
      auto x = coll_test::make_block<L>(m, {k, 3});
      auto r = psum<"x">(x);
      for (std::size_t i = 0; i < r.size(); ++i)
        if (r.data()[i] != value<float>(0, i) + value<float>(1, i)) ok[dev] = 0;
    }
    kept[dev] = collectives::detail::current_device("test").workspace().shapes();
  });
  for (std::size_t dev = 0; dev < 2; ++dev) {
    CHECK(ok[dev] == 1);
    CHECK(kept[dev] <= collectives::detail::collective_workspace::max_shapes);
    CHECK(kept[dev] > 0);
  }
}

}  // namespace MESHLIB_TEST_UNIT
