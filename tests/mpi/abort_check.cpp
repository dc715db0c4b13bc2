// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Rank 1 makes an invalid call and lets the exception escape; rank 0 waits in a collective that
// rank 1 never reaches. meshlib's terminate handler must end both with rank 1's reason (the test
// checks the message), long before rank 0's timeout of 600 s.
#include <meshlib/mpi.hpp>

#include <vector>

int main() {
  meshlib::mpi::options o;
  o.comm.timeout = std::chrono::seconds(600);
  meshlib::mpi::guard run(MPI_COMM_WORLD, o);
  auto comm = meshlib::mpi::world();
  std::vector<float> small(2), big(4);
  if (comm.rank() == 1) {
    // recv shorter than send: comm_argument_error, uncaught.
    comm.all_reduce(std::span<const float>(big), std::span(small), meshlib::reduce_op::sum);
  } else {
    comm.all_reduce(std::span(big), meshlib::reduce_op::sum);
  }
  return 0;
}
