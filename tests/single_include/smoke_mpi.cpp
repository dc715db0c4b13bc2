// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The single header with MESHLIB_ENABLE_MPI=1: its MPI part (the inlined <meshlib/mpi.hpp>) must
// compile and be there, and meshlib::config must say so. Runs without a launcher (no MPI_Init).
#include <meshlib.hpp>

#include <cstdio>
#include <type_traits>

#ifndef MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
#error "this must be the generated single header, not include/meshlib.hpp"
#endif
static_assert(meshlib::config::mpi, "MESHLIB_ENABLE_MPI=1 must show in meshlib::config");
static_assert(std::is_class_v<meshlib::mpi_communicator>, "the MPI communicator must be in the single header");
static_assert(std::is_class_v<meshlib::hybrid_communicator>, "the hybrid communicator must be in the single header");

int main() {
  std::printf("single header with MPI OK (meshlib %s, matmul: %s)\n", meshlib::config::version.data(),
              meshlib::config::matmul_kernel.data());
  return 0;
}
