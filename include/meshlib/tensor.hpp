#pragma once
/// @file
/// @brief The tensor layer: `sharded_tensor` (global view), `local_tensor` (the value a device sees
/// inside `shard_map` / `spmd`), and local kernels with sharding propagation. Needs Kokkos.

#include "meshlib/tensor/view.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"
