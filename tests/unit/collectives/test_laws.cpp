// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Laws the collectives obey, checked over every 2-D mesh shape up to 3 x 3 and both axes:
//   all_gather(psum_scatter(x)) == psum(x)                       (reduce-scatter + all-gather = all-reduce)
//   all_to_all<s, c>(all_to_all<c, s>(x)) == x                   (all_to_all is invertible)
//   ppermute(ppermute(x, perm), inverse(perm)) == x              (a full permutation loses nothing)
//   broadcast(x, i) == all_gather(x, untiled)[i]                  (broadcast is a gather and a pick)
//   pmean(n * x) == psum(x)                                       (pmean is psum / n)
#include <cstdint>
#include <vector>

#include "collectives_support.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {

using mesh2 = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh2::mask_of<"data">();
constexpr axis_mask M = mesh2::mask_of<"model">();

template <fixed_string A, class T>
std::size_t law_violations(const mesh2& m) {
  constexpr axis_mask bit = mesh2::mask_of<A>();
  const std::size_t n = m.axis_size<A>();
  using L = local_tensor<T, 2, mesh2, D | M>;
  using Lsharded = local_tensor<T, 2, mesh2, D | M, 0, dim_masks<bit, 0>>;
  auto bad = spmd(m, [&] {
    std::size_t v = 0;
    auto x = coll_test::make_block<L>(m, {2 * n, 3 * n});
    auto eq = [&](const auto& a, const auto& b) {
      if (a.shape() != b.shape()) return false;
      for (std::size_t i = 0; i < a.size(); ++i)
        if (a.data()[i] != b.data()[i]) return false;
      return true;
    };
    // reduce-scatter + all-gather = all-reduce (integers: exact in any order)
    v += !eq(all_gather<A, 1>(psum_scatter<A, 1>(x)), psum<A>(x));
    // all_to_all round trip: split 0 / concat 1, then split 1 / concat 0
    auto xs = Lsharded(x.view(), x.mesh(), x.device());
    v += !eq(all_to_all<A, 0, 1>(all_to_all<A, 1, 0>(xs)), xs);
    // ppermute by a rotation, then by its inverse
    std::vector<std::pair<std::size_t, std::size_t>> rot, inv;
    for (std::size_t i = 0; i < n; ++i) {
      rot.push_back({i, (i + 1) % n});
      inv.push_back({(i + 1) % n, i});
    }
    v += !eq(ppermute<A>(ppermute<A>(x, rot), inv), x);
    // broadcast from each index = the matching slice of the untiled gather
    auto stacked = all_gather<A, 0>(x, untiled);
    for (std::size_t i = 0; i < n; ++i) {
      auto b = broadcast<A>(x, i);
      for (std::size_t k = 0; k < b.size(); ++k) v += b.data()[k] != stacked.data()[i * b.size() + k];
    }
    // pmean(n * x) == psum(x): pmean is the sum divided by the axis size
    L nx(x.shape(), x.mesh(), x.device());
    for (std::size_t k = 0; k < x.size(); ++k) nx.data()[k] = x.data()[k] * static_cast<T>(n);
    v += !eq(pmean<A>(nx), psum<A>(x));
    return v;
  });
  std::size_t total = 0;
  for (auto b : bad) total += b;
  return total;
}

}  // namespace

TEST_CASE("collective laws over every 2-D mesh up to 3 x 3", "[collectives][laws]") {
  for (std::size_t a = 1; a <= 3; ++a)
    for (std::size_t b = 1; b <= 3; ++b) {
      const mesh2 m{a, b};
      INFO("mesh " << m);
      CHECK(law_violations<"data", std::int32_t>(m) == 0);
      CHECK(law_violations<"model", std::int32_t>(m) == 0);
      CHECK(law_violations<"model", std::int64_t>(m) == 0);
      CHECK(law_violations<"data", double>(m) == 0);
    }
}

}  // namespace MESHLIB_TEST_UNIT
