// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Kokkos 4 driven from several threads at once, each thread on its own execution-space instance
// (the instances meshlib gives its devices: tensor::detail::make_device_instances, partition_space):
// View allocation and release (also of one View shared by every thread, whose reference count
// every thread changes), RangePolicy parallel_for / parallel_reduce / parallel_scan, TeamPolicy
// with team scratch memory (what raced on Kokkos 3.4.1 Serial's one scratch buffer), deep_copy
// and fence on the instance; every result checked exactly. Built only against Kokkos 4 (3.4.1
// has one Serial instance: tensor_concurrency covers it), and also under ThreadSanitizer
// (kokkos_threads_tsan, Serial cases only; see tests/unit/tensor/CMakeLists.txt and the table in
// docs/design.md for what was checked with a ThreadSanitizer-instrumented Kokkos).
#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "meshlib/tensor/view.hpp"
#include "meshlib_catch.hpp"

static_assert(KOKKOS_VERSION >= 40000, "kokkos_threads_test is built against Kokkos 4 only");

namespace {

#if defined(MESHLIB_UNDER_TSAN)
constexpr int rounds = 20;
#else
constexpr int rounds = 200;
#endif
constexpr std::int64_t n = 1000;

/// What one thread computes on instance `exec` in one round; returns the number of wrong results.
template <class Exec>
int one_round(const Exec& exec, int thread, int round, const Kokkos::View<std::int64_t*, Kokkos::HostSpace>& shared) {
  using policy = Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>;
  int wrong = 0;
  const std::int64_t k = thread * 1000 + round;
  // Allocation (initialised on the instance) and a kernel that fills it.
  Kokkos::View<std::int64_t*, typename Exec::memory_space> a(Kokkos::view_alloc("a", exec), n);
  Kokkos::parallel_for("fill", policy(exec, 0, n), KOKKOS_LAMBDA(std::int64_t i) { a(i) = i + k; });
  // Reduction: sum of i + k over [0, n).
  std::int64_t sum = 0;
  Kokkos::parallel_reduce("sum", policy(exec, 0, n), KOKKOS_LAMBDA(std::int64_t i, std::int64_t& s) { s += a(i); }, sum);
  exec.fence();
  if (sum != n * (n - 1) / 2 + n * k) ++wrong;
  // Exclusive scan into b: b(i) = sum of a(0 .. i-1); total = sum.
  Kokkos::View<std::int64_t*, typename Exec::memory_space> b(Kokkos::view_alloc(Kokkos::WithoutInitializing, "b", exec), n);
  std::int64_t total = 0;
  Kokkos::parallel_scan(
      "scan", policy(exec, 0, n),
      KOKKOS_LAMBDA(std::int64_t i, std::int64_t& partial, bool final) {
        if (final) b(i) = partial;
        partial += a(i);
      },
      total);
  exec.fence();
  if (total != sum) ++wrong;
  for (std::int64_t i : {std::int64_t{0}, std::int64_t{1}, n / 2, n - 1})
    if (b(i) != i * (i - 1) / 2 + i * k) ++wrong;
  // TeamPolicy with team scratch: each team stages its rows in scratch and reduces them.
  using team_policy = Kokkos::TeamPolicy<Exec>;
  using member = typename team_policy::member_type;
  using scratch_view = Kokkos::View<std::int64_t*, typename Exec::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  constexpr int league = 10;
  constexpr std::int64_t per = n / league;
  std::int64_t team_sum = 0;
  Kokkos::parallel_reduce(
      "team", team_policy(exec, league, 1).set_scratch_size(0, Kokkos::PerTeam(scratch_view::shmem_size(per))),
      KOKKOS_LAMBDA(const member& t, std::int64_t& s) {
        scratch_view tmp(t.team_scratch(0), per);
        const std::int64_t base = t.league_rank() * per;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(t, per), [&](std::int64_t j) { tmp(j) = a(base + j); });
        t.team_barrier();
        std::int64_t part = 0;
        Kokkos::parallel_reduce(Kokkos::TeamThreadRange(t, per), [&](std::int64_t j, std::int64_t& p) { p += tmp(j); }, part);
        Kokkos::single(Kokkos::PerTeam(t), [&] { s += part; });
      },
      team_sum);
  exec.fence();
  if (team_sum != sum) ++wrong;
  // deep_copy on the instance, then check on the host.
  Kokkos::View<std::int64_t*, Kokkos::HostSpace> h(Kokkos::view_alloc(Kokkos::WithoutInitializing, "h"), n);
  Kokkos::deep_copy(exec, h, a);
  exec.fence();
  for (std::int64_t i = 0; i < n; i += 97)
    if (h(i) != i + k) ++wrong;
  // Handles of one allocation copied and dropped by every thread at once: its reference count
  // (checked once all threads have joined). Not use_count() here: Kokkos 4.6 reads the count
  // without an atomic load (SharedAllocationRecord::use_count), a race ThreadSanitizer reports
  // against the other threads' atomic increments; meshlib reads use_count() only of its own
  // device's blocks, which no other thread copies.
  for (int c = 0; c < 50; ++c) {
    auto copy = shared;
    if (copy.data() != shared.data()) ++wrong;
  }
  return wrong;
}

/// Runs `rounds` rounds on each of `threads` threads at once, thread `t` on `instances[t]`.
template <class Exec>
void drive(const std::vector<Exec>& instances) {
  const int threads = static_cast<int>(instances.size());
  Kokkos::View<std::int64_t*, Kokkos::HostSpace> shared("shared", 4);
  std::vector<int> wrong(instances.size(), 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int r = 0; r < rounds; ++r) wrong[static_cast<std::size_t>(t)] += one_round(instances[static_cast<std::size_t>(t)], t, r, shared);
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) {
    INFO("thread " << t);
    CHECK(wrong[static_cast<std::size_t>(t)] == 0);
  }
  CHECK(shared.use_count() == 1);  // every copy counted and released
}

}  // namespace

TEST_CASE("Kokkos 4 Serial: 4 threads, each on its own instance, give exact results", "[kokkos4][serial]") {
  const auto instances = meshlib::tensor::detail::make_device_instances<Kokkos::Serial>(4);
  REQUIRE(instances.size() == 4);
  // partition_space made independent instances, not four handles of one.
  // (Serial's impl_instance_id() is 1 for every instance; operator== compares the instances.)
  for (std::size_t i = 1; i < instances.size(); ++i) CHECK(!(instances[i] == instances[0]));
  drive(instances);
}

#if defined(KOKKOS_ENABLE_OPENMP)
TEST_CASE("Kokkos 4 OpenMP: threads, each on its own partition of the pool, give exact results", "[kokkos4][openmp]") {
  // As meshlib makes them: partition_space when every device gets a pool thread, else one-thread
  // instances. Two cases: as many partitions as the pool has threads, and four.
  const int pool = Kokkos::OpenMP().concurrency();
  for (const int devices : {pool, 4}) {
    INFO(devices << " devices, pool of " << pool);
    const auto instances = meshlib::tensor::detail::make_device_instances<Kokkos::OpenMP>(static_cast<std::size_t>(devices));
    REQUIRE(instances.size() == static_cast<std::size_t>(devices));
    drive(instances);
  }
}
#endif
