// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::mesh_param_blocks`: the train state's `param_blocks` (nn/optim/transform.hpp),
/// where a device's block of a parameter lies and the sum over the devices holding its other pieces,
/// for the transforms whose statistics are over a whole parameter (Adafactor's). A parameter's
/// blocks differ over its sharded axes, a run-time mask: its tensor-parallel axes and, under
/// `fully_shard`, the fsdp axis (a shard is a block of the parameter cut along dimension 0); under
/// ZeRO-1 the devices of the data axes also each update a run of the same block (their slices of
/// the flat vector may cut it anywhere), so the sum is over those axes too (`cut`). The sum is the
/// public donated `psum` over those axes, whose axes are compile-time: the mask is matched against
/// each subset of the axes parameters may be sharded over, with or without the cut axes, so only
/// those are instantiated.
/// @code
/// // inside optimizer_step::run, for parameter i on device dev (except: ZeRO-1's data axes, or 0):
/// // detail::mesh_param_blocks<Mesh, model_axes, data_axes> b(mesh, dev, params[i], except);  run.blocks = &b;
/// @endcode

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn::detail {

/// Sums the `n` values at `x` (in memory `Space`) over the axes `Axes`, in place (the donated psum).
template <axis_mask Axes, class Space, class Mesh, class V>
void sum_in_place(const Mesh& mesh, std::size_t dev, V* x, std::size_t n) {
  using vec_t = local_tensor<V, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, Space>;
  (void)psum_over<Axes>(wrap1<vec_t>(x, n, mesh, dev));
}

/// `sum_in_place<m>` for the run-time mask `m`: a non-empty subset of `Candidates`, or such a
/// subset (or none) with all of `Cut`.
template <axis_mask Candidates, axis_mask Cut, class Space, class Mesh, class V, std::size_t... M>
void sum_in_place_over(axis_mask m, const Mesh& mesh, std::size_t dev, V* x, std::size_t n,
                       std::index_sequence<M...>) {
  const auto one = [&]<axis_mask A>() {
    constexpr bool candidates_only = (A & ~Candidates) == 0;
    constexpr bool with_cut = Cut != 0 && (A & Cut) == Cut && (A & ~Cut & ~Candidates) == 0;
    if constexpr (A != 0 && (candidates_only || with_cut))
      if (m == A) sum_in_place<A, Space>(mesh, dev, x, n);
  };
  (one.template operator()<static_cast<axis_mask>(M)>(), ...);
}

/// See the file comment. `Candidates`: the axes a parameter may be sharded over (the model axes,
/// and the fsdp axis); `Cut`: the axes ZeRO-1 cuts a block's runs over (the data axes).
template <mesh_type Mesh, axis_mask Candidates, axis_mask Cut = 0>
class mesh_param_blocks final : public param_blocks {
 public:
  /// Device `dev`'s block of `p` (of element type `T`: the layout is all that is read); `cut`: the
  /// axes over which devices holding this same block each update a run of it (ZeRO-1: `Cut`;
  /// else 0).
  template <class T>
  mesh_param_blocks(const Mesh& mesh, std::size_t dev, const param_ref<T>& p, axis_mask cut = 0)
      : mesh_(&mesh), dev_(dev), axes_((p.sharded_axes & Candidates) | (cut & Cut)), offset_(p.layout->offset(dev)),
        extent_(p.layout->extent(dev)) {
    std::size_t block = 1, total = 1;
    for (std::size_t d = 0; d < p.shape.size(); ++d) {
      block *= extent_[d];
      total *= p.shape[d];
    }
    split_ = block != total || mesh.axes_size(cut & Cut) > 1;
  }
  /// See `param_blocks`.
  [[nodiscard]] std::span<const std::size_t> offset() const override { return offset_; }
  /// See `param_blocks`.
  [[nodiscard]] std::span<const std::size_t> extent() const override { return extent_; }
  /// See `param_blocks`.
  [[nodiscard]] bool split() const override { return split_; }
  /// See `param_blocks`: `x` in the running device's memory.
  void sum(std::span<float> x) const override {
    if (split_)
      sum_in_place_over<Candidates, Cut, default_memory_space>(axes_, *mesh_, dev_, x.data(), x.size(), masks());
  }
  /// See `param_blocks`: `x` in the running device's memory.
  void sum(std::span<double> x) const override {
    if (split_)
      sum_in_place_over<Candidates, Cut, default_memory_space>(axes_, *mesh_, dev_, x.data(), x.size(), masks());
  }

 private:
  static constexpr auto masks() {
    return std::make_index_sequence<static_cast<std::size_t>(Candidates | Cut) + 1>{};
  }

  const Mesh* mesh_;
  std::size_t dev_;
  axis_mask axes_;
  std::span<const std::size_t> offset_, extent_;
  bool split_ = false;
};

}  // namespace meshlib::nn::detail
