// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Who is blamed when a run fails: the one rule every launcher and runner applies
/// (`run_on_threads` and `thread_runner`, `mpi_runner`, `run_hybrid` and `hybrid_runner`,
/// `run_on_gpus`), so that a failure reads the same whatever runs the devices.
///
/// Each runner gathers the facts its backend knows (which local participant threw what, the
/// world's recorded root cause, what another process reported, the device whose call differed in
/// a mismatch) and `rethrow_root_cause` turns them into one `participant_error`. It lives in comm,
/// not exec, because `run_on_threads`, `run_hybrid` and `run_on_gpus` are comm's own launchers
/// and arrows point down; the exec runners call the same function.

#include <exception>
#include <span>
#include <string>
#include <string_view>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/errors.hpp"

namespace meshlib::comm::detail {

/// @brief What a run's participants on this process left behind (see the file comment). Ids
/// named "global" count every participant of the run, on every process.
struct run_failures {
  /// Per local participant: the exception it left with, or null.
  std::span<const std::exception_ptr> errors;
  /// The global id of local participant 0 (a process's first device; 0 in a one-process run).
  int first = 0;
  /// Participants in all.
  int size = 0;
  /// The local participant the world recorded as the root cause (the first to throw, or one that
  /// never arrived at a collective that timed out), even if it threw nothing itself; -1: none.
  int local_root = -1;
  /// The global id another process reported as the root cause; -1: none.
  int remote_root = -1;
  /// The global id of the participant whose call differed in a collective mismatch, as every
  /// member computed it; -1: none or unknown.
  int mismatch_culprit = -1;
  /// How messages name a participant: "participant", "MPI rank", "hybrid device".
  std::string_view noun = "participant";
};

/// The blamed participant (global id) and the local participant whose exception is reported.
struct blame {
  int participant = -1;
  int source = -1;
};

/// @brief The rule, in order (`source < 0`: nobody failed):
/// 1. A collective mismatch with no failure of a participant's own (an exception that is not a
///    communicator error) is blamed on the participant whose call differed: the same on every
///    process, not whichever saw it first.
/// 2. A failure another process reported, with no root cause here and no failure of our own, is
///    blamed on that process's participant.
/// 3. Otherwise the world's local root cause when it has one and nothing of our own outranks it
///    (a participant that threw an exception of its own is real, one that was late is not
///    necessarily), else the participant whose exception is reported.
/// The reported exception is the root cause's own when it threw, a participant's own failure when
/// another process is blamed meanwhile, else the lowest participant's that threw.
inline blame find_root_cause(const run_failures& f) {
  const int n = static_cast<int>(f.errors.size());
  auto threw = [&](int r) { return r >= 0 && r < n && f.errors[static_cast<std::size_t>(r)] != nullptr; };
  const bool local_root = f.local_root >= 0 && f.local_root < n;
  int root = threw(f.local_root) ? f.local_root : -1;
  for (int r = 0; r < n && root < 0; ++r)
    if (threw(r)) root = r;
  if (root < 0) return {};
  int own = -1, mismatched = -1;  // the lowest participant that failed on its own / with a mismatch
  for (int r = 0; r < n; ++r) {
    if (!threw(r)) continue;
    try {
      std::rethrow_exception(f.errors[static_cast<std::size_t>(r)]);
    } catch (const collective_mismatch&) {
      if (mismatched < 0) mismatched = r;
    } catch (const comm_error&) {
    } catch (...) {
      if (own < 0) own = r;
    }
  }
  if (own < 0 && mismatched >= 0 && f.mismatch_culprit >= 0) return {f.mismatch_culprit, mismatched};
  const int source = f.remote_root >= 0 && own >= 0 ? own : root;
  if (f.remote_root >= 0 && !local_root && own < 0) return {f.remote_root, source};
  return {f.first + (own < 0 && local_root ? f.local_root : source), source};
}

/// Throws `participant_error` for the root cause of `f` (see `find_root_cause`), naming it as
/// `name(global id)` ("participant 3 of 4", "hybrid device 5 of 8", "participant 1 of 2 (GPU 1)") with the
/// reported exception's message; returns when no participant failed.
template <class Name>
void rethrow_root_cause(const run_failures& f, Name&& name) {
  const blame b = find_root_cause(f);
  if (b.source < 0) return;
  const std::exception_ptr& e = f.errors[static_cast<std::size_t>(b.source)];
  try {
    std::rethrow_exception(e);
  } catch (...) {  // inside the handler, so participant_error nests the exception reported
    throw participant_error(b.participant, "meshlib: " + name(b.participant) + " failed: " + what_of(e));
  }
}

/// `rethrow_root_cause` naming participants as "<noun> <id> of <size>".
inline void rethrow_root_cause(const run_failures& f) {
  rethrow_root_cause(f, [&](int id) { return std::string(f.noun) + " " + std::to_string(id) + " of " + std::to_string(f.size); });
}

}  // namespace meshlib::comm::detail

namespace meshlib::experimental {
/// Rethrows the failure that caused the others (not an abort it triggered): the one root-cause rule every runner uses.
using comm::detail::rethrow_root_cause;
}  // namespace meshlib::experimental
