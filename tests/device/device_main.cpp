// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Main of the device tests: skips (exit code 77, CTest's SKIP_RETURN_CODE) with the reason when
// this machine has no CUDA device, else runs the Catch2 session.
#if defined(MESHLIB_CATCH2_MAJOR) && MESHLIB_CATCH2_MAJOR >= 3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device (cudaGetDeviceCount: %s: %s)\n", cudaGetErrorName(rc), cudaGetErrorString(rc));
    return 77;
  }
  std::printf("%d CUDA device(s)\n", count);
  return Catch::Session().run(argc, argv);
}
