// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `default_runner`: what `spmd` and `shard_map` run on when no runner is passed. In one
/// process, the process-wide persistent device threads (a `thread_runner` on them). Once
/// `mpi::initialize` (or `mpi::guard`) has started a run of several processes, the multi-process
/// runner: a mesh of n devices over the P processes of `mpi::world()` runs as P processes x
/// n / P device threads (a `hybrid_runner` on the process-wide hybrid device threads), device `p * (n / P) + t` being thread t of process p,
/// as `distributed::local_devices()` numbers them. The hybrid collectives reduce in the thread
/// backend's order, so a program gives the same bits under `mpirun` as on threads.
///
/// Exceptions: a call made inside a device (a nested `spmd`) runs on threads of its own process,
/// as before, because the other processes do not make it; a launcher that `distributed::initialize`
/// detected without MPI (torchrun, or mpirun with `distributed::initialize` alone) gives no
/// transport to run a mesh over the processes, and the default runner says so instead of running
/// every device in each process. Built with Kokkos CUDA and NCCL (`MESHLIB_HAS_GPU_RUNNER`), when a
/// GPU is visible, the default is `gpu_runner` (exec/gpu_runner.hpp), which also runs a launch of
/// several processes, one GPU each. Pass a runner explicitly to choose otherwise (`thread_runner{}`:
/// every device in this process; `mpi_runner{comm}`: one device per rank).
/// @code
/// meshlib::mpi::guard run;                                     // mpirun -np 2
/// meshlib::mesh<meshlib::axis<"x">> m{4};                        // 2 processes x 2 threads
/// auto ids = meshlib::spmd(m, [] { return meshlib::device_index(); });
/// // process 0: {0, 1, 0, 0}; process 1: {0, 0, 2, 3} (other processes' entries value-initialised)
/// @endcode

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/exec/gpu_runner.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/thread_runner.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib/runtime/errors.hpp"
#if MESHLIB_ENABLE_MPI
#include "meshlib/exec/mpi_runner.hpp"
#include "meshlib/runtime/mpi_runtime.hpp"
#endif

namespace meshlib {

namespace exec::detail {

/// The multi-process part of the default runner: the processes' communicator and how many of
/// an `n`-device mesh's devices each runs; empty when the default is the thread runner.
#if MESHLIB_ENABLE_MPI
inline std::optional<hybrid_runner> default_process_runner(std::size_t n) {
#else
inline std::optional<int> default_process_runner([[maybe_unused]] std::size_t n) {
#endif
  if (experimental::current_device_slot() != nullptr) return std::nullopt;  // nested in a device: local threads
  const auto launch = distributed::launch();
  const std::size_t procs = launch.process_count;
  if (procs <= 1) return std::nullopt;
  const std::string run = "the run has " + std::to_string(procs) + " processes (" +
                          std::string(distributed::to_string(launch.source)) + ")";
#if MESHLIB_ENABLE_MPI
  if (!mpi::mpi_state().ex)
#endif
    throw distributed_error("meshlib: spmd / shard_map on the default runner: " + run +
                            ", but no MPI communicator joins them to run a mesh over them: start the run with "
                            "meshlib::mpi::initialize() (or a meshlib::mpi::guard; link meshlib::mpi), or pass a "
                            "runner explicitly (thread_runner{} runs every device in this process)");
#if MESHLIB_ENABLE_MPI
  if (n == 0 || n % procs != 0)
    throw mesh_error("meshlib: spmd / shard_map on the default runner: " + run +
                     ", which run a mesh's devices in equal shares, but the mesh has " + std::to_string(n) +
                     " devices; use a multiple of " + std::to_string(procs) +
                     " (distributed::device_count() is " + std::to_string(distributed::device_count()) +
                     "), or pass a runner explicitly (thread_runner{} runs every device in this process)");
  return hybrid_runner(process_wide_threads, mpi::world(), static_cast<int>(n / procs));
#endif
}

#if MESHLIB_HAS_GPU_RUNNER
/// Whether the default runner runs on the GPUs now: a GPU build with a visible GPU, outside a
/// running device (`choose_default_runner`). The GPU count is read once per process.
inline bool default_runs_on_gpus() {
  static const int gpus = visible_gpu_count();
  return choose_default_runner(true, gpus, experimental::current_device_slot() != nullptr, distributed::launch().process_count) ==
         default_runner_kind::gpus;
}
#endif

}  // namespace exec::detail

/// @brief The runner of `spmd` and `shard_map` when none is passed (see the file comment): the
/// process-wide device threads, or, in a run of several processes started with
/// `mpi::initialize`, those processes' device threads (a `hybrid_runner`). Decided at each call.
/// @throws distributed_error when `distributed::initialize` found several processes but MPI does
/// not join them; mesh_error when the mesh's devices do not split evenly over the processes.
struct default_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;

  /// @brief Runs `body(device, communicator)` for this process's devices of an `n`-device mesh.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
#if MESHLIB_HAS_GPU_RUNNER
    if (exec::detail::default_runs_on_gpus()) {
      gpu_runner().run(n, body);
      return;
    }
#endif
#if MESHLIB_ENABLE_MPI
    if (const auto procs = exec::detail::default_process_runner(n)) {
      procs->run(n, body);
      return;
    }
#else
    (void)exec::detail::default_process_runner(n);
#endif
    thread_runner(exec::detail::process_wide_threads).run(n, body);
  }

  /// The devices this process runs of an `n`-device mesh: all of them in one process, else its
  /// `n / P` consecutive ones.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
#if MESHLIB_HAS_GPU_RUNNER
    if (exec::detail::default_runs_on_gpus()) return gpu_runner().local_devices(n);
#endif
#if MESHLIB_ENABLE_MPI
    if (const auto procs = exec::detail::default_process_runner(n)) return procs->local_devices(n);
#else
    (void)exec::detail::default_process_runner(n);
#endif
    return thread_runner(exec::detail::process_wide_threads).local_devices(n);
  }
};

static_assert(runner<default_runner>);

}  // namespace meshlib
