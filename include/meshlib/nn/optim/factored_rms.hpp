// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `scale_by_factored_rms` (optax's; Shazeer and Stern 2018, "Adafactor: Adaptive Learning
/// Rates with Sublinear Memory Cost"): the gradient divided by the root of a running mean of its
/// square, that mean factored into a row and a column statistic for a parameter whose two largest
/// dimensions are both at least `min_dim_size_to_factor`:
/// - `beta_t = 1 - (step - decay_offset + 1)^-decay_rate`, `g2 = g^2 + eps`;
/// - factored (`d0` the largest dimension, `d1` the second largest, ties to the later one, as
///   numpy's `argsort` orders them): `v_row = beta_t v_row + (1 - beta_t) mean(g2, d0)`, `v_col`
///   likewise over `d1`, `update = g / sqrt(v_row / mean(v_row, d1)) / sqrt(v_col)`;
/// - otherwise (vectors, small matrices, `factored = false`): `v = beta_t v + (1 - beta_t) g2`,
///   `update = g / sqrt(v)`.
///
/// The statistics of a parameter are a function of all its elements (`whole_parameters()`). Its
/// state is per parameter, not per element (`param_state_size`): factored, `v_row` then `v_col`,
/// `n / n0 + n / n1` floats for a parameter of `n` elements (a 1024 x 4096 matrix: 5,120 floats
/// where Adam keeps 4,194,304 per moment); unfactored, `v`, `n` floats. A parameter the optimizer
/// sees in pieces is updated piece by piece: a tensor-parallel block (`column_dense`, `row_dense`),
/// an FSDP shard (a block cut along dimension 0), or a ZeRO-1 device's run of the flat vector,
/// which may cut the parameter anywhere, mid-row included (`update_run::offset` and `size` within
/// the block). Each device sums the squares of its piece into the lines' statistics, the sums are
/// added over the devices holding the other pieces (`update_run::blocks`, an all-reduce of
/// `n / n0 + n / n1` doubles, `n` floats unfactored, over the parameter's tensor-parallel and fsdp
/// axes and ZeRO-1's data axes: every device calls it for every parameter, with an empty run where
/// its ZeRO-1 slice holds none of it), and every one of them keeps the whole statistics, alike, so
/// the update is the unsharded one: the sums are in double as the unsharded ones, and round to the
/// same floats but where their other order moves a rounding (unfactored: the same floats).
/// @code
/// auto tx = meshlib::nn::chain(meshlib::nn::scale_by_factored_rms(), meshlib::nn::clip_by_block_rms(1.0f),
///                              meshlib::nn::scale_by_learning_rate(1e-2f));
/// @endcode

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/detail/block_kernels.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn {

namespace detail {
/// The elements of a parameter of global shape `shape`.
inline std::size_t element_count(std::span<const std::size_t> shape) {
  return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, [](std::size_t a, std::size_t b) { return a * b; });
}
/// Whether run `r` is a piece of a parameter whose other pieces other devices hold (`r.blocks`
/// split: its statistics are summed over them).
inline bool run_is_piece(const update_run& r) { return r.blocks != nullptr && r.blocks->split(); }
/// The refusal of a run that is neither the whole parameter nor a piece with `r.blocks` to sum its
/// statistics over the devices holding the rest, for the transform `who`.
inline void require_whole_parameter(const char* who, const update_run& r) {
  if (run_is_piece(r)) return;
  const std::size_t total = element_count(r.param.shape);
  if (r.offset != 0 || r.size != total)
    throw std::invalid_argument(
        std::string("meshlib::nn: ") + who + ": parameter '" + std::string(r.param.name) + "' (" +
        std::to_string(total) + " elements) reached the optimizer as elements [" + std::to_string(r.offset) + ", " +
        std::to_string(r.offset + r.size) +
        ") only, with no update_run::blocks to sum its statistics over the devices holding the rest: pass the "
        "whole parameter in one run, or set update_run::blocks (the train state does, under ZeRO-1, fully_shard "
        "and tensor parallelism)");
}
/// The `block_map` of a device's block (`blocks`) of a parameter of global `shape`.
inline block_map map_of(const param_blocks& blocks, std::span<const std::size_t> shape) {
  if (shape.size() > block_map::max_rank)
    throw std::invalid_argument("meshlib::nn: a tensor-parallel parameter of rank " + std::to_string(shape.size()) +
                                " reached an optimizer that reads whole parameters (adafactor), which maps blocks of "
                                "rank up to " + std::to_string(block_map::max_rank) + "; replicate it");
  block_map m;
  m.rank = shape.size();
  std::size_t stride = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    m.extent[d] = blocks.extent()[d];
    m.offset[d] = blocks.offset()[d];
    m.stride[d] = stride;
    stride *= shape[d];
  }
  return m;
}
/// Row-major stride of dimension `d` of `shape`.
inline std::size_t stride_of(std::span<const std::size_t> shape, std::size_t d) {
  std::size_t s = 1;
  for (std::size_t k = d + 1; k < shape.size(); ++k) s *= shape[k];
  return s;
}
}  // namespace detail

/// @brief See the file comment.
class scale_by_factored_rms {
 public:
  /// optax's defaults.
  /// @throws std::invalid_argument when `min_dim_size_to_factor` is below 2 (a factored
  /// dimension of 1 has nothing to factor) or `decay_rate` is not positive.
  explicit scale_by_factored_rms(bool factored = true, float decay_rate = 0.8f, std::size_t decay_offset = 0,
                                 std::size_t min_dim_size_to_factor = 128, float eps = 1e-30f)
      : factored_(factored), decay_rate_(decay_rate), decay_offset_(decay_offset), min_dim_(min_dim_size_to_factor),
        eps_(eps) {
    if (min_dim_size_to_factor < 2)
      throw std::invalid_argument("meshlib::nn: scale_by_factored_rms: min_dim_size_to_factor is " +
                                  std::to_string(min_dim_size_to_factor) +
                                  "; it must be at least 2 (pass factored = false to factor nothing)");
    if (!(decay_rate > 0.0f))
      throw std::invalid_argument("meshlib::nn: scale_by_factored_rms: decay_rate is " +
                                  detail::number_text(decay_rate) + "; it must be positive");
  }

  /// The `gradient_transform` requirement: state floats per element: none (the state is per
  /// parameter, `param_state_size`).
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// Floats of state for parameter `p`: factored, `v_row` and `v_col` (`n / n0 + n / n1` for `n`
  /// elements, `n0` and `n1` its largest and second largest dimensions); else `v` (`n`).
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const {
    const std::size_t n = detail::element_count(p.shape);
    const auto dims = factored_dims(p.shape);
    return dims ? n / p.shape[(*dims)[1]] + n / p.shape[(*dims)[0]] : n;
  }
  /// True: the statistics are over every element of a parameter (summed over its pieces).
  [[nodiscard]] bool whole_parameters() const noexcept { return true; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_factored_rms"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_factored_rms"; }

  /// `beta_t` at `step` (0-based): `1 - (step - decay_offset + 1)^-decay_rate`, in float as optax.
  [[nodiscard]] float decay(std::size_t step) const {
    const float t = static_cast<float>(static_cast<double>(step) - static_cast<double>(decay_offset_) + 1.0);
    return 1.0f - std::pow(t, -decay_rate_);
  }
  /// optax's `_factored_dims`: `{d1, d0}`, the second largest and the largest dimension, for a
  /// parameter of `shape` that is factored; none for one that is not.
  [[nodiscard]] std::optional<std::array<std::size_t, 2>> factored_dims(std::span<const std::size_t> shape) const {
    if (!factored_ || shape.size() < 2) return std::nullopt;
    std::vector<std::size_t> order(shape.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return shape[a] < shape[b]; });
    const std::size_t d1 = order[order.size() - 2], d0 = order.back();
    if (shape[d1] < min_dim_) return std::nullopt;
    return std::array<std::size_t, 2>{d1, d0};
  }

  /// The `gradient_transform` requirement: transforms the run's updates in place, its statistics
  /// in `r.param_state`.
  /// @throws std::invalid_argument when the run is not a whole parameter nor a piece with
  /// `r.blocks` split, or has no per-parameter state.
  void update(const update_run& r) const {
    detail::require_whole_parameter("scale_by_factored_rms (adafactor)", r);
    if (r.param_state == nullptr)
      throw std::invalid_argument("meshlib::nn: scale_by_factored_rms (adafactor): the run of parameter '" +
                                  std::string(r.param.name) + "' has no per-parameter state (update_run::param_state "
                                  "is null); pass param_state_size(param) floats, zero at the start, as the train "
                                  "state does");
    if (detail::run_is_piece(r)) return update_block(r);
    const float beta = decay(r.step);
    const auto dims = factored_dims(r.param.shape);
    if (!dims) {
      ::meshlib::launch<default_memory_space>(r.size, detail::unfactored_scale{r.updates, r.param_state, beta, eps_});
      return;
    }
    const auto shape = r.param.shape;
    const std::size_t d1 = (*dims)[0], d0 = (*dims)[1];
    const std::size_t n0 = shape[d0], n1 = shape[d1];
    const std::size_t s0 = detail::stride_of(shape, d0), s1 = detail::stride_of(shape, d1);
    const std::size_t rows = r.size / n0, cols = r.size / n1, others = rows / n1;
    // d1's stride in v_row (the shape without d0): unchanged when d0 is the less significant.
    const std::size_t s1_row = d1 > d0 ? s1 : s1 / n0;
    float* v_row = r.param_state;
    float* v_col = v_row + rows;
    auto mean = ::meshlib::allocate<float, 1>({others}, "meshlib::nn::scale_by_factored_rms");
    ::meshlib::launch<default_memory_space>(rows, detail::factored_moment{r.updates, v_row, s0, n0, beta, eps_});
    ::meshlib::launch<default_memory_space>(cols, detail::factored_moment{r.updates, v_col, s1, n1, beta, eps_});
    ::meshlib::launch<default_memory_space>(others, detail::row_mean{v_row, mean.data(), s1_row, n1});
    ::meshlib::launch<default_memory_space>(
        r.size, detail::factored_scale{r.updates, v_row, v_col, mean.data(), s0, n0, s1, n1, s1_row});
  }

 private:
  bool factored_;
  float decay_rate_;
  std::size_t decay_offset_;
  std::size_t min_dim_;
  float eps_;

  // A piece of a parameter (see the file comment): elements `[r.offset, r.offset + r.size)` of a
  // device's block (the whole of a tensor-parallel block or an FSDP shard; under ZeRO-1 any run of
  // the block, empty included). Its sums, summed over the parameter's pieces, then the statistics of the whole
  // parameter, alike on every device holding a piece, and the run's update read from them.
  void update_block(const update_run& r) const {
    const float beta = decay(r.step);
    const auto shape = r.param.shape;
    const auto extent = r.blocks->extent();
    const detail::block_map map = detail::map_of(*r.blocks, shape);
    const std::size_t total = detail::element_count(shape), block = detail::element_count(extent);
    const std::size_t lo = r.offset, hi = r.offset + r.size;
    const auto dims = factored_dims(shape);
    if (!dims) {
      auto sums = ::meshlib::allocate<float, 1>({total}, "meshlib::nn::scale_by_factored_rms");
      ::meshlib::launch<default_memory_space>(r.size, detail::squares_to_global{r.updates, sums.data(), map, eps_, lo});
      r.blocks->sum(std::span<float>(sums.data(), total));
      ::meshlib::launch<default_memory_space>(total, detail::unfactored_moment{r.param_state, sums.data(), beta});
      ::meshlib::launch<default_memory_space>(r.size,
                                              detail::unfactored_scale_block{r.updates, r.param_state, map, lo});
      return;
    }
    const std::size_t d1 = (*dims)[0], d0 = (*dims)[1];
    const std::size_t n0 = shape[d0], n1 = shape[d1];
    const std::size_t s0 = detail::stride_of(shape, d0), s1 = detail::stride_of(shape, d1);
    const std::size_t rows = total / n0, cols = total / n1, others = rows / n1;
    const std::size_t s1_row = d1 > d0 ? s1 : s1 / n0;
    const std::size_t b0 = extent[d0], b1 = extent[d1];
    auto sums = ::meshlib::allocate<double, 1>({rows + cols}, "meshlib::nn::scale_by_factored_rms");
    if (r.size != 0) {  // (every line of the block: a run may hold any of them, in part)
      ::meshlib::launch<default_memory_space>(
          block / b0, detail::factored_partial_sums{r.updates, sums.data(), map, detail::stride_of(extent, d0), b0, s0,
                                                    n0, eps_, lo, hi});
      ::meshlib::launch<default_memory_space>(
          block / b1, detail::factored_partial_sums{r.updates, sums.data() + rows, map, detail::stride_of(extent, d1),
                                                    b1, s1, n1, eps_, lo, hi});
    }
    r.blocks->sum(std::span<double>(sums.data(), rows + cols));
    float* v_row = r.param_state;
    float* v_col = v_row + rows;
    ::meshlib::launch<default_memory_space>(rows, detail::moment_from_sums{v_row, sums.data(), n0, beta});
    ::meshlib::launch<default_memory_space>(cols, detail::moment_from_sums{v_col, sums.data() + rows, n1, beta});
    auto mean = ::meshlib::allocate<float, 1>({others}, "meshlib::nn::scale_by_factored_rms");
    ::meshlib::launch<default_memory_space>(others, detail::row_mean{v_row, mean.data(), s1_row, n1});
    ::meshlib::launch<default_memory_space>(
        r.size, detail::factored_scale_block{r.updates, v_row, v_col, mean.data(), map, s0, n0, s1, n1, s1_row, lo});
  }
};

}  // namespace meshlib::nn
