#pragma once
/// @file
/// @brief The element loops of the thread communicator: a rank-ordered reduction of n inputs into
/// one or more outputs, and plain copies. One code path serves the one-shot and the zero-copy
/// algorithms, so that both give the same bits: every element is combined as
/// `((x0 op x1) op x2) ...` in rank order, whatever the algorithm, the slicing or the thread timing.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::detail {

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

template <reduce_op Op, class T>
constexpr accumulator_t<T> combine(accumulator_t<T> a, T x) noexcept {
  using A = accumulator_t<T>;
  if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
    return static_cast<A>(a + widen(x));
  } else if constexpr (Op == reduce_op::prod) {
    return static_cast<A>(a * widen(x));
  } else if constexpr (std::is_integral_v<T>) {
    // Compare as signed values; the accumulator holds them as unsigned bit patterns.
    const T av = static_cast<T>(a);
    if constexpr (Op == reduce_op::min) return x < av ? widen(x) : a;
    else return av < x ? widen(x) : a;
  } else {
    const A xv = widen(x);
    if constexpr (Op == reduce_op::min) return xv < a ? xv : a;
    else return a < xv ? xv : a;
  }
}

template <reduce_op Op, class T>
constexpr T finish(accumulator_t<T> a, int n) noexcept {
  if constexpr (Op == reduce_op::avg) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<T>(a) / static_cast<T>(n));
    else return static_cast<T>(a / static_cast<accumulator_t<T>>(n));
  } else {
    return static_cast<T>(a);
  }
}

/// Elements combined per block: the accumulators of one block stay in L1.
inline constexpr std::size_t reduce_block_elems = 1024;

/// out[o][i] = in[0][i] op in[1][i] op ... op in[n-1][i] for i in [0, len), for each of the
/// `nout` outputs. Inputs may alias outputs element for element (in-place collectives): each block
/// is read completely before any of it is written.
template <reduce_op Op, class T>
void reduce_into_op(const T* const* in, int n, T* const* out, int nout, std::size_t len) {
  using A = accumulator_t<T>;
  A acc[reduce_block_elems];
  for (std::size_t b = 0; b < len; b += reduce_block_elems) {
    const std::size_t m = std::min(reduce_block_elems, len - b);
    const T* in0 = in[0] + b;
    for (std::size_t i = 0; i < m; ++i) acc[i] = widen(in0[i]);
    for (int r = 1; r < n; ++r) {
      const T* x = in[r] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<Op, T>(acc[i], x[i]);
    }
    for (int o = 0; o < nout; ++o) {
      T* y = out[o] + b;
      for (std::size_t i = 0; i < m; ++i) y[i] = finish<Op, T>(acc[i], n);
    }
  }
}

/// Dispatches `reduce_into_op` on the run-time reduce op.
template <class T>
void reduce_into(reduce_op op, const T* const* in, int n, T* const* out, int nout, std::size_t len) {
  switch (op) {
    case reduce_op::sum: return reduce_into_op<reduce_op::sum, T>(in, n, out, nout, len);
    case reduce_op::prod: return reduce_into_op<reduce_op::prod, T>(in, n, out, nout, len);
    case reduce_op::min: return reduce_into_op<reduce_op::min, T>(in, n, out, nout, len);
    case reduce_op::max: return reduce_into_op<reduce_op::max, T>(in, n, out, nout, len);
    case reduce_op::avg: return reduce_into_op<reduce_op::avg, T>(in, n, out, nout, len);
  }
}

/// memcpy that accepts empty ranges with null pointers (a span of size 0 may have data() == nullptr).
inline void copy_bytes(void* dst, const void* src, std::size_t bytes) noexcept {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace meshlib::detail
