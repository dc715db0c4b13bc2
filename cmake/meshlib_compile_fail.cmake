# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Runs one compile-fail source through a compiler (GCC or Clang, -fsyntax-only) and prints its
# output for the test's PASS_REGULAR_EXPRESSION; prints "meshlib-compile-fail: compiled" when it
# compiles and "meshlib-compile-fail: N errors" when the compiler reports more than one error (the
# test's FAIL_REGULAR_EXPRESSION): every mistake must give exactly one error.
# The compiler is called directly, not through the build tree, so that the tests run in parallel
# with each other and with everything else (no lock on the build tree, no build-system start-up).
# -D COMPILER=<c++> -D SOURCE=<file.cpp> -D FLAGS=<file>: FLAGS holds three lines, the target's
# include directories, definitions and options (each a CMake list; meshlib_add_compile_fail_test
# writes it).
set(args -std=c++20 -fsyntax-only -fno-diagnostics-color)
if(COMPILER MATCHES "clang")
  set(args -std=c++20 -fsyntax-only -fno-color-diagnostics)
endif()
file(READ "${FLAGS}" flags)
if(NOT flags MATCHES "^([^\n]*)\n([^\n]*)\n([^\n]*)\n$")
  message(FATAL_ERROR "meshlib-compile-fail: ${FLAGS} is not three lines")
endif()
set(INCLUDES "${CMAKE_MATCH_1}")
set(DEFINES "${CMAKE_MATCH_2}")
set(OPTIONS "${CMAKE_MATCH_3}")
list(REMOVE_DUPLICATES INCLUDES)
foreach(dir IN LISTS INCLUDES)
  # The compiler's own directories stay implicit: naming /usr/include breaks libstdc++'s
  # #include_next <stdlib.h>.
  if(dir AND NOT dir MATCHES "^/usr(/local)?/include/?$")
    list(APPEND args "-isystem${dir}")
  endif()
endforeach()
foreach(def IN LISTS DEFINES)
  if(def)
    list(APPEND args "-D${def}")
  endif()
endforeach()
foreach(opt IN LISTS OPTIONS)
  if(opt)
    list(APPEND args "${opt}")
  endif()
endforeach()
execute_process(COMMAND ${COMPILER} ${args} ${SOURCE} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(rc EQUAL 0)
  message("meshlib-compile-fail: compiled")
else()
  string(REGEX MATCHALL "error:" errors "${out}")
  list(LENGTH errors n)
  if(NOT n EQUAL 1)
    message("meshlib-compile-fail: ${n} errors")
  endif()
endif()
