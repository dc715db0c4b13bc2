// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Built against meshlib::headers only: the comm layer must not need Kokkos.
#include <cstdio>
#include <span>
#include <vector>

#include "meshlib/comm.hpp"

#ifdef KOKKOS_VERSION
#error "the comm layer included a Kokkos header"
#endif

int main() {
  std::vector<double> sums(3);
  meshlib::run_on_threads(3, [&](meshlib::thread_communicator& c) {
    double x = c.rank() + 1.0;
    c.all_reduce(std::span<double>(&x, 1), meshlib::reduce_op::sum);
    sums[static_cast<std::size_t>(c.rank())] = x;
  });
  for (double s : sums)
    if (s != 6.0) {
      std::printf("expected 6, got %g\n", s);
      return 1;
    }
  std::puts("comm layer works without Kokkos");
  return 0;
}
