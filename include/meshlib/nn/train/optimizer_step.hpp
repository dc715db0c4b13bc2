// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::optimizer_step`: what one device does with its synchronised gradients, whatever
/// the parallelism: the global gradient norm (each device sums its share of every parameter, one
/// multi-tensor reduction, then one all-reduce over the mesh) and the optimizer's chain, stage after
/// stage, the last stage updating and applying every run at once (one multi-tensor kernel). An
/// optimizer that reads whole parameters (`adafactor`) sums its statistics over the devices holding
/// a parameter's other pieces (`mesh_param_blocks`, nn/train/param_blocks.hpp): under ZeRO-1 each
/// device then gets a run of every parameter, empty where its slice holds none, so that every device
/// of the data axes calls those sums in the same order. The
/// data-parallel policy's gradient paths (nn/parallel/data_parallel.hpp) hand it their runs; the
/// train state holds one, with the per-device buffers that keep a step free of allocations after
/// its first.

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/train/param_blocks.hpp"
#include "meshlib/nn/train/step_metrics.hpp"
#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn::detail {

/// The optimizer's step on each device of a `Mesh` whose parameters may be sharded over
/// `ShardAxes` (tensor parallelism, FSDP: what an optimizer reading whole parameters learns of a
/// block) and whose runs ZeRO-1 may cut over `CutAxes` (the data axes).
template <class Mesh, axis_mask ShardAxes, axis_mask CutAxes = 0>
class optimizer_step {
 public:
  using T = float;
  /// Where a device's block of a parameter lies (nn/train/param_blocks.hpp).
  using blocks_type = mesh_param_blocks<Mesh, ShardAxes, CutAxes>;

  explicit optimizer_step(std::size_t devices)
      : squares_(devices),
        norm_runs_(devices),
        norm_words_(devices),
        norm_tables_(devices),
        batch_runs_(devices),
        batch_slots_(devices),
        batch_params_(devices),
        batch_blocks_(devices),
        update_words_(devices),
        update_tables_(devices),
        no_slots_(devices) {}

  /// This device's share of the `len` elements at `g` in a global norm, a (piece of a) block of
  /// `p` that every device of the group of axes `p` is replicated over (less `except`) holds alike:
  /// the group splits it evenly, so each element counts once over the mesh and no device sums alone.
  [[nodiscard]] float_run share_of(const Mesh& mesh, std::size_t dev, const param_ref<T>& p, const T* g,
                                   std::size_t len, axis_mask except) const {
    const axis_mask copies = mesh.all_axes & ~p.sharded_axes & ~except;
    const std::size_t r = mesh.axes_size(copies), q = mesh.group_rank(dev, copies);
    const std::size_t lo = len * q / r, hi = len * (q + 1) / r;
    return {g + lo, hi - lo};
  }
  /// Device `dev`'s list of runs for the next `global_norm`, emptied (its capacity kept: a step
  /// allocates nothing after its first).
  [[nodiscard]] std::vector<float_run>& norm_runs(std::size_t dev) const {
    auto& runs = norm_runs_.at(dev);
    runs.clear();
    return runs;
  }
  /// The global norm whose square device `dev`'s `runs` are its share of (summed over every device).
  [[nodiscard]] double global_norm(const Mesh& mesh, std::size_t dev, const std::vector<float_run>& runs) const {
    double sq[1] = {sum_of_squares(dev, runs)};
    sum_over<Mesh::all_axes>(mesh, dev, sq);
    return std::sqrt(sq[0]);
  }

  /// Runs `opt`'s chain over device `dev`'s runs of updates, stage after stage, and applies them
  /// (`param += update`) with the last. `for_runs(f)` calls `f(param index, offset in its block,
  /// updates, length, state slots)` for every run (the gradient, transformed in place);
  /// `master(i)` is parameter `i`'s float master block on `dev`, `param_state(i)` its
  /// per-parameter optimizer state there (or null); `norm`: the gradient's global norm; `except`:
  /// the axes over which a run's copies are not all alike (ZeRO-1's data axes), as `share_of`
  /// takes them for a later stage's norm, and over which the runs of one block are cut.
  template <class Master, class ParamState, class ForRuns>
  void run(const Mesh& mesh, const optimizer& opt, const std::vector<param_ref<T>>& params, std::size_t step,
           const Master& master, const ParamState& param_state, std::size_t dev, double norm, axis_mask except,
           ForRuns&& given) {
    // An optimizer that reads whole parameters: on runs ZeRO-1 cuts, a run of every parameter; none
    // of a parameter held by no device it would sum with (`held_by_none`).
    const auto for_runs = [&](auto&& f) {
      if (!opt.whole_parameters()) return given(f);
      const auto held = [&](std::size_t i, std::size_t off, T* u, std::size_t len, std::span<float* const> slot) {
        if (!held_by_none(params[i], dev)) f(i, off, u, len, slot);
      };
      if (except != 0) return for_every_param(opt, params.size(), dev, given, held);
      given(held);
    };
    for (std::size_t k = 0; k < opt.stages(); ++k) {
      double stage_norm = norm;
      if (k > 0 && opt.reads_global_norm(k)) {  // the updates' norm after the stages before
        std::vector<float_run>& runs = norm_runs(dev);
        given([&](std::size_t i, std::size_t, T* u, std::size_t len, std::span<float* const>) {
          runs.push_back(share_of(mesh, dev, params[i], u, len, except));
        });
        stage_norm = global_norm(mesh, dev, runs);
      }
      if (k + 1 == opt.stages())
        return apply_last_stage(mesh, opt, params, step, master, param_state, dev, k, stage_norm, except, for_runs);
      for_runs([&](std::size_t i, std::size_t off, T* u, std::size_t len, std::span<float* const> slot) {
        const auto& p = params[i];
        const blocks_type blocks(mesh, dev, p, except);
        opt.update(update_run{u, master(i) + off, slot, len, off, step, k, stage_norm,
                              param_info{p.name, p.shape, p.decay}, param_state(i), &blocks});
      });
    }
  }

 private:
  /// Whether device `dev` holds no block of `p`, nor does any device it would sum `p`'s statistics
  /// with: `p` is split over an axis that is not summed over (a pipeline's: only its stage's
  /// devices hold it), and the devices of a sum differ over summed axes only, so they all hold it or
  /// none do. (A device with an empty block of a parameter split over summed axes still sums.)
  [[nodiscard]] static bool held_by_none(const param_ref<T>& p, std::size_t dev) {
    return p.count[dev] == 0 && (p.sharded_axes & ~(ShardAxes | CutAxes)) != 0;
  }
  /// `for_runs(f)`, and `f(i, 0, nullptr, 0, no slots)` for each parameter `i` of `n` that it gives
  /// no run of, in parameter order (`for_runs` gives at most one run per parameter, in order, as
  /// ZeRO-1's slice of the flat vector holds them).
  template <class ForRuns, class F>
  void for_every_param(const optimizer& opt, std::size_t n, std::size_t dev, ForRuns& for_runs, F& f) const {
    std::vector<float*>& none = no_slots_.at(dev);
    none.assign(opt.slots(), nullptr);
    const std::span<float* const> no_slots(none);
    std::size_t next = 0;
    for_runs([&](std::size_t i, std::size_t off, T* u, std::size_t len, std::span<float* const> slot) {
      for (; next < i; ++next) f(next, std::size_t{0}, static_cast<T*>(nullptr), std::size_t{0}, no_slots);
      f(i, off, u, len, slot);
      next = i + 1;
    });
    for (; next < n; ++next) f(next, std::size_t{0}, static_cast<T*>(nullptr), std::size_t{0}, no_slots);
  }
  /// The sum of squares of device `dev`'s `runs` (shares of a global norm, in parameter order): one
  /// multi-tensor reduction, two kernels and one read-back whatever the number of runs (issue 38).
  double sum_of_squares(std::size_t dev, const std::vector<float_run>& runs) const {
    std::vector<std::size_t>& words = norm_words_.at(dev);
    const std::size_t blocks = run_table(runs, words);
    return detail::sum_of_squares<default_memory_space>(norm_tables_.upload(dev, words), words.size() / run_words,
                                                        blocks, squares_.get(dev, blocks + 1));
  }
  /// The last stage `k` of `run`: every run of device `dev` handed to the optimizer at once, which
  /// updates and applies them in one multi-tensor kernel for a chain of built-in transforms
  /// (issue 38: one launch per device, not one per parameter).
  template <class Master, class ParamState, class ForRuns>
  void apply_last_stage(const Mesh& mesh, const optimizer& opt, const std::vector<param_ref<T>>& params, std::size_t step,
                        const Master& master, const ParamState& param_state, std::size_t dev, std::size_t k,
                        double norm, axis_mask except, const ForRuns& for_runs) {
    auto& runs = batch_runs_.at(dev);
    auto& slots = batch_slots_.at(dev);
    auto& out = batch_params_.at(dev);
    auto& blocks = batch_blocks_.at(dev);
    runs.clear();
    slots.clear();
    out.clear();
    blocks.clear();
    const std::size_t n_slots = opt.slots();
    for_runs([&](std::size_t i, std::size_t off, T* u, std::size_t len, std::span<float* const> slot) {
      const auto& p = params[i];
      runs.push_back(update_run{u, master(i) + off, {}, len, off, step, k, norm, param_info{p.name, p.shape, p.decay},
                                param_state(i)});
      if (opt.whole_parameters()) blocks.emplace_back(mesh, dev, p, except);
      slots.insert(slots.end(), slot.begin(), slot.end());  // (the caller reuses `slot` for the next run)
      out.push_back(master(i) + off);
    });
    for (std::size_t r = 0; r < runs.size(); ++r) {
      runs[r].state = std::span<float* const>(slots.data() + r * n_slots, n_slots);
      if (!blocks.empty()) runs[r].blocks = &blocks[r];  // (after the last push_back: no reallocation moves them)
    }
    opt.update_and_apply_all(update_batch{runs, out, &update_tables_, &update_words_.at(dev), dev});
  }

  // The clipping norm's partial sums (a const query writes them: each device only its own slot).
  mutable device_buffers<double> squares_;
  /// The gradient norm's runs, their table on the host and in the kernels' memory, per device.
  mutable std::vector<std::vector<float_run>> norm_runs_;
  mutable std::vector<std::vector<std::size_t>> norm_words_;
  mutable run_table_buffers norm_tables_;
  /// The optimizer's last stage per device: its runs, their state slots and parameters, and the
  /// multi-tensor kernel's table on the host and in the kernels' memory.
  std::vector<std::vector<update_run>> batch_runs_;
  std::vector<std::vector<float*>> batch_slots_;
  std::vector<std::vector<float*>> batch_params_;
  /// Where each run's block lies (optimizers that read whole parameters only).
  std::vector<std::vector<blocks_type>> batch_blocks_;
  std::vector<std::vector<std::size_t>> update_words_;
  run_table_buffers update_tables_;
  /// The state slots of an empty run (`for_every_param`), per device.
  mutable std::vector<std::vector<float*>> no_slots_;
};

}  // namespace meshlib::nn::detail
