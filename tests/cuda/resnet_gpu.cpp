// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// examples/train_resnet_fashion_mnist built for CUDA (its --gpu path: gpu_runner, every block in
// CudaSpace): scripts/gpu-check.sh --bundle builds it and --run compares its losses with the CPU run.
#include <meshlib.hpp>
#include <meshlib/nccl.hpp>

static_assert(MESHLIB_HAS_GPU_RUNNER == 1, "the flagship's GPU path needs NCCL and Kokkos CUDA");

#include "../../examples/train_resnet_fashion_mnist/train_resnet_fashion_mnist.cpp"
