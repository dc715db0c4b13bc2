#pragma once
/// @file
/// @brief The core layer: axes, meshes, partition specs, shardings and shard layout math.
/// Standard library only.

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/axis.hpp"
#include "meshlib/core/mesh.hpp"
