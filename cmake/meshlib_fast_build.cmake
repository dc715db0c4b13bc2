# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# meshlib_enable_fast_build(<target> [NN] [ITERATE] [HEADERS <header>...] [REUSE_FROM <other target>])
#
# Makes the edit-compile loop of a program that uses meshlib short (docs/fast-builds.md has the
# measurements): meshlib is header-only and every program compiles Kokkos, the mesh and sharding
# templates and the collectives again; a precompiled header parses them once per target.
#   - A precompiled header (target_precompile_headers) of <Kokkos_Core.hpp> and <meshlib.hpp>, plus
#     <meshlib/nn.hpp> with NN and any HEADERS you name (<vector>, your own heavy headers).
#     REUSE_FROM <other> uses another target's precompiled header instead of building one more
#     (the two targets must be compiled with the same flags, as CMake requires).
#   - -Winvalid-pch (GCC, Clang): a precompiled header the compiler cannot use (other flags) is a
#     warning instead of a silent full parse.
#   - ITERATE: -O1 for the target, after the build type's flags so that it wins (GCC and Clang take
#     the last -O): most of a rebuild is generating optimised code for meshlib's runtime, and -O1
#     cuts a quarter to a third of it (docs/fast-builds.md). For the edit loop; leave it out for runs you time.
# Without ITERATE the optimisation level and debug information stay yours.
# For targets that link meshlib::meshlib (the precompiled header includes Kokkos). Available after
# find_package(meshlib), add_subdirectory or FetchContent of meshlib.

include_guard(GLOBAL)

function(meshlib_enable_fast_build target)
  cmake_parse_arguments(PARSE_ARGV 1 _mfb "NN;ITERATE" "REUSE_FROM" "HEADERS")
  if(_mfb_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "meshlib_enable_fast_build(${target}): unknown argument(s) '${_mfb_UNPARSED_ARGUMENTS}'; "
      "it takes NN, ITERATE, HEADERS <header>... and REUSE_FROM <target>")
  endif()
  if(NOT TARGET ${target})
    message(FATAL_ERROR "meshlib_enable_fast_build: there is no target '${target}'; call it after "
      "add_executable(${target} ...) or add_library(${target} ...)")
  endif()
  get_target_property(_mfb_type ${target} TYPE)
  if(_mfb_type STREQUAL "INTERFACE_LIBRARY")
    message(FATAL_ERROR "meshlib_enable_fast_build: '${target}' is an INTERFACE library, which compiles "
      "nothing; call it on the executables or libraries that link it")
  endif()
  if(_mfb_REUSE_FROM AND (_mfb_NN OR _mfb_HEADERS))
    message(FATAL_ERROR "meshlib_enable_fast_build(${target}): REUSE_FROM ${_mfb_REUSE_FROM} uses that "
      "target's precompiled header as it is; give NN or HEADERS to ${_mfb_REUSE_FROM}'s call instead")
  endif()

  if(_mfb_REUSE_FROM)
    if(NOT TARGET ${_mfb_REUSE_FROM})
      message(FATAL_ERROR "meshlib_enable_fast_build(${target}): REUSE_FROM names no target "
        "'${_mfb_REUSE_FROM}'; call meshlib_enable_fast_build(${_mfb_REUSE_FROM}) first")
    endif()
    target_precompile_headers(${target} REUSE_FROM ${_mfb_REUSE_FROM})
  else()
    # Kokkos first, as <meshlib.hpp> includes it: the precompiled header is one prefix of both.
    set(_mfb_headers <Kokkos_Core.hpp> <meshlib.hpp>)
    if(_mfb_NN)
      list(APPEND _mfb_headers <meshlib/nn.hpp>)
    endif()
    target_precompile_headers(${target} PRIVATE ${_mfb_headers} ${_mfb_HEADERS})
  endif()
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Winvalid-pch>)
    if(_mfb_ITERATE)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O1>)
    endif()
  elseif(_mfb_ITERATE)
    message(WARNING "meshlib_enable_fast_build(${target} ITERATE): -O1 is set for GCC and Clang only; "
      "${CMAKE_CXX_COMPILER_ID} keeps the build type's optimisation level")
  endif()
endfunction()
