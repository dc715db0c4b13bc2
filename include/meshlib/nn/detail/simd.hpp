// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief A few-lane float vector for the elementwise loops of the training step (optimizer
/// updates), written once as a generic body that runs on `float` (the tail, and compilers without
/// vector extensions) and on `simd_float` (the bulk).
///
/// Why not leave it to the auto-vectoriser: `std::sqrt` sets `errno`, which keeps GCC and Clang from
/// vectorising any loop that calls it unless the user builds with `-fno-math-errno`, and GCC 12's
/// `-O2` vectorises only loops whose trip count is a multiple of the vector width. Every lane
/// operation here (+ - * / and `sqrtps`) is the correctly rounded IEEE operation the scalar code
/// performs, so a body gives bitwise the same numbers on `float` and on `simd_float` (the compiler
/// contracts a*b+c into an FMA, where the flags allow it, in both forms alike).
/// @code
/// detail::for_lanes(n, std::array<float, 1>{2.0f}, [&](std::size_t i, const auto& k) {
///   detail::store_at(y, i, detail::sqrt_of(detail::load_as(x, i, k[0])) * k[0]);   // y = 2 sqrt(x)
/// });
/// @endcode

#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__SSE2__) || defined(__AVX__))
#include <immintrin.h>
#define MESHLIB_NN_SIMD 1
#else
#define MESHLIB_NN_SIMD 0
#endif

namespace meshlib::nn::detail {

#if MESHLIB_NN_SIMD
#if defined(__AVX__)
/// Lanes of `simd_float`: the widest float vector the target has (AVX 8, SSE2 4).
inline constexpr std::size_t simd_lanes = 8;
#else
inline constexpr std::size_t simd_lanes = 4;
#endif
/// `simd_lanes` floats (GCC/Clang vector extension: + - * / work lane by lane).
using simd_float = float __attribute__((vector_size(simd_lanes * sizeof(float))));

/// Loads `simd_lanes` floats from `p` (no alignment needed).
inline simd_float load(const float* p) noexcept {
  simd_float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
/// Stores `v` to `p` (no alignment needed).
inline void store(float* p, simd_float v) noexcept { std::memcpy(p, &v, sizeof v); }
/// Every lane `s`.
inline simd_float splat(float s) noexcept {
  simd_float v;
  for (std::size_t i = 0; i < simd_lanes; ++i) v[i] = s;
  return v;
}
/// Lane-wise correctly rounded square root (`sqrtps`, as `std::sqrt` per lane).
inline simd_float sqrt_of(simd_float v) noexcept {
#if defined(__AVX__)
  return reinterpret_cast<simd_float>(_mm256_sqrt_ps(reinterpret_cast<__m256>(v)));
#else
  return reinterpret_cast<simd_float>(_mm_sqrt_ps(reinterpret_cast<__m128>(v)));
#endif
}
#else
inline constexpr std::size_t simd_lanes = 1;
#endif

/// `std::sqrt(v)` (the scalar form of `sqrt_of`).
inline float sqrt_of(float v) noexcept { return std::sqrt(v); }

/// Calls `f(i, c)` for the elements `[0, n)`: over the bulk, for lanes `[i, i + simd_lanes)` with
/// `c` the constants `k` each splat to a `simd_float`; over the rest, for element `i` with `c == k`.
/// `f` reads with `load_as(p, i, c[0])`, writes with `store_at`. The constants are splat once,
/// outside the loop, into a local the stores cannot alias (a member read through `this` in the loop
/// would be reloaded and re-splat after every store).
template <std::size_t K, class F>
void for_lanes(std::size_t n, const std::array<float, K>& k, F&& f) {
  std::size_t i = 0;
#if MESHLIB_NN_SIMD
  std::array<simd_float, K> kv;
  for (std::size_t j = 0; j < K; ++j) kv[j] = splat(k[j]);
  for (; i + simd_lanes <= n; i += simd_lanes) f(i, kv);
#endif
  for (; i < n; ++i) f(i, k);
}

/// Loads element(s) `i` of `p` as `tag`'s type (`float` or `simd_float`).
inline float load_as(const float* p, std::size_t i, float) noexcept { return p[i]; }
/// Stores `v` at element(s) `i` of `p`.
inline void store_at(float* p, std::size_t i, float v) noexcept { p[i] = v; }
#if MESHLIB_NN_SIMD
inline simd_float load_as(const float* p, std::size_t i, simd_float) noexcept { return load(p + i); }
inline void store_at(float* p, std::size_t i, simd_float v) noexcept { store(p + i, v); }
#endif

/// Sum of `double(x[i])^2` over `[0, n)`, in four interleaved partial sums (one running sum is a
/// chain of dependent additions, four times slower; the order differs from a plain loop only in
/// the last bits of a double, which the float clip scale does not see).
inline double sum_of_squares(const float* x, std::size_t n) noexcept {
  double s[4] = {0, 0, 0, 0};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (std::size_t k = 0; k < 4; ++k) s[k] += static_cast<double>(x[i + k]) * x[i + k];
  for (; i < n; ++i) s[0] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace meshlib::nn::detail
