# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Install rules and the CMake package of meshlib.
#
# Layout (relocatable: nothing below names the install prefix or this build machine's paths;
# the generated files locate themselves from their own directory):
#   <prefix>/include/meshlib.hpp, <prefix>/include/meshlib/...       the headers
#   <prefix>/share/cmake/meshlib/meshlibConfig.cmake                 find_package(meshlib CONFIG)
#   <prefix>/share/cmake/meshlib/meshlibConfigVersion.cmake          SameMajorVersion, ARCH_INDEPENDENT
#   <prefix>/share/cmake/meshlib/meshlib-targets.cmake               meshlib::headers, meshlib::meshlib
#   <prefix>/share/cmake/meshlib/meshlib-<c>-targets.cmake           meshlib::mpi, ::tbb, ::nccl (if built)
#   <prefix>/share/pkgconfig/meshlib.pc                              pkg-config --cflags --libs meshlib
#   <prefix>/share/doc/meshlib/LICENSE
#   <prefix>/share/cmake/meshlib/meshlib_find_kokkos.cmake, meshlib_find_nccl.cmake
#   <prefix>/share/cmake/meshlib/meshlib_fast_build.cmake           meshlib_enable_fast_build()
#
# The package is header-only, so it goes under share/ (architecture independent), where
# find_package searches as well as lib/cmake. Each optional backend has its own export set so
# a consumer who does not ask for the component never needs that component's dependency
# (the targets file of meshlib::mpi names MPI::MPI_CXX, which exists only after find_package(MPI)).

include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(MESHLIB_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/meshlib"
  CACHE STRING "Where meshlib's CMake package files go, relative to the install prefix")
mark_as_advanced(MESHLIB_INSTALL_CMAKEDIR)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
  FILES_MATCHING PATTERN "*.hpp")

install(TARGETS meshlib_headers meshlib EXPORT meshlib-targets)
install(EXPORT meshlib-targets
  NAMESPACE meshlib::
  FILE meshlib-targets.cmake
  DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}")

# The components the installed config knows, and which of them this build provides. Each optional
# dependency is a component: the installed config finds it only when the consumer names it.
#   kokkos_kernels  meshlib::kokkos_kernels (made by the config from the found Kokkos Kernels)
#   mpi, tbb, zlib, nccl  meshlib::<c>, each in its own export set meshlib-<c>-targets.cmake
# nccl is offered, but built only when the NCCL backend's header exists: a component whose code
# does not exist is refused with a message rather than "found".
set(MESHLIB_KNOWN_COMPONENTS kokkos_kernels mpi nccl tbb zlib)
set(MESHLIB_BUILT_COMPONENTS "")
if(MESHLIB_HAVE_KOKKOS_KERNELS)
  list(APPEND MESHLIB_BUILT_COMPONENTS kokkos_kernels)
endif()
set(_meshlib_exported_components "")
if(MESHLIB_HAVE_MPI)
  list(APPEND _meshlib_exported_components mpi)
endif()
set(MESHLIB_NCCL_HAS_CODE FALSE)
if(EXISTS "${PROJECT_SOURCE_DIR}/include/meshlib/nccl.hpp")
  set(MESHLIB_NCCL_HAS_CODE TRUE)
endif()
if(MESHLIB_HAVE_NCCL AND MESHLIB_NCCL_HAS_CODE)
  list(APPEND _meshlib_exported_components nccl)
endif()
if(MESHLIB_HAVE_TBB)
  list(APPEND _meshlib_exported_components tbb)
endif()
if(MESHLIB_HAVE_ZLIB)
  list(APPEND _meshlib_exported_components zlib)
endif()
foreach(_meshlib_comp IN LISTS _meshlib_exported_components)
  list(APPEND MESHLIB_BUILT_COMPONENTS ${_meshlib_comp})
  install(TARGETS meshlib_${_meshlib_comp} EXPORT meshlib-${_meshlib_comp}-targets)
  install(EXPORT meshlib-${_meshlib_comp}-targets
    NAMESPACE meshlib::
    FILE meshlib-${_meshlib_comp}-targets.cmake
    DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}")
endforeach()

# pkg-config (meshlib.pc): the core and Kokkos; the optional parts are for CMake users (their
# flags depend on the consumer's MPI, CUDA and TBB), see docs/install.md.
set(MESHLIB_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_DATADIR}/pkgconfig"
  CACHE STRING "Where meshlib.pc goes, relative to the install prefix")
mark_as_advanced(MESHLIB_INSTALL_PKGCONFIGDIR)
include(meshlib_pkgconfig)
meshlib_write_pkgconfig("${PROJECT_BINARY_DIR}/meshlib.pc")
install(FILES "${PROJECT_BINARY_DIR}/meshlib.pc" DESTINATION "${MESHLIB_INSTALL_PKGCONFIGDIR}")
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/meshlib")

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/meshlibConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/meshlibConfig.cmake"
  INSTALL_DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}"
  NO_SET_AND_CHECK_MACRO)

write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/meshlibConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMajorVersion
  ARCH_INDEPENDENT)

install(FILES
  "${PROJECT_BINARY_DIR}/meshlibConfig.cmake"
  "${PROJECT_BINARY_DIR}/meshlibConfigVersion.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/meshlib_find_kokkos.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/meshlib_find_nccl.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/meshlib_fast_build.cmake"
  DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}")
