# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# <meshlib.hpp> stays cheap to include (docs/benchmarks.md, "Include cost"): users include it in
# every file, so no meshlib header it pulls in may include a header that costs a large share of a
# translation unit for something a lighter header or a builtin does. The check reads the include
# tree (-E -H: preprocessing only, under a second, so a loaded machine cannot make it flaky as a
# timing threshold would) and fails naming the heavy header and the meshlib header that includes it.
# Headers that Kokkos or the standard library include on their own do not count: only the direct
# includes of meshlib's headers do.
#
# cmake -DCXX=<compiler> -DFLAGS=<file> -DWORK=<dir> [-DPROBE=<header>] -P check_umbrella_includes.cmake
# FLAGS: three lines, meshlib's include directories, definitions and options (each a CMake list,
# as meshlib_testing.cmake's _meshlib_flags_file writes them).
# PROBE: a header included after the umbrella (the self-test includes a meshlib-like header that
# includes a forbidden one, and expects the failure).
foreach(v CXX WORK FLAGS)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_umbrella_includes: -D${v}=... is required")
  endif()
endforeach()

# What the umbrella must not pull in, and why (regex on the included path; the reason is printed).
set(forbidden
  "immintrin\\.h$|every x86 intrinsic up to AVX-512 (use the __builtin_ia32_* builtin)"
  "/iomanip$|<locale> with it (set width and precision through the stream's members)"
  "/locale$|the locale facets (use <charconv> or the stream's members)"
  "/fstream$|file streams (write through <cstdio>)"
  "/regex$|<regex>"
  "/random$|<random> (the engines are for nn and the data pipeline, not the umbrella)"
  "/format$|<format>"
  "/future$|<future>"
  "/filesystem$|<filesystem>"
  "meshlib/nn(/|\\.hpp$)|the training layer (include <meshlib/nn.hpp> where you train)"
  "meshlib/comm/mpi/|the MPI backend (include <meshlib/mpi.hpp>)"
  "meshlib/comm/nccl/|the NCCL backend (include <meshlib/nccl.hpp>)")

file(MAKE_DIRECTORY "${WORK}")
set(tu "${WORK}/umbrella_includes.cpp")
set(text "#include <meshlib.hpp>\n")
if(PROBE)
  string(APPEND text "#include \"${PROBE}\"\n")
endif()
file(WRITE "${tu}" "${text}")
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/meshlib_read_flags.cmake)
meshlib_read_flags("${FLAGS}" flag_args)
set(args -std=c++20 -E -H -o "${WORK}/umbrella_includes.i" ${flag_args})
execute_process(COMMAND "${CXX}" ${args} "${tu}" RESULT_VARIABLE rc ERROR_VARIABLE tree OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_umbrella_includes: preprocessing <meshlib.hpp> failed (${rc}):\n${tree}")
endif()

# -H prints one line per include: as many dots as the depth, a space, the path.
string(REPLACE ";" "\\;" tree "${tree}")
string(REPLACE "\n" ";" lines "${tree}")
set(parents "")  # parents[depth-1]: the path of the header at that depth on the current branch
set(seen_spmd FALSE)
set(failures "")
foreach(line IN LISTS lines)
  if(NOT line MATCHES "^(\\.+) (.+)$")
    continue()
  endif()
  string(LENGTH "${CMAKE_MATCH_1}" depth)
  set(path "${CMAKE_MATCH_2}")
  math(EXPR keep "${depth} - 1")
  list(SUBLIST parents 0 ${keep} parents)
  if(depth EQUAL 1)
    set(parent "${tu}")
  else()
    list(GET parents -1 parent)
  endif()
  list(APPEND parents "${path}")
  if(path MATCHES "meshlib/exec/spmd\\.hpp$")
    set(seen_spmd TRUE)
  endif()
  # Only what meshlib's own headers include directly counts.
  if(NOT parent MATCHES "(/meshlib/[^;]*|/meshlib)\\.hpp$")
    continue()
  endif()
  foreach(entry IN LISTS forbidden)
    string(FIND "${entry}" "|" bar REVERSE)
    string(SUBSTRING "${entry}" 0 ${bar} pattern)
    math(EXPR from "${bar} + 1")
    string(SUBSTRING "${entry}" ${from} -1 reason)
    if(path MATCHES "${pattern}")
      string(APPEND failures "  ${parent}\n    includes ${path}: ${reason}\n")
    endif()
  endforeach()
endforeach()

if(NOT seen_spmd)
  message(FATAL_ERROR "check_umbrella_includes: the include tree of <meshlib.hpp> does not contain "
    "meshlib/exec/spmd.hpp: the compiler printed no -H tree, or the umbrella changed (update this check)")
endif()
if(failures)
  message(FATAL_ERROR "meshlib: <meshlib.hpp> pulls in headers that make every translation unit "
    "including it slower (docs/benchmarks.md, \"Include cost\"):\n${failures}"
    "Use the lighter header or builtin named, or move the code to an opt-in header.")
endif()
message(STATUS "<meshlib.hpp>: no heavy header included by a meshlib header")
