// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief A few-lane float vector for the elementwise kernels of the training step (optimizer
/// updates), written once as a generic body that runs on `float` (the tail, and compilers without
/// vector extensions) and on `simd_float` (the bulk); and the Kokkos kernels that run such bodies,
/// and the sum of squares of global-norm clipping, on the running device's execution-space
/// instance (`meshlib::launch`: a RangePolicy `parallel_for`, the one launch safe from
/// concurrent device threads on Kokkos 3.4.1, see tensor/view.hpp).
///
/// Each work item of a kernel is a block of `kernel_block` elements: the constants are copied into
/// locals once per block (not re-read through the kernel object after every store), and the block
/// runs the lane loop as a plain loop would, so the kernel is as fast as the loop it replaced.
///
/// Why not leave it to the auto-vectoriser: `std::sqrt` sets `errno`, which keeps GCC and Clang from
/// vectorising any loop that calls it unless the user builds with `-fno-math-errno`, and GCC 12's
/// `-O2` vectorises only loops whose trip count is a multiple of the vector width. Every lane
/// operation here (+ - * / and `sqrtps`) is the correctly rounded IEEE operation the scalar code
/// performs, so a body gives bitwise the same numbers on `float` and on `simd_float` (the compiler
/// contracts a*b+c into an FMA, where the flags allow it, in both forms alike).
/// @code
/// struct twice_sqrt {   // y = 2 sqrt(x)
///   float* y; const float* x;
///   template <class K> KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
///     detail::store_at(y, i, detail::sqrt_of(detail::load_as(x, i, k[0])) * k[0]);
///   }
/// };
/// detail::for_lanes<Space>(n, std::array<float, 1>{2.0f}, twice_sqrt{y, x});
/// @endcode

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

// Not in nvcc's device pass (`__CUDA_ARCH__`): a GPU thread runs the scalar form of the bodies.
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__SSE2__) || defined(__AVX__)) && !defined(__CUDA_ARCH__)
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
/// Loads element(s) `i` of `p` as the optimizer's lanes (`load_as`'s form for `simd_float`, which
/// is narrower than `simd_of<float>` on AVX-512 and exists in CUDA translation units too).
inline simd_float load_as(const float* p, std::size_t i, simd_float) noexcept { return load(p + i); }
/// Stores the optimizer's lanes `v` at element(s) `i` of `p`.
inline void store_at(float* p, std::size_t i, simd_float v) noexcept { store(p + i, v); }
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
KOKKOS_INLINE_FUNCTION float sqrt_of(float v) noexcept { return std::sqrt(v); }

/// Elements per work item of the kernels below (see the file comment): a multiple of every lane
/// count, small enough that a few million elements give every core many items.
inline constexpr std::size_t kernel_block = 1024;

/// Calls `f(i, c)` for the elements `[i0, i1)`: over the bulk, for lanes `[i, i + simd_lanes)` with
/// `c` the constants `k` each splat to a `simd_float`; over the rest, for element `i` with `c == k`.
/// The constants are splat once, outside the loop, into a local the stores cannot alias (a member
/// read through `this` in the loop would be reloaded and re-splat after every store).
template <std::size_t K, class F>
KOKKOS_INLINE_FUNCTION void lanes_of_block(std::size_t i0, std::size_t i1, const std::array<float, K>& k, const F& f) {
  std::size_t i = i0;
#if MESHLIB_NN_SIMD
  std::array<simd_float, K> kv;
  for (std::size_t j = 0; j < K; ++j) kv[j] = splat(k[j]);
  for (; i + simd_lanes <= i1; i += simd_lanes) f(i, kv);
#endif
  const std::array<float, K> ks = k;
  for (; i < i1; ++i) f(i, ks);
}

/// The work item of `for_lanes`: block `b` of `kernel_block` elements. A class rather than a lambda:
/// nvcc refuses an extended device lambda in a function templated on another function's local type.
template <std::size_t K, class F>
struct lanes_kernel {
  std::size_t n;
  std::array<float, K> k;
  F f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    const std::size_t i0 = b * kernel_block, i1 = i0 + kernel_block < n ? i0 + kernel_block : n;
    lanes_of_block(i0, i1, k, f);
  }
};

/// Calls `f(i, c)` for the elements `[0, n)` (as `lanes_of_block`), as a Kokkos kernel on memory
/// `Space` on the running device's instance, one work item per block of `kernel_block` elements.
/// `f` reads with `load_as(p, i, c[0])` and writes with `store_at`; it is a class with a
/// `KOKKOS_INLINE_FUNCTION` call operator templated on the lane type (`float` or `simd_float`): nvcc
/// refuses a generic extended lambda.
template <class Space, std::size_t K, class F>
void for_lanes(std::size_t n, const std::array<float, K>& k, const F& f) {
  meshlib::launch<Space>((n + kernel_block - 1) / kernel_block, lanes_kernel<K, F>{n, k, f});
}


// ---- Lanes of a row: the layers' kernels over runs of channels ----
//
// The layers' row loops (a pixel's channels, a column block's sums over rows) read and write
// through several pointers, so GCC 12 at -O2 keeps them scalar: it vectorises only loops whose trip
// count is a multiple of the vector width and needs no check that the pointers do not overlap.
// Measured in the ResNet flagship (perf, 2026-12-07): im2col's copies, col2im's sums, batch norm and
// max pooling were scalar loops, about 47% of a step. `for_each_lane` runs such a loop's body on native
// vectors of the element type over the bulk of the run and on single elements over the rest; a body
// applies the same IEEE operations in the same order to every element in both forms, so the results
// are bitwise those of the scalar loop (sums over rows stay in row order: lanes run across columns).
// Where the target has FMA (`-march=haswell` and later) and contraction is on (GCC's default), the
// compiler decides per expression whether `a * b + c` becomes one rounding: there a body and the loop
// it replaced may differ in the last bit (measured: average pooling's backward with 3x3 windows).

// The row lanes' vectors (and conv2d's, nn/detail/conv2d_kernels.hpp) are host-compiler code only:
// in a CUDA or HIP translation unit nvcc's (and hipcc's) front end would parse the bodies' vector
// comparisons and selects in its host pass too, so there (where the work runs on the GPU anyway)
// the host loops stay scalar. They need no intrinsics: GCC/Clang vector extensions on x86 or Arm.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && !defined(__HIPCC__) && \
    (defined(__SSE2__) || defined(__ARM_NEON))
#define MESHLIB_NN_ROW_LANES 1
#if defined(__AVX512F__)
/// Bytes of `simd_of<T>`: the widest vector registers the target has (AVX-512 64, AVX 32, SSE2 and NEON 16).
inline constexpr std::size_t simd_bytes = 64;
#elif defined(__AVX__)
inline constexpr std::size_t simd_bytes = 32;
#else
inline constexpr std::size_t simd_bytes = 16;
#endif
#else
#define MESHLIB_NN_ROW_LANES 0
#endif

#if MESHLIB_NN_ROW_LANES
/// A native vector of `T` (`float`, `double`, `std::uint32_t`, ...), `simd_bytes` long: a class
/// member typedef, as GCC drops a vector attribute on a dependent alias template.
template <class T>
struct simd_of {
  typedef T type __attribute__((vector_size(simd_bytes)));
};
/// Loads `simd_of<T>` lanes from element `i` of `p` (no alignment needed).
template <class T>
inline typename simd_of<T>::type load_as(const T* p, std::size_t i, typename simd_of<T>::type) noexcept {
  typename simd_of<T>::type v;
  std::memcpy(&v, p + i, sizeof v);
  return v;
}
/// Stores the lanes `v` at element `i` of `p`.
template <class T>
inline void store_at(T* p, std::size_t i, typename simd_of<T>::type v) noexcept {
  std::memcpy(p + i, &v, sizeof v);
}
#endif
/// Element `i` of `p` (the scalar form of the vector `load_as`, for any element type).
template <class T>
KOKKOS_INLINE_FUNCTION T load_as(const T* p, std::size_t i, T) noexcept {
  return p[i];
}
/// Stores `v` at element `i` of `p`.
template <class T>
KOKKOS_INLINE_FUNCTION void store_at(T* p, std::size_t i, T v) noexcept {
  p[i] = v;
}
/// `s` as the lane type `L` of a body (`L` itself, or every lane of a vector `L`).
template <class L, class S>
KOKKOS_INLINE_FUNCTION L splat_as(S s) noexcept {
  if constexpr (std::is_arithmetic_v<L>) {
    return static_cast<L>(s);
  } else {
    using E = std::remove_cvref_t<decltype(L{}[0])>;
    L v{};  // lane by lane, not `L{} + s`: 0 + (-0) is +0, and a splat keeps the sign of a zero
    for (std::size_t k = 0; k < sizeof(L) / sizeof(E); ++k) v[k] = static_cast<E>(s);
    return v;
  }
}

/// The lane type of 32-bit indices beside float lanes `L`: `std::uint32_t` for a `float`, a vector
/// of as many `std::uint32_t` lanes for a float vector.
template <class L>
struct lane_index {
  using type = std::uint32_t;
};
#if MESHLIB_NN_ROW_LANES
template <>
struct lane_index<simd_of<float>::type> {
  using type = simd_of<std::uint32_t>::type;
};
#endif
/// See `lane_index`.
template <class L>
using lane_index_t = typename lane_index<L>::type;

/// Calls `f(j, lane)` for every `j` in `[j0, j1)`: where the host has native vectors (and `Vectorize`),
/// for `j` a step of `simd_of<T>`'s lanes apart with `lane` a `simd_of<T>::type` over the bulk, then
/// one element at a time with `lane` a `T`. `f` reads with `load_as(p, j, lane)`, writes with
/// `store_at(p, j, v)`, and writes constants as `splat_as<L>(c)`; it is a generic lambda written inside
/// the kernel (a plain lambda there, which nvcc accepts, unlike a generic extended lambda).
template <class T, bool Vectorize = true, class F>
KOKKOS_INLINE_FUNCTION void for_each_lane(std::size_t j0, std::size_t j1, const F& f) {
  std::size_t j = j0;
#if MESHLIB_NN_ROW_LANES
  if constexpr (Vectorize) {
    using V = typename simd_of<T>::type;
    constexpr std::size_t lanes = sizeof(V) / sizeof(T);
    for (; j + lanes <= j1; j += lanes) f(j, V{});
  }
#endif
  for (; j < j1; ++j) f(j, T{});
}

/// Sum of `double(x[i])^2` over `[i0, i1)`, in four interleaved partial sums (one running sum is a
/// chain of dependent additions, four times slower).
KOKKOS_INLINE_FUNCTION double squares_of_block(const float* x, std::size_t i0, std::size_t i1) noexcept {
  double s[4] = {0, 0, 0, 0};
  std::size_t i = i0;
  for (; i + 4 <= i1; i += 4)
    for (std::size_t k = 0; k < 4; ++k) s[k] += static_cast<double>(x[i + k]) * x[i + k];
  for (; i < i1; ++i) s[0] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// A run of a multi-tensor kernel: `n` floats at `x`, in the memory of the kernel's space.
struct float_run {
  const float* x;  ///< the first element
  std::size_t n;   ///< the number of elements
};

/// The words one run takes in a run table (`run_table`): its address, its length, its first block.
inline constexpr std::size_t run_words = 3;

/// Writes the run table of `runs` into `words` (`run_words` per run that is not empty, in order:
/// address, length, index of its first block of `kernel_block` elements over all the runs) and
/// returns the number of blocks over all the runs. A multi-tensor kernel reads the table from the
/// kernel's memory (`run_table_buffers`), so one launch covers every run of a device.
inline std::size_t run_table(const std::vector<float_run>& runs, std::vector<std::size_t>& words) {
  words.clear();
  std::size_t blocks = 0;
  for (const float_run& r : runs) {
    if (r.n == 0) continue;
    words.push_back(reinterpret_cast<std::uintptr_t>(r.x));
    words.push_back(r.n);
    words.push_back(blocks);
    blocks += (r.n + kernel_block - 1) / kernel_block;
  }
  return blocks;
}

/// The run that block `b` of a run table of `runs` runs lies in (a binary search: the last run whose
/// first block is at most `b`; no run of the table is empty). `stride` words per run, the first
/// block at word `at` of each (`run_table`'s layout by default; the optimizer's table is wider).
KOKKOS_INLINE_FUNCTION std::size_t run_of_block(const std::size_t* table, std::size_t runs, std::size_t b,
                                                std::size_t stride = run_words, std::size_t at = 2) noexcept {
  std::size_t lo = 0, hi = runs;  // the run is in [lo, hi)
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (table[mid * stride + at] <= b) lo = mid;
    else hi = mid;
  }
  return lo;
}

/// Sum of `double(x[i])^2` over every element of the runs of `table` (memory `Space`; `runs` runs,
/// `blocks` blocks, as `run_table` made it), one multi-tensor reduction for all of a device's runs:
/// a Kokkos kernel on the running device's instance writes one partial sum per block of
/// `kernel_block` elements of a run into `scratch` (memory `Space`, `blocks + 1` elements), one work
/// item adds them into its last element, and the host reads that one number back (a copy only for
/// device memory). Two launches and one read-back per device instead of as many per run (issue 38:
/// few kernels per step).
/// A `parallel_for` and not a `parallel_reduce`, which Kokkos 3.4.1 Serial cannot run from several
/// device threads at once (tensor/view.hpp). The blocks are fixed (they start at each run's first
/// element) and the finishing item adds them in a fixed order, the blocks of a run into the run's
/// sum (from 0), then the runs' sums into the total (from 0), in run order: the sum is bitwise
/// reproducible on every backend and thread count, and the same bits as summing each run with its
/// own reduction and adding the results in run order on the host. That order differs from one
/// running sum only in the last bits of a double, which the float clip scale does not see.
template <class Space>
double sum_of_squares(const std::size_t* table, std::size_t runs, std::size_t blocks, double* scratch) {
  if (blocks == 0) return 0.0;
  double* part = scratch;
  meshlib::launch<Space>(blocks, KOKKOS_LAMBDA(std::size_t b) {
    const std::size_t* r = table + run_of_block(table, runs, b) * run_words;
    const auto* x = reinterpret_cast<const float*>(r[0]);
    const std::size_t n = r[1], i0 = (b - r[2]) * kernel_block, i1 = i0 + kernel_block < n ? i0 + kernel_block : n;
    part[b] = squares_of_block(x, i0, i1);
  });
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    double total = 0;
    for (std::size_t k = 0; k < runs; ++k) {
      const std::size_t* r = table + k * run_words;
      const std::size_t b0 = r[2], b1 = b0 + (r[1] + kernel_block - 1) / kernel_block;
      double s = 0;
      for (std::size_t b = b0; b < b1; ++b) s += part[b];
      total += s;
    }
    part[blocks] = total;
  });
  return meshlib::read_back<Space>(part + blocks);
}

}  // namespace meshlib::nn::detail
