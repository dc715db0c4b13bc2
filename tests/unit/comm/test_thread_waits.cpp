// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// How the thread communicator's participants wait for each other (comm/detail/spin_then_block.hpp,
// issue 39 item 5): spin for a bounded window, then block; yield instead of spinning where the peer
// shares the waiter's CPU; block at once on a thread that prefers it (a communication worker).
// Results against independently computed sums over many rounds on a user's own, unpinned threads,
// whichever way each wait ends; and that a waiter whose peer is late ends up blocked. The verdicts
// are values and events, never times.
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "comm_test_support.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace comm_test;
using meshlib::thread_communicator;
using ns = std::chrono::nanoseconds;

namespace {

/// Runs `body(comm)` on `n` threads started here, as a user starts them (not `run_on_threads`,
/// never pinned), after `setup(rank)` on each; returns each rank's count of wrong results.
std::vector<int> on_own_threads(int n, meshlib::thread_comm_options o, const std::function<void(int)>& setup,
                                const std::function<int(thread_communicator&)>& body) {
  meshlib::thread_world world(n, o);
  std::vector<int> wrong(static_cast<std::size_t>(n), -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      setup(r);
      thread_communicator c = world.communicator(r);
      wrong[static_cast<std::size_t>(r)] = body(c);
    });
  for (auto& t : threads) t.join();
  return wrong;
}

/// `rounds` all_reduces: an 8 B one-shot one every round and, every 16th, a 64 KiB zero-copy one,
/// each checked against the sum written out independently; rank r's round-k value is
/// k * 1000 + r (integers, so the float sums are exact).
int all_reduce_rounds(thread_communicator& c, int rounds) {
  const int n = c.size();
  const std::int64_t ranks_sum = std::int64_t{n} * (n - 1) / 2;
  int wrong = 0;
  std::vector<float> big(16 * 1024);
  for (int k = 0; k < rounds; ++k) {
    std::int64_t x = std::int64_t{k} * 1000 + c.rank();
    c.all_reduce(std::span<std::int64_t>(&x, 1), reduce_op::sum);
    if (x != std::int64_t{k} * 1000 * n + ranks_sum) ++wrong;
    if (k % 16 == 0) {
      for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(k + c.rank() + static_cast<int>(i % 7));
      c.all_reduce(std::span<float>(big), reduce_op::sum);
      for (std::size_t i = 0; i < big.size(); ++i)
        if (big[i] != static_cast<float>(n * (k + static_cast<int>(i % 7)) + ranks_sum)) {
          ++wrong;
          break;
        }
    }
  }
  return wrong;
}

#if defined(__linux__)
/// Pins the calling thread to the first CPU it may run on (every caller to the same one).
void pin_to_first_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(pthread_self(), sizeof(set), &set) != 0) return;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
      return;
    }
}
#endif

}  // namespace

TEST_CASE("thread communicator on a user's own threads: many rounds give the expected sums whichever way waits end",
          "[comm][threads]") {
  const int rounds = 600;
  struct policy {
    const char* name;
    meshlib::thread_comm_options options;
  };
  meshlib::thread_comm_options long_spin, block_at_once, yield_then_block;
  long_spin.spin = ns(200'000);        // most waits end while spinning (4x the default window)
  long_spin.yield = ns(0);
  block_at_once.spin = ns(0);          // every wait that the first burst does not end blocks
  block_at_once.yield = ns(0);
  yield_then_block.spin = ns(0);
  yield_then_block.yield = ns(20'000);
  for (const policy& p : {policy{"default: spin, then block", {}}, policy{"long spin, then block", long_spin},
                          policy{"block at once", block_at_once}, policy{"yield, then block", yield_then_block}})
    for (int n : {2, 3, 5}) {
      INFO(p.name << ", " << n << " threads");
      const auto wrong = on_own_threads(n, p.options, [](int) {}, [&](thread_communicator& c) { return all_reduce_rounds(c, rounds); });
      CHECK(wrong == std::vector<int>(static_cast<std::size_t>(n), 0));
    }
}

TEST_CASE("thread communicator: threads that prefer blocking and threads that spin give the expected sums",
          "[comm][threads]") {
  // Odd ranks behave as communication workers (they block at once), even ranks spin.
  for (int n : {2, 4}) {
    INFO(n << " threads");
    const auto wrong = on_own_threads(
        n, {}, [](int r) { meshlib::comm::detail::prefer_blocking_waits() = (r % 2) == 1; },
        [](thread_communicator& c) { return all_reduce_rounds(c, 400); });
    CHECK(wrong == std::vector<int>(static_cast<std::size_t>(n), 0));
  }
}

#if defined(__linux__)
TEST_CASE("thread communicator: threads that share one CPU give the expected sums (the waiter yields to its peer)",
          "[comm][threads]") {
  // Every participant on one CPU: a waiter's peer can only arrive once the waiter gives the core
  // up, so this runs the path where a waiter that sees its peer on its own CPU yields instead of
  // spinning (with the default policy, a spinning waiter would cost a whole window per wait).
  for (int n : {2, 3}) {
    INFO(n << " threads on one CPU");
    const auto wrong = on_own_threads(n, {}, [](int) { pin_to_first_cpu(); },
                                      [](thread_communicator& c) { return all_reduce_rounds(c, 400); });
    CHECK(wrong == std::vector<int>(static_cast<std::size_t>(n), 0));
  }
}
#endif

TEST_CASE("thread communicator: a waiter whose peer is late ends up blocked, then gets the right result",
          "[comm][threads][repeat]") {
  // Rank 1 arrives only once rank 0's wait has gone to sleep: were an idle waiter to spin or yield
  // for ever, rank 1 would never arrive and the test would time out. Default policy, and the
  // peer-on-the-same-CPU path (yield, then block).
  for (bool same_cpu : {false, true}) {
    INFO((same_cpu ? "both on one CPU" : "unpinned"));
    const std::uint64_t before = meshlib::comm::detail::blocked_waits().load();
    const auto wrong = on_own_threads(
        2, {},
        [&](int) {
#if defined(__linux__)
          if (same_cpu) pin_to_first_cpu();
#endif
        },
        [&](thread_communicator& c) {
          if (c.rank() == 1)
            while (meshlib::comm::detail::blocked_waits().load() == before) std::this_thread::yield();
          std::int64_t x = 5 + c.rank();
          c.all_reduce(std::span<std::int64_t>(&x, 1), reduce_op::sum);
          return x == 11 ? 0 : 1;
        });
    CHECK(wrong == std::vector<int>{0, 0});
    CHECK(meshlib::comm::detail::blocked_waits().load() > before);
  }
}

TEST_CASE("poll_for: true as soon as the condition holds, false once the budget ran out", "[comm][threads]") {
  using meshlib::comm::detail::poll_for;
  int polls = 0;
  CHECK(poll_for([&] { return ++polls == 1; }, ns(0)));  // already true: one poll
  CHECK(polls == 1);
  polls = 0;
  CHECK(poll_for([&] { return ++polls == 100; }, ns(1'000'000'000)));  // true on the 100th poll
  CHECK(polls == 100);
  polls = 0;
  CHECK_FALSE(poll_for([&] { return ++polls < 0; }, ns(0)));  // never true: gives up
  CHECK(polls >= 32);  // the clock is read every 32 polls
  CHECK(meshlib::comm::detail::spin_window == ns(50'000));
}

}  // namespace MESHLIB_TEST_UNIT
