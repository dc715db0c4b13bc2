// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Per-parameter ("block") RMS transforms, optax's, as Adafactor uses them:
/// `clip_by_block_rms(threshold)` divides a parameter's updates by `max(1, rms(updates) /
/// threshold)`; `scale_by_param_block_rms(min_scale)` multiplies them by `max(rms(param),
/// min_scale)`, so a step moves a parameter in proportion to its own size. The RMS is over the whole
/// parameter (`whole_parameters()`): a device holding a piece of it (a tensor-parallel block, an
/// FSDP shard, a ZeRO-1 run) sums its piece's squares, and the sum is added over the devices
/// holding the others (`update_run::blocks`; see nn/optim/factored_rms.hpp).
/// @code
/// auto tx = meshlib::nn::chain(meshlib::nn::scale_by_factored_rms(), meshlib::nn::clip_by_block_rms(1.0f),
///                              meshlib::nn::scale_by_param_block_rms(), meshlib::nn::scale(-1e-2f));
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/detail/block_kernels.hpp"
#include "meshlib/nn/optim/factored_rms.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn {

namespace detail {
/// The RMS over the whole parameter of the run's values `x` (its updates or its parameter): the
/// run's sum of squares, summed over the parameter's pieces when it is one.
inline double block_rms(const update_run& r, const float* x) {
  double sq = block_sum_of_squares(x, r.size);
  if (run_is_piece(r)) {  // (the sum is over the running device's memory)
    auto d = ::meshlib::allocate<double, 1>({1}, "meshlib::nn::block_rms");
    ::meshlib::copy_from_host<default_memory_space>(d.data(), &sq, 1);
    r.blocks->sum(std::span<double>(d.data(), 1));
    ::meshlib::copy_to_host<default_memory_space>(&sq, d.data(), 1);
  }
  return std::sqrt(sq / static_cast<double>(element_count(r.param.shape)));
}
}  // namespace detail

/// @brief See the file comment.
class clip_by_block_rms {
 public:
  /// Clips each parameter's updates to RMS `threshold` (> 0).
  /// @throws std::invalid_argument when `threshold` is not positive.
  explicit clip_by_block_rms(float threshold) : threshold_(threshold) {
    if (!(threshold > 0.0f))
      throw std::invalid_argument("meshlib::nn: clip_by_block_rms: threshold is " + detail::number_text(threshold) +
                                  "; it must be positive (leave the transform out to not clip)");
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// True: the RMS is over every element of a parameter (summed over its pieces).
  [[nodiscard]] bool whole_parameters() const noexcept { return true; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "clip_by_block_rms(" + detail::number_text(threshold_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "clip_by_block_rms"; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  /// @throws std::invalid_argument when the run is not a whole parameter nor a piece with
  /// `r.blocks` split.
  void update(const update_run& r) const {
    detail::require_whole_parameter("clip_by_block_rms (adafactor)", r);
    const double rms = detail::block_rms(r, r.updates);
    const float denom = std::max(1.0f, static_cast<float>(rms) / threshold_);
    if (denom != 1.0f) ::meshlib::launch<default_memory_space>(r.size, detail::scale_by_factor{r.updates, 1.0f / denom});
  }

 private:
  float threshold_;
};

/// @brief See the file comment.
class scale_by_param_block_rms {
 public:
  /// Scales by each parameter's RMS, at least `min_scale` (optax's default 1e-3).
  explicit scale_by_param_block_rms(float min_scale = 1e-3f) : min_scale_(min_scale) {}
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// True: the RMS is over every element of a parameter (summed over its pieces).
  [[nodiscard]] bool whole_parameters() const noexcept { return true; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_param_block_rms"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_param_block_rms"; }
  /// The `gradient_transform` requirement: transforms the run's updates in place (the parameter's
  /// values before this step's update: `update_run::params`).
  /// @throws std::invalid_argument when the run is not a whole parameter nor a piece with
  /// `r.blocks` split.
  void update(const update_run& r) const {
    detail::require_whole_parameter("scale_by_param_block_rms (adafactor)", r);
    const double rms = detail::block_rms(r, r.params);
    const float f = std::max(static_cast<float>(rms), min_scale_);
    ::meshlib::launch<default_memory_space>(r.size, detail::scale_by_factor{r.updates, f});
  }

 private:
  float min_scale_;
};

}  // namespace meshlib::nn
