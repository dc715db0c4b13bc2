// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `train_state` (model parameters, optimizer state, step, random key: flax's `TrainState`)
/// and `train_options` (accumulation micro-batches, loss scaling). The parallelism is the policies
/// the state is made with (nn/parallel/: `data_parallel` with ZeRO-1 and overlap, `fully_shard`,
/// `pipeline`); the state keeps them and builds each one's engine. The steps themselves are in
/// nn/train/train_step.hpp and nn/train/evaluate.hpp.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)));
/// @endcode

#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/exec/thread_runner.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/loader.hpp"
#include "meshlib/nn/data/text_windows.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/nn/device_put.hpp"
#include "meshlib/nn/loss.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/nn/mean_squared_error.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/parallel/data_parallel.hpp"
#include "meshlib/nn/parallel/fsdp.hpp"
#include "meshlib/nn/parallel/grad_overlap.hpp"
#include "meshlib/nn/parallel/grad_sync.hpp"
#include "meshlib/nn/parallel/pipeline.hpp"
#include "meshlib/nn/parallel/policy.hpp"
#include "meshlib/nn/parallel/policy_set.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/precision.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/nn/train/loss_scaler.hpp"
#include "meshlib/nn/train/optimizer_state.hpp"
#include "meshlib/nn/train/optimizer_step.hpp"
#include "meshlib/nn/train/param_blocks.hpp"
#include "meshlib/nn/train/step_metrics.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief How `train_step` runs, apart from the parallelism (which the policies given to the
/// `train_state` say: `data_parallel`, `fully_shard`, `pipeline`).
struct train_options {
  std::size_t accumulation = 1;            ///< micro-batches per step; one synchronisation per step
  /// Dynamic loss scaling: the initial scale (> 0 turns it on; 0: on with 32768 for float16
  /// compute, off otherwise). The loss is multiplied by the scale before backward and the summed
  /// gradients divided by it; a step whose gradients hold an inf or NaN on any device is skipped on
  /// every device and halves the scale; `scale_growth_interval` good steps in a row double it.
  float loss_scale = 0.0f;
  std::size_t scale_growth_interval = 2000;  ///< good steps before the scale doubles
};

/// @brief Parameters (inside `model`), optimizer state, step and key (see the file comment).
/// Made with parallel policies (`data_parallel`, `fully_shard`, `pipeline`), the axes are theirs:
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"dp">{.zero = 1},
///                                meshlib::nn::pipeline<"pipe">{.microbatches = 8});
/// @endcode
/// @tparam Data the data-parallel axis; @tparam Fsdp the second batch axis: the fully-sharded
/// axis, or `data_parallel`'s second (`data_parallel<Data, Fsdp>`); a policy must name it when
/// it has more than one device; @tparam Pipe the pipeline axis (each used when the mesh has it); @tparam Wire the gradient reduction's element type;
/// @tparam Compute the type parameters, activations and gradients are rounded to (float, bfloat16,
/// float16): with a 16-bit type the optimizer keeps and updates float master weights and then
/// rounds them into the parameters (see nn/precision.hpp and docs/training.md).
template <mesh_type Mesh, class Model, fixed_string Data = "data", comm_element Wire = float,
          compute_precision Compute = float, fixed_string Fsdp = "fsdp", fixed_string Pipe = "pipeline">
class train_state {
  // The checker fires its one static_assert (naming both types) when they clash.
  static_assert(meshlib::diagnostic::diagnosed(detail::check_reduction_type<Wire, Compute>()));

  /// The policies a state runs and their checks (nn/parallel/policy_set.hpp).
  using policy_set = detail::policy_set<Data, Fsdp, Pipe>;

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
  /// The mesh's second batch axis `Fsdp` (0 when it has none): FSDP shards parameters over it
  /// (`fully_shard<Fsdp>`), or `data_parallel<Data, Fsdp>` names it; either way it splits the batch
  /// as a data axis does.
  static constexpr axis_mask fsdp_axes = [] {
    if constexpr (Mesh::template has_axis<Fsdp>) return Mesh::template mask_of<Fsdp>();
    else return axis_mask{0};
  }();
  /// The mesh axes the batch is split over and gradients are averaged over: `Data` and `Fsdp` (a
  /// mesh with an fsdp axis need not have `Data`).
  static constexpr axis_mask data_axes = [] {
    if constexpr (fsdp_axes != 0 && !Mesh::template has_axis<Data>) return fsdp_axes;
    else return Mesh::template mask_of<Data>() | fsdp_axes;
  }();
  /// The data axes other than the fsdp axis: under FSDP, the shards' gradients are all-reduced over these.
  static constexpr axis_mask replica_axes = data_axes & ~fsdp_axes;
  /// The name of the pipeline axis (`Pipe`).
  static constexpr auto pipeline_axis = Pipe;
  /// The mesh's pipeline axis `Pipe` (0 when it has none, or when it is the data or fsdp axis, as
  /// with `data_parallel<"pipeline">`): stages of the model under a `pipeline` policy
  /// (nn/parallel/pipeline.hpp).
  static constexpr axis_mask pipeline_axes = [] {
    if constexpr (Mesh::template has_axis<Pipe>)
      return (Mesh::template mask_of<Pipe>() & data_axes) != 0 ? axis_mask{0} : Mesh::template mask_of<Pipe>();
    else return axis_mask{0};
  }();
  /// The type of a device's block of the input batch: rows sharded over the data axes.
  using input_type = local_tensor<T, 2, Mesh, data_axes, 0, dim_masks<data_axes, axis_mask{0}>, default_memory_space>;
  /// The type of a device's block of token ids (a language model's input: one `std::int32_t` per
  /// row, the rows `batch * sequence` tokens, sequence-major), rows sharded over the data axes.
  using ids_type = local_tensor<std::int32_t, 1, Mesh, data_axes, 0, dim_masks<data_axes>, default_memory_space>;
  /// The optimizer state's layout (nn/train/optimizer_state.hpp).
  using optimizer_state_type = nn::optimizer_state<Mesh, data_axes>;
  /// A device's ZeRO-1 optimizer state (see `optimizer_state::zero_state_type`).
  using zero_state_type = typename optimizer_state_type::zero_state_type;
  /// The axes parameters may be sharded over by their layers (tensor parallelism): every axis but
  /// the data, fsdp and pipeline axes.
  static constexpr axis_mask model_axes = Mesh::all_axes & ~data_axes & ~fsdp_axes & ~pipeline_axes;
  /// What an optimizer that reads whole parameters learns of a device's piece of one
  /// (nn/train/param_blocks.hpp): a block over the model axes and the fsdp axis, a run of it cut
  /// over the data axes (ZeRO-1).
  using blocks_type = detail::mesh_param_blocks<Mesh, model_axes | fsdp_axes, data_axes>;

  /// The mesh the model runs on.
  Mesh mesh;
  /// The network; its parameters live inside it.
  Model model;
  /// The update rule and hyperparameters.
  optimizer opt;
  /// Accumulation and loss scaling (the parallelism is the policies').
  train_options options;
  /// Optimizer steps taken so far.
  std::size_t step = 0;
  /// The key each step's randomness (dropout) is folded from.
  rng_key key;
  /// Views of every parameter of `model`, in layer order.
  std::vector<param_ref<T>> params;

  /// @brief Collects the parameters of `net` and sizes the optimizer state of each local device;
  /// plain data parallelism over the data axes (`data_parallel<Data>{}`), nothing else.
  /// `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `opts.accumulation` is 0, for an optimizer that reads whole
  /// parameters (`adafactor`) with a parameter its layer shards over a data or pipeline axis, and
  /// for a mesh whose pipeline axis `Pipe` or second batch axis `Fsdp` has more than one device (an
  /// axis is pipelined, fully sharded or split by the batch by a policy, not by its name).
  train_state(const Mesh& m, Model net, optimizer o, train_options opts = {}, rng_key k = {},
              std::span<const std::size_t> local_devices = {})
      : train_state(m, std::move(net), o, opts, k, local_devices, policy_set{}) {}

  /// @brief As the constructor above, with the parallelism given as policies (`data_parallel`,
  /// `fully_shard`, `pipeline`) over the state's axes; the state keeps them (`data_parallel_policy`,
  /// `fully_shard_policy`, `pipeline_policy`) and builds each one's engine. A policy given twice,
  /// two policies over one axis, an axis the mesh lacks or that is not the state's, and
  /// `fully_shard` or `pipeline` of a model that is not a `sequential` do not compile.
  /// @throws sharding_error as the constructor above (a pipeline policy over the pipeline axis
  /// lifts the refusal there), when `data_parallel::zero` is not 0 or 1, for ZeRO-1 beside
  /// `fully_shard` or with overlap, for overlap where no layer hook would start the buckets (a model
  /// that is not a `sequential`, a pipeline over more than one device).
  template <parallel_policy P, parallel_policy... Ps>
  train_state(const Mesh& m, Model net, optimizer o, train_options opts, rng_key k,
              std::span<const std::size_t> local_devices, const P& p, const Ps&... ps)
      : train_state(m, std::move(net), o, opts, k, local_devices,
                    policy_set::template collect<Mesh, Model>(p, ps...)) {}
  /// @brief As the constructor above, with a default key, on every device.
  template <parallel_policy P, parallel_policy... Ps>
  train_state(const Mesh& m, Model net, optimizer o, train_options opts, const P& p, const Ps&... ps)
      : train_state(m, std::move(net), o, opts, rng_key{}, {}, p, ps...) {}
  /// @brief As the constructor above, from the default `train_options`.
  template <parallel_policy P, parallel_policy... Ps>
  train_state(const Mesh& m, Model net, optimizer o, const P& p, const Ps&... ps)
      : train_state(m, std::move(net), o, train_options{}, p, ps...) {}

  /// The data-parallel policy the state runs (`data_parallel<Data>{}` when none was given).
  [[nodiscard]] const data_parallel<Data>& data_parallel_policy() const noexcept { return policies_.data; }
  /// The `fully_shard` policy the state runs (empty without FSDP).
  [[nodiscard]] const std::optional<fully_shard<Fsdp>>& fully_shard_policy() const noexcept { return policies_.fsdp; }
  /// The `pipeline` policy given (empty without one; with one over an axis of one device, the
  /// step runs unpipelined: `pipeline()` is null).
  [[nodiscard]] const std::optional<nn::pipeline<Pipe>>& pipeline_policy() const noexcept { return policies_.pipe; }

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
  [[nodiscard]] float loss_scale() const noexcept { return scaler_.scale(); }
  /// Whether dynamic loss scaling is on.
  [[nodiscard]] bool loss_scaling() const noexcept { return scaler_.enabled(); }
  /// Consecutive good steps since the scale last changed.
  [[nodiscard]] std::size_t good_steps() const noexcept { return scaler_.good_steps(); }

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
    if (scaler_.update(skipped, options.scale_growth_interval)) ++step;
  }

  /// This process's devices.
  [[nodiscard]] const std::vector<std::size_t>& local_devices() const noexcept { return local_; }
  /// Elements of optimizer state held by device `dev` (the ZeRO saving shows here); 0 for a
  /// device of another process.
  [[nodiscard]] std::size_t optimizer_state_size(std::size_t dev) const {
    if (std::find(local_.begin(), local_.end(), dev) == local_.end()) return 0;
    return data_parallel_.state().size(params, dev);
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
  /// vector (its parameters' blocks in order; under ZeRO-1, its slice of that vector), then each
  /// parameter's per-parameter state (`param_state`): for tests and logs. Empty for a device of
  /// another process. Checkpoints use `for_each_state_run` and `param_state`.
  [[nodiscard]] std::vector<float> optimizer_state(std::size_t dev) {
    std::vector<float> out;
    out.reserve(optimizer_state_size(dev));
    for (std::size_t s = 0; s < opt.slots() && out.capacity() > 0; ++s)
      for_each_state_run(dev, [&](std::size_t, std::size_t, std::size_t len, std::span<float* const> slot) {
        out.insert(out.end(), slot[s], slot[s] + len);
      });
    std::vector<float> stage;
    for (std::size_t i = 0; i < params.size() && out.capacity() > 0; ++i)
      if (const float* v = param_state(i, dev)) {
        const std::size_t n = data_parallel_.state().param_state_size(i);
        const float* h = meshlib::host_readable<default_memory_space>(v, n, stage);
        out.insert(out.end(), h, h + n);
      }
    return out;
  }
  /// Floats of parameter `i`'s per-parameter optimizer state (the optimizer's `param_state_size`; 0: none).
  [[nodiscard]] std::size_t param_state_size(std::size_t i) const { return data_parallel_.state().param_state_size(i); }
  /// Parameter `i`'s per-parameter optimizer state on device `dev` (the optimizer's
  /// `param_state_size` floats, in the device's memory; alike on every device holding a block of
  /// the parameter), or null: none, or the device holds no block of it.
  [[nodiscard]] float* param_state(std::size_t i, std::size_t dev) const {
    return data_parallel_.state().param_state(i, dev);
  }
  /// Device `dev`'s ZeRO-1 optimizer state (`zero` on; see `zero_state_type`).
  [[nodiscard]] const zero_state_type& zero_state(std::size_t dev) const {
    return data_parallel_.state().zero_state(dev);
  }
  /// Device `dev`'s count of the model's layer buffers (`step_metrics::peak_activation_bytes`);
  /// `train_step` and `evaluate` make it the device thread's meter while the model runs.
  [[nodiscard]] detail::buffer_meter* activation_meter(std::size_t dev) const { return &meters_->at(dev); }
  /// The gradient synchronisation (its buckets and traffic).
  [[nodiscard]] const grad_sync<T, Wire>& sync() const noexcept { return data_parallel_.buckets(); }
  /// The loss function the training steps use.
  [[nodiscard]] softmax_cross_entropy<T>& loss() noexcept { return loss_; }
  /// The pipeline's stages and buffers (null without a `pipeline` policy over an axis of more than one device).
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
    data_parallel_.state().for_each_run(mesh, params, dev, std::forward<F>(f));
  }
  /// Whether device `dev` is the one that writes parameter `p`'s optimizer state to a checkpoint
  /// (one device of each group holding the same state).
  [[nodiscard]] bool owns_state(std::size_t dev, const param_ref<T>& p) const {
    return data_parallel_.state().owns(mesh, dev, p);
  }

  /// One device's share of a step after its backward passes: synchronise, clip, update (the
  /// data-parallel policy's gradient path, `detail::data_parallel_impl`). Returns the global
  /// gradient norm; `sync_seconds` the time spent synchronising.
  double apply_gradients(std::size_t dev, double& sync_seconds) {
    return data_parallel_.apply_gradients(*this, dev, sync_seconds);
  }

  /// Overlapped gradient sync: before the last micro-batch's backward on `dev`, arms the hooks that
  /// start the buckets (no-op without overlap).
  void begin_grad_overlap(std::size_t dev) {
    data_parallel_.arm(params, dev);
  }
  /// Overlapped gradient sync: at the start of the step on `dev`, makes the buckets' communicator
  /// (nn/parallel/grad_overlap.hpp, `prepare`; no-op without overlap).
  void prepare_grad_overlap(std::size_t dev) {
    data_parallel_.prepare(dev);
  }
  /// The parameters `[0, n)` whose gradients train_step still zeroes and rounds after the backward
  /// (the hooks did the others' before starting their buckets).
  [[nodiscard]] std::size_t grad_overlap_unstarted(std::size_t dev) const {
    return data_parallel_.unstarted(dev, params.size());
  }

 private:
  // The data-parallel policy's gradient path reads the global norm, the optimizer step and the masters.
  template <class, class, class, axis_mask, axis_mask>
  friend class detail::data_parallel_impl;

  // Every public constructor ends here: the policies checked and collected into `ps`, each one's
  // engine built from it.
  train_state(const Mesh& m, Model net, optimizer o, train_options opts, rng_key k,
              std::span<const std::size_t> local_devices, policy_set ps)
      : mesh(m),
        model(std::move(net)),
        opt(o),
        options(opts),
        key(k),
        policies_(std::move(ps)),
        data_parallel_(m.size(), policies_.data),
        loss_(m.size()),
        input_(m.size()),
        ids_(m.size()),
        output_grad_(m.size()),
        optimizer_step_(m.size()) {
    model.collect(params);
    scaler_ = loss_scaler(options.loss_scale, needs_loss_scaling<Compute>);
    if constexpr (mixed)
      if constexpr (requires { model.round_activations = &detail::round_to<Compute>; })
        model.round_activations = &detail::round_to<Compute>;
    if (options.accumulation == 0) throw sharding_error("meshlib::nn: train_options: accumulation must be at least 1");
    policies_.template check_axes<Model, fsdp_axes, pipeline_axes>(mesh);
    std::vector<std::size_t> all;
    if (local_devices.empty())
      for (std::size_t d = 0; d < m.size(); ++d) all.push_back(d);
    else
      all.assign(local_devices.begin(), local_devices.end());
    local_ = all;
    if (opt.whole_parameters()) refuse_parameter_shards();
    // fully_shard (nn/parallel/fsdp.hpp): `params` become the shards, its engine the model's hooks.
    // (The policy compiles only over a mesh axis, for a sequential model: `check_policies`.)
    if constexpr (fsdp_axes != 0 && detail::sequential_model<Model>)
      if (policies_.fsdp) fsdp_ = detail::fully_shard_model<fsdp_axes>(mesh, model, params, local_, *policies_.fsdp);
    data_parallel_.compose(fsdp_);
    // pipeline (nn/parallel/pipeline.hpp): each parameter (under FSDP, each shard) restricted to its
    // stage's devices, before the optimizer state is sized from the parameters' blocks. Over an
    // axis of one device there are no stages to cut: the step runs unpipelined.
    if constexpr (pipeline_axes != 0)
      if (policies_.pipe && m.axes_size(pipeline_axes) > 1)
        pipeline_ = detail::make_pipeline_state<pipeline_axes>(*this, *policies_.pipe, policies_.fsdp.has_value());
    // The overlapped gradient sync's hooks; a pipelined step synchronises each stage's gradients
    // after its rounds (nn/parallel/pipeline_run.hpp), not from the layer hooks.
    if (pipeline_ == nullptr) {
      void (*round)(float*, std::size_t) noexcept = nullptr;
      if constexpr (mixed) round = &detail::round_to<Compute>;
      data_parallel_.install_hooks(mesh, model, round);
    }
    // Every tensor is made here, on the calling thread: device threads only read and write blocks
    // through unmanaged views (tensor/view.hpp: no reference count is touched off this thread).
    std::vector<std::size_t> per_param;
    for (const auto& p : params) per_param.push_back(opt.param_state_size(param_info{p.name, p.shape, p.decay}));
    data_parallel_.size_state(mesh, params, opt.slots(), local_, per_param);
    if constexpr (mixed)
      for (const auto& p : params) {
        masters_.push_back(p.layout->zeros_like(local_));
        for (std::size_t dev : local_)
          detail::convert_copy<default_memory_space>(masters_.back().blocks[dev], p.value[dev], p.count[dev]);
      }
    refresh_compute_copies();
  }

  // An optimizer that reads whole parameters (`adafactor`) on a parameter its layer splits over an
  // axis that is not a model axis: refused here, before any step, with the fix. Tensor-parallel
  // blocks, FSDP's shards and ZeRO-1's runs are fine: the transforms sum their statistics over a
  // parameter's pieces (nn/train/param_blocks.hpp); a layer's block over a data axis, whose devices
  // also split the batch, is not one of those.
  void refuse_parameter_shards() const {
    const auto bad = [&](const std::string& why, const std::string& fix) {
      return sharding_error("meshlib::nn: train_state: the optimizer " + opt.name() +
                            " reads whole parameters (its statistics are per parameter, summed over the pieces of "
                            "a tensor-parallel, FSDP or ZeRO-1 parameter), but " + why + "; " + fix);
    };
    for (const auto& p : params)
      if ((p.sharded_axes & ~model_axes) != 0)
        throw bad("parameter '" + p.name + "' is sharded " + p.sharding + " over a data or pipeline axis",
                  "shard it over model (tensor-parallel) axes only, or replicate it");
  }
  void unscale(T* g, std::size_t n) const noexcept { scaler_.unscale(g, n); }
  void refresh_device(std::size_t dev) {
    if constexpr (mixed)
      for (std::size_t i = 0; i < params.size(); ++i)
        detail::round_copy<Compute>(params[i].value[dev], master(i, dev), params[i].count[dev]);
  }
  /// Runs the optimizer over device `dev`'s runs of updates and applies them
  /// (`detail::optimizer_step::run`, nn/train/optimizer_step.hpp).
  template <class ForRuns>
  void step_optimizer(std::size_t dev, double norm, axis_mask except, ForRuns&& for_runs) {
    optimizer_step_.run(
        mesh, opt, params, step, [&](std::size_t i) { return master(i, dev); },
        [&](std::size_t i) { return data_parallel_.state().param_state(i, dev); }, dev, norm, except,
        std::forward<ForRuns>(for_runs));
  }
  /// The policies given (the data-parallel one defaulted).
  policy_set policies_;
  /// The data-parallel policy at work: the gradient buckets and path, the optimizer state's layout
  /// (nn/train/optimizer_state.hpp: replicated or ZeRO-1) and the overlap's hooks.
  detail::data_parallel_impl<T, Wire, Mesh, data_axes, fsdp_axes> data_parallel_;
  softmax_cross_entropy<T> loss_;
  std::vector<std::size_t> local_;
  detail::device_buffers<T> input_;
  detail::device_buffers<std::int32_t> ids_;  // token ids staged for a device that cannot read the caller's
  detail::device_buffers<T> output_grad_;
  /// The global gradient norm and the optimizer's update, with their per-device buffers.
  detail::optimizer_step<Mesh, model_axes | fsdp_axes, data_axes> optimizer_step_;
  /// Per parameter (16-bit Compute only): its float master weights, a tensor with the
  /// parameter's shape and sharding.
  std::vector<detail::held_tensor<float>> masters_;
  /// FSDP's shards, buffers and layer hooks (null without FSDP); shared by copies of the state.
  std::shared_ptr<detail::fsdp_engine<Mesh, fsdp_axes>> fsdp_;
  /// Per device: the bytes of the model's layer buffers (shared by copies of the state, as the
  /// model's buffers are; the buffers point at it).
  std::shared_ptr<std::vector<detail::buffer_meter>> meters_ =
      std::make_shared<std::vector<detail::buffer_meter>>(mesh.size());
  /// The pipeline's stages and buffers (null without a `pipeline` policy over an axis of more than one device).
  std::shared_ptr<detail::pipeline_engine> pipeline_;
  /// Dynamic loss scaling (nn/train/loss_scaler.hpp).
  loss_scaler scaler_;
};

/// Made with parallel policies, a train state's axes are the policies' (the defaults for the
/// parallelisms not given; the second batch axis `fully_shard`'s, else `data_parallel`'s second),
/// its parameters and compute float.
template <mesh_type Mesh, class Model, parallel_policy P, parallel_policy... Ps>
train_state(const Mesh&, Model, optimizer, const P&, const Ps&...)
    -> train_state<Mesh, Model, detail::policy_axis<parallelism::data, "data", P, Ps...>::value, float, float,
                   detail::policy_axis<parallelism::fully_sharded, detail::second_data_axis<"fsdp", P, Ps...>::value,
                                       P, Ps...>::value,
                   detail::policy_axis<parallelism::pipelined, "pipeline", P, Ps...>::value>;
/// As above, with `train_options`, a key and this process's devices before the policies.
template <mesh_type Mesh, class Model, parallel_policy P, parallel_policy... Ps>
train_state(const Mesh&, Model, optimizer, train_options, rng_key, std::span<const std::size_t>, const P&, const Ps&...)
    -> train_state<Mesh, Model, detail::policy_axis<parallelism::data, "data", P, Ps...>::value, float, float,
                   detail::policy_axis<parallelism::fully_sharded, detail::second_data_axis<"fsdp", P, Ps...>::value,
                                       P, Ps...>::value,
                   detail::policy_axis<parallelism::pipelined, "pipeline", P, Ps...>::value>;
/// As above, with `train_options` before the policies.
template <mesh_type Mesh, class Model, parallel_policy P, parallel_policy... Ps>
train_state(const Mesh&, Model, optimizer, train_options, const P&, const Ps&...)
    -> train_state<Mesh, Model, detail::policy_axis<parallelism::data, "data", P, Ps...>::value, float, float,
                   detail::policy_axis<parallelism::fully_sharded, detail::second_data_axis<"fsdp", P, Ps...>::value,
                                       P, Ps...>::value,
                   detail::policy_axis<parallelism::pipelined, "pipeline", P, Ps...>::value>;

}  // namespace meshlib::nn
