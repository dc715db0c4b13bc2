// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Built against meshlib::nccl only: <meshlib/nccl.hpp>, nccl.h, NCCL and CUDA's runtime must come
// with the component. Needs no GPU: it checks the NCCL communicator's types and NCCL's version,
// and, where a GPU is present, makes a one-rank communicator and all-reduces on it.
#include <meshlib/nccl.hpp>

#include <cstdio>

#if !defined(MESHLIB_ENABLE_NCCL) || MESHLIB_ENABLE_NCCL != 1
#error "meshlib::nccl must define MESHLIB_ENABLE_NCCL=1"
#endif

static_assert(meshlib::communicator<meshlib::nccl_communicator>);
static_assert(meshlib::nccl_datatype_of<meshlib::bfloat16> == ncclBfloat16);

int main() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version <= 0) {
    std::puts("meshlib nccl consumer: ncclGetVersion failed");
    return 1;
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0) {
    float* x = nullptr;
    if (cudaMalloc(&x, sizeof(float)) != cudaSuccess) return 1;
    const float one = 1.0f;
    cudaMemcpy(x, &one, sizeof(float), cudaMemcpyHostToDevice);
    {
      meshlib::nccl_communicator comm(meshlib::nccl_communicator::new_unique_id(), 1, 0, {.device = 0});
      comm.all_reduce(std::span(x, 1), meshlib::reduce_op::sum).wait();
    }
    float back = 0;
    cudaMemcpy(&back, x, sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(x);
    if (back != 1.0f) return 1;
  }
  std::printf("meshlib nccl consumer OK (NCCL %d, %d GPU(s))\n", version, gpus);
  return 0;
}
