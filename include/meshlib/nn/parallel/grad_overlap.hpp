// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::grad_overlap`: the layer hooks (`sequential`'s `layer_hooks`, the mechanism FSDP
/// uses) that start the data-parallel gradient buckets during backward
/// (`data_parallel{.overlap = true}`, PyTorch DDP's overlap). After each layer's backward, every
/// parameter of that layer and of the layers after it has its final gradient (backward runs last
/// layer first), so every bucket (nn/parallel/grad_sync.hpp) made only of such parameters is started with
/// `psum_start`; the optimizer step waits for all of them.
///
/// Why a decorator: FSDP's hooks, when on, are the inner ones and run first (their reduce-scatter
/// writes the shard gradients this then starts), so one hook pointer serves both.
/// Only the last micro-batch's backward starts buckets (`arm`): with accumulation, the gradients
/// are complete only then.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/parallel/grad_sync.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/sequential.hpp"

namespace meshlib::nn::detail {

/// The overlap hooks of a `train_state` (see the file comment): buckets of `grad_sync<T, Wire>`
/// all-reduced over the axes `DataAxes` of `Mesh`, or `ReplicaAxes` with FSDP (whose reduce-scatter
/// already summed over the fsdp axis).
template <class T, class Wire, mesh_type Mesh, axis_mask DataAxes, axis_mask ReplicaAxes>
class grad_overlap final : public layer_hooks {
 public:
  /// `per_layer`: parameters per layer, in the order the model collects them; `round`: rounds a
  /// gradient to the compute type (mixed precision; null otherwise); `inner`: FSDP's hooks or null
  /// (then the sums run over `ReplicaAxes`).
  grad_overlap(const Mesh& mesh, const std::vector<std::size_t>& per_layer, void (*round)(float*, std::size_t) noexcept,
               layer_hooks* inner)
      : mesh_(mesh),
        round_(round),
        inner_(inner),
        sync_(mesh.size(), nullptr),
        params_(mesh.size(), nullptr),
        armed_(mesh.size(), 0),
        next_(mesh.size(), 0),
        seconds_(mesh.size(), 0.0) {
    begin_.push_back(0);
    for (std::size_t c : per_layer) begin_.push_back(begin_.back() + c);
  }

  /// At the start of `dev`'s step, before its forward: makes the communicator the buckets will use.
  /// Its first use in a call splits it from the world, a rendezvous of every device; here the
  /// devices have just been started together, where inside the backward the rendezvous would
  /// stall each device's backward until the slowest reached its first started bucket (the split
  /// was most of the hooks' time: docs/benchmarks.md, "Overlapped gradient synchronisation").
  void prepare(std::size_t dev) {
    (void)dev;
    on_axes([&]<axis_mask Axes>() {
      if constexpr (Axes != 0)
        if (mesh_.axes_size(Axes) > 1) prepare_group_over<Mesh, Axes>();
    });
  }

  /// Before the last micro-batch's backward on `dev`: plans the buckets; the hooks then start them.
  void arm(grad_sync<T, Wire>& sync, const std::vector<param_ref<T>>& params, std::size_t dev) {
    if (begin_.back() != params.size()) return;  // layers that do not account for every parameter: after backward
    const auto t0 = std::chrono::steady_clock::now();
    sync_[dev] = &sync;
    params_[dev] = &params;
    on_axes([&]<axis_mask Axes>() { sync.template begin_all_reduce<Axes>(params, mesh_, dev); });
    next_[dev] = params.size();
    armed_[dev] = 1;
    seconds_[dev] += since(t0);
  }
  /// Whether `dev`'s buckets are being started by the hooks (between `arm` and `finish`).
  [[nodiscard]] bool armed(std::size_t dev) const { return armed_.at(dev) != 0; }
  /// The parameters `[0, unstarted(dev))` whose gradients no hook has finalised yet (all of them
  /// when not armed): `train_step` zeroes and rounds those itself.
  [[nodiscard]] std::size_t unstarted(std::size_t dev, std::size_t all) const { return armed(dev) ? next_[dev] : all; }
  /// Starts the buckets not started yet, waits for all, returns where each summed gradient lies
  /// (`grad_sync::all_reduce`'s result).
  const std::vector<T*>& finish(std::size_t dev) {
    const auto t0 = std::chrono::steady_clock::now();
    armed_[dev] = 0;
    const std::vector<T*>* g = nullptr;
    on_axes([&]<axis_mask Axes>() { g = &sync_[dev]->template finish_all_reduce<Axes>(*params_[dev], mesh_, dev); });
    seconds_[dev] += since(t0);
    return *g;
  }
  /// The time `dev`'s thread spent in the overlapped synchronisation since the last call (packing
  /// and starting buckets during backward, then waiting): its exposed synchronisation time.
  double take_seconds(std::size_t dev) { return std::exchange(seconds_.at(dev), 0.0); }

  void before_forward(std::size_t layer, std::size_t dev) override {
    // A forward is never part of the armed backward: an earlier micro-batch's backward (or that of
    // a step that failed before its update) must not start buckets.
    if (layer == 0) armed_[dev] = 0;
    if (inner_ != nullptr) inner_->before_forward(layer, dev);
  }
  void before_backward(std::size_t layer, std::size_t dev) override {
    if (inner_ != nullptr) inner_->before_backward(layer, dev);
  }
  void after_backward(std::size_t layer, std::size_t dev) override {
    if (inner_ != nullptr) inner_->after_backward(layer, dev);
    if (!armed_[dev]) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<param_ref<T>>& params = *params_[dev];
    const std::size_t first = begin_.at(layer), last = begin_.at(layer + 1);
    // What train_step does after the backward for every gradient, here for this layer's, before
    // its bucket can start: a gradient no backward wrote is zero; mixed precision rounds it.
    for (std::size_t i = first; i < last; ++i) {
      const param_ref<T>& p = params[i];
      if (p.overwrite && p.overwrite[dev]) {
        fill_values<default_memory_space>(p.grad[dev], p.count[dev], T{});
        p.overwrite[dev] = 0;
      }
      if (round_ != nullptr) round_(p.grad[dev], p.count[dev]);
    }
    next_[dev] = std::min(next_[dev], first);
    // The buckets' staging buffers are the synchronisation's, not activations: not on the step's
    // activation meter (nn/remat.hpp), as they are not when the sync runs after the backward.
    const meter_scope unmetered(nullptr);
    on_axes([&]<axis_mask Axes>() { sync_[dev]->template start_ready<Axes>(params, mesh_, dev, first); });
    seconds_[dev] += since(t0);
  }

 private:
  template <class F>
  void on_axes(F&& f) {
    if (inner_ != nullptr) f.template operator()<ReplicaAxes>();
    else f.template operator()<DataAxes>();
  }
  static double since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  Mesh mesh_;
  void (*round_)(float*, std::size_t) noexcept;
  layer_hooks* inner_;
  std::vector<std::size_t> begin_;  ///< layer l's parameters: [begin_[l], begin_[l + 1])
  // Per device, each written only by its own device's thread.
  std::vector<grad_sync<T, Wire>*> sync_;
  std::vector<const std::vector<param_ref<T>>*> params_;
  std::vector<std::uint8_t> armed_;
  std::vector<std::size_t> next_;
  std::vector<double> seconds_;
};

}  // namespace meshlib::nn::detail
