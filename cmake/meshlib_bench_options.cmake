# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# The bad-option test of one benchmark (bench/CMakeLists.txt, issue 39 item 6): runs PROGRAM with
# each argument list of BAD and passes when every run exits with status 2 and says
# "<NAME>: <what is wrong>" on stderr (never an exception, a crash or a run); `--help` must exit 0,
# and each argument list of GOOD too (given only where PROGRAM is the benchmark's options-only
# build, which stops after checking its options: the benchmark itself would run).
#
# cmake -D PROGRAM=<exe> -D NAME=<program name in messages> -D BAD=<a|b c|...> [-D GOOD=<...>] -P meshlib_bench_options.cmake
# Lists are separated by '|', the words of one list by spaces.
set(failures "")
function(run_case args want)
  separate_arguments(argv UNIX_COMMAND "${args}")
  execute_process(COMMAND "${PROGRAM}" ${argv} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  string(REGEX REPLACE "\n.*" "" first "${err}")
  if(NOT rc STREQUAL "${want}")
    string(APPEND failures "  ${NAME} ${args}: exit status '${rc}', expected ${want}; stderr: ${err}\n")
  elseif(want EQUAL 2 AND NOT first MATCHES "^${NAME}: .")
    string(APPEND failures "  ${NAME} ${args}: exit status 2 but stderr does not start with '${NAME}: ': ${err}\n")
  else()
    message(STATUS "${NAME} ${args}: exit status ${rc}: ${first}")
  endif()
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

string(REPLACE "|" ";" bad "${BAD}")
foreach(args IN LISTS bad)
  run_case("${args}" 2)
endforeach()
run_case("--help" 0)
if(GOOD)
  string(REPLACE "|" ";" good "${GOOD}")
  foreach(args IN LISTS good)
    run_case("${args}" 0)
  endforeach()
endif()
if(failures)
  message(FATAL_ERROR "bad options not refused as they should be:\n${failures}")
endif()
message(STATUS "meshlib-bench-options: ${NAME} refused every bad option")
