// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The pipelined `train_step` and `evaluate` (nn/pipeline.hpp has the design): each device
/// runs its stage's layers of a `sequential` over the rounds of a `pipeline_plan`, exchanging
/// activations and gradients with its neighbours by `ppermute` over the `pipeline` axis.
///
/// Included at the end of nn/train_state.hpp: it uses the train state's helpers (input blocks,
/// the loss protocol, `sum_over`), and `run_train_step` / `run_evaluate` forward to it.

#include <array>
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/permutes.hpp"
#include "meshlib/nn/pipeline.hpp"
#include "meshlib/nn/train_state.hpp"

namespace meshlib::nn::detail {

/// The type of a device's model input on a pipeline mesh: as `input_block_t`, and varying over the
/// pipeline axis (every activation differs from stage to stage, which `ppermute` requires).
template <class State, class In>
using pipeline_input_t = with_vary_t<input_block_t<State, In>, State::data_axes | State::pipeline_axes>;

/// Sends `n` elements at `send` to the stages `pairs` names over the pipeline axis (the public
/// typed `ppermute`, every stage calling it); returns where this device's received elements lie
/// (the collective's workspace: valid until the next collective on this device).
template <class Mesh>
const float* pipeline_exchange(const Mesh& mesh, std::size_t dev, float* send, std::size_t n,
                               const std::vector<std::pair<std::size_t, std::size_t>>& pairs) {
  using message_t = local_tensor<float, 1, Mesh, Mesh::all_axes>;
  return meshlib::ppermute<"pipeline">(message_t(typename message_t::view_type(send, n), mesh, dev), pairs).data();
}

/// Makes this device's communicator of every group of mesh axes, in one order on every device.
/// Why: a group's communicator is split from the whole mesh's on its first use, a collective of
/// every device; the stages run different layers at different times, so their first uses (a
/// layer's psum over 'model', the pipeline's ppermute) would otherwise come in different orders.
template <class Mesh, std::size_t... M>
void make_group_communicators(const Mesh& mesh, std::size_t dev, std::index_sequence<M...>) {
  double v[1] = {0};
  (sum_over<static_cast<axis_mask>(M + 1)>(mesh, dev, v), ...);  // every mask but the whole mesh's
}
template <class Mesh>
void make_group_communicators(const Mesh& mesh, std::size_t dev) {
  make_group_communicators(mesh, dev, std::make_index_sequence<static_cast<std::size_t>(Mesh::all_axes) - 1>{});
}

/// Sends each mirrored parameter's value from its owner stage to its mirror (restored or updated
/// since the mirror last got it); with `for_backward`, the mirror's gradient block starts at zero.
template <class State>
void refresh_mirrors(State& s, pipeline_engine& e, std::size_t dev, std::size_t stage, bool for_backward) {
  for (const auto& t : e.mirrors) {
    const auto& q = s.params[t.param];
    const std::size_t n = e.block_elements(t.param, dev);
    const float* r = pipeline_exchange(s.mesh, dev, q.value[dev], n, {{t.owner, t.mirror}});
    if (stage != t.mirror) continue;
    convert_copy<default_memory_space>(q.value[dev], r, n);
    if (!for_backward) continue;
    fill_values<default_memory_space>(q.grad[dev], n, 0.0f);
    if (q.overwrite) q.overwrite[dev] = 0;
  }
}

/// One device's stage of a pipelined model: forward and backward over its layers `[lo, hi)` with
/// run-time bounds (each layer index a compile-time branch, since activation types differ per layer).
template <class State, class X0>
struct stage_runner {
  using model_t = typename State::model_type;
  static constexpr std::size_t layers = model_t::size;
  template <std::size_t I>
  using input_t = typename model_t::template input_of<X0, I>::type;

  State& s;
  pipeline_engine& e;
  std::size_t dev, stage, lo, hi;

  /// The activation entering layer `I` for `rows` rows, over `data` (its extents from the probe).
  template <std::size_t I>
  input_t<I> typed(float* data, std::size_t rows) const {
    using A = input_t<I>;
    if constexpr (!std::is_same_v<typename A::value_type, float>) {
      throw sharding_error("meshlib::nn: pipeline: layer " + std::to_string(I) +
                           " takes a non-float input, so no stage may start at it; move the split point");
    } else {
      std::array<std::size_t, A::rank> x{};
      const std::size_t* ext = e.extents[dev].data() + I * 8;
      for (std::size_t d = 0; d < A::rank; ++d) x[d] = ext[d];
      x[0] = e.probed_rows[dev] == 0 ? rows : ext[0] * rows / e.probed_rows[dev];
      return std::apply([&](auto... n) { return A(typename A::view_type(data, n...), s.mesh, dev); }, x);
    }
  }

  /// Runs every layer forward on `y` (the input of layer `I`), recording each boundary's extents.
  template <std::size_t I, class Y>
  void probe(const Y& y, std::size_t rows) {
    static_assert(Y::rank <= 8, "meshlib::nn: pipeline: an activation of rank above 8");
    for (std::size_t d = 0; d < Y::rank; ++d) e.extents[dev][I * 8 + d] = y.extent(d);
    if constexpr (I < layers) {
      if (s.model.hooks != nullptr) s.model.hooks->before_forward(I, dev);
      probe<I + 1>(std::get<I>(s.model.layers).forward(y), rows);
    } else {
      e.probed_rows[dev] = rows;
    }
  }

  /// Layers `I .. hi - 1` forward on `y`; then `sink(integral_constant<I>, output)`.
  template <std::size_t I, class Y, class Sink>
  void forward_from(const Y& y, Sink& sink) {
    if constexpr (I == layers) {
      sink(std::integral_constant<std::size_t, I>{}, y);
    } else {
      if (I == hi) return sink(std::integral_constant<std::size_t, I>{}, y);
      if (s.model.hooks != nullptr) s.model.hooks->before_forward(I, dev);  // FSDP: gather the layer
      forward_from<I + 1>(std::get<I>(s.model.layers).forward(y), sink);
    }
  }
  /// The stage's forward on `x0` (stage 0) or the received activation at `in`.
  template <std::size_t I = 0, class Sink>
  void forward(const X0& x0, float* in, std::size_t rows, Sink& sink) {
    if constexpr (I < layers) {
      if (I != lo) return forward<I + 1>(x0, in, rows, sink);
      if constexpr (I == 0) forward_from<0>(x0, sink);
      else forward_from<I>(typed<I>(in, rows), sink);
    }
  }

  /// Layers `I` down to `lo` backward from `dy` (the cotangent of layer `I`'s output); then
  /// `sink(dx)` with the cotangent of the stage input (not on stage 0, which needs none).
  template <std::size_t I, class DY, class Sink>
  void backward_from(const DY& dy, Sink& sink) {
    const bool first = I == lo;
    if (s.model.hooks != nullptr) s.model.hooks->before_backward(I, dev);
    auto dx = std::get<I>(s.model.layers).backward(dy, !first || stage > 0);
    if (s.model.hooks != nullptr) s.model.hooks->after_backward(I, dev);  // FSDP: reduce-scatter its gradients
    if (first) {
      if (stage > 0) sink(dx);
      return;
    }
    if constexpr (I > 0) backward_from<I - 1>(dx, sink);
  }
  /// The stage's backward from the cotangent of its output at `dy`.
  template <std::size_t I = 1, class Sink>
  void backward(float* dy, std::size_t rows, Sink& sink) {
    if constexpr (I <= layers) {
      if (I != hi) return backward<I + 1>(dy, rows, sink);
      backward_from<I - 1>(typed<I>(dy, rows), sink);
    }
  }

  /// Elements per row of the activation entering layer `I` (from the probe).
  [[nodiscard]] std::size_t per_row(std::size_t i) const {
    if (e.probed_rows[dev] == 0) return 0;
    std::size_t n = 1;
    for (std::size_t d = 0; d < 8 && e.extents[dev][i * 8 + d] != 0; ++d) n *= e.extents[dev][i * 8 + d];
    return n / e.probed_rows[dev];
  }
  /// The message size per row: the widest activation crossing a stage boundary.
  [[nodiscard]] std::size_t message_per_row() const {
    std::size_t w = 0;
    for (std::size_t t = 1; t < e.stages; ++t) w = std::max(w, per_row(e.bounds[t].first));
    return w;
  }
};

/// The pairs of one round's exchange: forward (stage -> stage + 1, for each stage that ran a
/// forward) or backward (stage -> stage - 1, for each that ran a backward and is not first).
inline std::vector<std::pair<std::size_t, std::size_t>> round_pairs(const std::vector<pipeline_slot>& r, bool forward) {
  std::vector<std::pair<std::size_t, std::size_t>> pairs;
  for (std::size_t t = 0; t < r.size(); ++t) {
    if (forward && t + 1 < r.size() && r[t].forward != pipeline_slot::none) pairs.push_back({t, t + 1});
    if (!forward && t > 0 && r[t].backward != pipeline_slot::none) pairs.push_back({t, t - 1});
  }
  return pairs;
}

/// `run_train_step` on a mesh whose pipeline axis has more than one device (see the file comment).
template <class State, class In, class Target, class Loss, class Backend>
step_metrics run_pipeline_step(State& s, std::span<const In> x, std::span<const Target> y, std::size_t rows,
                               std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend) {
  pipeline_engine& e = *s.pipeline();
  const std::size_t p = e.stages;
  const std::size_t m = s.options.pipeline.microbatches == 0 ? p : s.options.pipeline.microbatches;
  check_step_inputs<In>(s, backend, x.size(), y.size(), rows, global_rows, 1);
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  const std::size_t local_rows = global_rows / dp;
  if (local_rows % m != 0)
    throw sharding_error("meshlib::nn: train_step: the pipeline's " + std::to_string(m) +
                         " micro-batches do not divide the " + std::to_string(local_rows) +
                         " rows each device of the data axes gets (a global batch of " + std::to_string(global_rows) +
                         " rows over " + std::to_string(dp) + " devices); choose pipeline.microbatches dividing " +
                         std::to_string(local_rows) + ", or a batch of a multiple of " + std::to_string(dp * m) + " rows");
  const std::size_t features = rows == 0 ? 0 : x.size() / rows;
  const std::size_t width = rows == 0 ? 0 : y.size() / rows;
  const std::size_t micro = local_rows / m;
  const pipeline_plan plan(s.options.pipeline.schedule, p, m);
  using X0 = pipeline_input_t<State, In>;
  s.model.begin_step(s.key.fold_in(s.step), true);
  std::vector<step_metrics> out(s.mesh.size());
  meshlib::spmd(
      s.mesh,
      [&](std::size_t dev) {
        using clock = std::chrono::steady_clock;
        const std::size_t stage = s.mesh.group_rank(dev, State::pipeline_axes);
        stage_runner<State, X0> run{s, e, dev, stage, e.bounds[stage].first, e.bounds[stage].second};
        const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
        const std::size_t first = di * local_rows;
        if (first < global_offset || first + local_rows > global_offset + rows)
          throw sharding_error("meshlib::nn: train_step: device " + std::to_string(dev) + " needs rows [" +
                               std::to_string(first) + ", " + std::to_string(first + local_rows) +
                               ") of the global batch, but this process holds rows [" + std::to_string(global_offset) +
                               ", " + std::to_string(global_offset + rows) + ")");
        make_group_communicators(s.mesh, dev);
        // Gradients: this stage's parameters as in run_train_step; a mirror's block from zero.
        for (const auto& q : s.params)
          if (q.count[dev] == 0) continue;
          else if (q.overwrite) q.overwrite[dev] = 1;
          else fill_values<default_memory_space>(q.grad[dev], q.count[dev], 0.0f);
        refresh_mirrors(s, e, dev, stage, true);
        const auto input_rows = [&](std::size_t j) { return x.data() + (first + j * micro - global_offset) * features; };
        const auto x0_of = [&](std::size_t j) {
          return meshlib::pvary<"pipeline">(make_input_block<In>(s, dev, input_rows(j), micro, features));
        };
        if (e.probed_rows[dev] == 0) {
          e.extents[dev].assign((State::model_type::size + 1) * 8, 0);
          run.template probe<0>(x0_of(0), micro);
        }
        const std::size_t msg = micro * run.message_per_row();
        const std::size_t zn = micro * run.per_row(State::model_type::size);  // logits per micro-batch
        float* inputs = e.inputs.get(dev, m * msg);
        float* dys = e.dys.get(dev, m * msg);
        float* dlogits = e.dlogits.get(dev, stage + 1 == p ? m * zn : 0);
        float* send = e.send.get(dev, msg);
        double sums[2] = {0, 0};
        double busy = 0;
        bool with_loss = true;  // false while recomputing: the loss's gradient is kept from the forward
        std::size_t j = 0;      // the micro-batch running
        auto forward_sink = [&](auto at, const auto& out) {
          if constexpr (decltype(at)::value == State::model_type::size) {
            if (!with_loss) return;
            using Z = std::remove_cvref_t<decltype(out)>;
            Z dz(typename Z::view_type(dlogits + j * zn, out.extent(0), out.extent(1)), s.mesh, dev);
            const loss_part part =
                as_loss_part(loss(out, y.subspan((first + j * micro - global_offset) * width, micro * width), global_rows, dz));
            if (s.loss_scaling()) scale_in_place(dz.data(), dz.size(), s.loss_scale());
            sums[0] += part.loss;
            sums[1] += static_cast<double>(part.correct);
          } else {
            if (with_loss) convert_copy<default_memory_space>(send, out.data(), out.size());
          }
        };
        auto backward_sink = [&](const auto& dx) { convert_copy<default_memory_space>(send, dx.data(), dx.size()); };
        const auto& rounds = plan.rounds();
        const auto start = clock::now();
        for (std::size_t ri = 0; ri < rounds.size(); ++ri) {
          const auto& r = rounds[ri];
          if (r[stage].forward != pipeline_slot::none) {
            const auto t0 = clock::now();
            j = r[stage].forward;
            with_loss = true;
            run.forward(x0_of(j), inputs + j * msg, micro, forward_sink);
            busy += std::chrono::duration<double>(clock::now() - t0).count();
          }
          if (const auto pairs = round_pairs(r, true); !pairs.empty()) {
            const float* got = pipeline_exchange(s.mesh, dev, send, msg, pairs);
            if (stage > 0 && r[stage - 1].forward != pipeline_slot::none)
              convert_copy<default_memory_space>(inputs + r[stage - 1].forward * msg, got, msg);
          }
          if (r[stage].backward != pipeline_slot::none) {
            const auto t0 = clock::now();
            j = r[stage].backward;
            if (plan.recomputes(ri, stage)) {  // the layers hold another micro-batch's forward: run this one's again
              with_loss = false;
              run.forward(x0_of(j), inputs + j * msg, micro, forward_sink);
            }
            run.backward(stage + 1 == p ? dlogits + j * zn : dys + j * msg, micro, backward_sink);
            busy += std::chrono::duration<double>(clock::now() - t0).count();
          }
          if (const auto pairs = round_pairs(r, false); !pairs.empty()) {
            const float* got = pipeline_exchange(s.mesh, dev, send, msg, pairs);
            if (stage + 1 < p && r[stage + 1].backward != pipeline_slot::none)
              convert_copy<default_memory_space>(dys + r[stage + 1].backward * msg, got, msg);
          }
        }
        e.busy[dev] = busy;
        e.span[dev] = std::chrono::duration<double>(clock::now() - start).count();
        for (const auto& q : s.params)
          if (q.count[dev] != 0 && q.overwrite && q.overwrite[dev]) {  // no backward wrote it: zero
            fill_values<default_memory_space>(q.grad[dev], q.count[dev], 0.0f);
            q.overwrite[dev] = 0;
          }
        // A mirror's gradient goes to the owner, which adds it to its own (the tied weight's sum).
        for (const auto& t : e.mirrors) {
          const auto& q = s.params[t.param];
          const std::size_t n = e.block_elements(t.param, dev);
          const float* r = pipeline_exchange(s.mesh, dev, q.grad[dev], n, {{t.mirror, t.owner}});
          if (stage == t.owner) add_values<default_memory_space>(q.grad[dev], r, n);
        }
        step_metrics& mt = out[dev];
        mt.loss_scale = s.loss_scale();
        mt.grad_norm = s.apply_gradients(dev, mt.sync_seconds);
        mt.skipped = s.loss_scaling() && !std::isfinite(mt.grad_norm);
        sum_over<State::data_axes | State::pipeline_axes>(s.mesh, dev, sums);  // the last stage's sums, to all
        mt.loss = sums[0];
        mt.correct = static_cast<std::size_t>(sums[1] + 0.5);
        mt.rows = global_rows;
      },
      backend);
  const step_metrics& r = out[s.local_devices().front()];
  s.finish_step(r.skipped);
  return r;
}

/// `run_evaluate` on a mesh whose pipeline axis has more than one device: each batch goes through
/// the stages in turn (forward only, no overlap between batches), the loss on the last stage.
template <class State, class In, class Backend>
step_metrics run_pipeline_evaluate(State& s, std::span<const In> x, std::size_t features, std::span<const std::int32_t> y,
                                   std::size_t count, std::size_t group, std::size_t batch_rows, const Backend& backend) {
  check_runner(s, backend, "evaluate");
  pipeline_engine& e = *s.pipeline();
  const std::size_t p = e.stages, dp = s.mesh.axes_size(State::data_axes);
  using X0 = pipeline_input_t<State, In>;
  s.model.begin_step(s.key, false);
  std::vector<step_metrics> out(s.mesh.size());
  meshlib::spmd(
      s.mesh,
      [&](std::size_t dev) {
        const std::size_t stage = s.mesh.group_rank(dev, State::pipeline_axes);
        stage_runner<State, X0> run{s, e, dev, stage, e.bounds[stage].first, e.bounds[stage].second};
        const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
        make_group_communicators(s.mesh, dev);
        refresh_mirrors(s, e, dev, stage, false);
        double sums[2] = {0, 0};
        for (std::size_t start = 0; start < count; start += batch_rows) {
          const std::size_t units = std::min(batch_rows, count - start) / group;
          const std::size_t lo = start + units * di / dp * group, hi = start + units * (di + 1) / dp * group;
          const X0 x0 = meshlib::pvary<"pipeline">(make_input_block<In>(s, dev, x.data() + lo * features, hi - lo, features));
          if (e.probed_rows[dev] == 0 && hi > lo) {
            e.extents[dev].assign((State::model_type::size + 1) * 8, 0);
            run.template probe<0>(x0, hi - lo);
          }
          const std::size_t msg = (hi - lo) * run.message_per_row();
          float* in = e.inputs.get(dev, msg);
          float* send = e.send.get(dev, msg);
          auto sink = [&](auto at, const auto& z) {
            if constexpr (decltype(at)::value == State::model_type::size) {
              const loss_part part = s.loss().forward(z, y.subspan(lo, hi - lo), count);
              sums[0] += part.loss;
              sums[1] += static_cast<double>(part.correct);
            } else {
              convert_copy<default_memory_space>(send, z.data(), z.size());
            }
          };
          for (std::size_t t = 0; t < p; ++t) {
            if (stage == t) run.forward(x0, in, hi - lo, sink);
            if (t + 1 < p) {
              const float* got = pipeline_exchange(s.mesh, dev, send, msg, {{t, t + 1}});
              if (stage == t + 1) convert_copy<default_memory_space>(in, got, msg);
            }
          }
        }
        sum_over<State::data_axes | State::pipeline_axes>(s.mesh, dev, sums);
        out[dev].loss = sums[0];
        out[dev].correct = static_cast<std::size_t>(sums[1] + 0.5);
        out[dev].rows = count;
      },
      backend);
  return out[s.local_devices().front()];
}

}  // namespace meshlib::nn::detail
