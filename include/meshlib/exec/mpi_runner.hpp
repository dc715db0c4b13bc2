// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The multi-process runners (exec/runner.hpp): `mpi_runner` (one device per MPI rank)
/// and `hybrid_runner` (P processes x T device threads: device `p*T + t` is thread t of process p).
///
/// The device threads of a hybrid mesh are persistent, as a `thread_runner`'s: a `hybrid_runner`
/// owns threads of its own for as long as the user keeps it, and the default runner's runs them on
/// the process-wide hybrid device threads. What each call still builds is its hybrid world (the
/// communicators: a duplicate of the process communicator for the leaders, one for point-to-point
/// and the abort channel with its watcher thread), collectively over the processes, and frees it
/// at the end of the call (its messages settled first, comm/mpi/detail/settle.hpp). Why not keep
/// the world too: a world that failed refuses every later call, and a clean one would carry a
/// call's unreceived point-to-point messages and its collective sequence numbers into the next
/// call; a fresh world gives every call the error isolation of a new communicator. The price is
/// about 0.13 ms a call on 2 processes x 2 threads (bench/hybrid_bench, docs/benchmarks.md); the
/// watcher runs on a thread that parks between calls (comm/mpi/detail/watcher_threads.hpp).
///
/// Device threads of a hybrid mesh are not pinned to cores: every process of a node would pin
/// its thread `t` to the same core `t` (MPI launchers bind processes to cores themselves).
/// @code
/// meshlib::mpi::guard run;                                        // mpirun -np 2
/// meshlib::hybrid_runner runner(meshlib::mpi::world(), 4);        // 2 processes x 4 threads
/// meshlib::mesh<meshlib::axis<"process">, meshlib::axis<"thread">> m{2, 4};
/// for (int step = 0; step < 1000; ++step)
///   meshlib::spmd(m, [] { /* one step */ }, runner);             // the same 3 worker threads every step
/// @endcode

#if MESHLIB_ENABLE_MPI

#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/detail/root_cause.hpp"
#include "meshlib/comm/mpi/hybrid_communicator.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/exec/detail/device_workers.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/thread_runner.hpp"

namespace meshlib {

/// @brief One device per MPI rank of `comm`: `run(n, body)` runs `body` once, as this rank's
/// device; a mesh of n devices needs a communicator of n ranks. It has no threads to keep: the
/// device is the process.
///
/// Faults: a device that throws makes `run` throw `participant_error` on its own process (with
/// its device id). `mpi_runner` also fails its communicator with that rank as the root cause
/// (`mpi_communicator::fail`): the ranks that wait for it in a collective or a receive are released
/// within milliseconds, and their `run` throws `participant_error` naming the failed rank (not
/// themselves) with its message. The communicator then refuses every later call on every rank
/// (an abandoned collective may still be pending on it): continue with a new one. When the
/// exception is not caught the whole run ends through `MPI_Abort` (the terminate handler of
/// `mpi::initialize`).
/// @code
/// meshlib::mpi::guard run;
/// meshlib::mesh<meshlib::axis<"data">> m{meshlib::mpi::world().size()};
/// auto sums = meshlib::spmd(m, [] { ... meshlib::psum<"data">(x) ... }, meshlib::mpi_runner{meshlib::mpi::world()});
/// @endcode
struct mpi_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The MPI communicator whose ranks are the devices (one device per rank).
  mpi_communicator comm;

  /// @brief Runs `body(device, communicator)` once, as this rank's device; `n` must equal the number of ranks.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    check(n);
    // The body's handles leave the report of its exception to the catch below, which sends the
    // exception's own message (an unwound handle could only say that an exception left its scope).
    mpi_communicator device = comm;
    device.set_fail_on_unwind(false);
    try {
      body(static_cast<std::size_t>(comm.rank()), std::as_const(device));
    } catch (...) {
      const auto e = std::current_exception();
      int remote = -1;
      try {
        std::rethrow_exception(e);
      } catch (const comm_aborted&) {
        // Released by another rank's failure: that rank is the root cause.
        remote = comm.root_cause_rank();
      } catch (const comm_timeout&) {
        // Every waiting rank times out on its own; the message names the ranks that never arrived.
      } catch (const collective_mismatch&) {
        // Every rank of the collective throws it.
      } catch (...) {
        comm.fail(experimental::what_of(e));  // the rank's own failure: release its peers at once
      }
      experimental::rethrow_root_cause({.errors = std::span(&e, 1),
                                  .first = comm.rank(),
                                  .size = comm.size(),
                                  .remote_root = remote,
                                  .noun = "MPI rank"});
      throw;  // not reached: a non-null exception always has a root cause
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
      throw comm_argument_error("meshlib: mpi_runner runs one device per MPI rank, but the mesh has " +
                                std::to_string(n) + " devices and the communicator " + std::to_string(comm.size()) +
                                " ranks; use a mesh of " + std::to_string(comm.size()) +
                                " devices, or hybrid_runner for several devices (threads) per rank");
  }
};

/// @brief Deprecated name of `mpi_runner`; removed in the next release.
using mpi_backend [[deprecated("use meshlib::mpi_runner")]] = mpi_runner;

namespace exec::detail {
/// The process-wide device threads of hybrid meshes (not pinned: see the file comment). Apart
/// from the process-wide threads of `thread_runner`, so that a hybrid mesh's devices never wait
/// for, or pin, the threads that global-view operations use.
inline device_workers& hybrid_device_workers() {
  static device_workers w(false);
  return w;
}

/// Runs a hybrid world's threads on `pool` (the launcher of `run_hybrid`); a call the pool cannot
/// take (nested in a device, or while another thread's call holds it) starts threads of its own.
struct pool_launch {
  device_workers* pool;
  template <class Body>
  void operator()(int threads, Body& body) const {
    auto task = [&body](std::size_t t) { body(static_cast<int>(t)); };
    if (!pool->try_run(static_cast<std::size_t>(threads), task)) experimental::start_hybrid_threads{}(threads, body);
  }
};
}  // namespace exec::detail

/// @brief `threads` devices (threads) per MPI rank of `comm`: device `rank * threads + t`, run by
/// device threads of its own (they start on the first call, threads - 1 of them; the calling
/// thread runs local thread 0, and they are joined when the last copy of the runner is destroyed),
/// or, made with `detail::process_wide_threads` (the default runner's), by the process-wide hybrid
/// device threads. Each call is collective over `comm` and builds a new hybrid world (see the file
/// comment): a failure fails that call on every process, not the next one.
struct hybrid_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The MPI communicator over the processes.
  mpi_communicator comm;
  /// Threads (devices) per process; the mesh has ranks times threads devices.
  int threads = 1;
  /// Options of each process's thread world.
  thread_comm_options options{};
  /// The device threads, shared by every copy of this runner; null: the process-wide ones.
  std::shared_ptr<exec::detail::device_workers> workers{};

  /// `threads` devices per rank of `comm`, on device threads of its own; each call's thread world
  /// gets `options`.
  hybrid_runner(mpi_communicator comm, int threads, thread_comm_options options = {})
      : comm(std::move(comm)),
        threads(threads),
        options(std::move(options)),
        workers(std::make_shared<exec::detail::device_workers>(false)) {
    this->comm.set_fail_on_unwind(false);  // a failure of a call fails that call's hybrid world, not comm
  }
  /// The same on the process-wide hybrid device threads.
  hybrid_runner(exec::detail::process_wide_threads_t, mpi_communicator comm, int threads, thread_comm_options options = {})
      : comm(std::move(comm)), threads(threads), options(std::move(options)) {
    this->comm.set_fail_on_unwind(false);
  }

  /// @brief Runs `body(device, communicator)` on this process's threads, one per local device.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    check(n);
    run_hybrid(
        comm, threads,
        [&](hybrid_communicator& c) {
          const auto device = static_cast<std::size_t>(c.rank());
          body(device, std::move(c));
        },
        options, exec::detail::pool_launch{workers ? workers.get() : &exec::detail::hybrid_device_workers()});
  }

  /// The devices this process runs: `rank * threads` up to `(rank + 1) * threads - 1`.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    check(n);
    std::vector<std::size_t> d;
    for (int t = 0; t < threads; ++t) d.push_back(static_cast<std::size_t>(comm.rank() * threads + t));
    return d;
  }

 private:
  void check(std::size_t n) const {
    const auto have = static_cast<std::size_t>(comm.size()) * static_cast<std::size_t>(threads);
    if (n != have)
      throw comm_argument_error("meshlib: hybrid_runner runs " + std::to_string(comm.size()) + " ranks x " +
                                std::to_string(threads) + " threads = " + std::to_string(have) +
                                " devices, but the mesh has " + std::to_string(n));
  }
};

/// @brief Deprecated name of a `hybrid_runner` on the process-wide hybrid device threads (what it
/// was before runners had one name each); removed in the next release.
struct [[deprecated("use meshlib::hybrid_runner")]] hybrid_backend : hybrid_runner {
  /// `threads` devices per rank of `comm`.
  hybrid_backend(mpi_communicator comm, int threads = 1, thread_comm_options options = {})
      : hybrid_runner(exec::detail::process_wide_threads, std::move(comm), threads, std::move(options)) {}
};

static_assert(runner<mpi_runner>);
static_assert(runner<hybrid_runner>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
