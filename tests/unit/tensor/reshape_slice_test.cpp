// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// reshape, slice, pad and concatenate on local blocks (tensor/reshape.hpp, tensor/slice.hpp):
// every element against index arithmetic written here, for every dimension and every legal
// [start, stop), the laws in the headers' @post, the result types (sharding kept), and the
// run-time refusals, which name the dimension.
#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/exec.hpp"
#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {
using namespace meshlib;
using mesh1 = mesh<axis<"data">>;
constexpr axis_mask D = mesh1::mask_of<"data">();
using shape3 = std::array<std::size_t, 3>;
using rows3 = local_tensor<double, 3, mesh1, D, 0, dim_masks<D, 0, 0>>;  // P<"data", none, none>
using repl3 = local_tensor<double, 3, mesh1, 0, 0, dim_masks<0, 0, 0>>;
using part3 = local_tensor<double, 3, mesh1, 0, D, dim_masks<0, 0, 0>>;  // a pending sum over data

// reshape drops the per-dimension record (a local step, as in JAX); vary and partial are kept.
static_assert(std::is_same_v<decltype(reshape(std::declval<rows3>(), std::array<std::size_t, 2>{})),
                             local_tensor<double, 2, mesh1, D, 0, dim_masks<0, 0>>>);
static_assert(std::is_same_v<decltype(reshape(std::declval<rows3>(), std::array<std::size_t, 4>{})),
                             local_tensor<double, 4, mesh1, D, 0, dim_masks<0, 0, 0, 0>>>);
static_assert(std::is_same_v<decltype(reshape(std::declval<part3>(), std::array<std::size_t, 1>{})),
                             local_tensor<double, 1, mesh1, 0, D, dim_masks<0>>>);
// broadcast_in_dim inserts an unsharded dimension, or one recorded as like's.
static_assert(std::is_same_v<decltype(broadcast_in_dim<1>(std::declval<rows3>(), 4)),
                             local_tensor<double, 4, mesh1, D, 0, dim_masks<D, 0, 0, 0>>>);
static_assert(std::is_same_v<decltype(broadcast_in_dim<0>(std::declval<local_tensor<double, 2, mesh1, D>>(),
                                                          std::declval<rows3>())),
                             rows3>);
// slice, pad and concatenate keep the type.
static_assert(std::is_same_v<decltype(slice<2>(std::declval<rows3>(), 0, 1)), rows3>);
static_assert(std::is_same_v<decltype(pad<1>(std::declval<part3>(), 0, 1)), part3>);
static_assert(std::is_same_v<decltype(concatenate<1>(std::declval<rows3>(), std::declval<rows3>())), rows3>);

/// A block of `shape` whose element at flat index i is 1000 * (device + 1) + i.
template <class L>
L numbered(const shape3& shape, const mesh1& m, std::size_t dev) {
  L x(shape, m, dev);
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = 1000.0 * static_cast<double>(dev + 1) + static_cast<double>(i);
  return x;
}

std::vector<double> host(const auto& t) { return to_host(t); }

/// The row-major flat index of (i0, i1, i2) in `shape`.
std::size_t at(const shape3& s, std::size_t i0, std::size_t i1, std::size_t i2) { return (i0 * s[1] + i1) * s[2] + i2; }

/// Runs `f(dev)` on every device of a 2-device mesh and returns the failures it reports.
template <class F>
std::vector<std::string> on_two_devices(F f) {
  const mesh1 m{2};
  std::vector<std::string> failures(2);
  meshlib::spmd(m, [&](std::size_t dev) { failures[dev] = f(m, dev); });
  return failures;
}

}  // namespace

TEST_CASE("reshape keeps the elements in row-major order and round-trips", "[tensor][reshape]") {
  // Catch2's assertions are not thread-safe: device threads describe their failures, the test thread checks.
  const auto failures = on_two_devices([](const mesh1& m, std::size_t dev) -> std::string {
    const shape3 s{2, 3, 4};
    const auto x = numbered<rows3>(s, m, dev);
    const auto hx = host(x);
    for (const auto& shape : {std::array<std::size_t, 3>{2, 12, 1}, std::array<std::size_t, 3>{2, 2, 6},
                              std::array<std::size_t, 3>{1, 1, 24}, std::array<std::size_t, 3>{4, 3, 2},
                              std::array<std::size_t, 3>{24, 1, 1}, std::array<std::size_t, 3>{3, 4, 2}}) {
      const auto y = reshape(x, shape);
      if (y.shape() != shape) return "reshape: wrong shape";
      if (host(y) != hx) return "reshape: elements moved";
      const auto back = reshape(y, s);
      static_assert(std::is_same_v<std::remove_cvref_t<decltype(back)>, with_dims_t<rows3, dim_masks<0, 0, 0>>>);
      if (back.shape() != s || host(back) != hx) return "reshape back: not x";
    }
    const auto flat = reshape(x, std::array<std::size_t, 2>{2, 12});
    if (host(flat) != hx || flat.extent(1) != 12) return "reshape to rank 2";
    // with no sharded dimension, any shape of the same size
    const auto r = numbered<repl3>(s, m, dev);
    const auto one = reshape(r, std::array<std::size_t, 1>{24});
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(one)>, local_tensor<double, 1, mesh1>>);
    if (host(one) != host(r)) return "reshape of a replicated block";
    if (host(reshape(r, shape3{4, 3, 2})) != host(r)) return "reshape (4, 3, 2)";
    return "";
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("reshape refuses a shape of another size, naming both", "[tensor][reshape]") {
  const mesh1 m{2};
  const auto x = numbered<rows3>(shape3{2, 3, 4}, m, 0);
  try {
    (void)reshape(x, shape3{2, 3, 5});
    FAIL("reshape changed the size");
  } catch (const sharding_error& e) {
    CHECK(std::string(e.what()) == "meshlib: reshape of a local block of shape (2, 3, 4) (24 elements) to shape "
                                   "(2, 3, 5) (30 elements); the element counts must agree");
  }
}

TEST_CASE("slice, pad and concatenate move the right elements along every dimension", "[tensor][slice]") {
  const auto failures = on_two_devices([](const mesh1& m, std::size_t dev) -> std::string {
    const shape3 s{3, 4, 5};
    const auto x = numbered<repl3>(s, m, dev);
    const auto hx = host(x);
    std::string fail;
    const auto check_dim = [&]<std::size_t Dim>(std::integral_constant<std::size_t, Dim>) {
      for (std::size_t start = 0; start <= s[Dim]; ++start)
        for (std::size_t stop = start; stop <= s[Dim]; ++stop) {
          const auto y = slice<Dim>(x, start, stop);
          shape3 ys = s;
          ys[Dim] = stop - start;
          if (y.shape() != ys) fail = "slice: shape";
          const auto hy = host(y);
          for (std::size_t i0 = 0; i0 < ys[0]; ++i0)
            for (std::size_t i1 = 0; i1 < ys[1]; ++i1)
              for (std::size_t i2 = 0; i2 < ys[2]; ++i2) {
                std::array<std::size_t, 3> src{i0, i1, i2};
                src[Dim] += start;
                if (hy[at(ys, i0, i1, i2)] != hx[at(s, src[0], src[1], src[2])]) fail = "slice: element";
              }
          // pad is slice's transpose: pad(slice(x)) is x with zeros outside [start, stop)
          const auto p = host(pad<Dim>(y, start, s[Dim] - stop));
          for (std::size_t i0 = 0; i0 < s[0]; ++i0)
            for (std::size_t i1 = 0; i1 < s[1]; ++i1)
              for (std::size_t i2 = 0; i2 < s[2]; ++i2) {
                const std::size_t k = std::array<std::size_t, 3>{i0, i1, i2}[Dim];
                const double want = k >= start && k < stop ? hx[at(s, i0, i1, i2)] : 0.0;
                if (p[at(s, i0, i1, i2)] != want) fail = "pad(slice(x)): element";
              }
          // slice(pad(x)) is x; concatenate of the pieces is x
          if (host(slice<Dim>(pad<Dim>(x, start, stop), start, start + s[Dim])) != hx) fail = "slice(pad(x))";
          if (host(concatenate<Dim>(slice<Dim>(x, 0, start), slice<Dim>(x, start, stop), slice<Dim>(x, stop, s[Dim]))) != hx)
            fail = "concatenate of the slices";
        }
    };
    check_dim(std::integral_constant<std::size_t, 0>{});
    check_dim(std::integral_constant<std::size_t, 1>{});
    check_dim(std::integral_constant<std::size_t, 2>{});
    // a sharded block slices and concatenates along its whole dimensions
    const auto r = numbered<rows3>(s, m, dev);
    if (host(concatenate<2>(slice<2>(r, 0, 2), slice<2>(r, 2, 5))) != host(r)) fail = "sharded block: concatenate";
    const auto twice = concatenate<1>(r, r);
    if (twice.extent(1) != 8 || host(slice<1>(twice, 4, 8)) != host(r)) fail = "concatenate<1>(r, r)";
    return fail;
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("broadcast_in_dim repeats the block along the new dimension, at every position", "[tensor][broadcast]") {
  const auto failures = on_two_devices([](const mesh1& m, std::size_t dev) -> std::string {
    using two = local_tensor<double, 2, mesh1, D>;
    two x(std::array<std::size_t, 2>{3, 4}, m, dev);
    for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<double>(dev * 100 + i);
    const auto hx = host(x);
    const auto b0 = host(broadcast_in_dim<0>(x, 5));  // (5, 3, 4)
    const auto b1 = host(broadcast_in_dim<1>(x, 5));  // (3, 5, 4)
    const auto b2 = host(broadcast_in_dim<2>(x, 5));  // (3, 4, 5)
    for (std::size_t i = 0; i < 3; ++i)
      for (std::size_t j = 0; j < 4; ++j)
        for (std::size_t k = 0; k < 5; ++k) {
          const double want = hx[i * 4 + j];
          if (b0[(k * 3 + i) * 4 + j] != want || b1[(i * 5 + k) * 4 + j] != want || b2[(i * 4 + j) * 5 + k] != want)
            return "broadcast_in_dim: element";
        }
    // sum<D>(broadcast_in_dim<D>(x, n)) is n x
    if (host(sum<1>(broadcast_in_dim<1>(x, 5))) != host(x * 5.0)) return "sum of the broadcast";
    const rows3 like(shape3{7, 3, 4}, m, dev);
    if (broadcast_in_dim<0>(x, like).extent(0) != 7) return "broadcast_in_dim like: extent";
    return "";
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("slice and concatenate refuse shapes that do not fit, naming the dimension", "[tensor][slice]") {
  const mesh1 m{2};
  const auto x = numbered<repl3>(shape3{3, 4, 5}, m, 0);
  try {
    (void)slice<1>(x, 2, 5);
    FAIL("slice past the end");
  } catch (const sharding_error& e) {
    CHECK(std::string(e.what()).find("slice<1>: [2, 5) is not within dimension 1 of the block (3, 4, 5)") != std::string::npos);
  }
  const auto y = numbered<repl3>(shape3{3, 2, 5}, m, 0);
  CHECK_THROWS_AS(concatenate<0>(x, y), sharding_error);
  try {
    (void)concatenate<2>(x, y);
    FAIL("concatenate of blocks that differ in dimension 1");
  } catch (const sharding_error& e) {
    CHECK(std::string(e.what()).find("differ in dimension 1") != std::string::npos);
  }
  CHECK(concatenate<1>(x, y).extent(1) == 6);
}

}  // namespace MESHLIB_TEST_UNIT
