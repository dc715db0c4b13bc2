// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A device as a team of cores (issue 23, item 5): `thread_runner::threads_per_device` makes each
// device's execution-space instance a team of that many Kokkos threads on Kokkos 4 OpenMP, and is
// refused, naming the backend, where a device has one thread. One thread per device stays the
// default on every backend (a one-device mesh does not take the whole OpenMP pool).
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include <Kokkos_Core.hpp>
#if defined(KOKKOS_ENABLE_OPENMP)
#include <omp.h>
#endif

#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {

using mesh1 = mesh<axis<"x">>;
using host_exec = tensor::detail::exec_space_for_t<default_memory_space>;
using L = local_tensor<double, 1, mesh1, mesh1::all_axes>;

/// What each device of `m` sees on `runner`: its instance's concurrency, and how many distinct
/// threads of its team ran a kernel of 2^16 indices on it.
struct team_view {
  int concurrency = 0;
  int threads_that_ran = 0;
  double sum = 0;  // psum over the devices of sum_{i < 2^16} i, computed on each device's team
};

std::vector<team_view> teams(const mesh1& m, const thread_runner& runner) {
  std::vector<team_view> seen(m.size());
  spmd(
      m,
      [&] {
        const auto exec = tensor::detail::current_exec<default_memory_space>();
        const std::size_t device = device_index();
        constexpr int n = 1 << 16;
        int ran = 0;
        Kokkos::parallel_reduce(
            "test_threads_per_device", Kokkos::RangePolicy<host_exec>(exec, 0, n),
            KOKKOS_LAMBDA(int, int& most) {
#if defined(KOKKOS_ENABLE_OPENMP)
              if (omp_get_thread_num() + 1 > most) most = omp_get_thread_num() + 1;
#else
              most = 1;
#endif
            },
            Kokkos::Max<int>(ran));
        double s = 0;
        Kokkos::parallel_reduce(
            "test_threads_per_device_sum", Kokkos::RangePolicy<host_exec>(exec, 0, n),
            KOKKOS_LAMBDA(int i, double& acc) { acc += i; }, s);
        L x(std::array<std::size_t, 1>{1}, m, device);
        x.data()[0] = s;
        seen[device] = {exec.concurrency(), ran, psum<"x">(x).data()[0]};
      },
      runner);
  return seen;
}

constexpr double sum_below_2_16 = 65536.0 * 65535.0 / 2;

}  // namespace

TEST_CASE("a device computes on one thread by default, whatever the mesh and backend", "[exec][threads]") {
  thread_runner runner;
  for (std::size_t n : {1u, 2u}) {
    const auto seen = teams(mesh1{n}, runner);
    for (const auto& t : seen) {
      CHECK(t.concurrency == 1);
      CHECK(t.threads_that_ran == 1);
      CHECK(t.sum == sum_below_2_16 * static_cast<double>(n));
    }
  }
}

TEST_CASE("threads_per_device makes each device a team of cores, or is refused naming the backend",
          "[exec][threads]") {
  thread_runner runner;
  runner.threads_per_device = 2;
  if constexpr (tensor::detail::has_thread_teams_v<host_exec>) {
    // Two devices of two threads on any machine (more threads than cores run unpinned), and one.
    for (std::size_t n : {1u, 2u}) {
      const auto seen = teams(mesh1{n}, runner);
      for (const auto& t : seen) {
        CHECK(t.concurrency == 2);
        CHECK(t.threads_that_ran == 2);
        CHECK(t.sum == sum_below_2_16 * static_cast<double>(n));
      }
    }
    // Back to one thread on the same runner's threads: the instances are per team size.
    runner.threads_per_device = 1;
    for (const auto& t : teams(mesh1{2}, runner)) CHECK(t.concurrency == 1);
  } else {
    const std::string expected = "meshlib: threads_per_device = 2 needs Kokkos 4 with the OpenMP backend (a team of "
                                 "threads per device), but devices here compute on Kokkos::" +
                                 std::string(host_exec::name()) + " (Kokkos " + std::to_string(KOKKOS_VERSION) +
                                 "), one thread each; build Kokkos 4 with -DKokkos_ENABLE_OPENMP=ON, or leave "
                                 "threads_per_device at 1";
    CHECK(meshlib_test::message_of<meshlib::error>([&] { (void)teams(mesh1{2}, runner); }) == expected);
  }
}

TEST_CASE("threads_per_device 0 is refused on every backend", "[exec][threads]") {
  thread_runner runner;
  runner.threads_per_device = 0;
  CHECK(meshlib_test::message_of<meshlib::error>([&] { (void)teams(mesh1{2}, runner); }) ==
        "meshlib: threads_per_device is 0; a device computes on at least one thread (1, the default, is one core per "
        "device)");
}

}  // namespace MESHLIB_TEST_UNIT
