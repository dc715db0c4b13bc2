# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Runs EXE with the Catch2 test filter FILTER TIMES times; fails on the first failing run.
foreach(i RANGE 1 ${TIMES})
  execute_process(COMMAND ${EXE} ${FILTER} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "run ${i} of ${TIMES} failed (exit ${rc}):\n${out}")
  endif()
endforeach()
message(STATUS "${TIMES} runs passed")
