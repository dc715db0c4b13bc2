// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exec layer: runners (`runner`, `thread_runner`; `mpi_runner` and `hybrid_runner`
/// through <meshlib/mpi.hpp>), the device thread pool, `spmd(mesh, fn)`,
/// `shard_map(fn, mesh, in_specs, out_specs)`, `reshard` on a runner or the default one, and JAX's
/// names for it (`device_put`, `with_sharding_constraint`).

#include "meshlib/exec/available_cores.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/thread_runner.hpp"
#include "meshlib/exec/gpu_runner.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/exec/shard_map.hpp"
#include "meshlib/exec/global_reshard.hpp"
#include "meshlib/exec/device_put.hpp"
