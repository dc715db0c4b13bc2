// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `fail_guard`: fails an MPI communicator when an exception leaves the guard's scope, so
/// that a rank that throws releases its peers within milliseconds instead of leaving them to wait
/// for the whole timeout. Apart from the communicator because it is a policy of the program (which
/// scope is "the step"), not of the handle.
///
/// When it is needed: any handle of a communicator that an exception unwinds fails it on its own
/// (`~mpi_communicator`), a copy of `meshlib::mpi::world()` included; but a handle whose scope is
/// wider than the step (made before the loop, the exception caught inside it) is not unwound, and
/// meshlib never sees the exception. One line in the rank's step makes the failure propagate:
///
/// @code
/// auto comm = meshlib::mpi::world();
/// for (int step = 0; step < steps; ++step) {
///   try {
///     meshlib::fail_guard on_throw(comm);  // a throw below fails comm: its peers get comm_aborted at once
///     train_step(comm);
///   } catch (const bad_batch&) { log_and_stop(); break; }
/// }
/// @endcode
///
/// The peers' waits on `comm` (and on its splits) then end with `comm_aborted` "meshlib:
/// communicator aborted: MPI rank R of N failed: an exception left the scope of a fail_guard
/// there (that rank's handler has its message)", and `root_cause_rank()` is R on every rank.

#if MESHLIB_ENABLE_MPI

#include <exception>

#include "meshlib/comm/mpi/mpi_communicator.hpp"

namespace meshlib {

/// @brief Fails `comm` (as `comm.fail(reason)`) when an exception unwinds the guard. Does nothing
/// when the scope ends normally, when the exception was caught within the scope, or when the
/// communicator has already failed (a timeout, mismatch or another rank's failure seen here is
/// not blamed on this rank). Not copyable: one guard, one scope.
class fail_guard {
 public:
  /// Guards `comm` (a handle on the same communicator is kept until the guard ends).
  explicit fail_guard(const mpi_communicator& comm) : comm_(comm) {}
  fail_guard(const fail_guard&) = delete;
  fail_guard& operator=(const fail_guard&) = delete;
  ~fail_guard() {
    if (std::uncaught_exceptions() > exceptions_at_birth_)
      comm_.fail_unless_failed("an exception left the scope of a fail_guard there (that rank's handler has its message)");
  }

 private:
  mpi_communicator comm_;
  int exceptions_at_birth_ = std::uncaught_exceptions();
};

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
