// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Part of the CMake-only Kokkos stand-in of meshlib's package tests (../lib/cmake/Kokkos).
#error "meshlib tests: this is a CMake-only stand-in for Kokkos 4, used by configure-only package tests; it cannot be compiled against"
