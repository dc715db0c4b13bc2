// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// matmul_into against a naive triple loop over explicitly transposed copies: every transpose pair,
// alpha and beta, the BLAS edge cases (beta = 0 ignores NaN in C, k = 0, empty C), strided views,
// and the shape errors word for word; on the BLAS path (float, double with Kokkos Kernels) and on
// meshlib's own Kokkos kernel (int, and float forced through tensor::detail::matmul_into_kernel).
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/config.hpp"
#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

template <class T>
using host_view = Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace>;

template <class T>
host_view<T> make(std::size_t r, std::size_t c, int seed) {
  auto v = meshlib::tensor::detail::allocate<T, 2, Kokkos::HostSpace>({r, c}, "test", false);
  for (std::size_t i = 0; i < r; ++i)
    for (std::size_t j = 0; j < c; ++j) v(i, j) = static_cast<T>(static_cast<int>((i * 7 + j * 3 + static_cast<std::size_t>(seed)) % 11) - 5);
  return v;
}

/// `alpha * op(A) op(B) + beta * C0`, computed from explicit transposes (independent of the strides
/// and loop orders under test). Small integers: exact in every type used here.
template <class T>
std::vector<double> reference(const host_view<T>& a, const host_view<T>& b, const std::vector<double>& c0, bool ta,
                              bool tb, double alpha, double beta) {
  const std::size_t m = ta ? a.extent(1) : a.extent(0), k = ta ? a.extent(0) : a.extent(1);
  const std::size_t n = tb ? b.extent(0) : b.extent(1);
  std::vector<double> opa(m * k), opb(k * n), out(m * n);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t p = 0; p < k; ++p) opa[i * k + p] = static_cast<double>(ta ? a(p, i) : a(i, p));
  for (std::size_t p = 0; p < k; ++p)
    for (std::size_t j = 0; j < n; ++j) opb[p * n + j] = static_cast<double>(tb ? b(j, p) : b(p, j));
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t p = 0; p < k; ++p) s += opa[i * k + p] * opb[p * n + j];
      out[i * n + j] = alpha * s + (beta == 0 ? 0.0 : beta * c0[i * n + j]);
    }
  return out;
}

template <class V>
std::vector<double> contents(const V& c) {
  std::vector<double> out;
  for (std::size_t i = 0; i < c.extent(0); ++i)
    for (std::size_t j = 0; j < c.extent(1); ++j) out.push_back(static_cast<double>(c(i, j)));
  return out;
}

/// Runs one product through `matmul_into` (Kernel = false) or meshlib's kernel (Kernel = true).
template <bool Kernel, class VC, class VA, class VB>
void run(const VC& c, const VA& a, const VB& b, bool ta, bool tb, double alpha, double beta) {
  using T = typename VC::non_const_value_type;
  if constexpr (Kernel) {
    meshlib::tensor::detail::check_matmul_into_shapes(c, a, b, ta, tb);
    meshlib::tensor::detail::matmul_into_kernel(Kokkos::DefaultHostExecutionSpace(), c, a, b, ta, tb, static_cast<T>(alpha),
                                        static_cast<T>(beta));
  } else {
    meshlib::matmul_into(c, a, b, {.transpose_a = ta, .transpose_b = tb, .alpha = alpha, .beta = beta});
  }
}

/// Every transpose pair on a non-square product (m, k, n) = (5, 7, 3), with several alpha / beta.
template <class T, bool Kernel>
void check_all_transposes() {
  constexpr std::size_t m = 5, k = 7, n = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [alpha, beta] : std::initializer_list<std::pair<double, double>>{{1.0, 0.0}, {2.0, 1.0}, {-3.0, 2.0}, {1.0, -1.0}}) {
        INFO("transpose_a " << ta << ", transpose_b " << tb << ", alpha " << alpha << ", beta " << beta);
        const auto a = ta ? make<T>(k, m, 1) : make<T>(m, k, 1);
        const auto b = tb ? make<T>(n, k, 2) : make<T>(k, n, 2);
        auto c = make<T>(m, n, 3);
        const auto expected = reference(a, b, contents(c), ta, tb, alpha, beta);
        run<Kernel>(c, a, b, ta, tb, alpha, beta);
        CHECK(contents(c) == expected);
      }
}

/// BLAS's edge cases: beta = 0 never reads C (NaN there is ignored), k = 0 gives beta * C, empty C.
template <class T, bool Kernel>
void check_edge_cases() {
  const auto a = make<T>(4, 6, 1), b = make<T>(6, 5, 2);
  if constexpr (std::numeric_limits<T>::has_quiet_NaN) {
    auto c = make<T>(4, 5, 0);
    for (std::size_t i = 0; i < 4; ++i)
      for (std::size_t j = 0; j < 5; ++j) c(i, j) = std::numeric_limits<T>::quiet_NaN();
    run<Kernel>(c, a, b, false, false, 1.0, 0.0);
    CHECK(contents(c) == reference(a, b, std::vector<double>(20, 0.0), false, false, 1.0, 0.0));
    // k = 0 with beta = 0: zeros, whatever C held
    for (std::size_t i = 0; i < 4; ++i)
      for (std::size_t j = 0; j < 5; ++j) c(i, j) = std::numeric_limits<T>::quiet_NaN();
    run<Kernel>(c, make<T>(4, 0, 0), make<T>(0, 5, 0), false, false, 1.0, 0.0);
    CHECK(contents(c) == std::vector<double>(20, 0.0));
  }
  {  // k = 0: C = beta * C (not left as it was), transposed operands too
    auto c = make<T>(4, 5, 3);
    const auto before = contents(c);
    run<Kernel>(c, make<T>(0, 4, 0), make<T>(5, 0, 0), true, true, 1.0, 2.0);
    std::vector<double> doubled;
    for (double v : before) doubled.push_back(2 * v);
    CHECK(contents(c) == doubled);
  }
  {  // alpha = 0: beta * C, A and B not read (NaN in them is ignored where T has NaN)
    auto an = make<T>(4, 6, 1);
    if constexpr (std::numeric_limits<T>::has_quiet_NaN) an(1, 2) = std::numeric_limits<T>::quiet_NaN();
    auto c = make<T>(4, 5, 3);
    const auto before = contents(c);
    run<Kernel>(c, an, b, false, false, 0.0, 1.0);
    CHECK(contents(c) == before);
  }
  {  // m = 0 and n = 0: nothing to write, no error
    auto c0 = make<T>(0, 5, 0);
    run<Kernel>(c0, make<T>(0, 6, 0), b, false, false, 1.0, 0.0);
    auto c1 = make<T>(4, 0, 0);
    run<Kernel>(c1, a, make<T>(6, 0, 0), false, false, 1.0, 0.0);
    CHECK((c0.extent(0) == 0 && c1.extent(1) == 0));
  }
}

}  // namespace

TEST_CASE("matmul_into: every transpose pair, alpha and beta, against a naive product", "[tensor][matmul_into]") {
  check_all_transposes<float, false>();   // KokkosBlas::gemm where meshlib has Kokkos Kernels
  check_all_transposes<double, false>();
  check_all_transposes<int, false>();     // no BLAS for int: meshlib's Kokkos kernel
  check_all_transposes<float, true>();    // meshlib's kernel, forced, for a type that has a BLAS
  check_all_transposes<double, true>();
  STATIC_REQUIRE(!meshlib::tensor::detail::use_blas_v<int, Kokkos::HostSpace>);
  STATIC_REQUIRE(meshlib::tensor::detail::use_blas_v<float, Kokkos::HostSpace> == meshlib::config::kokkos_kernels);
}

TEST_CASE("matmul_into: beta = 0 ignores NaN in C, k = 0 scales C, empty results", "[tensor][matmul_into]") {
  check_edge_cases<float, false>();
  check_edge_cases<double, false>();
  check_edge_cases<int, false>();
  check_edge_cases<float, true>();
  check_edge_cases<double, true>();
}

TEST_CASE("matmul_into: strided views and an explicit execution-space instance", "[tensor][matmul_into]") {
  // Every other column of a wider matrix: LayoutStride views, so meshlib's kernel reads the strides.
  auto wide_a = make<float>(4, 12, 1), wide_c = make<float>(4, 10, 3);
  const auto b = make<float>(6, 5, 2);
  auto a = Kokkos::subview(wide_a, Kokkos::ALL, std::pair<std::size_t, std::size_t>(0, 6));
  auto c = Kokkos::subview(wide_c, Kokkos::ALL, std::pair<std::size_t, std::size_t>(2, 7));
  host_view<float> a_copy = make<float>(4, 6, 0);
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 6; ++j) a_copy(i, j) = a(i, j);
  const auto expected = reference(a_copy, b, contents(c), false, false, 2.0, 1.0);
  const auto wide_before = contents(wide_c);
  meshlib::matmul_into(Kokkos::DefaultHostExecutionSpace(), c, a, b, {.alpha = 2, .beta = 1});
  CHECK(contents(c) == expected);
  auto after = contents(wide_c);
  for (std::size_t i = 0; i < 4; ++i)
    for (int j : {0, 1, 7, 8, 9}) CHECK(after[i * 10 + static_cast<std::size_t>(j)] == wide_before[i * 10 + static_cast<std::size_t>(j)]);
  // A strided A, transposed.
  auto t = Kokkos::subview(wide_a, Kokkos::ALL, std::pair<std::size_t, std::size_t>(6, 11));  // (4, 5)
  host_view<float> t_copy = make<float>(4, 5, 0);
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 5; ++j) t_copy(i, j) = t(i, j);
  auto out = make<float>(5, 6, 0);
  meshlib::matmul_into(out, t, a_copy, {.transpose_a = true});  // (5, 4) . (4, 6)
  CHECK(contents(out) == reference(t_copy, a_copy, contents(out), true, false, 1.0, 0.0));
}

TEST_CASE("matmul_into: a batch of rank-3 views is each matrix's product", "[tensor][matmul_into][batch]") {
  // Attention's products per head and sequence: rank-3 views (batch, rows, cols). On the host each
  // matrix goes through the rank-2 product (per-slice views stay LayoutRight, so the BLAS path), so
  // a batch gives the bits of separate calls; each matrix is also checked against the naive product.
  using v3 = Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::HostSpace>;
  static_assert(std::is_same_v<decltype(Kokkos::subview(v3(), 0, Kokkos::ALL, Kokkos::ALL))::array_layout, Kokkos::LayoutRight>);
  constexpr std::size_t batch = 3, m = 4, k = 6, n = 5;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("transpose_a " << ta << ", transpose_b " << tb);
      v3 a("a", batch, ta ? k : m, ta ? m : k), b("b", batch, tb ? n : k, tb ? k : n), c("c", batch, m, n);
      std::vector<host_view<float>> as, bs, cs;
      for (std::size_t i = 0; i < batch; ++i) {
        as.push_back(ta ? make<float>(k, m, static_cast<int>(i)) : make<float>(m, k, static_cast<int>(i)));
        bs.push_back(tb ? make<float>(n, k, static_cast<int>(i) + 5) : make<float>(k, n, static_cast<int>(i) + 5));
        cs.push_back(make<float>(m, n, static_cast<int>(i) + 9));
        Kokkos::deep_copy(Kokkos::subview(a, i, Kokkos::ALL, Kokkos::ALL), as.back());
        Kokkos::deep_copy(Kokkos::subview(b, i, Kokkos::ALL, Kokkos::ALL), bs.back());
        Kokkos::deep_copy(Kokkos::subview(c, i, Kokkos::ALL, Kokkos::ALL), cs.back());
      }
      std::vector<std::vector<double>> expected;
      for (std::size_t i = 0; i < batch; ++i) expected.push_back(reference(as[i], bs[i], contents(cs[i]), ta, tb, 2.0, 1.0));
      meshlib::matmul_into(c, a, b, {.transpose_a = ta, .transpose_b = tb, .alpha = 2, .beta = 1});
      for (std::size_t i = 0; i < batch; ++i) {
        meshlib::matmul_into(cs[i], as[i], bs[i], {.transpose_a = ta, .transpose_b = tb, .alpha = 2, .beta = 1});
        CHECK(contents(Kokkos::subview(c, i, Kokkos::ALL, Kokkos::ALL)) == expected[i]);
        CHECK(contents(Kokkos::subview(c, i, Kokkos::ALL, Kokkos::ALL)) == contents(cs[i]));  // the separate call's bits
      }
    }
  v3 a("a", 2, 4, 6), b("b", 3, 6, 5), c("c", 2, 4, 5);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { meshlib::matmul_into(c, a, b); }) ==
        "meshlib: matmul_into: a batch of products needs as many matrices in A, B and C (their first dimension), but "
        "A has 2, B 3 and C 2; pass batches of one length");
  v3 b2("b2", 2, 5, 5);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { meshlib::matmul_into(c, a, b2); }) ==
        "meshlib: matmul_into: op(A) . op(B) with A (4, 6) not transposed and B (5, 5) not transposed is (4, 6) . (5, 5): "
        "the contraction sizes 6 and 5 differ; check the operands' shapes and the transpose flags");
}

TEST_CASE("matmul_into: shapes that do not chain are refused naming the shapes and the transposes",
          "[tensor][matmul_into][errors]") {
  auto c = make<float>(3, 5, 0);
  const auto a = make<float>(3, 4, 1), b = make<float>(4, 5, 2);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { meshlib::matmul_into(c, a, b, {.transpose_a = true}); }) ==
        "meshlib: matmul_into: op(A) . op(B) with A (3, 4) transposed and B (4, 5) not transposed is (4, 3) . (4, 5): "
        "the contraction sizes 3 and 4 differ; check the operands' shapes and the transpose flags");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { meshlib::matmul_into(c, a, b, {.transpose_b = true}); }) ==
        "meshlib: matmul_into: op(A) . op(B) with A (3, 4) not transposed and B (4, 5) transposed is (3, 4) . (5, 4): "
        "the contraction sizes 4 and 5 differ; check the operands' shapes and the transpose flags");
  auto wrong = make<float>(3, 6, 0);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { meshlib::matmul_into(wrong, a, b); }) ==
        "meshlib: matmul_into: op(A) . op(B) with A (3, 4) not transposed and B (4, 5) not transposed is (3, 4) . (4, "
        "5) = (3, 5), but C is (3, 6); pass a C of shape (3, 5)");
  auto ci = make<int>(3, 5, 0);
  const auto ai = make<int>(3, 4, 1);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { meshlib::matmul_into(ci, ai, ai); }) ==
        "meshlib: matmul_into: op(A) . op(B) with A (3, 4) not transposed and B (3, 4) not transposed is (3, 4) . (3, "
        "4): the contraction sizes 4 and 3 differ; check the operands' shapes and the transpose flags");
}

TEST_CASE("docs/tensors.md: matmul_into for a dense layer's backward", "[tensor][matmul_into][docs]") {
  const std::size_t rows = 6, in = 4, out = 3;
  const auto x = make<float>(rows, in, 1), w = make<float>(in, out, 2), dy = make<float>(rows, out, 3);
  auto dw = make<float>(in, out, 4);  // the previous micro-batch's gradient
  auto dx = make<float>(rows, in, 0);
  const auto dw_expected = reference(x, dy, contents(dw), true, false, 1.0, 1.0);
  meshlib::matmul_into(dw, x, dy, {.transpose_a = true, .beta = 1});
  meshlib::matmul_into(dx, dy, w, {.transpose_b = true});
  CHECK(contents(dw) == dw_expected);
  CHECK(contents(dx) == reference(dy, w, contents(dx), false, true, 1.0, 0.0));
}

}  // namespace MESHLIB_TEST_UNIT

// ---- where a pointer's memory is (tensor/pointer_check.hpp), with a fake device space -----------------

namespace meshlib_test_pointer {
/// A device memory space as far as meshlib's run-time check is concerned: its "device memory" is
/// the addresses of `device_block`, everything else is host memory.
struct fake_device_space {
  using execution_space = Kokkos::DefaultHostExecutionSpace;
  static constexpr const char* name() noexcept { return "FakeDeviceSpace"; }
};
inline float device_block[16];
}  // namespace meshlib_test_pointer

template <>
struct meshlib::pointer_query<meshlib_test_pointer::fake_device_space> {
  static constexpr bool asks = true;
  static pointer_info of(const void* p) noexcept {
    const auto* b = reinterpret_cast<const char*>(meshlib_test_pointer::device_block);
    const auto* q = static_cast<const char*>(p);
    if (q >= b && q < b + sizeof meshlib_test_pointer::device_block) return {pointer_location::device, 1};
    return {pointer_location::host, -1};
  }
};

namespace MESHLIB_TEST_UNIT {

TEST_CASE("a host pointer handed to a device kernel is refused before the launch, naming the argument", "[tensor][pointer_check]") {
  using fake = meshlib_test_pointer::fake_device_space;
  std::vector<float> host(16);
  // Host spaces are not asked: every pointer is readable there.
  STATIC_REQUIRE_FALSE(meshlib::pointer_query<Kokkos::HostSpace>::asks);
  CHECK(meshlib::is_device_readable<Kokkos::HostSpace>(host.data()));
  CHECK_NOTHROW(meshlib::check_device_readable<Kokkos::HostSpace>(host.data(), "matmul_into", "A"));
  // The fake device: its own block is readable on its GPU (1) or any, not on GPU 0; host memory never.
  CHECK(meshlib::is_device_readable<fake>(meshlib_test_pointer::device_block));
  CHECK(meshlib::is_device_readable<fake>(meshlib_test_pointer::device_block + 3, 1));
  CHECK_FALSE(meshlib::is_device_readable<fake>(meshlib_test_pointer::device_block, 0));
  CHECK_FALSE(meshlib::is_device_readable<fake>(host.data()));
  CHECK(meshlib::is_device_readable<fake>(nullptr));  // an empty block
  CHECK(meshlib_test::message_of<meshlib::memory_space_error>([&] {
          meshlib::check_device_readable<fake>(host.data(), "my_layer::forward", "x");
        }) == "meshlib: my_layer::forward: argument 'x' is host memory, but its kernel runs on " +
                  std::string(Kokkos::DefaultHostExecutionSpace::name()) +
                  " (FakeDeviceSpace); copy it to the device first (meshlib::nn::device_put for a batch, "
                  "meshlib::device_put for an array, Kokkos::deep_copy for a view)");
  CHECK(meshlib_test::message_of<meshlib::memory_space_error>([&] {
          meshlib::check_device_readable<fake>(meshlib_test_pointer::device_block, "matmul_into", "B", 0);
        }) == "meshlib: matmul_into: argument 'B' is memory of GPU 1, but its kernel runs on GPU 0; copy it to that "
              "GPU first (Kokkos::deep_copy)");
  CHECK_NOTHROW(meshlib::check_device_readable<fake>(meshlib_test_pointer::device_block, "matmul_into", "C"));
  // A memory_space_error is a meshlib::error.
  STATIC_REQUIRE(std::is_base_of_v<meshlib::error, meshlib::memory_space_error>);
  // The compile-time half is true where the execution space reads the memory (the refusal is a
  // compile error: tests/cuda/host_view_on_device.cpp in scripts/cuda_compile_check.sh).
  STATIC_REQUIRE(meshlib::require_accessible<meshlib::core::detail::diag_op_t<"matmul_into">, meshlib::core::detail::diag_op_t<"A">,
                                             Kokkos::DefaultHostExecutionSpace, Kokkos::HostSpace>());
}

TEST_CASE("to_host reads a device's block back row-major", "[tensor][pointer_check]") {
  using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
  const mesh_t m{1};
  meshlib::local_tensor<float, 2, mesh_t> x({2, 3}, m, 0);
  for (std::size_t i = 0; i < 2; ++i)
    for (std::size_t j = 0; j < 3; ++j) x(i, j) = static_cast<float>(10 * i + j);
  CHECK(meshlib::to_host(x) == std::vector<float>{0, 1, 2, 10, 11, 12});
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("the GPU's product kernel (one element per work item) against the plain loops", "[tensor][matmul_into][device_kernel]") {
  // The element kernel runs on CUDA only; its arithmetic is checked here on the host, work item by
  // work item, for every transpose pair and alpha / beta, k = 0 and NaN in C with beta = 0.
  constexpr std::size_t m = 5, k = 7, n = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [alpha, beta] : std::initializer_list<std::pair<double, double>>{{1.0, 0.0}, {2.0, 1.0}, {-3.0, 2.0}}) {
        INFO("transpose_a " << ta << ", transpose_b " << tb << ", alpha " << alpha << ", beta " << beta);
        const auto a = ta ? make<float>(k, m, 1) : make<float>(m, k, 1);
        const auto b = tb ? make<float>(n, k, 2) : make<float>(k, n, 2);
        auto c = make<float>(m, n, 3);
        const auto expected = reference(a, b, contents(c), ta, tb, alpha, beta);
        if (beta == 0) c(1, 1) = std::numeric_limits<float>::quiet_NaN();  // not read
        const meshlib::tensor::detail::matmul_into_element_functor<float> f{{a.data(), b.data(), c.data(),
                                                                    ta ? a.stride(1) : a.stride(0),
                                                                    ta ? a.stride(0) : a.stride(1),
                                                                    tb ? b.stride(1) : b.stride(0),
                                                                    tb ? b.stride(0) : b.stride(1), c.stride(0),
                                                                    c.stride(1), n, k, static_cast<float>(alpha),
                                                                    static_cast<float>(beta)}};
        for (std::size_t e = 0; e < m * n; ++e) f(e);
        CHECK(contents(c) == expected);
      }
  auto c = make<float>(2, 2, 3);
  const auto before = contents(c);
  const meshlib::tensor::detail::matmul_into_element_functor<float> f{{nullptr, nullptr, c.data(), 0, 0, 0, 0, 2, 1, 2, 0, 1.0f, 2.0f}};
  for (std::size_t e = 0; e < 4; ++e) f(e);  // k = 0: beta * C, A and B not read
  for (std::size_t e = 0; e < 4; ++e) CHECK(contents(c)[e] == 2 * before[e]);
}

namespace {

/// BLAS's column-major gemm as its reference documentation defines it, element by element:
/// `C(i, j) = alpha sum_p op(X)(i, p) op(Y)(p, j) + beta C(i, j)`, `X(r, c) = x[r + c ldx]`.
/// Independent of `make_column_major_product`, whose arguments it is fed.
void column_major_gemm(bool tx, bool ty, std::size_t m, std::size_t n, std::size_t k, double alpha, const float* x,
                       std::size_t ldx, const float* y, std::size_t ldy, double beta, float* c, std::size_t ldc) {
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t p = 0; p < k; ++p)
        s += static_cast<double>(tx ? x[p + i * ldx] : x[i + p * ldx]) * static_cast<double>(ty ? y[j + p * ldy] : y[p + j * ldy]);
      c[i + j * ldc] = static_cast<float>(alpha * s + (beta == 0 ? 0.0 : beta * static_cast<double>(c[i + j * ldc])));
    }
}

}  // namespace

TEST_CASE("cuBLAS's arguments for a row-major or column-major product, run through a column-major gemm",
          "[tensor][matmul_into][cublas]") {
  // What matmul_into hands cuBLAS on a GPU (tensor/cublas_product.hpp), checked on the host: the
  // arguments fed to the BLAS definition give the naive product, for every transpose pair, padded
  // leading dimensions and both layouts.
  constexpr std::size_t m = 5, k = 7, n = 3, pad = 2;
  for (bool row_major : {true, false})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        INFO("row_major " << row_major << ", transpose_a " << ta << ", transpose_b " << tb);
        const std::size_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
        // Stored with padding: row-major rows of (cols + pad), column-major columns of (rows + pad).
        const std::size_t lda = (row_major ? ac : ar) + pad, ldb = (row_major ? bc : br) + pad,
                          ldc = (row_major ? n : m) + pad;
        const auto at = [&](std::size_t r, std::size_t c, std::size_t ld) { return row_major ? r * ld + c : r + c * ld; };
        std::vector<float> a((row_major ? ar : ac) * lda), b((row_major ? br : bc) * ldb), c((row_major ? m : n) * ldc);
        for (std::size_t r = 0; r < ar; ++r)
          for (std::size_t q = 0; q < ac; ++q) a[at(r, q, lda)] = static_cast<float>(static_cast<int>((r * 7 + q * 3 + 1) % 11) - 5);
        for (std::size_t r = 0; r < br; ++r)
          for (std::size_t q = 0; q < bc; ++q) b[at(r, q, ldb)] = static_cast<float>(static_cast<int>((r * 5 + q * 2 + 2) % 9) - 4);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j) c[at(i, j, ldc)] = static_cast<float>(i + 2 * j);
        std::vector<float> expected(m * n);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j) {
            double s = 0;
            for (std::size_t p = 0; p < k; ++p)
              s += static_cast<double>(ta ? a[at(p, i, lda)] : a[at(i, p, lda)]) *
                   static_cast<double>(tb ? b[at(j, p, ldb)] : b[at(p, j, ldb)]);
            expected[i * n + j] = static_cast<float>(2 * s + 3 * static_cast<double>(c[at(i, j, ldc)]));
          }
        const auto g = meshlib::tensor::detail::make_column_major_product(row_major, ta, tb, m, n, k, lda, ldb, ldc);
        CHECK(g.b_first == row_major);
        column_major_gemm(g.trans_first, g.trans_second, g.m, g.n, g.k, 2.0, g.b_first ? b.data() : a.data(), g.ld_first,
                          g.b_first ? a.data() : b.data(), g.ld_second, 3.0, c.data(), g.ld_c);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j) CHECK(c[at(i, j, ldc)] == expected[i * n + j]);
      }
  // A strided batch (attention's products): matrix i of each operand starts stride * i further on,
  // the strides handed over in the operands' BLAS order.
  {
    constexpr std::size_t batch = 3, sa = m * k + 1, sb = k * n + 2, sc = m * n + 3;
    std::vector<float> a(batch * sa), b(batch * sb), c(batch * sc, 1.0f);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(static_cast<int>(i % 7) - 3);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(static_cast<int>(i % 5) - 2);
    const auto g = meshlib::tensor::detail::make_column_major_product(true, false, true, m, n, k, k, k, n);
    const auto st = meshlib::tensor::detail::make_batch_strides(g, sa, sb, sc);
    CHECK((st.first == sb && st.second == sa && st.c == sc));
    for (std::size_t i = 0; i < batch; ++i)
      column_major_gemm(g.trans_first, g.trans_second, g.m, g.n, g.k, 1.0, b.data() + i * st.first, g.ld_first,
                        a.data() + i * st.second, g.ld_second, 0.0, c.data() + i * st.c, g.ld_c);
    for (std::size_t i = 0; i < batch; ++i)
      for (std::size_t r = 0; r < m; ++r)
        for (std::size_t q = 0; q < n; ++q) {
          double s = 0;  // row-major A[i] (m x k), B[i] stored n x k and transposed
          for (std::size_t p = 0; p < k; ++p) s += static_cast<double>(a[i * sa + r * k + p]) * static_cast<double>(b[i * sb + q * k + p]);
          CHECK(c[i * sc + r * n + q] == static_cast<float>(s));
        }
  }
  // BLAS wants every leading dimension >= 1, even of an operand with no columns.
  const auto empty = meshlib::tensor::detail::make_column_major_product(true, false, false, 4, 0, 3, 3, 0, 0);
  CHECK((empty.ld_first == 1 && empty.ld_second == 3 && empty.ld_c == 1));
}

}  // namespace MESHLIB_TEST_UNIT
