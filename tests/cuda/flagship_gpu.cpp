// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): the flagship, examples/train_fashion_mnist,
// with its GPU path (`--gpu`: gpu_runner, every parameter, activation and gradient in CudaSpace,
// the gradient psum over NCCL or the shared-GPU communicator) compiled by nvcc for sm_90 against
// Kokkos CUDA with NCCL. scripts/gpu-check.sh builds the example itself on a GPU machine and runs
// it against the CPU run.
#include <meshlib.hpp>
#include <meshlib/nccl.hpp>

static_assert(MESHLIB_HAS_GPU_RUNNER == 1, "the flagship's GPU path needs NCCL and Kokkos CUDA");

#include "../../examples/train_fashion_mnist/train_fashion_mnist.cpp"
