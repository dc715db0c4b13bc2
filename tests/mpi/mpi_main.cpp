// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The main of meshlib's MPI test binaries: MPI (with MPI_THREAD_MULTIPLE, for hybrid meshes), then
// Kokkos, then Catch2. Every rank runs (and reports) every test
// (collectives need all of them), and the exit code is the worst of all ranks.
#if defined(MESHLIB_CATCH2_MAJOR) && MESHLIB_CATCH2_MAJOR >= 3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>

int main(int argc, char* argv[]) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    Catch::Session session;
    if (session.applyCommandLine(argc, argv) != 0) return 1;
    result = session.run();
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (result != 0) std::fprintf(stderr, "meshlib MPI tests: rank %d had %d failure(s)\n", rank, result);
  MPI_Finalize();
  return worst;
}
