# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# meshlib_write_pkgconfig(<file>): writes meshlib.pc for non-CMake builds. It carries meshlib's
# include directory (relative to the .pc file, so the install stays relocatable) and the flags of
# the Kokkos this build found: Kokkos is part of <meshlib.hpp>, and Kokkos 3.x/Debian ship no .pc.
# Kokkos comes in with -isystem, as CMake makes imported include directories system ones: its
# headers warn under -Wall -Wextra in C++20.
# The optional parts (MPI, NCCL, oneTBB, Kokkos Kernels) are not in it: define their
# MESHLIB_ENABLE_<X>=1 and add their own flags (docs/install.md shows how).

include_guard(GLOBAL)

function(meshlib_write_pkgconfig file)
  if(MESHLIB_KOKKOS_INCLUDE_DIR AND MESHLIB_KOKKOS_CORE_LIBRARY)
    # Kokkos found directly (Debian's libtrilinos-kokkos-dev): its headers and library.
    get_filename_component(_libdir "${MESHLIB_KOKKOS_CORE_LIBRARY}" DIRECTORY)
    get_filename_component(_libname "${MESHLIB_KOKKOS_CORE_LIBRARY}" NAME_WE)
    string(REGEX REPLACE "^lib" "" _libname "${_libname}")
    set(MESHLIB_PC_KOKKOS_CFLAGS "-isystem ${MESHLIB_KOKKOS_INCLUDE_DIR}")
    set(MESHLIB_PC_KOKKOS_LIBS "-L${_libdir} -l${_libname} ${CMAKE_DL_LIBS}")
  elseif(Kokkos_DIR)
    # A Kokkos CMake package in <kokkos prefix>/lib*/cmake/Kokkos.
    get_filename_component(_kokkos_prefix "${Kokkos_DIR}/../../.." ABSOLUTE)
    get_filename_component(_kokkos_libdir "${Kokkos_DIR}/../.." ABSOLUTE)
    set(MESHLIB_PC_KOKKOS_CFLAGS "-isystem ${_kokkos_prefix}/include")
    set(MESHLIB_PC_KOKKOS_LIBS "-L${_kokkos_libdir} -lkokkoscore -ldl")
  else()
    set(MESHLIB_PC_KOKKOS_CFLAGS "")
    set(MESHLIB_PC_KOKKOS_LIBS "")
  endif()
  if(MESHLIB_PC_KOKKOS_LIBS MATCHES "^-L/usr/lib(64|/[a-z0-9_]+-linux-gnu)? ")
    string(REGEX REPLACE "^-L[^ ]+ " "" MESHLIB_PC_KOKKOS_LIBS "${MESHLIB_PC_KOKKOS_LIBS}") # a default path
  endif()
  if(MESHLIB_PC_KOKKOS_LIBS MATCHES "dl$")
    string(REGEX REPLACE " dl$" " -ldl" MESHLIB_PC_KOKKOS_LIBS "${MESHLIB_PC_KOKKOS_LIBS}")
  endif()
  configure_file("${PROJECT_SOURCE_DIR}/cmake/meshlib.pc.in" "${file}" @ONLY)
endfunction()
