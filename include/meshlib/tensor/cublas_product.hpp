// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `matmul_into`'s products on CUDA memory through cuBLAS (`cublasSgemm` / `cublasDgemm`),
/// on the stream of the device's execution-space instance: the BLAS of a GPU, as OpenBLAS is the
/// host's (issue 38: meshlib's own kernel, one element per thread, is about 1% of an H200 for the
/// products a training step is made of).
///
/// Built when `MESHLIB_ENABLE_CUBLAS` is 1 and Kokkos has CUDA: meshlib's CMake target defines it
/// and links `CUDA::cublas` when Kokkos was built with CUDA and the toolkit has cuBLAS. As on the
/// host, `MESHLIB_NO_BLAS=1` sends every product to meshlib's kernel instead (the same bits as the
/// CPU's: the GPU check's loss comparison), and the product is shown to Kokkos tools as the region
/// `blas_product_region`.
///
/// cuBLAS is column-major; meshlib's blocks are row-major (`LayoutRight`). A row-major `m x n`
/// matrix is, read column-major, its `n x m` transpose with the same leading dimension, so
/// `C = op(A) op(B)` is computed as `C^T = op(B)^T op(A)^T`: B first, A second, the sizes `n, m, k`
/// (`column_major_product`, host code with host tests). The precision is float32's (cuBLAS's
/// default math mode: no TF32, as PyTorch's default; JAX's default precision on a GPU may use it).

#include <cstddef>
#include <climits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "meshlib/core/errors.hpp"
#include "meshlib/tensor/view.hpp"

#if defined(MESHLIB_ENABLE_CUBLAS) && MESHLIB_ENABLE_CUBLAS && defined(KOKKOS_ENABLE_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
/// 1 where `matmul_into` calls cuBLAS: `MESHLIB_ENABLE_CUBLAS` is 1 and Kokkos has CUDA; else 0.
#define MESHLIB_HAS_CUBLAS 1
#else
/// 1 where `matmul_into` calls cuBLAS: `MESHLIB_ENABLE_CUBLAS` is 1 and Kokkos has CUDA; else 0.
#define MESHLIB_HAS_CUBLAS 0
#endif

namespace meshlib::tensor::detail {

/// A product `C = alpha op(A) op(B) + beta C` of row-major (`LayoutRight`) or column-major
/// (`LayoutLeft`) matrices as a column-major BLAS call's arguments: `gemm(trans_first,
/// trans_second, m, n, k, alpha, first, ld_first, second, ld_second, beta, C, ld_c)`, where the
/// first operand is B when `b_first` (row-major) and A otherwise.
struct column_major_product {
  bool b_first;                     ///< the first operand is B (row-major blocks), else A
  bool trans_first, trans_second;   ///< the BLAS op of each operand (true: transposed)
  std::size_t m, n, k;              ///< the BLAS sizes: op(first) is m x k, op(second) k x n
  std::size_t ld_first, ld_second;  ///< the operands' leading dimensions
  std::size_t ld_c;                 ///< C's leading dimension
};

/// The BLAS arguments of `op(A) . op(B)` into `C` (`C` is `rows x cols`, the contraction `k`),
/// from the strides of row-major views (`row_major`: the stride of dimension 0 is the leading one)
/// or column-major views (the stride of dimension 1). A leading dimension is at least 1, as BLAS
/// requires even of an operand with no elements.
inline column_major_product make_column_major_product(bool row_major, bool transpose_a, bool transpose_b,
                                                      std::size_t rows, std::size_t cols, std::size_t k,
                                                      std::size_t ld_a, std::size_t ld_b, std::size_t ld_c) {
  const auto at_least_1 = [](std::size_t v) { return v < 1 ? std::size_t{1} : v; };
  if (row_major)  // C^T = op(B)^T op(A)^T, each row-major matrix read as its column-major transpose
    return {true, transpose_b, transpose_a, cols, rows, k, at_least_1(ld_b), at_least_1(ld_a), at_least_1(ld_c)};
  return {false, transpose_a, transpose_b, rows, cols, k, at_least_1(ld_a), at_least_1(ld_b), at_least_1(ld_c)};
}

/// The distances between consecutive matrices of a batch of products (strided-batched BLAS), in
/// the order of `p`'s operands: the first operand is B's when `p.b_first`.
struct column_major_batch_strides {
  std::size_t first, second, c;  ///< elements from one matrix to the next
};

/// `column_major_batch_strides` of A's, B's and C's batch strides for the product `p`.
inline column_major_batch_strides make_batch_strides(const column_major_product& p, std::size_t stride_a,
                                                     std::size_t stride_b, std::size_t stride_c) {
  return p.b_first ? column_major_batch_strides{stride_b, stride_a, stride_c}
                   : column_major_batch_strides{stride_a, stride_b, stride_c};
}

#if MESHLIB_HAS_CUBLAS

/// Throws `meshlib::error` naming the cuBLAS call and its status when it failed.
inline void check_cublas(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw error(std::string("meshlib: matmul_into: ") + call + " failed: " + cublasGetStatusString(status) +
              " (status " + std::to_string(static_cast<int>(status)) +
              "); set MESHLIB_NO_BLAS=1 to run the products with meshlib's own kernel");
}

/// This thread's cuBLAS handle for GPU `device`, bound to `stream`. One handle per thread and GPU:
/// a handle must not be used by two threads at once, and each mesh device runs on a thread of its
/// own (cuBLAS's advice), so no lock is taken. Made on the first product and destroyed when the
/// thread ends.
inline cublasHandle_t cublas_handle(int device, cudaStream_t stream) {
  struct handles {
    std::vector<std::pair<int, cublasHandle_t>> of_device;
    ~handles() {
      for (auto& [d, h] : of_device) (void)cublasDestroy(h);
    }
  };
  thread_local handles mine;
  cublasHandle_t h = nullptr;
  for (const auto& [d, handle] : mine.of_device)
    if (d == device) h = handle;
  if (h == nullptr) {
    int previous = 0;
    (void)cudaGetDevice(&previous);
    if (previous != device) (void)cudaSetDevice(device);  // a handle belongs to the current GPU
    const cublasStatus_t made = cublasCreate(&h);
    if (previous != device) (void)cudaSetDevice(previous);
    check_cublas(made, "cublasCreate");
    mine.of_device.emplace_back(device, h);
  }
  check_cublas(cublasSetStream(h, stream), "cublasSetStream");
  return h;
}

/// `c = alpha op(first) op(second) + beta c` (column-major `p`) on `exec`'s stream, for `batch`
/// matrices `strides` apart (one strided-batched call: attention's products per head and
/// sequence), waited for as each of meshlib's kernels is (`finish_launch`).
template <class T>
void cublas_product(const Kokkos::Cuda& exec, const column_major_product& p, T alpha, const T* a, const T* b, T beta,
                    T* c, std::size_t batch = 1, column_major_batch_strides strides = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "meshlib: cuBLAS products of float or double");
  for (std::size_t v : {p.m, p.n, p.k, p.ld_first, p.ld_second, p.ld_c, batch})
    if (v > static_cast<std::size_t>(INT_MAX))
      throw error("meshlib: matmul_into: a size, leading dimension or batch of " + std::to_string(v) +
                  " is beyond cuBLAS's int; split the product, or set MESHLIB_NO_BLAS=1");
  const cublasHandle_t h = cublas_handle(exec.cuda_device(), exec.cuda_stream());
  const T* first = p.b_first ? b : a;
  const T* second = p.b_first ? a : b;
  const auto op = [](bool t) { return t ? CUBLAS_OP_T : CUBLAS_OP_N; };
  const auto i = [](std::size_t v) { return static_cast<int>(v); };
  const auto ll = [](std::size_t v) { return static_cast<long long>(v); };
  if (batch == 1) {
    if constexpr (std::is_same_v<T, float>)
      check_cublas(cublasSgemm(h, op(p.trans_first), op(p.trans_second), i(p.m), i(p.n), i(p.k), &alpha, first,
                               i(p.ld_first), second, i(p.ld_second), &beta, c, i(p.ld_c)),
                   "cublasSgemm");
    else
      check_cublas(cublasDgemm(h, op(p.trans_first), op(p.trans_second), i(p.m), i(p.n), i(p.k), &alpha, first,
                               i(p.ld_first), second, i(p.ld_second), &beta, c, i(p.ld_c)),
                   "cublasDgemm");
  } else if constexpr (std::is_same_v<T, float>) {
    check_cublas(cublasSgemmStridedBatched(h, op(p.trans_first), op(p.trans_second), i(p.m), i(p.n), i(p.k), &alpha,
                                           first, i(p.ld_first), ll(strides.first), second, i(p.ld_second),
                                           ll(strides.second), &beta, c, i(p.ld_c), ll(strides.c), i(batch)),
                 "cublasSgemmStridedBatched");
  } else {
    check_cublas(cublasDgemmStridedBatched(h, op(p.trans_first), op(p.trans_second), i(p.m), i(p.n), i(p.k), &alpha,
                                           first, i(p.ld_first), ll(strides.first), second, i(p.ld_second),
                                           ll(strides.second), &beta, c, i(p.ld_c), ll(strides.c), i(batch)),
                 "cublasDgemmStridedBatched");
  }
  finish_launch(exec);  // as a kernel of meshlib's (tensor/view.hpp)
}

#endif  // MESHLIB_HAS_CUBLAS

/// Whether `matmul_into` sends products of `T` in memory `Space` on `Exec` to cuBLAS.
template <class T, class Space, class Exec>
inline constexpr bool use_cublas_v =
#if MESHLIB_HAS_CUBLAS
    (std::is_same_v<T, float> || std::is_same_v<T, double>) && std::is_same_v<Exec, Kokkos::Cuda> &&
    (std::is_same_v<Space, Kokkos::CudaSpace> || std::is_same_v<Space, Kokkos::CudaUVMSpace>);
#else
    false;
#endif

}  // namespace meshlib::tensor::detail
