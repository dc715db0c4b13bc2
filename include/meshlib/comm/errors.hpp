// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exception types of the comm layer. Every blocking call of every communicator ends in
/// one of these instead of hanging: a peer failed (`comm_aborted`), a peer never came
/// (`comm_timeout`), peers disagreed about the step (`collective_mismatch`), or the caller's own
/// arguments were wrong (`comm_argument_error`, thrown before any data moves).

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

}  // namespace meshlib
