// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Uses meshlib::headers alone: the core and comm layers must build with no Kokkos header on the
// include path (this target does not bring one).
#include <meshlib/comm.hpp>
#include <meshlib/core.hpp>

#include <cstdio>

#if __has_include(<Kokkos_Core.hpp>)
#error "meshlib::headers must not put Kokkos on the include path"
#endif

int main() {
  const meshlib::mesh<meshlib::axis<"x">, meshlib::axis<"y">, meshlib::axis<"z">> m{2, 3, 2};
  // device 7 = (1, 0, 1): 7 = 1*6 + 0*2 + 1
  if (m.size() != 12 || m.device_at({1, 0, 1}) != 7) {
    std::puts("meshlib headers consumer: wrong mesh arithmetic");
    return 1;
  }
  std::puts("meshlib headers consumer OK");
  return 0;
}
