// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Runners (exec/runner.hpp, exec/thread_runner.hpp): spmd and shard_map on persistent device
// threads. Repeated calls give the values computed here independently, on the same threads (the
// proof that they persist); a failed call leaves the next one a fresh world; nested calls, calls
// from two threads at once and meshes of changing size neither deadlock nor mix up devices.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {

using mesh1 = mesh<axis<"x">>;
using L = local_tensor<double, 1, mesh1, mesh1::all_axes>;

// Each device contributes (device + 1) * k; psum over all of them; returns what each device got.
template <class Runner>
std::vector<double> device_sums(const mesh1& m, double k, const Runner& runner) {
  return spmd(
      m,
      [&] {
        L x(std::array<std::size_t, 1>{1}, m, device_index());
        x.data()[0] = static_cast<double>(device_index() + 1) * k;
        return psum<"x">(x).data()[0];
      },
      runner);
}

// 1 + 2 + ... + n, times k: what every device of `device_sums` must get.
double expected_sum(std::size_t n, double k) { return k * static_cast<double>(n * (n + 1) / 2); }

template <class Runner>
std::vector<std::thread::id> device_threads(const mesh1& m, const Runner& runner) {
  return spmd(m, [] { return std::this_thread::get_id(); }, runner);
}

// Has run/local_devices like a runner but does not opt in: not a runner (opt-in, not shape).
struct lookalike {
  template <class Body>
  void run(std::size_t, Body&&) const {}
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t) const { return {}; }
};

/// A thread_runner on the process-wide device threads (the default runner's), default-constructible
/// for the templated cases.
struct process_wide_runner : thread_runner {
  process_wide_runner() : thread_runner(meshlib::exec::detail::process_wide_threads) {}
};

}  // namespace

static_assert(runner<process_wide_runner>);
static_assert(runner<thread_runner>);
static_assert(!runner<lookalike>);
static_assert(!runner<int>);

TEMPLATE_TEST_CASE("repeated calls give the independently computed sums, on the same threads every time",
                   "[exec][runner]", process_wide_runner, thread_runner) {
  const TestType runner{};
  const mesh1 m{4};
  const auto first = device_threads(m, runner);
  REQUIRE(first.size() == 4);
  CHECK(first[0] == std::this_thread::get_id());  // device 0 runs on the caller
  for (std::size_t d = 1; d < 4; ++d)
    for (std::size_t e = 0; e < d; ++e) CHECK(first[d] != first[e]);
  for (int call = 0; call < 50; ++call) {
    const double k = 1.0 + call;
    const auto sums = device_sums(m, k, runner);
    REQUIRE(sums.size() == 4);
    for (double s : sums) CHECK(s == expected_sum(4, k));
  }
  CHECK(device_threads(m, runner) == first);  // persistent: no thread was replaced
}

TEST_CASE("shard_map on a thread_runner reuses its threads and computes the same as the default", "[exec][runner]") {
  const mesh1 m{4};
  const thread_runner runner;
  std::vector<double> host(8);
  for (std::size_t i = 0; i < 8; ++i) host[i] = static_cast<double>(i) * 0.5 - 1;
  auto x = from_host(named_sharding<mesh1, P<"x">>{m}, std::array<std::size_t, 1>{8}, host);
  const auto ids = device_threads(m, runner);
  for (int call = 0; call < 5; ++call) {
    auto f = shard_map(
        [&](auto b) {
          decltype(b) y(b.shape(), b.mesh(), b.device());  // a copy would share b's view
          for (std::size_t i = 0; i < b.size(); ++i) y.data()[i] = b.data()[i] * 3 + call;
          return y;
        },
        m, P<"x">{}, P<"x">{}, runner);
    const auto got = f(x).to_host();
    REQUIRE(got.size() == 8);
    for (std::size_t i = 0; i < 8; ++i) CHECK(got[i] == host[i] * 3 + call);
  }
  CHECK(device_threads(m, runner) == ids);
}

TEST_CASE("after a failed call the next call runs on a fresh world, on the same threads", "[exec][runner][errors]") {
  const mesh1 m{3};
  const thread_runner runner;
  const auto ids = device_threads(m, runner);
  for (int round = 0; round < 3; ++round) {
    bool caught = false;
    try {
      spmd(
          m,
          [&] {
            if (device_index() == 1) throw std::runtime_error("boom in round " + std::to_string(round));
            L x(std::array<std::size_t, 1>{1}, m, device_index());
            (void)psum<"x">(x);  // devices 0 and 2 wait for device 1: released by the abort
          },
          runner);
    } catch (const device_error& e) {
      caught = true;
      CHECK(e.device() == 1);
      CHECK(std::string(e.what()) ==
            "meshlib: device 1 of mesh{'x': 3} failed: boom in round " + std::to_string(round));
      REQUIRE_THROWS_AS(e.rethrow_cause(), std::runtime_error);
    }
    CHECK(caught);
    // The world of the failed call stays failed; the next call must not see it.
    const auto sums = device_sums(m, 2.0, runner);
    for (double s : sums) CHECK(s == expected_sum(3, 2.0));
  }
  CHECK(device_threads(m, runner) == ids);
  // Outside any call the calling thread is no device again.
  REQUIRE_THROWS_AS(device_index(), spmd_context_error);
}

TEMPLATE_TEST_CASE("an spmd inside a device of another runs to completion (threads of its own)", "[exec][runner]",
                   process_wide_runner, thread_runner) {
  const TestType runner{};
  const mesh1 outer{2}, inner{3};
  const auto outer_ids = device_threads(outer, runner);
  const auto got = spmd(
      outer,
      [&] {
        const std::size_t me = device_index();
        // The inner devices talk to each other, so they cannot run one after another on this thread.
        const auto sums = device_sums(inner, static_cast<double>(me + 1), runner);
        const auto ids = device_threads(inner, runner);
        // The inner call's device 0 is this outer device's thread; the outer device is itself again after it.
        const bool inner0_here = ids[0] == std::this_thread::get_id();
        const bool back = device_index() == me;
        return std::array<double, 5>{sums[0], sums[1], sums[2], inner0_here ? 1.0 : 0.0, back ? 1.0 : 0.0};
      },
      runner);
  REQUIRE(got.size() == 2);
  for (std::size_t d = 0; d < 2; ++d) {
    INFO("outer device " << d);
    for (std::size_t i = 0; i < 3; ++i) CHECK(got[d][i] == expected_sum(3, static_cast<double>(d + 1)));
    CHECK(got[d][3] == 1.0);
    CHECK(got[d][4] == 1.0);
  }
  CHECK(device_threads(outer, runner) == outer_ids);  // the nested calls left the runner's threads alone
}

TEST_CASE("meshes of different sizes in sequence: device d of each runs on worker d", "[exec][runner]") {
  const thread_runner runner;
  const auto big = device_threads(mesh1{8}, runner);
  for (std::size_t n : {2u, 8u, 3u, 1u, 5u, 8u}) {
    INFO(n << " devices");
    const mesh1 m{n};
    const auto ids = device_threads(m, runner);
    REQUIRE(ids.size() == n);
    for (std::size_t d = 0; d < n; ++d) CHECK(ids[d] == big[d]);
    const auto sums = device_sums(m, 0.25, runner);
    for (double s : sums) CHECK(s == expected_sum(n, 0.25));
    const auto where = spmd(m, [] { return std::array<std::size_t, 2>{device_index(), axis_size<"x">()}; }, runner);
    for (std::size_t d = 0; d < n; ++d) CHECK(where[d] == std::array<std::size_t, 2>{d, n});
  }
}

TEST_CASE("a pinned device thread never starts a call on the CPU of the calling thread (device 0)", "[exec][runner]") {
#if defined(__linux__)
  // Issue 27: the caller is the user's thread and is never pinned; a worker pinned to a fixed CPU
  // shared it with the caller for whole runs on a busy machine, and two device threads on one core
  // wait for each other through context switches. So each call pins its workers beside the caller.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  REQUIRE(pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) == 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.size() < 2) {
    WARN("one CPU: no worker is pinned, nothing to check");
    return;
  }
  const thread_runner runner;
  const mesh1 m{2};
  (void)device_sums(m, 1.0, runner);  // the pool's first call, from the unpinned caller
  struct restore_affinity {
    cpu_set_t mask;
    ~restore_affinity() { pthread_setaffinity_np(pthread_self(), sizeof(mask), &mask); }
  } restore{allowed};
  // Every CPU in turn, and back to the first: the worker follows the caller from call to call.
  std::vector<int> order = cpus;
  order.push_back(cpus.front());
  for (int caller : order) {
    INFO("caller on CPU " << caller);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(caller, &one);
    REQUIRE(pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0);
    std::array<cpu_set_t, 2> masks{};
    runner.run(2, [&](std::size_t d, thread_communicator c) {
      CPU_ZERO(&masks[d]);
      pthread_getaffinity_np(pthread_self(), sizeof(cpu_set_t), &masks[d]);
      c.barrier().wait();
    });
    CHECK(CPU_EQUAL(&masks[0], &one));  // the caller's own affinity is left alone
    CHECK(CPU_COUNT(&masks[1]) == 1);   // the worker has a core of its own ...
    CHECK_FALSE(CPU_ISSET(caller, &masks[1]));  // ... not the caller's
    CHECK(device_sums(m, 0.5, runner) == std::vector<double>{expected_sum(2, 0.5), expected_sum(2, 0.5)});
  }
#endif
}

TEST_CASE("two threads calling on one runner at once both finish with their own results", "[exec][runner]") {
  const thread_runner runner;
  const mesh1 m{2};
  std::array<std::vector<double>, 2> got;
  {
    std::thread other([&] {
      for (int i = 0; i < 20; ++i) got[1] = device_sums(m, 3.0, runner);
    });
    for (int i = 0; i < 20; ++i) got[0] = device_sums(m, 5.0, runner);
    other.join();
  }
  CHECK(got[0] == std::vector<double>(2, expected_sum(2, 5.0)));
  CHECK(got[1] == std::vector<double>(2, expected_sum(2, 3.0)));
}

TEST_CASE("a thread_runner joins its threads when its last copy goes, also after a failure", "[exec][runner]") {
  const mesh1 m{4};
  {
    thread_runner runner;
    const thread_runner copy = runner;  // copies share the threads
    CHECK(device_threads(m, copy) == device_threads(m, runner));
    REQUIRE_THROWS_AS(spmd(
                          m, [] { if (device_index() == 3) throw std::logic_error("late failure"); }, runner),
                      device_error);
  }  // joins here: a hang would stop the test binary (the process-wide threads are joined at its exit)
  const auto sums = device_sums(m, 1.0, process_wide_runner{});
  for (double s : sums) CHECK(s == expected_sum(4, 1.0));
}

#if defined(__SANITIZE_THREAD__)
#define RUNNER_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RUNNER_TEST_TSAN 1
#endif
#endif
#if defined(__linux__) && !defined(RUNNER_TEST_TSAN)  // ThreadSanitizer refuses threads after a fork
TEST_CASE("a child of fork() runs spmd on threads of its own (the parent's workers are not in it)", "[exec][runner]") {
  const mesh1 m{3};
  (void)device_sums(m, 1.0, process_wide_runner{});  // the process-wide workers exist now
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Waiting for the parent's workers would hang here; exit code 0 only for the right sums.
    const auto sums = device_sums(m, 2.0, process_wide_runner{});
    bool ok = sums.size() == 3;
    for (double s : sums) ok = ok && s == expected_sum(3, 2.0);
    std::_Exit(ok ? 0 : 1);
  }
  int status = -1;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(device_sums(m, 3.0, process_wide_runner{}) == std::vector<double>(3, expected_sum(3, 3.0)));
}
#endif

// The default runner (exec/default_runner.hpp) in one process: the process-wide device threads,
// the same ones process_wide_runner{} uses, before distributed::initialize and after one that found
// one process; a run of several processes that MPI does not join is refused, not run as threads.
static_assert(runner<default_runner>);

TEST_CASE("without a multi-process launch the default runner is the process-wide thread runner", "[exec][runner]") {
  namespace dist = meshlib::distributed;
  const mesh1 m{4};
  auto check_threads = [&] {
    CHECK(default_runner{}.local_devices(4) == std::vector<std::size_t>{0, 1, 2, 3});
    const auto by_default = spmd(m, [] { return std::this_thread::get_id(); });
    CHECK(by_default == device_threads(m, process_wide_runner{}));  // the very same threads
    CHECK(by_default[0] == std::this_thread::get_id());
    for (double s : spmd(m, [&] {
           L x(std::array<std::size_t, 1>{1}, m, device_index());
           x.data()[0] = static_cast<double>(device_index() + 1);
           return psum<"x">(x).data()[0];
         }))
      CHECK(s == expected_sum(4, 1.0));
  };
  REQUIRE(!dist::is_initialized());
  check_threads();
  const dist::env_source no_env = [](std::string_view) -> std::optional<std::string> { return std::nullopt; };
  {
    dist::options o;
    o.initialize_kokkos = false;
    o.env = no_env;
    dist::guard one(o);  // no launcher: one process
    check_threads();
  }
  {
    dist::options o;
    o.initialize_kokkos = false;
    o.env = no_env;
    o.process_id = 1;
    o.num_processes = 2;
    dist::guard two(o);  // two processes, but nothing joins them in this build
    const std::string expected =
        "meshlib: spmd / shard_map on the default runner: the run has 2 processes (explicit arguments), but no MPI "
        "communicator joins them to run a mesh over them: start the run with meshlib::mpi::initialize() (or a "
        "meshlib::mpi::guard; link meshlib::mpi), or pass a runner explicitly (thread_runner{} runs every device in "
        "this process)";
    CHECK(meshlib_test::message_of<distributed_error>([&] { spmd(m, [] {}); }) == expected);
    CHECK(meshlib_test::message_of<distributed_error>([&] { (void)default_runner{}.local_devices(4); }) == expected);
    const auto local = spmd(m, [] { return device_index(); }, thread_runner{});  // explicit: still threads
    CHECK(local == std::vector<std::size_t>{0, 1, 2, 3});
  }
  CHECK(!dist::is_initialized());
  check_threads();
}

TEST_CASE("spmd on a mesh of more devices than an int counts is a mesh_error naming the axis, not bad_alloc",
          "[exec][runner][sizes]") {
  const mesh1 m{(std::size_t{1} << 32) + 2};
  const std::string expected =
      "meshlib: spmd on mesh{'x': 4294967298}: the mesh has 4294967298 devices, more than the 2147483647 that a "
      "communicator's int ranks can number; axis 'x' (size 4294967298) takes the device count past it: use a mesh of "
      "at most 2147483647 devices";
  CHECK(meshlib_test::message_of<mesh_error>([&] { spmd(m, [] {}); }) == expected);
  CHECK(meshlib_test::message_of<mesh_error>([&] { (void)spmd(m, [] { return 1; }); }) == expected);
  CHECK(meshlib_test::message_of<mesh_error>([&] { spmd(m, [] {}, thread_runner{}); }) == expected);
}

// The deprecated names of the runners (one release): `thread_backend` is still a runner on the
// process-wide device threads, as before the rename, with the same results.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
static_assert(runner<thread_backend>);
static_assert(std::is_base_of_v<thread_runner, thread_backend>);
TEST_CASE("the deprecated thread_backend runs on the process-wide threads, as thread_runner does", "[exec][runner]") {
  const mesh1 m{3};
  const thread_backend old{{.timeout = std::chrono::seconds(30)}};
  CHECK(old.workers == nullptr);  // the process-wide threads
  CHECK(old.options.timeout == std::chrono::seconds(30));
  CHECK(device_threads(m, old) == device_threads(m, process_wide_runner{}));
  CHECK(device_sums(m, 2.0, old) == std::vector<double>(3, expected_sum(3, 2.0)));
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace MESHLIB_TEST_UNIT
