// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exception types of the comm layer. Every blocking call of every communicator ends in
/// one of these instead of hanging: a peer failed (`comm_aborted`), a peer never came
/// (`comm_timeout`), peers disagreed about the step (`collective_mismatch`), or the caller's own
/// arguments were wrong (`comm_argument_error`, thrown before any data moves).

#include <exception>
#include <string>

#include "meshlib/core/errors.hpp"

namespace meshlib {

/// @brief Base of every communicator failure. Once a communicator has failed it refuses every
/// further operation with an error of the root cause's type, naming the root cause.
class comm_error : public error {
 public:
  using error::error;
};

/// @brief A collective that not every participant reached within the communicator's timeout.
/// `what()` names the operation, the step and the ranks that never arrived.
class comm_timeout : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief The communicator was aborted: a participant threw, its thread ended while peers waited
/// for it, or the communicator was destroyed or aborted explicitly. `what()` names the rank that
/// failed first and why; every participant sees the same root cause.
class comm_aborted : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief Participants called different collectives in the same step (another operation, count,
/// element type, reduce op or root). Thrown on every participant; `what()` lists each rank's call.
class collective_mismatch : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief An invalid argument to a communicator operation (root or peer out of range, a negative or
/// overflowing count, a buffer shorter than its count, a forbidden alias, a ppermute with a
/// duplicate source or destination). Thrown before any data moves.
class comm_argument_error : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief Thrown by every runner and launcher (`run_on_threads`, `run_hybrid`, the runners of
/// exec/) when a participant failed: the root cause, with its rank. Here with the other comm errors
/// because every backend's launcher throws it, not only the thread backend's.
/// The participant's own exception is nested (`std::rethrow_if_nested(e)` or `rethrow_nested()`
/// rethrows it with its original type); `what()` is "meshlib: participant R of N failed: <its what()>".
class participant_error : public comm_error, public std::nested_exception {
 public:
  /// Must be constructed while the participant's exception is the current one (in a catch block).
  participant_error(int rank, const std::string& message) : comm_error(message), rank_(rank) {}
  /// Rank (in the world of the run) of the participant whose failure is the root cause.
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

}  // namespace meshlib
