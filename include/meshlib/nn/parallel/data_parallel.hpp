// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `data_parallel<"axis">`: data parallelism over one mesh axis (PyTorch's DDP, torchtitan's
/// `apply_ddp`): the batch split over the axis, the gradients averaged over it in buckets
/// (`grad_sync`, nn/parallel/grad_sync.hpp), with ZeRO-1 (the optimizer state and update sharded over
/// the axis) and overlap (each bucket started during backward, nn/parallel/grad_overlap.hpp) as its
/// options. With `fully_shard` on another axis the two compose (HSDP: shards over the fsdp axis,
/// replicas over this one).
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"data">{.zero = 1});
/// meshlib::nn::train_state overlapped(mesh, std::move(net2), opt, meshlib::nn::data_parallel<"dp">{.overlap = true});
/// @endcode

#include <cstddef>

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/nn/parallel/grad_overlap.hpp"
#include "meshlib/nn/parallel/grad_sync.hpp"
#include "meshlib/nn/parallel/policy.hpp"

namespace meshlib::nn {

/// @brief Data parallelism over the mesh axis `Axis` (see the file comment); a `parallel_policy`.
/// @tparam Axis the mesh axis the batch is split over and the gradients averaged over.
template <fixed_string Axis = "data">
struct data_parallel {
  /// The parallelism this policy applies.
  static constexpr parallelism kind = parallelism::data;
  /// The mesh axis it applies over.
  static constexpr auto axis = Axis;
  /// The ZeRO stage: 0 (optimizer state replicated) or 1 (the optimizer state and update sharded
  /// over the axis, the updated parameters all-gathered). Stage 3 is `fully_shard`.
  int zero = 0;
  /// Start each gradient bucket's all-reduce during backward, as soon as its gradients are complete
  /// (PyTorch DDP's overlap): the same buckets and sums, bitwise the same training. A `sequential`
  /// model without ZeRO; off by default (docs/benchmarks.md, "Overlapped gradient synchronisation").
  bool overlap = false;
  /// The most gradient elements per collective (0: no limit).
  std::size_t bucket_elements = std::size_t{1} << 20;
};

}  // namespace meshlib::nn
