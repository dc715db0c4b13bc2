# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# meshlib_read_flags(<file> <out_var>): the compiler arguments of a flags file that
# meshlib_testing.cmake's _meshlib_flags_file wrote (three lines: a target's include directories,
# definitions and options, each a CMake list), for scripts that call the compiler directly
# (cmake/meshlib_compile_fail.cmake, tests/static/check_umbrella_includes.cmake). Include
# directories become -isystem, except the compiler's own: naming /usr/include breaks libstdc++'s
# #include_next <stdlib.h>.
include_guard(GLOBAL)
function(meshlib_read_flags file out_var)
  file(READ "${file}" flags)
  if(NOT flags MATCHES "^([^\n]*)\n([^\n]*)\n([^\n]*)\n$")
    message(FATAL_ERROR "meshlib_read_flags: ${file} is not three lines")
  endif()
  set(includes "${CMAKE_MATCH_1}")
  set(defines "${CMAKE_MATCH_2}")
  set(options "${CMAKE_MATCH_3}")
  list(REMOVE_DUPLICATES includes)
  set(args "")
  foreach(dir IN LISTS includes)
    if(dir AND NOT dir MATCHES "^/usr(/local)?/include/?$")
      list(APPEND args "-isystem${dir}")
    endif()
  endforeach()
  foreach(def IN LISTS defines)
    if(def)
      list(APPEND args "-D${def}")
    endif()
  endforeach()
  foreach(opt IN LISTS options)
    if(opt)
      list(APPEND args "${opt}")
    endif()
  endforeach()
  set(${out_var} "${args}" PARENT_SCOPE)
endfunction()
