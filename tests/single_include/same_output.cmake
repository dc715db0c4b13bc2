# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# cmake -DSINGLE=<program> -DREFERENCE=<program> -DEXPECT=<regex> -P same_output.cmake
# Runs both programs; each must exit 0 and print EXPECT, and their outputs must be identical (the
# single-header build computes exactly what the library built from include/ computes).
foreach(var SINGLE REFERENCE EXPECT)
  if(NOT ${var})
    message(FATAL_ERROR "same_output.cmake: ${var} is not set")
  endif()
endforeach()
foreach(program SINGLE REFERENCE)
  execute_process(COMMAND "${${program}}" RESULT_VARIABLE rc OUTPUT_VARIABLE out_${program} ERROR_VARIABLE err)
  message("${program} (${${program}}):\n${out_${program}}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${${program}} exited with ${rc}")
  endif()
  if(NOT out_${program} MATCHES "${EXPECT}")
    message(FATAL_ERROR "${${program}} did not print '${EXPECT}'")
  endif()
endforeach()
if(NOT out_SINGLE STREQUAL out_REFERENCE)
  message(FATAL_ERROR "the single-header build and the include/ build printed different results (above)")
endif()
message(STATUS "same output from the single header and from include/")
