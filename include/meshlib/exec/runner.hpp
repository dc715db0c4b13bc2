// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The `runner` concept: what runs one program per device for `spmd`, `shard_map` and
/// `reshard`. Satisfied by `thread_backend` / `thread_runner` (persistent threads in this
/// process), and, with MPI, by `mpi_backend` (a process per device) and `hybrid_backend` (threads
/// in processes).
/// @code
/// static_assert(meshlib::runner<meshlib::thread_runner>);
/// meshlib::thread_runner r;                     // owns its device threads while it lives
/// meshlib::spmd(m, [] { /* ... */ }, r);        // every call reuses them
/// @endcode

#include <concepts>
#include <cstddef>
#include <vector>

namespace meshlib {

namespace detail {
/// A device body as `run_devices` hands it to a runner: called once per local device with that
/// device's world communicator, whatever its type.
struct runner_body_archetype {
  template <class Communicator>
  void operator()(std::size_t, Communicator) const {}
};
}  // namespace detail

/// @brief A runner: opts in with `using is_runner = void;` and provides
/// - `r.run(n, body)`: calls `body(device, world)` once for each device of an `n`-device mesh that
///   this process runs, `world` being that device's communicator over all `n` devices (rank =
///   device id); returns when every call has returned. When a call throws, peers blocked in
///   collectives are released (the communicator aborts) and `run` throws `participant_error`
///   naming the root cause's rank, the device's exception nested.
/// - `r.local_devices(n)`: the devices this process runs, ascending.
///
/// Which runner is the default: `thread_backend` on the process-wide device threads, also after
/// `distributed::initialize` (an MPI launch passes `mpi_backend` or `hybrid_backend` explicitly,
/// as `docs/multi-process.md` shows).
template <class R>
concept runner = requires { typename R::is_runner; } &&
                 requires(const R& r, std::size_t n, detail::runner_body_archetype body) {
                   r.run(n, body);
                   { r.local_devices(n) } -> std::same_as<std::vector<std::size_t>>;
                 };

}  // namespace meshlib
