// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Must NOT compile (scripts/cuda_compile_check.sh checks the message): a product on a CUDA
// execution-space instance whose operand A is host memory. The kernel would read a host address
// on the GPU (the first H200 run's cudaErrorIllegalAddress); meshlib refuses it at compile time,
// naming the call and the argument (diagnostic::op<'m', 'a', ...>, diagnostic::op<'A'>) and the fix.
#include <meshlib/tensor.hpp>

void product_with_a_host_operand() {
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::CudaSpace> c("c", 2, 2), b("b", 2, 2);
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> a("a", 2, 2);
  meshlib::matmul_into(Kokkos::Cuda(), c, a, b);
}
