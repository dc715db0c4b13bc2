// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How the ranks of a thread group wait for each other and which algorithm a step takes:
/// `wait_policy` (spin, yield, block; the one-shot and streaming thresholds) with its measured
/// defaults, and `cpu_relax` for the spinning. Apart from the group state because these are tuning
/// decisions (docs/benchmarks.md), made once per group from `thread_comm_options` and the core
/// count, not the shared state itself.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <thread>

#include "meshlib/comm/thread/options.hpp"

namespace meshlib::detail {

/// Tells the core that this is a spin-wait loop (frees resources for the sibling hyper-thread and
/// avoids the memory-order mis-speculation penalty when the awaited line changes).
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  // The builtin behind _mm_pause (GCC and Clang): <immintrin.h> would cost every TU that includes
  // meshlib ~0.6 s of parsing for this one instruction (docs/benchmarks.md, include cost).
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// The waiting policy of one group: spin while a peer on another core is about to arrive (a cache
/// line moves between cores in ~60 ns), yield when there are more participants than cores (the
/// peer needs this core to arrive at all), block on a futex only after that (a futex wake costs
/// 35-40 us here, 600 cache-line handoffs).
struct wait_policy {
  std::chrono::nanoseconds spin;
  std::chrono::nanoseconds yield;
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

/// `threads`: the world's participants, all of which may be running (a sub-group of 2 in a world of
/// 8 threads on 2 cores must yield, not spin).
inline wait_policy make_wait_policy(const thread_comm_options& o, int threads) {
  // Read once: hardware_concurrency reads /sys on every call (11 us here), and every group (a
  // world per spmd call, a sub-group per axis used) asks.
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool oversubscribed = static_cast<unsigned>(threads) > cores;
  wait_policy p{};
  p.spin = o.spin.count() >= 0 ? o.spin
                               : (oversubscribed ? std::chrono::nanoseconds(0) : std::chrono::nanoseconds(50'000));
  p.yield = o.yield.count() >= 0 ? o.yield : std::chrono::nanoseconds(2'000'000);
  p.timeout = o.timeout;
  p.burst = oversubscribed ? 2 : 64;
  p.streaming_min = o.streaming_min_bytes != 0 ? o.streaming_min_bytes : default_streaming_min_bytes;
  p.one_shot_max = o.one_shot_max_bytes != 0 ? o.one_shot_max_bytes : default_one_shot_max_bytes(oversubscribed);
  return p;
}

}  // namespace meshlib::detail
