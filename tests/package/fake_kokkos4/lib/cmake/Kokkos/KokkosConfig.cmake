# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# A stand-in for an installed Kokkos 4.6.01 (Serial + OpenMP) that exists only for CMake: the
# targets and usage requirements of Kokkos 4's KokkosConfig.cmake (Kokkos::kokkos linking
# Kokkos::kokkoscore, -fopenmp for C++ and at link time, libdl), and a Kokkos_Core.hpp that refuses
# to compile. The package tests that need "a Kokkos 4 here" only to configure (version checks,
# recorded versions, pkg-config flags) use it, so they run where no Kokkos 4 was built.
get_filename_component(_fake_kokkos_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(Kokkos_DEVICES "OPENMP;SERIAL")
if(NOT TARGET Kokkos::kokkoscore)
  add_library(Kokkos::kokkoscore INTERFACE IMPORTED)
  set_target_properties(Kokkos::kokkoscore PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_fake_kokkos_prefix}/include"
    INTERFACE_COMPILE_FEATURES "cxx_std_17"
    INTERFACE_COMPILE_OPTIONS "$<$<COMPILE_LANGUAGE:CXX>:-fopenmp>"
    INTERFACE_LINK_OPTIONS "-fopenmp"
    INTERFACE_LINK_LIBRARIES "dl")
  add_library(Kokkos::kokkos INTERFACE IMPORTED)
  set_target_properties(Kokkos::kokkos PROPERTIES INTERFACE_LINK_LIBRARIES "Kokkos::kokkoscore")
endif()
unset(_fake_kokkos_prefix)
