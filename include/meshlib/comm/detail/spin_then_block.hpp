// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How a host thread waits for another: poll for a bounded window (`poll_for`,
/// `spin_window`), then block. One path for every waiter that spins before it sleeps: the thread
/// communicator's steps (comm/thread/detail/step_protocol.hpp) and the persistent device threads
/// (exec/detail/device_workers.hpp).
///
/// Why spin first, and for how long: a futex wake-up of a sleeping thread costs far more than a
/// cache line moving between cores (~0.1 us). Measured on the 2-core reference VM
/// (`comm_bench --wake-latency`, 2026-12-05, docs/benchmarks.md, "Waiting and the large
/// all_reduce"): a blocked thread woken from another CPU runs 25-28 us after the wake-up call
/// (median; p90 35-40 us), 4-6 us when woken on the waker's CPU; an idle vCPU took 27-50 us
/// (2026-12-01). Spinning for as long as a block and wake-up cost is never more than twice as slow
/// as the better of the two (the classic competitive bound), and spinning longer only burns a core
/// that a peer, or the computation an overlapped collective hides, could use. Hence `spin_window`
/// = 50 us, above the p90 of a wake-up across CPUs.
///
/// Why the sleeper pays for the fence: a waiter that goes to sleep announces it (a counter) and
/// then re-checks its condition; the thread that makes the condition true stores, then reads the
/// counter and wakes only if someone sleeps. Without a full fence on both sides each can miss the
/// other's store (store buffering) and the sleeper oversleeps until its next re-check. A fence on
/// the waker's side costs every collective a cache-line round trip on the critical path (0.2 us
/// calls), so the sleeper issues a process-wide barrier instead (`sleeper_fence`: Linux
/// `membarrier`, a few microseconds, paid only by a thread about to block), and the waker only
/// keeps the compiler from reordering (`waker_fence`), the asymmetric Dekker handshake.

#include <atomic>
#include <chrono>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__linux__) && __has_include(<linux/membarrier.h>)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MESHLIB_DETAIL_HAS_MEMBARRIER 1
#else
#define MESHLIB_DETAIL_HAS_MEMBARRIER 0
#endif

namespace meshlib::comm::detail {

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

/// How long a waiter whose peers each have a core polls before it blocks (see the file comment).
inline constexpr std::chrono::nanoseconds spin_window{50'000};

/// Polls `done()` for at most `budget` (the clock is read every 32 polls); true as soon as it
/// holds, false when the budget ran out first.
template <class Done>
bool poll_for(Done&& done, std::chrono::nanoseconds budget) {
  const auto start = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if ((i & 31u) == 0 && std::chrono::steady_clock::now() - start > budget) return done();
  }
}

/// The CPU the calling thread runs on, or -1 where that is unknown: a hint for a waiter whose peer
/// shares its core, which spinning cannot help (glibc reads it from rseq: no system call).
inline int current_cpu() noexcept {
#if defined(__linux__)
  return ::sched_getcpu();
#else
  return -1;
#endif
}

/// The waker's half of the handshake (see the file comment): between its store that makes a
/// waiter's condition true and its read of whether anyone sleeps. Free at run time.
inline void waker_fence() noexcept { std::atomic_signal_fence(std::memory_order_seq_cst); }

/// The sleeper's half: between announcing that it sleeps and re-checking its condition. Returns
/// whether it was a process-wide barrier; when not (no `membarrier`), a waker may miss the
/// sleeper, which must then re-check its condition on a short period.
/// No `std::atomic_thread_fence` here: the announcement is a seq_cst read-modify-write and the
/// system call is a full barrier itself (and ThreadSanitizer builds refuse thread fences).
inline bool sleeper_fence() noexcept {
#if MESHLIB_DETAIL_HAS_MEMBARRIER
  static const bool registered =
      ::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  return registered && ::syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
#else
  return false;
#endif
}

}  // namespace meshlib::comm::detail

namespace meshlib::experimental {
/// The CPU the calling thread runs on, or -1 where unknown.
using comm::detail::current_cpu;

/// How long `poll_for` spins before it blocks.
using comm::detail::spin_window;

/// Spins for a while, then blocks: the wait every backend and runner uses.
using comm::detail::poll_for;
}  // namespace meshlib::experimental
