// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Pipeline schedules (issue 26): which stage runs which micro-batch's forward or backward
/// when, as an object that can be printed as a timeline and measured (bubble fraction, activations
/// in flight), before any model runs on it. GPipe runs every forward and then every backward;
/// 1F1B (PipeDream-Flush, torch.distributed.pipelining's `Schedule1F1B`) runs `stages - stage - 1`
/// warm-up forwards and then alternates one forward and one backward, so a stage holds at most
/// `stages - stage` micro-batches' activations instead of all of them, for the same bubble.
///
/// Times are whole units (a forward of one micro-batch on one stage takes `costs.forward` units, a
/// backward `costs.backward`, sending to the next stage `costs.send`). Each stage runs its steps in
/// order; a forward starts when the previous stage's forward of the same micro-batch has arrived,
/// a backward when the next stage's backward of it has; `steps(stage)` gives the start and end
/// each step got. With uniform costs and no send time, both schedules idle for the fraction
/// (p - 1) / (m + p - 1) of the run (p stages, m micro-batches): the bubble.
/// @code
/// auto s = meshlib::nn::pipeline_schedule::one_f_one_b(4, 8);
/// std::cout << s.timeline();          // one row per stage: F0 F1 ... B0 F4 B1 ...
/// s.bubble_fraction();                // 3 / 11 = 0.273
/// s.peak_in_flight(0);                // 4 (GPipe: 8)
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/core/errors.hpp"

namespace meshlib::nn {

/// @brief What one pipeline step does.
enum class pipeline_pass : std::uint8_t { forward, backward };

/// @brief One step of one stage: a pass over one micro-batch, and when it runs.
struct pipeline_step {
  pipeline_pass pass = pipeline_pass::forward;  ///< forward or backward
  std::size_t microbatch = 0;                   ///< which micro-batch
  std::size_t start = 0;                        ///< first time unit it runs in
  std::size_t end = 0;                          ///< first time unit after it
};

/// @brief Time units of one micro-batch's work on one stage (see the file comment). A backward
/// costs about twice a forward (two products per layer instead of one), the common assumption.
struct pipeline_costs {
  std::size_t forward = 1;   ///< one forward
  std::size_t backward = 2;  ///< one backward
  std::size_t send = 0;      ///< an activation or gradient from one stage to the next
};

/// @brief A schedule of `stages` x `microbatches` (see the file comment).
class pipeline_schedule {
 public:
  /// GPipe: every forward, then every backward, micro-batches in order.
  /// @throws sharding_error when `stages` or `microbatches` is 0, or a cost is 0.
  static pipeline_schedule gpipe(std::size_t stages, std::size_t microbatches, pipeline_costs costs = {}) {
    check(stages, microbatches, costs, "gpipe");
    std::vector<std::vector<pipeline_step>> order(stages);
    for (auto& o : order) {
      for (std::size_t i = 0; i < microbatches; ++i) o.push_back({pipeline_pass::forward, i});
      for (std::size_t i = 0; i < microbatches; ++i) o.push_back({pipeline_pass::backward, i});
    }
    return {"GPipe", std::move(order), costs};
  }

  /// 1F1B: `min(stages - stage - 1, microbatches)` warm-up forwards, then one forward and one
  /// backward in turn, then the remaining backwards.
  /// @throws sharding_error as `gpipe`.
  static pipeline_schedule one_f_one_b(std::size_t stages, std::size_t microbatches, pipeline_costs costs = {}) {
    check(stages, microbatches, costs, "one_f_one_b");
    std::vector<std::vector<pipeline_step>> order(stages);
    for (std::size_t s = 0; s < stages; ++s) {
      const std::size_t warmup = std::min(stages - s - 1, microbatches);
      std::size_t f = 0, b = 0;
      for (; f < warmup; ++f) order[s].push_back({pipeline_pass::forward, f});
      for (; f < microbatches; ++f, ++b) {
        order[s].push_back({pipeline_pass::forward, f});
        order[s].push_back({pipeline_pass::backward, b});
      }
      for (; b < microbatches; ++b) order[s].push_back({pipeline_pass::backward, b});
    }
    return {"1F1B", std::move(order), costs};
  }

  /// The bubble of a balanced pipeline with uniform costs and free sends: (p - 1) / (m + p - 1).
  [[nodiscard]] static constexpr double ideal_bubble(std::size_t stages, std::size_t microbatches) noexcept {
    return static_cast<double>(stages - 1) / static_cast<double>(microbatches + stages - 1);
  }

  /// "GPipe" or "1F1B".
  [[nodiscard]] std::string_view name() const noexcept { return name_; }
  /// Pipeline stages.
  [[nodiscard]] std::size_t stages() const noexcept { return steps_.size(); }
  /// Micro-batches per step.
  [[nodiscard]] std::size_t microbatches() const noexcept { return microbatches_; }
  /// The steps stage `stage` runs, in order, with their times.
  [[nodiscard]] const std::vector<pipeline_step>& steps(std::size_t stage) const { return steps_.at(stage); }
  /// Time units from the first step's start to the last step's end.
  [[nodiscard]] std::size_t makespan() const noexcept { return makespan_; }

  /// The fraction of stage-time units in which a stage is idle.
  [[nodiscard]] double bubble_fraction() const noexcept {
    std::size_t busy = 0;
    for (const auto& st : steps_)
      for (const auto& x : st) busy += x.end - x.start;
    return 1.0 - static_cast<double>(busy) / static_cast<double>(stages() * makespan_);
  }

  /// The most micro-batches whose activations stage `stage` holds at once (forwarded, not yet
  /// backwarded): what its activation memory scales with.
  [[nodiscard]] std::size_t peak_in_flight(std::size_t stage) const {
    std::size_t held = 0, peak = 0;
    for (const auto& x : steps_.at(stage)) {
      if (x.pass == pipeline_pass::forward) peak = std::max(peak, ++held);
      else --held;
    }
    return peak;
  }

  /// One row per stage, one column per time unit: `F3` while micro-batch 3's forward runs, `B3`
  /// while its backward runs, `..` when idle.
  /// @code
  /// GPipe, 2 stages x 2 micro-batches (forward 1, backward 1, send 0), bubble 33.3%
  /// stage 0 | F0 F1 .. .. B0 B1
  /// stage 1 | .. F0 F1 B0 B1 ..
  /// @endcode
  [[nodiscard]] std::string timeline() const {
    std::string out = std::string(name_) + ", " + std::to_string(stages()) + " stages x " + std::to_string(microbatches_) +
                      " micro-batches (forward " + std::to_string(costs_.forward) + ", backward " +
                      std::to_string(costs_.backward) + ", send " + std::to_string(costs_.send) + "), bubble " +
                      percent(bubble_fraction()) + "\n";
    const std::size_t width = std::to_string(microbatches_ - 1).size() + 1;
    for (std::size_t s = 0; s < stages(); ++s) {
      std::vector<std::string> cell(makespan_, std::string(width, '.'));
      for (const auto& x : steps_[s]) {
        std::string label = (x.pass == pipeline_pass::forward ? "F" : "B") + std::to_string(x.microbatch);
        label.resize(width, ' ');
        for (std::size_t t = x.start; t < x.end; ++t) cell[t] = label;
      }
      out += "stage " + std::to_string(s) + " |";
      for (const auto& c : cell) out += " " + c;
      out += "\n";
    }
    return out;
  }

 private:
  pipeline_schedule(std::string_view name, std::vector<std::vector<pipeline_step>> order, pipeline_costs costs)
      : name_(name), microbatches_(order.front().size() / 2), costs_(costs), steps_(std::move(order)) {
    simulate();
  }

  static void check(std::size_t stages, std::size_t microbatches, const pipeline_costs& c, const char* who) {
    if (stages == 0 || microbatches == 0)
      throw sharding_error(std::string("meshlib::nn::pipeline_schedule::") + who + ": " + std::to_string(stages) +
                           " stages x " + std::to_string(microbatches) +
                           " micro-batches; a pipeline needs at least one of each");
    if (c.forward == 0 || c.backward == 0)
      throw sharding_error(std::string("meshlib::nn::pipeline_schedule::") + who +
                           ": forward and backward costs must be at least 1 time unit (forward " +
                           std::to_string(c.forward) + ", backward " + std::to_string(c.backward) + ")");
  }

  static std::string percent(double f) {
    const auto tenths = static_cast<long long>(f * 1000.0 + 0.5);
    return std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + "%";
  }

  // List scheduling: each stage runs its steps in order, each as soon as the stage is free and its
  // input has arrived. The orders above never wait on a step scheduled later on the same stage, so
  // every pass over the stages schedules at least one step.
  void simulate() {
    const std::size_t p = stages(), m = microbatches_;
    constexpr std::size_t none = static_cast<std::size_t>(-1);
    std::vector<std::vector<std::size_t>> fwd_end(p, std::vector<std::size_t>(m, none)), bwd_end = fwd_end;
    std::vector<std::size_t> next(p, 0), free_at(p, 0);
    for (std::size_t left = p * 2 * m; left > 0;) {
      std::size_t progress = 0;
      for (std::size_t s = 0; s < p; ++s) {
        while (next[s] < steps_[s].size()) {
          pipeline_step& x = steps_[s][next[s]];
          const bool fwd = x.pass == pipeline_pass::forward;
          std::size_t ready = 0;
          if (fwd && s > 0) ready = fwd_end[s - 1][x.microbatch];
          if (!fwd && s + 1 < p) ready = bwd_end[s + 1][x.microbatch];
          if (!fwd && s + 1 == p) ready = fwd_end[s][x.microbatch];
          if (ready == none) break;
          const bool from_peer = (fwd && s > 0) || (!fwd && s + 1 < p);
          x.start = std::max(free_at[s], ready + (from_peer ? costs_.send : 0));
          x.end = x.start + (fwd ? costs_.forward : costs_.backward);
          free_at[s] = x.end;
          (fwd ? fwd_end : bwd_end)[s][x.microbatch] = x.end;
          ++next[s];
          ++progress;
          --left;
        }
      }
      if (progress == 0) throw sharding_error("meshlib::nn::pipeline_schedule: the step orders deadlock");  // a bug
    }
    makespan_ = *std::max_element(free_at.begin(), free_at.end());
  }

  std::string_view name_;
  std::size_t microbatches_ = 0;
  pipeline_costs costs_;
  std::vector<std::vector<pipeline_step>> steps_;
  std::size_t makespan_ = 0;
};

}  // namespace meshlib::nn
