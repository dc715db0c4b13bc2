# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Shared by run_tests.sh and run_example.sh (sourced, not run). Both use one build directory with
# the same settings, so running one after the other rebuilds nothing twice.
#
# BUILD_DIR   the build directory (default: build/ in the repository root)
# BUILD_TYPE  the CMake build type (default: Release, at -O2: quicker to compile than -O3, and
#             assertions stay on because tests rely on them). The test targets get -Og on top
#             (MESHLIB_TEST_FLAGS, tests/CMakeLists.txt): they check results, not speed.
# JOBS        parallel jobs (default: nproc)
#
# Benchmarks are on demand (MESHLIB_BENCHMARKS_ON_DEMAND): `cmake --build build --target <bench>`
# builds one; the tests only compile-check them.

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$repo_root/build}"
BUILD_TYPE="${BUILD_TYPE:-Release}"
JOBS="${JOBS:-$(nproc)}"

# Prints a label and the seconds since the script started.
elapsed() { echo "== $1 after ${SECONDS}s"; }

# A new build directory uses Ninja when it is installed (install_deps.sh installs it): one graph of
# every target, so both cores stay busy across targets, and a fast no-op rebuild (a test rebuilds
# meshlib_headers_alone). An existing build directory keeps its generator (CMake refuses a change),
# and a -G among the arguments wins.
configure() {
  local generator=(-G Ninja) arg
  if [ -f "$BUILD_DIR/CMakeCache.txt" ] || ! command -v ninja >/dev/null; then generator=(); fi
  for arg in "$@"; do
    if [[ "$arg" == -G* ]]; then generator=(); fi
  done
  cmake -S "$repo_root" -B "$BUILD_DIR" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DCMAKE_CXX_FLAGS_RELEASE="-O2" -DMESHLIB_TEST_FLAGS="-Og" \
    -DMESHLIB_BUILD_TESTS=ON -DMESHLIB_BUILD_EXAMPLES=ON -DMESHLIB_BUILD_BENCHMARKS=ON -DMESHLIB_BENCHMARKS_ON_DEMAND=ON \
    "$@"
}

# The Kokkos version a configured build directory uses, as its configure summary printed it.
kokkos_version_of() {
  sed -n 's/^MESHLIB_KOKKOS_VERSION:INTERNAL=//p' "$1/CMakeCache.txt" 2>/dev/null | head -1
}
