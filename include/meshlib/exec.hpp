// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exec layer: runners (`runner`, `thread_runner`), `spmd(mesh, fn)` and
/// `shard_map(fn, mesh, in_specs, out_specs)`, `reshard` without a runner, and JAX's names for it
/// (`device_put`, `with_sharding_constraint`).

#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/thread_runner.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/exec/shard_map.hpp"
#include "meshlib/exec/global_reshard.hpp"
#include "meshlib/exec/device_put.hpp"
