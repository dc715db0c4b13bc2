// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Backends: what runs one program per device. `thread_backend` (the default) runs one
/// thread per device on a fresh `thread_world`; a later backend (MPI: one process per rank) plugs
/// into `shard_map`, `spmd` and `reshard` unchanged by providing the same two members.
///
/// A backend `B` provides:
/// - `b.run(n, body)`: calls `body(device, world)` once for each device of an `n`-device mesh
///   that this process runs, `world` being that device's communicator over all `n` devices (rank
///   = device id), and returns when every call has returned. When a call throws, peers blocked in
///   collectives must be released (the communicator aborts) and `run` throws `participant_error`
///   naming the rank of the root cause, with the device's exception nested.
/// - `b.local_devices(n)`: the devices this process runs, ascending.

#include <cstddef>
#include <exception>
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
#include "meshlib/tensor/view.hpp"

namespace meshlib {

/// @brief The default backend: one thread per device, all in this process, over a fresh
/// `thread_world` per call (`run_on_threads`).
/// @code
/// meshlib::spmd(m, fn, meshlib::thread_backend{{.timeout = std::chrono::seconds(5)}});
/// @endcode
struct thread_backend {
  thread_comm_options options{};

  template <class Body>
  void run(std::size_t n, Body&& body) const {
    run_on_threads(
        static_cast<int>(n),
        [&](thread_communicator& c) {
          const auto device = static_cast<std::size_t>(c.rank());
          body(device, std::move(c));
        },
        options);
  }

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
  run_observer observer(m, backend.local_devices(m.size()));  // the debug layer's hook (debug/observe.hpp)
  (void)device_instance<default_memory_space>(0, m.size());  // made here, not in the device threads
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
