# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Test helpers shared by every test folder.
#
#  meshlib_add_catch_test(NAME <n> SOURCES <src...> [LIBRARIES <lib...>] [LABELS <label...>] [TSAN])
#     One Catch2 binary from SOURCES, linked to the one precompiled Catch2 main (the main TU of
#     Catch2 v2 takes ~30 s to compile, so it is built once for every binary), registered as one
#     CTest test. TSAN also builds <n>_tsan under -fsanitize=thread (when MESHLIB_SANITIZE_THREAD)
#     and registers it with the label "tsan".
#  meshlib_add_compile_fail_test(NAME <n> SOURCE <src> REGEX <regex> [LIBRARIES <lib...>])
#     A program that must not compile: the test builds it and passes only when the compiler's
#     output matches REGEX (the static_assert message we promise the user).

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

function(meshlib_add_catch_test)
  cmake_parse_arguments(ARG "TSAN" "NAME" "SOURCES;LIBRARIES;LABELS" ${ARGN})
  _meshlib_catch_main("" "")
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE meshlib_catch_main meshlib::meshlib ${ARG_LIBRARIES})
  target_compile_options(${ARG_NAME} PRIVATE ${MESHLIB_TEST_WARNINGS})
  add_test(NAME ${ARG_NAME} COMMAND ${ARG_NAME})
  set_tests_properties(${ARG_NAME} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT 600)
  if(ARG_TSAN AND MESHLIB_SANITIZE_THREAD)
    set(tsan_flags -fsanitize=thread -g -O1)
    _meshlib_catch_main("_tsan" "${tsan_flags}")
    add_executable(${ARG_NAME}_tsan ${ARG_SOURCES})
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

function(meshlib_add_compile_fail_test)
  cmake_parse_arguments(ARG "" "NAME;SOURCE;REGEX" "LIBRARIES" ${ARGN})
  set(target compile_fail_${ARG_NAME})
  add_library(${target} OBJECT EXCLUDE_FROM_ALL ${ARG_SOURCE})
  target_link_libraries(${target} PRIVATE meshlib::meshlib ${ARG_LIBRARIES})
  add_test(NAME ${target}
    COMMAND ${CMAKE_COMMAND} --build ${CMAKE_BINARY_DIR} --target ${target})
  # The compiler's output must carry the promised message; a program that compiles cannot print it.
  set_tests_properties(${target} PROPERTIES
    PASS_REGULAR_EXPRESSION "${ARG_REGEX}"
    LABELS "compile_fail"
    RESOURCE_LOCK meshlib_build_tree
    TIMEOUT 300)
endfunction()
