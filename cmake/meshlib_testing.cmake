# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Test helpers shared by every test folder.
#
#  meshlib_add_catch_test(NAME <n> SOURCES <src...> [LIBRARIES <lib...>] [LABELS <label...>] [TSAN]
#                         [PARTS <test>:<stem>[,<stem>...] ...])
#     One Catch2 binary from SOURCES, linked to the one precompiled Catch2 main (the main TU of
#     Catch2 v2 takes ~30 s to compile, so it is built once for every binary), registered as one
#     CTest test. TSAN also builds <n>_tsan under -fsanitize=thread (when MESHLIB_SANITIZE_THREAD)
#     and registers it with the label "tsan".
#     PARTS: one binary, several CTest tests. Each <test> runs the test cases of the sources named
#     by their stems (test_remat for test_remat.cpp; Catch2's file-name tags, `-# [#test_remat]`),
#     and <n> runs the rest: the sources share the binary's unity batches (one compile of the
#     templates they share), while ctest still runs the parts side by side and names them apart.
#  meshlib_add_compile_fail_test(NAME <n> SOURCE <src> REGEX <regex> [NAMES <regex>] [HEAD <text...>]
#                                [GCC_ONLY] [LIBRARIES <lib...>])
#     A program that must not compile: the test compiles it (-fsyntax-only, the compiler called
#     directly by cmake/meshlib_compile_fail.cmake) and passes only when the compiler's
#     output matches REGEX (the first words of the static_assert message we promise the user) and,
#     when given, NAMES (what the diagnostic's condition spells out, in either order: GCC prints it
#     before and after the message, Clang before it). In NAMES, @model@ stands for the axis name
#     "model" as each compiler prints it (core/diagnostics.hpp): the word
#     meshlib::fixed_string<6>{"model"} on GCC, the char pack 'm', 'o', 'd', 'e', 'l' on Clang;
#     ">>" matches Clang's ">>" and GCC's "> >". Each name in NAMES must also be in the first three
#     lines of the diagnostic (the include chain not counted): where a user reads. HEAD: more text
#     that must be there, written as both compilers print it (a type, `meshlib::bfloat16`, or a
#     number, `meshlib::diagnostic::kernel<5>`), for names that are not axis names.
#     GCC_ONLY: no Clang leg (diagnostics not yet single-error on Clang). When clang++-14 is
#     found (MESHLIB_COMPILE_FAIL_CLANG), a second test compile_fail_clang_<n> runs the same source
#     through Clang (-fsyntax-only, ~3 s each) and checks the same REGEX and that Clang reports
#     exactly one error: diagnostics must read well on both compilers.

include_guard(GLOBAL)

find_package(Catch2 CONFIG REQUIRED)
set(MESHLIB_CATCH2_MAJOR ${Catch2_VERSION_MAJOR})

set(MESHLIB_TEST_WARNINGS -Wall -Wextra -Wpedantic)
if(MESHLIB_WARNINGS_AS_ERRORS)
  list(APPEND MESHLIB_TEST_WARNINGS -Werror)
endif()

function(_meshlib_catch_main suffix flags)
  if(TARGET meshlib_catch_main${suffix})
    return()
  endif()
  add_library(meshlib_catch_main${suffix} OBJECT ${PROJECT_SOURCE_DIR}/tests/support/catch_main.cpp)
  target_link_libraries(meshlib_catch_main${suffix} PUBLIC Catch2::Catch2 meshlib::meshlib)
  target_include_directories(meshlib_catch_main${suffix} PUBLIC ${PROJECT_SOURCE_DIR}/tests/support)
  target_compile_definitions(meshlib_catch_main${suffix} PUBLIC MESHLIB_CATCH2_MAJOR=${MESHLIB_CATCH2_MAJOR})
  target_compile_options(meshlib_catch_main${suffix} PUBLIC ${flags})
  target_link_options(meshlib_catch_main${suffix} PUBLIC ${flags})
endfunction()

# Unity builds of the test binaries (issue 28: the cold test command within 30 minutes on 2 cores).
# Every test source parses Kokkos, meshlib and Catch2 and instantiates and compiles the same tensor,
# collective and training templates as its neighbours; compiled MESHLIB_UNITY_TESTS_BATCH at a time,
# that happens once per batch (measured: 4 nn test sources 129 CPU s apart, 39 s as one batch; nn_unit
# and collectives_tests from clean 516 CPU s in batches of 5, 354 in batches of 10, 2026-12-06). Each
# source wraps its code in `namespace MESHLIB_TEST_UNIT { ... }`, which CMake defines to a name of
# its own per source in a batch (UNITY_BUILD_UNIQUE_ID), so file-local names cannot collide; outside
# a batch it is `meshlib_test_unit`. A source with compile options of its own (the -O0 one in
# tests/unit/core) is compiled alone, as CMake does for such sources.
option(MESHLIB_UNITY_TESTS "Compile each test binary's sources as unity batches" ON)
set(MESHLIB_UNITY_TESTS_BATCH 10 CACHE STRING "Sources per unity batch of a test binary")
function(meshlib_test_sources target)
  # A source that forgot the wrapper would compile today and collide with a neighbour's helper the
  # day one is named alike: refuse it at configure time, naming the file and the fix.
  get_target_property(sources ${target} SOURCES)
  get_target_property(source_dir ${target} SOURCE_DIR)
  list(LENGTH sources n)
  if(n GREATER 1)
    foreach(source IN LISTS sources)
      if(NOT IS_ABSOLUTE "${source}")
        set(source "${source_dir}/${source}")
      endif()
      file(READ "${source}" text)
      if(NOT text MATCHES "\nnamespace MESHLIB_TEST_UNIT {")
        message(FATAL_ERROR "meshlib: ${source} shares unity batches with the other sources of ${target}: put its "
          "code after the #include lines inside `namespace MESHLIB_TEST_UNIT { ... }` (cmake/meshlib_testing.cmake says why)")
      endif()
    endforeach()
  endif()
  target_compile_definitions(${target} PRIVATE MESHLIB_TEST_UNIT=meshlib_test_unit)
  set_target_properties(${target} PROPERTIES UNITY_BUILD_UNIQUE_ID MESHLIB_TEST_UNIT)
  if(MESHLIB_UNITY_TESTS)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${MESHLIB_UNITY_TESTS_BATCH})
  endif()
endfunction()

function(meshlib_add_catch_test)
  cmake_parse_arguments(ARG "TSAN" "NAME" "SOURCES;LIBRARIES;LABELS;PARTS" ${ARGN})
  _meshlib_catch_main("" "")
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  meshlib_test_sources(${ARG_NAME})
  target_link_libraries(${ARG_NAME} PRIVATE meshlib_catch_main meshlib::meshlib ${ARG_LIBRARIES})
  target_compile_options(${ARG_NAME} PRIVATE ${MESHLIB_TEST_WARNINGS})
  set(part_tests "")
  set(part_specs "")
  set(rest "")  # the Catch2 test spec of what no part runs: ~[#a]~[#b]... (all of them "and")
  foreach(part IN LISTS ARG_PARTS)
    if(NOT part MATCHES "^([A-Za-z0-9_]+):([A-Za-z0-9_,]+)$")
      message(FATAL_ERROR "meshlib_add_catch_test(${ARG_NAME}): PARTS entry '${part}' is not <test>:<stem>[,<stem>...]")
    endif()
    set(part_test ${CMAKE_MATCH_1})
    string(REPLACE "," ";" stems "${CMAKE_MATCH_2}")
    set(spec "")
    foreach(stem IN LISTS stems)
      if(NOT "${ARG_SOURCES}" MATCHES "(^|;|/)${stem}\\.cpp(;|$)")
        message(FATAL_ERROR "meshlib_add_catch_test(${ARG_NAME}): PARTS names ${stem}, which is not one of its SOURCES")
      endif()
      list(APPEND spec "[#${stem}]")
      string(APPEND rest "~[#${stem}]")
    endforeach()
    list(JOIN spec "," spec)
    list(APPEND part_tests ${part_test})
    list(APPEND part_specs "${spec}")
  endforeach()
  if(rest)
    add_test(NAME ${ARG_NAME} COMMAND ${ARG_NAME} "-#" "${rest}")
  else()
    add_test(NAME ${ARG_NAME} COMMAND ${ARG_NAME})
  endif()
  set_tests_properties(${ARG_NAME} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT 600)
  foreach(part_test spec IN ZIP_LISTS part_tests part_specs)
    add_test(NAME ${part_test} COMMAND ${ARG_NAME} "-#" "${spec}")
    set_tests_properties(${part_test} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT 600)
  endforeach()
  if(ARG_TSAN AND MESHLIB_SANITIZE_THREAD)
    # -g1 (line tables): a report names file and line, and -g's full debug information would cost
    # the sanitizer copies a fifth of their compile time. -Og as the other test targets (tests/CMakeLists.txt).
    set(tsan_flags -fsanitize=thread -g1 -Og)
    # An instrumented Catch2 main of its own, although it runs on the main thread only: the linker
    # keeps one copy of each inline function (shared_ptr's reference counting, say), and an
    # uninstrumented copy from the main hides its atomics from ThreadSanitizer, which then reports
    # races that are not there (tried: every TSan copy failed).
    _meshlib_catch_main("_tsan" "${tsan_flags}")
    add_executable(${ARG_NAME}_tsan ${ARG_SOURCES})
    meshlib_test_sources(${ARG_NAME}_tsan)
    target_link_libraries(${ARG_NAME}_tsan PRIVATE meshlib_catch_main_tsan meshlib::meshlib ${ARG_LIBRARIES})
    target_compile_options(${ARG_NAME}_tsan PRIVATE ${MESHLIB_TEST_WARNINGS} ${tsan_flags})
    target_link_options(${ARG_NAME}_tsan PRIVATE ${tsan_flags})
    target_compile_definitions(${ARG_NAME}_tsan PRIVATE MESHLIB_UNDER_TSAN=1)
    add_test(NAME ${ARG_NAME}_tsan COMMAND ${ARG_NAME}_tsan)
    # halt_on_error: a report fails the test instead of scrolling past.
    set_tests_properties(${ARG_NAME}_tsan PROPERTIES LABELS "tsan;${ARG_LABELS}" TIMEOUT 900
      ENVIRONMENT "TSAN_OPTIONS=halt_on_error=1 second_deadlock_stack=1")
  endif()
endfunction()

# The compile-fail tests and compile checks start from one precompiled header per compiler and
# flags (cmake/meshlib_compile_fail.cmake says how it is kept in step with the headers).
option(MESHLIB_COMPILE_CHECK_PCH "Compile-fail tests and compile checks share a precompiled meshlib header" ON)
# (A function, not a variable: bench/ calls these functions from outside tests/'s scope.)
function(_meshlib_pch_args out_var)
  set(args "")
  if(MESHLIB_COMPILE_CHECK_PCH)
    set(args "-DPCH_DIR=${CMAKE_BINARY_DIR}/compile_check_pch" "-DHEADERS=${PROJECT_SOURCE_DIR}/include")
  endif()
  set(${out_var} "${args}" PARENT_SCOPE)
endfunction()

# Writes the compile flags a user's target linked to `libraries` gets (include directories,
# definitions, options; transitive ones included) to <out_var>'s file, at generate time: there,
# usage requirements guarded by $<COMPILE_LANGUAGE:CXX> count as in a compile (Kokkos 4 with OpenMP
# asks for -fopenmp that way), while a test's command line evaluates them to nothing.
function(_meshlib_flags_file out_var target)
  set(flags "${CMAKE_CURRENT_BINARY_DIR}/${target}-$<CONFIG>.flags")
  file(GENERATE OUTPUT "${flags}"
    CONTENT "$<TARGET_PROPERTY:${target},INCLUDE_DIRECTORIES>\n$<TARGET_PROPERTY:${target},COMPILE_DEFINITIONS>\n$<TARGET_PROPERTY:${target},COMPILE_OPTIONS>\n")
  set(${out_var} "${flags}" PARENT_SCOPE)
endfunction()

#  meshlib_add_compile_check(TARGET <t>)
#     A test compile_check_<t> per source of target <t> (-fsyntax-only with <t>'s flags, the
#     compiler called directly): it passes when the source compiles. For targets the test command
#     does not build (the benchmarks: bench/CMakeLists.txt), so that they still cannot rot. No
#     precompiled header: each benchmark has flags of its own, so one would serve one source.
function(meshlib_add_compile_check)
  cmake_parse_arguments(ARG "" "TARGET" "" ${ARGN})
  _meshlib_flags_file(flags ${ARG_TARGET})
  get_target_property(sources ${ARG_TARGET} SOURCES)
  get_target_property(source_dir ${ARG_TARGET} SOURCE_DIR)
  list(FILTER sources INCLUDE REGEX "\\.cpp$")
  list(LENGTH sources n)
  if(NOT n EQUAL 1)
    message(FATAL_ERROR "meshlib_add_compile_check: ${ARG_TARGET} has ${n} .cpp sources; one test per target expects one")
  endif()
  foreach(source IN LISTS sources)
    if(NOT IS_ABSOLUTE "${source}")
      set(source "${source_dir}/${source}")
    endif()
    add_test(NAME compile_check_${ARG_TARGET}
      COMMAND ${CMAKE_COMMAND} -DCOMPILER=${CMAKE_CXX_COMPILER} -DSOURCE=${source} "-DFLAGS=${flags}" -DEXPECT=compile
        -P ${PROJECT_SOURCE_DIR}/cmake/meshlib_compile_fail.cmake)
    set_tests_properties(compile_check_${ARG_TARGET} PROPERTIES
      PASS_REGULAR_EXPRESSION "meshlib-compile-check: compiled" LABELS "compile_check" TIMEOUT 300)
  endforeach()
endfunction()

find_program(MESHLIB_CLANGXX NAMES clang++-14 clang++ DOC "Clang for the compile-fail tests' second leg")
option(MESHLIB_COMPILE_FAIL_CLANG "Also check every compile-fail test's message under Clang" ON)

# "model" -> "meshlib::fixed_string<6>{"model"}": an axis name as GCC prints a diagnostic name.
function(_meshlib_word out name)
  string(LENGTH "${name}" n)
  math(EXPR n "${n} + 1")
  set(${out} "meshlib::fixed_string<${n}>{\"${name}\"}" PARENT_SCOPE)
endfunction()

# "model" -> "'m', 'o', 'd', 'e', 'l'": an axis name as Clang prints a diagnostic name (a char pack).
function(_meshlib_char_pack out name)
  string(LENGTH "${name}" n)
  set(r "")
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    string(SUBSTRING "${name}" ${i} 1 c)
    if(i GREATER 0)
      string(APPEND r ", ")
    endif()
    string(APPEND r "'${c}'")
  endforeach()
  set(${out} "${r}" PARENT_SCOPE)
endfunction()

function(meshlib_add_compile_fail_test)
  cmake_parse_arguments(ARG "GCC_ONLY" "NAME;SOURCE;REGEX;NAMES" "LIBRARIES;HEAD" ${ARGN})
  set(target compile_fail_${ARG_NAME})
  # The regular expression each compiler's output must match: the message, and the names as that
  # compiler prints them.
  set(regex_gcc "${ARG_REGEX}")
  set(regex_clang "${ARG_REGEX}")
  set(head_gcc "")    # the names, as each compiler prints them, joined by "|": the script checks
  set(head_clang "")  # that each is in the first three lines of the diagnostic
  if(ARG_NAMES)
    string(REGEX MATCHALL "@[A-Za-z0-9_]+@" holes "${ARG_NAMES}")
    list(REMOVE_DUPLICATES holes)
    set(names_gcc "${ARG_NAMES}")
    set(names_clang "${ARG_NAMES}")
    foreach(hole IN LISTS holes)
      string(REPLACE "@" "" name "${hole}")
      _meshlib_word(word "${name}")
      _meshlib_char_pack(pack "${name}")
      string(REPLACE "${hole}" "${word}" names_gcc "${names_gcc}")
      string(REPLACE "${hole}" "${pack}" names_clang "${names_clang}")
      string(APPEND head_gcc "|${word}")
      string(APPEND head_clang "|${pack}")
    endforeach()
    foreach(c gcc clang)
      string(REPLACE ">" "> ?" names_${c} "${names_${c}}")  # GCC closes nested templates with "> >", "> > >"
      set(regex_${c} "(${ARG_REGEX}.*${names_${c}}|${names_${c}}.*${ARG_REGEX})")
    endforeach()
  endif()
  foreach(text IN LISTS ARG_HEAD)  # the same on both compilers
    string(APPEND head_gcc "|${text}")
    string(APPEND head_clang "|${text}")
  endforeach()
  # Never built: it gives the tests the flags a user's target gets (_meshlib_flags_file).
  add_library(${target} OBJECT EXCLUDE_FROM_ALL ${ARG_SOURCE})
  target_link_libraries(${target} PRIVATE meshlib::meshlib ${ARG_LIBRARIES})
  _meshlib_flags_file(flags ${target})
  _meshlib_pch_args(pch)
  set(compilers ${CMAKE_CXX_COMPILER})
  set(names ${target})
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(regexes "${regex_clang}")
    set(heads "-DHEAD_NAMES=${head_clang}")
  else()
    set(regexes "${regex_gcc}")
    set(heads "-DHEAD_NAMES=${head_gcc}")
  endif()
  if(MESHLIB_COMPILE_FAIL_CLANG AND MESHLIB_CLANGXX AND NOT ARG_GCC_ONLY)
    list(APPEND compilers ${MESHLIB_CLANGXX})
    list(APPEND names compile_fail_clang_${ARG_NAME})
    list(APPEND regexes "${regex_clang}")
    list(APPEND heads "-DHEAD_NAMES=${head_clang}")
  endif()
  foreach(compiler name ARG_REGEX head IN ZIP_LISTS compilers names regexes heads)
    add_test(NAME ${name}
      COMMAND ${CMAKE_COMMAND} -DCOMPILER=${compiler} -DSOURCE=${CMAKE_CURRENT_SOURCE_DIR}/${ARG_SOURCE}
        "-DFLAGS=${flags}" ${pch} "${head}" -P ${PROJECT_SOURCE_DIR}/cmake/meshlib_compile_fail.cmake)
    # The compiler's output must carry the promised message; a program that compiles cannot print it.
    # One mistake, one error, and the names it spells out within the diagnostic's first three lines.
    set_tests_properties(${name} PROPERTIES
      PASS_REGULAR_EXPRESSION "${ARG_REGEX}"
      FAIL_REGULAR_EXPRESSION "meshlib-compile-fail: (compiled|[0-9]+ errors|.* is not in the first three lines)"
      LABELS "compile_fail"
      TIMEOUT 300)
  endforeach()
  if(TEST compile_fail_clang_${ARG_NAME})
    set_tests_properties(compile_fail_clang_${ARG_NAME} PROPERTIES LABELS "compile_fail;clang")
  endif()
endfunction()
