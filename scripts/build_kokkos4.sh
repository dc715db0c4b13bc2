#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Builds and installs Kokkos 4.6.01 (Serial + OpenMP) and Kokkos Kernels 4.6.01 (BLAS component,
# OpenBLAS TPL) from local release snapshots into a prefix, once: a stamp file in the prefix records
# what was built, and a second run with the same inputs does nothing. run_tests.sh uses it for its
# Kokkos 4 leg; a user builds Kokkos 4 however they like (docs/getting-started.md) and never needs
# this script.
#
# usage: build_kokkos4.sh PREFIX [VENDOR_DIR]
#   PREFIX      install prefix (run_tests.sh: $BUILD_DIR/_deps/kokkos-4.6.01)
#   VENDOR_DIR  folder holding kokkos-4.6.01.tar.gz and kokkos-kernels-4.6.01.tar.gz
#               (default: $MESHLIB_VENDOR_DIR, else ../shared/vendor next to the repository)
# Exit status 0: the prefix holds both packages. 3: the snapshots are not there (nothing built).
# JOBS sets the parallel build jobs (default: nproc).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${1:?usage: build_kokkos4.sh PREFIX [VENDOR_DIR]}"
vendor="${2:-${MESHLIB_VENDOR_DIR:-$repo_root/../shared/vendor}}"
jobs="${JOBS:-$(nproc)}"
version=4.6.01
kokkos_tgz="$vendor/kokkos-$version.tar.gz"
kernels_tgz="$vendor/kokkos-kernels-$version.tar.gz"

if [ ! -f "$kokkos_tgz" ] || [ ! -f "$kernels_tgz" ]; then
  echo "build_kokkos4.sh: no Kokkos $version snapshots in '$vendor' (need kokkos-$version.tar.gz and kokkos-kernels-$version.tar.gz)"
  exit 3
fi

# What the stamp records: the inputs that change the result. A changed option rebuilds.
kokkos_options=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=20 -DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_OPENMP=ON
  -DKokkos_ENABLE_TESTS=OFF -DKokkos_ENABLE_EXAMPLES=OFF -DKokkos_ENABLE_DEPRECATED_CODE_4=OFF)
# Only the BLAS component with the OpenBLAS TPL, and no explicit instantiation (ETI): gemm of
# float/double on host memory goes to the TPL (cblas_sgemm/dgemm), whose wrappers are headers, so
# the pre-instantiated kernels would only cost build time (all of them: ~12 minutes on 2 cores).
kernels_options=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=20 -DKokkosKernels_ENABLE_ALL_COMPONENTS=OFF
  -DKokkosKernels_ENABLE_COMPONENT_BLAS=ON -DKokkosKernels_ENABLE_TPL_BLAS=ON
  -DKokkosKernels_INST_FLOAT=OFF -DKokkosKernels_INST_DOUBLE=OFF
  -DKokkosKernels_INST_LAYOUTLEFT=OFF -DKokkosKernels_INST_LAYOUTRIGHT=OFF
  -DKokkosKernels_ENABLE_TESTS=OFF -DKokkosKernels_ENABLE_EXAMPLES=OFF -DKokkosKernels_ENABLE_PERFTESTS=OFF)
stamp_text="kokkos $version $(sha256sum "$kokkos_tgz" | cut -c1-16) ${kokkos_options[*]}
kokkos-kernels $version $(sha256sum "$kernels_tgz" | cut -c1-16) ${kernels_options[*]}
compiler $(${CXX:-c++} --version | head -1)"
stamp="$prefix/meshlib-kokkos4.stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ]; then
  echo "build_kokkos4.sh: Kokkos $version already installed in $prefix (stamp matches)"
  exit 0
fi

# Runs a step with its output in LOG; on failure shows the end of LOG and stops.
step() {
  local log="$1"; shift
  if ! "$@" >"$log" 2>&1; then
    echo "build_kokkos4.sh: FAILED: $*"; tail -n 40 "$log"; exit 1
  fi
}

work="$prefix.build"
rm -rf "$work" "$prefix"
mkdir -p "$work"
SECONDS=0
tar -xzf "$kokkos_tgz" -C "$work"
tar -xzf "$kernels_tgz" -C "$work"
step "$work/kokkos-configure.log" cmake -S "$work/kokkos-$version" -B "$work/kokkos-build" -DCMAKE_INSTALL_PREFIX="$prefix" "${kokkos_options[@]}"
step "$work/kokkos-build.log" cmake --build "$work/kokkos-build" -j "$jobs"
step "$work/kokkos-install.log" cmake --install "$work/kokkos-build"
echo "build_kokkos4.sh: Kokkos $version built and installed in ${SECONDS}s"
step "$work/kernels-configure.log" cmake -S "$work/kokkos-kernels-$version" -B "$work/kernels-build" \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DKokkos_ROOT="$prefix" "${kernels_options[@]}"
step "$work/kernels-build.log" cmake --build "$work/kernels-build" -j "$jobs"
step "$work/kernels-install.log" cmake --install "$work/kernels-build"
echo "build_kokkos4.sh: Kokkos Kernels $version built and installed; ${SECONDS}s in all"
rm -rf "$work"
printf '%s\n' "$stamp_text" >"$prefix/meshlib-kokkos4.stamp"
