// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Backends: what runs one program per device. `thread_backend` (the default) runs one
/// persistent thread per device on a fresh `thread_world`; the MPI backends (one process per
/// rank: comm/mpi/mpi_backend.hpp; threads in processes: exec/mpi_runner.hpp) plug into `shard_map`, `spmd` and
/// `reshard` unchanged by providing the same members. exec/runner.hpp states this as the
/// `runner` concept.
///
/// A backend `B` provides (and marks itself with `using is_runner = void;`):
/// - `b.run(n, body)`: calls `body(device, world)` once for each device of an `n`-device mesh
///   that this process runs, `world` being that device's communicator over all `n` devices (rank
///   = device id), and returns when every call has returned. When a call throws, peers blocked in
///   collectives must be released (the communicator aborts) and `run` throws `participant_error`
///   naming the rank of the root cause, with the device's exception nested.
/// - `b.local_devices(n)`: the devices this process runs, ascending.

#include <cstddef>
#include <exception>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/errors.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/tensor/device_workers.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

/// @brief The default backend (a runner: exec/runner.hpp): one thread per device, all in this
/// process, each call on a fresh `thread_world`, run by persistent device threads
/// (`detail::device_workers`): the process-wide ones, or those of a `thread_runner`
/// (exec/thread_runner.hpp) that owns its own. Device 0 runs on the calling thread and device `d`
/// always on the pool's worker `d`, so repeated calls reuse the same threads.
///
/// A call that the pool cannot take (a `spmd` inside a device of another call, or while another
/// thread's call holds the pool) runs on threads started for it (`run_on_threads`), with the same
/// results and errors: nested calls never wait for the threads of their caller.
/// @code
/// meshlib::spmd(m, fn, meshlib::thread_backend{{.timeout = std::chrono::seconds(5)}});
/// @endcode
struct thread_backend {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;

  /// Options of each call's `thread_world` (timeout, spin policy). `pin_threads` applies only to
  /// calls that start their own threads: the persistent ones pin themselves whenever every device
  /// has a core (device_workers.hpp).
  thread_comm_options options{};
  /// The device threads, shared by every copy of this backend; null: the process-wide ones.
  std::shared_ptr<detail::device_workers> workers{};

  /// @brief Runs `body(device, communicator)` on `n` threads, one per device; returns when all finish.
  /// @throws participant_error naming the root-cause device (see the file comment).
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    auto device = [&](thread_communicator& c) {
      const auto d = static_cast<std::size_t>(c.rank());
      body(d, std::move(c));
    };
    const int size = static_cast<int>(n);
    detail::device_workers& pool = workers ? *workers : detail::device_workers::get();
    // A fresh world for every call: a failed world stays failed, and a fresh one costs less than
    // a microsecond per device next to the wake-up of the threads.
    thread_world world(size, options);
    detail::participant_failures failures(size);
    auto task = [&](std::size_t d) { failures.run(world, static_cast<int>(d), device); };
    if (!pool.try_run(n, task)) {
      run_on_threads(size, device, options);
      return;
    }
    failures.rethrow(world);
  }

  /// The devices this process runs: all `n` of them, `0 .. n-1` (one process owns every thread).
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    std::vector<std::size_t> d(n);
    std::iota(d.begin(), d.end(), std::size_t{0});
    return d;
  }
};

namespace detail {

/// Runs `body(device)` on every device of `m` that `backend` runs, each with its `device_context`
/// and its execution-space instance (`device_instance`) installed, and turns a device's failure
/// into `device_error`.
template <mesh_type Mesh, class Backend, class Body>
void run_devices(const Mesh& m, const Backend& backend, Body&& body) {
  require_runnable(m, "spmd / shard_map / reshard");
  run_observer observer(m, backend.local_devices(m.size()));  // the debug layer's hook (debug/observe.hpp)
  (void)device_instance<default_memory_space>(0, m.size());  // made here, not in the device threads
  workspace_registry::get().hook();                          // likewise (Kokkos' hook stack has no lock)
  try {
    backend.run(m.size(), [&]<class C>(std::size_t device, C world) {
      device_context_for<C, Mesh> ctx(m, device, std::move(world), &observer);
      scoped_device installed(ctx);
      scoped_exec_space<default_memory_space> on(device_instance<default_memory_space>(device, m.size()));
      body(device);
    });
  } catch (const participant_error& e) {
    const auto device = static_cast<std::size_t>(e.rank());
    std::exception_ptr cause = e.nested_ptr();
    std::string what = e.what();
    if (cause) {
      try {
        std::rethrow_exception(cause);
      } catch (const std::exception& x) {
        what = x.what();
      } catch (...) {
        what = "an exception not derived from std::exception";
      }
    }
    throw device_error(device, cause, "meshlib: device " + std::to_string(device) + " of " + m.to_string() +
                                          " failed: " + what);
  }
}

}  // namespace detail
}  // namespace meshlib
