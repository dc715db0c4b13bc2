// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `evaluate(state, data)`: loss and accuracy of the model, forward only, in batches split
/// over the data axes; with a `pipeline` policy, each batch through the stages in turn
/// (nn/train/microbatches.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/text_windows.hpp"
#include "meshlib/nn/train/microbatches.hpp"
#include "meshlib/nn/train/step_inputs.hpp"
#include "meshlib/nn/train/step_metrics.hpp"
#include "meshlib/nn/train/train_state.hpp"

namespace meshlib::nn {

namespace detail {
/// `evaluate` on `count` rows at `x` (`features` floats, or one id, each) with labels `y`, in batches
/// of `batch_rows` rows; each batch is split over the data axis in whole groups of `group` rows (a
/// sequence for a language model; 1 for feature rows), so a last, smaller batch is split unevenly
/// and a device may get none (it still runs the forward, on no rows, so that every device makes the
/// same collective calls).
template <class State, input_element In, class Backend>
step_metrics run_evaluate(State& s, std::span<const In> x, std::size_t features, std::span<const std::int32_t> y,
                          std::size_t count, std::size_t group, std::size_t batch_rows, const Backend& backend) {
  return with_microbatches<In>(s, [&](const auto& schedule) {
    using Schedule = std::remove_cvref_t<decltype(schedule)>;
    check_runner(s, backend, "evaluate");
    const std::size_t dp = s.mesh.axes_size(State::data_axes);
    s.model.begin_step(s.key, false);
    std::vector<step_metrics> out(s.mesh.size());
    meshlib::spmd(
        s.mesh,
        [&](std::size_t dev) {
          const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
          schedule.begin_evaluate(dev);
          double sums[2] = {0, 0};
          for (std::size_t start = 0; start < count; start += batch_rows) {
            const std::size_t units = std::min(batch_rows, count - start) / group;
            const std::size_t lo = start + units * di / dp * group, hi = start + units * (di + 1) / dp * group;
            const auto input = [&] { return make_input_block<In>(s, dev, x.data() + lo * features, hi - lo, features); };
            auto on_output = [&](const auto& z) {
              const loss_part part = s.loss().forward(z, y.subspan(lo, hi - lo), count);
              sums[0] += part.loss;
              sums[1] += static_cast<double>(part.correct);
            };
            schedule.evaluate(dev, input, hi - lo, on_output);
          }
          sum_over<Schedule::metric_axes>(s.mesh, dev, sums);
          out[dev].loss = sums[0];
          out[dev].correct = static_cast<std::size_t>(sums[1] + 0.5);
          out[dev].rows = count;
        },
        backend);
    return out[s.local_devices().front()];
  });
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
