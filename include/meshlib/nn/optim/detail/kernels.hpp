// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The elementwise steps of the built-in gradient transforms, and `fused_body`, which runs a
/// sequence of them as one kernel (`for_lanes`, nn/detail/simd.hpp, on `float` and `simd_float`
/// alike): a chain of built-in transforms reads and writes each element once, as the fused
/// optimizer kernels before transforms composed did. Each step keeps the exact expression of those
/// kernels (`(m * c1) / (sqrt(v * c2) + eps)`, ...), so `adam`, `adamw` and `sgd` give their numbers
/// bit for bit (tests/unit/nn/test_optim.cpp): `p - lr * x == p + (-lr) * x` exactly in IEEE
/// arithmetic. Classes, not generic lambdas, which nvcc refuses in device code.
///
/// A step is a class with `constants` (floats per step it reads, `k[0..]`), `slots` (state floats
/// per element) and `apply(i, x, k, s, p)`: the new update of element `i` from the update `x`, its
/// constants `k`, its state slots `s` and the parameter `p`.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "meshlib/nn/detail/simd.hpp"

namespace meshlib::nn::detail {

/// `x * k[0]`: clip, scale, schedule, learning rate.
struct scale_step {
  static constexpr std::size_t constants = 1, slots = 0;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t, L x, const K* k, float* const*, const float*) {
    return x * k[0];
  }
};

/// `x + wd p` (`k = {wd}`): decoupled weight decay.
struct decay_step {
  static constexpr std::size_t constants = 1, slots = 0;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L x, const K* k, float* const*, const float* p) {
    return x + k[0] * load_as(p, i, k[0]);
  }
};

/// Momentum: `m = decay m + x`, the update `m` (`k = {decay}`).
struct trace_step {
  static constexpr std::size_t constants = 1, slots = 1;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L x, const K* k, float* const* s, const float*) {
    const L mi = k[0] * load_as(s[0], i, k[0]) + x;
    store_at(s[0], i, mi);
    return mi;
  }
};

/// Adam's scaling (`k = {b1, 1 - b1, b2, 1 - b2, c1, c2, eps}`; c1, c2: the bias corrections).
struct adam_step {
  static constexpr std::size_t constants = 7, slots = 2;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L gi, const K* k, float* const* s, const float*) {
    const L mi = k[0] * load_as(s[0], i, k[0]) + k[1] * gi;
    const L vi = k[2] * load_as(s[1], i, k[0]) + k[3] * gi * gi;
    store_at(s[0], i, mi);
    store_at(s[1], i, vi);
    return (mi * k[4]) / (sqrt_of(vi * k[5]) + k[6]);
  }
};

/// -1, 0 or 1 as `x` is negative, zero or positive (NaN: 0).
KOKKOS_INLINE_FUNCTION float sign_of(float x) noexcept { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
#if MESHLIB_NN_SIMD
inline simd_float sign_of(simd_float x) noexcept {
  simd_float r;
  for (std::size_t j = 0; j < simd_lanes; ++j) r[j] = sign_of(static_cast<float>(x[j]));
  return r;
}
#endif

/// Lion's scaling: the update `sign(b1 m + (1 - b1) x)`, then `m = b2 m + (1 - b2) x`
/// (`k = {b1, 1 - b1, b2, 1 - b2}`).
struct lion_step {
  static constexpr std::size_t constants = 4, slots = 1;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L gi, const K* k, float* const* s, const float*) {
    const L mi = load_as(s[0], i, k[0]);
    store_at(s[0], i, k[2] * mi + k[3] * gi);
    return sign_of(k[1] * gi + k[0] * mi);
  }
};

/// Total constants and slots of `Steps`.
template <class... Steps>
inline constexpr std::size_t constants_of = (std::size_t{0} + ... + Steps::constants);
template <class... Steps>
inline constexpr std::size_t slots_of = (std::size_t{0} + ... + Steps::slots);

/// The steps `Steps` one after the other on each element: the constants `k` are `{0}` (which only
/// gives the lane type) then each step's, the slots each step's in order. Stores the update to `u`,
/// or with `Apply` adds it to the parameter instead (optax's `apply_updates` in the same pass).
template <bool Apply, class... Steps>
struct fused_body {
  float* u;        ///< the updates
  const float* p;  ///< the parameter, read
  float* out;      ///< with `Apply`: the parameter, written (`p`)
  std::array<float*, slots_of<Steps...> + 1> s;  // + 1: no zero-length array when no step has state

  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    auto x = load_as(u, i, k[0]);
    if constexpr (sizeof...(Steps) > 0) run<1, 0, Steps...>(i, x, k);
    if constexpr (Apply) store_at(out, i, load_as(p, i, k[0]) + x);
    else store_at(u, i, x);
  }

 private:
  template <std::size_t C, std::size_t O, class Step, class... Rest, class L, class K>
  KOKKOS_INLINE_FUNCTION void run(std::size_t i, L& x, const K& k) const {
    x = Step::apply(i, x, k.data() + C, s.data() + O, p);
    if constexpr (sizeof...(Rest) > 0) run<C + Step::constants, O + Step::slots, Rest...>(i, x, k);
  }
};

/// Runs `Steps` over `n` elements (see `fused_body`): `k` their constants after the leading 0,
/// `state` their slots, `out` the parameter to add the updates to (`Apply`; else they stay in `u`).
template <bool Apply, class... Steps, std::size_t N>
void run_steps(float* u, const float* p, float* out, float* const* state, std::size_t n,
               const std::array<float, N>& k) {
  static_assert(N == 1 + constants_of<Steps...>, "meshlib::nn: the steps' constants, after a leading 0");
  fused_body<Apply, Steps...> body{u, p, out, {}};
  if constexpr (slots_of<Steps...> > 0)  // (nvcc warns of `j < 0` otherwise)
    for (std::size_t j = 0; j < slots_of<Steps...>; ++j) body.s[j] = state[j];
  for_lanes<default_memory_space>(n, k, body);
}

/// Words per run of a multi-tensor optimizer table (`fused_runs_kernel`): the updates, the parameter
/// read, the parameter written (with `Apply`), the run's first block over all the runs, its length,
/// then its `slots_of<Steps...>` state slots and its `constants_of<Steps...>` constants (each float's
/// bits in a word of its own).
template <class... Steps>
inline constexpr std::size_t fused_run_words = 5 + slots_of<Steps...> + constants_of<Steps...>;

/// Block `b` of a multi-tensor optimizer update: the `fused_body` of its run over the block, with
/// the run's own constants (a decay mask gives runs different ones; the bias corrections are the
/// same). The blocks start at each run's first element and `lanes_of_block` runs each as
/// `for_lanes` runs it, so every element goes through the same operations as in `run_steps` on
/// its run alone: the numbers are bitwise those of one kernel per run (issue 38: one launch per
/// device instead of one per parameter).
template <bool Apply, class... Steps>
struct fused_runs_kernel {
  const std::size_t* table;  ///< `runs` runs of `fused_run_words<Steps...>` words, in the kernel's memory
  std::size_t runs;          ///< runs in the table (none empty)

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    constexpr std::size_t words = fused_run_words<Steps...>, slots = slots_of<Steps...>;
    constexpr std::size_t constants = constants_of<Steps...>;
    const std::size_t* w = table + run_of_block(table, runs, b, words, 3) * words;
    fused_body<Apply, Steps...> body{reinterpret_cast<float*>(w[0]), reinterpret_cast<const float*>(w[1]),
                                     reinterpret_cast<float*>(w[2]), {}};
    if constexpr (slots > 0)
      for (std::size_t j = 0; j < slots; ++j) body.s[j] = reinterpret_cast<float*>(w[5 + j]);
    std::array<float, 1 + constants> k{};
    if constexpr (constants > 0)
      for (std::size_t j = 0; j < constants; ++j) k[1 + j] = float_of_word(w[5 + slots + j]);
    const std::size_t n = w[4], i0 = (b - w[3]) * kernel_block, i1 = i0 + kernel_block < n ? i0 + kernel_block : n;
    lanes_of_block(i0, i1, k, body);
  }

  /// The float whose bits word `x` holds (`word_of_float`).
  KOKKOS_INLINE_FUNCTION static float float_of_word(std::size_t x) noexcept {
    const auto bits = static_cast<std::uint32_t>(x);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

/// `f`'s bits in a table word (`fused_runs_kernel::float_of_word` reads them back).
inline std::size_t word_of_float(float f) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

/// Runs `Steps` over every run of `table` (`runs` runs, `blocks` blocks of `kernel_block` elements
/// in all; see `fused_runs_kernel`) as one Kokkos kernel on memory `Space`.
template <class Space, bool Apply, class... Steps>
void run_steps_over_runs(const std::size_t* table, std::size_t runs, std::size_t blocks) {
  if (blocks == 0) return;
  meshlib::launch<Space>(blocks, fused_runs_kernel<Apply, Steps...>{table, runs});
}

/// `p += u` over `n` elements (optax's `apply_updates`; `u` is only read).
inline void apply_updates(float* p, float* u, std::size_t n) {
  run_steps<true>(u, p, p, nullptr, n, std::array<float, 1>{0.0f});
}

}  // namespace meshlib::nn::detail
