// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `spmd(mesh, fn)`: runs `fn` once per device of `mesh`, as a multi-controller JAX program
/// runs once per process: the program owns its data, builds its `local_tensor`s, and talks to its
/// peers through the typed collectives. Inside, `axis_index<"a">()`, `axis_size<"a">()` and
/// `device_index()` say where it runs.
/// @code
/// meshlib::mesh<meshlib::axis<"x">> m{4};
/// auto ids = meshlib::spmd(m, [] { return meshlib::axis_index<"x">(); });   // {0, 1, 2, 3}
/// @endcode

#include <cstddef>
#include <type_traits>
#include <vector>

#include "meshlib/core/mesh.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/detail/run_devices.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/runtime/kokkos_runtime.hpp"

namespace meshlib {

namespace exec::detail {
template <class Fn>
decltype(auto) call_on_device(Fn& fn, std::size_t device) {
  if constexpr (std::is_invocable_v<Fn&, std::size_t>) return fn(device);
  else return fn();
}
template <class Fn>
using spmd_result_t = decltype(call_on_device(std::declval<Fn&>(), std::size_t{}));
}  // namespace exec::detail

/// @brief Runs `fn()` (or `fn(device)`) once per device of `m` on `backend`, a `runner` (default:
/// `default_runner`, the process-wide persistent device threads, or the processes' device threads
/// once `mpi::initialize` has started several; a `thread_runner` owns threads of its own).
/// @returns nothing when `fn` returns nothing; otherwise one result per device, indexed by device
/// id (entries of devices another process runs are value-initialised).
/// @throws device_error when a device throws: the first device that failed, its exception nested;
/// every other device is released from its collectives (no hang).
/// @throws kokkos_lifecycle_error when Kokkos is not initialised (before any device thread starts).
/// @throws mesh_error when the mesh has more devices than an `int` counts (naming the axis).
template <mesh_type Mesh, class Fn, runner Backend = default_runner>
  requires(std::is_invocable_v<Fn&> || std::is_invocable_v<Fn&, std::size_t>)
auto spmd(const Mesh& m, Fn&& fn, const Backend& backend = {}) {
  using result_t = std::remove_cvref_t<exec::detail::spmd_result_t<Fn>>;
  experimental::require_kokkos("spmd");
  experimental::require_runnable(m, "spmd");  // before the per-device results are allocated
  if constexpr (std::is_void_v<result_t>) {
    exec::detail::run_devices(m, backend, [&](std::size_t device) { exec::detail::call_on_device(fn, device); });
  } else {
    std::vector<result_t> out(m.size());
    exec::detail::run_devices(m, backend, [&](std::size_t device) { out[device] = exec::detail::call_on_device(fn, device); });
    return out;
  }
}

}  // namespace meshlib
