#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Installs what is missing, builds meshlib's tests (Release, -O2) in build/ and runs them all.
# The last lines are ctest's summary ("100% tests passed, 0 tests failed out of N"); the exit
# status is ctest's. When a target fails to build, the build keeps going, ctest runs what was
# built (a test whose binary is missing counts as failed), a last line says the build failed, and
# the exit status is non-zero. Extra arguments go to ctest (e.g. -L package, -R mesh).
#
# Then the Kokkos 4 leg (MESHLIB_KOKKOS4_LEG=0 turns it off): Kokkos 4.6.01 (Serial+OpenMP) and
# Kokkos Kernels 4.6.01 are built once from the release snapshots in ../shared/vendor (or
# $MESHLIB_VENDOR_DIR) into $BUILD_DIR/_deps/ (scripts/build_kokkos4.sh; cached by a stamp), a
# second build directory $BUILD_DIR/kokkos4 is configured against them, and the tests that run
# Kokkos kernels (tensor, collectives, exec, lifecycle, nn, debug, the training example) run again there (tests at -Og, the example at -O1);
# MESHLIB_KOKKOS4_LEG=full runs every unit, compile-fail and MPI test there too (the
# package-consumer tests run only in the first leg). Without the snapshots the leg says it skipped. The
# exit status is non-zero when either leg failed; the last lines summarise both.
#
# And the CUDA compile check (MESHLIB_CUDA_CHECK=0 turns it off): meshlib's sources for device
# memory compiled with nvcc against Kokkos 4.7.01 configured for CUDA (scripts/cuda_compile_check.sh),
# reported last. It and the Kokkos 4.6.01 build run in the background beside the first leg's
# configure and build (their logs under $BUILD_DIR/_deps/logs), and finish before any test runs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SECONDS=0

"$repo_root/scripts/install_deps.sh"
elapsed "dependencies checked"

# Preparation beside the first leg's configure and build: Kokkos 4.6.01 for the Kokkos 4 leg
# (built once, cached by a stamp) and the CUDA compile check run in the background, each with its
# output in a log that is printed when it is waited for. Their configure steps are single-threaded,
# as is much of the first leg's configure: side by side they fill each other's idle core (issue 28:
# the cold test command within 30 minutes on 2 cores). Both are waited for before any test runs, so
# the tests never share the machine with them.
k4_prefix="$BUILD_DIR/_deps/kokkos-4.6.01"
prep_logs="$BUILD_DIR/_deps/logs"
mkdir -p "$prep_logs"
k4_prep_pid=""
if [ "${MESHLIB_KOKKOS4_LEG:-1}" != 0 ]; then
  setsid "$repo_root/scripts/build_kokkos4.sh" "$k4_prefix" >"$prep_logs/build_kokkos4.log" 2>&1 &
  k4_prep_pid=$!
fi
cuda_pid=""
if [ "${MESHLIB_CUDA_CHECK:-1}" != 0 ] && [ $# -eq 0 ]; then
  setsid "$repo_root/scripts/cuda_compile_check.sh" "$BUILD_DIR/_deps/kokkos-4.7.01-cuda" >"$prep_logs/cuda_compile_check.log" 2>&1 &
  cuda_pid=$!
fi

# A run that stops early (a failed configure under `set -e`, Ctrl-C) takes its background jobs with
# it, compilers included, rather than leaving them writing into the build directory: each was
# started by setsid as the leader of its own process group, which the trap ends.
trap 'for pid in $k4_prep_pid $cuda_pid; do kill -- "-$pid" 2>/dev/null || true; done' EXIT

configure
elapsed "configured"

# Keep going past a target that fails, so one broken test does not hide every other result.
keep_going=(-k)
if grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD_DIR/CMakeCache.txt"; then
  keep_going=(-k 0)
fi
build_status=0
cmake --build "$BUILD_DIR" -j "$JOBS" -- "${keep_going[@]}" || build_status=$?
if [ "$build_status" -ne 0 ]; then
  elapsed "build FAILED (status $build_status; errors above); running the tests that did build"
else
  elapsed "built"
fi

# The background preparation finishes before the tests start (their timeouts assume a machine of
# their own).
vendor_status=0
if [ -n "$k4_prep_pid" ]; then
  wait "$k4_prep_pid" || vendor_status=$?
  cat "$prep_logs/build_kokkos4.log"
fi
cuda_status=0
if [ -n "$cuda_pid" ]; then
  wait "$cuda_pid" || cuda_status=$?
fi
elapsed "background preparation done"

echo "== running the tests (-j $JOBS); total so far ${SECONDS}s"
test_status=0
# No rerun of failed tests: a test that fails once is a failure of the run (a flake must be
# fixed, not hidden). `cmake --build build --target stress_mpi` runs the MPI tests 50 times.
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" "$@") || test_status=$?
summary="== Kokkos $(kokkos_version_of "$BUILD_DIR") leg: tests $( [ "$test_status" -eq 0 ] && echo passed || echo FAILED)"
if [ "$build_status" -ne 0 ]; then
  # In an incremental build an old binary of a target that failed may have run above.
  summary="$summary; BUILD FAILED (status $build_status): the results above may include stale binaries"
fi
elapsed "first leg done"

k4_status=0
k4_summary="== Kokkos 4 leg: off (MESHLIB_KOKKOS4_LEG=0)"
if [ "${MESHLIB_KOKKOS4_LEG:-1}" != 0 ]; then
  k4_build="$BUILD_DIR/kokkos4"
  if [ "$vendor_status" -eq 3 ]; then
    k4_summary="== Kokkos 4 leg: SKIPPED (no Kokkos 4.6.01 snapshots in ${MESHLIB_VENDOR_DIR:-$repo_root/../shared/vendor})"
  elif [ "$vendor_status" -ne 0 ]; then
    k4_status=$vendor_status
    k4_summary="== Kokkos 4 leg: FAILED to build Kokkos 4.6.01 (status $vendor_status; see above)"
  else
    elapsed "Kokkos 4.6.01 ready"
    # No ThreadSanitizer copies (the first leg runs them); package consumers need an install, not Kokkos.
    # Benchmarks are not tests: the leg builds only what ctest runs.
    # -Og tests, -O1 example: this leg checks what compiles and computes against Kokkos 4, not speed
    # (the benchmarks say that); -O1 compiles the Kokkos 4 headers' templates about a quarter faster
    # than -O2, and GCC's -Og the tests' a further quarter to 40% (tests/CMakeLists.txt).
    # MESHLIB_TEST_FEWER_PAIRS: the reshard property test instantiates each spec once as source
    # and once as target instead of all pairs (test_reshard.cpp; the first leg runs them all).
    # MESHLIB_TEST_NN_PARTS=OFF: nn_unit without the sources of nn_remat_unit, nn_pipeline_unit,
    # nn_pipeline_more_unit and nn_overlap_tests (one binary with nn_unit in the first leg; this leg
    # runs nn_unit alone, and would compile them for nothing: two unity batches, over 120 CPU s).
    # MESHLIB_KOKKOS4_LEG=full builds and runs them.
    # MESHLIB_TEST_NN_KERNELS_ONLY=ON: of nn_unit, only the sources that check the kernels against
    # reference loops (tests/unit/nn/CMakeLists.txt says which; ~half its CPU time).
    k4_nn_parts=OFF
    k4_nn_kernels=ON
    if [ "${MESHLIB_KOKKOS4_LEG:-1}" = full ]; then k4_nn_parts=ON; k4_nn_kernels=OFF; fi
    BUILD_DIR="$k4_build" configure -DCMAKE_PREFIX_PATH="$k4_prefix" -DMESHLIB_SANITIZE_THREAD=OFF \
      -DMESHLIB_BUILD_BENCHMARKS=OFF -DCMAKE_CXX_FLAGS_RELEASE=-O1 \
      -DMESHLIB_TEST_FLAGS="-Og -DMESHLIB_TEST_FEWER_PAIRS=1" -DMESHLIB_TEST_NN_PARTS="$k4_nn_parts" \
      -DMESHLIB_TEST_NN_KERNELS_ONLY="$k4_nn_kernels" >/dev/null
    k4_build_status=0
    if [ "${MESHLIB_KOKKOS4_LEG:-1}" = full ]; then
      k4_targets=()
      k4_tests=()
    else
      # The default leg builds and runs what runs Kokkos kernels (tensors, collectives, exec, the
      # runtime's lifecycle, nn, debug, the training example end to end); comm, compile-fail,
      # package and MPI tests, the JAX parity tables and the smaller examples do not depend on the
      # Kokkos version beyond what these cover, and run in the first leg. Keeps the whole command
      # within budget on 2 cores (measured cold: 30.4 min with them, here); MESHLIB_KOKKOS4_LEG=full
      # builds and runs everything.
      k4_targets=(--target tensor_unit tensor_concurrency kokkos_threads collectives_tests exec_tests
                  runtime_kokkos_lifecycle_check nn_unit debug_tests train_fashion_mnist)
      k4_tests=(-R '^(tensor_unit|tensor_concurrency|kokkos_threads|collectives_tests|exec_tests|runtime_kokkos_lifecycle_check|nn_unit|debug_tests|example_train_fashion_mnist_.*)$')
    fi
    # Its own generator's keep-going flag (the first build directory may use another generator).
    k4_keep_going=(-k)
    if grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$k4_build/CMakeCache.txt"; then k4_keep_going=(-k 0); fi
    cmake --build "$k4_build" -j "$JOBS" "${k4_targets[@]}" -- "${k4_keep_going[@]}" || k4_build_status=$?
    elapsed "Kokkos 4 leg built (status $k4_build_status)"
    k4_test_status=0
    # OMP_PROC_BIND=false: what Kokkos asks for unit tests (and it silences its start-up warning).
    (cd "$k4_build" && OMP_PROC_BIND=false ctest --output-on-failure -j "$JOBS" -LE package "${k4_tests[@]}" "$@") || k4_test_status=$?
    k4_summary="== Kokkos $(kokkos_version_of "$k4_build") leg: tests $( [ "$k4_test_status" -eq 0 ] && echo passed || echo FAILED)"
    if [ "$k4_build_status" -ne 0 ]; then
      k4_summary="$k4_summary; BUILD FAILED (status $k4_build_status)"
      k4_status=$k4_build_status
    else
      k4_status=$k4_test_status
    fi
  fi
fi

# The CUDA compile check (scripts/cuda_compile_check.sh): Kokkos 4.7.01 configured for CUDA
# (headers only), meshlib's device-memory sources compiled with nvcc. Skipped when ctest arguments
# select tests, with MESHLIB_CUDA_CHECK=0, or without nvcc or the snapshot.
# It ran beside the first leg's build (above); here its result is reported.
cuda_summary="== CUDA compile check: off"
if [ -n "$cuda_pid" ]; then
  cat "$prep_logs/cuda_compile_check.log"
  case "$cuda_status" in
    0) cuda_summary="== CUDA compile check (Kokkos 4.7.01, nvcc, sm_90): passed" ;;
    3) cuda_summary="== CUDA compile check: SKIPPED (no nvcc or no Kokkos 4.7.01 snapshot)"; cuda_status=0 ;;
    *) cuda_summary="== CUDA compile check: FAILED" ;;
  esac
fi

elapsed "all done"
echo "$summary"
echo "$k4_summary"
echo "$cuda_summary"
if [ "$build_status" -ne 0 ]; then exit "$build_status"; fi
if [ "$test_status" -ne 0 ]; then exit "$test_status"; fi
if [ "$k4_status" -ne 0 ]; then exit "$k4_status"; fi
exit "$cuda_status"
