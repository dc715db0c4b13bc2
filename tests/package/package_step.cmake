# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# One step of a package test, run as `cmake -D... -P package_step.cmake`.
#
# STEP=install     Install meshlib into STAGE, then move STAGE to PREFIX (package managers move
#                  install trees; moving proves nothing points back at the old place) and check
#                  that no installed file names STAGE, the source tree or a build tree.
#                  Installs BUILD_DIR (the tree being tested) or, when CONFIGURE_ARGS is given, a
#                  fresh configuration of SOURCE_DIR with those arguments ("|"-separated) in WORK.
#                  EXPECT_PC=<regex>: the installed meshlib.pc (white space made single spaces)
#                  must match it. KOKKOS_PREFIX=<dir>: the Kokkos the install was configured
#                  against, which its files may name (it is not moved with them), even where it
#                  lies inside the source or build tree (the tests' stand-in does).
# STEP=consumer    Configure the consumer project CONSUMER into WORK with CONSUMER_ARGS
#                  ("|"-separated). With EXPECT_FAIL=<regex>: configuring must fail and print it.
#                  Otherwise build it and run RUN ("|"-separated command, in the consumer's
#                  build directory), whose output must match EXPECT_OUTPUT; then RUN2 likewise.
#                  The consumer's configure must print no CMake warning. INSTALL_EMPTY_OF_MESHLIB=ON:
#                  also install the consumer and check that no meshlib file came with it.
#                  TARBALL_FROM=<source dir>: first pack meshlib's sources into WORK/meshlib.tar.gz
#                  and pass its URL and SHA256 as MESHLIB_TARBALL / MESHLIB_TARBALL_SHA256.
#                  CONFIGURE_ONLY=ON: stop after configuring (for projects that cannot be built
#                  here, e.g. against the CMake-only stand-in of Kokkos 4 in fake_kokkos4/), with
#                  EXPECT_OUTPUT matched against the configure output instead. EXPECT_WARNING=<regex>:
#                  the configure output must hold a CMake warning matching it (instead of none).
# STEP=pkgconfig   Compile and run CONSUMER_SOURCE with `c++ -std=c++20 $(pkg-config --cflags --libs
#                  meshlib)` against the install in PREFIX (PKG_CONFIG_PATH=PREFIX/share/pkgconfig),
#                  after checking that the .pc names the Kokkos version the CMake package records.
# Common: GENERATOR, CXX_COMPILER, BUILD_TYPE (of the enclosing build).

cmake_minimum_required(VERSION 3.20)

function(fail)
  string(JOIN "" msg ${ARGN})
  message(FATAL_ERROR "package test: ${msg}")
endfunction()

# Runs a command, echoes its output, fails unless it exits 0 (or, with EXPECT_FAILURE, non-zero).
function(run_checked out_var)
  cmake_parse_arguments(ARG "EXPECT_FAILURE" "WORKING_DIRECTORY" "COMMAND" ${ARGN})
  if(NOT ARG_WORKING_DIRECTORY)
    set(ARG_WORKING_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}")
  endif()
  string(JOIN " " shown ${ARG_COMMAND})
  message(STATUS "package test: running: ${shown}")
  execute_process(COMMAND ${ARG_COMMAND}
    WORKING_DIRECTORY "${ARG_WORKING_DIRECTORY}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(ARG_EXPECT_FAILURE)
    if(rc EQUAL 0)
      fail("expected this to fail, but it succeeded: ${shown}")
    endif()
  elseif(NOT rc EQUAL 0)
    fail("exit status ${rc} from: ${shown}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

function(generator_args out_var)
  set(args -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
  if(BUILD_TYPE)
    list(APPEND args "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
  endif()
  set(${out_var} "${args}" PARENT_SCOPE)
endfunction()

foreach(var STEP WORK GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    fail("${var} is not set")
  endif()
endforeach()
generator_args(gen_args)

if(STEP STREQUAL "install")
  foreach(var STAGE PREFIX SOURCE_DIR)
    if(NOT ${var})
      fail("${var} is not set")
    endif()
  endforeach()
  file(REMOVE_RECURSE "${STAGE}" "${PREFIX}")
  set(tree "${BUILD_DIR}")
  if(CONFIGURE_ARGS)
    set(tree "${WORK}/meshlib-build")
    file(REMOVE_RECURSE "${tree}")
    string(REPLACE "|" ";" configure_args "${CONFIGURE_ARGS}")
    run_checked(out COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${tree}" ${gen_args} ${configure_args})
  endif()
  run_checked(out COMMAND "${CMAKE_COMMAND}" --install "${tree}" --prefix "${STAGE}")
  file(RENAME "${STAGE}" "${PREFIX}")

  foreach(f include/meshlib.hpp include/meshlib/core/mesh.hpp
            share/cmake/meshlib/meshlibConfig.cmake share/cmake/meshlib/meshlibConfigVersion.cmake
            share/cmake/meshlib/meshlib-targets.cmake share/cmake/meshlib/meshlib_find_kokkos.cmake)
    if(NOT EXISTS "${PREFIX}/${f}")
      fail("the install tree lacks ${f}")
    endif()
  endforeach()
  # Relocatable: no installed file may point back at where it was installed or built from.
  file(GLOB_RECURSE installed LIST_DIRECTORIES false "${PREFIX}/*")
  foreach(f IN LISTS installed)
    file(READ "${f}" text)
    if(KOKKOS_PREFIX)
      string(REPLACE "${KOKKOS_PREFIX}" "<the Kokkos prefix>" text "${text}")
    endif()
    foreach(bad "${STAGE}" "${SOURCE_DIR}" "${tree}")
      string(FIND "${text}" "${bad}" at)
      if(NOT at EQUAL -1)
        fail("${f} names the absolute path ${bad}, but the install tree must be relocatable")
      endif()
    endforeach()
  endforeach()
  # The version file, asked as find_package would ask it: any 0.x is compatible, 1.0 is not, and
  # a 32-bit consumer may use this header-only package (ARCH_INDEPENDENT).
  function(ask_version wanted pointer_size out)
    set(PACKAGE_FIND_VERSION "${wanted}")
    string(REGEX MATCH "^[0-9]+" PACKAGE_FIND_VERSION_MAJOR "${wanted}")
    string(REGEX REPLACE "^[0-9]+\\.([0-9]+).*" "\\1" PACKAGE_FIND_VERSION_MINOR "${wanted}")
    set(PACKAGE_FIND_VERSION_COUNT 2)
    set(CMAKE_SIZEOF_VOID_P ${pointer_size})
    include("${PREFIX}/share/cmake/meshlib/meshlibConfigVersion.cmake")
    if(PACKAGE_VERSION_COMPATIBLE AND NOT PACKAGE_VERSION_UNSUITABLE)
      set(${out} TRUE PARENT_SCOPE)
    else()
      set(${out} FALSE PARENT_SCOPE)
    endif()
  endfunction()
  ask_version(0.0 8 ok_same_major)
  ask_version(0.0 4 ok_32bit)
  ask_version(1.0 8 ok_other_major)
  if(NOT ok_same_major OR ok_other_major)
    fail("meshlibConfigVersion.cmake is not SameMajorVersion (0.0: ${ok_same_major}, 1.0: ${ok_other_major})")
  endif()
  if(NOT ok_32bit)
    fail("meshlibConfigVersion.cmake checks the pointer size, but a header-only package must be ARCH_INDEPENDENT")
  endif()
  if(EXPECT_PC)
    file(READ "${PREFIX}/share/pkgconfig/meshlib.pc" pc)
    string(REGEX REPLACE "[ \t\r\n]+" " " flat "${pc}")
    if(NOT flat MATCHES "${EXPECT_PC}")
      fail("the installed meshlib.pc does not match '${EXPECT_PC}':\n${pc}")
    endif()
  endif()
  message(STATUS "package test: installed and moved to ${PREFIX}")

elseif(STEP STREQUAL "consumer")
  if(NOT CONSUMER)
    fail("CONSUMER is not set")
  endif()
  file(REMOVE_RECURSE "${WORK}")
  file(MAKE_DIRECTORY "${WORK}")
  string(REPLACE "|" ";" consumer_args "${CONSUMER_ARGS}")

  if(TARBALL_FROM)
    # A release-style archive holding only what a consumer needs: proves the package is
    # self-contained (no reference to tests/, scripts/ or anything outside it).
    set(tarball "${WORK}/meshlib.tar.gz")
    set(pack_dir "${WORK}/pack/meshlib-src")
    file(MAKE_DIRECTORY "${pack_dir}")
    file(COPY "${TARBALL_FROM}/CMakeLists.txt" "${TARBALL_FROM}/VERSION" "${TARBALL_FROM}/LICENSE"
      "${TARBALL_FROM}/cmake" "${TARBALL_FROM}/include" DESTINATION "${pack_dir}")
    run_checked(out COMMAND "${CMAKE_COMMAND}" -E tar czf "${tarball}" meshlib-src
      WORKING_DIRECTORY "${WORK}/pack")
    file(SHA256 "${tarball}" sha)
    list(APPEND consumer_args "-DMESHLIB_TARBALL=file://${tarball}" "-DMESHLIB_TARBALL_SHA256=${sha}")
  endif()

  set(build "${WORK}/build")
  if(EXPECT_FAIL)
    run_checked(out EXPECT_FAILURE
      COMMAND "${CMAKE_COMMAND}" -S "${CONSUMER}" -B "${build}" ${gen_args} ${consumer_args})
    # CMake wraps long messages: compare with runs of white space made single spaces.
    string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}")
    if(NOT flat MATCHES "${EXPECT_FAIL}")
      fail("configuring failed as expected, but the output does not match '${EXPECT_FAIL}'")
    endif()
    message(STATUS "package test: configure failed with the expected message")
    return()
  endif()

  run_checked(out COMMAND "${CMAKE_COMMAND}" -S "${CONSUMER}" -B "${build}" ${gen_args} ${consumer_args})
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}")
  if(EXPECT_WARNING)
    if(NOT out MATCHES "CMake Warning" OR NOT flat MATCHES "${EXPECT_WARNING}")
      fail("configuring did not print the expected CMake warning '${EXPECT_WARNING}'")
    endif()
  elseif(out MATCHES "CMake Warning")
    fail("configuring the consumer printed a CMake warning (above), but a consumer must see none")
  endif()
  if(CONFIGURE_ONLY)
    if(EXPECT_OUTPUT AND NOT flat MATCHES "${EXPECT_OUTPUT}")
      fail("configuring succeeded, but its output does not match '${EXPECT_OUTPUT}'")
    endif()
    message(STATUS "package test: configured as expected (configure only)")
    return()
  endif()
  run_checked(out COMMAND "${CMAKE_COMMAND}" --build "${build}")
  if(INSTALL_EMPTY_OF_MESHLIB)
    set(consumer_prefix "${WORK}/consumer-install")
    run_checked(out COMMAND "${CMAKE_COMMAND}" --install "${build}" --prefix "${consumer_prefix}")
    file(GLOB_RECURSE installed RELATIVE "${consumer_prefix}" "${consumer_prefix}/*")
    if(NOT installed)
      fail("the consumer's install is empty: the check below would prove nothing")
    endif()
    foreach(f IN LISTS installed)
      if(f MATCHES "meshlib")
        fail("installing the consumer also installed meshlib's ${f}: a subproject must install nothing unless asked (MESHLIB_INSTALL)")
      endif()
    endforeach()
    message(STATUS "package test: the consumer's install holds only its own files: ${installed}")
  endif()
  foreach(suffix "" 2)
    if(RUN${suffix})
      string(REPLACE "|" ";" run_cmd "${RUN${suffix}}")
      run_checked(out COMMAND ${run_cmd} WORKING_DIRECTORY "${build}")
      if(NOT out MATCHES "${EXPECT_OUTPUT${suffix}}")
        fail("the consumer ran, but its output does not match '${EXPECT_OUTPUT${suffix}}'")
      endif()
    endif()
  endforeach()
  message(STATUS "package test: consumer configured, built and ran")

elseif(STEP STREQUAL "pkgconfig")
  find_program(pkg_config NAMES pkg-config pkgconf)
  if(NOT pkg_config)
    fail("pkg-config not found (apt-get install pkg-config)")
  endif()
  file(REMOVE_RECURSE "${WORK}")
  file(MAKE_DIRECTORY "${WORK}")
  set(ENV{PKG_CONFIG_PATH} "${PREFIX}/share/pkgconfig")
  run_checked(version COMMAND "${pkg_config}" --modversion meshlib)
  string(STRIP "${version}" version)
  if(NOT version STREQUAL EXPECT_VERSION)
    fail("pkg-config says meshlib ${version}, expected ${EXPECT_VERSION}")
  endif()
  # The .pc and the CMake package name the same Kokkos (the one the install was configured against).
  run_checked(pc_kokkos COMMAND "${pkg_config}" --variable=kokkos_version meshlib)
  string(STRIP "${pc_kokkos}" pc_kokkos)
  file(READ "${PREFIX}/share/cmake/meshlib/meshlibConfig.cmake" config)
  if(NOT config MATCHES "set\\(_meshlib_kokkos_version \"([^\"]*)\"\\)")
    fail("the installed meshlibConfig.cmake does not record the Kokkos version it was configured against")
  endif()
  if(NOT pc_kokkos STREQUAL CMAKE_MATCH_1 OR pc_kokkos STREQUAL "")
    fail("meshlib.pc says Kokkos '${pc_kokkos}', the CMake package '${CMAKE_MATCH_1}': they must agree")
  endif()
  run_checked(flags COMMAND "${pkg_config}" --cflags --libs meshlib)
  string(STRIP "${flags}" flags)
  separate_arguments(flags UNIX_COMMAND "${flags}")
  # The flags must point into the moved install, not at the source or build tree.
  if(NOT "${flags}" MATCHES "-I${PREFIX}/share/pkgconfig/../../include")
    fail("pkg-config --cflags does not name the install's include directory: ${flags}")
  endif()
  run_checked(out COMMAND "${CXX_COMPILER}" -std=c++20 -Wall -Wextra -Werror
    "-DMESHLIB_CONSUMER_KIND=\"pkg-config\"" "${CONSUMER_SOURCE}" -o "${WORK}/consumer" ${flags})
  run_checked(out COMMAND "${WORK}/consumer")
  if(NOT out MATCHES "meshlib consumer OK \\(pkg-config\\)")
    fail("the pkg-config consumer ran, but did not say OK")
  endif()
  message(STATUS "package test: compiled and ran a consumer with pkg-config --cflags --libs meshlib")

else()
  fail("unknown STEP '${STEP}'")
endif()
