// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The runtime over MPI: mpi::initialize adopts the communicator, the process index and count are
// its rank and size, the start-up checks run on every process, and a mesh built differently on
// one process is reported on all of them with both values.
#include <meshlib/mpi.hpp>

#include <string>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace dist = meshlib::distributed;

TEST_CASE("mpi::initialize: process index and count from the communicator", "[mpi][runtime]") {
  int r = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  meshlib::mpi::options o;
  o.runtime.local_device_count = 2;
  {
    meshlib::mpi::guard run(MPI_COMM_WORLD, o);
    CHECK(dist::is_initialized());
    CHECK(dist::process_index() == static_cast<std::size_t>(r));
    CHECK(dist::process_count() == static_cast<std::size_t>(n));
    CHECK(dist::launch().source == dist::launcher::communicator);
    CHECK(dist::device_count() == static_cast<std::size_t>(2 * n));
    CHECK(dist::local_devices() == std::vector<std::size_t>{2 * static_cast<std::size_t>(r), 2 * static_cast<std::size_t>(r) + 1});
    // mpirun's environment agrees (it is OpenMPI's launcher here).
    const auto env = dist::detect_launch(dist::process_env());
    if (env.source == dist::launcher::openmpi) CHECK(env.process_index == static_cast<std::size_t>(r));
    CHECK(meshlib::mpi::world().size() == n);

    // Initialising again with the same values is a no-op.
    meshlib::mpi::initialize(MPI_COMM_WORLD, o);
    CHECK(dist::process_index() == static_cast<std::size_t>(r));

    // The same mesh everywhere passes.
    const auto m = dist::make_global_mesh<meshlib::axis<"process">, meshlib::axis<"thread">>(n, 2);
    CHECK(m.size() == dist::device_count());
    const auto coords = dist::local_coords(m);
    CHECK(coords[0] == decltype(m)::coord_type{static_cast<std::size_t>(r), 0});

    // A mesh of other axis sizes on rank 0: every process reports both meshes.
    try {
      if (r == 0)
        (void)dist::make_global_mesh<meshlib::axis<"a">, meshlib::axis<"b">>(2 * n, 1);
      else
        (void)dist::make_global_mesh<meshlib::axis<"a">, meshlib::axis<"b">>(n, 2);
      FAIL("must throw process_mismatch on every process");
    } catch (const meshlib::process_mismatch& e) {
      const std::string w = e.what();
      CHECK(w.find("process 0 has mesh{'a': " + std::to_string(2 * n) + ", 'b': 1}") != std::string::npos);
      const std::string other = "mesh{'a': " + std::to_string(n) + ", 'b': 2}";
      const bool names_other = w.find("have " + other) != std::string::npos || w.find("has " + other) != std::string::npos;
      CHECK(names_other);
    }
  }
  CHECK(!dist::is_initialized());
}

TEST_CASE("mpi::initialize: processes started with different device counts are reported", "[mpi][runtime]") {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  meshlib::mpi::options o;
  o.runtime.local_device_count = r == 1 ? 3 : 2;
  try {
    meshlib::mpi::initialize(MPI_COMM_WORLD, o);
    FAIL("must throw process_mismatch");
  } catch (const meshlib::process_mismatch& e) {
    const std::string w = e.what();
    CHECK(w.find("process 1 has ") != std::string::npos);
    CHECK(w.find("x 3 local devices") != std::string::npos);
    CHECK(w.find("x 2 local devices") != std::string::npos);
  }
  meshlib::mpi::finalize();
  CHECK(!dist::is_initialized());
}

}  // namespace MESHLIB_TEST_UNIT
