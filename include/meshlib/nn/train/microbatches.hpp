// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How the one `train_step` and the one `evaluate` run a step's micro-batches on a device:
/// one after another (`accumulated_microbatches`: `train_options::accumulation` forwards and
/// backwards, the gradients summed), or, on a mesh whose pipeline axis has more than one device,
/// the pipeline policy's schedule over its stages (`pipelined_microbatches`,
/// nn/parallel/pipeline_run.hpp). `with_microbatches` picks one; the step and the evaluation around
/// them (inputs, loss, synchronisation, update, metrics) are the same code for both.

#include <cstddef>
#include <utility>

#include "meshlib/nn/parallel/pipeline_run.hpp"
#include "meshlib/nn/train/step_inputs.hpp"
#include "meshlib/nn/train/step_metrics.hpp"

namespace meshlib::nn::detail {

/// A step's micro-batches one after another on every device (no pipeline): `k` forwards and
/// backwards of the whole model, each on its own rows, the gradients summed in the parameters'
/// gradient blocks; with `data_parallel{.overlap = true}`, the last backward starts the gradient
/// buckets (nn/parallel/grad_overlap.hpp). The members are `pipelined_microbatches`'s.
template <class State, class In>
struct accumulated_microbatches {
  /// The axes the step's loss sums run over.
  static constexpr axis_mask metric_axes = State::data_axes;

  State& s;

  /// Micro-batches per accumulation step.
  [[nodiscard]] static std::size_t per_group() { return 1; }
  /// The accumulation steps the common batch check divides by.
  [[nodiscard]] static std::size_t checked_groups(std::size_t k) { return k; }
  /// Nothing beyond the common batch check.
  static void check_split(std::size_t, std::size_t, std::size_t, std::size_t) {}

  /// Before device `dev`'s step: last step's gradients stay where a layer's first backward can
  /// overwrite them (no zeroing pass over the model), the others are zeroed; the overlap's communicator.
  void begin_step(std::size_t dev) const {
    for (const auto& p : s.params)
      if (p.overwrite) p.overwrite[dev] = 1;
      else fill_values<default_memory_space>(p.grad[dev], p.count[dev], 0.0f);
    s.prepare_grad_overlap(dev);
  }

  /// Device `dev`'s `k` forwards and backwards of `micro` rows: `input(j)` makes micro-batch `j`'s
  /// input block, `loss_on(j, z, dz)` its loss and the loss's gradient into `dz`.
  template <class Input, class LossOn>
  void run(std::size_t dev, std::size_t k, std::size_t, const Input& input, LossOn& loss_on,
           step_metrics& metrics) const {
    buffer_meter* meter = s.activation_meter(dev);
    for (std::size_t j = 0; j < k; ++j) {
      const auto xb = input(j);
      auto logits = [&] {
        const meter_scope metered(meter);  // counts the model's buffers only
        return s.model.forward(xb);
      }();
      metrics.activation_bytes = meter->live;
      using Z = decltype(logits);
      Z dlogits(typename Z::view_type(s.output_grad_block(dev, logits.size()), logits.extent(0), logits.extent(1)),
                s.mesh, dev);
      loss_on(j, std::as_const(logits), dlogits);
      if (j + 1 == k) s.begin_grad_overlap(dev);  // the last backward completes the gradients
      const meter_scope metered(meter);
      s.model.template backward<std::remove_cvref_t<decltype(xb)>>(dlogits);
    }
  }

  /// After device `dev`'s backwards: a gradient no backward wrote (its layer did not run) zeroed,
  /// the sums on the compute type's grid (overlapped: the hooks did both for the gradients whose
  /// buckets they started).
  void end_step(std::size_t dev) const {
    const std::span<const param_ref<float>> unstarted(s.params.data(), s.grad_overlap_unstarted(dev));
    for (const auto& p : unstarted)
      if (p.overwrite && p.overwrite[dev]) {
        fill_values<default_memory_space>(p.grad[dev], p.count[dev], 0.0f);
        p.overwrite[dev] = 0;
      }
    if constexpr (State::mixed)
      for (const auto& p : unstarted) round_to<typename State::compute_type>(p.grad[dev], p.count[dev]);
  }

  /// Before device `dev`'s evaluation: nothing.
  static void begin_evaluate(std::size_t) {}
  /// Device `dev`'s forward of one evaluation batch (`input()` its block); `on_output(z)` with the
  /// model's output.
  template <class Input, class OnOutput>
  void evaluate(std::size_t dev, const Input& input, std::size_t, OnOutput& on_output) const {
    auto logits = [&] {
      const meter_scope metered(s.activation_meter(dev));  // new buffers are the model's too
      return s.model.forward(input());
    }();
    on_output(logits);
  }
};

/// `f(schedule)` with the state's schedule of micro-batches for inputs of elements `In`: the
/// pipeline policy's on a mesh whose pipeline axis has more than one device, else one after another.
template <class In, class State, class F>
decltype(auto) with_microbatches(State& s, F&& f) {
  if constexpr (State::pipeline_axes != 0)
    if (s.pipeline() != nullptr) return f(pipelined_microbatches<State, In>{s, *s.pipeline()});
  return f(accumulated_microbatches<State, In>{s});
}

}  // namespace meshlib::nn::detail
