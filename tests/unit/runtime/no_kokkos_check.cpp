// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Builds against meshlib::headers (no Kokkos on the include path) and checks detection from the
// real process environment, which CTest sets to OpenMPI's variables for one process.
#include <meshlib/runtime/distributed.hpp>

#include <cstdio>

#ifdef KOKKOS_VERSION
#error "meshlib/runtime/distributed.hpp must not pull in Kokkos"
#endif

int main() {
  meshlib::distributed::guard g;
  const auto l = meshlib::distributed::launch();
  const bool ok = l.source == meshlib::distributed::launcher::openmpi && l.process_count == 1 &&
                  meshlib::distributed::local_device_count() == 3 && meshlib::distributed::device_count() == 3;
  if (!ok) std::printf("unexpected launch: source=%d count=%zu local=%zu\n", static_cast<int>(l.source), l.process_count,
                       meshlib::distributed::local_device_count());
  return ok ? 0 : 1;
}
