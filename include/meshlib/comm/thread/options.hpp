// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `thread_comm_options`: the knobs of the thread communicator, with defaults that were
/// measured on a 2-core machine (see docs/benchmarks.md). The timeout default they start from is
/// the comm layer's (comm/timeout.hpp), shared by every backend.

#include <chrono>
#include <cstddef>

#include "meshlib/comm/timeout.hpp"

namespace meshlib {

/// @brief Options of a `thread_world`.
/// @code
/// meshlib::thread_world world(4, {.timeout = std::chrono::seconds(2)});
/// @endcode
struct thread_comm_options {
  /// How long a participant waits for its peers in one step before `comm_timeout`.
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// The one-shot algorithm (each rank copies its payload into a shared slot; one
  /// synchronisation) runs while the bytes each rank stages are at most this (for all_reduce and
  /// reduce: times the number of ranks, because there each rank then reads every payload whole);
  /// above it the zero-copy algorithm runs (peers read each other's buffers; two
  /// synchronisations). 0: the measured default, 2 KiB when each participant has a core, 64 KiB
  /// when there are more participants than cores (each synchronisation then costs context switches).
  std::size_t one_shot_max_bytes = 0;
  /// Payload of all ranks together (bytes per rank times ranks) from which the zero-copy
  /// algorithms write with non-temporal (streaming) stores, which skip the read-for-ownership of
  /// lines that will not be read again soon and leave the caches to the inputs. 0: the measured
  /// default (64 MiB); SIZE_MAX: never.
  std::size_t streaming_min_bytes = 0;
  /// How long a waiting participant spins, at most, before it blocks. Negative: the measured
  /// default (`detail::spin_window`, 50 us: about what a block and wake-up cost), none when there
  /// are more participants than cores. A participant that spun in vain spins less next time.
  std::chrono::nanoseconds spin = std::chrono::nanoseconds(-1);
  /// How long a waiting participant yields its core before it blocks, where the peer it waits for
  /// needs that core (it last ran on the same CPU, or there are more participants than cores);
  /// instead of spinning in the first case, after it in the second. Negative: default (2 ms).
  std::chrono::nanoseconds yield = std::chrono::nanoseconds(-1);
  /// `run_on_threads` only: pin participant r to the r-th CPU the process may run on (modulo their
  /// number), as OpenMPI binds its ranks to cores; the calling thread's affinity is restored when
  /// it returns. Keeps two communicating participants from sharing a core on a busy machine.
  /// Linux only; ignored elsewhere.
  bool pin_threads = false;
};

}  // namespace meshlib
