# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Runs one compile-fail source through Clang (-fsyntax-only) and prints its output for the test's
# PASS_REGULAR_EXPRESSION; prints "meshlib-clang-leg: compiled" when it compiles and
# "meshlib-clang-leg: N errors" when Clang reports more than one error (the test's
# FAIL_REGULAR_EXPRESSION): every mistake must give exactly one error.
# -D CLANGXX=<clang++> -D SOURCE=<file.cpp> -D INCLUDES=<a;b> -D DEFINES=<X=1;Y=1>
set(args -std=c++20 -fsyntax-only -fno-color-diagnostics)
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
execute_process(COMMAND ${CLANGXX} ${args} ${SOURCE} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(rc EQUAL 0)
  message("meshlib-clang-leg: compiled")
else()
  string(REGEX MATCHALL "error:" errors "${out}")
  list(LENGTH errors n)
  if(NOT n EQUAL 1)
    message("meshlib-clang-leg: ${n} errors")
  endif()
endif()
