# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Runs ports/meshlib/portfile.cmake as vcpkg would, with stand-ins for the vcpkg_* helpers that do
# what vcpkg's do here (configure, install into the package's staging prefix, check the config
# location, install the copyright), then builds and runs test_package/ against the staged install
# with the components of the chosen FEATURES. vcpkg itself cannot run on this machine (it
# downloads its tool and ports), so this tests the port's own CMake calls, not vcpkg.
#   cmake -DSOURCE_DIR=<meshlib> -DWORK=<dir> -DGENERATOR=... -DCXX_COMPILER=... -DFEATURES=mpi,tbb -P vcpkg_port.cmake

cmake_minimum_required(VERSION 3.20)

function(fail)
  string(JOIN "" msg ${ARGN})
  message(FATAL_ERROR "vcpkg port test: ${msg}")
endfunction()

function(run_checked)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT rc EQUAL 0)
    string(JOIN " " shown ${ARGN})
    fail("exit status ${rc} from: ${shown}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(PORT meshlib)
set(port_dir "${SOURCE_DIR}/ports/meshlib")
file(READ "${port_dir}/vcpkg.json" manifest)
string(JSON VERSION GET "${manifest}" version)
string(REPLACE "," ";" FEATURES "${FEATURES}")
foreach(feature IN LISTS FEATURES)
  string(JSON _ ERROR_VARIABLE missing GET "${manifest}" features ${feature})
  if(missing)
    fail("feature '${feature}' is not declared in ports/meshlib/vcpkg.json")
  endif()
endforeach()
set(CURRENT_PACKAGES_DIR "${WORK}/packages/meshlib_x64-linux")
set(CURRENT_BUILDTREES_DIR "${WORK}/buildtrees/meshlib")
file(REMOVE_RECURSE "${WORK}")

# --- stand-ins for the vcpkg helpers the portfile calls -------------------------------------------
function(vcpkg_from_github)
  fail("the portfile downloads the release although it runs in a meshlib checkout")
endfunction()

function(vcpkg_check_features)
  cmake_parse_arguments(ARG "" "OUT_FEATURE_OPTIONS" "FEATURES" ${ARGN})
  set(options "")
  while(ARG_FEATURES)
    list(POP_FRONT ARG_FEATURES feature option)
    string(JSON _ ERROR_VARIABLE missing GET "${manifest}" features ${feature})
    if(missing)
      fail("vcpkg_check_features names '${feature}', which vcpkg.json does not declare")
    endif()
    if(feature IN_LIST FEATURES)
      list(APPEND options "-D${option}=ON")
    else()
      list(APPEND options "-D${option}=OFF")
    endif()
  endwhile()
  set(${ARG_OUT_FEATURE_OPTIONS} "${options}" PARENT_SCOPE)
endfunction()

function(vcpkg_cmake_configure)
  cmake_parse_arguments(ARG "" "SOURCE_PATH" "OPTIONS" ${ARGN})
  run_checked("${CMAKE_COMMAND}" -S "${ARG_SOURCE_PATH}" -B "${CURRENT_BUILDTREES_DIR}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}" ${ARG_OPTIONS})
  if(last_output MATCHES "CMake Warning")
    fail("configuring meshlib for the port printed a CMake warning (above)")
  endif()
  # The configure summary names what it found (it once printed "MPI: found " and nothing else).
  if(last_output MATCHES ": found[ \t]*\n")
    fail("the configure summary has a 'found' line that names nothing (above)")
  endif()
  foreach(feature IN LISTS FEATURES)
    string(TOUPPER "${feature}" upper)
    if(upper STREQUAL "TBB")
      set(upper "oneTBB")
    elseif(upper STREQUAL "ZLIB")
      set(upper "zlib")
    endif()
    if(NOT last_output MATCHES "  ${upper}: found [^\n]+")
      fail("the configure summary does not say what it found for ${feature}")
    endif()
  endforeach()
endfunction()

function(vcpkg_cmake_install)
  run_checked("${CMAKE_COMMAND}" --build "${CURRENT_BUILDTREES_DIR}")
  run_checked("${CMAKE_COMMAND}" --install "${CURRENT_BUILDTREES_DIR}")
endfunction()

function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(ARG "" "PACKAGE_NAME;CONFIG_PATH" "" ${ARGN})
  # vcpkg moves the config to share/<package>; the port installs it there so nothing moves.
  if(NOT ARG_CONFIG_PATH STREQUAL "share/${ARG_PACKAGE_NAME}")
    fail("vcpkg_cmake_config_fixup would move ${ARG_CONFIG_PATH} to share/${ARG_PACKAGE_NAME}")
  endif()
  if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/${ARG_CONFIG_PATH}/${ARG_PACKAGE_NAME}Config.cmake")
    fail("no ${ARG_PACKAGE_NAME}Config.cmake in ${CURRENT_PACKAGES_DIR}/${ARG_CONFIG_PATH}")
  endif()
endfunction()

function(vcpkg_fixup_pkgconfig)
  file(GLOB pcs "${CURRENT_PACKAGES_DIR}/share/pkgconfig/*.pc" "${CURRENT_PACKAGES_DIR}/lib/pkgconfig/*.pc")
  if(NOT pcs)
    fail("no pkg-config file in share/pkgconfig or lib/pkgconfig")
  endif()
endfunction()

function(vcpkg_install_copyright)
  cmake_parse_arguments(ARG "" "" "FILE_LIST" ${ARGN})
  file(INSTALL ${ARG_FILE_LIST} DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
  file(RENAME "${CURRENT_PACKAGES_DIR}/share/${PORT}/LICENSE" "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright")
endfunction()

# --- the port --------------------------------------------------------------------------------
set(CMAKE_CURRENT_LIST_DIR "${port_dir}")
include("${port_dir}/portfile.cmake")

# What vcpkg's post-build checks look at.
foreach(f include/meshlib.hpp include/meshlib/version.hpp share/meshlib/meshlibConfig.cmake
          share/meshlib/copyright share/meshlib/usage share/pkgconfig/meshlib.pc)
  if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/${f}")
    fail("the port's package lacks ${f}")
  endif()
endforeach()
foreach(d debug lib)
  if(EXISTS "${CURRENT_PACKAGES_DIR}/${d}")
    fail("a header-only port must not leave ${d}/")
  endif()
endforeach()

# --- test_package against the staged install --------------------------------------------------
string(REPLACE ";" "\\;" components "${FEATURES}")
run_checked("${CMAKE_COMMAND}" -S "${SOURCE_DIR}/test_package" -B "${WORK}/test_package" -G "${GENERATOR}"
  "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  "-DCMAKE_PREFIX_PATH=${CURRENT_PACKAGES_DIR}" "-DMESHLIB_COMPONENTS=${components}")
if(last_output MATCHES "CMake Warning")
  fail("configuring test_package against the port printed a CMake warning (above)")
endif()
run_checked("${CMAKE_COMMAND}" --build "${WORK}/test_package")
run_checked("${WORK}/test_package/test_package")
if(NOT last_output MATCHES "test_package OK")
  fail("test_package ran but did not say OK")
endif()
message(STATUS "vcpkg port test: the port installed meshlib[${FEATURES}] and test_package passed")
