// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::optimizer_step`: what one device does with its synchronised gradients, whatever
/// the parallelism: the global gradient norm (each device sums its share of every parameter, one
/// multi-tensor reduction, then one all-reduce over the mesh) and the optimizer's chain, stage after
/// stage, the last stage updating and applying every run at once (one multi-tensor kernel). The
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
/// `ModelAxes` (tensor parallelism: what an optimizer reading whole parameters learns of a block).
template <class Mesh, axis_mask ModelAxes>
class optimizer_step {
 public:
  using T = float;
  /// Where a device's block of a parameter lies (nn/train/param_blocks.hpp).
  using blocks_type = mesh_param_blocks<Mesh, ModelAxes>;

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
        update_tables_(devices) {}

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
  /// takes them for a later stage's norm.
  template <class Master, class ParamState, class ForRuns>
  void run(const Mesh& mesh, const optimizer& opt, const std::vector<param_ref<T>>& params, std::size_t step,
           const Master& master, const ParamState& param_state, std::size_t dev, double norm, axis_mask except,
           ForRuns&& for_runs) {
    for (std::size_t k = 0; k < opt.stages(); ++k) {
      double stage_norm = norm;
      if (k > 0 && opt.reads_global_norm(k)) {  // the updates' norm after the stages before
        std::vector<float_run>& runs = norm_runs(dev);
        for_runs([&](std::size_t i, std::size_t, T* u, std::size_t len, std::span<float* const>) {
          runs.push_back(share_of(mesh, dev, params[i], u, len, except));
        });
        stage_norm = global_norm(mesh, dev, runs);
      }
      if (k + 1 == opt.stages())
        return apply_last_stage(mesh, opt, params, step, master, param_state, dev, k, stage_norm, for_runs);
      for_runs([&](std::size_t i, std::size_t off, T* u, std::size_t len, std::span<float* const> slot) {
        const auto& p = params[i];
        const blocks_type blocks(mesh, dev, p);
        opt.update(update_run{u, master(i) + off, slot, len, off, step, k, stage_norm,
                              param_info{p.name, p.shape, p.decay}, param_state(i), &blocks});
      });
    }
  }

 private:
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
                        double norm, ForRuns& for_runs) {
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
      if (opt.whole_parameters()) blocks.emplace_back(mesh, dev, p);
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
};

}  // namespace meshlib::nn::detail
