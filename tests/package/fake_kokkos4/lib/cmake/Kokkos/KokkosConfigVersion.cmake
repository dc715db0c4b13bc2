# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# The version of the CMake-only Kokkos stand-in (see KokkosConfig.cmake): 4.6.01, compatible with
# any request of the same major version, as Kokkos' own version file.
set(PACKAGE_VERSION "4.6.01")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
if(NOT PACKAGE_FIND_VERSION OR (PACKAGE_FIND_VERSION_MAJOR EQUAL 4 AND PACKAGE_VERSION VERSION_GREATER_EQUAL PACKAGE_FIND_VERSION))
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
endif()
if(PACKAGE_VERSION VERSION_EQUAL PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_EXACT TRUE)
endif()
