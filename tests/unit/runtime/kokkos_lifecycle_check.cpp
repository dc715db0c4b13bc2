// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The Kokkos lifecycle rule: every meshlib entry point used before Kokkos is initialised, or after
// it is finalised, throws kokkos_lifecycle_error naming the entry point and the fix, before any
// device thread starts. Its own main (not the shared Catch2 main, which initialises Kokkos first).
#include <atomic>
#include <cstdio>
#include <string>

#include <Kokkos_Core.hpp>

#include "meshlib.hpp"
#include "message_of.hpp"

namespace {

int failures = 0;

void expect_eq(const std::string& what, const std::string& got, const std::string& want) {
  if (got == want) return;
  ++failures;
  std::printf("FAILED: %s\n  got:  %s\n  want: %s\n", what.c_str(), got.c_str(), want.c_str());
}

std::string expected(const std::string& entry, bool finalized) {
  return "meshlib: " + entry + ": Kokkos " + (finalized ? "was already finalised" : "is not initialised") +
         "; hold a Kokkos::ScopeGuard in main() (or meshlib::distributed::guard, or meshlib::mpi::guard with MPI, "
         "which initialise MPI and Kokkos in the right order) before the first meshlib call and before any device "
         "thread starts, and keep it alive until every tensor is destroyed";
}

using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
using sharding_t = meshlib::named_sharding<mesh_t, meshlib::P<"x">>;

/// Every entry point once; `finalized`: the state the message must report.
void check_all_throw(bool finalized, const char* when) {
  using meshlib_test::message_of;
  const mesh_t m{2};
  std::atomic<int> device_calls{0};
  expect_eq(std::string("spmd ") + when,
            message_of<meshlib::kokkos_lifecycle_error>([&] { meshlib::spmd(m, [&] { ++device_calls; }); }),
            expected("spmd", finalized));
  expect_eq(std::string("zeros ") + when, message_of<meshlib::kokkos_lifecycle_error>([&] {
              (void)meshlib::zeros<float>(sharding_t(m), std::array<std::size_t, 1>{4});
            }),
            expected("meshlib::sharded_tensor", finalized));
  const auto f = meshlib::shard_map([&] { ++device_calls; return std::tuple<>{}; }, m, meshlib::specs<>{}, meshlib::specs<>{});
  expect_eq(std::string("shard_map ") + when, message_of<meshlib::kokkos_lifecycle_error>([&] { (void)f(); }),
            expected("shard_map", finalized));
  if (device_calls.load() != 0) {
    ++failures;
    std::printf("FAILED: a device ran %s (%d calls)\n", when, device_calls.load());
  }
}

}  // namespace

int main(int argc, char** argv) {
  check_all_throw(false, "before Kokkos::initialize");
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    const mesh_t m{2};
    const auto ids = meshlib::spmd(m, [] { return meshlib::device_index(); });
    if (ids != std::vector<std::size_t>{0, 1}) {
      ++failures;
      std::printf("FAILED: spmd under a ScopeGuard\n");
    }
  }
  // Kokkos 3.x cannot tell a finalised Kokkos from one never initialised.
  check_all_throw(KOKKOS_VERSION >= 40000, "after Kokkos::finalize");
  std::printf("%s\n", failures ? "kokkos_lifecycle_check FAILED" : "kokkos_lifecycle_check passed");
  return failures ? 1 : 0;
}
