// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The kernels of the losses and of embedding's id check, each one RangePolicy `parallel_for`
/// on the running device's instance over memory `Space` (`meshlib::launch`), and the read-back
/// of the one or two numbers the host needs from them (a copy only for device memory).
///
/// Why free functions over pointers, templated on the element type and the memory space only: nvcc
/// names an extended device lambda's kernel after its enclosing function, and its generated host stub
/// spells a class-type template argument (the mesh's `axis<"data">`, a `fixed_string`) in a form g++
/// cannot parse (`fixed_string<5>{char [5]{...}}`), so a kernel written inside code templated on a mesh
/// does not compile for CUDA. These functions are instantiated for CUDA in tests/cuda/nn_headers.cpp.
///
/// Sums over rows are added in row order by one work item: the same chain of additions on every
/// backend (a `parallel_reduce` is unsafe from several device threads on Kokkos 3.4.1, and its order
/// would depend on the backend).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "meshlib/nn/loss_function.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// `mx[i]` = the largest of row `i`'s `cols` logits at `z` (row-major).
template <class Space, class T>
void row_max(const T* z, std::size_t rows, std::size_t cols, T* mx) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j < cols; ++j) m = m < z[i * cols + j] ? z[i * cols + j] : m;
    mx[i] = m;
  });
}

/// Softmax cross-entropy, second pass: `g = exp(z - mx)`, `sum[i]` its row sums, `tgt[i]` the label's
/// logit where this block of columns (`[col0, col0 + cols)` of the classes) holds it, else 0.
template <class Space, class T>
void exp_and_target(const T* z, std::size_t rows, std::size_t cols, std::size_t col0, const std::int32_t* lab,
                    const T* mx, T* g, T* sum, T* tgt) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    T s = 0;
    for (std::size_t j = 0; j < cols; ++j) s += (g[i * cols + j] = std::exp(z[i * cols + j] - mx[i]));
    sum[i] = s;
    const std::size_t l = static_cast<std::size_t>(lab[i]);
    tgt[i] = l >= col0 && l < col0 + cols ? z[i * cols + (l - col0)] : T{0};
  });
}

/// Softmax cross-entropy's totals: one work item adds the rows' terms `term[i]` and counts the rows
/// whose target logit is the maximum, in row order, into `term[rows]` and `term[rows + 1]`, which the
/// host reads back. Returns {loss, correct} of these rows.
template <class Space, class T>
loss_part cross_entropy_totals(std::size_t rows, const T* mx, const T* tgt, double* term) {
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    double loss = 0, correct = 0;
    for (std::size_t i = 0; i < rows; ++i) {
      loss += term[i];
      correct += tgt[i] >= mx[i] ? 1 : 0;
    }
    term[rows] = loss;
    term[rows + 1] = correct;
  });
  double totals[2];
  meshlib::copy_to_host<Space>(totals, term + rows, 2);
  return loss_part{totals[0], static_cast<std::size_t>(totals[1])};
}

/// Softmax cross-entropy, last pass, with complete row maxima, normalisers and target logits:
/// `term[i]` = row `i`'s loss / `global_batch`, `g` = the gradient of the mean loss; then one work item
/// adds the terms and counts the rows whose target logit is the maximum, in row order, into
/// `term[rows]` and `term[rows + 1]`. Returns {loss, correct} of these rows.
template <class Space, class T>
loss_part cross_entropy_terms(std::size_t rows, std::size_t cols, std::size_t col0, const std::int32_t* lab,
                              const T* mx, const T* sum, const T* tgt, std::size_t global_batch, T* g, double* term) {
  const T inv_b = T{1} / static_cast<T>(global_batch);
  const double gb = static_cast<double>(global_batch);
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    term[i] = (static_cast<double>(std::log(sum[i])) + mx[i] - tgt[i]) / gb;
    const std::size_t l = static_cast<std::size_t>(lab[i]);
    const T inv = T{1} / sum[i];
    for (std::size_t j = 0; j < cols; ++j) g[i * cols + j] *= inv * inv_b;
    if (l >= col0 && l < col0 + cols) g[i * cols + (l - col0)] -= inv_b;
  });
  return cross_entropy_totals<Space>(rows, mx, tgt, term);
}

/// Softmax cross-entropy of rows whose classes are all on this device (no class axis), the three
/// passes of `row_max`, `exp_and_target` and `cross_entropy_terms` in one kernel: a row needs no
/// other device's maximum or normaliser, so its work item runs them one after the other, each with
/// the same expressions in the same order (the loss and gradient are bitwise those of the three
/// kernels; issue 38: fewer kernels per step). Then `cross_entropy_totals`. Returns {loss, correct}.
template <class Space, class T>
loss_part softmax_cross_entropy_rows(const T* z, std::size_t rows, std::size_t cols, const std::int32_t* lab,
                                     std::size_t global_batch, T* g, T* mx, T* sum, T* tgt, double* term) {
  const T inv_b = T{1} / static_cast<T>(global_batch);
  const double gb = static_cast<double>(global_batch);
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* zi = z + i * cols;
    T* gi = g + i * cols;
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j < cols; ++j) m = m < zi[j] ? zi[j] : m;
    T s = 0;
    for (std::size_t j = 0; j < cols; ++j) s += (gi[j] = std::exp(zi[j] - m));
    const std::size_t l = static_cast<std::size_t>(lab[i]);
    const T t = zi[l];  // the labels were checked against the classes, all of them here
    mx[i] = m;
    sum[i] = s;
    tgt[i] = t;
    term[i] = (static_cast<double>(std::log(s)) + m - t) / gb;
    const T inv = T{1} / s;
    for (std::size_t j = 0; j < cols; ++j) gi[j] *= inv * inv_b;
    gi[l] -= inv_b;
  });
  return cross_entropy_totals<Space>(rows, mx, tgt, term);
}

/// Mean squared error: `g = two_scale (z - t)` over a `rows x cols` block whose targets are rows of
/// `width` values at `t` (the block's columns first), and `*sum` = `scale` times the sum of the
/// squared differences (in double, row-major; not read back: it may still be completed by a psum).
template <class Space, class T>
void squared_error(const T* z, const T* t, std::size_t rows, std::size_t cols, std::size_t width, T two_scale,
                   double scale, T* g, double* sum) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t j = 0; j < cols; ++j) g[i * cols + j] = two_scale * (z[i * cols + j] - t[i * width + j]);
  });
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    double s = 0;
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) {
        const double d = static_cast<double>(z[i * cols + j]) - static_cast<double>(t[i * width + j]);
        s += d * d;
      }
    *sum = s * scale;
  });
}

/// The index of the first of `rows` ids at `id` outside `[0, vocab)`, or `rows` when all are inside:
/// one work item writes it to `*res` (memory `Space`), read back here.
template <class Space>
std::size_t first_id_outside(const std::int32_t* id, std::size_t rows, std::int32_t vocab, std::size_t* res) {
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    std::size_t first = rows;
    for (std::size_t i = 0; i < rows; ++i)
      if (id[i] < 0 || id[i] >= vocab) {
        first = i;
        break;
      }
    *res = first;
  });
  return meshlib::read_back<Space>(res);
}

}  // namespace meshlib::nn::detail
