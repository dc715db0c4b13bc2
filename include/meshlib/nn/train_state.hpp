// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `train_state` (model parameters, optimizer state, step, random key: flax's `TrainState`)
/// and `train_step(state, batch)`, which a user calls in a loop as optax users do: forward and
/// backward over `accumulation` micro-batches, one bucketed data-parallel synchronisation, global-norm
/// clipping over every shard, and the optimizer update (replicated, ZeRO-1 sharded over the data
/// axis, or FSDP: parameters, gradients and state sharded over an fsdp axis, nn/fsdp.hpp), all on
/// every device of the mesh at once.
///
/// The batch is the global batch (or this process's share of it, as `data_loader` gives it): device
/// `i` of the data axis takes rows `[i B/n, (i+1) B/n)`, replicated over the model axis.
///
/// The loss is the state's `softmax_cross_entropy` for class labels, or any `loss_function` given
/// to `train_step` with its targets (`mean_squared_error` for regression, or a user-written loss:
/// nn/loss_function.hpp).
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)));
/// for (auto b = loader.next(); b; b = loader.next()) {
///   auto m = meshlib::nn::train_step(state, *b);   // m.loss: the mean loss over the global batch
/// }
/// // regression: rows x F float targets, mean squared error
/// auto r = meshlib::nn::train_step(state, x, targets, rows, 0, rows, meshlib::nn::mean_squared_error{});
/// @endcode

#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/exec/thread_runner.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/loader.hpp"
#include "meshlib/nn/data/text_windows.hpp"
#include "meshlib/nn/device_put.hpp"
#include "meshlib/nn/detail/axis_mask_group.hpp"
#include "meshlib/nn/detail/buffers.hpp"
#include "meshlib/nn/detail/grad_overlap.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/nn/fsdp.hpp"
#include "meshlib/nn/grad_sync.hpp"
#include "meshlib/nn/loss.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/nn/mean_squared_error.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/pipeline.hpp"
#include "meshlib/nn/precision.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief How `train_step` runs (see the file comment).
struct train_options {
  std::size_t accumulation = 1;            ///< micro-batches per step; one synchronisation per step
  bool zero = false;                       ///< ZeRO-1: optimizer state and update sharded over the data axis
  /// FSDP (ZeRO-3): parameters, gradients and optimizer state stored sharded over the mesh's fsdp
  /// axis, each layer's parameters all-gathered just before it runs (nn/fsdp.hpp).
  bool fsdp = false;
  /// FSDP: gather a layer's parameters again for its backward (true: least memory), or keep them
  /// from its forward (false: one all-gather fewer per layer, unsharded parameters' memory).
  bool reshard_after_forward = true;
  std::size_t bucket_elements = 1u << 20;  ///< most gradient elements per collective (0: no limit)
  /// Dynamic loss scaling: the initial scale (> 0 turns it on; 0: on with 32768 for float16
  /// compute, off otherwise). The loss is multiplied by the scale before backward and the summed
  /// gradients divided by it; a step whose gradients hold an inf or NaN on any device is skipped on
  /// every device and halves the scale; `scale_growth_interval` good steps in a row double it.
  float loss_scale = 0.0f;
  std::size_t scale_growth_interval = 2000;  ///< good steps before the scale doubles
  /// Pipeline parallelism over the mesh's `pipeline` axis (used when it has more than one device):
  /// micro-batches, schedule and stage split (nn/pipeline.hpp).
  pipeline_options pipeline = {};
  /// Start each gradient bucket's data-parallel all-reduce during backward, as soon as the backward
  /// has completed its gradients (PyTorch DDP's overlap; nn/detail/grad_overlap.hpp), instead of
  /// after the whole backward. The same buckets and sums: bitwise the same training. Applies to a
  /// `sequential` model without ZeRO (ZeRO's reduce-scatter runs after the backward). Off by
  /// default: on the quiet 2-core machine the step took 1.00-1.02x the time with it at (2, 1) and
  /// (4, 2) (the thread backend's sums need the cores the backward uses); under load it took
  /// 0.54-0.58x at (4, 2) (docs/benchmarks.md, "Overlapped gradient synchronisation").
  bool overlap_grad_sync = false;
  /// FSDP with `reshard_after_forward = false`: start the next layer's parameter all-gathers
  /// before a layer's forward, so they run while it computes (FSDP2's prefetch; the same bits).
  /// With `reshard_after_forward` every layer shares one gather buffer, which a prefetch would
  /// overwrite: not prefetched.
  bool fsdp_prefetch = true;
};

namespace detail {
/// Sums the `N` numbers `v` (the squared norm; `(loss, correct)`) over the axes `Axes` with the
/// public donated `psum`, in `v` itself (a host-memory value that differs over every axis); every
/// device of the group gets the totals. Runs on device `dev` inside `spmd`.
template <axis_mask Axes, mesh_type Mesh, std::size_t N>
void sum_over(const Mesh& mesh, std::size_t dev, double (&v)[N]) {
  if constexpr (Axes != 0) {
    if constexpr (meshlib::detail::host_accessible_v<default_memory_space>) {
      using sums_t = local_tensor<double, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, Kokkos::HostSpace>;
      (void)psum_over<Axes>(wrap1<sums_t>(v, N, mesh, dev));
    } else {
      // A device communicator (NCCL, shared GPU) moves device memory only: the sums go through a
      // device block of the running device (reduced in place, then read back).
      using sums_t = local_tensor<double, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, default_memory_space>;
      const sums_t d(typename sums_t::shape_type{N}, mesh, dev);
      meshlib::detail::copy_from_host<default_memory_space>(d.data(), v, N);
      (void)psum_over<Axes>(wrap1<sums_t>(d.data(), N, mesh, dev));  // donated: in place
      meshlib::detail::copy_to_host<default_memory_space>(v, d.data(), N);
    }
  }
}
}  // namespace detail

/// @brief What one `train_step` (or `evaluate`) reports; equal on every device.
struct step_metrics {
  double loss = 0;             ///< mean loss over the global batch
  std::size_t correct = 0;     ///< rows whose prediction was right
  std::size_t rows = 0;        ///< rows of the global batch
  double grad_norm = 0;        ///< global gradient norm before clipping (train_step)
  /// Time the first local device's thread spent in the gradient synchronisation: blocked in its
  /// collectives, or (overlapped) starting them during backward and waiting for them after it: the
  /// synchronisation the step exposes.
  double sync_seconds = 0;
  bool skipped = false;        ///< dynamic loss scaling: the gradients were not finite, no update
  double loss_scale = 1;       ///< the loss scale this step used (1 without loss scaling)
  // ---- activation memory (nn/remat.hpp), of the first local device ----
  /// Bytes of the model's layer buffers (activations, outputs, cotangents, workspaces) live when the
  /// last micro-batch's forward returned: what is held between forward and backward.
  std::size_t activation_bytes = 0;
  /// The most bytes of the model's layer buffers live at any time during the step's forward and
  /// backward passes (what `remat` lowers).
  std::size_t peak_activation_bytes = 0;
};

namespace detail {
/// The text of a `fixed_string` template argument (see `train_state::shard_parameters`).
template <std::size_t N>
constexpr std::string_view text_of(const fixed_string<N>& s) noexcept {
  return s.view();
}
/// The text of a template argument nvcc's front end has turned into a `const char*`.
constexpr std::string_view text_of(const char* s) noexcept { return s; }
}  // namespace detail

/// @brief Parameters (inside `model`), optimizer state, step and key (see the file comment).
/// @tparam Data the data-parallel axis; @tparam Wire the gradient reduction's element type;
/// @tparam Compute the type parameters, activations and gradients are rounded to (float, bfloat16,
/// float16): with a 16-bit type the optimizer keeps and updates float master weights and then
/// rounds them into the parameters (see nn/precision.hpp and docs/training.md).
template <mesh_type Mesh, class Model, fixed_string Data = "data", comm_element Wire = float,
          compute_precision Compute = float, fixed_string Fsdp = "fsdp">
class train_state {
  // Instantiating the checker fires its one static_assert (naming both types) when they clash.
  static_assert(sizeof(detail::gradient_reduction_type_narrower_than_compute_type<
                       detail::reduction_at_least_compute<Wire, Compute>, Wire, Compute>) > 0);

 public:
  /// The element type of parameters and optimizer state.
  using T = float;
  /// The type parameters, activations and gradients are rounded to.
  using compute_type = Compute;
  /// True when `Compute` is a 16-bit type and float master weights are kept.
  static constexpr bool mixed = !std::is_same_v<Compute, float>;
  /// The mesh the model runs on.
  using mesh_type = Mesh;
  /// The network's type.
  using model_type = Model;
  /// The mesh's fsdp axis `Fsdp` (0 when it has none): FSDP shards parameters over it, and it
  /// splits the batch as a data axis does.
  static constexpr axis_mask fsdp_axes = [] {
    if constexpr (Mesh::template has_axis<Fsdp>) return Mesh::template mask_of<Fsdp>();
    else return axis_mask{0};
  }();
  /// The mesh axes the batch is split over and gradients are averaged over: `Data` and the fsdp
  /// axis (a mesh with an fsdp axis need not have `Data`).
  static constexpr axis_mask data_axes = [] {
    if constexpr (fsdp_axes != 0 && !Mesh::template has_axis<Data>) return fsdp_axes;
    else return Mesh::template mask_of<Data>() | fsdp_axes;
  }();
  /// The data axes other than the fsdp axis: under FSDP, the shards' gradients are all-reduced over these.
  static constexpr axis_mask replica_axes = data_axes & ~fsdp_axes;
  /// The mesh's `pipeline` axis (0 when it has none): stages of the model (nn/pipeline.hpp).
  static constexpr axis_mask pipeline_axes = [] {
    if constexpr (Mesh::template has_axis<"pipeline">) return Mesh::template mask_of<"pipeline">();
    else return axis_mask{0};
  }();
  /// The type of a device's block of the input batch: rows sharded over the data axes.
  using input_type = local_tensor<T, 2, Mesh, data_axes, 0, dim_masks<data_axes, axis_mask{0}>, default_memory_space>;
  /// The type of a device's block of token ids (a language model's input: one `std::int32_t` per
  /// row, the rows `batch * sequence` tokens, sequence-major), rows sharded over the data axes.
  using ids_type = local_tensor<std::int32_t, 1, Mesh, data_axes, 0, dim_masks<data_axes>, default_memory_space>;
  /// A device's ZeRO-1 optimizer state: shape `(slots, ceil(n / dp))`, row `s` slot `s` of this
  /// device's slice of its flat gradient vector (`n` elements: its parameters' blocks in order;
  /// `dp` devices over the data axes). Its type says what it is: dimension 1 is a block over the
  /// data axes, and the value varies over every axis (the flat vector itself differs over the
  /// axes parameters are sharded over). It is a local tensor, not a `sharded_tensor` with a global
  /// shape: the flat vectors of devices that differ over a model axis may have different lengths
  /// (uneven shardings), so no one global array is split into these slices (docs/design.md).
  using zero_state_type =
      local_tensor<float, 2, Mesh, Mesh::all_axes, 0, dim_masks<axis_mask{0}, data_axes>, default_memory_space>;

  /// The mesh the model runs on.
  Mesh mesh;
  /// The network; its parameters live inside it.
  Model model;
  /// The update rule and hyperparameters.
  optimizer opt;
  /// Accumulation, ZeRO and bucketing options.
  train_options options;
  /// Optimizer steps taken so far.
  std::size_t step = 0;
  /// The key each step's randomness (dropout) is folded from.
  rng_key key;
  /// Views of every parameter of `model`, in layer order.
  std::vector<param_ref<T>> params;

  /// @brief Collects the parameters of `net` and sizes the optimizer state of each local device.
  /// `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `opts.accumulation` is 0.
  train_state(const Mesh& m, Model net, optimizer o, train_options opts = {}, rng_key k = {},
              std::span<const std::size_t> local_devices = {})
      : mesh(m),
        model(std::move(net)),
        opt(o),
        options(opts),
        key(k),
        sync_(m.size(), opts.bucket_elements),
        loss_(m.size()),
        gather_(m.size()),
        input_(m.size()),
        ids_(m.size()),
        output_grad_(m.size()),
        squares_(m.size()) {
    model.collect(params);
    loss_scale_ = options.loss_scale > 0 ? options.loss_scale : (needs_loss_scaling<Compute> ? 32768.0f : 1.0f);
    scaling_ = options.loss_scale > 0 || needs_loss_scaling<Compute>;
    if constexpr (mixed)
      if constexpr (requires { model.round_activations = &detail::round_to<Compute>; })
        model.round_activations = &detail::round_to<Compute>;
    if (options.accumulation == 0) throw sharding_error("meshlib::nn: train_options: accumulation must be at least 1");
    std::vector<std::size_t> all;
    if (local_devices.empty())
      for (std::size_t d = 0; d < m.size(); ++d) all.push_back(d);
    else
      all.assign(local_devices.begin(), local_devices.end());
    local_ = all;
    if (options.fsdp) shard_parameters();
    // Pipeline (nn/pipeline.hpp): each parameter (under FSDP, each shard) restricted to its
    // stage's devices, before the optimizer state is sized from the parameters' blocks.
    if constexpr (pipeline_axes != 0)
      if (m.axes_size(pipeline_axes) > 1) pipeline_ = detail::make_pipeline_state<pipeline_axes>(*this);
    // The overlapped gradient sync's hooks; a pipelined step synchronises each stage's gradients
    // after its rounds (nn/detail/pipeline_step.hpp), not from the layer hooks.
    if (pipeline_ == nullptr) start_overlap();
    // Every tensor is made here, on the calling thread: device threads only read and write blocks
    // through unmanaged views (tensor/view.hpp: no reference count is touched off this thread).
    const std::size_t dp = m.axes_size(data_axes);
    if (options.zero) {
      zero_state_.reserve(m.size());
      for (std::size_t dev = 0; dev < m.size(); ++dev)
        if (std::find(local_.begin(), local_.end(), dev) == local_.end()) {
          zero_state_.emplace_back(typename zero_state_type::view_type(), mesh, dev);
        } else {
          const std::size_t n = grad_sync<T, Wire>::flat_size(params, dev);
          zero_state_.emplace_back(typename zero_state_type::shape_type{opt.slots(), (n + dp - 1) / dp}, mesh, dev);
        }
    } else {
      for (const auto& p : params)
        for (std::size_t s = 0; s < opt.slots(); ++s) state_.push_back(p.layout->zeros_like(local_));
    }
    if constexpr (mixed)
      for (const auto& p : params) {
        masters_.push_back(p.layout->zeros_like(local_));
        for (std::size_t dev : local_)
          detail::convert_copy<default_memory_space>(masters_.back().blocks[dev], p.value[dev], p.count[dev]);
      }
    refresh_compute_copies();
  }

  /// Parameter `i`'s float master block on device `dev`: the optimizer updates it; with a 16-bit
  /// `Compute` the parameter's value is its rounding (with float, the value itself).
  [[nodiscard]] float* master(std::size_t i, std::size_t dev) {
    if constexpr (mixed) return masters_.at(i).blocks[dev];
    else return params.at(i).value[dev];
  }
  /// Parameter `i`'s float master block on device `dev` (read-only).
  [[nodiscard]] const float* master(std::size_t i, std::size_t dev) const {
    if constexpr (mixed) return masters_.at(i).blocks[dev];
    else return params.at(i).value[dev];
  }
  /// Rounds the master weights into the parameters' values (after the masters were written, e.g.
  /// by restore_checkpoint). A no-op when computing in float.
  void refresh_compute_copies() {
    if constexpr (mixed)
      for (std::size_t dev : local_)
        for (std::size_t i = 0; i < params.size(); ++i)
          detail::round_copy<Compute>(params[i].value[dev], master(i, dev), params[i].count[dev]);
  }
  /// The current loss scale (1 without loss scaling).
  [[nodiscard]] float loss_scale() const noexcept { return loss_scale_; }
  /// Whether dynamic loss scaling is on.
  [[nodiscard]] bool loss_scaling() const noexcept { return scaling_; }
  /// Consecutive good steps since the scale last changed.
  [[nodiscard]] std::size_t good_steps() const noexcept { return good_steps_; }

  /// Device `dev`'s `n` input values at `x` as the model's kernels read them: `x` itself where they
  /// can (host memory on a host backend; device memory of the device's GPU, as from `device_put`),
  /// else staged into the device's buffer (host rows on a GPU); with a 16-bit `Compute`, a copy
  /// rounded to it (the caller's data is never modified).
  [[nodiscard]] float* input_block(std::size_t dev, const float* x, std::size_t n) {
    const float* src = input_.staged(dev, x, n);
    if constexpr (!mixed) {
      return const_cast<float*>(src);
    } else {
      float* b = input_.get(dev, n);
      if (src != b) detail::convert_copy<default_memory_space>(b, src, n);
      detail::round_to<Compute>(b, n);
      return b;
    }
  }
  /// Device `dev`'s `n` token ids at `x` as the model's kernels read them (see `input_block`).
  [[nodiscard]] std::int32_t* ids_block(std::size_t dev, const std::int32_t* x, std::size_t n) {
    return const_cast<std::int32_t*>(ids_.staged(dev, x, n));
  }
  /// Device `dev`'s buffer of `n` elements for the loss's gradient with respect to the model
  /// output (the `grad` argument of a `loss_function`); valid until the next step.
  [[nodiscard]] float* output_grad_block(std::size_t dev, std::size_t n) { return output_grad_.get(dev, n); }

  /// Called by train_step after the spmd region with every device's verdict (equal on all of
  /// them): advances the step, or, on a skipped step, halves the loss scale.
  void finish_step(bool skipped) {
    if (!scaling_) {
      ++step;
      return;
    }
    if (skipped) {
      loss_scale_ = std::max(loss_scale_ * 0.5f, 1.0f / 65536.0f);
      good_steps_ = 0;
      return;
    }
    ++step;
    if (++good_steps_ >= options.scale_growth_interval) {
      loss_scale_ *= 2.0f;
      good_steps_ = 0;
    }
  }

  /// This process's devices.
  [[nodiscard]] const std::vector<std::size_t>& local_devices() const noexcept { return local_; }
  /// Elements of optimizer state held by device `dev` (the ZeRO saving shows here); 0 for a
  /// device of another process.
  [[nodiscard]] std::size_t optimizer_state_size(std::size_t dev) const {
    if (std::find(local_.begin(), local_.end(), dev) == local_.end()) return 0;
    if (options.zero) return zero_state_.at(dev).size();
    return opt.slots() * grad_sync<T, Wire>::flat_size(params, dev);
  }
  /// @brief The bytes device `dev` holds for parameters, gradients and optimizer state (and, under
  /// FSDP, the buffers layers' parameters are gathered into); zero for a device of another process.
  [[nodiscard]] training_memory memory(std::size_t dev) const {
    training_memory m;
    if (std::find(local_.begin(), local_.end(), dev) == local_.end()) return m;
    const std::size_t n = grad_sync<T, Wire>::flat_size(params, dev);
    m.parameters = n * sizeof(T) * (mixed ? 2 : 1);
    m.gradients = n * sizeof(T);
    m.optimizer_state = optimizer_state_size(dev) * sizeof(float);
    if (fsdp_) m.unsharded = fsdp_->unsharded_elements(dev) * sizeof(T);
    return m;
  }
  /// A host copy of device `dev`'s optimizer state, slot after slot, each slot the device's flat
  /// vector (its parameters' blocks in order; under ZeRO-1, its slice of that vector): for tests
  /// and logs. Empty for a device of another process. Checkpoints use `for_each_state_run`.
  [[nodiscard]] std::vector<float> optimizer_state(std::size_t dev) {
    std::vector<float> out;
    out.reserve(optimizer_state_size(dev));
    for (std::size_t s = 0; s < opt.slots() && out.capacity() > 0; ++s)
      for_each_state_run(dev, [&](std::size_t, std::size_t, std::size_t len, std::span<float* const> slot) {
        out.insert(out.end(), slot[s], slot[s] + len);
      });
    return out;
  }
  /// Device `dev`'s ZeRO-1 optimizer state (`zero` on; see `zero_state_type`).
  [[nodiscard]] const zero_state_type& zero_state(std::size_t dev) const { return zero_state_.at(dev); }
  /// Device `dev`'s count of the model's layer buffers (`step_metrics::peak_activation_bytes`);
  /// `train_step` and `evaluate` make it the device thread's meter while the model runs.
  [[nodiscard]] detail::buffer_meter* activation_meter(std::size_t dev) const { return &meters_->at(dev); }
  /// The gradient synchronisation (its buckets and traffic).
  [[nodiscard]] const grad_sync<T, Wire>& sync() const noexcept { return sync_; }
  /// The loss function the training steps use.
  [[nodiscard]] softmax_cross_entropy<T>& loss() noexcept { return loss_; }
  /// The pipeline's stages and buffers (null without a pipeline axis of more than one device).
  [[nodiscard]] detail::pipeline_engine* pipeline() const noexcept { return pipeline_.get(); }
  /// The layers `[begin, end)` of each pipeline stage (empty without a pipeline).
  [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> pipeline_stages() const {
    return pipeline_ ? pipeline_->bounds : std::vector<std::pair<std::size_t, std::size_t>>{};
  }

  /// Calls `f(param_index, offset_in_block, len, slot)` for each run of optimizer state device
  /// `dev` holds, in parameter order: elements `[offset, offset + len)` of the parameter's local
  /// block, whose slot `s` starts at `slot[s]` (a `std::span<float* const>` of `opt.slots()`
  /// pointers). Replicated: whole blocks; ZeRO-1: the pieces of this device's slice of the flat vector.
  template <class F>
  void for_each_state_run(std::size_t dev, F&& f) {
    std::array<float*, 2> slot{};
    const std::span<float* const> slots(slot.data(), opt.slots());
    if (!options.zero) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        for (std::size_t s = 0; s < opt.slots(); ++s) slot[s] = state_slot(i, s, dev);
        f(i, std::size_t{0}, params[i].count[dev], slots);
      }
      return;
    }
    const std::size_t size = zero_state_.at(dev).extent(1), begin = mesh.group_rank(dev, data_axes) * size;
    std::size_t off = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) {
        for (std::size_t s = 0; s < opt.slots(); ++s) slot[s] = zero_state_[dev].data() + s * size + (lo - begin);
        f(i, lo - off, hi - lo, slots);
      }
      off += p.count[dev];
    }
  }
  /// Whether device `dev` is the one that writes parameter `p`'s optimizer state to a checkpoint
  /// (one device of each group holding the same state).
  [[nodiscard]] bool owns_state(std::size_t dev, const param_ref<T>& p) const {
    const axis_mask replicas = mesh.all_axes & ~p.sharded_axes & ~(options.zero ? data_axes : axis_mask{0});
    return mesh.group_rank(dev, replicas) == 0;
  }

  /// One device's share of a step after its backward passes: synchronise, clip, update.
  /// Returns the global gradient norm.
  double apply_gradients(std::size_t dev, double& sync_seconds) {
    const std::size_t dp = mesh.axes_size(data_axes);
    const auto t0 = std::chrono::steady_clock::now();
    if (!options.zero) {
      // FSDP: the fsdp axis's share of the sum was done by the reduce-scatters after each backward.
      // Overlapped: the buckets were started during backward (nn/detail/grad_overlap.hpp).
      const bool overlapped = overlap_ && overlap_->armed(dev);
      const std::vector<T*>& g = overlapped ? overlap_->finish(dev)
                                 : fsdp_    ? sync_.template all_reduce<replica_axes>(params, mesh, dev)
                                            : sync_.template all_reduce<data_axes>(params, mesh, dev);
      sync_seconds = overlapped ? overlap_->take_seconds(dev)
                                : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (fsdp_) sync_seconds += fsdp_->take_seconds(dev);
      double sq[1] = {0};
      for (std::size_t i = 0; i < params.size(); ++i) {
        unscale(g[i], params[i].count[dev]);
        sq[0] += share_of_squares(dev, params[i], g[i], params[i].count[dev], 0);
      }
      detail::sum_over<Mesh::all_axes>(mesh, dev, sq);
      const double norm = std::sqrt(sq[0]);
      // The norm is summed over every device, so an inf or NaN anywhere makes it non-finite on all
      // of them: the skip verdict is the same on every device.
      if (scaling_ && !std::isfinite(norm)) return norm;
      const float scale = clip_scale(norm);
      for (std::size_t i = 0; i < params.size(); ++i) {
        float* m = state_slot(i, 0, dev);
        float* v = opt.slots() > 1 ? state_slot(i, 1, dev) : m;
        opt.update(master(i, dev), g[i], m, v, params[i].count[dev], step, scale, params[i].decay);
      }
      refresh_device(dev);
      return norm;
    }
    std::size_t begin = 0, size = 0;
    T* g = sync_.template reduce_scatter<data_axes>(params, mesh, dev, begin, size);
    sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    unscale(g, size);
    double sq[1] = {0};
    for_each_piece(dev, begin, size, [&](const param_ref<T>& p, std::size_t, std::size_t s, std::size_t len) {
      sq[0] += share_of_squares(dev, p, g + s, len, data_axes);
    });
    detail::sum_over<Mesh::all_axes>(mesh, dev, sq);
    const double norm = std::sqrt(sq[0]);
    if (scaling_ && !std::isfinite(norm)) return norm;  // same verdict everywhere (see above)
    const float scale = clip_scale(norm);
    float* m = zero_state_[dev].data();
    float* v = opt.slots() > 1 ? m + size : m;
    for_each_piece(dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t s, std::size_t len) {
      opt.update(master_of(p, dev) + in_param, g + s, m + s, v + s, len, step, scale, p.decay);
    });
    // all_gather the updated slices: every replica gets the whole updated flat parameter vector.
    T* send = gather_.get(dev, size * (dp + 1));
    T* recv = send + size;
    detail::fill_values<default_memory_space>(send, size, T{});
    for_each_piece(dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t s, std::size_t len) {
      detail::convert_copy<default_memory_space>(send + s, master_of(p, dev) + in_param, len);
    });
    const auto t1 = std::chrono::steady_clock::now();
    if (dp > 1) {
      // The slices vary over the data axes; gathered, every replica holds the whole vector.
      using slice_t = local_tensor<T, 1, Mesh, Mesh::all_axes>;
      (void)meshlib::all_gather_into<detail::group_of_t<Mesh, data_axes>, 0>(
          detail::wrap1<slice_t>(send, size, mesh, dev), detail::wrap1<slice_t>(recv, size * dp, mesh, dev));
    } else {
      detail::convert_copy<default_memory_space>(recv, send, size);
    }
    sync_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::size_t off = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      detail::convert_copy<default_memory_space>(master(i, dev), recv + off, params[i].count[dev]);
      off += params[i].count[dev];
    }
    refresh_device(dev);
    return norm;
  }

  /// Overlapped gradient sync: before the last micro-batch's backward on `dev`, arms the hooks that
  /// start the buckets (no-op without overlap).
  void begin_grad_overlap(std::size_t dev) {
    if (overlap_) overlap_->arm(sync_, params, dev);
  }
  /// Overlapped gradient sync: at the start of the step on `dev`, makes the buckets' communicator
  /// (nn/detail/grad_overlap.hpp, `prepare`; no-op without overlap).
  void prepare_grad_overlap(std::size_t dev) {
    if (overlap_) overlap_->prepare(dev);
  }
  /// The parameters `[0, n)` whose gradients train_step still zeroes and rounds after the backward
  /// (the hooks did the others' before starting their buckets).
  [[nodiscard]] std::size_t grad_overlap_unstarted(std::size_t dev) const {
    return overlap_ ? overlap_->unstarted(dev, params.size()) : params.size();
  }

 private:
  /// `train_options::overlap_grad_sync`: installs the overlap hooks (around FSDP's, when on).
  void start_overlap() {
    if constexpr (requires(Model& net) {
                    net.hooks;
                    net.template params_per_layer<T>();
                  }) {
      if (!options.overlap_grad_sync || options.zero) return;
      void (*round)(float*, std::size_t) noexcept = nullptr;
      if constexpr (mixed) round = &detail::round_to<Compute>;
      overlap_ = std::make_shared<overlap_type>(mesh, model.template params_per_layer<T>(), round, fsdp_.get());
      model.hooks = overlap_.get();
    }
  }

  /// FSDP: moves the parameters into their shards (nn/fsdp.hpp); `params` become the shards.
  void shard_parameters() {
    // nvcc's front end takes `Fsdp`, whose default is a string literal, for a `const char*` here
    // ("expression must have class type"): read it through an overload for either.
    const std::string_view fsdp_name = detail::text_of(Fsdp);
    if constexpr (fsdp_axes == 0) {
      throw sharding_error("meshlib::nn: train_state: train_options::fsdp needs a mesh axis named '" +
                           std::string(fsdp_name) + "' to shard the parameters over; the mesh is " +
                           mesh.to_string() + ": add the axis (e.g. mesh<axis<\"data\">, axis<\"" +
                           std::string(fsdp_name) + "\">, axis<\"model\">>)");
    } else if constexpr (!requires(Model& net) {
                           net.hooks;
                           net.template params_per_layer<T>();
                         }) {
      throw sharding_error("meshlib::nn: train_state: train_options::fsdp needs a sequential model (its layers are "
                           "FSDP's units: each is gathered just before it runs); wrap the layers in nn::sequential");
    } else {
      if (options.zero)
        throw sharding_error("meshlib::nn: train_state: train_options::fsdp and zero are both set; FSDP already "
                             "shards the optimizer state (over '" + std::string(fsdp_name) + "'): turn zero off");
      fsdp_ = std::make_shared<detail::fsdp_engine<Mesh, fsdp_axes>>(mesh, params, model.template params_per_layer<T>(),
                                                                      local_, options.reshard_after_forward, fsdp_name,
                                                                      options.fsdp_prefetch);
      params = fsdp_->shards();
      model.hooks = fsdp_.get();
    }
  }
  /// This device's share of the sum of squares of `len` elements at `g`, a (piece of a) block of
  /// `p` that every device of the group of axes `p` is replicated over (less `except`) holds alike:
  /// the group splits it evenly, so each element counts once over the mesh and no device sums alone.
  double share_of_squares(std::size_t dev, const param_ref<T>& p, const T* g, std::size_t len, axis_mask except) const {
    const axis_mask copies = mesh.all_axes & ~p.sharded_axes & ~except;
    const std::size_t r = mesh.axes_size(copies), q = mesh.group_rank(dev, copies);
    const std::size_t lo = len * q / r, hi = len * (q + 1) / r;
    return detail::sum_of_squares<default_memory_space>(g + lo, hi - lo,
                                                        squares_.get(dev, detail::squares_scratch(hi - lo)));
  }
  void unscale(T* g, std::size_t n) const noexcept {
    if (scaling_ && loss_scale_ != 1.0f) {
      detail::scale_in_place(g, n, 1.0f / loss_scale_);
    }
  }
  /// Slot `s` of parameter `i`'s optimizer state on device `dev` (replicated mode).
  float* state_slot(std::size_t i, std::size_t s, std::size_t dev) const { return state_[i * opt.slots() + s].blocks[dev]; }
  float* master_of(const param_ref<T>& p, std::size_t dev) {
    return master(static_cast<std::size_t>(&p - params.data()), dev);
  }
  void refresh_device(std::size_t dev) {
    if constexpr (mixed)
      for (std::size_t i = 0; i < params.size(); ++i)
        detail::round_copy<Compute>(params[i].value[dev], master(i, dev), params[i].count[dev]);
  }
  float clip_scale(double norm) const {
    return opt.clip_norm > 0 && norm > opt.clip_norm ? static_cast<float>(opt.clip_norm / norm) : 1.0f;
  }
  /// Calls `f(param, offset in param, offset in slice, length)` for the pieces of parameters that
  /// lie in the flat slice `[begin, begin + size)`.
  template <class F>
  void for_each_piece(std::size_t dev, std::size_t begin, std::size_t size, F&& f) const {
    std::size_t off = 0;
    for (const auto& p : params) {
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) f(p, lo - off, lo - begin, hi - lo);
      off += p.count[dev];
    }
  }

  grad_sync<T, Wire> sync_;
  softmax_cross_entropy<T> loss_;
  // Optimizer state (see docs/design.md). Replicated: slot `s` of parameter `i` is
  // `state_[i * slots + s]`, a float tensor with the parameter's own shape and sharding (the same
  // blocks as its value and gradient). ZeRO-1: `zero_state_[dev]` (see `zero_state_type`).
  std::vector<detail::held_tensor<float>> state_;
  std::vector<zero_state_type> zero_state_;
  detail::device_buffers<T> gather_;
  std::vector<std::size_t> local_;
  detail::device_buffers<T> input_;
  detail::device_buffers<std::int32_t> ids_;  // token ids staged for a device that cannot read the caller's
  detail::device_buffers<T> output_grad_;
  // The clipping norm's partial sums (a const query writes them: each device only its own slot).
  mutable detail::device_buffers<double> squares_;
  /// Per parameter (16-bit Compute only): its float master weights, a tensor with the
  /// parameter's shape and sharding.
  std::vector<detail::held_tensor<float>> masters_;
  /// FSDP's shards, buffers and layer hooks (null without FSDP); shared by copies of the state.
  std::shared_ptr<detail::fsdp_engine<Mesh, fsdp_axes>> fsdp_;
  /// Per device: the bytes of the model's layer buffers (shared by copies of the state, as the
  /// model's buffers are; the buffers point at it).
  std::shared_ptr<std::vector<detail::buffer_meter>> meters_ =
      std::make_shared<std::vector<detail::buffer_meter>>(mesh.size());
  /// The pipeline's stages and buffers (null without a pipeline axis of more than one device).
  std::shared_ptr<detail::pipeline_engine> pipeline_;
  /// The overlapped gradient sync's hooks (null without it); shared by copies of the state.
  using overlap_type = detail::grad_overlap<T, Wire, Mesh, data_axes, replica_axes>;
  std::shared_ptr<overlap_type> overlap_;
  float loss_scale_ = 1.0f;
  bool scaling_ = false;
  std::size_t good_steps_ = 0;
};

namespace detail {
/// Throws unless a global batch of `count` units (rows; or sequences of `seq` tokens, `seq > 0`)
/// splits evenly over the data axis and `groups` (accumulation steps, or 1).
template <class State>
void check_batch(const State& s, std::size_t count, std::size_t groups, const char* what, std::size_t seq = 0) {
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  if (count != 0 && count % (dp * groups) == 0) return;
  const std::string unit = seq == 0 ? " rows" : " sequences";
  throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(count) + unit +
                       (seq == 0 ? std::string() : " (of " + std::to_string(seq) + " tokens)") +
                       " does not split evenly over the " + std::to_string(dp) + " devices of the data axis" +
                       (groups > 1 ? " x " + std::to_string(groups) + " accumulation steps" : std::string()) +
                       "; choose a batch size that is a multiple of " + std::to_string(dp * groups) +
                       (seq == 0 ? std::string() : unit));
}

/// The tokens per sequence of a model that starts at token ids: the `sequence_length()` of the
/// first of its top-level layers that has one (a `positional_embedding`), else 0 (unknown).
template <class Model>
std::size_t sequence_length_of(const Model& model) {
  if constexpr (requires { model.sequence_length(); }) {
    return model.sequence_length();
  } else if constexpr (requires { std::tuple_size<std::remove_cvref_t<decltype(model.layers)>>::value; }) {
    std::size_t seq = 0;
    std::apply([&](const auto&... l) { ((seq = seq != 0 ? seq : sequence_length_of(l)), ...); }, model.layers);
    return seq;
  } else {
    return 0;
  }
}

/// The batch check of a model that starts at token ids, in sequences: `tokens` global tokens are
/// whole sequences of `seq` (0: the model's, when it has one) and the sequences split evenly over
/// the data axis and `groups`, so that every device gets whole sequences (checked before any
/// kernel, which would otherwise refuse a device's share in tokens).
template <class State>
void check_token_batch(const State& s, std::size_t tokens, std::size_t groups, const char* what, std::size_t seq = 0) {
  if (seq == 0) seq = sequence_length_of(s.model);
  if (seq == 0) return;  // no layer reads sequences: the batch is checked in rows
  if (tokens % seq != 0)
    throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(tokens) +
                         " tokens is not a whole number of sequences of " + std::to_string(seq) +
                         " tokens; give sequences x " + std::to_string(seq) + " tokens (rows are sequence-major)");
  check_batch(s, tokens / seq, groups, what, seq);
}

/// Throws unless `runner` runs exactly the devices whose state `s` holds in this process: a runner
/// that runs others would read blocks this process does not have, and one that runs fewer would
/// leave the state's other devices a step behind.
template <class State, class Runner>
void check_runner(const State& s, const Runner& runner, const char* what) {
  const std::vector<std::size_t> run = runner.local_devices(s.mesh.size());
  if (run == s.local_devices()) return;
  throw sharding_error("meshlib::nn: " + std::string(what) + ": the runner runs devices " +
                       meshlib::detail::describe_devices(run) + " in this process, but the train state holds devices " +
                       meshlib::detail::describe_devices(s.local_devices()) +
                       "; pass the runner the state was made for, or make the state with the runner's devices "
                       "(train_state(..., runner.local_devices(mesh.size())))");
}
}  // namespace detail

namespace detail {
/// The element types a model's input may have: float feature rows, or `std::int32_t` token ids
/// (one per row; a language model whose first layer is an `embedding`).
template <class In>
concept input_element = std::same_as<In, float> || std::same_as<In, std::int32_t>;

/// A device's block of the model input for elements `In`: `State::input_type` (float rows of
/// `features`) or `State::ids_type` (one token id per row).
template <class State, input_element In>
using input_block_t = std::conditional_t<std::is_same_v<In, std::int32_t>, typename State::ids_type,
                                         typename State::input_type>;

/// Device `dev`'s block of `rows` input rows at `x` (`features` each) as the model takes it: float
/// rows through `State::input_block` (rounded to the compute type), ids as they are (ids are not
/// rounded, and the embedding checks their range).
template <input_element In, class State>
input_block_t<State, In> make_input_block(State& s, std::size_t dev, const In* x, std::size_t rows, std::size_t features) {
  using X = input_block_t<State, In>;
  if constexpr (std::is_same_v<In, std::int32_t>)
    return X(typename X::view_type(s.ids_block(dev, x, rows), rows), s.mesh, dev);
  else
    return X(typename X::view_type(s.input_block(dev, x, rows * features), rows, features), s.mesh, dev);
}

/// Throws unless `n` token ids are one per row of `rows`.
template <class In>
void check_input_rows(std::size_t n, std::size_t rows, const char* what) {
  if constexpr (std::is_same_v<In, std::int32_t>)
    if (n != rows)
      throw sharding_error("meshlib::nn: " + std::string(what) + ": " + std::to_string(n) + " token ids for " +
                           std::to_string(rows) + " rows: a model that starts at an embedding takes one id per row "
                           "(rows = sequences x sequence length, sequence-major)");
}

/// The argument checks of every `train_step` (the plain step and the pipelined one): the global
/// batch splits over the data axes and `groups` (accumulation steps, or 1), `backend` runs the
/// state's devices, `n_in` inputs are one id per row when `In` is a token id, and the `n_targets`
/// targets give every one of the `rows` rows the same number.
template <class In, class State, class Backend>
void check_step_inputs(const State& s, const Backend& backend, std::size_t n_in, std::size_t n_targets,
                       std::size_t rows, std::size_t global_rows, std::size_t groups) {
  if constexpr (std::is_same_v<In, std::int32_t>) check_token_batch(s, global_rows, groups, "train_step");
  check_batch(s, global_rows, groups, "train_step");
  check_runner(s, backend, "train_step");
  check_input_rows<In>(n_in, rows, "train_step");
  if (rows != 0 && n_targets % rows != 0)
    throw sharding_error("meshlib::nn: train_step: " + std::to_string(n_targets) + " target values for " +
                         std::to_string(rows) +
                         " rows: give every row the same number of targets (one label per row for "
                         "softmax_cross_entropy, one value per output column for mean_squared_error)");
}

// The pipelined step and evaluation (nn/detail/pipeline_step.hpp, included at the end of this file).
template <class State, class In, class Target, class Loss, class Backend>
step_metrics run_pipeline_step(State& s, std::span<const In> x, std::span<const Target> y, std::size_t rows,
                               std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend);
template <class State, class In, class Backend>
step_metrics run_pipeline_evaluate(State& s, std::span<const In> x, std::size_t features, std::span<const std::int32_t> y,
                                   std::size_t count, std::size_t group, std::size_t batch_rows, const Backend& backend);

/// The step of every `train_step` overload, with the loss `loss` (a `loss_function` of the model's
/// output, checked by the caller), `x` this process's `rows` rows of input (float features, or one
/// token id per row) and `y` holding `rows` rows of targets of equal width.
template <class State, input_element In, class Target, class Loss, class Backend>
step_metrics run_train_step(State& s, std::span<const In> x, std::span<const Target> y, std::size_t rows,
                            std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend) {
  if constexpr (State::pipeline_axes != 0)
    if (s.pipeline() != nullptr) return run_pipeline_step(s, x, y, rows, global_offset, global_rows, loss, backend);
  const std::size_t k = s.options.accumulation;
  check_step_inputs<In>(s, backend, x.size(), y.size(), rows, global_rows, k);
  const std::size_t features = rows == 0 ? 0 : x.size() / rows;
  const std::size_t width = rows == 0 ? 0 : y.size() / rows;  // targets per row
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  const std::size_t local_rows = global_rows / dp, micro = local_rows / k;
  using X = input_block_t<State, In>;
  s.model.begin_step(s.key.fold_in(s.step), true);
  std::vector<step_metrics> out(s.mesh.size());
  meshlib::spmd(
      s.mesh,
      [&](std::size_t dev) {
        const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
        const std::size_t first = di * local_rows;
        if (first < global_offset || first + local_rows > global_offset + rows)
          throw sharding_error("meshlib::nn: train_step: device " + std::to_string(dev) + " needs rows [" +
                               std::to_string(first) + ", " + std::to_string(first + local_rows) +
                               ") of the global batch, but this process holds rows [" + std::to_string(global_offset) +
                               ", " + std::to_string(global_offset + rows) + ")");
        // Last step's gradients: the layers that can overwrite them in the first backward do (no
        // zeroing pass over the model), the others add to zeros.
        for (const auto& p : s.params)
          if (p.overwrite) p.overwrite[dev] = 1;
          else fill_values<default_memory_space>(p.grad[dev], p.count[dev], 0.0f);
        double sums[2] = {0, 0};
        buffer_meter* meter = s.activation_meter(dev);
        meter->reset_peak();
        s.prepare_grad_overlap(dev);
        for (std::size_t j = 0; j < k; ++j) {
          const std::size_t r0 = first + j * micro - global_offset;
          const X xb = make_input_block<In>(s, dev, x.data() + r0 * features, micro, features);
          auto logits = [&] {
            const meter_scope metered(meter);  // counts the model's buffers only
            return s.model.forward(xb);
          }();
          out[dev].activation_bytes = meter->live;
          using Z = decltype(logits);
          Z dlogits(typename Z::view_type(s.output_grad_block(dev, logits.size()), logits.extent(0), logits.extent(1)),
                    s.mesh, dev);
          const loss_part part = as_loss_part(loss(std::as_const(logits), y.subspan(r0 * width, micro * width),
                                                   global_rows, dlogits));
          if (s.loss_scaling() || State::mixed) {
            // The scaled loss's cotangent, on the compute type's grid (float16 overflows here first).
            scale_in_place(dlogits.data(), dlogits.size(), s.loss_scale());
            round_to<typename State::compute_type>(dlogits.data(), dlogits.size());
          }
          if (j + 1 == k) s.begin_grad_overlap(dev);  // the last backward completes the gradients
          {
            const meter_scope metered(meter);
            s.model.template backward<X>(dlogits);
          }
          sums[0] += part.loss;
          sums[1] += static_cast<double>(part.correct);
        }
        // (Overlapped: the hooks did this for the gradients whose buckets they started.)
        const std::span<const param_ref<float>> unstarted(s.params.data(), s.grad_overlap_unstarted(dev));
        for (const auto& p : unstarted)
          if (p.overwrite && p.overwrite[dev]) {  // no backward wrote it (its layer did not run): zero
            fill_values<default_memory_space>(p.grad[dev], p.count[dev], 0.0f);
            p.overwrite[dev] = 0;
          }
        if constexpr (State::mixed)
          for (const auto& p : unstarted) round_to<typename State::compute_type>(p.grad[dev], p.count[dev]);
        step_metrics& m = out[dev];
        m.peak_activation_bytes = meter->peak;
        m.loss_scale = s.loss_scale();
        m.grad_norm = s.apply_gradients(dev, m.sync_seconds);
        m.skipped = s.loss_scaling() && !std::isfinite(m.grad_norm);
        sum_over<State::data_axes>(s.mesh, dev, sums);
        m.loss = sums[0];
        m.correct = static_cast<std::size_t>(sums[1] + 0.5);
        m.rows = global_rows;
      },
      backend);
  const step_metrics& r = out[s.local_devices().front()];
  for (std::size_t dev : s.local_devices())
    if (out[dev].skipped != r.skipped)  // cannot happen: the verdict comes from an all-reduced norm
      throw sharding_error("meshlib::nn: train_step: devices disagree on skipping the step (device " +
                           std::to_string(dev) + ")");
  s.finish_step(r.skipped);
  return r;
}

/// The model's output type for a train state's input of elements `In` (what a loss receives).
template <class State, class In = float>
using output_of_t = std::remove_cvref_t<decltype(std::declval<typename State::model_type&>().forward(
    std::declval<const input_block_t<State, In>&>()))>;

/// The `train_step` with a user's loss, for inputs of elements `In` (see the public overloads).
template <input_element In, class State, std::ranges::contiguous_range Targets, class Loss, class Backend>
step_metrics train_step_with_loss(State& s, std::span<const In> x, const Targets& targets, std::size_t rows,
                                  std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend) {
  using L = std::remove_reference_t<Loss>;
  using Z = output_of_t<State, In>;
  constexpr bool is_loss = loss_function<L, Z>;
  static_assert(sizeof(loss_does_not_satisfy_loss_function<is_loss, std::remove_cvref_t<Loss>, Z>) > 0);
  if constexpr (is_loss) {
    using given = std::remove_cv_t<std::ranges::range_value_t<Targets>>;
    constexpr bool same = std::is_same_v<given, loss_target_t<L>>;
    static_assert(sizeof(targets_type_differs_from_loss_target_type<same, std::remove_cvref_t<Loss>, given,
                                                                    loss_target_t<L>>) > 0);
    if constexpr (same)
      return run_train_step(s, x, std::span<const given>(std::ranges::data(targets), std::ranges::size(targets)), rows,
                            global_offset, global_rows, loss, backend);
    else
      return {};
  } else {
    return {};
  }
}
}  // namespace detail

/// @brief One training step on a global batch: `x` holds this process's `rows` rows (row-major,
/// `features` each) starting at row `global_offset` of a global batch of `global_rows` rows, and
/// `y` their class labels; the loss is the state's `softmax_cross_entropy` (`state.loss()`).
/// The parameters' gradient blocks start the step holding the last step's gradients: the first
/// backward overwrites them (or, for a layer that only adds, they are zeroed first); they serve as
/// the synchronisation's buffers (the big ones are all-reduced in place): after the step they are scratch.
/// Runs on `backend` (default: `default_runner`, as `spmd`: this process's device threads, or, after
/// `mpi::initialize` started several processes, those processes), which must run the devices the
/// state holds in this process.
/// @throws sharding_error when the batch does not split over the data axis and the accumulation
/// steps, when a device's rows are not in this process's share, when `y` is not one label per row,
/// or when `backend` runs other devices than the state holds here.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, std::span<const float> x, std::span<const std::int32_t> y, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, const Backend& backend = {}) {
  return detail::run_train_step(s, x, y, rows, global_offset, global_rows, s.loss(), backend);
}

/// @brief One training step with the loss `loss` (a `loss_function` of the model's output:
/// `mean_squared_error`, `softmax_cross_entropy`, or a user-written loss) on targets `targets`:
/// a contiguous range of the loss's `target_type`, this process's `rows` rows of targets of equal
/// width, row-major (for `mean_squared_error`, one value per output column). Otherwise as the
/// `train_step` above: `m.loss` is the mean loss over the global batch.
/// @code
/// auto m = nn::train_step(state, x, std::span<const float>(t), rows, 0, rows, nn::mean_squared_error{});
/// @endcode
/// A loss that is not a `loss_function`, or targets of another element type than its
/// `target_type`, is one compile error naming the requirement.
/// @throws sharding_error as the `train_step` above, when the targets are not the same number per
/// row, and (as the cause of a `device_error`) what the loss throws: `mean_squared_error` on
/// targets whose width is not the model output's.
template <class State, std::ranges::contiguous_range Targets, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, std::span<const float> x, const Targets& targets, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, Loss&& loss, const Backend& backend = {}) {
  return detail::train_step_with_loss<float>(s, x, targets, rows, global_offset, global_rows, loss, backend);
}

/// @brief One training step of a model that starts at token ids (a language model whose first
/// layer is an `embedding`): `ids` holds this process's `rows` tokens (one id per row; the rows
/// are sequences of the model's sequence length, sequence-major, whole sequences on every device
/// of the data axis), starting at row `global_offset` of a global batch of `global_rows` tokens,
/// and `y` each token's target (the next token); the loss is the state's `softmax_cross_entropy`,
/// which takes logits sharded over the vocabulary (a `tied_head` or `column_dense` head) without
/// gathering them. `m.loss` is the mean loss per token over the global batch.
/// @code
/// auto b = nn::sample_windows(train_text, 32, 64, key.fold_in(state.step));   // 32 windows of 64 bytes
/// auto m = nn::train_step(state, b);   // or: train_step(state, ids, next_ids, rows, 0, rows)
/// @endcode
/// @throws sharding_error as the float `train_step`, when `ids` is not one id per row, and, before
/// any kernel runs, when the global batch is not whole sequences of the model's sequence length (its
/// `positional_embedding`'s) or its sequences do not split evenly over the data axis (and the
/// accumulation steps): the message counts sequences as the float path counts rows; (as the cause
/// of a `device_error`) `std::out_of_range` from the embedding for an id outside its vocabulary,
/// naming the layer and the vocabulary size, and `sharding_error` from a layer whose own sequence
/// length does not fit a device's rows.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, std::span<const std::int32_t> ids, std::span<const std::int32_t> y, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, const Backend& backend = {}) {
  return detail::run_train_step(s, ids, y, rows, global_offset, global_rows, s.loss(), backend);
}

/// @brief One training step of a model that starts at token ids, with the loss `loss` (a
/// `loss_function`) on `targets`; otherwise as the `train_step` on ids above.
template <class State, std::ranges::contiguous_range Targets, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, std::span<const std::int32_t> ids, const Targets& targets, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, Loss&& loss, const Backend& backend = {}) {
  return detail::train_step_with_loss<std::int32_t>(s, ids, targets, rows, global_offset, global_rows, loss, backend);
}

/// @brief `train_step` on windows of text (`sample_windows`): every window a sequence, the whole
/// batch global (`b.rows * b.context` tokens, every process holding all of them).
/// @throws sharding_error, before any kernel runs, when the `b.rows` windows do not split evenly
/// over the data axis (and the accumulation steps), in sequences: "the global batch of 3 sequences
/// (of 8 tokens) does not split evenly over the 2 devices of the data axis; choose a batch size that
/// is a multiple of 2 sequences"; otherwise as the `train_step` on ids.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, const token_batch& b, const Backend& backend = {}) {
  const std::size_t tokens = b.rows * b.context;
  // In windows, before anything runs (the model's own sequence length may differ: the layers name it).
  detail::check_batch(s, b.rows, s.options.accumulation, "train_step", b.context);
  return train_step(s, std::span<const std::int32_t>(b.inputs), std::span<const std::int32_t>(b.targets), tokens, 0,
                    tokens, backend);
}

/// @brief `train_step` on a batch from `data_loader`.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, const batch& b, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x), std::span<const std::int32_t>(b.y), b.rows, b.global_offset,
                    b.global_rows, backend);
}

/// @brief `train_step` on a batch from `data_loader` with the loss `loss` (a `loss_function`
/// taking the batch's class labels, `std::int32_t`).
template <class State, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, const batch& b, Loss&& loss, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x), b.y, b.rows, b.global_offset, b.global_rows,
                    std::forward<Loss>(loss), backend);
}

/// @brief `train_step` on a batch already in device memory (`device_put`, `device_prefetcher`):
/// the model reads its rows in place; the labels are the batch's host copy.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, const device_batch& b, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x.data(), b.x.size()), std::span<const std::int32_t>(b.y), b.rows,
                    b.global_offset, b.global_rows, backend);
}

/// @brief `train_step` on a batch in device memory with the loss `loss` (see the `batch` overload).
template <class State, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, const device_batch& b, Loss&& loss, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x.data(), b.x.size()), b.y, b.rows, b.global_offset, b.global_rows,
                    std::forward<Loss>(loss), backend);
}

namespace detail {
/// `evaluate` on `count` rows at `x` (`features` floats, or one id, each) with labels `y`, in batches
/// of `batch_rows` rows; each batch is split over the data axis in whole groups of `group` rows (a
/// sequence for a language model; 1 for feature rows), so a last, smaller batch is split unevenly
/// and a device may get none (it still runs the forward, on no rows, so that every device makes the
/// same collective calls).
template <class State, input_element In, class Backend>
step_metrics run_evaluate(State& s, std::span<const In> x, std::size_t features, std::span<const std::int32_t> y,
                          std::size_t count, std::size_t group, std::size_t batch_rows, const Backend& backend) {
  if constexpr (State::pipeline_axes != 0)
    if (s.pipeline() != nullptr) return run_pipeline_evaluate(s, x, features, y, count, group, batch_rows, backend);
  check_runner(s, backend, "evaluate");
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  s.model.begin_step(s.key, false);
  std::vector<step_metrics> out(s.mesh.size());
  meshlib::spmd(
      s.mesh,
      [&](std::size_t dev) {
        const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
        double sums[2] = {0, 0};
        for (std::size_t start = 0; start < count; start += batch_rows) {
          const std::size_t units = std::min(batch_rows, count - start) / group;
          const std::size_t lo = start + units * di / dp * group, hi = start + units * (di + 1) / dp * group;
          auto logits = [&] {
            const meter_scope metered(s.activation_meter(dev));  // new buffers are the model's too
            return s.model.forward(make_input_block<In>(s, dev, x.data() + lo * features, hi - lo, features));
          }();
          const loss_part part = s.loss().forward(logits, y.subspan(lo, hi - lo), count);
          sums[0] += part.loss;
          sums[1] += static_cast<double>(part.correct);
        }
        sum_over<State::data_axes>(s.mesh, dev, sums);
        out[dev].loss = sums[0];
        out[dev].correct = static_cast<std::size_t>(sums[1] + 0.5);
        out[dev].rows = count;
      },
      backend);
  return out[s.local_devices().front()];
}
}  // namespace detail

/// @brief Loss and accuracy of the model on a whole data set (every process holds it), forward only,
/// in batches of `batch_rows` split over the data axis (a last, smaller batch is split unevenly).
/// Runs on `backend` as `train_step` does.
/// @throws sharding_error when `backend` runs other devices than the state holds here.
template <class State, class Backend = default_runner>
step_metrics evaluate(State& s, const dataset& ds, std::size_t batch_rows = 1000, const Backend& backend = {}) {
  return detail::run_evaluate(s, std::span<const float>(ds.x), ds.features, std::span<const std::int32_t>(ds.y), ds.count,
                              1, batch_rows, backend);
}

/// @brief The mean loss per token (and the tokens predicted right) of a model that starts at token
/// ids on the windows `w` (`tile_windows`: every window a sequence of the model's length), forward
/// only, `batch_windows` windows at a time split over the data axis in whole windows.
/// @code
/// auto v = nn::evaluate(state, nn::tile_windows(split.validation, 64, 0, nn::count_windows(split.validation, 64)));
/// // v.loss: nats per token; v.correct / v.rows: next-token accuracy
/// @endcode
/// @throws sharding_error when `backend` runs other devices than the state holds here, or
/// `batch_windows` is 0; (as the cause of a `device_error`) what the layers throw (an id outside the
/// vocabulary).
template <class State, class Backend = default_runner>
step_metrics evaluate(State& s, const token_batch& w, std::size_t batch_windows = 64, const Backend& backend = {}) {
  if (batch_windows == 0) throw sharding_error("meshlib::nn: evaluate: batch_windows is 0; evaluate at least one window at a time");
  const std::size_t tokens = w.rows * w.context;
  if (w.inputs.size() != tokens || w.targets.size() != tokens)
    throw sharding_error("meshlib::nn: evaluate: the token batch holds " + std::to_string(w.inputs.size()) + " ids and " +
                         std::to_string(w.targets.size()) + " targets for " + std::to_string(w.rows) + " windows of " +
                         std::to_string(w.context) + " tokens");
  return detail::run_evaluate(s, std::span<const std::int32_t>(w.inputs), 1, std::span<const std::int32_t>(w.targets),
                              tokens, w.context, batch_windows * w.context, backend);
}

}  // namespace meshlib::nn

// The pipelined step: after train_state, whose helpers it uses.
#include "meshlib/nn/detail/pipeline_step.hpp"
