// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Main of the device tests: skips (exit code 77, CTest's SKIP_RETURN_CODE) with the reason when
// this machine has no CUDA device, else prints the NCCL library and headers it runs with (a wheel's
// libnccl.so.2 is often not the NCCL the program was compiled against) and runs the Catch2 session.
#if defined(MESHLIB_CATCH2_MAJOR) && MESHLIB_CATCH2_MAJOR >= 3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <cuda_runtime_api.h>

#include <meshlib/comm/nccl/nccl_version.hpp>

#include <cstdio>
#include <exception>

int main(int argc, char* argv[]) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device (cudaGetDeviceCount: %s: %s)\n", cudaGetErrorName(rc), cudaGetErrorString(rc));
    return 77;
  }
  std::printf("%d CUDA device(s)\n", count);
  try {
    const auto library = meshlib::nccl_version();
    std::printf("%s%s\n", meshlib::comm::detail::nccl_versions_text(library).c_str(),
                library < meshlib::nccl_min_version ? " (older than meshlib's minimum: NCCL tests will fail)" : "");
  } catch (const std::exception& e) {
    std::printf("%s\n", e.what());
  }
  return Catch::Session().run(argc, argv);
}
