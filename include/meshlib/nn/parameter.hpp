// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `parameter`: a trainable sharded array (its value and its gradient, same sharding), and
/// `param_ref`, the untyped view of one parameter that optimizers, the gradient synchronisation and
/// checkpoints walk over (they treat every parameter alike: a block of floats per device).
///
/// Initialisation is mesh-invariant: element `g` (global row-major index) of parameter `name` is
/// `init(key.fold_in(id(name)), g)`, whatever device holds it (see nn/random.hpp).
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// mesh_t m{4, 2};
/// meshlib::nn::parameter<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, "model">>> w(
///     "fc1.w", {m}, {784, 1024}, meshlib::nn::rng_key{0}, meshlib::nn::init::normal(0.05f));
/// w.value.local_value(3);   // device 3's (784, 512) block, the same numbers on any mesh
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "meshlib/core/hash.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib::nn {

/// @brief Initialisers: `f(key, global_index) -> float`.
namespace init {
/// Zeros (biases, layer-norm shifts).
inline auto zeros() {
  return [](rng_key, std::uint64_t) { return 0.0f; };
}
/// A constant (layer-norm scales).
inline auto constant(float c) {
  return [c](rng_key, std::uint64_t) { return c; };
}
/// Normal with standard deviation `stddev` (`jax.nn.initializers.normal`).
inline auto normal(float stddev) {
  return [stddev](rng_key k, std::uint64_t g) { return stddev * nn::normal(k, g); };
}
/// Uniform on [-limit, limit): with limit = sqrt(6 / (fan_in + fan_out)), Glorot / Xavier uniform.
inline auto uniform(float limit) {
  return [limit](rng_key k, std::uint64_t g) { return limit * (2.0f * nn::uniform(k, g) - 1.0f); };
}
}  // namespace init

namespace detail {
/// FNV-1a of a parameter name: its stream id, so the values depend on the name, not on the order
/// in which a model registers its parameters.
constexpr std::uint64_t name_id(std::string_view name) noexcept { return meshlib::fnv1a_of(name); }
}  // namespace detail

namespace detail {
/// One array's blocks, one per device, as unmanaged 1-D `Kokkos::View`s of the device's memory
/// space (the element order of the block's row-major storage). `blocks[dev]` is the block's first
/// element (nullptr where device `dev` is not local: the spelling of the raw-pointer `param_ref`,
/// which layers and tests index as `p.grad[dev][k]`); `blocks.view(dev)` is the view that Kokkos
/// kernels take. Unmanaged: copies touch no reference count, so device threads may copy them
/// freely (tensor/view.hpp); the tensor that owns the blocks must outlive them.
template <class T, class Space = default_memory_space>
class device_blocks {
 public:
  /// A device's block.
  using view_type = meshlib::unmanaged_block_view<T, 1, Space>;
  device_blocks() = default;
  /// `n` devices, none local yet.
  explicit device_blocks(std::size_t n) : views_(n) {}
  /// Device `dev`'s block, `n` elements at `data`.
  void set(std::size_t dev, T* data, std::size_t n) { views_.at(dev) = view_type(data, n); }
  /// Device `dev`'s block as a view (empty where not local).
  [[nodiscard]] const view_type& view(std::size_t dev) const { return views_[dev]; }
  /// Device `dev`'s first element, or nullptr where not local.
  [[nodiscard]] T* operator[](std::size_t dev) const noexcept { return views_[dev].data(); }
  /// The number of devices of the mesh.
  [[nodiscard]] std::size_t size() const noexcept { return views_.size(); }

 private:
  std::vector<view_type> views_;
};

/// A meshlib tensor whose rank and sharding are erased, held by its device blocks: `owner` keeps
/// the tensor (a `sharded_tensor` with the sharding it was made with) alive, `blocks` reach its
/// blocks. This is how the train state holds float master weights and optimizer slots of every
/// parameter in one vector, each with its parameter's own sharding.
template <class T, class Space = default_memory_space>
struct held_tensor {
  std::shared_ptr<const void> owner;  ///< the typed tensor
  device_blocks<T, Space> blocks;     ///< its blocks
};

/// The layout of one parameter with its rank and sharding erased: core's `shard_layout` and the
/// `block` it gives every device. Everything `param_ref` says about where a device's block lies
/// comes from here, so the block arithmetic stays in core/shard_layout.hpp.
class param_layout {
 public:
  virtual ~param_layout() = default;
  /// Where device `dev`'s block starts, per dimension.
  [[nodiscard]] virtual std::span<const std::size_t> offset(std::size_t dev) const = 0;
  /// Device `dev`'s block's size per dimension.
  [[nodiscard]] virtual std::span<const std::size_t> extent(std::size_t dev) const = 0;
  /// Elements of device `dev`'s block in this process (0 where the device is not local).
  [[nodiscard]] virtual std::size_t count(std::size_t dev) const = 0;
  /// Global row-major index of element `i` of device `dev`'s block (`block::global_index`).
  [[nodiscard]] virtual std::size_t global_index(std::size_t dev, std::size_t i) const = 0;
  /// `block::for_each_global_run` of device `dev`'s block.
  virtual void for_each_global_run(std::size_t dev, std::size_t first, std::size_t len,
                                   const std::function<void(std::size_t, std::size_t, std::size_t)>& f) const = 0;
  /// A float tensor of zeros with the parameter's shape and sharding, blocks on `devices`.
  [[nodiscard]] virtual held_tensor<float> zeros_like(std::span<const std::size_t> devices) const = 0;
};

/// `param_layout` of a parameter of rank `Rank` sharded by `S`.
template <sharding_type S, std::size_t Rank>
class typed_param_layout final : public param_layout {
 public:
  typed_param_layout(const shard_layout<S, Rank>& layout, std::span<const std::size_t> local)
      : layout_(layout), local_(layout.num_devices(), false) {
    for (std::size_t dev = 0; dev < layout.num_devices(); ++dev) blocks_.push_back(layout.block_of(dev));
    for (std::size_t dev : local) local_.at(dev) = true;
  }
  std::span<const std::size_t> offset(std::size_t dev) const override { return blocks_.at(dev).offset; }
  std::span<const std::size_t> extent(std::size_t dev) const override { return blocks_.at(dev).extent; }
  std::size_t count(std::size_t dev) const override { return local_.at(dev) ? blocks_[dev].size() : 0; }
  std::size_t global_index(std::size_t dev, std::size_t i) const override {
    return blocks_.at(dev).global_index(layout_.global_shape(), i);
  }
  void for_each_global_run(std::size_t dev, std::size_t first, std::size_t len,
                           const std::function<void(std::size_t, std::size_t, std::size_t)>& f) const override {
    blocks_.at(dev).for_each_global_run(layout_.global_shape(), first, len, f);
  }
  held_tensor<float> zeros_like(std::span<const std::size_t> devices) const override {
    auto t = std::make_shared<sharded_tensor<float, Rank, S>>(layout_.sharding(), layout_.global_shape(), devices);
    held_tensor<float> h{t, device_blocks<float>(layout_.num_devices())};
    for (std::size_t dev : devices) h.blocks.set(dev, t->local(dev).data(), t->local(dev).size());
    return h;
  }

 private:
  shard_layout<S, Rank> layout_;
  std::vector<block<Rank>> blocks_;  // block_of(dev) for every device, as core computes it
  std::vector<bool> local_;
};

/// `p.count[dev]`: the elements of device `dev`'s block (0 where not local), from the layout.
struct block_counts {
  std::shared_ptr<const param_layout> layout;
  [[nodiscard]] std::size_t operator[](std::size_t dev) const { return layout ? layout->count(dev) : 0; }
};
/// `p.offset[dev][d]` / `p.extent[dev][d]`: device `dev`'s block's corner or size, from the layout.
struct block_corners {
  std::shared_ptr<const param_layout> layout;
  bool extents = false;
  [[nodiscard]] std::span<const std::size_t> operator[](std::size_t dev) const {
    return extents ? layout->extent(dev) : layout->offset(dev);
  }
};
}  // namespace detail

/// @brief The untyped view of one parameter (see the file comment). Per-device entries are indexed
/// by device id. The blocks are the parameter's own tensors' blocks (`value.view(dev)`, an
/// unmanaged 1-D view, or `value[dev]`, its first element, nullptr where device `d` is not
/// local); where they lie in the global array comes from core's `shard_layout` (`layout`), never
/// from a layout of nn's own.
template <class T = float>
struct param_ref {
  /// The parameter's name, such as `"layer1.w"`.
  std::string name;
  std::vector<std::size_t> shape;      ///< global shape
  std::string sharding;                ///< printed named_sharding
  std::vector<axis_mask> dims;         ///< per dimension, the axes it is sharded over
  axis_mask sharded_axes = 0;          ///< axes the parameter is split over (replicated over the rest)
  bool decay = true;                   ///< whether AdamW's weight decay applies (weights, not biases/norms)
  /// per device: the value blocks (see the struct comment).
  detail::device_blocks<T> value;
  /// per device: the gradient blocks.
  detail::device_blocks<T> grad;
  /// The parameter's layout: core's blocks, rank and sharding erased.
  std::shared_ptr<const detail::param_layout> layout;
  detail::block_counts count;          ///< per device: elements in the block (0 where not local)
  /// per device: where the block lies in the global array.
  detail::block_corners offset;
  /// per device: the block's size per dimension.
  detail::block_corners extent;
  /// Per device, indexed by device id: set to 1 by `train_step` instead of zeroing the gradient
  /// block; the layer's next backward then writes the block (`beta = 0`) instead of adding to it
  /// (see `parameter::grad_beta`). nullptr for a parameter whose layer always adds: `train_step`
  /// zeroes those.
  std::uint8_t* overwrite = nullptr;
  /// Moves the parameter's value and gradient blocks to caller-owned memory: device `d`'s blocks
  /// become unmanaged views of `values[d]` and `grads[d]` (each `count[d]` elements; ignored where
  /// not local) and the parameter's own storage is released. FSDP (nn/parallel/fsdp.hpp) points every
  /// layer's blocks into one shared buffer this way. Empty for a view that cannot rebind (a shard).
  /// Valid while the parameter that gave this view stays where it was.
  std::function<void(std::span<T* const> values, std::span<T* const> grads)> rebind;
};

namespace detail {
/// Global row-major index of element `i` of device `dev`'s block of `p` (core's `block::global_index`).
template <class T>
std::size_t global_index(const param_ref<T>& p, std::size_t dev, std::size_t i) {
  return p.layout->global_index(dev, i);
}

/// Calls `f(k, g, n)` for the runs of elements `[first, first + len)` of device `dev`'s block of
/// `p` that are contiguous in the global row-major array: block elements `k .. k + n` are global
/// elements `g .. g + n` (core's `block::for_each_global_run`: a run never crosses a row of the
/// block's last dimension).
template <class T, class F>
void for_each_global_run(const param_ref<T>& p, std::size_t dev, std::size_t first, std::size_t len, F&& f) {
  p.layout->for_each_global_run(dev, first, len, std::forward<F>(f));
}
}  // namespace detail

namespace detail {
/// The untyped view of tensor `t` under `name`, without a gradient: what `parameter::ref` starts
/// from, and how a layer shows the arrays it keeps but does not train (batch norm's running
/// statistics, PyTorch's buffers, flax's `batch_stats`) to checkpoints.
template <class T, std::size_t Rank, sharding_type S>
param_ref<T> tensor_ref(const std::string& name, const sharded_tensor<T, Rank, S>& t) {
  param_ref<T> r;
  r.name = name;
  r.shape.assign(t.global_shape().begin(), t.global_shape().end());
  r.sharding = t.sharding().to_string();
  for (std::size_t d = 0; d < Rank; ++d) r.dims.push_back(S::dim_mask(d));
  r.sharded_axes = S::sharded_axes;
  r.decay = false;
  const std::vector<std::size_t> local = t.local_devices();
  r.layout = std::make_shared<typed_param_layout<S, Rank>>(t.layout(), local);
  r.count = {r.layout};
  r.offset = {r.layout, false};
  r.extent = {r.layout, true};
  r.value = device_blocks<T>(t.num_devices());
  for (std::size_t dev : local) r.value.set(dev, t.local(dev).data(), t.local(dev).size());
  return r;
}

/// Appends layer `l`'s buffers (arrays it keeps but does not train, see `tensor_ref`) when it has
/// any (`l.collect_buffers(out)`, PyTorch's `named_buffers`); most layers have none and need not say so.
template <class L, class T>
void collect_buffers_of(const L& l, std::vector<param_ref<T>>& out) {
  if constexpr (requires { l.collect_buffers(out); }) l.collect_buffers(out);
}
}  // namespace detail

/// @brief A trainable array: value and gradient with sharding `S`.
template <class T, std::size_t Rank, sharding_type S>
struct parameter {
  /// The sharded array type of value and gradient.
  using tensor_type = sharded_tensor<T, Rank, S>;
  /// A device's block of the value or gradient.
  using local_type = typename tensor_type::local_type;
  /// The global shape.
  using shape_type = std::array<std::size_t, Rank>;

  /// The parameter's name, used in checkpoints and messages.
  std::string name;
  /// The current value.
  tensor_type value;
  /// The gradient of the loss with respect to `value`.
  tensor_type grad;
  /// Whether AdamW's weight decay applies (true for weights, false for biases and norms).
  bool decay = true;

  /// Initialises element `g` to `init(key.fold_in(name_id(name)), g)`; `local_devices` empty: all.
  template <class Init>
  parameter(std::string name_, const S& sharding, const shape_type& shape, rng_key key, Init&& init, bool decay_ = true,
            std::span<const std::size_t> local_devices = {})
      : name(std::move(name_)),
        value(make_array_from_callback<T>(
            shape, sharding,
            [&, k = key.fold_in(detail::name_id(name))](const shape_type& g) {
              std::uint64_t flat = 0;
              for (std::size_t d = 0; d < Rank; ++d) flat = flat * shape[d] + g[d];
              return static_cast<T>(init(k, flat));
            },
            local_devices)),
        grad(zeros<T>(sharding, shape, local_devices)),
        decay(decay_),
        overwrite_(new std::uint8_t[sharding.mesh().size()]()) {}

  /// This device's value block, typed as it enters shard_map (varying over the spec's axes).
  [[nodiscard]] local_type local(std::size_t dev) const { return value.local_value(dev); }

  /// How device `dev`'s next backward writes its gradient block: `T{0}` (overwrite, once) when
  /// `train_step` marked the block as holding a previous step's gradient, else `T{1}` (add: a
  /// later micro-batch of the same step). A layer that asks this before each write, as a GEMM's
  /// `beta`, saves `train_step` a pass that zeroes every gradient (a read and a write of the whole
  /// model per step), and announces it with `ref(true)`.
  [[nodiscard]] T grad_beta(std::size_t dev) {
    if (overwrite_[dev] == 0) return T{1};
    overwrite_[dev] = 0;
    return T{0};
  }

  /// See `param_ref::rebind`.
  void rebind(std::span<T* const> values, std::span<T* const> grads) {
    const std::size_t n = value.num_devices();
    std::vector<typename tensor_type::view_type> vs(n), gs(n);
    std::vector<bool> local(n, false);
    for (std::size_t dev = 0; dev < n; ++dev) {
      if (!value.is_local(dev)) continue;
      const auto shape = value.layout().local_shape(dev);
      vs[dev] = std::apply([&](auto... e) { return typename tensor_type::view_type(values[dev], e...); }, shape);
      gs[dev] = std::apply([&](auto... e) { return typename tensor_type::view_type(grads[dev], e...); }, shape);
      local[dev] = true;
    }
    value = tensor_type(value.sharding(), value.global_shape(), std::move(vs), local);
    grad = tensor_type(grad.sharding(), grad.global_shape(), std::move(gs), std::move(local));
  }

  /// The untyped view (see `param_ref`); `overwrites`: the layer writes the gradient with `grad_beta`.
  /// Non-const: the view's `rebind` moves this parameter's blocks (FSDP's gather buffers, a
  /// pipeline's stages), so a layer's `collect` that gives it is non-const too.
  [[nodiscard]] param_ref<T> ref(bool overwrites = false) {
    param_ref<T> r = detail::tensor_ref(name, value);
    r.decay = decay;
    r.overwrite = overwrites ? overwrite_.get() : nullptr;
    r.rebind = [self = this](std::span<T* const> values, std::span<T* const> grads) { self->rebind(values, grads); };
    r.grad = detail::device_blocks<T>(value.num_devices());
    for (std::size_t dev : value.local_devices()) r.grad.set(dev, grad.local(dev).data(), grad.local(dev).size());
    return r;
  }

 private:
  // Per device; shared by copies (a layer is moved into its model after the state took its refs).
  std::shared_ptr<std::uint8_t[]> overwrite_;
};

}  // namespace meshlib::nn
