// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The abort channel: how one process tells the others that a participant failed, so that
/// their waits end within milliseconds instead of at the timeout. Used by `mpi_communicator`
/// (participants are MPI ranks) and `hybrid_world` (participants are global devices).

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/mpi/detail/settle.hpp"
#include "meshlib/comm/mpi/detail/watcher_threads.hpp"

namespace meshlib::comm::detail {

/// Fault propagation between processes, shared by the MPI communicator (one rank per process) and
/// the hybrid world. Each process posts one receive on a duplicate communicator of its own. When a
/// participant fails, its process sends "<epoch><participant><kind><what>" to every other process (once);
/// a process that receives it (`poll`, called by the MPI waits of `mpi_communicator`, or by the
/// hybrid world's watcher thread every millisecond) records the root cause (`interrupt`), and its
/// waits end with the root cause's error (`check`): `comm_aborted` naming the participant that
/// failed, or the `comm_timeout` or `collective_mismatch` that another process detected. The owner names participants
/// (an MPI rank, a global hybrid device).
struct abort_channel {
  MPI_Comm comm = MPI_COMM_NULL;
  int process = 0;
  int processes = 1;
  bool enabled = false;
  /// Which hybrid world of this run the channel belongs to (every process opens its worlds in the
  /// same order: construction is collective). MPI may give a new duplicate the context id of a
  /// freed one, so a message sent to an earlier world can arrive here: it is recognised by its
  /// epoch and dropped.
  std::uint64_t epoch = 0;
  std::atomic<bool> interrupted{false};  ///< this process's devices must stop (a local or remote failure)
  std::atomic<int> remote_device{-1};    ///< the global device of a failure reported by another process
  std::atomic<int> root_cause{-1};       ///< the participant of the first recorded failure (-1: unnamed)
  /// The participant whose call differed in a collective mismatch (-1: none known). Every member
  /// of the mismatched collective computes it from every member's call, so it is the same on every
  /// process; processes that were not members learn it from the report (`notify`'s participant).
  std::atomic<int> mismatch_culprit{-1};
  std::mutex mutex;
  std::string message;                   ///< the root cause's message (guarded by mutex)
  failure_kind kind = failure_kind::aborted;  ///< the root cause's kind: the error waits throw (guarded by mutex)
  bool sent = false;                     ///< guarded by mutex
  std::vector<char> inbox = std::vector<char>(4096);
  MPI_Request inbox_request = MPI_REQUEST_NULL;
  std::vector<std::pair<MPI_Request, std::vector<char>>> outbox;  ///< guarded by mutex
  std::vector<std::uint64_t> sent_to;        ///< messages sent to each process (guarded by mutex)
  std::vector<std::uint64_t> received_from;  ///< messages received from each process (by the poller)
  std::atomic<bool> stop{false};
  std::mutex nap_mutex;              ///< with nap_cv: close() wakes a napping watcher at once
  std::condition_variable nap_cv;

  /// Waits up to `d` (the watcher's pause between polls), returning at once when the channel is
  /// closed: a watcher that slept its full pause made every hybrid call's close wait for it (up to
  /// a millisecond a call).
  void nap(std::chrono::milliseconds d) {
    std::unique_lock lk(nap_mutex);
    nap_cv.wait_for(lk, d, [this] { return stop.load(); });
  }
  watcher_threads::job watcher;          ///< the hybrid world's poller (the MPI communicator polls from its waits)
  std::mutex poll_mutex;                 ///< one poller at a time (threads may share a split's channel)
  bool closed = false;

  abort_channel() = default;
  abort_channel(const abort_channel&) = delete;
  abort_channel& operator=(const abort_channel&) = delete;
  ~abort_channel() { close(std::chrono::milliseconds(1000)); }

  /// Every process opens its channels in the same order (construction of the owners is
  /// collective), so this counter names the same channel on every process.
  static std::uint64_t next_epoch() {
    static std::atomic<std::uint64_t> channels{0};
    return ++channels;
  }

  /// Collective over `parent`: duplicates it and posts the receive (when `enable`).
  void open(MPI_Comm parent, bool enable) {
    MPI_Comm_rank(parent, &process);
    MPI_Comm_size(parent, &processes);
    epoch = next_epoch();
    enabled = enable && processes > 1;
    sent_to.assign(static_cast<std::size_t>(processes), 0);
    received_from.assign(static_cast<std::size_t>(processes), 0);
    if (!enabled) return;
    if (MPI_Comm_dup(parent, &comm) != MPI_SUCCESS) throw comm_error("meshlib: abort channel: MPI_Comm_dup failed");
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    post();
  }
  void post() {
    MPI_Irecv(inbox.data(), static_cast<int>(inbox.size()), MPI_CHAR, MPI_ANY_SOURCE, 0, comm, &inbox_request);
  }

  /// The header of a report: epoch, participant, kind (`failure_kind`).
  static constexpr std::size_t head = sizeof(std::uint64_t) + 2 * sizeof(int);

  /// Tests for a report from another process: true (with its participant, message and kind) once
  /// one of this channel's epoch has arrived; reports meant for an earlier channel are dropped.
  bool poll(int& device, std::string& what, failure_kind& reported) {
    if (!enabled || stop.load()) return false;
    std::unique_lock lk(poll_mutex, std::try_to_lock);
    if (!lk.owns_lock() || inbox_request == MPI_REQUEST_NULL) return false;
    int done = 0;
    MPI_Status st;
    MPI_Test(&inbox_request, &done, &st);
    if (!done) return false;
    ++received_from[static_cast<std::size_t>(st.MPI_SOURCE)];
    int bytes = 0;
    MPI_Get_count(&st, MPI_CHAR, &bytes);
    std::uint64_t e = 0;
    int wire_kind = 0;
    if (bytes >= static_cast<int>(head)) {
      std::memcpy(&e, inbox.data(), sizeof(std::uint64_t));
      std::memcpy(&device, inbox.data() + sizeof(std::uint64_t), sizeof(int));
      std::memcpy(&wire_kind, inbox.data() + sizeof(std::uint64_t) + sizeof(int), sizeof(int));
    }
    if (e != epoch) {  // meant for an earlier channel (MPI reuses a freed duplicate's context id)
      post();
      return false;
    }
    what.assign(inbox.data() + head, static_cast<std::size_t>(bytes) - head);
    reported = wire_kind == 1 ? failure_kind::timeout : wire_kind == 2 ? failure_kind::mismatch : failure_kind::aborted;
    remote_device.store(device);
    return true;
  }

  /// Records the root cause (`participant` failed, -1 when the owner does not name it) once and
  /// releases the waits that check the channel.
  /// `k`: the error the waits then throw (a timeout or mismatch seen elsewhere keeps its type).
  void interrupt(const std::string& msg, int participant = -1, failure_kind k = failure_kind::aborted) {
    std::lock_guard lk(mutex);
    if (interrupted.load()) return;
    message = msg;
    kind = k;
    root_cause.store(participant);
    interrupted.store(true, std::memory_order_release);
  }
  /// Records the participant whose call differed in a collective mismatch (the first one wins:
  /// every member computes the same).
  void blame_mismatch(int participant) noexcept {
    int none = -1;
    mismatch_culprit.compare_exchange_strong(none, participant);
  }
  /// The leaders' MPI waits call this (mpi_comm_state::check_interrupt).
  void check() {
    if (interrupted.load(std::memory_order_acquire)) rethrow("");
  }
  /// The recorded root cause: its kind, and its message in `msg`.
  failure_kind recorded(std::string& msg) {
    std::lock_guard lk(mutex);
    msg = message;
    return kind;
  }
  /// Throws the recorded root cause (its kind's error) with `suffix` appended.
  [[noreturn]] void rethrow(const std::string& suffix) {
    std::string m;
    failure_kind k;
    {
      std::lock_guard lk(mutex);
      m = message + suffix;
      k = kind;
    }
    throw_failure(k, std::move(m));
  }
  /// Tells every other process that participant `device` failed (`k` aborted), or that a timeout
  /// or collective mismatch was seen here, with `what` (once per channel).
  void notify(int device, const std::string& what, failure_kind k = failure_kind::aborted) {
    if (!enabled) return;
    std::lock_guard lk(mutex);
    if (sent) return;
    sent = true;
    const int wire_kind = static_cast<int>(k);
    std::vector<char> msg(head + std::min<std::size_t>(what.size(), inbox.size() - head));
    std::memcpy(msg.data(), &epoch, sizeof(std::uint64_t));
    std::memcpy(msg.data() + sizeof(std::uint64_t), &device, sizeof(int));
    std::memcpy(msg.data() + sizeof(std::uint64_t) + sizeof(int), &wire_kind, sizeof(int));
    std::memcpy(msg.data() + head, what.data(), msg.size() - head);
    for (int p = 0; p < processes; ++p) {
      if (p == process) continue;
      outbox.emplace_back(MPI_REQUEST_NULL, msg);
      auto& [req, buf] = outbox.back();
      MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, p, 0, comm, &req);
      ++sent_to[static_cast<std::size_t>(p)];
    }
  }
  /// Ends the watcher and completes or abandons the channel's requests (at most `grace` for the sends).
  void close(std::chrono::milliseconds grace) noexcept {
    if (closed) return;
    closed = true;
    {
      std::lock_guard lk(nap_mutex);  // a watcher between its check and its wait sees the flag
      stop.store(true);
    }
    nap_cv.notify_all();
    if (watcher.joinable()) watcher.join();
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin || !enabled) return;
    if (inbox_request != MPI_REQUEST_NULL) {
      MPI_Cancel(&inbox_request);
      MPI_Status st;
      MPI_Wait(&inbox_request, &st);
      int cancelled = 0;
      MPI_Test_cancelled(&st, &cancelled);
      if (!cancelled && st.MPI_SOURCE >= 0 && st.MPI_SOURCE < processes)
        ++received_from[static_cast<std::size_t>(st.MPI_SOURCE)];
    }
    const auto deadline = std::chrono::steady_clock::now() + grace;
    bool pending = false;
    for (auto& [req, buf] : outbox) {
      int done = 0;
      while (req != MPI_REQUEST_NULL && !done && std::chrono::steady_clock::now() < deadline) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (req != MPI_REQUEST_NULL && !done) {
        pending = true;
        MPI_Request_free(&req);  // MPI finishes it on its own, reading buf: leak it on purpose
        (void)new std::vector<char>(std::move(buf));
      }
    }
    // Failure messages still in flight to this process must be received before the free
    // (detail/settle.hpp says why); when they cannot be, the duplicate stays allocated.
    if (!pending && settle_messages(comm, 0, sent_to, received_from, grace)) MPI_Comm_free(&comm);
  }
};

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_MPI
