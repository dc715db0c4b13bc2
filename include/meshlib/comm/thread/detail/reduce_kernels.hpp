// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The element loops of the thread communicator: a rank-ordered reduction of n inputs into
/// one or more outputs, and plain copies. One code path serves the one-shot and the zero-copy
/// algorithms, so that both give the same bits: every element is combined as
/// `((x0 op x1) op x2) ...` in rank order, whatever the algorithm, the slicing or the thread timing.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace meshlib::comm::detail {

/// The type in which elements of T are combined: float for bfloat16 (NCCL's and PyTorch's
/// accumulation type), the unsigned twin for integers (so that sum and prod wrap instead of
/// overflowing into undefined behaviour), T itself for float and double.
template <class T>
struct accumulator {
  using type = T;
};
template <>
struct accumulator<bfloat16> {
  using type = float;
};
template <class T>
  requires std::is_integral_v<T>
struct accumulator<T> {
  using type = std::make_unsigned_t<T>;
};
template <class T>
using accumulator_t = typename accumulator<T>::type;

template <class T>
constexpr accumulator_t<T> widen(T x) noexcept {
  return static_cast<accumulator_t<T>>(x);
}

/// Whether the sign bit of a float or double is set (-0.0 included), usable in constexpr code.
template <class F>
constexpr bool sign_bit(F v) noexcept {
  if constexpr (sizeof(F) == 4) return (std::bit_cast<std::uint32_t>(v) >> 31) != 0;
  else return (std::bit_cast<std::uint64_t>(v) >> 63) != 0;
}

/// max of floating-point values as meshlib defines it on every backend: a NaN anywhere gives NaN
/// (the first in rank order: `a` is the running result of the lower ranks), and +0 > -0. So the
/// result does not depend on the order of the participants, and NaN is not lost as with
/// `a < b ? b : a` (which keeps `a` whenever `b` is NaN).
template <class F>
constexpr F float_max(F a, F b) noexcept {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return sign_bit(a) ? b : a;
  return a < b ? b : a;
}

/// min, the mirror of `float_max`: NaN anywhere gives NaN, and -0 < +0.
template <class F>
constexpr F float_min(F a, F b) noexcept {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return sign_bit(a) ? a : b;
  return b < a ? b : a;
}

template <reduce_op Op, class T>
constexpr accumulator_t<T> combine(accumulator_t<T> a, T x) noexcept {
  using A = accumulator_t<T>;
  if constexpr (Op == reduce_op::sum || Op == reduce_op::mean) {
    return static_cast<A>(a + widen(x));
  } else if constexpr (Op == reduce_op::prod) {
    return static_cast<A>(a * widen(x));
  } else if constexpr (std::is_integral_v<T>) {
    // Compare as signed values; the accumulator holds them as unsigned bit patterns.
    const T av = static_cast<T>(a);
    if constexpr (Op == reduce_op::min) return x < av ? widen(x) : a;
    else return av < x ? widen(x) : a;
  } else {
    if constexpr (Op == reduce_op::min) return float_min(a, widen(x));
    else return float_max(a, widen(x));
  }
}

template <reduce_op Op, class T>
constexpr T finish(accumulator_t<T> a, int n) noexcept {
  if constexpr (Op == reduce_op::mean) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<T>(a) / static_cast<T>(n));
    else return static_cast<T>(a / static_cast<accumulator_t<T>>(n));
  } else {
    return static_cast<T>(a);
  }
}

/// Elements combined per block: the accumulators of one block stay in L1.
inline constexpr std::size_t reduce_block_elems = 1024;

/// Copies `bytes` with non-temporal (streaming) stores where the target is 16-byte aligned: the
/// written lines bypass the caches, so a copy much larger than the last-level cache neither reads
/// the target lines first (no read-for-ownership) nor evicts the sources. The caller issues
/// `stream_fence()` before it tells peers that the data is there.
inline void stream_bytes(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
  if (head >= bytes) {
    std::memcpy(d, s, bytes);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  std::size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

/// Orders the streaming stores before the stores that follow (the release of a step).
inline void stream_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// out[o][i] = in[0][i] op in[1][i] op ... op in[n-1][i] for i in [0, len), for each of the
/// `nout` outputs. Inputs may alias outputs element for element (in-place collectives): each block
/// is read completely before any of it is written. With `streaming`, outputs are written with
/// non-temporal stores (call stream_fence() before publishing them).
template <reduce_op Op, class T>
void reduce_into_op(const T* const* in, int n, T* const* out, int nout, std::size_t len, bool streaming) {
  using A = accumulator_t<T>;
  // float and double sum/prod/min/max accumulate in T itself: then the first output's block can be
  // the accumulator (one pass for two ranks instead of three), unless it is also a later input
  // (an in-place reduce to a root other than 0), which must be read before anything is written.
  constexpr bool direct_ok = std::is_same_v<A, T> && Op != reduce_op::mean;
  bool direct = direct_ok && !streaming && n >= 2;
  for (int r = 1; r < n && direct; ++r) direct = in[r] != out[0];
  if (direct) {
    for (std::size_t b = 0; b < len; b += reduce_block_elems) {
      const std::size_t m = std::min(reduce_block_elems, len - b);
      T* y = out[0] + b;
      const T* x0 = in[0] + b;
      const T* x1 = in[1] + b;
      for (std::size_t i = 0; i < m; ++i) y[i] = combine<Op, T>(x0[i], x1[i]);
      for (int r = 2; r < n; ++r) {
        const T* x = in[r] + b;
        for (std::size_t i = 0; i < m; ++i) y[i] = combine<Op, T>(y[i], x[i]);
      }
      for (int o = 1; o < nout; ++o) std::memcpy(out[o] + b, y, m * sizeof(T));
    }
    return;
  }
  A acc[reduce_block_elems];
  T res[reduce_block_elems];
  for (std::size_t b = 0; b < len; b += reduce_block_elems) {
    const std::size_t m = std::min(reduce_block_elems, len - b);
    const T* in0 = in[0] + b;
    if (n >= 2) {
      const T* in1 = in[1] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<Op, T>(widen(in0[i]), in1[i]);
    } else {
      for (std::size_t i = 0; i < m; ++i) acc[i] = widen(in0[i]);
    }
    for (int r = 2; r < n; ++r) {
      const T* x = in[r] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<Op, T>(acc[i], x[i]);
    }
    if (!streaming) {
      T* y = out[0] + b;
      for (std::size_t i = 0; i < m; ++i) y[i] = finish<Op, T>(acc[i], n);
      for (int o = 1; o < nout; ++o) std::memcpy(out[o] + b, y, m * sizeof(T));
      continue;
    }
    for (std::size_t i = 0; i < m; ++i) res[i] = finish<Op, T>(acc[i], n);
    for (int o = 0; o < nout; ++o) stream_bytes(out[o] + b, res, m * sizeof(T));
  }
}

/// Dispatches `reduce_into_op` on the run-time reduce op.
template <class T>
void reduce_into(reduce_op op, const T* const* in, int n, T* const* out, int nout, std::size_t len,
                 bool streaming = false) {
  switch (op) {
    case reduce_op::sum: return reduce_into_op<reduce_op::sum, T>(in, n, out, nout, len, streaming);
    case reduce_op::prod: return reduce_into_op<reduce_op::prod, T>(in, n, out, nout, len, streaming);
    case reduce_op::min: return reduce_into_op<reduce_op::min, T>(in, n, out, nout, len, streaming);
    case reduce_op::max: return reduce_into_op<reduce_op::max, T>(in, n, out, nout, len, streaming);
    case reduce_op::mean: return reduce_into_op<reduce_op::mean, T>(in, n, out, nout, len, streaming);
  }
}

/// memcpy that accepts empty ranges with null pointers (a span of size 0 may have data() == nullptr).
inline void copy_bytes(void* dst, const void* src, std::size_t bytes) noexcept {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace meshlib::comm::detail
