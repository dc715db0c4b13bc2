#!/usr/bin/env bash
# Installs what is missing, builds meshlib's tests (Release, -O2) in build/ and runs them all.
# The last lines are ctest's summary ("100% tests passed, 0 tests failed out of N"); the exit
# status is ctest's. Extra arguments go to ctest (e.g. -L package, -R mesh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SECONDS=0

"$repo_root/scripts/install_deps.sh"
elapsed "dependencies checked"

configure
elapsed "configured"

cmake --build "$BUILD_DIR" -j "$JOBS"
elapsed "built"

cd "$BUILD_DIR"
echo "== running the tests (-j $JOBS); total so far ${SECONDS}s"
exec ctest --output-on-failure -j "$JOBS" "$@"
