// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The multi-process runners (exec/runner.hpp): `mpi_runner` (one device per MPI rank,
/// also named `mpi_backend`) and `hybrid_backend` / `hybrid_runner` (P processes x T device
/// threads: device `p*T + t` is thread t of process p).
///
/// The device threads of a hybrid mesh are persistent, as `thread_backend`'s: `hybrid_backend`
/// runs them on the process-wide hybrid device threads, and a `hybrid_runner` owns threads of its
/// own for as long as the user keeps it. What each call still builds is its hybrid world (the
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
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/mpi/hybrid_communicator.hpp"
#include "meshlib/comm/mpi/mpi_backend.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/tensor/device_workers.hpp"

namespace meshlib {

/// @brief The runner with one device per MPI rank: `mpi_backend` (comm/mpi/mpi_backend.hpp),
/// under the name the other runners have. It has no threads to keep: the device is the process.
using mpi_runner = mpi_backend;

namespace detail {
/// The process-wide device threads of hybrid meshes (not pinned: see the file comment). Apart
/// from the process-wide threads of `thread_backend`, so that a hybrid mesh's devices never wait
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
    if (!pool->try_run(static_cast<std::size_t>(threads), task)) start_hybrid_threads{}(threads, body);
  }
};
}  // namespace detail

/// @brief `threads` devices (threads) per MPI rank of `comm`: device `rank * threads + t`, run by
/// the process-wide hybrid device threads (persistent), or by `workers` when set (a
/// `hybrid_runner` sets its own). Each call is collective over `comm` and builds a new hybrid
/// world (see the file comment): a failure fails that call on every process, not the next one.
struct hybrid_backend {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The MPI communicator over the processes.
  mpi_communicator comm;
  /// Threads (devices) per process; the mesh has ranks times threads devices.
  int threads = 1;
  /// Options of each process's thread world.
  thread_comm_options options{};
  /// The device threads, shared by every copy of this backend; null: the process-wide ones.
  std::shared_ptr<detail::device_workers> workers{};

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
        options, detail::pool_launch{workers ? workers.get() : &detail::hybrid_device_workers()});
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
      throw comm_argument_error("meshlib: hybrid_backend runs " + std::to_string(comm.size()) + " ranks x " +
                                std::to_string(threads) + " threads = " + std::to_string(have) +
                                " devices, but the mesh has " + std::to_string(n));
  }
};

/// @brief A `hybrid_backend` with device threads of its own, as `thread_runner` is a
/// `thread_backend` with its own: they start on the first call (threads - 1 of them; the calling
/// thread runs local thread 0) and are joined when the last copy of the runner is destroyed.
struct hybrid_runner : hybrid_backend {
  /// `threads` devices per rank of `comm`; each call's thread world gets `options`.
  hybrid_runner(mpi_communicator comm, int threads, thread_comm_options options = {})
      : hybrid_backend{std::move(comm), threads, std::move(options), std::make_shared<detail::device_workers>(false)} {}
};

static_assert(runner<mpi_runner>);
static_assert(runner<hybrid_backend>);
static_assert(runner<hybrid_runner>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
