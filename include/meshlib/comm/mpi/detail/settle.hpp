// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `settle_messages`: before meshlib frees one of its own MPI communicators that carries
/// unsolicited point-to-point messages (arrival notes, the hybrid abort channel), every rank
/// receives the messages still in flight to it. Internal to the MPI communicators.
///
/// Why: a message that arrives after `MPI_Comm_free` waits inside MPI for whichever communicator
/// later gets the freed one's context id, and OpenMPI 4.1 matches it there when that communicator
/// is created: it crashed in `mca_pml_ob1_add_comm` (under `MPI_Comm_dup`) when the new
/// communicator had fewer ranks than the message's source. A communicator that cannot be
/// settled is left allocated instead, so its context id is never reused.

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

namespace meshlib::comm::detail {

/// @brief Exchanges how many messages with tag `tag` each rank sent to each other rank on `comm`
/// (one all-to-all: freeing `comm` is collective anyway), then receives and drops the ones not
/// yet received (`received` counts per source, updated). Returns false when a peer does not take
/// part within `grace` or MPI fails: the caller must then not free `comm`.
///
/// `clean`, when given, is this rank's vote that the communicators it closes with `comm` carry no
/// abandoned operation (no timeout, no failure); it travels in the same all-to-all and comes back
/// true only when every rank voted so (false when the exchange fails). A rank that left cleanly
/// learns this way that a peer abandoned a collective whose messages may still reach it.
inline bool settle_messages(MPI_Comm comm, int tag, const std::vector<std::uint64_t>& sent,
                            std::vector<std::uint64_t>& received, std::chrono::milliseconds grace,
                            bool* clean = nullptr) noexcept {
  const int size = static_cast<int>(sent.size());
  if (size <= 1) return true;
  const bool mine = clean == nullptr || *clean;
  if (clean != nullptr) *clean = false;  // until every rank's vote is in
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + grace;
  // Heap buffers, released only on success: when a peer never joins, MPI keeps the all-to-all
  // pending and may still read and write them. Two words per peer: the count and the vote.
  auto* out = new std::vector<std::uint64_t>(2 * sent.size());
  auto* in = new std::vector<std::uint64_t>(2 * sent.size(), 0);
  for (std::size_t p = 0; p < sent.size(); ++p) {
    (*out)[2 * p] = sent[p];
    (*out)[2 * p + 1] = mine ? 1 : 0;
  }
  MPI_Request r = MPI_REQUEST_NULL;
  if (MPI_Ialltoall(out->data(), 2, MPI_UINT64_T, in->data(), 2, MPI_UINT64_T, comm, &r) != MPI_SUCCESS)
    return false;
  for (int done = 0; !done;) {
    if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) break;
    if (clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  delete out;
  bool all_clean = true;
  for (std::size_t p = 0; p < sent.size(); ++p) all_clean = all_clean && (*in)[2 * p + 1] != 0;
  std::vector<char> sink;
  for (int peer = 0; peer < size; ++peer) {
    const auto p = static_cast<std::size_t>(peer);
    while (received[p] < (*in)[2 * p]) {
      int found = 0;
      MPI_Status st;
      if (MPI_Iprobe(peer, tag, comm, &found, &st) != MPI_SUCCESS) return false;
      if (!found) {
        if (clock::now() > deadline) return false;
        std::this_thread::yield();
        continue;
      }
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      sink.resize(static_cast<std::size_t>(bytes > 0 ? bytes : 1));
      if (MPI_Recv(sink.data(), bytes, MPI_BYTE, peer, tag, comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
      ++received[p];
    }
  }
  delete in;
  if (clean != nullptr) *clean = all_clean;
  return true;
}

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_MPI
