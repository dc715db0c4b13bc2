// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How the ranks of a thread group wait for each other and which algorithm a step takes:
/// `wait_policy` (spin, yield, block; the one-shot and streaming thresholds) with its measured
/// defaults. Apart from the group state because these are tuning
/// decisions (docs/benchmarks.md), made once per group from `thread_comm_options` and the core
/// count, not the shared state itself.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "meshlib/comm/detail/spin_then_block.hpp"
#include "meshlib/comm/thread/options.hpp"

namespace meshlib::comm::detail {

/// The waiting policy of one group: spin while a peer on another core is about to arrive (a cache
/// line moves between cores in ~60 ns), for at most `spin_window` (comm/detail/spin_then_block.hpp:
/// about what a block and wake-up cost), then block. Yield instead of spinning, for at most
/// `yield`, where the peer needs this core to arrive at all: it last ran on the waiter's CPU, or
/// there are more participants than cores (a context switch to a runnable peer is cheaper than a
/// wake-up). Where each participant has a core, yielding to no one made a late peer's waiter spin
/// through system calls for 2 ms (a core burnt for nothing) and see the peer's arrival only
/// between them.
struct wait_policy {
  std::chrono::nanoseconds spin;
  std::chrono::nanoseconds yield;  ///< yielding, when a peer shares this CPU or oversubscribed, before blocking
  bool oversubscribed;             ///< more participants than cores
  std::chrono::nanoseconds timeout;
  std::size_t one_shot_max;  ///< bytes staged per rank at or below which the one-shot algorithm runs
  int burst;                 ///< spins before the first clock reading
  std::size_t streaming_min; ///< payload bytes of all ranks from which zero-copy paths use streaming stores
};

/// Measured (docs/benchmarks.md): streaming stores pay once the payloads of all ranks no longer
/// fit in the caches: 16 MiB all_reduce 1.3x faster with them on 4 and 8 ranks, 1.35x slower on 2.
inline constexpr std::size_t default_streaming_min_bytes = std::size_t{64} << 20;

/// Measured on the 2-core reference machine (docs/benchmarks.md): below this many staged bytes per
/// rank, one synchronisation plus a copy beats two synchronisations and no copy. Oversubscribed, a
/// synchronisation costs context switches, so the one-shot algorithm pays for much longer.
inline std::size_t default_one_shot_max_bytes(bool oversubscribed) noexcept {
  return oversubscribed ? std::size_t{64} << 10 : std::size_t{2} << 10;
}

/// @brief How long this thread spins, at most `policy.spin`, before it yields: the spin budget
/// adapts to whether spinning has been paying off for it (issue 27).
///
/// Why: spinning only helps while the awaited peer runs on another core. When the peer shares
/// this thread's core (the scheduler put both there: on a loaded machine it happened for whole
/// runs of 2000 calls), it cannot arrive until this thread gives the core up, so every wait spun
/// its full budget first: ~107 us per 8 B all_reduce instead of ~0.5 us, on the raw communicator
/// and the typed collectives alike (docs/benchmarks.md). So a wait whose spinning ran out (a
/// miss) cuts this thread's budget to `floor`, and a wait that ended while spinning after having
/// had to spin at all doubles it back, up to the policy's; a wait that finds its peers already
/// there says nothing either way. Per thread, not per communicator: where a thread runs is a
/// property of the thread, and a `thread_runner` makes a fresh world every call.
class adaptive_spin {
 public:
  /// The budget after a miss: what a context switch costs, so a peer on another core that is a
  /// little late is still caught without a switch.
  static constexpr std::chrono::nanoseconds floor{1'000};

  /// This thread's current budget under a policy allowing `max`.
  static std::chrono::nanoseconds budget(std::chrono::nanoseconds max) noexcept {
    const std::chrono::nanoseconds b = current();
    return b.count() < 0 || b > max ? max : b;
  }
  /// A wait that had to spin ended while spinning: spinning pays here again.
  static void caught(std::chrono::nanoseconds max) noexcept {
    std::chrono::nanoseconds& b = current();
    if (b.count() >= 0) b = std::min(max, std::max(floor, 2 * b));
  }
  /// A wait spun its whole budget in vain.
  static void missed(std::chrono::nanoseconds max) noexcept {
    current() = std::min(max, floor);
    ++misses();
  }
  /// Misses of this thread so far (tests: how often a wait spun its budget in vain).
  static std::uint64_t& misses() noexcept {
    thread_local std::uint64_t n = 0;
    return n;
  }

 private:
  static std::chrono::nanoseconds& current() noexcept {
    thread_local std::chrono::nanoseconds b{-1};  // negative: the policy's budget, nothing learnt yet
    return b;
  }
};

/// `threads`: the world's participants, all of which may be running (a sub-group of 2 in a world of
/// 8 threads on 2 cores must yield, not spin).
inline wait_policy make_wait_policy(const thread_comm_options& o, int threads) {
  // Read once: hardware_concurrency reads /sys on every call (11 us here), and every group (a
  // world per spmd call, a sub-group per axis used) asks.
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool oversubscribed = static_cast<unsigned>(threads) > cores;
  wait_policy p{};
  p.spin = o.spin.count() >= 0 ? o.spin
                               : (oversubscribed ? std::chrono::nanoseconds(0) : spin_window);
  p.yield = o.yield.count() >= 0 ? o.yield : std::chrono::nanoseconds(2'000'000);
  p.oversubscribed = oversubscribed;
  p.timeout = o.timeout;
  p.burst = oversubscribed ? 2 : 64;
  p.streaming_min = o.streaming_min_bytes != 0 ? o.streaming_min_bytes : default_streaming_min_bytes;
  p.one_shot_max = o.one_shot_max_bytes != 0 ? o.one_shot_max_bytes : default_one_shot_max_bytes(oversubscribed);
  return p;
}

}  // namespace meshlib::comm::detail
