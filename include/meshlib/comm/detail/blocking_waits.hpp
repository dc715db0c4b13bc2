// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::prefer_blocking_waits()`: whether this thread's waits in a host backend block
/// at once instead of spinning and yielding first.
///
/// Why a per-thread hint: a backend spins and yields because the waiting thread wants its answer
/// soon and a context switch costs more than a short spin. A communication worker
/// (collectives/comm_stream.hpp) is the opposite case: nothing waits on it but the device thread,
/// which is busy computing what the collective overlaps, so every spin or `sched_yield` of the
/// worker takes a core from that computation (8 device threads and 8 workers on 2 cores: measured
/// in docs/benchmarks.md, "Overlapped gradient synchronisation"). The worker sets it for its
/// lifetime; the thread backend's waits read it (comm/thread/detail/step_protocol.hpp).

namespace meshlib::comm::detail {

/// This thread's hint (see the file comment); false unless the thread sets it.
inline bool& prefer_blocking_waits() noexcept {
  thread_local bool block = false;
  return block;
}

}  // namespace meshlib::comm::detail

namespace meshlib::experimental {
/// Whether waits should block rather than spin (more device threads than cores).
using comm::detail::prefer_blocking_waits;
}  // namespace meshlib::experimental
