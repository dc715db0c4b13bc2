// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The core layer: axes, meshes, partition specs, shardings and shard layout math.
/// Standard library only.

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/hash.hpp"
#include "meshlib/core/axis.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/shard_layout.hpp"
