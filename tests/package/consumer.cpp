// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The program every package consumer builds: it includes the umbrella header and Kokkos, and
// checks a few mesh facts against values worked out by hand, so a consumer that builds against
// a broken or stale install fails here rather than passing silently.
#include <Kokkos_Core.hpp>
#include <meshlib.hpp>

#include <cstdio>
#include <vector>

#ifndef MESHLIB_CONSUMER_KIND
#error "MESHLIB_CONSUMER_KIND names the way meshlib was consumed"
#endif

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  const meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">> m{2, 4};
  // Row-major: device 5 = data 1, model 1; its "model" group is the second row.
  const bool ok = m.size() == 8 && m.coords(5)[0] == 1 && m.coords(5)[1] == 1 &&
                  m.group<"model">(5) == std::vector<std::size_t>{4, 5, 6, 7} &&
                  m.group<"data">(5) == std::vector<std::size_t>{1, 5};
  if (!ok) {
    std::puts("meshlib consumer: wrong mesh arithmetic");
    return 1;
  }
  std::printf("meshlib consumer OK (%s)\n", MESHLIB_CONSUMER_KIND);
  return 0;
}
