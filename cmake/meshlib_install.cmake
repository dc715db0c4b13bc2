# Install rules and the CMake package of meshlib.
#
# Layout (relocatable: nothing below names the install prefix or this build machine's paths;
# the generated files locate themselves from their own directory):
#   <prefix>/include/meshlib.hpp, <prefix>/include/meshlib/...       the headers
#   <prefix>/share/cmake/meshlib/meshlibConfig.cmake                 find_package(meshlib CONFIG)
#   <prefix>/share/cmake/meshlib/meshlibConfigVersion.cmake          SameMajorVersion, ARCH_INDEPENDENT
#   <prefix>/share/cmake/meshlib/meshlib-targets.cmake               meshlib::headers, meshlib::meshlib
#   <prefix>/share/cmake/meshlib/meshlib-<c>-targets.cmake           meshlib::mpi, meshlib::nccl (if built)
#   <prefix>/share/cmake/meshlib/meshlib_find_kokkos.cmake, meshlib_find_nccl.cmake
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

# The components the installed config knows, and which of them this build provides.
set(MESHLIB_KNOWN_COMPONENTS mpi nccl tbb)
set(MESHLIB_BUILT_COMPONENTS "")
if(MESHLIB_HAVE_TBB)
  list(APPEND MESHLIB_BUILT_COMPONENTS tbb)
endif()
if(MESHLIB_HAVE_MPI)
  list(APPEND MESHLIB_BUILT_COMPONENTS mpi)
  install(TARGETS meshlib_mpi EXPORT meshlib-mpi-targets)
  install(EXPORT meshlib-mpi-targets
    NAMESPACE meshlib::
    FILE meshlib-mpi-targets.cmake
    DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}")
endif()
if(MESHLIB_HAVE_NCCL)
  list(APPEND MESHLIB_BUILT_COMPONENTS nccl)
  install(TARGETS meshlib_nccl EXPORT meshlib-nccl-targets)
  install(EXPORT meshlib-nccl-targets
    NAMESPACE meshlib::
    FILE meshlib-nccl-targets.cmake
    DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}")
endif()

# Booleans baked into the config: what the installed targets link to.
foreach(_meshlib_dep TBB ZLIB KOKKOS_KERNELS MPI NCCL)
  if(MESHLIB_HAVE_${_meshlib_dep})
    set(MESHLIB_CONFIG_HAVE_${_meshlib_dep} TRUE)
  else()
    set(MESHLIB_CONFIG_HAVE_${_meshlib_dep} FALSE)
  endif()
endforeach()

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
  DESTINATION "${MESHLIB_INSTALL_CMAKEDIR}")
