#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# meshlib's GPU check: one script for a machine with an NVIDIA GPU (made for one H200 and 16 cores,
# under 9 minutes), which also runs without one and then says what it could not check.
#
#   scripts/gpu-check.sh [--no-build] [--no-kokkos] [--max-bytes 1G]
#
# Steps (each prints "== [Ns] step"; the end prints CHECKED / NOT CHECKED lines):
#   1. the GPUs (nvidia-smi) and the CUDA and NCCL versions;
#   2. builds meshlib's NCCL targets with the host compiler (nccl_host_tests, nccl_device_tests,
#      conformance_device, nccl_bench, and train_fashion_mnist for the CPU reference run) in $BUILD_DIR (default build-gpu/meshlib; BUILD_DIR=build
#      reuses the test build), and compiles <meshlib/nccl.hpp> with nvcc next to a kernel;
#   3. runs the host tests, then the device tests: every collective against host results on one
#      NCCL rank per GPU (one rank on one GPU), and on 1, 3 and 4 mesh devices sharing GPU 0; then
#      the comm conformance kit on device buffers (NCCL with one rank; 2 and 4 devices on GPU 0);
#   4. Kokkos 4.7.01 with CUDA (-DKokkos_ENABLE_CUDA=ON -DKokkos_ARCH_HOPPER90=ON; the first release
#      that builds with CUDA 13) from ../shared/vendor/kokkos-4.7.01.tar.gz (or $KOKKOS_TARBALL),
#      cached in build-gpu/kokkos-cuda-4.7 and built in the background from step 1 on half the
#      cores; with it tests/device/kokkos_cuda: a Kokkos kernel, an NCCL all_reduce and a second
#      kernel ordered by one execution-space instance's stream;
#   5. tests/cuda built with that Kokkos' nvcc_wrapper: gpu_collectives (every typed collective on
#      CudaSpace blocks through gpu_runner: shared-GPU devices on GPU 0, one NCCL rank, NCCL per GPU
#      with 2+ GPUs, default_runner) and the flagship with --gpu: 100 steps' losses against the CPU
#      run of the same seed (1e-4 relative), then a full run (accuracy, samples/s against the CPU
#      run on 2 cores);
#   6. nccl_bench: nccl-tests rows (bytes, time, algbw, busbw) of all_reduce, all_gather and
#      reduce_scatter from 8 B to --max-bytes (1 GiB), with raw NCCL and cudaMemcpy device-to-device
#      bandwidth in the same run, the wrapper overhead over ncclAllReduce at 8 B, and all_reduce
#      between 2 and 4 mesh devices sharing GPU 0 against the device-to-device copy bandwidth.
# Everything printed also goes to $GPU_REPORT (default $OUT/gpu-check.txt when $OUT is set, as on
# the device tool's machines, whose $OUT comes back; else build-gpu/gpu-check.txt), so a run on a
# lent machine brings its table and CHECKED / NOT CHECKED lines back.
# Exit status: 0 when everything that ran passed (skips included), 1 when something failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU_DIR="${GPU_DIR:-$repo/build-gpu}"
BUILD_DIR="${BUILD_DIR:-$GPU_DIR/meshlib}"
JOBS="${JOBS:-$(nproc)}"
MAX_BYTES=1G
DO_BUILD=1
DO_KOKKOS=1
if [ -n "${OUT:-}" ]; then GPU_REPORT="${GPU_REPORT:-$OUT/gpu-check.txt}"; else GPU_REPORT="${GPU_REPORT:-$GPU_DIR/gpu-check.txt}"; fi
mkdir -p "$(dirname "$GPU_REPORT")"
exec > >(tee "$GPU_REPORT") 2>&1
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
  echo "$out" | tail -n "${RUN_TAIL:-40}"
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

# Kokkos 4.7.01 with CUDA (the first release that builds with CUDA 13), cached in $GPU_DIR/kokkos-cuda-4.7:
# built in the background from here, on half the cores, while step 2 builds meshlib's targets.
kokkos_version=4.7.01
kokkos_prefix="$GPU_DIR/kokkos-cuda-4.7"
kokkos_pid=""
kokkos_skip=""
tarball="${KOKKOS_TARBALL:-}"
for t in "$repo/../shared/vendor/kokkos-$kokkos_version.tar.gz" "$repo/shared/vendor/kokkos-$kokkos_version.tar.gz" /work/shared/vendor/kokkos-$kokkos_version.tar.gz; do
  [ -z "$tarball" ] && [ -f "$t" ] && tarball="$t"
done
mkdir -p "$GPU_DIR"
if [ $DO_KOKKOS -eq 0 ]; then
  kokkos_skip="Kokkos CUDA (--no-kokkos)"
elif [ -z "$tarball" ]; then
  kokkos_skip="Kokkos CUDA: kokkos-$kokkos_version.tar.gz not found (set KOKKOS_TARBALL)"
elif ! command -v nvcc >/dev/null 2>&1; then
  kokkos_skip="Kokkos CUDA: nvcc not found"
elif [ ! -f "$kokkos_prefix/.built" ]; then
  (
    rm -rf "$GPU_DIR/kokkos-src" "$GPU_DIR/kokkos-build" && mkdir -p "$GPU_DIR/kokkos-src"
    tar xzf "$tarball" -C "$GPU_DIR/kokkos-src" --strip-components=1
    cmake -S "$GPU_DIR/kokkos-src" -B "$GPU_DIR/kokkos-build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_COMPILER="$GPU_DIR/kokkos-src/bin/nvcc_wrapper" -DCMAKE_CXX_STANDARD=20 \
      -DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_CUDA=ON -DKokkos_ARCH_HOPPER90=ON \
      -DKokkos_ENABLE_TESTS=OFF -DKokkos_ENABLE_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$kokkos_prefix" >"$GPU_DIR/kokkos-configure.log" 2>&1 &&
    cmake --build "$GPU_DIR/kokkos-build" -j "$(( (JOBS + 1) / 2 ))" >"$GPU_DIR/kokkos-build.log" 2>&1 &&
    cmake --install "$GPU_DIR/kokkos-build" >/dev/null 2>&1 && touch "$kokkos_prefix/.built"
  ) &
  kokkos_pid=$!
  echo "building Kokkos $kokkos_version with CUDA in the background (pid $kokkos_pid)"
fi

# ---- 2. build meshlib's NCCL targets -----------------------------------------------------------------
step "2. build meshlib's NCCL targets in $BUILD_DIR"
built=0
if [ $DO_BUILD -eq 1 ]; then
  if cmake -S "$repo" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O2 \
       -DMESHLIB_BUILD_TESTS=ON -DMESHLIB_BUILD_BENCHMARKS=ON -DMESHLIB_BUILD_EXAMPLES=ON \
       -DMESHLIB_SANITIZE_THREAD=OFF >"$GPU_DIR.configure.log" 2>&1; then
    grep -E 'CUDA \+ NCCL' "$GPU_DIR.configure.log"
    build_jobs=$JOBS
    [ -n "$kokkos_pid" ] && build_jobs=$(( JOBS / 2 > 0 ? JOBS / 2 : 1 ))  # the other half builds Kokkos
    if cmake --build "$BUILD_DIR" -j "$build_jobs" --target nccl_host_tests nccl_device_tests conformance_device nccl_bench train_fashion_mnist; then
      built=1; ok "build of nccl_host_tests, nccl_device_tests, conformance_device, nccl_bench, train_fashion_mnist"
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

# ---- 4. Kokkos 4.7.01 with CUDA (built in the background since step 1) ------------------------------
step "4. Kokkos $kokkos_version with CUDA, and the NCCL communicator on a Kokkos instance's stream"
kokkos_ok=0
if [ -n "$kokkos_pid" ]; then
  wait "$kokkos_pid" && kokkos_ok=1
  echo "Kokkos $kokkos_version CUDA build: $( [ $kokkos_ok -eq 1 ] && echo done || echo FAILED) (started in the background at step 1; logs in $GPU_DIR)"
elif [ -f "$kokkos_prefix/.built" ]; then
  kokkos_ok=1
fi
if [ -n "$kokkos_skip" ]; then
  skip "$kokkos_skip"
elif [ $kokkos_ok -eq 1 ]; then
  ok "Kokkos $kokkos_version with CUDA (Hopper) in $kokkos_prefix"
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
  tail -n 15 "$GPU_DIR/kokkos-configure.log" "$GPU_DIR/kokkos-build.log" 2>/dev/null
  fail "build of Kokkos $kokkos_version with CUDA (logs in $GPU_DIR)"
fi

# ---- 5. the typed collectives on CudaSpace through gpu_runner, and the flagship on the GPU mesh -------
step "5. gpu_runner: typed collectives on device memory, and the flagship on the GPU mesh"
programs="$GPU_DIR/gpu_programs"
programs_ok=0
if [ $kokkos_ok -eq 1 ]; then
  if cmake -S "$repo/tests/cuda" -B "$programs" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$kokkos_prefix" \
       -DCMAKE_CXX_COMPILER="$kokkos_prefix/bin/nvcc_wrapper" -DCMAKE_CXX_FLAGS=-arch=sm_90 >"$programs.configure.log" 2>&1 &&
     cmake --build "$programs" -j "$JOBS" >"$programs.build.log" 2>&1; then
    programs_ok=1; ok "tests/cuda (gpu_collectives, train_fashion_mnist_gpu) build with nvcc_wrapper against Kokkos CUDA"
  else
    tail -n 30 "$programs.configure.log" "$programs.build.log"; fail "build of tests/cuda against Kokkos CUDA (logs: $programs.*.log)"
  fi
else
  skip "tests/cuda programs: no Kokkos CUDA build"
fi
if [ $programs_ok -eq 1 ] && [ "$gpus" -gt 0 ]; then
  run_test "gpu_collectives: psum, all_gather, psum_scatter, ppermute, all_to_all, psum_start on CudaSpace blocks (shared-GPU on GPU 0; NCCL one rank; NCCL per GPU when 2+; default_runner) vs host expectations" \
    "$programs/gpu_collectives"
  # The flagship: the same seed and float32 on the CPU (this build's thread devices) and on the GPU
  # mesh, per-step losses compared (1e-4 relative), then the GPU's full run (accuracy, samples/s).
  cpu_bin="$BUILD_DIR/examples/train_fashion_mnist/train_fashion_mnist"
  gpu_bin="$programs/train_fashion_mnist_gpu"
  flag=(--mesh 1x1 --batch 256 --seed 0 --steps 100)
  if [ ! -x "$cpu_bin" ]; then
    skip "flagship CPU/GPU loss comparison: $cpu_bin not built"
  elif "$gpu_bin" "${flag[@]}" --gpu --loss-log "$GPU_DIR/loss_gpu.txt" >"$GPU_DIR/flagship_gpu_100.log" 2>&1; then
    # The CPU reference on 2 cores (the issue's baseline): samples/s from its last line.
    taskset -c 0,1 "$cpu_bin" "${flag[@]}" --loss-log "$GPU_DIR/loss_cpu.txt" >"$GPU_DIR/flagship_cpu_100.log" 2>&1
    worst=$(awk 'NR==FNR {c[$1]=$2; next} ($1 in c) {d=$2-c[$1]; if (d<0) d=-d; r=d/(c[$1]<0?-c[$1]:c[$1]); if (r>w) w=r; n++} END {printf "%.3g %d", w, n}' \
      "$GPU_DIR/loss_cpu.txt" "$GPU_DIR/loss_gpu.txt")
    echo "per-step losses, GPU vs CPU (100 steps, mesh 1x1, float32): largest relative difference, steps compared: $worst"
    if awk -v w="${worst% *}" -v n="${worst#* }" 'BEGIN {exit !(n == 100 && w <= 1e-4)}'; then
      ok "flagship --gpu: 100 per-step losses within 1e-4 relative of the CPU run ($worst)"
    else
      fail "flagship --gpu: per-step losses differ from the CPU run by more than 1e-4 relative, or steps are missing ($worst)"
    fi
    step "5b. the flagship on the GPU mesh, full run (6 epochs)"
    "$gpu_bin" --gpu --mesh 1x1 --seed 0 2>&1 | tail -n 8 | tee "$GPU_DIR/flagship_gpu_full.log"
    acc=$(sed -n 's/.*test accuracy \([0-9.]*\)%.*/\1/p' "$GPU_DIR/flagship_gpu_full.log" | tail -1)
    gpu_sps=$(sed -n 's/.*  \([0-9]*\) samples\/s.*/\1/p' "$GPU_DIR/flagship_gpu_full.log" | tail -1)
    cpu_sps=$(tr '\r' '\n' <"$GPU_DIR/flagship_cpu_100.log" | sed -n 's/.*  \([0-9]*\) samples\/s.*/\1/p' | tail -1)
    echo "| flagship | test accuracy | samples/s | vs 2-core CPU |"
    echo "| GPU mesh 1x1 | ${acc:-?}% | ${gpu_sps:-?} | $(awk -v g="${gpu_sps:-0}" -v c="${cpu_sps:-0}" 'BEGIN {if (c > 0) printf "%.1fx", g / c; else print "?"}') (CPU: ${cpu_sps:-?} samples/s) |"
    if awk -v a="${acc:-0}" 'BEGIN {exit !(a >= 88)}'; then ok "flagship --gpu: test accuracy ${acc}% (target 88%)"
    else fail "flagship --gpu: test accuracy ${acc:-none}% below 88% (log: $GPU_DIR/flagship_gpu_full.log)"; fi
  else
    tail -n 15 "$GPU_DIR/flagship_gpu_100.log"
    if grep -q "exists; install Debian's package dataset-fashion-mnist" "$GPU_DIR/flagship_gpu_100.log"; then
      skip "flagship on the GPU mesh: no Fashion-MNIST data on this machine (apt install dataset-fashion-mnist)"
    else
      fail "flagship --gpu run (log: $GPU_DIR/flagship_gpu_100.log)"
    fi
  fi
elif [ $programs_ok -eq 1 ]; then
  skip "gpu_collectives and the flagship on the GPU mesh: no CUDA device"
fi

# ---- 6. benchmark -----------------------------------------------------------------------------------------
step "6. nccl_bench: nccl-tests rows for all_reduce, all_gather, reduce_scatter (8 B .. $MAX_BYTES)"
if [ $built -eq 1 ] && [ -x "$BUILD_DIR/bench/nccl_bench" ]; then
  RUN_TAIL=1000 run_test "nccl_bench" "$BUILD_DIR/bench/nccl_bench" --max-bytes "$MAX_BYTES"  # the whole table
else
  # With --no-build a test build may hold the device tests but no benchmarks: not a failure.
  skip "nccl_bench (not built in $BUILD_DIR)"
fi

# ---- summary --------------------------------------------------------------------------------------------
step "summary (${SECONDS}s)"
for c in "${checked[@]}"; do echo "CHECKED: $c"; done
for c in "${not_checked[@]}"; do echo "NOT CHECKED: $c"; done
[ "$SECONDS" -gt 540 ] && echo "note: took ${SECONDS}s, over the 9-minute budget"
exit $failed
