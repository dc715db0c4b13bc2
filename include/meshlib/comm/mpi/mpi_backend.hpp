// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `mpi_backend`: runs `spmd`, `shard_map` and `reshard` over MPI with one device per MPI
/// rank: a runner (the concept of `meshlib/exec/runner.hpp`, members as
/// `meshlib/collectives/backend.hpp` describes them): `run(n, body)` and `local_devices(n)`; a
/// mesh of n devices needs a communicator of n ranks. `meshlib/exec/mpi_runner.hpp` names it
/// `mpi_runner` too, beside `hybrid_backend` / `hybrid_runner` (threads in processes).
///
/// @code
/// meshlib::mpi::guard run;
/// meshlib::mesh<meshlib::axis<"data">> m{meshlib::mpi::world().size()};
/// auto sums = meshlib::spmd(m, [] { ... meshlib::psum<"data">(x) ... }, meshlib::mpi_backend{meshlib::mpi::world()});
/// @endcode
///
/// Faults: a device that throws makes `run` throw `participant_error` on its own process (with
/// its device id). `mpi_backend` also fails its communicator with that rank as the root cause
/// (`mpi_communicator::fail`): the ranks that wait for it in a collective or a receive are released
/// within milliseconds, and their `run` throws `participant_error` naming the failed rank (not
/// themselves) with its message. The communicator then refuses every later call on every rank
/// (an abandoned collective may still be pending on it): continue with a new one. When the
/// exception is not caught the whole run ends through `MPI_Abort` (the terminate handler of
/// `mpi::initialize`).

#if MESHLIB_ENABLE_MPI

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"

namespace meshlib {

/// @brief One device per MPI rank of `comm`.
struct mpi_backend {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The MPI communicator whose ranks are the devices (one device per rank).
  mpi_communicator comm;

  /// @brief Runs `body(device, communicator)` once, as this rank's device; `n` must equal the number of ranks.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    check(n);
    try {
      body(static_cast<std::size_t>(comm.rank()), comm);
    } catch (...) {
      const auto e = std::current_exception();
      const std::string what = detail::what_of(e);
      int blamed = comm.rank();
      try {
        std::rethrow_exception(e);
      } catch (const comm_aborted&) {
        // Released by another rank's failure: blame that rank.
        if (comm.root_cause_rank() >= 0) blamed = comm.root_cause_rank();
      } catch (const comm_timeout&) {
        // Every waiting rank times out on its own; the message names the ranks that never arrived.
      } catch (const collective_mismatch&) {
        // Every rank of the collective throws it.
      } catch (...) {
        comm.fail(what);  // the rank's own failure: release its peers at once
      }
      throw participant_error(blamed, "meshlib: MPI rank " + std::to_string(blamed) + " of " +
                                          std::to_string(comm.size()) + " failed: " + what);
    }
  }

  /// The device this process runs: its own rank.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    check(n);
    return {static_cast<std::size_t>(comm.rank())};
  }

 private:
  void check(std::size_t n) const {
    if (n != static_cast<std::size_t>(comm.size()))
      throw comm_argument_error("meshlib: mpi_backend runs one device per MPI rank, but the mesh has " +
                                std::to_string(n) + " devices and the communicator " + std::to_string(comm.size()) +
                                " ranks; use a mesh of " + std::to_string(comm.size()) +
                                " devices, or hybrid_backend for several devices (threads) per rank");
  }
};

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
