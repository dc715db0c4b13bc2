// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `data_parallel<"axis">`: data parallelism over one mesh axis (PyTorch's DDP, torchtitan's
/// `apply_ddp`): the batch split over the axis, the gradients averaged over it in buckets
/// (`grad_sync`, nn/parallel/grad_sync.hpp), with ZeRO-1 (the optimizer state and update sharded over
/// the axis) and overlap (each bucket started during backward, nn/parallel/grad_overlap.hpp) as its
/// options. With `fully_shard` on another axis the two compose (HSDP: shards over the fsdp axis,
/// replicas over this one).
///
/// `detail::data_parallel_impl` is the policy at work inside a `train_state`: it owns the gradient
/// buckets, the optimizer state's layout (replicated, or ZeRO-1's slices), the overlap's hooks and
/// the two gradient paths (all-reduce, then the update of whole blocks; or reduce-scatter, the
/// update of this device's slice, all-gather), composed over `fully_shard`'s engine when there is one.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"data">{.zero = 1});
/// meshlib::nn::train_state overlapped(mesh, std::move(net2), opt, meshlib::nn::data_parallel<"dp">{.overlap = true});
/// @endcode

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/nn/parallel/fsdp.hpp"
#include "meshlib/nn/parallel/grad_overlap.hpp"
#include "meshlib/nn/parallel/grad_sync.hpp"
#include "meshlib/nn/parallel/policy.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/train/optimizer_state.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief Data parallelism over the mesh axis `Axis`, and `Second` if given (see the file
/// comment); a `parallel_policy`.
/// @code
/// meshlib::nn::data_parallel<"data">{}            // the batch over 'data'
/// meshlib::nn::data_parallel<"data", "fsdp">{}    // over data x fsdp, the parameters replicated on both
/// @endcode
/// @tparam Axis the mesh axis the batch is split over and the gradients averaged over.
/// @tparam Second a second such axis ("": none), the batch split over `Axis` x `Second` as JAX's
/// `P(("data", "fsdp"))`: what a model whose parameters must not be sharded (a tied embedding)
/// runs on a mesh whose other configurations shard them over that axis with `fully_shard`. A
/// `train_state` splits the batch over at most two axes: `Second` and `fully_shard` do not go together.
template <fixed_string Axis = "data", fixed_string Second = "">
struct data_parallel {
  /// The parallelism this policy applies.
  static constexpr parallelism kind = parallelism::data;
  /// The mesh axis it applies over.
  static constexpr auto axis = Axis;
  /// The second mesh axis it applies over ("": none).
  static constexpr auto second_axis = Second;
  /// The ZeRO stage: 0 (optimizer state replicated) or 1 (the optimizer state and update sharded
  /// over the axis, the updated parameters all-gathered). Stage 3 is `fully_shard`.
  int zero = 0;
  /// Start each gradient bucket's all-reduce during backward, as soon as its gradients are complete
  /// (PyTorch DDP's overlap): the same buckets and sums, bitwise the same training. Needs a
  /// `sequential` model (its layer hooks start the buckets), no ZeRO-1 and no pipeline over more than
  /// one device: the `train_state` refuses the others with a `sharding_error` rather than ignore it.
  /// Off by default (docs/benchmarks.md, "Overlapped gradient synchronisation").
  bool overlap = false;
  /// The most gradient elements per collective (0: no limit).
  std::size_t bucket_elements = std::size_t{1} << 20;
};

namespace detail {

/// @brief `data_parallel`'s part of a `train_state` (see the file comment): the gradient buckets,
/// the optimizer state's layout, the overlap's hooks and the gradient path, over the data axes
/// `DataAxes` of `Mesh`. Composed with `fully_shard`'s engine (`compose`), the train state's
/// parameters are that engine's shards, whose gradients its reduce-scatters have already summed
/// over `FsdpAxes`: the buckets are then all-reduced over the replica axes only (HSDP).
///
/// The path is chosen once, at construction (ZeRO-1 or not); `apply_gradients` reads the train
/// state `S` (a friend's view: its parameters, norm helpers, optimizer chain and master weights)
/// and leaves the updated parameters in it.
template <class T, class Wire, class Mesh, axis_mask DataAxes, axis_mask FsdpAxes>
class data_parallel_impl {
 public:
  /// The data axes other than the fsdp axis: composed with FSDP, the shards' gradients are
  /// all-reduced over these.
  static constexpr axis_mask replica_axes = DataAxes & ~FsdpAxes;
  /// The optimizer state's layout (nn/train/optimizer_state.hpp): replicated or ZeRO-1.
  using layout_type = optimizer_state<Mesh, DataAxes>;
  /// `fully_shard`'s engine this composes with (nn/parallel/fsdp.hpp).
  using fsdp_type = fsdp_engine<Mesh, FsdpAxes>;
  /// The overlap's hooks (nn/parallel/grad_overlap.hpp).
  using overlap_type = grad_overlap<T, Wire, Mesh, DataAxes, replica_axes>;

  /// The policy `p` at work on `devices` devices: buckets of at most `p.bucket_elements`, ZeRO-1
  /// when `p.zero` is 1, the buckets started during backward when `p.overlap` (and the model is a
  /// `sequential`: `install_hooks`).
  /// @throws sharding_error when `p.zero` is not 0 or 1.
  // (A policy type, not a `fixed_string A` deduced from `data_parallel<A>`: nvcc 13's front end
  // deduces no class-type template argument from a specialisation.)
  template <class Policy>
    requires(Policy::kind == parallelism::data)
  data_parallel_impl(std::size_t devices, const Policy& p)
      : buckets_(devices, p.bucket_elements), gather_(devices), zero_(checked_zero(p.zero)), overlap_on_(p.overlap) {}

  /// Composes over `fully_shard`'s engine (null: none).
  void compose(std::shared_ptr<fsdp_type> fsdp) { fsdp_ = std::move(fsdp); }
  /// Sizes the optimizer state of `params` (`slots` per element, `per_param[i]` floats for
  /// parameter `i`) on this process's devices `local`.
  void size_state(const Mesh& mesh, std::span<const param_ref<T>> params, std::size_t slots,
                  std::span<const std::size_t> local, std::span<const std::size_t> per_param = {}) {
    state_ = layout_type(mesh, params, slots, zero_, local, per_param);
  }
  /// With overlap (and without ZeRO-1, whose reduce-scatter runs after the backward): installs the
  /// hooks that start the buckets during backward, around `fully_shard`'s when composed (the train
  /// state has refused overlap on a model without hooks and on a pipelined step). `round`
  /// rounds a gradient to the compute type (null in float).
  template <class Model>
  void install_hooks(const Mesh& mesh, Model& model, void (*round)(float*, std::size_t) noexcept) {
    if constexpr (sequential_model<Model>) {
      if (!overlap_on_ || zero_) return;
      overlap_ = std::make_shared<overlap_type>(mesh, model.template params_per_layer<T>(), round, fsdp_.get());
      model.hooks = overlap_.get();
    }
  }

  /// At the start of the step on `dev`: the overlap's communicator (no-op without overlap).
  void prepare(std::size_t dev) {
    if (overlap_) overlap_->prepare(dev);
  }
  /// Before the last micro-batch's backward on `dev`: arms the overlap's hooks (no-op without).
  void arm(const std::vector<param_ref<T>>& params, std::size_t dev) {
    if (overlap_) overlap_->arm(buckets_, params, dev);
  }
  /// The parameters `[0, n)` of `n` whose gradients the step still zeroes and rounds after the
  /// backward (the overlap's hooks did the others').
  [[nodiscard]] std::size_t unstarted(std::size_t dev, std::size_t n) const {
    return overlap_ ? overlap_->unstarted(dev, n) : n;
  }

  /// The gradient buckets (their traffic).
  [[nodiscard]] const grad_sync<T, Wire>& buckets() const noexcept { return buckets_; }
  /// The optimizer state's layout.
  [[nodiscard]] layout_type& state() noexcept { return state_; }
  /// The optimizer state's layout (read-only).
  [[nodiscard]] const layout_type& state() const noexcept { return state_; }

  /// One device's share of a step of `s` after its backward passes: synchronise, clip, update.
  /// Returns the global gradient norm; `sync_seconds` the time spent synchronising.
  template <class S>
  double apply_gradients(S& s, std::size_t dev, double& sync_seconds) {
    return zero_ ? apply_sharded(s, dev, sync_seconds) : apply_replicated(s, dev, sync_seconds);
  }

 private:
  // All-reduced gradients (over the replica axes when composed with FSDP, whose reduce-scatters
  // after each backward did the fsdp axis's share; overlapped: the buckets started during the
  // backward, nn/parallel/grad_overlap.hpp), then every device updates its whole blocks.
  template <class S>
  double apply_replicated(S& s, std::size_t dev, double& sync_seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto& params = s.params;
    const bool overlapped = overlap_ && overlap_->armed(dev);
    const std::vector<T*>& g = overlapped ? overlap_->finish(dev)
                               : fsdp_    ? buckets_.template all_reduce<replica_axes>(params, s.mesh, dev)
                                          : buckets_.template all_reduce<DataAxes>(params, s.mesh, dev);
    sync_seconds = overlapped ? overlap_->take_seconds(dev)
                              : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (fsdp_) sync_seconds += fsdp_->take_seconds(dev);
    std::vector<float_run>& runs = s.optimizer_step_.norm_runs(dev);
    for (std::size_t i = 0; i < params.size(); ++i) {
      s.unscale(g[i], params[i].count[dev]);
      runs.push_back(s.optimizer_step_.share_of(s.mesh, dev, params[i], g[i], params[i].count[dev], 0));
    }
    const double norm = s.optimizer_step_.global_norm(s.mesh, dev, runs);
    // The norm is summed over every device, so an inf or NaN anywhere makes it non-finite on all
    // of them: the skip verdict is the same on every device.
    if (s.loss_scaling() && !std::isfinite(norm)) return norm;
    std::vector<float*> slot(s.opt.slots());
    s.step_optimizer(dev, norm, 0, [&](auto&& f) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        for (std::size_t k = 0; k < slot.size(); ++k) slot[k] = state_.slot(i, k, dev);
        f(i, std::size_t{0}, g[i], params[i].count[dev], std::span<float* const>(slot));
      }
    });
    s.refresh_device(dev);
    return norm;
  }

  // ZeRO-1: the gradients reduce-scattered over the data axes, each device updating its slice of
  // the flat vector with its slice of the state, the updated slices all-gathered.
  template <class S>
  double apply_sharded(S& s, std::size_t dev, double& sync_seconds) {
    const auto& params = s.params;
    const std::size_t dp = s.mesh.axes_size(DataAxes);
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t begin = 0, size = 0;
    T* g = buckets_.template reduce_scatter<DataAxes>(params, s.mesh, dev, begin, size);
    sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.unscale(g, size);
    std::vector<float_run>& runs = s.optimizer_step_.norm_runs(dev);
    for_each_piece(params, dev, begin, size, [&](const param_ref<T>& p, std::size_t, std::size_t o, std::size_t len) {
      runs.push_back(s.optimizer_step_.share_of(s.mesh, dev, p, g + o, len, DataAxes));
    });
    const double norm = s.optimizer_step_.global_norm(s.mesh, dev, runs);
    if (s.loss_scaling() && !std::isfinite(norm)) return norm;  // same verdict everywhere (see above)
    float* m = state_.zero_state(dev).data();
    std::vector<float*> slot(s.opt.slots());
    s.step_optimizer(dev, norm, DataAxes, [&](auto&& f) {
      for_each_piece(params, dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t o,
                                                   std::size_t len) {
        for (std::size_t k = 0; k < slot.size(); ++k) slot[k] = m + k * size + o;
        f(static_cast<std::size_t>(&p - params.data()), in_param, g + o, len, std::span<float* const>(slot));
      });
    });
    // all_gather the updated slices: every replica gets the whole updated flat parameter vector.
    T* send = gather_.get(dev, size * (dp + 1));
    T* recv = send + size;
    fill_values<default_memory_space>(send, size, T{});
    for_each_piece(params, dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t o,
                                                 std::size_t len) {
      convert_copy<default_memory_space>(send + o, s.master(static_cast<std::size_t>(&p - params.data()), dev) + in_param,
                                         len);
    });
    const auto t1 = std::chrono::steady_clock::now();
    if (dp > 1) {
      // The slices vary over the data axes; gathered, every replica holds the whole vector.
      using slice_t = local_tensor<T, 1, Mesh, Mesh::all_axes>;
      (void)meshlib::all_gather_into<group_of_t<Mesh, DataAxes>, 0>(wrap1<slice_t>(send, size, s.mesh, dev),
                                                                   wrap1<slice_t>(recv, size * dp, s.mesh, dev));
    } else {
      convert_copy<default_memory_space>(recv, send, size);
    }
    sync_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::size_t off = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      convert_copy<default_memory_space>(s.master(i, dev), recv + off, params[i].count[dev]);
      off += params[i].count[dev];
    }
    s.refresh_device(dev);
    return norm;
  }

  // ZeRO's stage as data_parallel takes it: 1 shards the optimizer state, 0 does not; stage 3 is
  // fully_shard's, a policy of its own (on its own axis), not a number here.
  static bool checked_zero(int zero) {
    if (zero != 0 && zero != 1)
      throw sharding_error("meshlib::nn: data_parallel: zero = " + std::to_string(zero) +
                           "; data_parallel shards the optimizer state with zero = 1 (ZeRO-1) or not at all "
                           "(0); for ZeRO-3 use fully_shard<\"axis\"> on an axis of its own");
    return zero == 1;
  }

  // Calls `f(param, offset in param, offset in slice, length)` for the pieces of `params` that lie
  // in the flat slice `[begin, begin + size)` of device `dev`'s flat vector.
  template <class F>
  static void for_each_piece(const std::vector<param_ref<T>>& params, std::size_t dev, std::size_t begin,
                             std::size_t size, F&& f) {
    std::size_t off = 0;
    for (const auto& p : params) {
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) f(p, lo - off, lo - begin, hi - lo);
      off += p.count[dev];
    }
  }

  grad_sync<T, Wire> buckets_;
  layout_type state_;
  device_buffers<T> gather_;  // ZeRO-1's all-gather of the updated slices
  bool zero_ = false;
  bool overlap_on_ = false;
  // Shared by copies of the state, as the model's hooks pointing at them are.
  std::shared_ptr<fsdp_type> fsdp_;
  std::shared_ptr<overlap_type> overlap_;
};

}  // namespace detail

}  // namespace meshlib::nn
