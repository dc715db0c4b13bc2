// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Kernels and collectives ordered by one stream, with no host synchronisation in between: a Kokkos
// kernel fills x on an execution-space instance, the NCCL communicator bound to that instance's
// stream all-reduces x into y, a second kernel doubles y. If the collective were not ordered after
// the first kernel, or the second kernel not after the collective, y would not be 2 * i.
// Prints "kokkos cuda nccl OK" and exits 0, or names the first wrong element and exits 1.
#include <Kokkos_Core.hpp>

#include <meshlib/nccl.hpp>

#include <cstdio>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard guard(argc, argv);
  static_assert(std::is_same_v<Kokkos::DefaultExecutionSpace, Kokkos::Cuda>, "Kokkos must have CUDA as its default");
  auto instances = Kokkos::Experimental::partition_space(Kokkos::Cuda(), 1);
  const Kokkos::Cuda exec = instances[0];
  const int n = 1 << 22;
  int bad = -1;
  {
    meshlib::nccl_comm_options options;
    options.device = exec.cuda_device();
    options.stream = exec;  // the communicator enqueues on the instance's stream
    meshlib::nccl_communicator comm(meshlib::nccl_communicator::new_unique_id(), 1, 0, options);
    if (comm.stream() != exec.cuda_stream()) {
      std::puts("kokkos cuda nccl: the communicator is not bound to the instance's stream");
      return 1;
    }
    Kokkos::View<float*, Kokkos::CudaSpace> x("x", n), y("y", n);
    Kokkos::parallel_for("fill", Kokkos::RangePolicy<Kokkos::Cuda>(exec, 0, n), KOKKOS_LAMBDA(int i) { x(i) = float(i % 4096); });
    auto req = comm.all_reduce(std::span<const float>(x.data(), n), std::span<float>(y.data(), n), meshlib::reduce_op::sum);
    Kokkos::parallel_for("double", Kokkos::RangePolicy<Kokkos::Cuda>(exec, 0, n), KOKKOS_LAMBDA(int i) { y(i) *= 2; });
    req.wait();
    exec.fence();
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
    for (int i = 0; i < n && bad < 0; ++i)
      if (host(i) != 2.0f * float(i % 4096)) bad = i;
    if (bad >= 0) std::printf("kokkos cuda nccl: y(%d) = %g, expected %g\n", bad, double(host(bad)), 2.0 * (bad % 4096));
  }
  if (bad >= 0) return 1;
  std::puts("kokkos cuda nccl OK");
  return 0;
}
