// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Pipeline-parallel training over a mesh axis (issue 26): a `sequential`
/// model cut into stages (contiguous runs of layers), one stage per device of the axis, the batch
/// cut into micro-batches that flow through the stages under a GPipe or 1F1B order, activations
/// forward and gradients backward by the public typed `ppermute` between neighbouring stages
/// (torch.distributed.pipelining's `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B`, or the JAX
/// `shard_map` + `ppermute` pipeline loop).
///
/// A `train_state` given the policy `pipeline<"axis">` (any axis of its mesh) over an axis of
/// `p > 1` devices trains this way; the policy holds the micro-batches, schedule and stage split.
/// A mesh axis is pipelined only by the policy, whatever its name: a state whose pipeline axis
/// (`pipeline` by default) has more than one device and no policy is refused at construction.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"pipe">>;
/// meshlib::nn::train_state state(mesh_t{2, 2}, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)),
///     meshlib::nn::pipeline<"pipe">{.schedule = meshlib::nn::pipeline_kind::gpipe, .microbatches = 4});
/// auto m = meshlib::nn::train_step(state, batch);  // m.loss: computed on the last stage, reported to all
/// @endcode
///
/// Why lockstep rounds: `ppermute` is a collective of the whole axis (every stage calls it, as in
/// JAX), so the stages meet at each exchange. A step is a sequence of rounds; in a round every
/// stage runs at most one forward, then the activations move one stage on, then every stage runs
/// at most one backward, then the gradients move one stage back (`pipeline_plan`). A message
/// therefore takes one round per hop each way, and 1F1B warms up with `2 (p - 1 - s)` forwards on
/// stage `s` instead of the `p - 1 - s` of an asynchronous runtime (torch's send/recv): the same
/// bubble, (p - 1) / (m + p - 1), with up to `2 (p - s) - 1` micro-batches in flight instead of
/// GPipe's `m`.
///
/// Why recomputation: a layer keeps what its backward needs from its *last* forward, so a stage
/// keeps each in-flight micro-batch's *input* (the received activation) and, when the backward of a
/// micro-batch is not the one its layers last ran forward, runs the stage's forward on it again
/// first (stage-level activation checkpointing; the same numbers, dropout included: its mask is a
/// function of the step's key and the rows).
///
/// What it computes: what `train_options{.accumulation = m}` computes without a pipeline on the same
/// data mesh (the same rows per forward, the gradients summed over the micro-batches); so 16-bit
/// compute rounds as there (each layer's output and cotangent, the loss's scaled gradient, the
/// summed gradients), batch norm takes statistics per micro-batch and moves its running statistics
/// once per micro-batch in order (a recompute saves and restores them; after the step every stage
/// gets the others' by a sum over the axis), and `accumulation = k` runs `k` whole schedules before
/// the one synchronisation (`k m` micro-batches). Activation memory: a stage holds its layers'
/// buffers for one micro-batch plus the boundary buffers of `pipeline_plan::held`, metered as
/// `step_metrics::peak_activation_bytes`.
///
/// Parameters: a device holds, synchronises and updates only its stage's parameters (its
/// `params[i].count[dev]` is 0 for the others, so optimizer state, gradient synchronisation over the
/// data axes, clipping and checkpoints skip them); a parameter that a later stage's layer also reads
/// (a `tied_head`'s embedding table) is owned by the first stage and mirrored on the other: the
/// owner sends its value before each step, the mirror sends its gradient back after the backward.
///
/// Composition: the data axes split the batch and all-reduce (or, under ZeRO-1, reduce-scatter)
/// each stage's gradients as without a pipeline; a tensor axis runs inside the layers; under FSDP
/// the stages restrict the shards and the stage runner calls the FSDP hooks around each layer.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/parallel/pipeline_schedule.hpp"
#include "meshlib/nn/parallel/policy.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn {

/// @brief Which order the micro-batches run in (torch's `ScheduleGPipe` / `Schedule1F1B`).
enum class pipeline_kind : std::uint8_t {
  gpipe,        ///< every forward, then every backward: m micro-batches' activations in flight
  one_f_one_b,  ///< after a warm-up, one forward and one backward in turn: fewer in flight
};

/// @brief Pipeline parallelism over the mesh axis `Axis` (see the file comment; torchtitan's
/// `pipeline_llama`); a `parallel_policy`. Its schedule runs the step's micro-batches
/// (nn/parallel/pipeline_run.hpp). Composes with `data_parallel` and `fully_shard` on other axes.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt,
///     meshlib::nn::pipeline<"pipe">{.schedule = meshlib::nn::pipeline_kind::gpipe, .microbatches = 8});
/// @endcode
/// @tparam Axis the mesh axis whose devices hold the stages.
template <fixed_string Axis = "pipeline">
struct pipeline {
  /// The parallelism this policy applies.
  static constexpr parallelism kind = parallelism::pipelined;
  /// The mesh axis it applies over.
  static constexpr auto axis = Axis;
  /// The order of forwards and backwards.
  pipeline_kind schedule = pipeline_kind::one_f_one_b;
  /// Micro-batches per step (0: as many as stages).
  std::size_t microbatches = 0;
  /// The index of the first layer of every stage after the first (torch's `split_spec`, as layer
  /// indices): `{2, 4}` on 3 stages runs layers [0, 2), [2, 4), [4, n). Empty: stages balanced by
  /// parameter count.
  std::vector<std::size_t> split_points = {};
};

/// @brief One stage's work in one round of a `pipeline_plan`: the micro-batch it runs forward and
/// the one it runs backward (`none` for neither).
struct pipeline_slot {
  static constexpr std::size_t none = static_cast<std::size_t>(-1);  ///< no micro-batch
  std::size_t forward = none;   ///< runs in the round's first half
  std::size_t backward = none;  ///< runs in the round's second half
};

/// @brief Where one device's compute time in its last pipelined step went (`nn::stage_times`):
/// thread CPU seconds where the platform has a per-thread clock (Linux, macOS: not inflated when
/// other work shares the cores), else wall seconds; with the number of each. What
/// `pipeline_plan::bubble_with_costs` takes, per stage, as the cost of one of each.
struct pipeline_stage_times {
  double forward = 0;         ///< in its forwards (the first run of each micro-batch, loss included)
  double backward = 0;        ///< in its backwards, less the forwards they first run again
  double recompute = 0;       ///< in the forwards run again before a backward
  std::size_t forwards = 0;   ///< forwards run
  std::size_t backwards = 0;  ///< backwards run
  std::size_t recomputes = 0; ///< forwards run again
};

/// @brief The lockstep rounds a pipelined step runs (see the file comment): per round, per stage,
/// what it runs. Built from the per-stage orders of `pipeline_schedule` (GPipe) or 1F1B with a
/// warm-up of `2 (p - 1 - s)` forwards, each stage running its next step as soon as its input has
/// arrived.
class pipeline_plan {
 public:
  /// The plan of `kind` for `stages` x `microbatches`.
  /// @throws sharding_error when either is 0.
  pipeline_plan(pipeline_kind kind, std::size_t stages, std::size_t microbatches)
      : kind_(kind), p_(stages), m_(microbatches) {
    if (stages == 0 || microbatches == 0)
      throw sharding_error("meshlib::nn::pipeline_plan: " + std::to_string(stages) + " stages x " +
                           std::to_string(microbatches) + " micro-batches; a pipeline needs at least one of each");
    build();
  }

  /// GPipe or 1F1B.
  [[nodiscard]] pipeline_kind kind() const noexcept { return kind_; }
  /// "GPipe" or "1F1B".
  [[nodiscard]] std::string name() const { return kind_ == pipeline_kind::gpipe ? "GPipe" : "1F1B"; }
  /// Stages.
  [[nodiscard]] std::size_t stages() const noexcept { return p_; }
  /// Micro-batches per step.
  [[nodiscard]] std::size_t microbatches() const noexcept { return m_; }
  /// The rounds: `rounds()[r][s]` is stage `s`'s work in round `r`.
  [[nodiscard]] const std::vector<std::vector<pipeline_slot>>& rounds() const noexcept { return rounds_; }

  /// The fraction of stage time idle when a forward takes `forward` and a backward `backward` (any
  /// units) on every stage and messages are free: a round lasts the forward if any stage runs one,
  /// plus the backward if any stage runs one. (p - 1) / (m + p - 1) for both kinds.
  [[nodiscard]] double bubble_fraction(double forward = 1.0, double backward = 2.0) const {
    double total = 0;
    for (const auto& r : rounds_) {
      bool f = false, b = false;
      for (const auto& x : r) {
        f = f || x.forward != pipeline_slot::none;
        b = b || x.backward != pipeline_slot::none;
      }
      total += (f ? forward : 0.0) + (b ? backward : 0.0);
    }
    return 1.0 - static_cast<double>(m_) * (forward + backward) / total;
  }

  /// Whether stage `stage`'s backward in round `round` first runs its forward again: its layers
  /// last ran another micro-batch's forward (see the file comment). The last stage under 1F1B never does.
  [[nodiscard]] bool recomputes(std::size_t round, std::size_t stage) const { return recompute_.at(round).at(stage) != 0; }

  /// `bubble_fraction` with the recomputed forwards counted as work: a backward that recomputes
  /// costs `forward + backward`. The stages then do unequal work (the last does less), and this is
  /// what a balanced model's measured bubble approaches.
  [[nodiscard]] double bubble_with_recompute(double forward = 1.0, double backward = 2.0) const {
    double total = 0, busy = 0;
    for (std::size_t r = 0; r < rounds_.size(); ++r) {
      double f = 0, b = 0;
      for (std::size_t s = 0; s < p_; ++s) {
        if (rounds_[r][s].forward != pipeline_slot::none) f = forward;
        if (rounds_[r][s].backward == pipeline_slot::none) continue;
        const double c = backward + (recompute_[r][s] ? forward : 0.0);
        b = std::max(b, c);
        busy += c;
      }
      total += f + b;
    }
    busy += static_cast<double>(p_ * m_) * forward;
    return 1.0 - busy / (static_cast<double>(p_) * total);
  }

  /// `bubble_with_recompute` with each stage's own costs: `forward[s]`, `backward[s]` and
  /// `recompute[s]` the seconds (any unit) of one forward, one backward and one recomputed forward
  /// on stage `s`. A round lasts its slowest forward plus its slowest backward (a recomputing one
  /// with its recompute); the bubble is the stages' idle share of that. With measured costs
  /// (`nn::stage_times`) it is what the schedule costs on that model when messages are free:
  /// stages whose work differs (a first stage skips its input's cotangent; recomputation falls on
  /// some stages only) idle even at the plan's best.
  /// @throws sharding_error when a vector does not have one cost per stage.
  [[nodiscard]] double bubble_with_costs(const std::vector<double>& forward, const std::vector<double>& backward,
                                         const std::vector<double>& recompute) const {
    if (forward.size() != p_ || backward.size() != p_ || recompute.size() != p_)
      throw sharding_error("meshlib::nn::pipeline_plan::bubble_with_costs: " + std::to_string(forward.size()) + ", " +
                           std::to_string(backward.size()) + " and " + std::to_string(recompute.size()) +
                           " costs for " + std::to_string(p_) + " stages; give one forward, backward and recompute "
                           "cost per stage");
    double total = 0, busy = 0;
    for (std::size_t r = 0; r < rounds_.size(); ++r) {
      double f = 0, b = 0;
      for (std::size_t s = 0; s < p_; ++s) {
        if (rounds_[r][s].forward != pipeline_slot::none) {
          f = std::max(f, forward[s]);
          busy += forward[s];
        }
        if (rounds_[r][s].backward == pipeline_slot::none) continue;
        const double c = backward[s] + (recompute_[r][s] ? recompute[s] : 0.0);
        b = std::max(b, c);
        busy += c;
      }
      total += f + b;
    }
    return total <= 0 ? 0.0 : 1.0 - busy / (static_cast<double>(p_) * total);
  }

  /// The most micro-batches stage `stage` holds the input of at once (forwarded, not yet backwarded).
  [[nodiscard]] std::size_t peak_in_flight(std::size_t stage) const {
    std::size_t held = 0, peak = 0;
    for (const auto& r : rounds_) {
      if (r.at(stage).forward != pipeline_slot::none) peak = std::max(peak, ++held);
      if (r[stage].backward != pipeline_slot::none) --held;
    }
    return peak;
  }

  /// @brief What stage `stage` holds between rounds (`slots`): for each micro-batch, the slot of the
  /// stage's buffers its received activation, its received cotangent and (last stage) its loss's
  /// gradient live in, and how many slots of each the stage needs. A received activation is held
  /// from the exchange that brings it until the stage's backward of that micro-batch (it is the
  /// layers' saved input, and what a recomputing backward starts from); a received cotangent until
  /// that backward; the loss's gradient from the last stage's forward (where the loss is taken)
  /// until its backward. A slot freed by a backward is reused by the next arrival (lowest first).
  struct holding {
    std::vector<std::size_t> input_slot;      ///< per micro-batch (`pipeline_slot::none` on stage 0)
    std::vector<std::size_t> cotangent_slot;  ///< per micro-batch (`none` on the last stage)
    std::vector<std::size_t> loss_grad_slot;  ///< per micro-batch (`none` but on the last stage)
    std::size_t inputs = 0;                   ///< slots of received activations
    std::size_t cotangents = 0;               ///< slots of received cotangents
    std::size_t loss_grads = 0;               ///< slots of the loss's gradients
  };
  /// The buffers stage `stage` holds over the rounds (see `holding`). Under GPipe the last stage
  /// holds all `m` activations and loss gradients; under 1F1B at most `2 (p - s)` activations.
  [[nodiscard]] holding held(std::size_t stage) const {
    constexpr std::size_t none = pipeline_slot::none;
    holding h;
    h.input_slot.assign(m_, none);
    h.cotangent_slot.assign(m_, none);
    h.loss_grad_slot.assign(m_, none);
    std::vector<char> in_use[3];
    const auto take = [&](int kind, std::vector<std::size_t>& slot, std::size_t& count, std::size_t j) {
      auto& u = in_use[kind];
      std::size_t i = 0;
      while (i < u.size() && u[i]) ++i;
      if (i == u.size()) u.push_back(0);
      u[i] = 1;
      slot[j] = i;
      count = std::max(count, u.size());
    };
    const auto give = [&](int kind, const std::vector<std::size_t>& slot, std::size_t j) {
      if (slot[j] != none) in_use[kind][slot[j]] = 0;
    };
    for (const auto& r : rounds_) {
      if (stage + 1 == p_ && r.at(stage).forward != none) take(2, h.loss_grad_slot, h.loss_grads, r[stage].forward);
      if (stage > 0 && r[stage - 1].forward != none) take(0, h.input_slot, h.inputs, r[stage - 1].forward);
      if (const std::size_t j = r[stage].backward; j != none) {
        give(0, h.input_slot, j);
        give(1, h.cotangent_slot, j);
        give(2, h.loss_grad_slot, j);
      }
      if (stage + 1 < p_ && r[stage + 1].backward != none) take(1, h.cotangent_slot, h.cotangents, r[stage + 1].backward);
    }
    return h;
  }

  /// One row per stage, one column per round half: `F3` / `B3` when micro-batch 3's forward /
  /// backward runs, `..` when idle.
  /// @code
  /// 1F1B, 2 stages x 3 micro-batches, 5 rounds
  /// stage 0 | F0 .. F1 .. F2 B0 .. B1 .. B2
  /// stage 1 | .. .. F0 B0 F1 B1 F2 B2 .. ..
  /// @endcode
  [[nodiscard]] std::string timeline() const {
    std::string out = name() + ", " + std::to_string(p_) + " stages x " + std::to_string(m_) + " micro-batches, " +
                      std::to_string(rounds_.size()) + " rounds\n";
    const std::size_t width = std::to_string(m_ - 1).size() + 1;
    const auto cell = [&](char c, std::size_t j) {
      std::string s = j == pipeline_slot::none ? std::string(width, '.') : c + std::to_string(j);
      s.resize(width, ' ');
      return s;
    };
    for (std::size_t s = 0; s < p_; ++s) {
      out += "stage " + std::to_string(s) + " |";
      for (const auto& r : rounds_) out += " " + cell('F', r[s].forward) + " " + cell('B', r[s].backward);
      out += "\n";
    }
    return out;
  }

 private:
  // Each stage's order, then a lockstep replay: a forward's output reaches the next stage for the
  // next round, a backward's for the next round too; the last stage may run a micro-batch's
  // backward in the round of its forward (the loss is computed in between).
  void build() {
    std::vector<std::vector<pipeline_step>> order(p_);
    if (kind_ == pipeline_kind::gpipe) {
      const auto g = pipeline_schedule::gpipe(p_, m_);
      for (std::size_t s = 0; s < p_; ++s) order[s] = g.steps(s);
    } else {
      for (std::size_t s = 0; s < p_; ++s) {
        const std::size_t warmup = std::min(2 * (p_ - 1 - s), m_);
        std::size_t f = 0, b = 0;
        for (; f < warmup; ++f) order[s].push_back({pipeline_pass::forward, f});
        for (; f < m_; ++f, ++b) {
          order[s].push_back({pipeline_pass::forward, f});
          order[s].push_back({pipeline_pass::backward, b});
        }
        for (; b < m_; ++b) order[s].push_back({pipeline_pass::backward, b});
      }
    }
    // has_in[s][j]: stage s can run forward j; has_dy[s][j]: it can run backward j.
    std::vector<std::vector<char>> has_in(p_, std::vector<char>(m_, 0)), has_dy = has_in;
    std::fill(has_in[0].begin(), has_in[0].end(), 1);
    std::vector<std::size_t> next(p_, 0), last_forward(p_, pipeline_slot::none);
    std::size_t left = p_ * 2 * m_;
    while (left > 0) {
      std::vector<pipeline_slot> r(p_);
      std::vector<std::pair<std::size_t, std::size_t>> arrive_in, arrive_dy;  // (stage, micro-batch)
      for (std::size_t s = 0; s < p_; ++s) {
        if (next[s] == order[s].size()) continue;
        const auto& x = order[s][next[s]];
        if (x.pass != pipeline_pass::forward || !has_in[s][x.microbatch]) continue;
        r[s].forward = x.microbatch;
        ++next[s];
        --left;
        if (s + 1 < p_) arrive_in.push_back({s + 1, x.microbatch});
        else has_dy[s][x.microbatch] = 1;  // the loss's gradient, at once
      }
      for (std::size_t s = 0; s < p_; ++s) {
        if (next[s] == order[s].size()) continue;
        const auto& x = order[s][next[s]];
        if (x.pass != pipeline_pass::backward || !has_dy[s][x.microbatch]) continue;
        r[s].backward = x.microbatch;
        ++next[s];
        --left;
        if (s > 0) arrive_dy.push_back({s - 1, x.microbatch});
      }
      std::vector<char> again(p_, 0);
      for (std::size_t s = 0; s < p_; ++s) {
        if (r[s].forward != pipeline_slot::none) last_forward[s] = r[s].forward;
        if (r[s].backward == pipeline_slot::none) continue;
        again[s] = last_forward[s] != r[s].backward;
        last_forward[s] = pipeline_slot::none;  // a backward leaves the layers' saved state spent
      }
      recompute_.push_back(std::move(again));
      for (auto [s, j] : arrive_in) has_in[s][j] = 1;
      for (auto [s, j] : arrive_dy) has_dy[s][j] = 1;
      rounds_.push_back(std::move(r));
      if (rounds_.size() > 4 * (p_ + m_) + 4)  // a bug, not an input: the orders above never deadlock
        throw sharding_error("meshlib::nn::pipeline_plan: the stage orders deadlock");
    }
  }

  pipeline_kind kind_;
  std::size_t p_, m_;
  std::vector<std::vector<pipeline_slot>> rounds_;
  std::vector<std::vector<char>> recompute_;  // [round][stage]
};

/// @brief The stages of a model of `layer_params.size()` layers (`layer_params[l]`: layer `l`'s
/// parameter elements) on `stages` devices: `[begin, end)` layer ranges. With `split_points` empty,
/// balanced: the contiguous split with at least one layer per stage whose largest stage has the
/// fewest parameters (ties: the earliest cuts).
/// @throws sharding_error when there are more stages than layers, or `split_points` is not
/// `stages - 1` strictly increasing indices in `[1, layers - 1]`.
inline std::vector<std::pair<std::size_t, std::size_t>> pipeline_stages(const std::vector<std::size_t>& layer_params,
                                                                        std::size_t stages,
                                                                        const std::vector<std::size_t>& split_points = {}) {
  const std::size_t n = layer_params.size();
  const auto list = [](const std::vector<std::size_t>& v) {
    std::string s = "{";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "}";
  };
  if (stages > n)
    throw sharding_error("meshlib::nn: pipeline: the mesh's 'pipeline' axis has " + std::to_string(stages) +
                         " devices (one stage each) but the model has " + std::to_string(n) +
                         " layers; a stage needs at least one layer: use a pipeline axis of at most " + std::to_string(n) +
                         " devices or a model with more layers");
  std::vector<std::size_t> cuts;
  if (!split_points.empty()) {
    if (split_points.size() + 1 != stages)
      throw sharding_error("meshlib::nn: pipeline: split_points " + list(split_points) + " make " +
                           std::to_string(split_points.size() + 1) + " stages but the mesh's 'pipeline' axis has " +
                           std::to_string(stages) + " devices (one stage each); give " + std::to_string(stages - 1) +
                           " split points, or none to balance the stages by parameter count");
    for (std::size_t i = 0; i < split_points.size(); ++i)
      if (split_points[i] == 0 || split_points[i] >= n || (i > 0 && split_points[i] <= split_points[i - 1]))
        throw sharding_error("meshlib::nn: pipeline: split_points " + list(split_points) +
                             " must be strictly increasing layer indices in [1, " + std::to_string(n - 1) +
                             "] (the first layer of each stage after the first, for a model of " + std::to_string(n) +
                             " layers); split point " + std::to_string(i) + " is " + std::to_string(split_points[i]));
    cuts = split_points;
  } else {
    // best[k][i]: the smallest largest-stage total of layers [0, i) in k stages; from[k][i] its last cut.
    constexpr std::size_t inf = std::numeric_limits<std::size_t>::max();
    std::vector<std::size_t> prefix(n + 1, 0);
    for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + layer_params[i];
    std::vector<std::vector<std::size_t>> best(stages + 1, std::vector<std::size_t>(n + 1, inf)), from = best;
    best[0][0] = 0;
    for (std::size_t k = 1; k <= stages; ++k)
      for (std::size_t i = k; i <= n; ++i)
        for (std::size_t j = k - 1; j < i; ++j) {
          if (best[k - 1][j] == inf) continue;
          const std::size_t v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
          if (v < best[k][i]) {
            best[k][i] = v;
            from[k][i] = j;
          }
        }
    cuts.resize(stages - 1);
    for (std::size_t k = stages, i = n; k > 1; --k) i = cuts[k - 2] = from[k][i];
  }
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t s = 0; s < stages; ++s) out.push_back({s == 0 ? 0 : cuts[s - 1], s + 1 == stages ? n : cuts[s]});
  return out;
}

namespace detail {

/// The layout of a parameter that only the devices of its stage hold: `inner`'s blocks there,
/// none elsewhere (`count` 0, and `zeros_like` makes blocks only there: optimizer state and master
/// weights follow).
class stage_param_layout final : public param_layout {
 public:
  stage_param_layout(std::shared_ptr<const param_layout> inner, std::vector<bool> holds)
      : inner_(std::move(inner)), holds_(std::move(holds)) {}
  std::span<const std::size_t> offset(std::size_t dev) const override { return inner_->offset(dev); }
  std::span<const std::size_t> extent(std::size_t dev) const override { return inner_->extent(dev); }
  std::size_t count(std::size_t dev) const override { return holds_.at(dev) ? inner_->count(dev) : 0; }
  std::size_t global_index(std::size_t dev, std::size_t i) const override { return inner_->global_index(dev, i); }
  void for_each_global_run(std::size_t dev, std::size_t first, std::size_t len,
                           const std::function<void(std::size_t, std::size_t, std::size_t)>& f) const override {
    inner_->for_each_global_run(dev, first, len, f);
  }
  held_tensor<float> zeros_like(std::span<const std::size_t> devices) const override {
    std::vector<std::size_t> mine;
    for (std::size_t dev : devices)
      if (holds_.at(dev)) mine.push_back(dev);
    return inner_->zeros_like(mine);
  }
  /// Elements of device `dev`'s block whether or not it holds it (a mirror's block).
  [[nodiscard]] std::size_t full_count(std::size_t dev) const { return inner_->count(dev); }

 private:
  std::shared_ptr<const param_layout> inner_;
  std::vector<bool> holds_;
};

/// A layer's parameters that it reads but another layer lists (`tied_head`'s table): what a layer
/// appends in `collect_tied`, if it has one.
template <class L, class T>
void collect_tied_of(L& l, std::vector<param_ref<T>>& out) {
  if constexpr (requires { l.collect_tied(out); }) l.collect_tied(out);
}

/// What a `train_state` keeps for a pipeline axis: the stages, which parameters each device holds,
/// the mirrors, and each device's buffers (see the file comment). Made on the calling thread; each
/// device thread touches only its own entries.
struct pipeline_engine {
  /// A parameter a later stage reads: owned by stage `owner`, mirrored on stage `mirror`.
  struct mirror_t {
    std::size_t param, owner, mirror;
  };
  std::size_t stages = 1;
  std::size_t microbatches = 0;                              ///< the policy's micro-batches per step (0: one per stage)
  pipeline_kind schedule = pipeline_kind::one_f_one_b;       ///< the policy's order of forwards and backwards
  std::vector<std::pair<std::size_t, std::size_t>> bounds;  ///< per stage, its layers [begin, end)
  std::vector<std::size_t> stage_of_param;                  ///< per parameter, its stage
  std::vector<std::size_t> full_count;                      ///< per parameter and device (param * devices + dev)
  std::vector<mirror_t> mirrors;
  std::size_t devices = 0;
  // Per device: the boundary activations' extents of the last probe (per layer index, as a flat
  // list of `rank` extents per boundary: [I * 8, I * 8 + rank)), the rows they were probed with,
  // and the buffers.
  std::vector<std::vector<std::size_t>> extents;
  std::vector<std::size_t> probed_rows;
  device_buffers<float> inputs, dys, dlogits, send, scratch, stash;
  /// The blocks of the parameters a device's stage holds (moved out of the layers' own storage,
  /// which goes), and one zero block that the other stages' parameters point to on that device.
  std::vector<meshlib::block_view<float, 1, default_memory_space>> owned;
  std::vector<double> busy;  ///< per device: seconds of the last step's rounds spent computing
  std::vector<double> span;  ///< per device: seconds of the last step's rounds, first to last
  std::vector<pipeline_stage_times> times;  ///< per device: the last step's compute, by kind

  /// `full_count` of parameter `i` on `dev`.
  [[nodiscard]] std::size_t block_elements(std::size_t i, std::size_t dev) const { return full_count[i * devices + dev]; }
};

/// The policy `opts` at work: cuts `model` into its stages on `mesh`'s pipeline axis (`PipeMask`)
/// and restricts every parameter in `params` to its stage's devices.
/// (`Policy` is `pipeline<A>`, a type rather than a deduced `fixed_string A`: nvcc 13's front end
/// deduces no class-type template argument from a specialisation.)
template <axis_mask PipeMask, class Mesh, class Model, class T, class Policy>
  requires(Policy::kind == parallelism::pipelined)
std::shared_ptr<pipeline_engine> make_pipeline_engine(const Mesh& mesh, Model& model, std::vector<param_ref<T>>& params,
                                                      const Policy& opts) {
  auto e = std::make_shared<pipeline_engine>();
  e->stages = mesh.axes_size(PipeMask);
  e->microbatches = opts.microbatches;
  e->schedule = opts.schedule;
  e->devices = mesh.size();
  const std::vector<std::size_t> counts = model.template params_per_layer<T>();
  std::vector<std::size_t> elements(counts.size(), 0);
  std::vector<std::size_t> layer_of;  // per parameter
  for (std::size_t l = 0, i = 0; l < counts.size(); ++l)
    for (std::size_t k = 0; k < counts[l]; ++k, ++i) {
      std::size_t n = 1;
      for (auto d : params.at(i).shape) n *= d;
      elements[l] += n;
      layer_of.push_back(l);
    }
  e->bounds = pipeline_stages(elements, e->stages, opts.split_points);
  const auto stage_of_layer = [&](std::size_t l) {
    std::size_t s = 0;
    while (l >= e->bounds[s].second) ++s;
    return s;
  };
  for (std::size_t i = 0; i < params.size(); ++i) e->stage_of_param.push_back(stage_of_layer(layer_of[i]));
  // Tied parameters: a layer that reads another stage's parameter mirrors it.
  std::size_t l = 0;
  std::apply(
      [&](auto&... layer) {
        (
            [&] {
              std::vector<param_ref<T>> tied;
              collect_tied_of(layer, tied);
              for (const auto& t : tied)
                for (std::size_t i = 0; i < params.size(); ++i)
                  if (params[i].name == t.name && e->stage_of_param[i] != stage_of_layer(l))
                    e->mirrors.push_back({i, e->stage_of_param[i], stage_of_layer(l)});
              ++l;
            }(),
            ...);
      },
      model.layers);
  e->full_count.resize(params.size() * e->devices);
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    std::vector<bool> holds(e->devices);
    for (std::size_t dev = 0; dev < e->devices; ++dev) {
      holds[dev] = mesh.group_rank(dev, PipeMask) == e->stage_of_param[i];
      e->full_count[i * e->devices + dev] = p.count[dev];
    }
    p.layout = std::make_shared<stage_param_layout>(p.layout, std::move(holds));
    p.count = {p.layout};
    p.offset = {p.layout, false};
    p.extent = {p.layout, true};
    p.sharded_axes |= PipeMask;  // a block lives on one stage: clipping and checkpoints count it once
  }
  e->extents.resize(e->devices);
  e->probed_rows.assign(e->devices, 0);
  e->busy.assign(e->devices, 0.0);
  e->span.assign(e->devices, 0.0);
  e->times.assign(e->devices, {});
  e->inputs = device_buffers<float>(e->devices);
  e->dys = device_buffers<float>(e->devices);
  e->dlogits = device_buffers<float>(e->devices);
  e->send = device_buffers<float>(e->devices);
  e->scratch = device_buffers<float>(e->devices);
  e->stash = device_buffers<float>(e->devices);
  return e;
}

}  // namespace detail
}  // namespace meshlib::nn

namespace meshlib::nn {

/// @brief The bubble of `state`'s last pipelined `train_step`, measured: the fraction of the
/// devices' time in the step's rounds (from the first round's start to the last round's end,
/// the longest device's) that they spent not computing (waiting for a neighbour, exchanging,
/// idle in a round). 0 without a pipeline. Compare with `pipeline_plan::bubble_fraction` and
/// (p - 1) / (m + p - 1) (docs/benchmarks.md has a table; devices must have a core each for the
/// times to mean anything).
template <class State>
double measured_bubble(const State& state) {
  const auto* e = state.pipeline();
  if (e == nullptr) return 0.0;
  double busy = 0, span = 0;
  for (std::size_t dev : state.local_devices()) {
    busy += e->busy[dev];
    span = std::max(span, e->span[dev]);
  }
  return span <= 0 ? 0.0 : 1.0 - busy / (span * static_cast<double>(state.local_devices().size()));
}

/// @brief Device `dev`'s compute in `state`'s last pipelined `train_step`, by kind (see
/// `pipeline_stage_times`); all zero without a pipeline. `pipeline_plan::bubble_with_costs` of the
/// per-stage means is the bubble the schedule costs on that model; `measured_bubble` minus it is
/// what the exchanges and the machine add.
template <class State>
pipeline_stage_times stage_times(const State& state, std::size_t dev) {
  const auto* e = state.pipeline();
  return e == nullptr ? pipeline_stage_times{} : e->times.at(dev);
}

}  // namespace meshlib::nn

namespace meshlib::nn::detail {

/// Releases the layers' storage of the parameters a device's stage does not hold: on every local
/// device, each parameter's value and gradient move to blocks of `e.owned` where its stage holds
/// it, and point to one shared zero block elsewhere (only the probe's forward, which looks at
/// shapes, reads them there; nothing writes them). `params[i].value[dev]` becomes nullptr where the
/// stage does not hold it. Mirrored parameters keep their storage: the mirror reads it, through the
/// tied layer's own handle. Not under FSDP, whose buffers already hold every layer's gathered blocks.
template <class T>
void release_other_stages(pipeline_engine& e, std::vector<param_ref<T>>& params, std::span<const std::size_t> local) {
  std::vector<char> keep(params.size(), 0);
  for (const auto& t : e.mirrors) keep[t.param] = 1;
  std::size_t most = 1;
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::size_t dev : local) most = std::max(most, e.block_elements(i, dev));
  e.owned.push_back(meshlib::allocate<float, 1, default_memory_space>({most}, "meshlib::nn::pipeline_released"));
  float* zero = e.owned.back().data();
  std::vector<float*> vs(e.devices, nullptr), gs(e.devices, nullptr);
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (keep[i] || !p.rebind) continue;
    for (std::size_t dev : local) {
      const std::size_t n = p.count[dev];
      if (n == 0) {
        vs[dev] = gs[dev] = zero;
        continue;
      }
      e.owned.push_back(meshlib::allocate<float, 1, default_memory_space>({2 * n}, "meshlib::nn::pipeline_stage"));
      vs[dev] = e.owned.back().data();
      gs[dev] = vs[dev] + n;
      convert_copy<default_memory_space>(vs[dev], p.value[dev], n);
    }
    Kokkos::fence();  // the copies are done before the layer's own storage goes
    p.rebind(vs, gs);
    for (std::size_t dev : local) {
      const std::size_t n = p.count[dev];
      p.value.set(dev, n == 0 ? nullptr : vs[dev], n);
      p.grad.set(dev, n == 0 ? nullptr : gs[dev], n);
    }
  }
}

/// The policy `p` at work in a `train_state` under construction (its `params` collected, nothing
/// sized yet): cuts the model (`make_pipeline_engine`), refusing a tied parameter under FSDP
/// (`sharded`: a `fully_shard` policy is given too). (The policy compiles only for a `sequential`
/// model: `check_policies`.)
/// @throws sharding_error naming the parameter and the fix.
template <axis_mask PipeMask, class State, class Policy>
  requires(Policy::kind == parallelism::pipelined)
std::shared_ptr<pipeline_engine> make_pipeline_state(State& s, const Policy& p, bool sharded) {
  if constexpr (!requires(typename State::model_type& net) {
                  net.layers;
                  net.template params_per_layer<float>();
                }) {
    return nullptr;  // not reached: check_policies refuses a pipeline of a model that is not a sequential
  } else {
    auto e = make_pipeline_engine<PipeMask>(s.mesh, s.model, s.params, p);
    if (!sharded) release_other_stages(*e, s.params, s.local_devices());
    if (sharded && !e->mirrors.empty())
      throw sharding_error("meshlib::nn: train_state: pipeline<\"" + std::string(text_of(Policy::axis)) + "\"> over " +
                           std::to_string(s.mesh.axes_size(PipeMask)) + " devices with fully_shard, and parameter '" +
                           s.params[e->mirrors.front().param].name + "' is read by a layer of stage " +
                           std::to_string(e->mirrors.front().mirror) +
                           " too (a tied head): FSDP does not shard a tied parameter; untie the head (a column_dense "
                           "head) or use the fsdp axis as a data axis (data_parallel<\"fsdp\"> instead of fully_shard)");
    return e;
  }
}

}  // namespace meshlib::nn::detail
