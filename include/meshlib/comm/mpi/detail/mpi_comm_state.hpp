// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `mpi_comm_state`: the MPI state that the handles of one `mpi_communicator` share, and
/// its teardown (buffered sends given the timeout, `settle_messages` before the communicators are
/// freed). Apart from the communicator because its lifetime rules (what may be freed, and when,
/// after a failure) are a subject of their own. Internal to the MPI communicators.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "meshlib/comm/mpi/detail/abort_channel.hpp"
#include "meshlib/comm/mpi/detail/settle.hpp"
#include "meshlib/comm/mpi/mpi_comm_options.hpp"

namespace meshlib::comm::detail {

/// The MPI state shared by the handles of one communicator.
struct mpi_comm_state {
  MPI_Comm adopted = MPI_COMM_NULL;  ///< the application's communicator; never freed
  MPI_Comm comm = MPI_COMM_NULL;     ///< meshlib's own (a dup or a split result); freed by meshlib
  /// A duplicate of `comm` for arrival notes: a rank that waits long in a collective tells its
  /// peers which call it waits in, so that a timeout can name the ranks that never arrived.
  MPI_Comm side = MPI_COMM_NULL;
  std::vector<std::uint64_t> peer_waits_in;  ///< per rank: 1 + the call it last said it waits in (0: none)
  static constexpr int arrival_tag = 1;      ///< the tag of arrival notes on `side`
  std::vector<std::uint64_t> notes_sent;     ///< per rank: arrival notes sent to it on `side`
  std::vector<std::uint64_t> notes_received; ///< per rank: arrival notes received from it on `side`
  int rank = 0;
  int size = 0;
  int tag_ub = 32767;
  /// Whether this node runs more ranks (of the adopted communicator) than it has cores.
  bool oversubscribed = false;
  mpi_comm_options options;
  bool failed = false;
  bool failed_by_mismatch = false;  ///< else a timeout
  std::string failure;
  /// Whether a handle that an exception unwinds fails the communicator (`~mpi_communicator`): the
  /// application's communicators and their splits, not a hybrid world's own.
  bool fail_on_unwind = false;
  /// A timeout of the fingerprint exchange: the ranks that never said they arrived (empty: unknown,
  /// or every rank arrived late), so that an owner can name them its own way (hybrid devices).
  std::vector<int> missing;
  std::uint64_t calls = 0;  ///< collectives called on this communicator (the fingerprint's sequence number)
  /// Set by an owner that can fail this communicator from outside (a hybrid world whose device
  /// failed, here or in another process): called by every wait while it polls, it throws that
  /// failure. Copied into split results.
  std::function<void()> check_interrupt;
  /// The abort channel of the adopted communicator (shared by its splits): `fail` reports through
  /// it, and every polled wait (through `check_interrupt`) ends when another rank has reported.
  std::shared_ptr<abort_channel> channel;
  struct pending_send {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> data;
  };
  std::vector<pending_send> sends;

  mpi_comm_state() = default;
  mpi_comm_state(const mpi_comm_state&) = delete;
  mpi_comm_state& operator=(const mpi_comm_state&) = delete;

  ~mpi_comm_state() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // nothing can be freed any more
    // Buffered sends still in flight: give them the timeout to complete, then leave them to MPI.
    const auto deadline = std::chrono::steady_clock::now() + (options.timeout.count() > 0 ? options.timeout : std::chrono::nanoseconds(0));
    for (auto& s : sends) {
      int done = 0;
      while (s.request != MPI_REQUEST_NULL && !done) {
        MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
        if (!done && std::chrono::steady_clock::now() > deadline) break;
        if (!done) std::this_thread::yield();
      }
      if (!done && s.request != MPI_REQUEST_NULL) {
        MPI_Request_free(&s.request);  // allowed for point-to-point: MPI finishes it on its own
        // ... reading the buffer until then, so it must outlive this object: leak it on purpose.
        (void)new std::vector<unsigned char>(std::move(s.data));
      }
    }
    // `comm` is freed only when no rank left an operation pending on it. A rank that timed out,
    // or whose waits were released by a failure (the abort channel), abandoned a non-blocking
    // collective that MPI cannot cancel: it may still send to every rank, and a message that
    // arrives after the free waits for the next communicator given the same context id
    // (detail/settle.hpp). Every rank votes in the settle exchange of `side`, which also
    // receives the arrival notes still in flight; a rank that cannot settle keeps both.
    // A mismatch is detected after the exchanges complete on every rank: nothing is pending.
    const bool interrupted = channel && channel->interrupted.load(std::memory_order_acquire);
    bool clean = !interrupted && (!failed || failed_by_mismatch);
    const bool settled =
        side == MPI_COMM_NULL ||
        settle_messages(side, arrival_tag, notes_sent, notes_received, std::chrono::milliseconds(1000), &clean);
    if (comm != MPI_COMM_NULL && settled && clean) MPI_Comm_free(&comm);
    if (side != MPI_COMM_NULL && settled) MPI_Comm_free(&side);
  }
};

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_MPI
