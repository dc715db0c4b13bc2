// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Which optional parts this translation unit was compiled with, as `meshlib::config`.
///
/// Each optional part is switched on by one macro, which the matching CMake target defines (and
/// which a user of the single header defines by hand, next to linking the library it needs):
///
/// | macro                               | CMake target             | what it enables                                       |
/// | ----------------------------------- | ------------------------ | ----------------------------------------------------- |
/// | `MESHLIB_ENABLE_KOKKOS_KERNELS=1`   | meshlib::kokkos_kernels  | matmul through `KokkosBlas::gemm` (BLAS speed) instead of meshlib's own kernel |
/// | `MESHLIB_ENABLE_CUBLAS=1`           | meshlib::meshlib (Kokkos with CUDA) | `matmul_into`'s products in CUDA memory through cuBLAS |
/// | `MESHLIB_ENABLE_MPI=1`              | meshlib::mpi             | `<meshlib/mpi.hpp>`: MPI and hybrid communicators, `meshlib::mpi::initialize` |
/// | `MESHLIB_ENABLE_NCCL=1`             | meshlib::nccl            | the NCCL communicator (CUDA devices)                  |
/// | `MESHLIB_ENABLE_TBB=1`              | meshlib::tbb             | the oneTBB-backed parts (parallel data loading)       |
///
/// One macro changes how meshlib is compiled, not what it does: `MESHLIB_SEPARATE_COMPILATION`
/// (defined, with any value) declares the mesh-independent runtime `extern template`, to be
/// compiled once by `<meshlib/src.hpp>` in one translation unit of the program
/// (`<meshlib/separate_compilation.hpp>`; `meshlib_enable_fast_build(target RUNTIME)` sets both up).
///
/// None is switched on by finding a header with `__has_include`: each needs a library at link
/// time too, and a header found without its library would turn into a link error far from the
/// cause. Define `MESHLIB_VERBOSE_CONFIG` to have the compiler print one line saying which parts
/// are on (and which could be, because their headers are on the include path).
///
/// Example:
/// @code
/// std::cout << "matmul kernel: " << meshlib::config::matmul_kernel << '\n';
/// if constexpr (!meshlib::config::mpi) { /* run on threads only */ }
/// @endcode

#include <string_view>

#include "meshlib/version.hpp"

#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
#define MESHLIB_CONFIG_KOKKOS_KERNELS_ 1
#else
#define MESHLIB_CONFIG_KOKKOS_KERNELS_ 0
#endif
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
#define MESHLIB_CONFIG_MPI_ 1
#else
#define MESHLIB_CONFIG_MPI_ 0
#endif
#if defined(MESHLIB_ENABLE_CUBLAS) && MESHLIB_ENABLE_CUBLAS
#define MESHLIB_CONFIG_CUBLAS_ 1
#else
#define MESHLIB_CONFIG_CUBLAS_ 0
#endif
#if defined(MESHLIB_ENABLE_NCCL) && MESHLIB_ENABLE_NCCL
#define MESHLIB_CONFIG_NCCL_ 1
#else
#define MESHLIB_CONFIG_NCCL_ 0
#endif
#if defined(MESHLIB_SEPARATE_COMPILATION)
#define MESHLIB_CONFIG_SEPARATE_COMPILATION_ 1
#else
#define MESHLIB_CONFIG_SEPARATE_COMPILATION_ 0
#endif
#if defined(MESHLIB_ENABLE_TBB) && MESHLIB_ENABLE_TBB
#define MESHLIB_CONFIG_TBB_ 1
#else
#define MESHLIB_CONFIG_TBB_ 0
#endif

namespace meshlib {

/// @brief The optional parts compiled into this translation unit (see the table in the file's doc).
struct config {
  /// @brief meshlib's version, "major.minor.patch".
  static constexpr std::string_view version{MESHLIB_VERSION_STRING};
  /// @brief True when matmul calls `KokkosBlas::gemm` (`MESHLIB_ENABLE_KOKKOS_KERNELS`).
  static constexpr bool kokkos_kernels = MESHLIB_CONFIG_KOKKOS_KERNELS_ == 1;
  /// @brief True when products in CUDA memory go to cuBLAS (`MESHLIB_ENABLE_CUBLAS`; it takes
  /// effect where Kokkos has CUDA).
  static constexpr bool cublas = MESHLIB_CONFIG_CUBLAS_ == 1;
  /// @brief True when the MPI communicators are available (`MESHLIB_ENABLE_MPI`).
  static constexpr bool mpi = MESHLIB_CONFIG_MPI_ == 1;
  /// @brief True when the NCCL communicator is available (`MESHLIB_ENABLE_NCCL`).
  static constexpr bool nccl = MESHLIB_CONFIG_NCCL_ == 1;
  /// @brief True when the oneTBB-backed parts are available (`MESHLIB_ENABLE_TBB`).
  static constexpr bool tbb = MESHLIB_CONFIG_TBB_ == 1;
  /// @brief True when the mesh-independent runtime is compiled once, by `<meshlib/src.hpp>`, rather
  /// than in this translation unit (`MESHLIB_SEPARATE_COMPILATION`).
  static constexpr bool separate_compilation = MESHLIB_CONFIG_SEPARATE_COMPILATION_ == 1;
  /// @brief The kernel local matmuls use: "KokkosBlas::gemm" or "meshlib built-in".
  static constexpr std::string_view matmul_kernel = kokkos_kernels ? "KokkosBlas::gemm" : "meshlib built-in";
};

}  // namespace meshlib

#if defined(MESHLIB_VERBOSE_CONFIG)
#define MESHLIB_CONFIG_STR_(x) #x
#define MESHLIB_CONFIG_PRAGMA_(x) _Pragma(MESHLIB_CONFIG_STR_(x))
#if MESHLIB_CONFIG_KOKKOS_KERNELS_
#define MESHLIB_CONFIG_KK_TEXT_ "matmul=KokkosBlas::gemm"
#elif __has_include(<KokkosBlas3_gemm.hpp>)
#define MESHLIB_CONFIG_KK_TEXT_ "matmul=built-in (Kokkos Kernels found: define MESHLIB_ENABLE_KOKKOS_KERNELS=1 and link it)"
#else
#define MESHLIB_CONFIG_KK_TEXT_ "matmul=built-in"
#endif
#if MESHLIB_CONFIG_MPI_
#define MESHLIB_CONFIG_MPI_TEXT_ "mpi=on"
#elif __has_include(<mpi.h>)
#define MESHLIB_CONFIG_MPI_TEXT_ "mpi=off (mpi.h found: define MESHLIB_ENABLE_MPI=1 and link MPI)"
#else
#define MESHLIB_CONFIG_MPI_TEXT_ "mpi=off"
#endif
#if MESHLIB_CONFIG_NCCL_
#define MESHLIB_CONFIG_NCCL_TEXT_ "nccl=on"
#else
#define MESHLIB_CONFIG_NCCL_TEXT_ "nccl=off"
#endif
#if MESHLIB_CONFIG_TBB_
#define MESHLIB_CONFIG_TBB_TEXT_ "tbb=on"
#else
#define MESHLIB_CONFIG_TBB_TEXT_ "tbb=off"
#endif
MESHLIB_CONFIG_PRAGMA_(message("meshlib " MESHLIB_VERSION_STRING ": " MESHLIB_CONFIG_KK_TEXT_ ", " MESHLIB_CONFIG_MPI_TEXT_ ", " MESHLIB_CONFIG_NCCL_TEXT_ ", " MESHLIB_CONFIG_TBB_TEXT_))
#endif
