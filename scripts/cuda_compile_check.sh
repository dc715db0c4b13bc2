#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# The CUDA compile check (issue 24): proves on a machine without a GPU that meshlib compiles for
# CUDA device memory, cheaply enough for every CI run. Kokkos 4.7.01 (the first release that builds
# with CUDA 13) is only *configured* for CUDA + Hopper (sm_90) through its nvcc_wrapper, which
# generates its configuration headers; it is not built (that took ~50 minutes here), because a
# compile check needs headers only. Then every source in tests/cuda/ is compiled (-c, not linked)
# against it with nvcc: the ones that must compile, and host_collective_on_device.cpp, which must
# fail with the message that names the backend to use, and host_view_on_device.cpp and
# host_tensor_into_layer.cpp, which must fail naming the argument whose memory the kernel cannot read. The NCCL ones (gpu_collectives.cpp: the
# typed collectives on CudaSpace blocks through gpu_runner over NCCL and the shared-GPU
# communicator; flagship_gpu.cpp: examples/train_fashion_mnist with its --gpu path) compile with
# -DMESHLIB_ENABLE_NCCL=1 when nccl.h is found next to nvcc (else they are reported as skipped).
#
# usage: cuda_compile_check.sh WORK_DIR [VENDOR_DIR]
#   WORK_DIR    where Kokkos is unpacked and configured (run_tests.sh: $BUILD_DIR/_deps/kokkos-4.7.01-cuda),
#               cached by a stamp: a second run with the same inputs only compiles.
#   VENDOR_DIR  folder holding kokkos-4.7.01.tar.gz (default: $MESHLIB_VENDOR_DIR, else ../shared/vendor)
# Exit status 0: all checks passed; 1: a check failed; 3: skipped (no nvcc or no snapshot).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:?usage: cuda_compile_check.sh WORK_DIR [VENDOR_DIR]}"
vendor="${2:-${MESHLIB_VENDOR_DIR:-$repo_root/../shared/vendor}}"
version=4.7.01
tgz="$vendor/kokkos-$version.tar.gz"

nvcc_bin="$(command -v nvcc || true)"
[ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc_bin" ]; then echo "cuda_compile_check.sh: SKIPPED: no nvcc (install the CUDA toolkit)"; exit 3; fi
if [ ! -f "$tgz" ]; then echo "cuda_compile_check.sh: SKIPPED: no kokkos-$version.tar.gz in '$vendor'"; exit 3; fi
export PATH="$(dirname "$nvcc_bin"):$PATH"

src="$work/kokkos-$version"
build="$work/build"
options=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=20 -DKokkos_ENABLE_CUDA=ON -DKokkos_ARCH_HOPPER90=ON
  -DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_TESTS=OFF -DKokkos_ENABLE_EXAMPLES=OFF)
stamp_text="kokkos $version $(sha256sum "$tgz" | cut -c1-16) ${options[*]}
nvcc $("$nvcc_bin" --version | tail -1)"
SECONDS=0
if [ ! -f "$work/stamp" ] || [ "$(cat "$work/stamp")" != "$stamp_text" ]; then
  rm -rf "$work"
  mkdir -p "$work"
  tar -xzf "$tgz" -C "$work"
  if ! cmake -S "$src" -B "$build" -DCMAKE_CXX_COMPILER="$src/bin/nvcc_wrapper" "${options[@]}" >"$work/configure.log" 2>&1; then
    echo "cuda_compile_check.sh: FAILED: configuring Kokkos $version for CUDA"; tail -n 30 "$work/configure.log"; exit 1
  fi
  echo "$stamp_text" >"$work/stamp"
  echo "cuda_compile_check.sh: Kokkos $version configured for CUDA (sm_90) in ${SECONDS}s (not built: headers only)"
fi

flags=(-std=c++20 -arch=sm_90 --expt-extended-lambda --expt-relaxed-constexpr -Wno-deprecated-gpu-targets
  -I"$build" -I"$src/core/src" -I"$build/core/src" -I"$src/containers/src" -I"$src/algorithms/src"
  -I"$src/simd/src" -I"$build/simd/src" -I"$src/tpls/desul/include" -I"$src/tpls/mdspan/include"
  -I"$repo_root/include")
status=0
cuda_include="$(dirname "$(dirname "$nvcc_bin")")/include"
nccl=0
[ -f "$cuda_include/nccl.h" ] || [ -f /usr/include/nccl.h ] && nccl=1
# matmul_into's products on CUDA memory go to cuBLAS where the toolkit has it (tensor/cublas_product.hpp),
# as meshlib's CMake target arranges for a Kokkos with CUDA.
cublas=()
[ -f "$cuda_include/cublas_v2.h" ] && cublas=(-DMESHLIB_ENABLE_CUBLAS=1 -I"$cuda_include")
if [ ${#cublas[@]} -gt 0 ]; then echo "  with cuBLAS: matmul_into's CUDA products (MESHLIB_ENABLE_CUBLAS=1)"
else echo "  without cuBLAS (no cublas_v2.h in $cuda_include): matmul_into's CUDA products use meshlib's kernel"; fi
compile() {  # compile NAME [CASE]: tests/cuda/NAME.cpp (-DMESHLIB_CASE=CASE) -> $work/NAME[CASE].o, output in .log
  local extra=("${cublas[@]}") out="$work/$1${2:-}"
  case "$1" in gpu_collectives | flagship_gpu) extra+=(-DMESHLIB_ENABLE_NCCL=1 -I"$cuda_include") ;; esac
  [ -n "${2:-}" ] && extra+=(-DMESHLIB_CASE="$2")
  "$src/bin/nvcc_wrapper" "${flags[@]}" "${extra[@]}" -c "$repo_root/tests/cuda/$1.cpp" -o "$out.o" >"$out.log" 2>&1 || return 1
  # A kernel calling a host-only function compiles with a warning only (#20011/#20014/#20015:
  # "calling a __host__ function from a __host__ __device__ function"), but cannot run on a GPU.
  if grep -E -m 5 'warning #200(11|14|15)-D' "$out.log"; then
    echo "  ^ a kernel calls a host-only function (mark it KOKKOS_INLINE_FUNCTION): tests/cuda/$1.cpp" >>"$out.log"
    echo "error: a kernel calls a host-only function" >>"$out.log"
    return 1
  fi
}
start=$SECONDS
# The ones that must compile run two at a time (one per core), the longest (the flagship) first;
# then the one that must not.
pairs=("device_arrays nn_layers" "autodiff")
if [ $nccl -eq 1 ]; then pairs=("flagship_gpu device_arrays" "gpu_collectives nn_layers" "autodiff")
else echo "  SKIPPED (no nccl.h in $cuda_include or /usr/include): tests/cuda/gpu_collectives.cpp, tests/cuda/flagship_gpu.cpp"; fi
for pair in "${pairs[@]}"; do
  jobs_=()
  for name in $pair; do compile "$name" & jobs_+=("$!:$name"); done
  for job in "${jobs_[@]}"; do
    if wait "${job%%:*}"; then echo "  compiles for CUDA: tests/cuda/${job#*:}.cpp"
    else echo "  FAILED to compile for CUDA: tests/cuda/${job#*:}.cpp"; grep -m 10 "error" "$work/${job#*:}.log" || tail -n 20 "$work/${job#*:}.log"; status=1; fi
  done
done
want="meshlib: the host collectives need host-accessible blocks; use the NCCL backend for device memory"
if compile host_collective_on_device; then
  echo "  FAILED: tests/cuda/host_collective_on_device.cpp compiled, but a host collective on device memory must not"; status=1
elif grep -qF "$want" "$work/host_collective_on_device.log"; then
  echo "  refused as it must: tests/cuda/host_collective_on_device.cpp (\"$want\")"
else
  echo "  FAILED: tests/cuda/host_collective_on_device.cpp failed without the expected message:"; grep -m 10 "error" "$work/host_collective_on_device.log"; status=1
fi
# The compile-time half of "a host pointer never reaches a device kernel" (tensor/pointer_check.hpp):
# one error that names the call, the argument and device_put.
want="meshlib: an argument's memory space cannot be read by the execution space its kernel runs on"
if compile host_view_on_device; then
  echo "  FAILED: tests/cuda/host_view_on_device.cpp compiled, but a host view in a CUDA kernel must not"; status=1
elif grep -qF "$want" "$work/host_view_on_device.log" && grep -qF "op<'A'>" "$work/host_view_on_device.log" &&
     grep -qF "device_put" "$work/host_view_on_device.log"; then
  echo "  refused as it must: tests/cuda/host_view_on_device.cpp (\"$want\", argument 'A')"
else
  echo "  FAILED: tests/cuda/host_view_on_device.cpp failed without the expected message naming argument 'A':"; grep -m 10 "error" "$work/host_view_on_device.log"; status=1
fi
# The same for the entries above matmul_into: a layer, an elementwise op and the loss, each handed a
# host block (one case per compile: nvcc's front end reports only the first instantiation errors).
for case_ in "1 op<'x'>" "2 op<'b'>" "3 op<'l', 'o', 'g', 'i', 't', 's'>"; do
  n=${case_%% *} arg=${case_#* }
  log="$work/host_tensor_into_layer$n.log"
  if compile host_tensor_into_layer "$n"; then
    echo "  FAILED: tests/cuda/host_tensor_into_layer.cpp case $n compiled, but a host block into a GPU kernel must not"; status=1
  elif [ "$(grep -c "error" "$log")" -le 2 ] && grep -qF "$want" "$log" && grep -qF "$arg" "$log" && grep -qF "device_put" "$log"; then
    echo "  refused as it must: tests/cuda/host_tensor_into_layer.cpp case $n (one error, argument $arg)"
  else
    echo "  FAILED: tests/cuda/host_tensor_into_layer.cpp case $n failed without one error naming $arg:"; grep -m 10 "error" "$log"; status=1
  fi
done
echo "cuda_compile_check.sh: $([ $status -eq 0 ] && echo passed || echo FAILED) (compiles: $((SECONDS - start))s, all: ${SECONDS}s)"
exit $status
