// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Built against meshlib::mpi only: MPI's header and library must come with the component.
#include <mpi.h>

#include <meshlib.hpp>
#if __has_include(<meshlib/mpi.hpp>)
#include <meshlib/mpi.hpp>
#endif

#include <cstdio>

#if !defined(MESHLIB_ENABLE_MPI) || MESHLIB_ENABLE_MPI != 1
#error "meshlib::mpi must define MESHLIB_ENABLE_MPI=1"
#endif

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // One mesh device per rank; the sum of all device ids is n(n-1)/2.
  const meshlib::mesh<meshlib::axis<"data">> m{static_cast<std::size_t>(size)};
  long mine = static_cast<long>(m.device_at({static_cast<std::size_t>(rank)}));
  long sum = 0;
  MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  const bool ok = static_cast<int>(m.size()) == size && sum == static_cast<long>(size) * (size - 1) / 2;
  if (rank == 0) std::printf("meshlib mpi consumer %s on %d ranks\n", ok ? "OK" : "FAILED", size);
  MPI_Finalize();
  return ok ? 0 : 1;
}
