// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Fully sharded data parallelism (ZeRO-3, PyTorch FSDP2's `fully_shard`, JAX's
/// `P('fsdp', ...)` on parameters) over a mesh axis: the policy `fully_shard<"axis">` given to a
/// `train_state` (any axis of its mesh; `fsdp` by default).
///
/// Each parameter is *stored* sharded over the fsdp axis on its first dimension, on top of its own
/// sharding (a `column_dense` weight `P<none, 'model'>` is stored as `P<'fsdp', 'model'>`, a
/// `row_dense` weight `P<'model', none>` as `P<('model', 'fsdp'), none>`): device `r` of the axis
/// keeps chunk `r` of its block's rows. The optimizer's state, the float master weights and the
/// gradients follow the stored shard: the train state's `params` *are* the shards, so the
/// replicated optimizer, clipping over every shard, and mesh-independent checkpoints work on them
/// unchanged (a shard's layout is core's block of its parameter, cut along dimension 0).
///
/// The layers keep computing on whole blocks: just before a layer runs forward, and again before
/// its backward, `sequential` calls the hooks here, which all-gather each of its parameters' shards
/// over the fsdp axis (the public typed `all_gather_into`) into one buffer that every layer shares
/// (the largest layer's size); just after its backward, its gradients are reduce-scattered
/// (`psum_scatter_into`) back to the shards, the running shard folded into this device's chunk
/// first so micro-batches accumulate with no extra buffer. `reshard_after_forward = false` (FSDP2's
/// option of the same name) gives every layer a buffer of its own, gathered in forward and kept
/// for backward: one all-gather fewer per layer and step, for the memory of unsharded parameters.
///
/// The fsdp axis also splits the batch (it is a data-parallel axis whose replicas hold different
/// parameter shards): the gradients are pending sums over it, which the reduce-scatter completes;
/// over the remaining data axes the shards' gradients are all-reduced as in plain data parallelism.
///
/// Shards are even: an fsdp axis that does not divide a parameter's first dimension (per device)
/// is refused at construction with `sharding_error` naming the parameter, its shape, the axis and
/// its size, and the fix. A model whose layers share a parameter (a tied head) is not supported.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"model">>;
/// mesh_t m{2, 2, 2};
/// meshlib::nn::train_state state(m, std::move(net), meshlib::nn::adam(1e-3f), meshlib::nn::fully_shard<"fsdp">{});
/// std::printf("%zu bytes per device\n", state.memory(0).total());
/// @endcode

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/parallel/policy.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/sequential.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief Fully sharded data parallelism over the mesh axis `Axis` (see the file comment; FSDP2's
/// `fully_shard`); a `parallel_policy`. Composes with `data_parallel` on another axis (HSDP) and
/// with `pipeline`.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::fully_shard<"fsdp">{.reshard_after_forward = false});
/// @endcode
/// @tparam Axis the mesh axis parameters, gradients and optimizer state are sharded over (it splits
/// the batch as a data axis does).
template <fixed_string Axis = "fsdp">
struct fully_shard {
  /// The parallelism this policy applies.
  static constexpr parallelism kind = parallelism::fully_sharded;
  /// The mesh axis it applies over.
  static constexpr auto axis = Axis;
  /// Gather a layer's parameters again for its backward (true: least memory), or keep them from its
  /// forward (false: one all-gather fewer per layer, unsharded parameters' memory).
  bool reshard_after_forward = true;
  /// With `reshard_after_forward = false`: start the next layer's parameter all-gathers before a
  /// layer's forward, so they run while it computes (FSDP2's prefetch; the same bits).
  bool prefetch = true;
};

/// @brief The bytes one device holds for training (`train_state::memory`): what FSDP and ZeRO shrink.
struct training_memory {
  /// Parameter values this device stores (under FSDP its shards); with a 16-bit compute type, plus
  /// their float master weights.
  std::size_t parameters = 0;
  std::size_t gradients = 0;        ///< gradient blocks (under FSDP the shards' gradients)
  std::size_t optimizer_state = 0;  ///< optimizer slots (sharded under ZeRO-1, FSDP) and per-parameter state
  /// FSDP: the buffers layers' parameters are gathered into and their gradients computed in (the
  /// largest layer's, or every layer's values with `reshard_after_forward = false`).
  std::size_t unsharded = 0;
  /// The sum of the four.
  [[nodiscard]] std::size_t total() const noexcept { return parameters + gradients + optimizer_state + unsharded; }
};

namespace detail {

/// `to[i] += from[i]` for `[0, n)` of memory `Space`, a Kokkos kernel on the running device's instance.
template <class Space, class T>
void add_values(T* to, const T* from, std::size_t n) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { to[i] += from[i]; });
}

/// The layout of a parameter's FSDP shard: chunk `rank[dev]` of `shards` equal chunks of the
/// parent's block along dimension 0 (so elements `[rank * c / shards, (rank + 1) * c / shards)` of
/// the row-major block of `c` elements). Every position comes from the parent's (core's) block.
class fsdp_shard_layout final : public param_layout {
 public:
  fsdp_shard_layout(std::shared_ptr<const param_layout> parent, const std::vector<std::size_t>& rank,
                    std::size_t shards)
      : parent_(std::move(parent)), shards_(shards), first_(rank.size()), offset_(rank.size()), extent_(rank.size()) {
    for (std::size_t dev = 0; dev < rank.size(); ++dev) {
      const auto off = parent_->offset(dev), ext = parent_->extent(dev);
      offset_[dev].assign(off.begin(), off.end());
      extent_[dev].assign(ext.begin(), ext.end());
      std::size_t total = 1;
      for (std::size_t e : ext) total *= e;
      if (!ext.empty()) {
        extent_[dev][0] = ext[0] / shards;
        offset_[dev][0] = off[0] + rank[dev] * extent_[dev][0];
      }
      first_[dev] = rank[dev] * (total / shards);
    }
  }
  std::span<const std::size_t> offset(std::size_t dev) const override { return offset_.at(dev); }
  std::span<const std::size_t> extent(std::size_t dev) const override { return extent_.at(dev); }
  std::size_t count(std::size_t dev) const override { return parent_->count(dev) / shards_; }
  std::size_t global_index(std::size_t dev, std::size_t i) const override {
    return parent_->global_index(dev, first_.at(dev) + i);
  }
  void for_each_global_run(std::size_t dev, std::size_t first, std::size_t len,
                           const std::function<void(std::size_t, std::size_t, std::size_t)>& f) const override {
    const std::size_t base = first_.at(dev);
    parent_->for_each_global_run(dev, base + first, len,
                                 [&](std::size_t k, std::size_t g, std::size_t n) { f(k - base, g, n); });
  }
  held_tensor<float> zeros_like(std::span<const std::size_t> devices) const override {
    using view_t = meshlib::block_view<float, 1, default_memory_space>;
    auto owned = std::make_shared<std::vector<view_t>>(offset_.size());
    held_tensor<float> h{owned, device_blocks<float>(offset_.size())};
    for (std::size_t dev : devices) {
      (*owned)[dev] = meshlib::allocate<float, 1, default_memory_space>({count(dev)}, "meshlib::nn::fsdp_shard");
      h.blocks.set(dev, (*owned)[dev].data(), count(dev));
    }
    return h;
  }

 private:
  std::shared_ptr<const param_layout> parent_;
  std::size_t shards_;
  std::vector<std::size_t> first_;
  std::vector<std::vector<std::size_t>> offset_, extent_;
};

/// "12x16" for a shape, "scalar" for none.
inline std::string fsdp_shape_text(std::span<const std::size_t> s) {
  std::string t;
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? "x" : "") + std::to_string(s[i]);
  return t.empty() ? "scalar" : t;
}

/// The FSDP machinery of one `train_state` (see the file comment): the shards, the shared buffers,
/// and the hooks `sequential` calls around each layer. `Axes`: the fsdp axis (a mask of `Mesh`).
template <mesh_type Mesh, axis_mask Axes>
class fsdp_engine final : public layer_hooks {
  using T = float;
  using Space = default_memory_space;

 public:
  /// Shards the parameters `full` (every layer's, in layer order; layer `l` holds `per_layer[l]`
  /// of them) over `Axes`: copies each device's chunk of each block into its shard, then points the
  /// parameters' blocks into the shared buffers (their own storage is released).
  /// @throws sharding_error when the axis does not divide a parameter's first dimension.
  /// `prefetch` (with `reshard_after_forward` false, where every layer has its own buffer):
  /// start the next layer's all-gathers before a layer runs forward (see `before_forward`).
  fsdp_engine(const Mesh& mesh, std::vector<param_ref<T>> full, const std::vector<std::size_t>& per_layer,
              const std::vector<std::size_t>& local, bool reshard_after_forward, std::string_view axis_name,
              bool prefetch = false)
      : mesh_(mesh),
        shards_n_(mesh.axes_size(Axes)),
        full_(std::move(full)),
        reshard_(reshard_after_forward),
        prefetch_(prefetch && !reshard_after_forward),
        prefetched_(mesh.size()),
        prefetched_for_(mesh.size(), 0),
        voff_(mesh.size()),
        goff_(mesh.size()),
        values_(mesh.size()),
        grads_(mesh.size()),
        seconds_(mesh.size(), 0.0),
        unsharded_(mesh.size(), 0) {
    unit_begin_.push_back(0);
    for (std::size_t c : per_layer) unit_begin_.push_back(unit_begin_.back() + c);
    if (unit_begin_.back() != full_.size())
      throw sharding_error("meshlib::nn: train_state: FSDP: the model's layers report " +
                           std::to_string(unit_begin_.back()) + " parameters, but it collects " +
                           std::to_string(full_.size()));
    const std::size_t f = shards_n_;
    for (const auto& p : full_)
      for (std::size_t dev : local) {
        const auto ext = p.extent[dev];
        if (ext.empty() || ext[0] % f != 0)
          throw sharding_error(
              "meshlib::nn: train_state: FSDP cannot shard parameter '" + p.name + "' (shape " +
              fsdp_shape_text(p.shape) + ", " + p.sharding + ") over the " + std::to_string(f) +
              " devices of the fsdp axis '" + std::string(axis_name) + "': " +
              (ext.empty() ? std::string("it has no dimension to split")
                           : "its dimension 0 (" + std::to_string(ext[0]) + " per device) is not divisible by " +
                                 std::to_string(f)) +
              "; use an fsdp axis whose size divides " + (ext.empty() ? std::string("1") : std::to_string(ext[0])) +
              ", or make that dimension a multiple of " + std::to_string(f) + " (e.g. " +
              std::to_string(ext.empty() ? f : (ext[0] + f - 1) / f * f) + ")");
      }
    std::vector<std::size_t> rank(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev) rank[dev] = mesh.group_rank(dev, Axes);
    // Buffers: per device, each parameter's place in the value and gradient buffers.
    for (std::size_t dev : local) {
      voff_[dev].resize(full_.size());
      goff_[dev].resize(full_.size());
      std::size_t vmax = 0, gmax = 0, vall = 0;
      for (std::size_t u = 0; u + 1 < unit_begin_.size(); ++u) {
        std::size_t used = 0;
        for (std::size_t k = unit_begin_[u]; k < unit_begin_[u + 1]; ++k) {
          voff_[dev][k] = reshard_ ? used : vall + used;
          goff_[dev][k] = used;
          used += full_[k].count[dev];
        }
        vall += used;
        vmax = std::max(vmax, used);
        gmax = std::max(gmax, used);
      }
      const std::size_t vn = reshard_ ? vmax : vall;
      values_[dev] = meshlib::allocate<T, 1, Space>({std::max<std::size_t>(vn, 1)}, "meshlib::nn::fsdp_values", false);
      grads_[dev] = meshlib::allocate<T, 1, Space>({std::max<std::size_t>(gmax, 1)}, "meshlib::nn::fsdp_grads", false);
      unsharded_[dev] = vn + gmax;
    }
    // The shards, with their layouts; each starts as its chunk of the parameter's current block.
    for (const auto& p : full_) {
      param_ref<T> s = p;
      s.layout = std::make_shared<fsdp_shard_layout>(p.layout, rank, f);
      s.count = {s.layout};
      s.offset = {s.layout, false};
      s.extent = {s.layout, true};
      if (!s.dims.empty()) s.dims[0] |= Axes;
      s.sharded_axes |= Axes;
      s.sharding = stored_sharding(s.dims);
      s.overwrite = nullptr;
      s.rebind = {};
      held_tensor<float> v = s.layout->zeros_like(local), g = s.layout->zeros_like(local);
      s.value = v.blocks;
      s.grad = g.blocks;
      for (std::size_t dev : local)
        convert_copy<Space>(s.value[dev], p.value[dev] + rank[dev] * s.count[dev], s.count[dev]);
      owners_.push_back(std::move(v.owner));
      owners_.push_back(std::move(g.owner));
      shards_.push_back(std::move(s));
    }
    Kokkos::fence();
    // The layers' blocks move into the shared buffers; their own storage goes.
    std::vector<T*> vs(mesh.size(), nullptr), gs(mesh.size(), nullptr);
    for (std::size_t k = 0; k < full_.size(); ++k) {
      for (std::size_t dev : local) {
        vs[dev] = values_[dev].data() + voff_[dev][k];
        gs[dev] = grads_[dev].data() + goff_[dev][k];
      }
      if (!full_[k].rebind)
        throw sharding_error("meshlib::nn: train_state: FSDP: parameter '" + full_[k].name +
                             "' cannot be moved into the gather buffers (its layer's collect gives a view without "
                             "rebind); FSDP needs parameters made as meshlib::nn::parameter");
      full_[k].rebind(vs, gs);
      for (std::size_t dev : local) {
        full_[k].value.set(dev, vs[dev], full_[k].count[dev]);
        full_[k].grad.set(dev, gs[dev], full_[k].count[dev]);
      }
    }
  }

  /// The stored shards, in the order of the parameters: what the train state optimizes and saves.
  [[nodiscard]] const std::vector<param_ref<T>>& shards() const noexcept { return shards_; }
  /// Elements of device `dev`'s gather buffers (values and gradients).
  [[nodiscard]] std::size_t unsharded_elements(std::size_t dev) const { return unsharded_.at(dev); }
  /// Seconds device `dev` spent in FSDP's collectives since the last call (then reset).
  double take_seconds(std::size_t dev) { return std::exchange(seconds_.at(dev), 0.0); }

  /// Gathers the layer's parameters, or (prefetch) waits for the gathers started before an earlier
  /// layer, then starts those of the next layer that has parameters with `all_gather_into_start`,
  /// which run on the device's communication worker while this layer (and any parameterless one
  /// after it) computes: FSDP2's forward prefetch, one layer ahead. The gathered bits are the same.
  void before_forward(std::size_t layer, std::size_t dev) override {
    const auto t0 = std::chrono::steady_clock::now();
    auto& pending = prefetched_[dev];
    // A new forward, or gathers started for a layer already passed (an aborted forward's): dropped.
    if (layer == 0 || prefetched_for_[dev] < layer) pending.clear();
    if (!pending.empty() && prefetched_for_[dev] == layer) {
      for (auto& w : pending) w();
      pending.clear();
    } else {
      for (std::size_t k = unit_begin_.at(layer); k < unit_begin_.at(layer + 1); ++k) gather(k, dev);
    }
    if (prefetch_ && pending.empty()) {
      std::size_t next = layer + 1;
      while (next + 1 < unit_begin_.size() && unit_begin_[next] == unit_begin_[next + 1]) ++next;
      if (next + 1 < unit_begin_.size()) {
        prefetched_for_[dev] = next;
        for (std::size_t k = unit_begin_[next]; k < unit_begin_[next + 1]; ++k) start_gather(k, dev, pending);
      }
    }
    seconds_[dev] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void before_backward(std::size_t layer, std::size_t dev) override {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t k = unit_begin_.at(layer); k < unit_begin_.at(layer + 1); ++k) {
      if (reshard_) gather(k, dev);
      // The shared gradient buffer holds another layer's gradients: this backward overwrites it
      // (a layer that announces grad_beta), or adds to zeros.
      const param_ref<T>& p = full_[k];
      if (p.overwrite) p.overwrite[dev] = 1;
      else fill_values<Space>(p.grad[dev], p.count[dev], 0.0f);
    }
    seconds_[dev] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void after_backward(std::size_t layer, std::size_t dev) override {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t k = unit_begin_.at(layer); k < unit_begin_.at(layer + 1); ++k) {
      const param_ref<T>& p = full_[k];
      if (p.overwrite && p.overwrite[dev]) {  // the backward did not write it: no gradient
        fill_values<Space>(p.grad[dev], p.count[dev], 0.0f);
        p.overwrite[dev] = 0;
      }
      scatter(k, dev);
    }
    seconds_[dev] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  /// How a shard is laid out, as `named_sharding` prints it: `dims` per dimension, the parameter's
  /// own axes (in mesh order) then, on dimension 0, the fsdp axis (minor: a chunk of the block).
  std::string stored_sharding(const std::vector<axis_mask>& dims) const {
    std::string t = "named_sharding(" + mesh_.to_string() + ", P<";
    for (std::size_t d = 0; d < dims.size(); ++d) {
      std::vector<std::string_view> names;
      for (std::size_t i = 0; i < Mesh::ndim; ++i)
        if ((dims[d] & ~(d == 0 ? Axes : axis_mask{0})) & (axis_mask{1} << i)) names.push_back(Mesh::axis_names[i]);
      if (d == 0)
        for (std::size_t i = 0; i < Mesh::ndim; ++i)
          if (Axes & (axis_mask{1} << i)) names.push_back(Mesh::axis_names[i]);
      std::string e = names.empty() ? "none" : names.size() == 1 ? "" : "axes(";
      for (std::size_t i = 0; i < names.size(); ++i) e += (i ? ", \"" : "\"") + std::string(names[i]) + "\"";
      if (names.size() > 1) e += ")";
      t += (d ? ", " : "") + e;
    }
    return t + ">)";
  }
  /// Parameter `k`'s whole block on `dev` from the shards: the typed all-gather over `Axes`.
  void gather(std::size_t k, std::size_t dev) {
    const std::size_t s = shards_[k].count[dev];
    T* out = full_[k].value[dev];
    T* in = shards_[k].value[dev];
    if constexpr (Axes != 0) {
      if (shards_n_ > 1) {
        // The shard varies over every axis; gathered over the fsdp axis, the block no longer varies over it.
        using slice_t = local_tensor<T, 1, Mesh, Mesh::all_axes>;
        (void)meshlib::all_gather_into<group_of_t<Mesh, Axes>, 0>(wrap1<slice_t>(in, s, mesh_, dev),
                                                                 wrap1<slice_t>(out, s * shards_n_, mesh_, dev));
        return;
      }
    }
    convert_copy<Space>(out, in, s);
  }
  /// `gather(k, dev)` started: the request's wait goes into `pending` (a layer without parameters,
  /// or a group of one, leaves a wait that only copies).
  void start_gather(std::size_t k, std::size_t dev, std::vector<std::function<void()>>& pending) {
    const std::size_t s = shards_[k].count[dev];
    T* out = full_[k].value[dev];
    T* in = shards_[k].value[dev];
    if constexpr (Axes != 0) {
      if (shards_n_ > 1) {
        using slice_t = local_tensor<T, 1, Mesh, Mesh::all_axes>;
        auto r = std::make_shared<decltype(meshlib::all_gather_into_start<group_of_t<Mesh, Axes>, 0>(
            wrap1<slice_t>(in, s, mesh_, dev), wrap1<slice_t>(out, s * shards_n_, mesh_, dev)))>(
            meshlib::all_gather_into_start<group_of_t<Mesh, Axes>, 0>(wrap1<slice_t>(in, s, mesh_, dev),
                                                                        wrap1<slice_t>(out, s * shards_n_, mesh_, dev)));
        pending.emplace_back([r] { (void)r->wait(); });
        return;
      }
    }
    pending.emplace_back([this, k, dev] { gather(k, dev); });
  }
  /// Parameter `k`'s gradient block on `dev` (a pending sum over `Axes`: its rows were this device's
  /// batch) reduce-scattered into its shard's gradient, which it adds to.
  void scatter(std::size_t k, std::size_t dev) {
    const std::size_t s = shards_[k].count[dev], r = mesh_.group_rank(dev, Axes);
    T* g = full_[k].grad[dev];
    T* shard = shards_[k].grad[dev];
    add_values<Space>(g + r * s, shard, s);  // the running sum rides in this device's chunk
    if constexpr (Axes != 0) {
      if (shards_n_ > 1) {
        using B = local_tensor<T, 1, Mesh, Mesh::all_axes & ~Axes, Axes>;
        (void)meshlib::psum_scatter_into<group_of_t<Mesh, Axes>, 0>(wrap1<B>(g, s * shards_n_, mesh_, dev),
                                                                   wrap1<B>(shard, s, mesh_, dev));
        return;
      }
    }
    convert_copy<Space>(shard, g, s);
  }

  Mesh mesh_;
  std::size_t shards_n_;
  std::vector<param_ref<T>> full_, shards_;
  std::vector<std::shared_ptr<const void>> owners_;
  std::vector<std::size_t> unit_begin_;
  bool reshard_;
  bool prefetch_;
  /// Per device: the waits of the next layer's started gathers (prefetch).
  std::vector<std::vector<std::function<void()>>> prefetched_;
  std::vector<std::size_t> prefetched_for_;  ///< per device: the layer `prefetched_` gathers
  std::vector<std::vector<std::size_t>> voff_, goff_;
  std::vector<meshlib::block_view<T, 1, Space>> values_, grads_;
  std::vector<double> seconds_;
  std::vector<std::size_t> unsharded_;
};

/// The policy `p` at work in a `train_state` under construction (its `params` collected, nothing
/// sized yet): shards `params` over `Axes` (the mesh axis `A`), makes them the engine's shards and
/// installs the engine as `model`'s layer hooks (the policy compiles only over a mesh axis, for a
/// `sequential` model: `check_policies`).
/// @throws sharding_error as `fsdp_engine`'s constructor.
/// (`Policy` is `fully_shard<A>`, a type rather than a deduced `fixed_string A`: nvcc 13's front end
/// deduces no class-type template argument from a specialisation.)
template <axis_mask Axes, mesh_type Mesh, class Model, class T, class Policy>
  requires(Axes != 0 && sequential_model<Model> && Policy::kind == parallelism::fully_sharded)
std::shared_ptr<fsdp_engine<Mesh, Axes>> fully_shard_model(const Mesh& mesh, Model& model,
                                                           std::vector<param_ref<T>>& params,
                                                           const std::vector<std::size_t>& local,
                                                           const Policy& p) {
  auto engine = std::make_shared<fsdp_engine<Mesh, Axes>>(mesh, params, model.template params_per_layer<T>(), local,
                                                          p.reshard_after_forward, text_of(Policy::axis), p.prefetch);
  params = engine->shards();
  model.hooks = engine.get();
  return engine;
}

}  // namespace detail
}  // namespace meshlib::nn
