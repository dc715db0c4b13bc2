// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `reshard(x, to)` and `reshard<ToSpec>(x)` without a runner: on `default_runner`, as
/// `spmd` and `shard_map` without one. In one process that is every device on the process-wide
/// device threads; after `mpi::initialize` in a run of several processes, each process runs the
/// devices whose blocks it holds and the steps of the plan go between the processes, so the same
/// line reshards a tensor on threads and under `mpirun` (a thread default there would run devices
/// whose blocks the process does not hold).
///
/// Why here and not in collectives/reshard.hpp: the default runner chooses between the thread and
/// the multi-process runners, which live in this layer; the collectives layer below takes the
/// runner as an argument.
/// @code
/// meshlib::mpi::guard run;                                            // mpirun -np 2
/// auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"x">>{m}, shape, host);
/// auto y = meshlib::reshard<meshlib::P<>>(x);   // every process holds its devices' full copies
/// @endcode

#include "meshlib/collectives/reshard.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

/// @brief `x` laid out by sharding `to` (same mesh; the rule may differ), on `default_runner`.
/// @throws sharding_error as `reshard(x, to, runner)`; the default runner's errors (a mesh that
/// does not split over the processes, several processes without MPI).
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] auto reshard(const X& x, const To& to) {
  return reshard(x, to, default_runner{});
}

/// @brief `x` laid out by `ToSpec` on the same mesh, with the same shard rule, on `default_runner`.
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] auto reshard(const X& x) {
  return reshard<ToSpec>(x, default_runner{});
}

}  // namespace meshlib
