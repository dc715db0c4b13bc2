// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `mpi_comm_options`: the knobs of an `mpi_communicator`. Its own header because the
/// hybrid world and the MPI runtime configure MPI communicators too, and the options are public
/// API that reads better apart from the communicator's internals.

#if MESHLIB_ENABLE_MPI

#include <chrono>
#include <cstddef>

#include "meshlib/comm/timeout.hpp"

namespace meshlib {

/// @brief Options of an `mpi_communicator`.
struct mpi_comm_options {
  /// How long a rank waits for its peers in one operation before `comm_timeout`. Zero or
  /// negative: no deadline (MPI's blocking calls throughout).
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// Payloads (bytes per rank) at least this large are "large" (see `large_payloads`); smaller
  /// ones run MPI's non-blocking collective, polled. Default 0: every payload, because the
  /// fingerprint exchange that precedes each collective already shows that every rank arrived (so
  /// the blocking call cannot hang), and a polled `MPI_Iallreduce` of 8 B costs about 1.5 us more
  /// than `MPI_Allreduce` (docs/benchmarks.md, "MPI overhead").
  std::size_t blocking_min_bytes = 0;
  /// How large payloads wait under a deadline.
  enum class large_payload_mode {
    automatic,              ///< barrier then blocking, unless the node's ranks outnumber its cores
    barrier_then_blocking,  ///< a polled `MPI_Ibarrier`, then MPI's blocking collective
    nonblocking,            ///< MPI's non-blocking collective, polled
  };
  /// How payloads of `blocking_min_bytes` or more wait under a deadline (see `large_payload_mode`).
  large_payload_mode large_payloads = large_payload_mode::automatic;
  /// bfloat16 reductions: false (default) widens to float, reduces with MPI's float ops and rounds
  /// once (bitwise equal to the thread backend: sums in rank order, `detail/ordered_reduce.hpp`);
  /// true sends 16-bit values and combines them with a user-defined op in float, rounding after
  /// every combination (half the traffic; each combination may lose half an ulp of bfloat16).
  bool bfloat16_on_wire = false;
  /// Kept for source compatibility and ignored: every collective is checked (see the file comment).
  bool verify_collectives = true;
};

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
