// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The `runner` concept: what runs one program per device for `spmd`, `shard_map` and
/// `reshard`. Satisfied by `thread_runner` (persistent threads in this process), with MPI by
/// `mpi_runner` (a process per device) and `hybrid_runner` (persistent threads in processes;
/// exec/mpi_runner.hpp), and by `default_runner`, which picks one of them at each call
/// (exec/default_runner.hpp). One name each: `thread_backend`, `mpi_backend` and
/// `hybrid_backend` are deprecated names kept for one release.
/// @code
/// static_assert(meshlib::runner<meshlib::thread_runner>);
/// meshlib::thread_runner r;                     // owns its device threads while it lives
/// meshlib::spmd(m, [] { /* ... */ }, r);        // every call reuses them
/// @endcode

#include <concepts>
#include <cstddef>
#include <vector>

namespace meshlib {

namespace exec::detail {
/// A device body as `run_devices` hands it to a runner: called once per local device with that
/// device's world communicator, whatever its type.
struct runner_body_archetype {
  template <class Communicator>
  void operator()(std::size_t, Communicator) const {}
};
}  // namespace exec::detail

/// @brief A runner: opts in with `using is_runner = void;` and provides
/// - `r.run(n, body)`: calls `body(device, world)` once for each device of an `n`-device mesh that
///   this process runs, `world` being that device's communicator over all `n` devices (rank =
///   device id); returns when every call has returned. When a call throws, peers blocked in
///   collectives are released (the communicator aborts) and `run` throws `participant_error`
///   naming the root cause's rank, the device's exception nested.
/// - `r.local_devices(n)`: the devices this process runs, ascending.
///
/// Which runner is the default (`default_runner`): a `thread_runner` on the process-wide device
/// threads in one process; once `mpi::initialize` has started a run of several processes, those
/// processes' device threads (a `hybrid_runner`, n / P devices per process).
template <class R>
concept runner = requires { typename R::is_runner; } &&
                 requires(const R& r, std::size_t n, exec::detail::runner_body_archetype body) {
                   r.run(n, body);
                   { r.local_devices(n) } -> std::same_as<std::vector<std::size_t>>;
                 };

}  // namespace meshlib
