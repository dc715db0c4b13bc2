// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `chain(t1, t2, ...)` (optax's `chain`): the transforms one after the other, each taking
/// the updates the one before returned; its state is theirs side by side (`slots()` the sum). A
/// transform that reads the global norm starts a new stage, so that the norm it reads is the one
/// of the updates entering it, after every element went through the transforms before it.
/// @code
/// namespace nn = meshlib::nn;
/// auto opt = nn::chain(nn::clip_by_global_norm(1.0f), nn::scale_by_adam(), nn::add_decayed_weights(1e-4f),
///                      nn::scale_by_learning_rate(nn::warmup_cosine(1e-3f, 100, 2000)));
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/transform.hpp"

namespace meshlib::nn {

/// @brief The transform `chain` returns (see the file comment).
template <gradient_transform... Ts>
class chain_transform {
 public:
  /// The transforms, in the order they run.
  explicit chain_transform(Ts... ts) : ts_(std::move(ts)...) {
    std::size_t i = 0, off = 0;
    for_each([&](const auto& t) {
      offset_[i] = off;
      off += t.slots();
      for (std::size_t s = 0; s < detail::stages_of(t); ++s) {
        if (stages_.empty() || (detail::reads_global_norm_of(t, s) && !stages_.back().empty())) stages_.emplace_back();
        stages_.back().push_back({i, s});
      }
      ++i;
    });
    offset_[sizeof...(Ts)] = off;
    if (stages_.empty()) stages_.emplace_back();
  }

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return offset_[sizeof...(Ts)]; }
  /// How many stages `update` runs in (the train state runs each over every run before the next).
  [[nodiscard]] std::size_t stages() const noexcept { return stages_.size(); }
  /// Whether stage `k` starts with a transform that reads the global norm of its updates.
  [[nodiscard]] bool reads_global_norm(std::size_t k) const {
    if (stages_[k].empty()) return false;
    bool reads = false;
    const std::size_t first = stages_[k].front().first, stage = stages_[k].front().second;
    visit(first, [&](const auto& t) { reads = detail::reads_global_norm_of(t, stage); });
    return reads;
  }
  /// Floats of per-parameter state for `p`: the transforms' side by side.
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const {
    std::size_t n = 0;
    for_each([&](const auto& t) { n += detail::param_state_size_of(t, p); });
    return n;
  }
  /// Whether any transform reads statistics of whole parameters (`whole_parameters_of`).
  [[nodiscard]] bool whole_parameters() const {
    bool any = false;
    for_each([&](const auto& t) { any = any || detail::whole_parameters_of(t); });
    return any;
  }
  /// `chain(a, b, ...)` of the transforms' names.
  [[nodiscard]] std::string name() const { return joined(", ", [](const auto& t) { return detail::name_of(t); }); }
  /// `chain(a,b,...)` of the transforms' kinds (no spaces: checkpoints record it).
  [[nodiscard]] std::string kind() const { return joined(",", [](const auto& t) { return detail::kind_of(t); }); }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if constexpr (fusable_chain) {
      if (stages_.size() == 1) return run_fused<false>(r, nullptr);
    }
    const auto& stage = stages_[r.stage];
    for (const auto& at : stage) run_child(r, at, [](const auto& t, const update_run& sub) { t.update(sub); });
  }
  /// `update(r)`, then `params += updates`. A chain of built-in transforms in one stage (`adamw`)
  /// does both in one kernel, as the fused optimizers did; else the stage's last transform applies
  /// them if it can (a nested `adamw`), or a pass of their own does.
  void update_and_apply(const update_run& r, float* params) const {
    if constexpr (fusable_chain) {
      if (stages_.size() == 1) return run_fused<true>(r, params);
    }
    const auto& stage = stages_[r.stage];
    if (stage.empty()) return detail::apply_updates(params, r.updates, r.size);
    for (std::size_t j = 0; j + 1 < stage.size(); ++j)
      run_child(r, stage[j], [](const auto& t, const update_run& sub) { t.update(sub); });
    run_child(r, stage.back(),
              [&](const auto& t, const update_run& sub) { detail::update_and_apply_of(t, sub, params); });
  }
  /// `update_and_apply` over every run of a device's last stage (the train state's call): a chain
  /// of built-in transforms in one stage updates and applies all of them in one multi-tensor
  /// kernel, bitwise as run by run (`detail::fused_runs_kernel`); else run by run.
  void update_and_apply_all(const detail::update_batch& b) const {
    if constexpr (fusable_chain) {
      if (stages_.size() == 1) return run_fused_all(b);
    }
    for (std::size_t i = 0; i < b.runs.size(); ++i) update_and_apply(b.runs[i], b.params[i]);
  }
  /// The transforms.
  [[nodiscard]] const std::tuple<Ts...>& transforms() const noexcept { return ts_; }

 private:
  template <class F>
  void for_each(F&& f) const {
    std::apply([&](const auto&... t) { (f(t), ...); }, ts_);
  }
  /// `f(transform i)`.
  template <class F>
  void visit(std::size_t i, F&& f) const {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((I == i ? (void)f(std::get<I>(ts_)) : void()), ...);
    }(std::index_sequence_for<Ts...>{});
  }
  template <class F>
  std::string joined(const char* sep, F&& f) const {
    std::string out = "chain(";
    bool first = true;
    for_each([&](const auto& t) {
      if (!first) out += sep;
      first = false;
      out += f(t);
    });
    return out + ")";
  }

  static constexpr bool fusable_chain = sizeof...(Ts) > 0 && (detail::fusable<Ts> && ...);

  /// `f(transform, its run)` for (transform, its stage) `at`.
  template <class F>
  void run_child(const update_run& r, const std::pair<std::size_t, std::size_t>& at, F&& f) const {
    update_run sub = r;
    sub.state = r.state.subspan(offset_[at.first], offset_[at.first + 1] - offset_[at.first]);
    sub.stage = at.second;
    if (r.param_state != nullptr) {  // the per-parameter state of the transforms before this one
      std::size_t before = 0, i = 0;
      for_each([&](const auto& t) { before += i++ < at.first ? detail::param_state_size_of(t, r.param) : 0; });
      sub.param_state = r.param_state + before;
    }
    visit(at.first, [&](const auto& t) { f(t, sub); });
  }
  /// Every transform's step in one kernel (one stage of fusable transforms), adding the updates to
  /// `params` with `Apply`.
  template <bool Apply>
  void run_fused(const update_run& r, float* params) const {
    if constexpr (fusable_chain) {
      std::array<float, 1 + detail::constants_of<typename Ts::step_type...>> k{};
      std::size_t c = 1;
      for_each([&](const auto& t) {
        for (float x : t.constants(r)) k[c++] = x;
      });
      detail::run_steps<Apply, typename Ts::step_type...>(r.updates, r.params, params, r.state.data(), r.size, k);
    }
  }

  /// `run_fused<true>` over every run of `b` in one kernel: the table holds each run's pointers,
  /// first block, length, state slots and constants (`detail::fused_run_words`).
  void run_fused_all(const detail::update_batch& b) const {
    if constexpr (fusable_chain) {
      constexpr std::size_t slots = detail::slots_of<typename Ts::step_type...>;
      std::vector<std::size_t>& words = *b.words;
      words.clear();
      std::size_t blocks = 0, runs = 0;
      for (std::size_t i = 0; i < b.runs.size(); ++i) {
        const update_run& r = b.runs[i];
        if (r.size == 0) continue;  // (no run of a table is empty: `run_of_block`)
        for (const void* a : {static_cast<const void*>(r.updates), static_cast<const void*>(r.params),
                              static_cast<const void*>(b.params[i])})
          words.push_back(reinterpret_cast<std::uintptr_t>(a));
        words.push_back(blocks);
        words.push_back(r.size);
        for (std::size_t j = 0; j < slots; ++j) words.push_back(reinterpret_cast<std::uintptr_t>(r.state[j]));
        for_each([&](const auto& t) {
          for (float x : t.constants(r)) words.push_back(detail::word_of_float(x));
        });
        blocks += (r.size + detail::kernel_block - 1) / detail::kernel_block;
        ++runs;
      }
      if (runs == 0) return;
      detail::run_steps_over_runs<default_memory_space, true, typename Ts::step_type...>(
          b.tables->upload(b.dev, words), runs, blocks);
    }
  }

  std::tuple<Ts...> ts_;
  std::array<std::size_t, sizeof...(Ts) + 1> offset_{};
  // Per stage: the (transform, transform's stage) pairs it runs, in order.
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> stages_;
};

/// @brief The transforms one after the other (see the file comment). Each argument must be a
/// `gradient_transform`; one that is not is named in one error (`diagnose_gradient_transform`).
template <class... Ts>
auto chain(Ts... ts) {
  if constexpr ((gradient_transform<Ts> && ...)) {
    return chain_transform<Ts...>(std::move(ts)...);
  } else {
    (void)(detail::diagnose_gradient_transform<Ts>() && ...);
    return detail::not_a_transform{};
  }
}

}  // namespace meshlib::nn
