// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The backward of each collective is its transpose: <f(x), y> = <x, f^T(y)> with the inner product
// of the global values (a value invariant over the axis counted once, a varying or pending-sum value
// summed over the devices), for every pair of nn/collective_transpose.hpp, on 4 devices.
#include <meshlib.hpp>
#include <meshlib/nn/collective_transpose.hpp>

#include <cmath>
#include <cstddef>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
constexpr meshlib::axis_mask X = mesh_t::mask_of<"x">();
using row_sharded = meshlib::local_tensor<double, 2, mesh_t, X, 0, meshlib::dim_masks<X, 0>>;
using varying_full = meshlib::local_tensor<double, 2, mesh_t, X, 0, meshlib::dim_masks<0, 0>>;
using invariant_full = meshlib::local_tensor<double, 2, mesh_t, 0, 0, meshlib::dim_masks<0, 0>>;
using partial_full = meshlib::local_tensor<double, 2, mesh_t, 0, X, meshlib::dim_masks<0, 0>>;

template <class L>
L filled(const mesh_t& m, std::size_t rows, std::size_t cols, double seed, bool per_device = true) {
  L t(std::array<std::size_t, 2>{rows, cols}, m, meshlib::device_index());
  const double d = per_device ? static_cast<double>(meshlib::device_index()) : 0.0;
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = std::sin(seed + 1.3 * static_cast<double>(i) + 2.1 * d);
  return t;
}

template <class A, class B>
double dot(const A& a, const B& b) {
  REQUIRE(a.size() == b.size());
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a.data()[i] * b.data()[i];
  return s;
}

/// Sum over devices of per-device values; `once`: count device 0's only (an invariant value).
double total(const std::vector<double>& v, bool once = false) {
  if (once) return v[0];
  double s = 0;
  for (double x : v) s += x;
  return s;
}

}  // namespace

TEST_CASE("the backward of each collective is its transpose", "[nn][transpose]") {
  const mesh_t m{4};
  std::vector<double> lhs(4), rhs(4);
  auto check = [&](bool lhs_once, bool rhs_once) {
    CHECK(std::abs(total(lhs, lhs_once) - total(rhs, rhs_once)) < 1e-9 * (1 + std::abs(total(lhs, lhs_once))));
  };

  SECTION("psum <-> pvary") {
    meshlib::spmd(m, [&](std::size_t d) {
      auto x = filled<row_sharded>(m, 2, 3, 0.1);
      auto y = filled<invariant_full>(m, 2, 3, 0.7, false);  // invariant
      auto fx = meshlib::psum<"x">(x);
      static_assert(decltype(meshlib::nn::psum_transpose<"x">(y))::vary == X);
      lhs[d] = dot(fx, y);                                    // invariant: counted once
      rhs[d] = dot(x, meshlib::nn::psum_transpose<"x">(y));   // varying: summed
    });
    check(true, false);
    meshlib::spmd(m, [&](std::size_t d) {  // pvary: the same identity read the other way
      auto y = filled<invariant_full>(m, 2, 3, 0.7, false);
      auto x = filled<varying_full>(m, 2, 3, 0.1);
      lhs[d] = dot(meshlib::pvary<"x">(y), x);
      rhs[d] = dot(y, meshlib::nn::pvary_transpose<"x">(x));
    });
    check(false, true);
  }

  SECTION("all_gather <-> psum_scatter") {
    meshlib::spmd(m, [&](std::size_t d) {
      auto x = filled<row_sharded>(m, 2, 3, 0.2);
      auto y = filled<partial_full>(m, 8, 3, 0.5);  // each device's contribution to the cotangent
      auto g = meshlib::all_gather<"x", 0>(x);
      lhs[d] = dot(g, y);
      auto back = meshlib::nn::all_gather_transpose<"x", 0>(y);
      static_assert(std::is_same_v<decltype(back), row_sharded>);
      rhs[d] = dot(x, back);
    });
    check(false, false);
    meshlib::spmd(m, [&](std::size_t d) {  // an invariant cotangent: the device's own chunk
      auto x = filled<row_sharded>(m, 2, 3, 0.2);
      auto y = filled<invariant_full>(m, 8, 3, 0.5, false);
      lhs[d] = dot(meshlib::all_gather<"x", 0>(x), y);
      rhs[d] = dot(x, meshlib::nn::all_gather_transpose<"x", 0>(y));
    });
    check(true, false);
    meshlib::spmd(m, [&](std::size_t d) {
      auto x = filled<varying_full>(m, 8, 3, 0.3);
      auto y = filled<row_sharded>(m, 2, 3, 0.9);
      lhs[d] = dot(meshlib::psum_scatter<"x", 0>(x), y);
      rhs[d] = dot(x, meshlib::nn::psum_scatter_transpose<"x", 0>(y));
    });
    check(false, false);
  }

  SECTION("all_to_all <-> the reverse all_to_all") {
    meshlib::spmd(m, [&](std::size_t d) {
      auto x = filled<row_sharded>(m, 2, 8, 0.4);
      auto fx = meshlib::all_to_all<"x", 1, 0>(x);
      auto y = filled<decltype(fx)>(m, 8, 2, 1.1);
      auto back = meshlib::nn::all_to_all_transpose<"x", 1, 0>(y);
      static_assert(std::is_same_v<decltype(back), row_sharded>);
      lhs[d] = dot(fx, y);
      rhs[d] = dot(x, back);
    });
    check(false, false);
  }

  SECTION("ppermute <-> the inverse permutation") {
    const std::vector<std::pair<std::size_t, std::size_t>> perm{{0, 2}, {2, 1}, {1, 3}, {3, 0}};
    meshlib::spmd(m, [&](std::size_t d) {
      auto x = filled<row_sharded>(m, 2, 3, 0.6);
      auto y = filled<row_sharded>(m, 2, 3, 1.7);
      lhs[d] = dot(meshlib::ppermute<"x">(x, perm), y);
      rhs[d] = dot(x, meshlib::nn::ppermute_transpose<"x">(y, perm));
    });
    check(false, false);
  }
}

}  // namespace MESHLIB_TEST_UNIT
