// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exec layer: `spmd(mesh, fn)` and `shard_map(fn, mesh, in_specs, out_specs)`.

#include "meshlib/exec/spmd.hpp"
#include "meshlib/exec/shard_map.hpp"
