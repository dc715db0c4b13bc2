// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Compute precisions for mixed-precision training: `float` (default), `meshlib::bfloat16`
/// and, where the compiler has `_Float16` (GCC 12+ and Clang 15+ on x86-64 and AArch64;
/// `MESHLIB_HAS_FLOAT16` is then 1), `meshlib::float16`; the rounding that puts a float buffer on a
/// compute type's grid, and the compile-time rule on gradient-reduction types.
///
/// A `train_state<..., Compute>` with `Compute` a 16-bit type keeps float master weights in the
/// optimizer and rounds parameters, activations, cotangents and gradients to `Compute` (see
/// docs/training.md, "Mixed precision"). Values live in float buffers holding numbers of the
/// `Compute` grid: the numerics are those of 16-bit storage with float accumulation inside each
/// matrix product (what KokkosBlas::gemm on float gives; it has no bfloat16 gemm on the host), but
/// not its memory saving.
/// @code
/// meshlib::nn::train_state<mesh_t, decltype(net), "data", float, meshlib::bfloat16> state(m, std::move(net), opt);
/// @endcode

#include <cstddef>
#include <string_view>
#include <type_traits>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/diagnostics.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

/// 1 where the compiler has `_Float16` (GCC 12+ and Clang 15+ on x86-64 and AArch64), and with it
/// `meshlib::float16`; 0 elsewhere (float16 training is then not offered). 0 under nvcc: it passes
/// the host compiler's `__FLT16_MAX__` on, but its device code generator stops on `_Float16`
/// ("Internal Compiler Error (codegen): unsupported float variant!", CUDA 13.0, found compiling the
/// flagship for sm_90).
#if defined(__FLT16_MAX__) && !defined(__CUDACC__)
#define MESHLIB_HAS_FLOAT16 1
#else
#define MESHLIB_HAS_FLOAT16 0
#endif

namespace meshlib {

#if MESHLIB_HAS_FLOAT16
/// @brief IEEE binary16 (5-bit exponent, 10-bit mantissa, largest finite 65504) over the compiler's
/// `_Float16`: a storage and rounding type; arithmetic goes through `float`. Only where
/// `MESHLIB_HAS_FLOAT16` is 1. Not a communicator element (no collective moves it).
struct float16 {
  _Float16 value = 0;
  constexpr float16() noexcept = default;
  /// Rounds to nearest even; beyond 65504 gives infinity (what dynamic loss scaling detects).
  constexpr float16(float f) noexcept : value(static_cast<_Float16>(f)) {}  // NOLINT: implicit, as a float type
  constexpr operator float() const noexcept { return static_cast<float>(value); }  // NOLINT
};
static_assert(sizeof(float16) == 2 && std::is_trivially_copyable_v<float16>);
#endif

namespace nn {

/// @brief The types a model can compute in: float, bfloat16 and (where available) float16.
template <class T>
concept compute_precision = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>
#if MESHLIB_HAS_FLOAT16
                            || std::is_same_v<T, float16>
#endif
    ;

/// @brief "float32", "bfloat16", "float16" or "float64".
template <class T>
constexpr std::string_view precision_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, double>) return "float64";
  else if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
#if MESHLIB_HAS_FLOAT16
  else if constexpr (std::is_same_v<T, float16>) return "float16";
#endif
  else return "?";
}

/// @brief Whether computing in `C` uses dynamic loss scaling by default (float16: its range ends
/// at 65504 and small gradients underflow; bfloat16 has float's range).
template <class C>
inline constexpr bool needs_loss_scaling =
#if MESHLIB_HAS_FLOAT16
    std::is_same_v<C, float16>;
#else
    false;
#endif

namespace detail {

/// Puts `n` floats of memory `Space` on the grid of `C` (a no-op for float): a Kokkos kernel on the
/// running device's instance (nn/detail/simd.hpp).
template <class C, class Space = default_memory_space>
inline void round_to(float* p, std::size_t n) noexcept {
  if constexpr (!std::is_same_v<C, float>)
    meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = static_cast<float>(C(p[i])); });
}

/// `to[i] = from[i]` put on the grid of `C` for `[0, n)` of memory `Space`: the float masters
/// rounded into the parameters' values in one pass (a copy, then `round_to` in place, read the
/// values twice), as a Kokkos kernel on the running device's instance.
template <class C, class Space = default_memory_space>
inline void round_copy(float* to, const float* from, std::size_t n) noexcept {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { to[i] = static_cast<float>(C(from[i])); });
}

/// Multiplies `n` floats of memory `Space` by `s` (loss scaling: the scaled cotangent, the
/// unscaled gradients): a Kokkos kernel on the running device's instance.
template <class Space = default_memory_space>
inline void scale_in_place(float* p, std::size_t n, float s) noexcept {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = p[i] * s; });
}

/// Whether the reduction type `W` may reduce gradients computed in `C`: float or double always;
/// a 16-bit type only when the compute type is float (an explicitly asked compressed wire, as
/// `grad_sync<float, bfloat16>`) or `C` itself. bfloat16 on float16 gradients would drop 3 mantissa
/// bits, float16 on bfloat16 gradients would overflow past 65504: both silently narrower.
template <class W, class C>
inline constexpr bool reduction_at_least_compute =
    std::is_same_v<W, float> || std::is_same_v<W, double> || std::is_same_v<C, float> || std::is_same_v<W, C>;

template <class Reduction, class Compute>
consteval bool gradient_reduction_type_narrower_than_compute_type() {
  static_assert(meshlib::diagnostic::always_false<Reduction, Compute>,
                "meshlib::nn: train_state: the gradient reduction type (first argument of "
                "gradient_reduction_type_narrower_than_compute_type<reduction, compute>) is narrower than the "
                "compute type (second argument); reduce 16-bit gradients in float or in their own type");
  return false;
}

/// True when gradients computed in `C` may be reduced in `W`; otherwise fires the one diagnostic,
/// naming both types.
template <class W, class C>
consteval bool check_reduction_type() {
  if constexpr (reduction_at_least_compute<W, C>) return true;
  else return gradient_reduction_type_narrower_than_compute_type<W, C>();
}

}  // namespace detail
}  // namespace nn
}  // namespace meshlib
