// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Plain-loop reference implementations on row-major std::vectors: the independent expectations
// the tensor tests compare against. Nothing here uses meshlib's layout math or kernels.
#pragma once
#include <algorithm>
#include <array>
#include <cstddef>
#include <limits>
#include <vector>

namespace ref {

template <class T>
std::vector<T> iota(std::size_t n, long start = 1, long modulo = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    long x = start + static_cast<long>(i);
    if (modulo) x = x % modulo - modulo / 2;  // small signed values: exact in float sums
    v[i] = static_cast<T>(x);
  }
  return v;
}

template <class T>
std::vector<T> matmul(const std::vector<T>& a, const std::vector<T>& b, std::size_t m, std::size_t k, std::size_t n) {
  std::vector<T> c(m * n, T{});
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      T acc{};
      for (std::size_t p = 0; p < k; ++p) acc += a[i * k + p] * b[p * n + j];
      c[i * n + j] = acc;
    }
  return c;
}

template <class T>
std::vector<T> transpose(const std::vector<T>& a, std::size_t rows, std::size_t cols) {
  std::vector<T> t(rows * cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

enum class op { sum, max, mean };

/// Reduce dimension `d` of a row-major array of `shape` (rank 2 or 3 handled generically).
template <class U, class T, std::size_t R>
std::vector<U> reduce(const std::vector<T>& a, const std::array<std::size_t, R>& shape, std::size_t d, op o) {
  std::size_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < d; ++i) outer *= shape[i];
  for (std::size_t i = d + 1; i < R; ++i) inner *= shape[i];
  const std::size_t n = shape[d];
  std::vector<U> out(outer * inner);
  for (std::size_t o_ = 0; o_ < outer; ++o_)
    for (std::size_t j = 0; j < inner; ++j) {
      U acc = o == op::max ? std::numeric_limits<U>::lowest() : U{};
      for (std::size_t k = 0; k < n; ++k) {
        const U v = static_cast<U>(a[(o_ * n + k) * inner + j]);
        acc = o == op::max ? std::max(acc, v) : acc + v;
      }
      out[o_ * inner + j] = o == op::mean ? acc / static_cast<U>(n) : acc;
    }
  return out;
}

/// The 2-D block [r0, r1) x [c0, c1) of a rows x cols array.
template <class T>
std::vector<T> block2(const std::vector<T>& a, std::size_t cols, std::size_t r0, std::size_t r1, std::size_t c0,
                      std::size_t c1) {
  std::vector<T> out;
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t c = c0; c < c1; ++c) out.push_back(a[r * cols + c]);
  return out;
}

}  // namespace ref
