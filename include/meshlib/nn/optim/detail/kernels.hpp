// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The elementwise bodies of the built-in gradient transforms, run by `for_lanes`
/// (nn/detail/simd.hpp) on `float` and `simd_float` alike. Each keeps the exact expression the
/// fused optimizer kernels had before transforms composed (`(m * c1) / (sqrt(v * c2) + eps)`, ...):
/// a chain of these gives the old `adam`, `adamw` and `sgd` bit for bit (tests/unit/nn/test_optim.cpp),
/// because `p - lr * x == p + (-lr) * x` exactly in IEEE arithmetic. Classes, not generic lambdas,
/// which nvcc refuses in device code.

#include <cstddef>

#include "meshlib/nn/detail/simd.hpp"

namespace meshlib::nn::detail {

/// `u *= k[0]`.
struct scale_body {
  float* u;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    store_at(u, i, load_as(u, i, k[0]) * k[0]);
  }
};

/// `p += u` (optax's `apply_updates`); constants `{0}` only give the lane type.
struct apply_body {
  float* p;
  const float* u;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    store_at(p, i, load_as(p, i, k[0]) + load_as(u, i, k[0]));
  }
};

/// `u += wd * p`: constants `{wd}`.
struct decay_body {
  float* u;
  const float* p;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    store_at(u, i, load_as(u, i, k[0]) + k[0] * load_as(p, i, k[0]));
  }
};

/// Momentum: `m = decay * m + u; u = m`: constants `{decay}`.
struct trace_body {
  float* u;
  float* m;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    const auto mi = k[0] * load_as(m, i, k[0]) + load_as(u, i, k[0]);
    store_at(m, i, mi);
    store_at(u, i, mi);
  }
};

/// Adam's scaling: constants `{b1, 1 - b1, b2, 1 - b2, c1, c2, eps}` (c1, c2: the bias corrections).
struct adam_body {
  float* u;
  float* m;
  float* v;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    const auto [b1_, one_b1, b2_, one_b2, c1_, c2_, eps_] = k;
    const auto gi = load_as(u, i, b1_);
    const auto mi = b1_ * load_as(m, i, b1_) + one_b1 * gi;
    const auto vi = b2_ * load_as(v, i, b1_) + one_b2 * gi * gi;
    store_at(m, i, mi);
    store_at(v, i, vi);
    store_at(u, i, (mi * c1_) / (sqrt_of(vi * c2_) + eps_));
  }
};

/// -1, 0 or 1 as `x` is negative, zero or positive (NaN: 0).
KOKKOS_INLINE_FUNCTION float sign_of(float x) noexcept {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
}
#if MESHLIB_NN_SIMD
inline simd_float sign_of(simd_float x) noexcept {
  simd_float r;
  for (std::size_t j = 0; j < simd_lanes; ++j) r[j] = sign_of(static_cast<float>(x[j]));
  return r;
}
#endif

/// Lion's scaling: `u = sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g`: constants
/// `{b1, 1 - b1, b2, 1 - b2}`.
struct lion_body {
  float* u;
  float* m;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    const auto [b1_, one_b1, b2_, one_b2] = k;
    const auto gi = load_as(u, i, b1_);
    const auto mi = load_as(m, i, b1_);
    store_at(u, i, sign_of(one_b1 * gi + b1_ * mi));
    store_at(m, i, b2_ * mi + one_b2 * gi);
  }
};

}  // namespace meshlib::nn::detail
