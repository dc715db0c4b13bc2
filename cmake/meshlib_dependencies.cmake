# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Finds meshlib's dependencies: Kokkos (required), and the optional oneTBB, zlib, Kokkos Kernels, MPI and
# CUDA+NCCL, each switchable with MESHLIB_WITH_<X>. Sets MESHLIB_HAVE_<X> and prints a summary that
# says what was found and what each missing piece disables.

include(meshlib_find_kokkos)
meshlib_find_kokkos()

set(MESHLIB_HAVE_KOKKOS_KERNELS FALSE)
set(MESHLIB_KOKKOS_KERNELS_MISMATCH "")
if(MESHLIB_WITH_KOKKOS_KERNELS)
  meshlib_find_kokkos_kernels()
  if(MESHLIB_KOKKOS_KERNELS_MISMATCH)
    # Skipped, not fatal: meshlib works without it; the warning says how to get it back.
    message(WARNING "${MESHLIB_KOKKOS_KERNELS_MISMATCH}")
  endif()
endif()

set(MESHLIB_HAVE_TBB FALSE)
if(MESHLIB_WITH_TBB)
  find_package(TBB CONFIG QUIET)
  if(TBB_FOUND)
    set(MESHLIB_HAVE_TBB TRUE)
  endif()
endif()

set(MESHLIB_HAVE_ZLIB FALSE)
if(MESHLIB_WITH_ZLIB)
  find_package(ZLIB QUIET)
  if(ZLIB_FOUND)
    set(MESHLIB_HAVE_ZLIB TRUE)
  endif()
endif()

set(MESHLIB_HAVE_MPI FALSE)
if(MESHLIB_WITH_MPI)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(MESHLIB_HAVE_MPI TRUE)
  endif()
endif()

set(MESHLIB_HAVE_NCCL FALSE)
if(MESHLIB_WITH_NCCL)
  include(meshlib_find_nccl)
  meshlib_find_nccl()
endif()

function(_meshlib_summary_line what have detail missing)
  string(STRIP "${detail}" detail)
  if(have AND detail)
    message(STATUS "  ${what}: found ${detail}")
  elseif(have)
    message(STATUS "  ${what}: found")
  else()
    message(STATUS "  ${what}: not found -> ${missing}")
  endif()
endfunction()

function(meshlib_print_summary)
  message(STATUS "meshlib ${PROJECT_VERSION} configuration:")
  message(STATUS "  Kokkos: ${MESHLIB_KOKKOS_ORIGIN}")
  set(_kk_missing "matmul uses meshlib's own Kokkos kernel instead of KokkosBlas::gemm (MESHLIB_WITH_KOKKOS_KERNELS=${MESHLIB_WITH_KOKKOS_KERNELS})")
  if(MESHLIB_KOKKOS_KERNELS_MISMATCH)
    set(_kk_missing "one was found, but for another Kokkos version (warning above): ${_kk_missing}")
  endif()
  _meshlib_summary_line("Kokkos Kernels" "${MESHLIB_HAVE_KOKKOS_KERNELS}" "${MESHLIB_KOKKOS_KERNELS_ORIGIN}" "${_kk_missing}")
  _meshlib_summary_line("oneTBB" "${MESHLIB_HAVE_TBB}" "${TBB_VERSION}"
    "no meshlib::tbb target: the data loader assembles each batch when asked, sequentially, without prefetching (MESHLIB_WITH_TBB=${MESHLIB_WITH_TBB})")
  _meshlib_summary_line("zlib" "${MESHLIB_HAVE_ZLIB}" "${ZLIB_VERSION_STRING}"
    "no meshlib::zlib target: the IDX reader reads only uncompressed files (MESHLIB_WITH_ZLIB=${MESHLIB_WITH_ZLIB})")
  # FindMPI leaves MPI_CXX_LIBRARY_VERSION_STRING empty when it cannot run a test program; the
  # standard version and the library it links are always known.
  set(_mpi_detail "")
  if(MESHLIB_HAVE_MPI)
    set(_mpi_detail "MPI ${MPI_CXX_VERSION}")
    if(MPI_CXX_LIBRARY_VERSION_STRING)
      string(REGEX REPLACE "[,\n].*" "" _mpi_library "${MPI_CXX_LIBRARY_VERSION_STRING}")
      string(APPEND _mpi_detail " (${_mpi_library})")
    elseif(MPI_mpi_cxx_LIBRARY OR MPI_mpi_LIBRARY)
      string(APPEND _mpi_detail " (${MPI_mpi_LIBRARY})")
    endif()
  endif()
  _meshlib_summary_line("MPI" "${MESHLIB_HAVE_MPI}" "${_mpi_detail}"
    "no meshlib::mpi target, MPI tests and MPI benchmark comparison skipped (MESHLIB_WITH_MPI=${MESHLIB_WITH_MPI})")
  set(_nccl_detail "${MESHLIB_NCCL_LIBRARY}")
  if(MESHLIB_HAVE_NCCL AND NOT EXISTS "${PROJECT_SOURCE_DIR}/include/meshlib/nccl.hpp")
    string(APPEND _nccl_detail " (no <meshlib/nccl.hpp> in this source tree: the installed package does not offer the nccl component)")
  endif()
  _meshlib_summary_line("CUDA + NCCL" "${MESHLIB_HAVE_NCCL}" "${_nccl_detail}"
    "no meshlib::nccl target (MESHLIB_WITH_NCCL=${MESHLIB_WITH_NCCL})")
endfunction()
