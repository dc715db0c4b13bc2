// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Built against meshlib::nccl only: nccl.h, NCCL and CUDA's runtime must come with the component.
// ncclGetVersion needs no GPU, so this runs on a machine without one.
#include <nccl.h>

#include <meshlib/core.hpp>  // not the whole umbrella: this checks what the component brings
#if __has_include(<meshlib/nccl.hpp>)
#include <meshlib/nccl.hpp>
#endif

#include <cstdio>

#if !defined(MESHLIB_ENABLE_NCCL) || MESHLIB_ENABLE_NCCL != 1
#error "meshlib::nccl must define MESHLIB_ENABLE_NCCL=1"
#endif

int main() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version <= 0) {
    std::puts("meshlib nccl consumer: ncclGetVersion failed");
    return 1;
  }
  std::printf("meshlib nccl consumer OK (NCCL %d)\n", version);
  return 0;
}
