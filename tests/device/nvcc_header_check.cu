// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// <meshlib/nccl.hpp> compiled by nvcc, next to a kernel and CUDA's half type: programs whose own
// kernels are in .cu files include meshlib there too. Compiled (not run) by the CTest nvcc_header_check
// and by scripts/gpu-check.sh.
#include <cuda_fp16.h>

#include <meshlib/nccl.hpp>

__global__ void scale(float* x, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) x[i] *= 2.0f;
}

static_assert(meshlib::communicator<meshlib::nccl_communicator>);
static_assert(meshlib::communicator<meshlib::shared_gpu_communicator>);
static_assert(meshlib::nccl_datatype_of<__half> == ncclFloat16);

int main() { return meshlib::cuda_stream_ref{}.given() ? 1 : 0; }
