// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `matmul_into`: `C = alpha * op(A) * op(B) + beta * C` on rank-2 Kokkos views that the
/// caller owns, the product kernel under `matmul` and the training layer.
///
/// Why a product into a caller's buffer: a training step multiplies the same shapes every
/// iteration, so it keeps its output blocks instead of allocating one per product (as `matmul`
/// does), accumulates gradients with `beta = 1`, and gets the backward pass's `x^T dy` and `dy W^T`
/// from the transpose flags without materialising a transpose (BLAS reads the operand transposed).
///
/// Kernel: `KokkosBlas::gemm` when meshlib has Kokkos Kernels for the element type and memory
/// space (`use_blas_v`: `float` / `double` in host-accessible memory; Debian's build calls the BLAS
/// TPL, OpenBLAS) and the three views share a LayoutRight or LayoutLeft layout; cuBLAS on the
/// instance's stream for `float` / `double` in CUDA memory (tensor/cublas_product.hpp, where
/// meshlib was built with it); otherwise meshlib's
/// own Kokkos kernel, a RangePolicy `parallel_for` on the given execution-space instance: over the
/// rows of `C` on a host (`matmul_into_functor`), over its elements on a GPU
/// (`matmul_into_element_functor`: coalesced, every thread busy). RangePolicy only, over raw pointers: safe from concurrent device
/// threads on Kokkos 3.4.1 (tensor/view.hpp), where Kokkos Kernels' own team-policy fallback is not.
///
/// The edge cases are BLAS's, decided here so both kernels agree: `beta == 0` overwrites `C`
/// without reading it (garbage or NaN in `C` is ignored); `k == 0` or `alpha == 0` gives
/// `beta * C` without reading `A` or `B` (Kokkos Kernels 3.4.1 returns early on `k == 0`, leaving
/// `C` unscaled, so that case never reaches it); an empty `C` does nothing.
///
/// BLAS threads: with one thread per device, a multi-threaded BLAS inside every device would
/// oversubscribe the cores. The first BLAS product therefore sets OpenBLAS to one thread per call
/// (`openblas_set_num_threads`, looked up with `dlsym`, so nothing is required at link time), unless
/// `set_blas_threads_per_device(n)` was called first or `MESHLIB_BLAS_THREADS=n` is set.
/// @code
/// // the backward of y = x W: dW = x^T dy (accumulated), dx = dy W^T
/// meshlib::matmul_into(dw, x, dy, {.transpose_a = true, .beta = 1});
/// meshlib::matmul_into(dx, dy, w, {.transpose_b = true});
/// @endcode

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include <dlfcn.h>

#include <Kokkos_Core.hpp>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/tensor/cublas_product.hpp"
#include "meshlib/tensor/pointer_check.hpp"
#include "meshlib/tensor/view.hpp"

#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
#include <KokkosBlas3_gemm.hpp>
#endif

namespace meshlib {

/// @brief The name of the Kokkos profiling region around each matrix product that the BLAS makes
/// (`matmul_into`, and so `matmul` and the nn layers): Kokkos tools see no kernel launch for it,
/// since the BLAS is not Kokkos. A product that runs as meshlib's own kernel is a Kokkos
/// `parallel_for` instead, and has no such region. `launch_counter` counts the regions.
inline constexpr const char* blas_product_region = "meshlib::matmul_into[BLAS]";

namespace tensor::detail {

inline std::atomic<bool>& blas_threads_chosen() {
  static std::atomic<bool> chosen{false};
  return chosen;
}

/// The threads the last `set_blas_threads_per_device` asked for (1 before any).
inline std::atomic<int>& blas_threads_setting() {
  static std::atomic<int> threads{1};
  return threads;
}

/// OpenBLAS's `openblas_set_num_threads`, when an OpenBLAS is loaded in the process.
inline void (*openblas_setter())(int) {
  static void (*fn)(int) = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  return fn;
}

}  // namespace tensor::detail

/// @brief Sets how many threads the BLAS uses inside one device's `matmul` (process-wide: OpenBLAS
/// has one setting). Call it before the device threads start.
/// @returns whether an OpenBLAS was found to apply it to.
inline bool set_blas_threads_per_device(int threads) {
  tensor::detail::blas_threads_chosen() = true;
  tensor::detail::blas_threads_setting() = threads < 1 ? 1 : threads;
  if (auto fn = tensor::detail::openblas_setter()) {
    fn(threads < 1 ? 1 : threads);
    return true;
  }
  return false;
}

/// @brief The BLAS threads per device last set (`set_blas_threads_per_device`, or
/// `MESHLIB_BLAS_THREADS` at the first product); 1 before either. What to restore after trying
/// another (the mesh advisor does).
inline int blas_threads_per_device() noexcept {
  if (!tensor::detail::blas_threads_chosen())  // what the first product will choose
    if (const char* env = std::getenv("MESHLIB_BLAS_THREADS"); env && std::atoi(env) > 0) return std::atoi(env);
  return tensor::detail::blas_threads_setting();
}

namespace tensor::detail {

/// Applies the default of one BLAS thread per device once, unless the user chose.
inline void ensure_blas_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (blas_threads_chosen()) return;
    int n = 1;
    if (const char* env = std::getenv("MESHLIB_BLAS_THREADS")) n = std::atoi(env);
    set_blas_threads_per_device(n);
  });
}

/// Whether the BLAS may be used at all: not when `MESHLIB_NO_BLAS=1` is set, which makes every
/// product on a host run meshlib's own kernel (the same bits on every machine, and a GPU built with
/// `--fmad=false`'s: the reference runs of scripts/gpu-check.sh). Read once.
inline bool blas_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("MESHLIB_NO_BLAS");
    return v == nullptr || std::string(v) != "1";
  }();
  return allowed;
}

/// Shows a product that a library outside Kokkos makes (the BLAS) to Kokkos tools as the profiling
/// region `blas_product_region` for as long as it lives, because Kokkos tools see only Kokkos' own
/// launches: `launch_counter` (debug/launch_counter.hpp) counts the products by it, a timeline tool
/// shows their time. One check of a flag when no tool is loaded.
class blas_product_scope {
 public:
  blas_product_scope() : on_(Kokkos::Profiling::profileLibraryLoaded()) {
    if (on_) Kokkos::Profiling::pushRegion(blas_product_region);
  }
  ~blas_product_scope() {
    if (on_) Kokkos::Profiling::popRegion();
  }
  blas_product_scope(const blas_product_scope&) = delete;
  blas_product_scope& operator=(const blas_product_scope&) = delete;

 private:
  bool on_;
};

/// Whether products of `T` in memory `Space` go to `KokkosBlas::gemm` (see the file comment).
template <class T, class Space>
inline constexpr bool use_blas_v =
#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
    (std::is_same_v<T, float> || std::is_same_v<T, double>) && host_accessible_v<Space>;
#else
    false;
#endif

/// meshlib's product kernel: one row `i` of `C` per iteration. Every operand is a pointer and two
/// strides, so a transpose is only a swap of strides: `op(A)(i, p) = a[i * a_i + p * a_p]`,
/// `op(B)(p, j) = b[p * b_p + j * b_j]`, `C(i, j) = c[i * c_i + j * c_j]`.
/// Two loop orders: when `op(B)` and `C` rows are unit-stride (no transpose of B, row-major), the
/// i-p-j order (an axpy per `p`, vectorisable); otherwise (`op(B) = B^T`) a dot product per `(i, j)`,
/// unit-stride along `p` on both sides for row-major `A` and `B`.
template <class T>
struct matmul_into_functor {
  const T* a;
  const T* b;
  T* c;
  std::size_t a_i, a_p, b_p, b_j, c_i, c_j;
  std::size_t n, k;  // k == 0: only C = beta * C
  T alpha, beta;

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    T* ci = c + i * c_i;
    if (beta == T{0}) {
      for (std::size_t j = 0; j < n; ++j) ci[j * c_j] = T{0};
    } else if (beta != T{1}) {
      for (std::size_t j = 0; j < n; ++j) ci[j * c_j] *= beta;
    }
    if (k == 0) return;
    const T* ai = a + i * a_i;
    if (b_j == 1 && c_j == 1) {
      for (std::size_t p = 0; p < k; ++p) {
        const T aip = alpha * ai[p * a_p];
        const T* bp = b + p * b_p;
        for (std::size_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
      }
    } else {
      for (std::size_t j = 0; j < n; ++j) {
        const T* bj = b + j * b_j;
        T s{0};
        for (std::size_t p = 0; p < k; ++p) s += ai[p * a_p] * bj[p * b_p];
        ci[j * c_j] += alpha * s;
      }
    }
  }
};

/// meshlib's product kernel on a GPU: one output element `(i, j)` per work item, `j` fastest, so
/// that the threads of a warp read one row of `op(B)` and write one row of `C` in consecutive
/// addresses and share their `op(A)` element (the row kernel above gives each thread a row of `C`
/// of its own: a warp's accesses are `n` elements apart, and one thread per row leaves all but a
/// few hundred of a GPU's threads idle). Each element is computed with the row kernel's operations
/// in the row kernel's order (`beta` first, then one `+= (alpha a) b` per `p`; or a dot product added
/// once), so a GPU built without contracted multiply-adds (nvcc `--fmad=false`) gives the host
/// kernel's bits: what scripts/gpu-check.sh compares (`MESHLIB_NO_BLAS=1` on the CPU side).
template <class T>
struct matmul_into_element_functor {
  matmul_into_functor<T> op;  ///< the operands, strides and scalars, as the row kernel has them

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t e) const {
    const std::size_t i = e / op.n, j = e % op.n;
    T& cij = op.c[i * op.c_i + j * op.c_j];
    T v = op.beta == T{0} ? T{0} : (op.beta == T{1} ? cij : cij * op.beta);
    if (op.k != 0) {
      const T* ai = op.a + i * op.a_i;
      if (op.b_j == 1 && op.c_j == 1) {  // the row kernel's i-p-j order
        for (std::size_t p = 0; p < op.k; ++p) v += (op.alpha * ai[p * op.a_p]) * op.b[p * op.b_p + j];
      } else {  // its dot product
        const T* bj = op.b + j * op.b_j;
        T s{0};
        for (std::size_t p = 0; p < op.k; ++p) s += ai[p * op.a_p] * bj[p * op.b_p];
        v += op.alpha * s;
      }
    }
    cij = v;
  }
};

/// `(r, c)` for a message.
inline std::string shape_text(std::size_t r, std::size_t c) {
  return "(" + std::to_string(r) + ", " + std::to_string(c) + ")";
}

/// Throws when `op(A) . op(B)` does not chain or does not fit `C` (see `matmul_into`).
template <class VC, class VA, class VB>
void check_matmul_into_shapes(const VC& c, const VA& a, const VB& b, bool ta, bool tb) {
  const std::size_t m = ta ? a.extent(1) : a.extent(0), k = ta ? a.extent(0) : a.extent(1);
  const std::size_t k2 = tb ? b.extent(1) : b.extent(0), n = tb ? b.extent(0) : b.extent(1);
  if (k == k2 && c.extent(0) == m && c.extent(1) == n) return;
  const std::string operands = "op(A) . op(B) with A " + shape_text(a.extent(0), a.extent(1)) +
                               (ta ? " transposed" : " not transposed") + " and B " +
                               shape_text(b.extent(0), b.extent(1)) + (tb ? " transposed" : " not transposed") + " is " +
                               shape_text(m, k) + " . " + shape_text(k2, n);
  if (k != k2)
    throw sharding_error("meshlib: matmul_into: " + operands + ": the contraction sizes " + std::to_string(k) + " and " +
                         std::to_string(k2) + " differ; check the operands' shapes and the transpose flags");
  throw sharding_error("meshlib: matmul_into: " + operands + " = " + shape_text(m, n) + ", but C is " +
                       shape_text(c.extent(0), c.extent(1)) + "; pass a C of shape " + shape_text(m, n));
}

template <class V>
inline constexpr bool blas_layout_v =
    std::is_same_v<typename V::array_layout, Kokkos::LayoutRight> || std::is_same_v<typename V::array_layout, Kokkos::LayoutLeft>;

/// meshlib's kernel on `exec` (no BLAS), after the shapes were checked: also what tests call to
/// exercise it for types that do have a BLAS.
template <class Exec, class VC, class VA, class VB>
void matmul_into_kernel(const Exec& exec, const VC& c, const VA& a, const VB& b, bool ta, bool tb,
                        typename VC::non_const_value_type alpha, typename VC::non_const_value_type beta) {
  using T = typename VC::non_const_value_type;
  const std::size_t m = c.extent(0), n = c.extent(1), k = alpha == T{0} ? 0 : (ta ? a.extent(0) : a.extent(1));
  if (m == 0 || n == 0) return;
  matmul_into_functor<T> f{a.data(),
                           b.data(),
                           c.data(),
                           ta ? a.stride(1) : a.stride(0),
                           ta ? a.stride(0) : a.stride(1),
                           tb ? b.stride(1) : b.stride(0),
                           tb ? b.stride(0) : b.stride(1),
                           c.stride(0),
                           c.stride(1),
                           n,
                           k,
                           alpha,
                           beta};
  if constexpr (host_accessible_v<typename Exec::memory_space>) launch_on(exec, m, f);
  else launch_on(exec, m * n, matmul_into_element_functor<T>{f});
}

}  // namespace tensor::detail

/// @brief The options of `matmul_into`: the transpose of each operand, and `alpha`, `beta`
/// (converted to the element type). Designated initialisers name what a positional BLAS call hides
/// (`{.transpose_a = true, .beta = 1}`); the scalars are `double`, not the element type, so that one
/// non-template struct serves every type (exact for the values products use: 0, 1, integers).
struct matmul_into_options {
  bool transpose_a = false;  ///< `op(A) = A^T` (`A` stored `k x m`)
  bool transpose_b = false;  ///< `op(B) = B^T` (`B` stored `n x k`)
  double alpha = 1;          ///< scales the product
  double beta = 0;           ///< scales `C`'s previous contents; 0: `C` is not read
};

/// @brief `C = alpha * op(A) * op(B) + beta * C` on `exec` (see the file comment for the kernel and
/// the edge cases). `op(A)` is `m x k`, `op(B)` is `k x n`, `C` is `m x n`; any rank-2 views of one
/// element type, in a memory space `exec` can access (`A` and `B` may be views of `const`). Rank-3
/// views are a batch: `C[i] = alpha op(A[i]) op(B[i]) + beta C[i]` for each `i` of the first
/// dimension (one strided-batched cuBLAS call on a GPU; each product in turn elsewhere).
/// @pre `C` overlaps neither `A` nor `B`.
/// @post `C` holds the result when the call returns (on a GPU too, unless `MESHLIB_ASYNC_KERNELS=1`:
/// then the product is ordered on the instance's stream, `tensor/view.hpp`'s `finish_launch`).
/// @throws sharding_error naming the three shapes and the transposes when the contraction sizes
/// differ or `C`'s shape is not `m x n`, and naming the three lengths when a batch's differ.
template <class Exec, class VC, class VA, class VB>
  requires(Kokkos::is_execution_space<Exec>::value && Kokkos::is_view<VC>::value && Kokkos::is_view<VA>::value &&
           Kokkos::is_view<VB>::value)
void matmul_into(const Exec& exec, const VC& c, const VA& a, const VB& b, const matmul_into_options& o = {}) {
  using T = typename VC::non_const_value_type;
  using space = typename VC::memory_space;
  static_assert((VA::rank == 2 && VB::rank == 2 && VC::rank == 2) || (VA::rank == 3 && VB::rank == 3 && VC::rank == 3),
                "meshlib: matmul_into needs three rank-2 views, or three rank-3 views (a batch of products over "
                "their first dimension)");
  static_assert(std::is_same_v<typename VA::non_const_value_type, T> && std::is_same_v<typename VB::non_const_value_type, T>,
                "meshlib: matmul_into: A, B and C must have the same element type");
  static_assert(std::is_same_v<typename VC::value_type, T>, "meshlib: matmul_into: C must be writable (not a view of const)");
  using entry = diagnostic::op_t<"matmul_into">;
  constexpr bool accessible = require_accessible<entry, diagnostic::op_t<"C">, Exec, space>() &&
                              require_accessible<entry, diagnostic::op_t<"A">, Exec, typename VA::memory_space>() &&
                              require_accessible<entry, diagnostic::op_t<"B">, Exec, typename VB::memory_space>();
  if constexpr (accessible && VC::rank == 3) {
    // A batch: C[i] = alpha op(A[i]) op(B[i]) + beta C[i]. One strided-batched cuBLAS call on a GPU
    // (attention's products per head and sequence would otherwise be one launch each); elsewhere
    // the rank-2 product of each matrix in turn, so the numbers are those of the separate calls.
    const std::size_t batch = c.extent(0);
    if (a.extent(0) != batch || b.extent(0) != batch)
      throw sharding_error("meshlib: matmul_into: a batch of products needs as many matrices in A, B and C (their first "
                           "dimension), but A has " + std::to_string(a.extent(0)) + ", B " + std::to_string(b.extent(0)) +
                           " and C " + std::to_string(batch) + "; pass batches of one length");
    if (batch == 0) return;
    const auto slice = [](const auto& v, std::size_t i) {
      using V = std::remove_cvref_t<decltype(v)>;  // unmanaged, so no reference count is touched
      using um = Kokkos::View<typename V::data_type, typename V::array_layout, typename V::memory_space,
                              Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
      return Kokkos::subview(um(v), i, Kokkos::ALL, Kokkos::ALL);
    };
    tensor::detail::check_matmul_into_shapes(slice(c, 0), slice(a, 0), slice(b, 0), o.transpose_a, o.transpose_b);
    if constexpr (tensor::detail::use_cublas_v<T, space, Exec> && std::is_same_v<typename VA::memory_space, space> &&
                  std::is_same_v<typename VB::memory_space, space> &&
                  std::is_same_v<typename VA::array_layout, Kokkos::LayoutRight> &&
                  std::is_same_v<typename VB::array_layout, Kokkos::LayoutRight> &&
                  std::is_same_v<typename VC::array_layout, Kokkos::LayoutRight>) {
      const T alpha = static_cast<T>(o.alpha), beta = static_cast<T>(o.beta);
      const std::size_t k = o.transpose_a ? a.extent(1) : a.extent(2);
      if (c.extent(1) == 0 || c.extent(2) == 0) return;
      if (k != 0 && alpha != T{0} && tensor::detail::blas_allowed()) {
        check_device_readable<space>(c.data(), "matmul_into", "C");
        check_device_readable<space>(a.data(), "matmul_into", "A");
        check_device_readable<space>(b.data(), "matmul_into", "B");
#if MESHLIB_HAS_CUBLAS
        const auto product = tensor::detail::make_column_major_product(true, o.transpose_a, o.transpose_b, c.extent(1),
                                                                       c.extent(2), k, a.stride(1), b.stride(1), c.stride(1));
        const tensor::detail::blas_product_scope region;
        tensor::detail::cublas_product(exec, product, alpha, a.data(), b.data(), beta, c.data(), batch,
                                       tensor::detail::make_batch_strides(product, a.stride(0), b.stride(0), c.stride(0)));
#endif
        return;
      }
    }
    for (std::size_t i = 0; i < batch; ++i) matmul_into(exec, slice(c, i), slice(a, i), slice(b, i), o);
  } else if constexpr (accessible) {
    tensor::detail::check_matmul_into_shapes(c, a, b, o.transpose_a, o.transpose_b);
    // The views' types say device memory; their pointers may still be host memory (a view wrapped
    // around a host buffer): asked at run time where the space has a pointer query (pointer_check.hpp).
    check_device_readable<space>(c.data(), "matmul_into", "C");
    check_device_readable<typename VA::memory_space>(a.data(), "matmul_into", "A");
    check_device_readable<typename VB::memory_space>(b.data(), "matmul_into", "B");
    const T alpha = static_cast<T>(o.alpha), beta = static_cast<T>(o.beta);
    const std::size_t k = o.transpose_a ? a.extent(0) : a.extent(1);
    if constexpr (tensor::detail::use_blas_v<T, space> && std::is_same_v<typename VA::memory_space, space> &&
                  std::is_same_v<typename VB::memory_space, space> &&
                  std::is_same_v<typename VA::array_layout, typename VC::array_layout> &&
                  std::is_same_v<typename VB::array_layout, typename VC::array_layout> && tensor::detail::blas_layout_v<VC>) {
      if (c.extent(0) == 0 || c.extent(1) == 0) return;
      if (k == 0 || alpha == T{0} || !tensor::detail::blas_allowed())
        return tensor::detail::matmul_into_kernel(exec, c, a, b, o.transpose_a, o.transpose_b, alpha, beta);
#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
      tensor::detail::ensure_blas_threads();
      // Unmanaged: no reference count is touched, so any device thread may call this (tensor/view.hpp).
      using layout = typename VC::array_layout;
      using um = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
      const Kokkos::View<const T**, layout, space, um> av = a;
      const Kokkos::View<const T**, layout, space, um> bv = b;
      const Kokkos::View<T**, layout, space, um> cv = c;
      const char* ta = o.transpose_a ? "T" : "N";
      const char* tb = o.transpose_b ? "T" : "N";
      const tensor::detail::blas_product_scope region;
#if KOKKOS_VERSION >= 40000
      if constexpr (std::is_same_v<Exec, typename space::execution_space>) KokkosBlas::gemm(exec, ta, tb, alpha, av, bv, beta, cv);
      else KokkosBlas::gemm(ta, tb, alpha, av, bv, beta, cv);
#else
      KokkosBlas::gemm(ta, tb, alpha, av, bv, beta, cv);  // Kokkos Kernels 3.x has no instance overload
#endif
#endif
    } else if constexpr (tensor::detail::use_cublas_v<T, space, Exec> &&
                         std::is_same_v<typename VA::memory_space, space> &&
                         std::is_same_v<typename VB::memory_space, space> &&
                         std::is_same_v<typename VA::array_layout, typename VC::array_layout> &&
                         std::is_same_v<typename VB::array_layout, typename VC::array_layout> &&
                         tensor::detail::blas_layout_v<VC>) {
      if (c.extent(0) == 0 || c.extent(1) == 0) return;
      if (k == 0 || alpha == T{0} || !tensor::detail::blas_allowed())
        return tensor::detail::matmul_into_kernel(exec, c, a, b, o.transpose_a, o.transpose_b, alpha, beta);
#if MESHLIB_HAS_CUBLAS
      constexpr bool row_major = std::is_same_v<typename VC::array_layout, Kokkos::LayoutRight>;
      const auto lead = [](const auto& v) { return row_major ? v.stride(0) : v.stride(1); };
      const tensor::detail::blas_product_scope region;
      tensor::detail::cublas_product(
          exec,
          tensor::detail::make_column_major_product(row_major, o.transpose_a, o.transpose_b, c.extent(0), c.extent(1), k,
                                                    lead(a), lead(b), lead(c)),
          alpha, a.data(), b.data(), beta, c.data());
#endif
    } else {
      tensor::detail::matmul_into_kernel(exec, c, a, b, o.transpose_a, o.transpose_b, alpha, beta);
    }
  }
}

/// @brief `matmul_into` on the running device's execution-space instance (inside `spmd` /
/// `shard_map`), else the default instance of `C`'s memory space.
template <class VC, class VA, class VB>
  requires(Kokkos::is_view<VC>::value && Kokkos::is_view<VA>::value && Kokkos::is_view<VB>::value)
void matmul_into(const VC& c, const VA& a, const VB& b, const matmul_into_options& o = {}) {
  matmul_into(tensor::detail::current_exec<typename VC::memory_space>(), c, a, b, o);
}

}  // namespace meshlib
