// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `reshard(x, to, runner)` and `reshard<ToSpec>(x, runner)`: the plan of
/// collectives/reshard.hpp run on a runner's devices; and without a runner, on `default_runner`, as
/// `spmd` and `shard_map` without one. In one process that is every device on the process-wide
/// device threads; after `mpi::initialize` in a run of several processes, each process runs the
/// devices whose blocks it holds and the steps of the plan go between the processes, so the same
/// line reshards a tensor on threads and under `mpirun` (a thread default there would run devices
/// whose blocks the process does not hold).
///
/// Why here and not in collectives/reshard.hpp: running a plan runs devices (a runner, with the
/// device context and the debug layer's observer installed: exec/detail/run_devices.hpp), and the
/// default runner chooses between the thread and the multi-process runners, which live in this
/// layer; the collectives layer below holds the plan and each device's steps.
/// @code
/// meshlib::mpi::guard run;                                            // mpirun -np 2
/// auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"x">>{m}, shape, host);
/// auto y = meshlib::reshard<meshlib::P<>>(x);   // every process holds its devices' full copies
/// @endcode

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "meshlib/collectives/errors.hpp"
#include "meshlib/collectives/reshard.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/detail/run_devices.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

/// @brief `x` laid out by sharding `to` (same mesh; the rule may differ). Runs `plan_reshard(x, to)`
/// on every device that `backend` runs in this process. Without a runner, `reshard(x, to)` runs
/// on `default_runner` (below), as `spmd` and `shard_map` do.
/// @throws sharding_error when the shape does not fit `to` (even rule and a size that does not
/// divide), or when `backend` runs a device whose block `x` does not hold in this process.
template <sharded_tensor_type X, sharding_type To, class Backend>
[[nodiscard]] auto reshard(const X& x, const To& to, const Backend& backend) {
  using T = typename X::value_type;
  constexpr std::size_t Rank = X::rank;
  using result_t = sharded_tensor<T, Rank, To, typename X::memory_space>;
  const reshard_plan plan = plan_reshard(x, to);
  const std::vector<std::size_t> run = backend.local_devices(x.mesh().size());
  for (std::size_t dev : run)
    if (!x.is_local(dev))
      throw sharding_error("meshlib: reshard: the runner runs device " + std::to_string(dev) +
                           " in this process, but the tensor holds no block of it here (it holds devices " +
                           experimental::describe_devices(x.local_devices()) +
                           "); pass the runner that runs the tensor's devices");
  result_t out(to, x.global_shape(), std::span<const std::size_t>(run));
  if (plan.empty()) {
    // Same blocks: copy them (the result owns its memory, as after any reshard).
    for (auto dev : out.local_devices())
      std::copy_n(x.local(dev).data(), x.local(dev).size(), out.local(dev).data());
    return out;
  }
  const auto from = experimental::to_dyn_spec<typename X::sharding_type>(Rank);
  exec::detail::run_devices(x.mesh(), backend, [&](std::size_t dev) {
    experimental::run_reshard_plan<T, typename X::memory_space>(plan, x.mesh(), dev, from, x.sharding().rule(), to.rule(), x.global_shape(),
                                x.local(dev).data(), out.local(dev).data());
  });
  return out;
}

/// @brief `x` laid out by `ToSpec` on the same mesh, with the same shard rule, on `backend`'s
/// devices (without a runner: `default_runner`, below).
template <partition_spec_type ToSpec, sharded_tensor_type X, class Backend>
[[nodiscard]] auto reshard(const X& x, const Backend& backend) {
  return reshard(x, named_sharding<typename X::mesh_type, ToSpec>(x.mesh(), x.sharding().rule()), backend);
}

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
