// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How the pipeline policy runs a step's micro-batches and an evaluation's batches
/// (nn/parallel/pipeline.hpp has the design): each device runs its stage's layers of a `sequential`
/// over the rounds of a `pipeline_plan`, exchanging activations and gradients with its neighbours by
/// `ppermute` over the pipeline axis. `pipelined_microbatches` is what the one `train_step` and the
/// one `evaluate` run in place of running the micro-batches one after another
/// (nn/train/microbatches.hpp); the inputs, the loss, the synchronisation and the update are theirs.

#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <ctime>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/permutes.hpp"
#include "meshlib/nn/parallel/pipeline.hpp"
#include "meshlib/nn/train/step_inputs.hpp"
#include "meshlib/nn/train/step_metrics.hpp"

namespace meshlib::nn::detail {

/// The calling thread's CPU seconds where the platform has a per-thread clock (not inflated by other
/// work sharing the cores), else wall seconds (`pipeline_stage_times`).
inline double thread_seconds() noexcept {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec t{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) == 0) return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
#endif
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The type of a device's model input on a pipeline mesh: as `input_block_t`, and varying over the
/// pipeline axis (every activation differs from stage to stage, which `ppermute` requires).
template <class State, class In>
using pipeline_input_t = with_vary_t<input_block_t<State, In>, State::data_axes | State::pipeline_axes>;

/// Sends `n` elements at `send` to the stages `pairs` names over the pipeline axis (the public
/// typed `ppermute`, every stage calling it); returns where this device's received elements lie
/// (the collective's workspace: valid until the next collective on this device).
template <fixed_string Axis, class Mesh>
const float* pipeline_exchange(const Mesh& mesh, std::size_t dev, float* send, std::size_t n,
                               const std::vector<std::pair<std::size_t, std::size_t>>& pairs) {
  using message_t = local_tensor<float, 1, Mesh, Mesh::all_axes>;
  return meshlib::ppermute<Axis>(message_t(typename message_t::view_type(send, n), mesh, dev), pairs).data();
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
    const float* r = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, q.value[dev], n, {{t.owner, t.mirror}});
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

  /// Rounds a layer's output or cotangent to the compute type, as `sequential` does (mixed precision).
  template <class Y>
  void round(Y& y) const noexcept {
    if constexpr (requires { { y.data() } -> std::same_as<float*>; y.size(); })
      if (s.model.round_activations != nullptr) s.model.round_activations(y.data(), y.size());
  }

  /// Calls `f(layer index, buffer)` for every buffer (running statistics) of the model's layers.
  template <class F>
  void for_each_buffer(F&& f) const {
    std::size_t i = 0;
    std::apply(
        [&](const auto&... l) {
          (
              [&] {
                std::vector<param_ref<float>> out;
                collect_buffers_of(l, out);
                for (const auto& b : out) f(i, b);
                ++i;
              }(),
              ...);
        },
        s.model.layers);
  }
  /// The buffers of this stage's layers.
  [[nodiscard]] std::vector<param_ref<float>> stage_buffers() const {
    std::vector<param_ref<float>> out;
    for_each_buffer([&](std::size_t i, const param_ref<float>& b) {
      if (i >= lo && i < hi) out.push_back(b);
    });
    return out;
  }
  /// Copies the stage's buffers to `stash` (`to_stash`) or back: a forward run again (recompute,
  /// probe) must not move running statistics a second time (as `remat`).
  void stash_buffers(const std::vector<param_ref<float>>& buffers, float* stash, bool to_stash) const {
    for (std::size_t i = 0, off = 0; i < buffers.size(); off += buffers[i].count[dev], ++i) {
      float* v = buffers[i].value[dev];
      if (to_stash) convert_copy<default_memory_space>(stash + off, v, buffers[i].count[dev]);
      else convert_copy<default_memory_space>(v, stash + off, buffers[i].count[dev]);
    }
  }

  /// Records the extents of `y` (the input of layer `I`) and runs the stage's layers from `I` on,
  /// recording each; at the stage's end, the output's extents go to `out`.
  template <std::size_t I, class Y>
  void probe_from(const Y& y, double* out) {
    static_assert(Y::rank <= 8, "meshlib::nn: pipeline: an activation of rank above 8");
    for (std::size_t d = 0; d < Y::rank; ++d) e.extents[dev][I * 8 + d] = y.extent(d);
    if constexpr (I < layers) {
      if (I != hi) {
        if (s.model.hooks != nullptr) s.model.hooks->before_forward(I, dev);
        auto z = std::get<I>(s.model.layers).forward(y);
        round(z);
        return probe_from<I + 1>(z, out);
      }
    }
    for (std::size_t d = 0; d < Y::rank; ++d) out[d] = static_cast<double>(y.extent(d));
  }
  template <std::size_t I = 0, class MakeX0>
  void probe_stage(const MakeX0& x0, float* in, std::size_t rows, double* out) {
    if constexpr (I < layers) {
      if (I != lo) return probe_stage<I + 1>(x0, in, rows, out);
      if constexpr (I == 0) probe_from<0>(x0(), out);
      else probe_from<I>(typed<I>(in, rows), out);
    }
  }
  /// Learns the extents of every activation of this stage and of every stage boundary for `rows`
  /// rows: the stages run their layers in turn, each on zeros of the extents the one before found
  /// (sent to all by a sum over the pipeline axis), so a device runs (and allocates the buffers of)
  /// its own layers only. Running statistics are put back afterwards. A collective of the axis.
  template <class MakeX0>
  void probe(const MakeX0& x0, std::size_t rows) {
    e.extents[dev].assign((layers + 1) * 8, 0);
    e.probed_rows[dev] = 0;
    const auto buffers = stage_buffers();
    std::size_t total = 0;
    for (const auto& b : buffers) total += b.count[dev];
    for (std::size_t t = 0; t < e.stages; ++t) {
      double out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (t == stage) {
        float* in = nullptr;
        float* stash = nullptr;
        {
          const meter_scope unmetered(nullptr);  // the probe's own scratch is not the model's
          if (stage > 0) {
            std::size_t n = 1;
            for (std::size_t d = 0; d < 8 && e.extents[dev][lo * 8 + d] != 0; ++d) n *= e.extents[dev][lo * 8 + d];
            in = e.scratch.zeros(dev, n);
          }
          if (total > 0) stash = e.stash.get(dev, total);
        }
        stash_buffers(buffers, stash, true);
        probe_stage(x0, in, rows, out);
        stash_buffers(buffers, stash, false);
      }
      sum_over<State::pipeline_axes>(s.mesh, dev, out);
      const std::size_t at = e.bounds[t].second;
      for (std::size_t d = 0; d < 8; ++d) e.extents[dev][at * 8 + d] = static_cast<std::size_t>(out[d] + 0.5);
    }
    e.probed_rows[dev] = rows;
  }

  /// Layers `I .. hi - 1` forward on `y`; then `sink(integral_constant<I>, output)`.
  template <std::size_t I, class Y, class Sink>
  void forward_from(const Y& y, Sink& sink) {
    if constexpr (I == layers) {
      sink(std::integral_constant<std::size_t, I>{}, y);
    } else {
      if (I == hi) return sink(std::integral_constant<std::size_t, I>{}, y);
      if (s.model.hooks != nullptr) s.model.hooks->before_forward(I, dev);  // FSDP: gather the layer
      auto z = std::get<I>(s.model.layers).forward(y);
      round(z);  // mixed precision: on the compute type's grid, as sequential's forward
      forward_from<I + 1>(z, sink);
    }
  }
  /// The stage's forward on `x0()` (stage 0: the micro-batch's input block, made only there) or
  /// the received activation at `in`.
  template <std::size_t I = 0, class MakeX0, class Sink>
  void forward(const MakeX0& x0, float* in, std::size_t rows, Sink& sink) {
    if constexpr (I < layers) {
      if (I != lo) return forward<I + 1>(x0, in, rows, sink);
      if constexpr (I == 0) forward_from<0>(x0(), sink);
      else forward_from<I>(typed<I>(in, rows), sink);
    }
  }

  /// Layers `I` down to `lo` backward from `dy` (the cotangent of layer `I`'s output); then
  /// `sink(dx)` with the cotangent of the stage input (not on stage 0, which needs none).
  template <std::size_t I, class DY, class Sink>
  void backward_from(const DY& dy, Sink& sink) {
    const bool first = I == lo;
    const bool need_dx = !first || stage > 0;
    if (s.model.hooks != nullptr) s.model.hooks->before_backward(I, dev);
    auto dx = layer_backward<input_t<I>>(std::get<I>(s.model.layers), dy, need_dx);
    if (s.model.hooks != nullptr) s.model.hooks->after_backward(I, dev);  // FSDP: reduce-scatter its gradients
    if (need_dx) round(dx);  // mixed precision, as sequential's backward
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

/// Gives every stage the running statistics (layer buffers) its stage's devices updated in the
/// step: one sum over the pipeline axis of all the model's buffers, each stage contributing its own
/// layers' and zeros for the others' (x + 0 is x: the values arrive unchanged). Afterwards every
/// device holds the model's current buffers, so a checkpoint (written by the first device of each
/// group) and `running_mean()` read on any device see them. No-op for a model without buffers.
template <class Runner>
void sync_buffers(Runner& run) {
  std::size_t total = 0;
  run.for_each_buffer([&](std::size_t, const param_ref<float>& b) { total += b.count[run.dev]; });
  if (total == 0) return;
  using State = std::remove_cvref_t<decltype(run.s)>;
  using buffers_t = local_tensor<float, 1, typename State::mesh_type, State::mesh_type::all_axes, 0, replicated_dims<1>,
                                 default_memory_space>;
  float* v = run.e.scratch.get(run.dev, total);
  std::size_t off = 0;
  run.for_each_buffer([&](std::size_t i, const param_ref<float>& b) {
    const std::size_t n = b.count[run.dev];
    if (i >= run.lo && i < run.hi) convert_copy<default_memory_space>(v + off, b.value[run.dev], n);
    else fill_values<default_memory_space>(v + off, n, 0.0f);
    off += n;
  });
  (void)psum_over<State::pipeline_axes>(wrap1<buffers_t>(v, total, run.s.mesh, run.dev));
  off = 0;
  run.for_each_buffer([&](std::size_t i, const param_ref<float>& b) {
    const std::size_t n = b.count[run.dev];
    if (i < run.lo || i >= run.hi) convert_copy<default_memory_space>(b.value[run.dev], v + off, n);
    off += n;
  });
}

/// The pipeline policy's schedule of a step's micro-batches (see the file comment): what the one
/// step (nn/train/train_step.hpp) and the one evaluation (nn/train/evaluate.hpp) run on a mesh
/// whose pipeline axis has more than one device, in place of `accumulated_microbatches`
/// (nn/train/microbatches.hpp), with the same members. Each device runs its stage's layers over
/// the rounds of a `pipeline_plan`; the step's `accumulation = k` runs `k` whole schedules of `m`
/// micro-batches before the one synchronisation.
template <class State, class In>
struct pipelined_microbatches {
  /// The axes the step's loss sums run over: the last stage computes the loss, every stage reports it.
  static constexpr axis_mask metric_axes = State::data_axes | State::pipeline_axes;
  using X0 = pipeline_input_t<State, In>;

  State& s;
  pipeline_engine& e;

  /// Micro-batches per accumulation step: the policy's `microbatches` (0: one per stage).
  [[nodiscard]] std::size_t per_group() const { return e.microbatches == 0 ? e.stages : e.microbatches; }
  /// The accumulation steps the common batch check divides by (the pipeline checks its own split).
  [[nodiscard]] static std::size_t checked_groups(std::size_t) { return 1; }
  /// Throws unless the `k` accumulation steps of `per_group()` micro-batches divide each data
  /// device's `local_rows` rows of a global batch of `global_rows` over `dp` devices.
  void check_split(std::size_t local_rows, std::size_t global_rows, std::size_t dp, std::size_t k) const {
    const std::size_t m = per_group();
    if (local_rows % (k * m) == 0) return;
    const std::string what = k == 1 ? "the pipeline's " + std::to_string(m) + " micro-batches"
                                    : "the pipeline's " + std::to_string(m) + " micro-batches x " + std::to_string(k) +
                                          " accumulation steps";
    const std::string fix = k == 1 ? "pipeline.microbatches" : "pipeline.microbatches x accumulation";
    throw sharding_error("meshlib::nn: train_step: " + what + " do not divide the " + std::to_string(local_rows) +
                         " rows each device of the data axes gets (a global batch of " + std::to_string(global_rows) +
                         " rows over " + std::to_string(dp) + " devices); choose " + fix + " dividing " +
                         std::to_string(local_rows) + ", or a batch of a multiple of " + std::to_string(dp * k * m) +
                         " rows");
  }

  [[nodiscard]] std::size_t stage_of(std::size_t dev) const { return s.mesh.group_rank(dev, State::pipeline_axes); }
  [[nodiscard]] stage_runner<State, X0> runner(std::size_t dev) const {
    const std::size_t stage = stage_of(dev);
    return {s, e, dev, stage, e.bounds[stage].first, e.bounds[stage].second};
  }

  /// Before device `dev`'s step: the group communicators in one order, this stage's gradients as
  /// the step's (overwritten by the first backward, or zeroed), a mirror's from zero.
  void begin_step(std::size_t dev) const {
    make_group_communicators(s.mesh, dev);
    for (const auto& q : s.params)
      if (q.count[dev] == 0) continue;
      else if (q.overwrite) q.overwrite[dev] = 1;
      else fill_values<default_memory_space>(q.grad[dev], q.count[dev], 0.0f);
    refresh_mirrors(s, e, dev, stage_of(dev), true);
  }

  /// Device `dev`'s forwards and backwards of the step's `k * per_group()` micro-batches of `micro`
  /// rows each in the plan's rounds: `input(j)` makes micro-batch `j`'s input block (on the first
  /// stage), `loss_on(j, z, dz)` computes its loss on the last stage, its gradient into `dz`.
  template <class Input, class LossOn>
  void run(std::size_t dev, std::size_t k, std::size_t micro, const Input& input, LossOn& loss_on,
           step_metrics& metrics) const {
    using clock = std::chrono::steady_clock;
    const std::size_t p = e.stages, m = per_group(), stage = stage_of(dev);
    const pipeline_plan plan(e.schedule, p, m);
    stage_runner<State, X0> run = runner(dev);
    std::size_t g = 0;  // the accumulation group running: micro-batch j is the step's g m + j
    const auto x0_of = [&](std::size_t j) {
      return [&, j] { return meshlib::pvary<State::pipeline_axis>(input(g * m + j)); };
    };
    // Activation memory (step_metrics): the stage's layer buffers and the boundary buffers it
    // holds across the rounds, counted by the device's meter (nn/remat.hpp).
    buffer_meter* meter = s.activation_meter(dev);
    if (e.probed_rows[dev] == 0) {
      const meter_scope metered(meter);
      run.probe(x0_of(0), micro);
    }
    const std::size_t msg = micro * run.message_per_row();
    const std::size_t zn = micro * run.per_row(State::model_type::size);  // logits per micro-batch
    const pipeline_plan::holding held = plan.held(stage);
    float *inputs = nullptr, *dys = nullptr, *dlogits = nullptr, *send = nullptr;
    {
      const meter_scope metered(meter);
      inputs = e.inputs.get(dev, held.inputs * msg);
      dys = e.dys.get(dev, held.cotangents * msg);
      dlogits = e.dlogits.get(dev, held.loss_grads * zn);
      send = e.send.get(dev, msg);
    }
    const auto input_of = [&](std::size_t j) { return stage == 0 ? nullptr : inputs + held.input_slot[j] * msg; };
    const auto buffers = run.stage_buffers();
    std::size_t buffer_elements = 0;
    for (const auto& b : buffers) buffer_elements += b.count[dev];
    float* stash = nullptr;
    if (buffer_elements > 0) stash = e.stash.get(dev, buffer_elements);
    double busy = 0;
    pipeline_stage_times times;
    bool with_loss = true;  // false while recomputing: the loss's gradient is kept from the forward
    std::size_t j = 0;      // the micro-batch running
    auto forward_sink = [&](auto at, const auto& out) {
      if constexpr (decltype(at)::value == State::model_type::size) {
        if (!with_loss) return;
        using Z = std::remove_cvref_t<decltype(out)>;
        Z dz(typename Z::view_type(dlogits + held.loss_grad_slot[j] * zn, out.extent(0), out.extent(1)), s.mesh, dev);
        loss_on(g * m + j, out, dz);
      } else {
        if (with_loss) convert_copy<default_memory_space>(send, out.data(), out.size());
      }
    };
    auto backward_sink = [&](const auto& dx) { convert_copy<default_memory_space>(send, dx.data(), dx.size()); };
    const auto& rounds = plan.rounds();
    const auto start = clock::now();
    for (g = 0; g < k; ++g)
      for (std::size_t ri = 0; ri < rounds.size(); ++ri) {
        const auto& r = rounds[ri];
        if (r[stage].forward != pipeline_slot::none) {
          const auto t0 = clock::now();
          const double c0 = thread_seconds();
          j = r[stage].forward;
          with_loss = true;
          {
            const meter_scope metered(meter);
            run.forward(x0_of(j), input_of(j), micro, forward_sink);
          }
          times.forward += thread_seconds() - c0;
          ++times.forwards;
          if (g + 1 == k && j + 1 == m) metrics.activation_bytes = meter->live;
          busy += std::chrono::duration<double>(clock::now() - t0).count();
        }
        if (const auto pairs = round_pairs(r, true); !pairs.empty()) {
          const float* got = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, send, msg, pairs);
          if (stage > 0 && r[stage - 1].forward != pipeline_slot::none)
            convert_copy<default_memory_space>(input_of(r[stage - 1].forward), got, msg);
        }
        if (r[stage].backward != pipeline_slot::none) {
          const auto t0 = clock::now();
          j = r[stage].backward;
          const meter_scope metered(meter);
          double c0 = thread_seconds();
          if (plan.recomputes(ri, stage)) {  // the layers hold another micro-batch's forward: run this one's again
            with_loss = false;
            run.stash_buffers(buffers, stash, true);  // running statistics move once per micro-batch
            run.forward(x0_of(j), input_of(j), micro, forward_sink);
            run.stash_buffers(buffers, stash, false);
            const double c1 = thread_seconds();
            times.recompute += c1 - c0;
            ++times.recomputes;
            c0 = c1;
          }
          run.backward(stage + 1 == p ? dlogits + held.loss_grad_slot[j] * zn : dys + held.cotangent_slot[j] * msg,
                       micro, backward_sink);
          times.backward += thread_seconds() - c0;
          ++times.backwards;
          busy += std::chrono::duration<double>(clock::now() - t0).count();
        }
        if (const auto pairs = round_pairs(r, false); !pairs.empty()) {
          const float* got = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, send, msg, pairs);
          if (stage + 1 < p && r[stage + 1].backward != pipeline_slot::none)
            convert_copy<default_memory_space>(dys + held.cotangent_slot[r[stage + 1].backward] * msg, got, msg);
        }
      }
    e.busy[dev] = busy;
    e.span[dev] = std::chrono::duration<double>(clock::now() - start).count();
    e.times[dev] = times;
  }

  /// After device `dev`'s backwards: an unwritten gradient zeroed, a mirror's gradient added to its
  /// owner's (the tied weight's sum), the sums on the compute type's grid, every stage's running
  /// statistics on every stage.
  void end_step(std::size_t dev) const {
    const std::size_t stage = stage_of(dev);
    for (const auto& q : s.params)
      if (q.count[dev] != 0 && q.overwrite && q.overwrite[dev]) {  // no backward wrote it: zero
        fill_values<default_memory_space>(q.grad[dev], q.count[dev], 0.0f);
        q.overwrite[dev] = 0;
      }
    for (const auto& t : e.mirrors) {
      const auto& q = s.params[t.param];
      const std::size_t n = e.block_elements(t.param, dev);
      const float* r = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, q.grad[dev], n, {{t.mirror, t.owner}});
      if (stage == t.owner) add_values<default_memory_space>(q.grad[dev], r, n);
    }
    if constexpr (State::mixed)  // the summed gradients on the compute type's grid (as without a pipeline)
      for (const auto& q : s.params)
        if (q.count[dev] != 0) round_to<typename State::compute_type>(q.grad[dev], q.count[dev]);
    stage_runner<State, X0> run = runner(dev);
    sync_buffers(run);
  }

  /// Before device `dev`'s evaluation: the group communicators, the mirrors' values.
  void begin_evaluate(std::size_t dev) const {
    make_group_communicators(s.mesh, dev);
    refresh_mirrors(s, e, dev, stage_of(dev), false);
  }
  /// Device `dev`'s forward of one evaluation batch of `rows` rows (`input()` its block on the
  /// first stage) through the stages in turn (no overlap between batches); `on_output(z)` with the
  /// model's output on the last stage.
  template <class Input, class OnOutput>
  void evaluate(std::size_t dev, const Input& input, std::size_t rows, OnOutput& on_output) const {
    const std::size_t p = e.stages, stage = stage_of(dev);
    stage_runner<State, X0> run = runner(dev);
    const auto x0 = [&] { return meshlib::pvary<State::pipeline_axis>(input()); };
    const meter_scope metered(s.activation_meter(dev));  // the stage's buffers are the model's
    if (e.probed_rows[dev] == 0 && rows > 0) run.probe(x0, rows);
    const std::size_t msg = rows * run.message_per_row();
    float* in = e.inputs.get(dev, msg);
    float* send = e.send.get(dev, msg);
    auto sink = [&](auto at, const auto& z) {
      if constexpr (decltype(at)::value == State::model_type::size) {
        const meter_scope unmetered(nullptr);
        on_output(z);
      } else {
        convert_copy<default_memory_space>(send, z.data(), z.size());
      }
    };
    for (std::size_t t = 0; t < p; ++t) {
      if (stage == t) run.forward(x0, in, rows, sink);
      if (t + 1 < p) {
        const float* got = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, send, msg, {{t, t + 1}});
        if (stage == t + 1) convert_copy<default_memory_space>(in, got, msg);
      }
    }
  }
};

}  // namespace meshlib::nn::detail
