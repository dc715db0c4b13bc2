#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# meshlib's GPU check: one script for a machine with an NVIDIA GPU (made for one H200 and 16 cores,
# under 8 minutes), which also runs without one and then says what it could not check.
#
#   scripts/gpu-check.sh [--no-build] [--no-kokkos] [--max-bytes 1G]
#
# Steps (each prints "== [Ns] step"; the end prints CHECKED / NOT CHECKED lines):
#   1. the GPUs (nvidia-smi) and the CUDA and NCCL versions;
#   2. builds meshlib's NCCL targets with the host compiler (nccl_host_tests, nccl_device_tests,
#      conformance_device, nccl_bench) in $BUILD_DIR (default build-gpu/meshlib; BUILD_DIR=build
#      reuses the test build), and compiles <meshlib/nccl.hpp> with nvcc next to a kernel;
#   3. runs the host tests, then the device tests: every collective against host results on one
#      NCCL rank per GPU (one rank on one GPU), and on 1, 3 and 4 mesh devices sharing GPU 0; then
#      the comm conformance kit on device buffers (NCCL with one rank; 2 and 4 devices on GPU 0);
#   4. builds Kokkos 4.6.01 with CUDA (-DKokkos_ENABLE_CUDA=ON -DKokkos_ARCH_HOPPER90=ON) from
#      ../shared/vendor/kokkos-4.6.01.tar.gz (or $KOKKOS_TARBALL), cached in build-gpu/kokkos-cuda,
#      and with it tests/device/kokkos_cuda: a Kokkos kernel, an NCCL all_reduce and a second kernel
#      ordered by one execution-space instance's stream;
#   5. the flagship training example on the GPU mesh, where it can run there;
#   6. nccl_bench: nccl-tests rows (bytes, time, algbw, busbw) of all_reduce, all_gather and
#      reduce_scatter from 8 B to --max-bytes (1 GiB), with raw NCCL and cudaMemcpy device-to-device
#      bandwidth in the same run, the wrapper overhead over ncclAllReduce at 8 B, and all_reduce
#      between 2 and 4 mesh devices sharing GPU 0 against the device-to-device copy bandwidth.
# Exit status: 0 when everything that ran passed (skips included), 1 when something failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU_DIR="${GPU_DIR:-$repo/build-gpu}"
BUILD_DIR="${BUILD_DIR:-$GPU_DIR/meshlib}"
JOBS="${JOBS:-$(nproc)}"
MAX_BYTES=1G
DO_BUILD=1
DO_KOKKOS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) DO_BUILD=0 ;;
    --no-kokkos) DO_KOKKOS=0 ;;
    --max-bytes) MAX_BYTES="$2"; shift ;;
    *) echo "usage: $0 [--no-build] [--no-kokkos] [--max-bytes 1G]" >&2; exit 2 ;;
  esac
  shift
done

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
checked=()
not_checked=()
failed=0
step() { echo; echo "== [${SECONDS}s] $*"; }
ok() { checked+=("$1"); echo "-- OK: $1"; }
skip() { not_checked+=("$1"); echo "-- NOT CHECKED: $1"; }
fail() { checked+=("FAILED: $1"); failed=1; echo "-- FAILED: $1"; }
# Runs a test program: exit 0 passes, 77 is a skip (its first line says why), anything else fails.
run_test() {
  local what="$1"; shift
  local out rc
  out="$("$@" 2>&1)"; rc=$?
  echo "$out" | tail -n 40
  case $rc in
    0) ok "$what" ;;
    77) skip "$what: $(echo "$out" | grep -m1 '^SKIP' || echo skipped)" ;;
    *) fail "$what (exit $rc)" ;;
  esac
}

# ---- 1. the machine --------------------------------------------------------------------------------
step "1. GPUs, CUDA and NCCL"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  gpus=$(nvidia-smi -L | grep -c '^GPU')
else
  echo "no GPU: nvidia-smi is missing or finds no device (the run steps will skip with 'no CUDA device')"
fi
cuda_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9]*\).*/\1/p')
echo "nvcc: ${cuda_version:-not found} ($CUDA_HOME); nproc: $(nproc)"
grep -m3 -E '#define NCCL_(MAJOR|MINOR|PATCH)' "$CUDA_HOME/include/nccl.h" 2>/dev/null | awk '{printf "%s=%s ", $2, $3} END {print ""}'

# ---- 2. build meshlib's NCCL targets -----------------------------------------------------------------
step "2. build meshlib's NCCL targets in $BUILD_DIR"
built=0
if [ $DO_BUILD -eq 1 ]; then
  if cmake -S "$repo" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O2 \
       -DMESHLIB_BUILD_TESTS=ON -DMESHLIB_BUILD_BENCHMARKS=ON -DMESHLIB_BUILD_EXAMPLES=ON \
       -DMESHLIB_SANITIZE_THREAD=OFF >"$GPU_DIR.configure.log" 2>&1; then
    grep -E 'CUDA \+ NCCL' "$GPU_DIR.configure.log"
    if cmake --build "$BUILD_DIR" -j "$JOBS" --target nccl_host_tests nccl_device_tests conformance_device nccl_bench; then
      built=1; ok "build of nccl_host_tests, nccl_device_tests, conformance_device, nccl_bench"
    else
      fail "build of the NCCL targets"
    fi
  else
    tail -n 20 "$GPU_DIR.configure.log"
    fail "configure (CMake needs Kokkos, Catch2 and CUDA+NCCL: scripts/install_deps.sh)"
  fi
else
  [ -x "$BUILD_DIR/tests/device/nccl_device_tests" ] && built=1
  echo "--no-build: using $BUILD_DIR"
fi
mkdir -p "$GPU_DIR"

step "2b. nvcc compiles <meshlib/nccl.hpp> with a kernel (tests/device/nvcc_header_check.cu)"
if command -v nvcc >/dev/null 2>&1; then
  if nvcc -std=c++20 -arch=sm_90 -DMESHLIB_ENABLE_NCCL=1 -I"$repo/include" -c "$repo/tests/device/nvcc_header_check.cu" \
       -o "$GPU_DIR/nvcc_header_check.o"; then
    ok "nvcc -std=c++20 -arch=sm_90 compiles <meshlib/nccl.hpp>"
  else
    fail "nvcc compile of <meshlib/nccl.hpp>"
  fi
else
  skip "nvcc compile of <meshlib/nccl.hpp>: nvcc not found"
fi

# ---- 3. tests ------------------------------------------------------------------------------------------
step "3. NCCL tests"
if [ $built -eq 1 ]; then
  run_test "nccl_host_tests (mapping, errors, request state machine, argument checks)" \
    "$BUILD_DIR/tests/unit/nccl/nccl_host_tests"
  run_test "nccl_device_tests [nccl]: every collective vs host results on $gpus NCCL rank(s), one per GPU; stream ordering; errors" \
    "$BUILD_DIR/tests/device/nccl_device_tests" "[nccl]"
  run_test "nccl_device_tests [shared_gpu]: 1, 3 and 4 mesh devices on GPU 0 (copies + NVRTC reduction kernel), bitwise vs the thread communicator, mismatch, send/recv" \
    "$BUILD_DIR/tests/device/nccl_device_tests" "[shared_gpu]"
  if [ -x "$BUILD_DIR/tests/conformance/conformance_device" ]; then
    run_test "conformance_device: the comm conformance kit's value and argument rows on device buffers, NCCL with 1 rank and 2 and 4 mesh devices on GPU 0" \
      "$BUILD_DIR/tests/conformance/conformance_device"
  else
    skip "conformance_device (not built in $BUILD_DIR)"
  fi
else
  skip "NCCL tests (not built)"
fi
if [ "$gpus" -lt 2 ]; then
  skip "several NCCL ranks (processes or threads on different GPUs): this machine has $gpus GPU(s); NCCL refuses two ranks on one GPU"
fi
skip "the conformance kit's mismatch, throw, timing and departure rows on the device communicators: their expected words are the host backends' (tests/conformance/test_conformance_device.cpp says why); nccl_device_tests checks the device messages"

# ---- 4. Kokkos 4.6 with CUDA ---------------------------------------------------------------------------
step "4. Kokkos 4.6.01 with CUDA, and the NCCL communicator on a Kokkos instance's stream"
kokkos_prefix="$GPU_DIR/kokkos-cuda"
tarball="${KOKKOS_TARBALL:-}"
for t in "$repo/../shared/vendor/kokkos-4.6.01.tar.gz" "$repo/shared/vendor/kokkos-4.6.01.tar.gz" /work/shared/vendor/kokkos-4.6.01.tar.gz; do
  [ -z "$tarball" ] && [ -f "$t" ] && tarball="$t"
done
cuda_major=${cuda_version%%.*}
if [ $DO_KOKKOS -eq 0 ]; then
  skip "Kokkos CUDA (--no-kokkos)"
elif [ -z "$tarball" ]; then
  skip "Kokkos CUDA: kokkos-4.6.01.tar.gz not found (set KOKKOS_TARBALL)"
elif [ -n "$cuda_major" ] && [ "$cuda_major" -ge 13 ] && [ -z "${KOKKOS_FORCE:-}" ]; then
  # Checked on the build machine: Kokkos 4.6.01's Cuda/Kokkos_Cuda_Instance.hpp calls
  # cudaGraphAddDependencies and cudaMemAdvise with their CUDA 12 signatures, which CUDA 13 changed
  # (fixed upstream after 4.6: kokkos/kokkos#8298). KOKKOS_FORCE=1 tries anyway.
  skip "Kokkos 4.6.01 with CUDA: nvcc $cuda_version is CUDA 13+, which Kokkos 4.6.01 does not compile with (kokkos/kokkos#8298); use a CUDA 12 toolkit (CUDA_HOME=/usr/local/cuda-12.x) or a newer Kokkos"
else
  if [ ! -f "$kokkos_prefix/.built" ]; then
    rm -rf "$GPU_DIR/kokkos-src" "$GPU_DIR/kokkos-build" && mkdir -p "$GPU_DIR/kokkos-src"
    tar xzf "$tarball" -C "$GPU_DIR/kokkos-src" --strip-components=1
    # nvcc_wrapper defaults to sm_70, which CUDA 13 dropped: the architecture is given explicitly.
    if cmake -S "$GPU_DIR/kokkos-src" -B "$GPU_DIR/kokkos-build" -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CXX_COMPILER="$GPU_DIR/kokkos-src/bin/nvcc_wrapper" -DCMAKE_CXX_FLAGS=-arch=sm_90 \
         -DCMAKE_CXX_STANDARD=20 -DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_CUDA=ON -DKokkos_ARCH_HOPPER90=ON \
         -DKokkos_ENABLE_TESTS=OFF -DCMAKE_INSTALL_PREFIX="$kokkos_prefix" >"$GPU_DIR/kokkos-configure.log" 2>&1 &&
       cmake --build "$GPU_DIR/kokkos-build" -j "$JOBS" >"$GPU_DIR/kokkos-build.log" 2>&1 &&
       cmake --install "$GPU_DIR/kokkos-build" >/dev/null 2>&1; then
      touch "$kokkos_prefix/.built"
    else
      tail -n 15 "$GPU_DIR/kokkos-configure.log" "$GPU_DIR/kokkos-build.log" 2>/dev/null
    fi
  fi
  if [ -f "$kokkos_prefix/.built" ]; then
    ok "Kokkos 4.6.01 with CUDA (Hopper) in $kokkos_prefix"
    if cmake -S "$repo/tests/device/kokkos_cuda" -B "$GPU_DIR/kokkos_cuda_nccl" -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_PREFIX_PATH="$kokkos_prefix" -DCMAKE_CXX_COMPILER="$kokkos_prefix/bin/nvcc_wrapper" \
         -DCMAKE_CXX_FLAGS=-arch=sm_90 >/dev/null &&
       cmake --build "$GPU_DIR/kokkos_cuda_nccl" -j "$JOBS"; then
      if [ "$gpus" -gt 0 ]; then
        run_test "Kokkos kernel -> NCCL all_reduce -> Kokkos kernel on one instance's stream" "$GPU_DIR/kokkos_cuda_nccl/kokkos_cuda_nccl"
      else
        ok "tests/device/kokkos_cuda builds with nvcc_wrapper"; skip "running it: no CUDA device"
      fi
    else
      fail "build of tests/device/kokkos_cuda against Kokkos CUDA"
    fi
  else
    fail "build of Kokkos 4.6.01 with CUDA (logs in $GPU_DIR)"
  fi
fi

# ---- 5. the flagship example ------------------------------------------------------------------------
step "5. the flagship training example on the GPU mesh"
if [ -d "$repo/examples/train_fashion_mnist" ]; then
  skip "examples/train_fashion_mnist on the GPU mesh: the example trains on the thread communicator with host Kokkos views; running it on GPUs needs the exec layer's GPU runner (device tensors in Kokkos CUDA views, NCCL between devices), which does not exist yet"
else
  skip "the flagship training example: examples/train_fashion_mnist is not in this checkout"
fi

# ---- 6. benchmark -----------------------------------------------------------------------------------------
step "6. nccl_bench: nccl-tests rows for all_reduce, all_gather, reduce_scatter (8 B .. $MAX_BYTES)"
if [ $built -eq 1 ] && [ -x "$BUILD_DIR/bench/nccl_bench" ]; then
  run_test "nccl_bench" "$BUILD_DIR/bench/nccl_bench" --max-bytes "$MAX_BYTES"
else
  # With --no-build a test build may hold the device tests but no benchmarks: not a failure.
  skip "nccl_bench (not built in $BUILD_DIR)"
fi

# ---- summary --------------------------------------------------------------------------------------------
step "summary (${SECONDS}s)"
for c in "${checked[@]}"; do echo "CHECKED: $c"; done
for c in "${not_checked[@]}"; do echo "NOT CHECKED: $c"; done
[ "$SECONDS" -gt 480 ] && echo "note: took ${SECONDS}s, over the 8-minute budget"
exit $failed
