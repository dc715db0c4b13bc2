# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Finds Kokkos (and optionally Kokkos Kernels) and makes the imported targets meshlib::kokkos and
# meshlib::kokkos_kernels. Used by meshlib's own build and by the installed meshlibConfig.cmake,
# so a consumer finds Kokkos the same way meshlib was built.
#
# Order: a Kokkos::kokkos target that already exists (the user's add_subdirectory/FetchContent of
# Kokkos, or MESHLIB_FETCH_KOKKOS below); then a working find_package(Kokkos) (a user's own Kokkos 4.x, or any Kokkos whose config
# is sound); otherwise Debian's libtrilinos-kokkos-dev, whose KokkosConfig.cmake names an include
# directory that does not exist (/usr/lib/include): we detect that and build a correct target from
# the headers in include/trilinos and the library trilinos_kokkoscore. Imported targets' include
# directories are system include directories, so Kokkos' own warnings under C++20 stay quiet.

include_guard(GLOBAL)

# MESHLIB_FETCH_KOKKOS: build Kokkos from source inside this build with FetchContent (for users
# with internet and no Kokkos 4 install). The URL is upstream's release; a local copy replaces it
# with -DMESHLIB_KOKKOS_URL=file:///path/kokkos-4.6.01.tar.gz or with FetchContent's own
# -DFETCHCONTENT_SOURCE_DIR_KOKKOS=/path/kokkos-4.6.01 (an unpacked tree). Backends: Kokkos' own
# options (-DKokkos_ENABLE_OPENMP=ON, -DKokkos_ENABLE_CUDA=ON, ...); Serial when none is given.
# MESHLIB_FETCH_KOKKOS_KERNELS does the same for Kokkos Kernels (BLAS component).
option(MESHLIB_FETCH_KOKKOS "Build Kokkos 4 from source with FetchContent instead of finding an installed one" OFF)
option(MESHLIB_FETCH_KOKKOS_KERNELS "Build Kokkos Kernels 4 (BLAS) from source with FetchContent" OFF)
set(MESHLIB_KOKKOS_URL "https://github.com/kokkos/kokkos/archive/refs/tags/4.6.01.tar.gz"
  CACHE STRING "Where MESHLIB_FETCH_KOKKOS downloads Kokkos from (a URL or file:// path)")
set(MESHLIB_KOKKOS_KERNELS_URL "https://github.com/kokkos/kokkos-kernels/archive/refs/tags/4.6.01.tar.gz"
  CACHE STRING "Where MESHLIB_FETCH_KOKKOS_KERNELS downloads Kokkos Kernels from (a URL or file:// path)")

macro(_meshlib_fetch_kokkos)
  include(FetchContent)
  set(_meshlib_fetch_args)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.24)
    set(_meshlib_fetch_args DOWNLOAD_EXTRACT_TIMESTAMP TRUE)
  endif()
  if(MESHLIB_FETCH_KOKKOS AND NOT TARGET Kokkos::kokkos)
    FetchContent_Declare(kokkos URL "${MESHLIB_KOKKOS_URL}" ${_meshlib_fetch_args})
    FetchContent_MakeAvailable(kokkos)
    get_directory_property(Kokkos_VERSION DIRECTORY "${kokkos_SOURCE_DIR}" DEFINITION Kokkos_VERSION)
  endif()
  if(MESHLIB_FETCH_KOKKOS_KERNELS AND NOT TARGET Kokkos::kokkoskernels)
    set(KokkosKernels_ENABLE_ALL_COMPONENTS OFF CACHE BOOL "")
    set(KokkosKernels_ENABLE_COMPONENT_BLAS ON CACHE BOOL "")
    FetchContent_Declare(kokkoskernels URL "${MESHLIB_KOKKOS_KERNELS_URL}" ${_meshlib_fetch_args})
    FetchContent_MakeAvailable(kokkoskernels)
  endif()
endmacro()

# True when every include directory of TARGET exists and one of them holds HEADER.
function(_meshlib_target_has_header target header out)
  set(${out} FALSE PARENT_SCOPE)
  if(NOT TARGET ${target})
    return()
  endif()
  get_target_property(_dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
  if(NOT _dirs)
    # Some configs (Kokkos 4.x) put the include directories on a linked target.
    get_target_property(_libs ${target} INTERFACE_LINK_LIBRARIES)
    foreach(_lib IN LISTS _libs)
      if(TARGET ${_lib})
        _meshlib_target_has_header(${_lib} ${header} _found)
        if(_found)
          set(${out} TRUE PARENT_SCOPE)
          return()
        endif()
      endif()
    endforeach()
    return()
  endif()
  foreach(_dir IN LISTS _dirs)
    if(_dir MATCHES "\\$<")
      set(${out} TRUE PARENT_SCOPE) # generator expressions: trust the package
      return()
    endif()
    if(EXISTS "${_dir}/${header}")
      set(${out} TRUE PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()

# "M.m.p" from a `#define MACRO MMmmpp` line of a header (Kokkos' and Kokkos Kernels' encoding of
# their version: KOKKOS_VERSION 40601 is 4.6.1), or "" when the header or the line is missing.
function(_meshlib_encoded_version header macro out)
  set(${out} "" PARENT_SCOPE)
  if(EXISTS "${header}")
    file(STRINGS "${header}" _line REGEX "^#define ${macro} [0-9]+")
    if(_line MATCHES "${macro} ([0-9]+)")
      math(EXPR _major "${CMAKE_MATCH_1} / 10000")
      math(EXPR _minor "${CMAKE_MATCH_1} / 100 % 100")
      math(EXPR _patch "${CMAKE_MATCH_1} % 100")
      set(${out} "${_major}.${_minor}.${_patch}" PARENT_SCOPE)
    endif()
  endif()
endfunction()

# TRUE in OUT when versions A and B are both known ("M.m..." ) and differ in major or minor.
# Kokkos Kernels and a meshlib install both need the Kokkos of their own major.minor: 3.4.01 and
# 3.4.1 agree, 4.6.01 and 3.4.1 do not. An unknown version ("" or "(version unknown)") agrees.
function(meshlib_kokkos_versions_differ a b out)
  set(${out} FALSE PARENT_SCOPE)
  if(a MATCHES "^([0-9]+)\\.([0-9]+)")
    math(EXPR _a "${CMAKE_MATCH_1} * 1000 + ${CMAKE_MATCH_2}")
    if(b MATCHES "^([0-9]+)\\.([0-9]+)")
      math(EXPR _b "${CMAKE_MATCH_1} * 1000 + ${CMAKE_MATCH_2}")
      if(NOT _a EQUAL _b)
        set(${out} TRUE PARENT_SCOPE)
      endif()
    endif()
  endif()
endfunction()

# MESHLIB_KOKKOS_HINTS: folders find_package(Kokkos) also looks in, after the user's own
# Kokkos_ROOT / CMAKE_PREFIX_PATH and before the system's. The installed config sets it to the
# Kokkos meshlib was installed against, so a consumer finds that one unless told otherwise.
macro(meshlib_find_kokkos)
  if(NOT TARGET meshlib::kokkos)
    set(MESHLIB_KOKKOS_ORIGIN "")
    _meshlib_fetch_kokkos()
    if(TARGET Kokkos::kokkos)
      # Built in this CMake run (FetchContent / add_subdirectory): no config to find.
      add_library(meshlib::kokkos INTERFACE IMPORTED GLOBAL)
      set_target_properties(meshlib::kokkos PROPERTIES INTERFACE_LINK_LIBRARIES Kokkos::kokkos)
      set(MESHLIB_KOKKOS_ORIGIN "the Kokkos::kokkos target of this build (${Kokkos_VERSION})")
      set(_meshlib_kokkos_ok FALSE)
    else()
      find_package(Kokkos CONFIG QUIET HINTS ${MESHLIB_KOKKOS_HINTS})
      _meshlib_target_has_header(Kokkos::kokkos Kokkos_Core.hpp _meshlib_kokkos_ok)
    endif()
    if(TARGET meshlib::kokkos)
      # done above
    elseif(Kokkos_FOUND AND _meshlib_kokkos_ok)
      add_library(meshlib::kokkos INTERFACE IMPORTED GLOBAL)
      set_target_properties(meshlib::kokkos PROPERTIES INTERFACE_LINK_LIBRARIES Kokkos::kokkos)
      set(MESHLIB_KOKKOS_ORIGIN "find_package(Kokkos) ${Kokkos_VERSION} in ${Kokkos_DIR}")
      set(MESHLIB_KOKKOS_WHERE "${Kokkos_DIR}")
      set(MESHLIB_KOKKOS_CONFIG_DIR "${Kokkos_DIR}")
    else()
      find_path(MESHLIB_KOKKOS_INCLUDE_DIR Kokkos_Core.hpp PATH_SUFFIXES trilinos kokkos)
      find_library(MESHLIB_KOKKOS_CORE_LIBRARY NAMES kokkoscore trilinos_kokkoscore)
      if(NOT MESHLIB_KOKKOS_INCLUDE_DIR OR NOT MESHLIB_KOKKOS_CORE_LIBRARY)
        message(FATAL_ERROR
          "meshlib: Kokkos not found. Install Debian's libtrilinos-kokkos-dev "
          "(scripts/install_deps.sh does) or point Kokkos_ROOT at a Kokkos 4.x install. "
          "Looked for a working find_package(Kokkos), then for Kokkos_Core.hpp "
          "(found: '${MESHLIB_KOKKOS_INCLUDE_DIR}') and libkokkoscore/libtrilinos_kokkoscore "
          "(found: '${MESHLIB_KOKKOS_CORE_LIBRARY}').")
      endif()
      find_package(Threads REQUIRED)
      add_library(meshlib::kokkos INTERFACE IMPORTED GLOBAL)
      set_target_properties(meshlib::kokkos PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${MESHLIB_KOKKOS_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES "${MESHLIB_KOKKOS_CORE_LIBRARY};Threads::Threads;${CMAKE_DL_LIBS}")
      if(Kokkos_FOUND)
        set(MESHLIB_KOKKOS_ORIGIN
          "${MESHLIB_KOKKOS_INCLUDE_DIR} (Kokkos ${Kokkos_VERSION}: its KokkosConfig.cmake names a missing include directory, so meshlib made its own target)")
      else()
        set(MESHLIB_KOKKOS_ORIGIN "${MESHLIB_KOKKOS_INCLUDE_DIR} (headers and library found directly)")
      endif()
      set(MESHLIB_KOKKOS_WHERE "${MESHLIB_KOKKOS_INCLUDE_DIR}")
      if(NOT Kokkos_VERSION)
        _meshlib_encoded_version("${MESHLIB_KOKKOS_INCLUDE_DIR}/KokkosCore_config.h" KOKKOS_VERSION Kokkos_VERSION)
      endif()
    endif()
    # A Kokkos with CUDA: meshlib's kernels call constexpr functions from device code (std::array's
    # operator[] in the optimizers, std::bit_cast, bfloat16's conversions), which nvcc compiles only
    # as a warning (#20013/#20015) and a kernel that cannot run, unless --expt-relaxed-constexpr.
    if(Kokkos_ENABLE_CUDA)
      set_property(TARGET meshlib::kokkos APPEND PROPERTY
        INTERFACE_COMPILE_OPTIONS "$<$<COMPILE_LANGUAGE:CXX>:--expt-relaxed-constexpr>")
      # matmul_into's products on CUDA memory go to cuBLAS on the device's stream
      # (tensor/cublas_product.hpp); without cuBLAS they run meshlib's own kernel, far slower.
      find_package(CUDAToolkit QUIET)
      if(TARGET CUDA::cublas)
        set_property(TARGET meshlib::kokkos APPEND PROPERTY INTERFACE_LINK_LIBRARIES CUDA::cublas)
        set_property(TARGET meshlib::kokkos APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS MESHLIB_ENABLE_CUBLAS=1)
      else()
        message(WARNING "meshlib: Kokkos has CUDA but cuBLAS was not found (CUDAToolkit_ROOT): matrix products "
          "on the GPU run meshlib's own kernel, far slower than cuBLAS")
      endif()
    endif()
    if(NOT DEFINED MESHLIB_KOKKOS_WHERE)
      set(MESHLIB_KOKKOS_WHERE "")
    endif()
    if(NOT DEFINED MESHLIB_KOKKOS_CONFIG_DIR)
      set(MESHLIB_KOKKOS_CONFIG_DIR "") # a hint for consumers only when a KokkosConfig.cmake was used
    endif()
    # For scripts and summaries (run_tests.sh names each leg by it), the Kokkos Kernels check
    # below, and the installed config, which records it.
    if(Kokkos_VERSION)
      set(MESHLIB_KOKKOS_VERSION "${Kokkos_VERSION}" CACHE INTERNAL "the Kokkos version meshlib was configured with")
    else()
      set(MESHLIB_KOKKOS_VERSION "(version unknown)" CACHE INTERNAL "the Kokkos version meshlib was configured with")
    endif()
  endif()
endmacro()

# Sets MESHLIB_HAVE_KOKKOS_KERNELS and makes meshlib::kokkos_kernels when a Kokkos Kernels of the
# Kokkos found by meshlib_find_kokkos is found. One of another major.minor (Debian's 3.4 beside the
# user's Kokkos 4: its headers do not compile against Kokkos 4) is not used: MESHLIB_HAVE_KOKKOS_KERNELS
# stays FALSE and MESHLIB_KOKKOS_KERNELS_MISMATCH holds the message that says what to do (the
# caller prints it: a warning in meshlib's build, the not-found message in the installed config).
macro(meshlib_find_kokkos_kernels)
  set(MESHLIB_KOKKOS_KERNELS_MISMATCH "")
  if(NOT TARGET meshlib::kokkos_kernels)
    set(MESHLIB_HAVE_KOKKOS_KERNELS FALSE)
    if(TARGET Kokkos::kokkoskernels)
      set(KokkosKernels_FOUND TRUE)
      set(_meshlib_kk_ok TRUE)
      set(KokkosKernels_DIR "this build")
    else()
      find_package(KokkosKernels CONFIG QUIET)
      _meshlib_target_has_header(Kokkos::kokkoskernels KokkosBlas3_gemm.hpp _meshlib_kk_ok)
    endif()
    if(KokkosKernels_FOUND AND _meshlib_kk_ok)
      set(_meshlib_kk_version "${KokkosKernels_VERSION}")
      set(_meshlib_kk_where "${KokkosKernels_DIR}")
      if(NOT _meshlib_kk_version AND _meshlib_kk_where STREQUAL "this build" AND DEFINED kokkoskernels_SOURCE_DIR)
        get_directory_property(_meshlib_kk_version DIRECTORY "${kokkoskernels_SOURCE_DIR}" DEFINITION KokkosKernels_VERSION)
      endif()
      meshlib_kokkos_versions_differ("${_meshlib_kk_version}" "${MESHLIB_KOKKOS_VERSION}" _meshlib_kk_differs)
      if(NOT _meshlib_kk_differs)
        add_library(meshlib::kokkos_kernels INTERFACE IMPORTED GLOBAL)
        set_target_properties(meshlib::kokkos_kernels PROPERTIES INTERFACE_LINK_LIBRARIES Kokkos::kokkoskernels)
        set(MESHLIB_HAVE_KOKKOS_KERNELS TRUE)
        set(MESHLIB_KOKKOS_KERNELS_ORIGIN "find_package(KokkosKernels) ${_meshlib_kk_version} in ${KokkosKernels_DIR}")
      endif()
    else()
      find_path(MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR KokkosBlas3_gemm.hpp PATH_SUFFIXES trilinos kokkos-kernels)
      find_library(MESHLIB_KOKKOS_KERNELS_LIBRARY NAMES kokkoskernels trilinos_kokkoskernels)
      if(MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR AND MESHLIB_KOKKOS_KERNELS_LIBRARY)
        # Its version: KokkosKernels_config.h says it from 3.5 on; an older one (Debian's 3.4, part
        # of Trilinos) lies beside the Kokkos it was built with, whose KokkosCore_config.h says it.
        _meshlib_encoded_version("${MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR}/KokkosKernels_config.h"
          KOKKOSKERNELS_VERSION _meshlib_kk_version)
        if(NOT _meshlib_kk_version)
          _meshlib_encoded_version("${MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR}/KokkosCore_config.h"
            KOKKOS_VERSION _meshlib_kk_version)
        endif()
        set(_meshlib_kk_where "${MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR}")
        meshlib_kokkos_versions_differ("${_meshlib_kk_version}" "${MESHLIB_KOKKOS_VERSION}" _meshlib_kk_differs)
        if(NOT _meshlib_kk_differs)
          add_library(meshlib::kokkos_kernels INTERFACE IMPORTED GLOBAL)
          set_target_properties(meshlib::kokkos_kernels PROPERTIES
            INTERFACE_INCLUDE_DIRECTORIES "${MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR}"
            INTERFACE_LINK_LIBRARIES "${MESHLIB_KOKKOS_KERNELS_LIBRARY};meshlib::kokkos")
          set(MESHLIB_HAVE_KOKKOS_KERNELS TRUE)
          set(MESHLIB_KOKKOS_KERNELS_ORIGIN "${MESHLIB_KOKKOS_KERNELS_LIBRARY}")
        endif()
      endif()
    endif()
    if(_meshlib_kk_differs)
      string(REGEX MATCH "^[0-9]+\\.[0-9]+" _meshlib_kokkos_mm "${MESHLIB_KOKKOS_VERSION}")
      set(MESHLIB_KOKKOS_KERNELS_MISMATCH
        "meshlib: Kokkos Kernels ${_meshlib_kk_version} (${_meshlib_kk_where}) does not match Kokkos ${MESHLIB_KOKKOS_VERSION} (${MESHLIB_KOKKOS_WHERE}): Kokkos Kernels only compiles against the Kokkos of its own major.minor version, so it is not used and matmul runs meshlib's own kernel. To use KokkosBlas::gemm, install Kokkos Kernels ${_meshlib_kokkos_mm} built against this Kokkos and point KokkosKernels_ROOT at it (scripts/build_kokkos4.sh builds Kokkos and Kokkos Kernels 4.6.01 into one prefix), or use the Kokkos that matches this Kokkos Kernels; -DMESHLIB_WITH_KOKKOS_KERNELS=OFF skips Kokkos Kernels without this message.")
      set(MESHLIB_KOKKOS_KERNELS_ORIGIN "")
    endif()
    unset(_meshlib_kk_differs)
    unset(_meshlib_kk_version)
    unset(_meshlib_kk_where)
  else()
    set(MESHLIB_HAVE_KOKKOS_KERNELS TRUE)
  endif()
endmacro()
