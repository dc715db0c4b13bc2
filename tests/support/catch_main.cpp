// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The Catch2 main of every meshlib test binary, compiled once. Kokkos is initialised here for the
// whole run because Kokkos 3.x cannot be initialised twice in one process.
#if defined(MESHLIB_CATCH2_MAJOR) && MESHLIB_CATCH2_MAJOR >= 3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <Kokkos_Core.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  return Catch::Session().run(argc, argv);
}
