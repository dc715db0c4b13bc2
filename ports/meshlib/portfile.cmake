# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# vcpkg port of meshlib (header-only). Use it as an overlay port:
#   vcpkg install meshlib[mpi,tbb] --overlay-ports=<meshlib checkout>/ports
# In a meshlib checkout the port builds that checkout; elsewhere (a registry copy) it downloads
# the release tag v${VERSION} of the project's canonical repository.
# tests/package runs this file with stand-ins for the vcpkg_* helpers (the same configure and
# install, into a staging prefix) and builds test_package/ against the result.

set(_meshlib_checkout "${CMAKE_CURRENT_LIST_DIR}/../..")
if(EXISTS "${_meshlib_checkout}/VERSION" AND EXISTS "${_meshlib_checkout}/include/meshlib.hpp")
  file(STRINGS "${_meshlib_checkout}/VERSION" _meshlib_version LIMIT_COUNT 1)
  if(NOT _meshlib_version STREQUAL VERSION)
    message(FATAL_ERROR "meshlib port: vcpkg.json says ${VERSION} but the checkout's VERSION says ${_meshlib_version}")
  endif()
  get_filename_component(SOURCE_PATH "${_meshlib_checkout}" ABSOLUTE)
else()
  vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO meshlib-org/meshlib
    REF "v${VERSION}"
    SHA512 0 # filled in when the release is registered (vcpkg prints the archive's SHA512)
    HEAD_REF main
  )
endif()

# Kokkos Kernels has no vcpkg port, so the port builds meshlib without it (matmul uses meshlib's
# own kernel); install Kokkos Kernels yourself and build meshlib with CMake to get KokkosBlas::gemm.
vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    mpi  MESHLIB_WITH_MPI
    nccl MESHLIB_WITH_NCCL
    tbb  MESHLIB_WITH_TBB
    zlib MESHLIB_WITH_ZLIB
)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DMESHLIB_INSTALL=ON
    -DMESHLIB_BUILD_TESTS=OFF
    -DMESHLIB_BUILD_EXAMPLES=OFF
    -DMESHLIB_BUILD_BENCHMARKS=OFF
    -DMESHLIB_SANITIZE_THREAD=OFF
    -DMESHLIB_WITH_KOKKOS_KERNELS=OFF
    -DMESHLIB_INSTALL_CMAKEDIR=share/meshlib
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME meshlib CONFIG_PATH share/meshlib)
vcpkg_fixup_pkgconfig()

# Header-only: nothing in lib/ and no debug tree.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/lib")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
