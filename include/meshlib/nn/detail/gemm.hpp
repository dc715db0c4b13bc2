// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The one BLAS call of the training layer: `C = alpha op(A) op(B) + beta C` on raw row-major
/// buffers that the caller owns, so a training step reuses its buffers instead of allocating a fresh
/// block per product (as `meshlib::matmul` does) and gets the transposed products of the backward
/// pass (`x^T dy`, `dy W^T`) without materialising a transpose.
///
/// `KokkosBlas::gemm` on unmanaged views when meshlib has Kokkos Kernels (the BLAS TPL, OpenBLAS,
/// with one thread per device: `ensure_blas_threads`); otherwise a plain loop. Unmanaged views touch
/// no reference count, so any device thread may call it (docs/tensors.md, the reference-count rule).

#include <cstddef>
#include <type_traits>

#include "meshlib/tensor/matmul.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// `C (m x n) = alpha * op(A) * op(B) + beta * C`; `op(A)` is `m x k` (`A` stored `k x m` when
/// `trans_a`), `op(B)` is `k x n` (`B` stored `n x k` when `trans_b`). Row-major, contiguous.
template <class T>
void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, T alpha, const T* a, const T* b,
          T beta, T* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (std::size_t i = 0; i < m * n; ++i) c[i] = beta == T{0} ? T{0} : beta * c[i];
    return;
  }
  if constexpr (meshlib::detail::use_blas_v<T, Kokkos::HostSpace>) {
#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
    meshlib::detail::ensure_blas_threads();
    using cview = meshlib::detail::unmanaged_view_t<const T, 2, Kokkos::HostSpace>;
    using view = meshlib::detail::unmanaged_view_t<T, 2, Kokkos::HostSpace>;
    cview av(a, trans_a ? k : m, trans_a ? m : k);
    cview bv(b, trans_b ? n : k, trans_b ? k : n);
    view cv(c, m, n);
    KokkosBlas::gemm(trans_a ? "T" : "N", trans_b ? "T" : "N", alpha, av, bv, beta, cv);
#endif
  } else {
    for (std::size_t i = 0; i < m; ++i) {
      T* ci = c + i * n;
      for (std::size_t j = 0; j < n; ++j) ci[j] = beta == T{0} ? T{0} : beta * ci[j];
      for (std::size_t p = 0; p < k; ++p) {
        const T aip = alpha * (trans_a ? a[p * m + i] : a[i * k + p]);
        if (trans_b) {
          for (std::size_t j = 0; j < n; ++j) ci[j] += aip * b[j * k + p];
        } else {
          const T* bp = b + p * n;
          for (std::size_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
        }
      }
    }
  }
}

}  // namespace meshlib::nn::detail
