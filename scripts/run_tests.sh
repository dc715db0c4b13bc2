#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Installs what is missing, builds meshlib's tests (Release, -O2) in build/ and runs them all.
# The last lines are ctest's summary ("100% tests passed, 0 tests failed out of N"); the exit
# status is ctest's. When a target fails to build, the build keeps going, ctest runs what was
# built (a test whose binary is missing counts as failed), a last line says the build failed, and
# the exit status is non-zero. Extra arguments go to ctest (e.g. -L package, -R mesh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SECONDS=0

"$repo_root/scripts/install_deps.sh"
elapsed "dependencies checked"

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

cd "$BUILD_DIR"
echo "== running the tests (-j $JOBS); total so far ${SECONDS}s"
test_status=0
ctest --output-on-failure -j "$JOBS" "$@" || test_status=$?
if [ "$build_status" -ne 0 ]; then
  # In an incremental build an old binary of a target that failed may have run above.
  echo "== BUILD FAILED (status $build_status): the results above may include stale binaries"
  exit "$build_status"
fi
exit "$test_status"
