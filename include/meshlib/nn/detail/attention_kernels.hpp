// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The kernels of causal self-attention besides its products: the heads' layouts (split and
/// merge, and their inverses) and the causal softmax with its backward, one work item per token or
/// per row of scores. Free functions over pointers, templated on the element type and the memory
/// space only, for the reason nn/detail/layer_kernels.hpp gives (nvcc and kernels in mesh-templated code).

#include <cmath>
#include <cstddef>
#include <limits>

#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// The fused projection's output `(token, [head][q|k|v][head_dim])` as `[q|k|v][head][token][head_dim]`
/// (each sequence and head contiguous for the products), and back (`unsplit_heads`).
template <class Space, class T>
void split_heads(T* qh, const T* y, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t t = 0; t < 3; ++t)
        for (std::size_t e = 0; e < hd; ++e) qh[((t * hl + h) * rows + i) * hd + e] = y[i * 3 * hl * hd + (h * 3 + t) * hd + e];
  });
}

/// The inverse of `split_heads`.
template <class Space, class T>
void unsplit_heads(T* y, const T* qh, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t t = 0; t < 3; ++t)
        for (std::size_t e = 0; e < hd; ++e) y[i * 3 * hl * hd + (h * 3 + t) * hd + e] = qh[((t * hl + h) * rows + i) * hd + e];
  });
}

/// The heads' outputs `[head][token][head_dim]` as the output projection's rows `(token, [head][head_dim])`,
/// and back (`unmerge_heads`).
template <class Space, class T>
void merge_heads(T* o, const T* oh, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t e = 0; e < hd; ++e) o[i * hl * hd + h * hd + e] = oh[(h * rows + i) * hd + e];
  });
}

/// The inverse of `merge_heads`.
template <class Space, class T>
void unmerge_heads(T* oh, const T* o, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t e = 0; e < hd; ++e) oh[(h * rows + i) * hd + e] = o[i * hl * hd + h * hd + e];
  });
}

/// In place over `n` rows of `seq` scores: row `r` is query position `i = r % seq`; `softmax` over
/// `j <= i` with the maximum subtracted, 0 above.
template <class Space, class T>
void causal_softmax(T* s, std::size_t n, std::size_t seq) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t r) {
    T* row = s + r * seq;
    const std::size_t last = r % seq;
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j <= last; ++j) m = row[j] > m ? row[j] : m;
    T sum = 0;
    for (std::size_t j = 0; j <= last; ++j) sum += (row[j] = std::exp(row[j] - m));
    const T inv = T{1} / sum;
    for (std::size_t j = 0; j <= last; ++j) row[j] *= inv;
    for (std::size_t j = last + 1; j < seq; ++j) row[j] = T{0};
  });
}

/// `dS = scale * P (dP - rowsum(P dP))` in place of `dp` (the softmax's backward, with the scale of
/// the scores folded in); 0 above the diagonal.
template <class Space, class T>
void causal_softmax_backward(const T* p, T* dp, std::size_t n, std::size_t seq, T scale) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t r) {
    const T* pr = p + r * seq;
    T* d = dp + r * seq;
    const std::size_t last = r % seq;
    T dot = 0;
    for (std::size_t j = 0; j <= last; ++j) dot += pr[j] * d[j];
    for (std::size_t j = 0; j <= last; ++j) d[j] = scale * pr[j] * (d[j] - dot);
    for (std::size_t j = last + 1; j < seq; ++j) d[j] = T{0};
  });
}

}  // namespace meshlib::nn::detail
