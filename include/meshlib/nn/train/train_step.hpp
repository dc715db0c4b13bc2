// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `train_step(state, batch)`, which a user calls in a loop as optax users do: forward and
/// backward over `accumulation` micro-batches, one bucketed data-parallel synchronisation, global-norm
/// clipping over every shard, and the optimizer update (`train_state::apply_gradients`), all on
/// every device of the mesh at once. The forwards and backwards run in the state's schedule of
/// micro-batches: one after another, or, with a `pipeline` policy, its schedule over the stages
/// (nn/train/microbatches.hpp).
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

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/loader.hpp"
#include "meshlib/nn/data/text_windows.hpp"
#include "meshlib/nn/device_put.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/nn/train/microbatches.hpp"
#include "meshlib/nn/train/step_inputs.hpp"
#include "meshlib/nn/train/step_metrics.hpp"
#include "meshlib/nn/train/train_state.hpp"

namespace meshlib::nn {

namespace detail {

/// The step of every `train_step` overload, with the loss `loss` (a `loss_function` of the model's
/// output, checked by the caller), `x` this process's `rows` rows of input (float features, or one
/// token id per row) and `y` holding `rows` rows of targets of equal width. The state's schedule of
/// micro-batches (nn/train/microbatches.hpp: one after another, or the pipeline policy's) runs the
/// forwards and backwards; the rest is the same for every parallelism.
template <class State, input_element In, class Target, class Loss, class Backend>
step_metrics run_train_step(State& s, std::span<const In> x, std::span<const Target> y, std::size_t rows,
                            std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend) {
  return with_microbatches<In>(s, [&](const auto& schedule) {
    using Schedule = std::remove_cvref_t<decltype(schedule)>;
    const std::size_t k = s.options.accumulation, m = schedule.per_group();
    check_step_inputs<In>(s, backend, x.size(), y.size(), rows, global_rows, schedule.checked_groups(k));
    const std::size_t dp = s.mesh.axes_size(State::data_axes);
    const std::size_t local_rows = global_rows / dp;
    schedule.check_split(local_rows, global_rows, dp, k);
    const std::size_t features = rows == 0 ? 0 : x.size() / rows;
    const std::size_t width = rows == 0 ? 0 : y.size() / rows;  // targets per row
    const std::size_t micro = local_rows / (k * m);             // rows per micro-batch
    s.model.begin_step(s.key.fold_in(s.step), true);
    std::vector<step_metrics> out(s.mesh.size());
    meshlib::spmd(
        s.mesh,
        [&](std::size_t dev) {
          const std::size_t first = s.mesh.group_rank(dev, State::data_axes) * local_rows;
          if (first < global_offset || first + local_rows > global_offset + rows)
            throw sharding_error("meshlib::nn: train_step: device " + std::to_string(dev) + " needs rows [" +
                                 std::to_string(first) + ", " + std::to_string(first + local_rows) +
                                 ") of the global batch, but this process holds rows [" +
                                 std::to_string(global_offset) + ", " + std::to_string(global_offset + rows) + ")");
          schedule.begin_step(dev);
          step_metrics& mt = out[dev];
          buffer_meter* meter = s.activation_meter(dev);
          meter->reset_peak();
          double sums[2] = {0, 0};  // loss, correct
          // Micro-batch j: rows [first + j micro, first + (j + 1) micro) of the global batch.
          const auto row0 = [&](std::size_t j) { return first + j * micro - global_offset; };
          const auto input = [&](std::size_t j) {
            return make_input_block<In>(s, dev, x.data() + row0(j) * features, micro, features);
          };
          const auto loss_on = [&](std::size_t j, const auto& z, auto& dz) {
            const meter_scope unmetered(nullptr);  // the loss's scratch is not the model's
            const loss_part part = as_loss_part(loss(z, y.subspan(row0(j) * width, micro * width), global_rows, dz));
            if (s.loss_scaling() || State::mixed) {
              // The scaled loss's cotangent, on the compute type's grid (float16 overflows here first).
              scale_in_place(dz.data(), dz.size(), s.loss_scale());
              round_to<typename State::compute_type>(dz.data(), dz.size());
            }
            sums[0] += part.loss;
            sums[1] += static_cast<double>(part.correct);
          };
          schedule.run(dev, k, micro, input, loss_on, mt);
          schedule.end_step(dev);
          mt.peak_activation_bytes = meter->peak;
          mt.loss_scale = s.loss_scale();
          mt.grad_norm = s.apply_gradients(dev, mt.sync_seconds);
          mt.skipped = s.loss_scaling() && !std::isfinite(mt.grad_norm);
          sum_over<Schedule::metric_axes>(s.mesh, dev, sums);
          mt.loss = sums[0];
          mt.correct = static_cast<std::size_t>(sums[1] + 0.5);
          mt.rows = global_rows;
        },
        backend);
    const step_metrics& r = out[s.local_devices().front()];
    for (std::size_t dev : s.local_devices())
      if (out[dev].skipped != r.skipped)  // cannot happen: the verdict comes from an all-reduced norm
        throw sharding_error("meshlib::nn: train_step: devices disagree on skipping the step (device " +
                             std::to_string(dev) + ")");
    s.finish_step(r.skipped);
    return r;
  });
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
}  // namespace meshlib::nn
