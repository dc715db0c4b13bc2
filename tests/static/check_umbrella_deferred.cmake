# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Compiles umbrella_deferred.cpp with -fsyntax-only and meshlib's flags (see that file for why).
# cmake -DCXX=<compiler> -DFLAGS=<file> [-DPROBE=ON] -P check_umbrella_deferred.cmake
foreach(v CXX FLAGS)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_umbrella_deferred: -D${v}=... is required")
  endif()
endforeach()
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/meshlib_read_flags.cmake)
meshlib_read_flags("${FLAGS}" flag_args)
set(extra "")
if(PROBE)
  set(extra -DMESHLIB_DEFERRED_PROBE=1)
endif()
execute_process(COMMAND "${CXX}" -std=c++20 -fsyntax-only ${flag_args} ${extra}
                        "${CMAKE_CURRENT_LIST_DIR}/umbrella_deferred.cpp"
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "meshlib: <meshlib.hpp> compiles code that only tracing, running devices or starting "
    "processes needs in every translation unit (docs/benchmarks.md, \"Include cost\"): keep it in the "
    "templates of core/deferred.hpp's pattern, called only from templates.\n${out}${err}")
endif()
message(STATUS "<meshlib.hpp>: the deferred code is not instantiated by including it")
