#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Installs what meshlib needs on Debian 12 (bookworm), and only what is missing: safe to run again.
# apt-get update runs only when something is missing; sudo is used only when not root.
set -euo pipefail

packages=(
  build-essential cmake python3            # compiler, build system, scripts/amalgamate.py
  ninja-build                              # the test command's generator (schedules the whole build as one graph)
  libtrilinos-kokkos-dev                   # Kokkos (required)
  libtrilinos-kokkos-kernels-dev libopenblas-dev  # Kokkos Kernels: KokkosBlas::gemm for matmul
  catch2                                   # tests
  libtbb-dev                               # oneTBB (optional; the data loader prefetches with it)
  zlib1g-dev                               # zlib: the IDX reader reads .gz data files
  dataset-fashion-mnist                    # Fashion-MNIST IDX files for the training flagship and its tests
  fortunes                                 # plain text (/usr/share/games/fortunes) for the language-model data tests
  openmpi-bin libopenmpi-dev               # MPI communicator (optional)
  python3-matplotlib                       # benchmark plots
  doxygen pkg-config python3-jsonschema    # packaging tests: API reference, pkg-config, vcpkg manifest schema
  python3-fasteners python3-jinja2 python3-requests python3-colorama python3-patch-ng  # Conan 2 from source (packaging test)
  clang-14                                 # compile-fail tests' second compiler (diagnostics read well on Clang too)
  libomp-14-dev                            # Clang's <omp.h>: its compile-fail tests against a Kokkos 4 built with OpenMP
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages are installed"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "install_deps: need root or sudo to install: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
