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
      find_package(Kokkos CONFIG QUIET)
      _meshlib_target_has_header(Kokkos::kokkos Kokkos_Core.hpp _meshlib_kokkos_ok)
    endif()
    if(TARGET meshlib::kokkos)
      # done above
    elseif(Kokkos_FOUND AND _meshlib_kokkos_ok)
      add_library(meshlib::kokkos INTERFACE IMPORTED GLOBAL)
      set_target_properties(meshlib::kokkos PROPERTIES INTERFACE_LINK_LIBRARIES Kokkos::kokkos)
      set(MESHLIB_KOKKOS_ORIGIN "find_package(Kokkos) ${Kokkos_VERSION} in ${Kokkos_DIR}")
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
    endif()
    # For scripts and summaries (run_tests.sh names each leg by it).
    if(Kokkos_VERSION)
      set(MESHLIB_KOKKOS_VERSION "${Kokkos_VERSION}" CACHE INTERNAL "the Kokkos version meshlib was configured with")
    else()
      set(MESHLIB_KOKKOS_VERSION "(version unknown)" CACHE INTERNAL "the Kokkos version meshlib was configured with")
    endif()
  endif()
endmacro()

# Sets MESHLIB_HAVE_KOKKOS_KERNELS and makes meshlib::kokkos_kernels when Kokkos Kernels is found.
macro(meshlib_find_kokkos_kernels)
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
      add_library(meshlib::kokkos_kernels INTERFACE IMPORTED GLOBAL)
      set_target_properties(meshlib::kokkos_kernels PROPERTIES INTERFACE_LINK_LIBRARIES Kokkos::kokkoskernels)
      set(MESHLIB_HAVE_KOKKOS_KERNELS TRUE)
      set(MESHLIB_KOKKOS_KERNELS_ORIGIN "find_package(KokkosKernels) in ${KokkosKernels_DIR}")
    else()
      find_path(MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR KokkosBlas3_gemm.hpp PATH_SUFFIXES trilinos kokkos-kernels)
      find_library(MESHLIB_KOKKOS_KERNELS_LIBRARY NAMES kokkoskernels trilinos_kokkoskernels)
      if(MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR AND MESHLIB_KOKKOS_KERNELS_LIBRARY)
        add_library(meshlib::kokkos_kernels INTERFACE IMPORTED GLOBAL)
        set_target_properties(meshlib::kokkos_kernels PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "${MESHLIB_KOKKOS_KERNELS_INCLUDE_DIR}"
          INTERFACE_LINK_LIBRARIES "${MESHLIB_KOKKOS_KERNELS_LIBRARY};meshlib::kokkos")
        set(MESHLIB_HAVE_KOKKOS_KERNELS TRUE)
        set(MESHLIB_KOKKOS_KERNELS_ORIGIN "${MESHLIB_KOKKOS_KERNELS_LIBRARY}")
      endif()
    endif()
  else()
    set(MESHLIB_HAVE_KOKKOS_KERNELS TRUE)
  endif()
endmacro()
