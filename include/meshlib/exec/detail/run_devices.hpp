// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::run_devices(mesh, runner, body)`: what `spmd`, `shard_map` and `reshard` with a
/// runner run each device through. It is here, in the exec layer, because it joins the layers
/// below: the runner (exec/runner.hpp) runs the devices, the collectives' device context
/// (collectives/device_context.hpp) is installed on each, and the debug layer's observer
/// (debug/observe.hpp), which implements the collectives' observer interface
/// (collectives/observer.hpp), is created for the run and handed to every device's context. The
/// collectives layer declares that interface and never includes the debug layer.

#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/errors.hpp"
#include "meshlib/collectives/workspace.hpp"
#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/debug/observe.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::exec::detail {

/// The cores each device of `runner` computes on: its `threads_per_device` where it has one, else 1.
template <class Runner>
std::size_t threads_per_device_of(const Runner& runner) {
  if constexpr (requires { runner.threads_per_device; })
    return static_cast<std::size_t>(runner.threads_per_device);
  else
    return 1;
}

/// Throws unless devices computing on `Exec` can have `threads` threads each.
template <class Exec>
void require_thread_teams(std::size_t threads) {
  if (threads == 1) return;
  if (threads == 0)
    throw error("meshlib: threads_per_device is 0; a device computes on at least one thread (1, the default, is one "
                "core per device)");
  if constexpr (!experimental::has_thread_teams_v<Exec>)
    throw error("meshlib: threads_per_device = " + std::to_string(threads) + " needs Kokkos 4 with the OpenMP "
                "backend (a team of threads per device), but devices here compute on Kokkos::" +
                std::string(Exec::name()) + " (Kokkos " + std::to_string(KOKKOS_VERSION) +
                "), one thread each; build Kokkos 4 with -DKokkos_ENABLE_OPENMP=ON, or leave threads_per_device at 1");
}

/// Whether `Runner` always installs each device's execution-space instance itself (`gpu_runner`: a
/// Kokkos CUDA instance on the stream of the device's communicator, so that kernels and collectives
/// are ordered on one stream; it also sets `experimental::runner_installed_exec()` for each call); otherwise
/// `run_devices` installs `device_instance`'s, unless the runner set that flag for the call.
template <class Runner>
inline constexpr bool runner_installs_instances_v = requires { typename Runner::installs_exec_instances; };

/// Runs `body(device)` on every device of `m` that `backend` runs, each with its `device_context`
/// (observed by the debug layer's `run_observer`) and its execution-space instance
/// (`device_instance`) installed, and turns a device's failure into `device_error`: the one place
/// where every runner's root cause (`participant_error`, whatever the runner) becomes the user's
/// error, with the same message for every runner.
template <mesh_type Mesh, class Backend, class Body>
void run_devices(const Mesh& m, const Backend& backend, Body&& body) {
  experimental::require_runnable(m, "spmd / shard_map / reshard");  // before anything is sized by the device count
  const std::vector<std::size_t> local = backend.local_devices(m.size());
  const std::size_t team = threads_per_device_of(backend);
  require_thread_teams<experimental::exec_space_for_t<default_memory_space>>(team);
  experimental::run_observer observer(m, local);  // installed: the debug layer's observer
  // Instances per local device: a process running devices 4..7 of 8 makes 4, not 8.
  constexpr bool own_instances = !runner_installs_instances_v<Backend>;
  if constexpr (own_instances)
    (void)experimental::device_instance<default_memory_space>(0, local.size(), team);  // made here, not in the device threads
  experimental::workspace_registry::get().hook();  // likewise (Kokkos' hook stack has no lock)
  try {
    backend.run(m.size(), [&]<class C>(std::size_t device, C world) {
      experimental::device_context_for<C, Mesh> ctx(m, device, std::move(world), &observer);
      experimental::scoped_device installed(ctx);
      std::optional<experimental::scoped_exec_space<default_memory_space>> on;
      // A runner chosen at run time (default_runner picking gpu_runner) says so per call.
      const bool runner_instance = std::exchange(experimental::runner_installed_exec(), false);
      if (own_instances && !runner_instance) {
        const auto index = static_cast<std::size_t>(std::lower_bound(local.begin(), local.end(), device) - local.begin());
        on.emplace(experimental::device_instance<default_memory_space>(index, local.size(), team));
      }
      body(device);
      // A stream backend's collectives may still be enqueued: the call ends when they are
      // complete (or with their error, bounded by the communicator's timeout).
      if constexpr (experimental::stream_ordered_v<C>) ctx.synchronize();
    });
  } catch (const participant_error& e) {
    const auto device = static_cast<std::size_t>(e.rank());
    const std::exception_ptr cause = e.nested_ptr();
    const std::string what = cause ? experimental::what_of(cause) : std::string(e.what());
    throw device_error(device, cause, "meshlib: device " + std::to_string(device) + " of " + m.to_string() +
                                          " failed: " + what);
  }
}

}  // namespace meshlib::exec::detail
