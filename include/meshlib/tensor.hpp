// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The tensor layer: `sharded_tensor` (global view), `local_tensor` (the value a device sees
/// inside `shard_map` / `spmd`), and local kernels with sharding propagation (elementwise,
/// reductions, transpose, reshape, slice / pad / concatenate, broadcast_in_dim, matmul). Needs Kokkos; Kokkos Kernels is used for matmul where found.

#include "meshlib/tensor/view.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/spec_algebra.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"
#include "meshlib/tensor/elementwise.hpp"
#include "meshlib/tensor/reduce.hpp"
#include "meshlib/tensor/transpose.hpp"
#include "meshlib/tensor/reshape.hpp"
#include "meshlib/tensor/slice.hpp"
#include "meshlib/tensor/broadcast_in_dim.hpp"
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/matmul.hpp"
