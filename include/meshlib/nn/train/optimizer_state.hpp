// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `optimizer_state`: where a `train_state`'s optimizer slots live, in one of two layouts.
/// Replicated (and under FSDP, whose parameters are already the shards): slot `s` of parameter `i`
/// is a float tensor with the parameter's own shape and sharding, the same blocks as its value and
/// gradient. ZeRO-1 (`data_parallel{.zero = 1}`): each device holds `(slots, ceil(n / dp))`, its
/// slice of its flat gradient vector over the data axes (`zero_state_type`). The update rule
/// (nn/optimizer.hpp) does not know which; checkpoints read both through `for_each_run`. Beside the
/// slots, a transform may keep state per parameter (`param_state_size`: Adafactor's factored second
/// moment): a flat array on every device that holds a block of the parameter, alike on all of them.
/// @code
/// // inside data_parallel_impl (nn/parallel/data_parallel.hpp), which owns it:
/// // state_ = optimizer_state<Mesh, DataAxes>(mesh, params, opt.slots(), zero, local);
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief A train state's optimizer slots (see the file comment) over the mesh `Mesh`, ZeRO-1
/// sharded over `DataAxes` when asked.
template <mesh_type Mesh, axis_mask DataAxes>
class optimizer_state {
 public:
  /// A device's ZeRO-1 optimizer state: shape `(slots, ceil(n / dp))`, row `s` slot `s` of this
  /// device's slice of its flat gradient vector (`n` elements: its parameters' blocks in order;
  /// `dp` devices over the data axes). Its type says what it is: dimension 1 is a block over the
  /// data axes, and the value varies over every axis (the flat vector itself differs over the
  /// axes parameters are sharded over). It is a local tensor, not a `sharded_tensor` with a global
  /// shape: the flat vectors of devices that differ over a model axis may have different lengths
  /// (uneven shardings), so no one global array is split into these slices (docs/design.md).
  using zero_state_type =
      local_tensor<float, 2, Mesh, Mesh::all_axes, 0, dim_masks<axis_mask{0}, DataAxes>, default_memory_space>;

  /// No state.
  optimizer_state() = default;
  /// @brief Zeroed slots for `params` on this process's devices `local`: `slots` per element,
  /// ZeRO-1 sharded over `DataAxes` when `zero`. Every tensor is made here, on the calling thread:
  /// device threads only read and write blocks through unmanaged views (tensor/view.hpp).
  /// `per_param[i]`: the floats of per-parameter state of parameter `i` (none when empty).
  optimizer_state(const Mesh& mesh, std::span<const param_ref<float>> params, std::size_t slots, bool zero,
                  std::span<const std::size_t> local, std::span<const std::size_t> per_param = {})
      : slots_(slots), zero_(zero), devices_(mesh.size()) {
    param_state_size_.assign(params.size(), 0);
    std::copy_n(per_param.begin(), std::min(per_param.size(), params.size()), param_state_size_.begin());
    param_state_.resize(params.size() * devices_);
    for (std::size_t i = 0; i < params.size(); ++i)
      if (param_state_size_[i] != 0)
        for (std::size_t dev : local)
          if (params[i].count[dev] != 0)
            param_state_[i * devices_ + dev] =
                ::meshlib::allocate<float, 1>({param_state_size_[i]}, "meshlib::nn::optimizer_state");
    if (zero) {
      const std::size_t dp = mesh.axes_size(DataAxes);
      zero_state_.reserve(mesh.size());
      for (std::size_t dev = 0; dev < mesh.size(); ++dev)
        if (std::find(local.begin(), local.end(), dev) == local.end()) {
          zero_state_.emplace_back(typename zero_state_type::view_type(), mesh, dev);
        } else {
          const std::size_t n = flat_size(params, dev);
          zero_state_.emplace_back(typename zero_state_type::shape_type{slots, (n + dp - 1) / dp}, mesh, dev);
        }
    } else {
      for (const auto& p : params)
        for (std::size_t s = 0; s < slots; ++s) state_.push_back(p.layout->zeros_like(local));
    }
  }

  /// Whether the slots are ZeRO-1 sharded over the data axes.
  [[nodiscard]] bool sharded() const noexcept { return zero_; }
  /// Elements of state device `dev` holds (a device of this process) for `params`.
  [[nodiscard]] std::size_t size(std::span<const param_ref<float>> params, std::size_t dev) const {
    std::size_t per_param = 0;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (param_state(i, dev) != nullptr) per_param += param_state_size_[i];
    return (zero_ ? zero_state_.at(dev).size() : slots_ * flat_size(params, dev)) + per_param;
  }
  /// Parameter `i`'s per-parameter state on device `dev`: `param_state_size(i)` floats, null where
  /// it has none or the device holds no block of the parameter.
  [[nodiscard]] float* param_state(std::size_t i, std::size_t dev) const {
    return param_state_.empty() ? nullptr : param_state_.at(i * devices_ + dev).data();
  }
  /// The floats of parameter `i`'s per-parameter state (0: none).
  [[nodiscard]] std::size_t param_state_size(std::size_t i) const {
    return i < param_state_size_.size() ? param_state_size_[i] : 0;
  }
  /// Slot `s` of parameter `i`'s block on device `dev` (replicated layout).
  [[nodiscard]] float* slot(std::size_t i, std::size_t s, std::size_t dev) const {
    return state_[i * slots_ + s].blocks[dev];
  }
  /// Device `dev`'s ZeRO-1 state (sharded layout).
  [[nodiscard]] const zero_state_type& zero_state(std::size_t dev) const { return zero_state_.at(dev); }
  /// Device `dev`'s ZeRO-1 state, to update (sharded layout).
  [[nodiscard]] zero_state_type& zero_state(std::size_t dev) { return zero_state_.at(dev); }

  /// Calls `f(param_index, offset_in_block, len, slot)` for each run of state device `dev` holds, in
  /// parameter order: elements `[offset, offset + len)` of the parameter's local block, whose slot
  /// `s` starts at `slot[s]` (a `std::span<float* const>` of the slots). Replicated: whole blocks;
  /// ZeRO-1: the pieces of this device's slice of the flat vector.
  template <class F>
  void for_each_run(const Mesh& mesh, std::span<const param_ref<float>> params, std::size_t dev, F&& f) {
    std::vector<float*> slot(slots_);  // a chain has any number of slots
    const std::span<float* const> slots(slot);
    if (!zero_) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        for (std::size_t s = 0; s < slots_; ++s) slot[s] = this->slot(i, s, dev);
        f(i, std::size_t{0}, params[i].count[dev], slots);
      }
      return;
    }
    const std::size_t size = zero_state_.at(dev).extent(1), begin = mesh.group_rank(dev, DataAxes) * size;
    std::size_t off = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) {
        for (std::size_t s = 0; s < slots_; ++s) slot[s] = zero_state_[dev].data() + s * size + (lo - begin);
        f(i, lo - off, hi - lo, slots);
      }
      off += p.count[dev];
    }
  }
  /// Whether device `dev` is the one that writes parameter `p`'s state to a checkpoint (one device
  /// of each group holding the same state).
  [[nodiscard]] bool owns(const Mesh& mesh, std::size_t dev, const param_ref<float>& p) const {
    const axis_mask replicas = mesh.all_axes & ~p.sharded_axes & ~(zero_ ? DataAxes : axis_mask{0});
    return mesh.group_rank(dev, replicas) == 0;
  }

 private:
  static std::size_t flat_size(std::span<const param_ref<float>> params, std::size_t dev) {
    std::size_t n = 0;
    for (const auto& p : params) n += p.count[dev];
    return n;
  }

  std::size_t slots_ = 0;
  bool zero_ = false;
  std::size_t devices_ = 0;
  // Per parameter `i` and device `dev`: `param_state_[i * devices_ + dev]` (empty: none there).
  std::vector<std::size_t> param_state_size_;
  std::vector<block_view<float, 1>> param_state_;
  // Replicated: slot `s` of parameter `i` is `state_[i * slots + s]`. ZeRO-1: `zero_state_[dev]`.
  std::vector<detail::held_tensor<float>> state_;
  std::vector<zero_state_type> zero_state_;
};

}  // namespace meshlib::nn
