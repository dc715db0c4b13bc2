// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// meshlib 0.1.0: the training layer (<meshlib/nn.hpp>) -- single-header distribution.
// Generated from include/ by scripts/amalgamate.py; do not edit by hand:
// change the headers in include/ and run `python3 scripts/amalgamate.py`.
//
// Needs meshlib.hpp from the same folder (included below): the same requirements and the
// same optional-part macros (see its first lines). This file adds only the headers of the
// training layer that meshlib.hpp does not hold.
#ifndef MESHLIB_SINGLE_INCLUDE_MESHLIB_NN_HPP
#define MESHLIB_SINGLE_INCLUDE_MESHLIB_NN_HPP
#include "meshlib.hpp"
// begin meshlib/nn.hpp
/// @file
/// @brief meshlib's training layer: layers with forward and backward, losses, optimizers and
/// schedules, data-parallel gradient synchronisation, ZeRO-1, `train_state` / `train_step`, and the
/// data pipeline. See docs/training.md.

// begin meshlib/nn/random.hpp
/// @file
/// @brief Counter-based random numbers for training: every value is a pure function of
/// `(seed, stream, index)`, so a parameter initialised from its *global* element index, or a dropout
/// mask drawn per global activation index, is the same on every mesh and every sharding. JAX's
/// `jax.random` values for a sharded array change with the shard count; these do not.
///
/// The function is SplitMix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014) applied to a combination of the three words, a stateless hash as
/// Philox/Threefry are for JAX: no state, so any device computes any element on its own.
/// @code
/// meshlib::nn::rng_key key{42};
/// float u = meshlib::nn::uniform(key.fold_in(7), 1234);   // parameter 7, element 1234: in [0, 1)
/// float z = meshlib::nn::normal(key.fold_in(7), 1234);    // standard normal
/// @endcode

#include <cmath>
#include <cstdint>

namespace meshlib::nn {

namespace detail {
/// SplitMix64's output function: a bijective avalanche mix of 64 bits.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace detail

/// @brief A random key (JAX's `PRNGKey`): a 64-bit value; `fold_in` derives independent streams
/// (per parameter id, per step, per layer) as `jax.random.fold_in` does.
struct rng_key {
  /// The key's 64 bits.
  std::uint64_t value = 0;
  /// A new key derived from this one and `data` (as `jax.random.fold_in`); the key itself is unchanged.
  [[nodiscard]] constexpr rng_key fold_in(std::uint64_t data) const noexcept {
    return rng_key{detail::mix64(value ^ detail::mix64(data + 0x632BE59BD9B4E019ull))};
  }
  /// Keys are equal when their values are.
  friend constexpr bool operator==(rng_key, rng_key) = default;
};

/// @brief 64 random bits of element `index` of stream `key`.
[[nodiscard]] constexpr std::uint64_t random_bits(rng_key key, std::uint64_t index) noexcept {
  return detail::mix64(key.value + detail::mix64(index));
}

/// @brief A uniform float in [0, 1) for element `index` of `key` (24 random bits).
[[nodiscard]] constexpr float uniform(rng_key key, std::uint64_t index) noexcept {
  return static_cast<float>(random_bits(key, index) >> 40) * (1.0f / 16777216.0f);
}

/// @brief A standard normal for element `index` of `key` (Box-Muller on two independent words).
[[nodiscard]] inline float normal(rng_key key, std::uint64_t index) noexcept {
  const std::uint64_t bits = random_bits(key, index);
  const double u1 = (static_cast<double>(bits >> 11) + 1.0) * (1.0 / 9007199254740993.0);  // (0, 1]
  const double u2 = static_cast<double>(detail::mix64(bits) >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace meshlib::nn
// end meshlib/nn/random.hpp
// begin meshlib/nn/parameter.hpp
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
// end meshlib/nn/parameter.hpp
// begin meshlib/nn/layers/dense.hpp
/// @file
/// @brief Dense layers `y = x W + b` with forward and backward: replicated (`dense`), and the two
/// halves of Megatron's tensor-parallel MLP, `column_dense` (W sharded on its output dimension, no
/// communication forward) and `row_dense` (W sharded on its input dimension, one `psum` forward).
///
/// Every type of the backward pass comes from the tensor algebra: the cotangent of the output has
/// the output's type; the transpose of the forward's collective gives the next type (the `psum` of
/// `row_dense` transposes to a `pvary`, the implicit `pvary` of `column_dense`'s replicated input to
/// a `psum`), and `sequential` checks that each layer hands back a cotangent of exactly its input's
/// type, so a sharding mistake in a backward pass is a compile error.
///
/// | layer | W | b | forward | backward (dx) |
/// | --- | --- | --- | --- | --- |
/// | `dense` | `P<none, none>` | `P<none>` | `x W + b` | `dy W^T` |
/// | `column_dense<Model>` | `P<none, Model>` | `P<Model>` | `x W_b + b_b`: output columns sharded | `psum<Model>(dy W_b^T)` |
/// | `row_dense<Model>` | `P<Model, none>` | `P<none>` | `psum<Model>(x_b W_b) + b` | `pvary<Model>(dy) W_b^T`: sharded |
///
/// Weight gradients are `x^T dy`: a contraction over the batch, so a pending sum over the data axis
/// (what the data-parallel synchronisation completes); they accumulate (`+=`) over the micro-batches
/// of a step, and the first backward of a `train_step` overwrites them (`parameter::grad_beta`).
/// Every product is one `matmul_into` into the layer's own buffers (transposes read, not made).
///
/// Shapes are checked, never taken on trust: an input whose sharding does not fit the weight does
/// not compile (one error); an input or cotangent whose width is not the weight's throws
/// `sharding_error` naming the layer, both widths (global, and per device when sharded) and the fix.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// mesh_t m{4, 2};
/// meshlib::nn::column_dense<float, mesh_t> fc1(m, "fc1", 784, 1024, meshlib::nn::rng_key{0});
/// meshlib::nn::row_dense<float, mesh_t> fc2(m, "fc2", 1024, 1024, meshlib::nn::rng_key{0});
/// // inside spmd: auto h = fc1.forward(x); auto y = fc2.forward(h);   // y replicated over model
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/nn/buffers.hpp
/// @file
/// @brief Per-device scratch buffers of the training layers, so a training step allocates nothing
/// after its first iteration.
///
/// A layer owns one buffer slot per device; only that device's thread grows or reads its slot (the
/// reference-count rule of docs/tensors.md: a device copies and drops only its own handles). The
/// tensors a layer returns wrap these buffers (unmanaged views): they stay valid until the layer's
/// next forward / backward on that device.
///
/// Two hooks let `remat` (nn/remat.hpp) and the activation measure of `train_step` see these
/// buffers without every layer reporting its own: a thread-local `buffer_meter` counts the bytes of
/// the slots allocated while it is active (each slot remembers the meter that counted it, so a
/// slot released or regrown later is taken off that meter and no count goes negative), and a
/// thread-local `release_scope` records every slot used while it is active, so `remat` can free
/// the buffers of the block it wraps after forward and let backward reallocate them.

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn::detail {

/// The bytes of layer buffers one device holds (see the file comment): `live` now, `peak` the
/// most since `reset_peak`. Only that device's thread touches it.
struct buffer_meter {
  std::size_t live = 0;  ///< bytes allocated now in the slots this meter counted
  std::size_t peak = 0;  ///< the most `live` reached since the last `reset_peak`
  void add(std::size_t n) noexcept {
    live += n;
    peak = std::max(peak, live);
  }
  void remove(std::size_t n) noexcept { live -= std::min(n, live); }
  void reset_peak() noexcept { peak = live; }
};
/// The meter that counts the slots the calling thread allocates (null: none).
inline buffer_meter*& active_meter() noexcept {
  thread_local buffer_meter* m = nullptr;
  return m;
}
/// Makes `m` the calling thread's meter until the end of the scope (then the previous one again).
class meter_scope {
 public:
  explicit meter_scope(buffer_meter* m) noexcept : prev_(active_meter()) { active_meter() = m; }
  ~meter_scope() { active_meter() = prev_; }
  meter_scope(const meter_scope&) = delete;
  meter_scope& operator=(const meter_scope&) = delete;

 private:
  buffer_meter* prev_;
};

/// A slot of some `device_buffers<T>`, with the function that frees it (type-erased so one scope
/// records buffers of every element type).
struct buffer_slot_ref {
  void* slot = nullptr;
  void (*release)(void*) noexcept = nullptr;
  bool (*holds)(const void*, const void*) noexcept = nullptr;  ///< whether the slot's block holds an address
  friend bool operator==(const buffer_slot_ref&, const buffer_slot_ref&) = default;
};
/// The slots used on the calling thread while it is active (see the file comment). Scopes nest:
/// only the innermost records. A copy starts empty (its slots would be another object's).
class release_scope {
 public:
  release_scope() = default;
  release_scope(const release_scope&) noexcept {}
  release_scope& operator=(const release_scope&) noexcept {
    slots_.clear();
    return *this;
  }
  release_scope(release_scope&&) noexcept = default;  // the slots' vectors move with their owners
  release_scope& operator=(release_scope&&) noexcept = default;
  ~release_scope() = default;

  /// Frees every recorded slot but the one whose block holds `keep` (the memory goes back to
  /// Kokkos; the next `get` allocates again). The kept slot stays recorded: the next call frees it
  /// unless it holds that call's `keep`.
  void release_except(const void* keep) noexcept {
    dedupe();
    std::size_t kept = 0;
    for (const auto& s : slots_) {
      if (keep != nullptr && s.holds(s.slot, keep)) slots_[kept++] = s;
      else s.release(s.slot);
    }
    slots_.resize(kept);
  }
  void record(buffer_slot_ref s) {
    if (slots_.empty() || !(slots_.back() == s)) slots_.push_back(s);
    if (slots_.size() > 2 * unique_) dedupe();
  }
  /// Makes this scope the calling thread's recorder until `leave` (restoring the previous one).
  void enter() noexcept {
    prev_ = current();
    current() = this;
  }
  void leave() noexcept { current() = prev_; }
  static release_scope*& current() noexcept {
    thread_local release_scope* s = nullptr;
    return s;
  }

 private:
  void dedupe() {
    if (slots_.empty()) return;
    std::sort(slots_.begin(), slots_.end(),
              [](const buffer_slot_ref& a, const buffer_slot_ref& b) { return a.slot < b.slot; });
    slots_.erase(std::unique(slots_.begin(), slots_.end()), slots_.end());
    unique_ = std::max<std::size_t>(slots_.size(), 16);
  }
  std::vector<buffer_slot_ref> slots_;
  std::size_t unique_ = 16;
  release_scope* prev_ = nullptr;
};

/// One growable buffer per device (see the file comment).
template <class T>
class device_buffers {
 public:
  device_buffers() = default;
  explicit device_buffers(std::size_t devices) : bufs_(devices) {}
  void resize_devices(std::size_t devices) { bufs_.resize(devices); }
  /// Device `dev`'s buffer of at least `n` elements (contents unspecified when it grew).
  T* get(std::size_t dev, std::size_t n) {
    auto& s = bufs_.at(dev);
    if (s.view.extent(0) < n) {
      if (s.meter != nullptr) s.meter->remove(s.bytes);
      s.view = view_t();  // the old block goes before the new one comes: the meter's peak is real
      s.view = meshlib::allocate<T, 1>({n}, "meshlib::nn::buffer", false);
      s.bytes = n * sizeof(T);
      s.meter = active_meter();
      if (s.meter != nullptr) s.meter->add(s.bytes);
    }
    if (release_scope* r = release_scope::current()) r->record(slot_ref(dev));
    return s.view.data();
  }
  /// Device `dev`'s buffer of `n` elements, zero-filled (a Kokkos kernel on the running device's instance).
  T* zeros(std::size_t dev, std::size_t n) {
    T* p = get(dev, n);
    meshlib::launch<default_memory_space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = T{}; });
    return p;
  }
  /// `n` values of the caller's host memory at `src`, readable by kernels in the buffers' memory
  /// space: `src` itself where the host's memory is that space's, else a copy in device `dev`'s buffer.
  const T* readable(std::size_t dev, const T* src, std::size_t n) {
    if constexpr (meshlib::host_accessible_v<default_memory_space>) {
      return src;
    } else {
      T* p = get(dev, n);
      meshlib::copy_from_host<default_memory_space>(p, src, n);
      return p;
    }
  }
  /// `n` values at `src`, which may be host or device memory (a caller's span), readable by the
  /// running device's kernels: `src` itself where they can read it (any pointer on a host space;
  /// device memory of the running GPU, asked with `is_readable_by_running_device`), else a copy in device
  /// `dev`'s buffer (`readable`).
  const T* staged(std::size_t dev, const T* src, std::size_t n) {
    if (meshlib::is_readable_by_running_device<default_memory_space>(src)) return src;
    return readable(dev, src, n);
  }
  /// Frees device `dev`'s buffer (the next `get` allocates again).
  void release(std::size_t dev) noexcept { release_slot(&bufs_.at(dev)); }
  /// Device `dev`'s buffer as a slot a `release_scope` can free.
  buffer_slot_ref slot_ref(std::size_t dev) { return {&bufs_.at(dev), &release_slot, &slot_holds}; }

 private:
  using view_t = meshlib::block_view<T, 1, default_memory_space>;
  struct slot {
    view_t view;
    buffer_meter* meter = nullptr;  // the meter that counted `bytes` (not owned)
    std::size_t bytes = 0;
  };
  static void release_slot(void* p) noexcept {
    auto& s = *static_cast<slot*>(p);
    if (s.meter != nullptr) s.meter->remove(s.bytes);
    s.view = view_t();
    s.meter = nullptr;
    s.bytes = 0;
  }
  static bool slot_holds(const void* p, const void* address) noexcept {
    const auto& s = *static_cast<const slot*>(p);
    const auto* a = static_cast<const unsigned char*>(address);
    const auto* b = reinterpret_cast<const unsigned char*>(s.view.data());
    return b != nullptr && a >= b && a < b + s.bytes;
  }
  std::vector<slot> bufs_;
};

/// A rank-1 local tensor of type `L` over `n` elements at `data` (not owned: a caller's buffer,
/// which the donated collectives reduce in place).
template <local_tensor_type L>
L wrap1(typename L::value_type* data, std::size_t n, const typename L::mesh_type& mesh, std::size_t dev) {
  return L(typename L::view_type(data, n), mesh, dev);
}

/// A local tensor of type `L` over `data` (not owned), `rows x cols`.
template <local_tensor_type L>
L wrap2(typename L::value_type* data, std::size_t rows, std::size_t cols, const typename L::mesh_type& mesh,
        std::size_t dev) {
  return L(typename L::view_type(data, rows, cols), mesh, dev);
}

/// The type `psum<Names...>` gives `L` (the compiler checks the rule; nothing runs).
template <class L, fixed_string... Names>
using psum_t = decltype(meshlib::psum<Names...>(std::declval<const L&>()));
/// The type `pvary<Names...>` gives `L`.
template <class L, fixed_string... Names>
using pvary_t = decltype(meshlib::pvary<Names...>(std::declval<const L&>()));

template <class L, fixed_string... Names>
struct psum_of {
  using type = psum_t<L, Names...>;
};
template <class L, fixed_string... Names>
struct pvary_of {
  using type = pvary_t<L, Names...>;
};

/// `psum_t<L, Names...>` when `B`, else `L`, without naming the psum otherwise (its axes may not
/// exist on this mesh). A conditional, not a specialisation on `<true, L, Names...>`: nvcc's front
/// end matches no partial specialisation over a pack of `fixed_string`s (collectives/axis_group.hpp).
template <bool B, class L, fixed_string... Names>
struct psum_if {
  using type = typename std::conditional_t<B, psum_of<L, Names...>, std::type_identity<L>>::type;
};
/// `pvary_t<L, Names...>` when `B`, else `L`.
template <bool B, class L, fixed_string... Names>
struct pvary_if {
  using type = typename std::conditional_t<B, pvary_of<L, Names...>, std::type_identity<L>>::type;
};

/// `pvary<Names...>(x)` without a copy (pvary moves no data; only the type changes).
template <fixed_string... Names, local_tensor_type L>
pvary_t<L, Names...> pvary_view(const L& x) {
  using R = pvary_t<L, Names...>;
  return R(x.view(), x.mesh(), x.device());
}

/// Global offset of this device's block along dimension `d` of `L` (its rank in the group of the
/// axes that shard `d`, times the block extent).
template <local_tensor_type L>
std::size_t global_offset(const L& x, std::size_t d) {
  return x.mesh().group_rank(x.device(), L::dims_type::at(d)) * x.extent(d);
}

/// Per-device run tables of multi-tensor kernels (nn/detail/simd.hpp, `run_table`) in the kernels'
/// memory. A step's runs are the same every step (the same parameters, gradients and state), so a
/// table is copied to the device only when it differs from the one there: once, not per step (on a
/// GPU each copy is a transfer the step would wait for). Only device `dev`'s thread uses slot `dev`.
class run_table_buffers {
 public:
  run_table_buffers() = default;
  explicit run_table_buffers(std::size_t devices) : tables_(devices), last_(devices) {}
  /// Device `dev`'s copy of `words` in the kernels' memory, valid until the next call for `dev`.
  const std::size_t* upload(std::size_t dev, const std::vector<std::size_t>& words) {
    auto& last = last_.at(dev);
    std::size_t* p = tables_.get(dev, words.size());
    if (p != last.at || last.words != words) {
      meshlib::copy_from_host<default_memory_space>(p, words.data(), words.size());
      last.at = p;
      last.words = words;
    }
    return p;
  }

 private:
  struct uploaded {
    const std::size_t* at = nullptr;  ///< where the table was copied to
    std::vector<std::size_t> words;   ///< what was copied there
  };
  device_buffers<std::size_t> tables_;
  std::vector<uploaded> last_;
};

}  // namespace meshlib::nn::detail
// end meshlib/nn/buffers.hpp
// begin meshlib/nn/detail/kernels.hpp
/// @file
/// @brief The small Kokkos kernels the training layers share: fill, converting copy, and a launch
/// over blocks of columns for column sums (bias gradients, norm parameters). Each is one RangePolicy
/// `parallel_for` on the running device's execution-space instance (`meshlib::launch`, the one
/// launch safe from concurrent device threads on Kokkos 3.4.1, see tensor/view.hpp), over memory
/// `Space`; the bodies are the plain loops they replaced, so the compiler vectorises them as before.
///
/// Column sums are deterministic: a work item owns a block of columns and adds the rows into them
/// in row order, so every column's sum is the same chain of additions on every mesh and backend
/// (bitwise), with no atomics and no `parallel_reduce` (unsafe from several device threads on
/// Kokkos 3.4.1). Within a block the rows are added a row at a time, contiguous over the block's
/// columns: the vectorised loop of the row-by-row sum it replaced.
/// @code
/// detail::fill_values<Space>(g, n, 0.0f);
/// detail::for_column_blocks<Space>(cols, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
///   for (std::size_t i = 0; i < rows; ++i)
///     for (std::size_t j = j0; j < j1; ++j) s[j] += x[i * cols + j];   // s = column sums of x
/// });
/// @endcode

#include <cstddef>
#include <type_traits>


namespace meshlib::nn::detail {

/// `p[i] = v` for `[0, n)` of memory `Space`, as a Kokkos kernel on the running device's instance.
template <class Space, class T>
void fill_values(T* p, std::size_t n, std::type_identity_t<T> v) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = v; });
}

/// `to[i] = To(from[i])` for `[0, n)` of memory `Space` (a copy, or a conversion such as float to
/// bfloat16), as a Kokkos kernel on the running device's instance.
template <class Space, class To, class From>
void convert_copy(To* to, const From* from, std::size_t n) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { to[i] = static_cast<To>(from[i]); });
}

/// Columns per work item of `for_column_blocks` on the host: a layer of up to 1024 outputs is one
/// work item, the row-by-row loop it replaced (its rows stream through memory in order); narrower
/// blocks were measured slower there (256 columns: 10-30% on a 256 x 1024 bias gradient, GCC 12
/// -O2, Serial), and a wider layer still splits over a device's cores.
inline constexpr std::size_t column_block = 1024;

/// Columns per work item of `for_column_blocks` in memory `Space`: `column_block` where the host
/// runs the kernel, one column on a GPU. There a 1024-column block made a layer's whole bias
/// gradient (and the activation's cotangent fused with it) one GPU thread; one column per thread
/// spreads the columns over the GPU's cores and lets neighbouring threads read neighbouring
/// elements of a row together. The sums are the same either way: every column's rows are added in
/// row order by one work item (not measured on a GPU yet).
template <class Space>
inline constexpr std::size_t column_block_for = host_accessible_v<Space> ? column_block : 1;

/// The work item of `for_column_blocks`: block `b` of `width` columns calls `f(j0, j1)`. A class
/// rather than a lambda: nvcc refuses an extended device lambda in a function templated on a type
/// local to another function (the caller's lambda `F`).
template <class F>
struct column_blocks_kernel {
  std::size_t cols, width;
  F f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    const std::size_t j0 = b * width, j1 = j0 + width < cols ? j0 + width : cols;
    f(j0, j1);
  }
};

/// Calls `f(j0, j1)` for the blocks `[j0, j1)` of `[0, cols)`, `column_block_for<Space>` wide, as
/// a Kokkos kernel on memory `Space` on the running device's instance, one work item per block (see
/// the file comment). `f` is a `KOKKOS_LAMBDA` (it runs in the kernel), written outside code
/// templated on a mesh (nn/detail/layer_kernels.hpp says why). An element-wise kernel over `n`
/// values uses it too: on the host its blocks of 1024 run on vectors (`for_each_lane`), on a GPU one
/// value per thread.
template <class Space, class F>
void for_column_blocks(std::size_t cols, const F& f) {
  constexpr std::size_t width = column_block_for<Space>;
  meshlib::launch<Space>((cols + width - 1) / width, column_blocks_kernel<F>{cols, width, f});
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/kernels.hpp
// begin meshlib/nn/detail/layer_kernels.hpp
/// @file
/// @brief The element-wise and row-wise kernels of the dense, activation, dropout, residual,
/// positional-embedding and embedding layers. Each is one RangePolicy `parallel_for` on the running
/// device's instance over memory `Space` (`meshlib::launch`), or a launch over blocks of
/// columns for sums over rows (`for_column_blocks`, rows added in row order: the same bits on every
/// mesh and backend); the bodies are the loops the layers ran before.
///
/// Why free functions over pointers, templated on the element type and the memory space only, and
/// not lambdas in the layers: nvcc names an extended device lambda's kernel after its enclosing
/// function, and its generated host stub spells a class-type template argument (the mesh's
/// `axis<"data">`, a `fixed_string`) in a form GCC cannot parse, so a kernel written inside code
/// templated on a mesh does not compile for CUDA (docs/design.md). tests/cuda/nn_layers.cpp
/// instantiates the layers for `CudaSpace`.

#include <cstddef>
#include <cstdint>

// begin meshlib/nn/detail/simd.hpp
/// @file
/// @brief A few-lane float vector for the elementwise kernels of the training step (optimizer
/// updates), written once as a generic body that runs on `float` (the tail, and compilers without
/// vector extensions) and on `simd_float` (the bulk); and the Kokkos kernels that run such bodies,
/// and the sum of squares of global-norm clipping, on the running device's execution-space
/// instance (`meshlib::launch`: a RangePolicy `parallel_for`, the one launch safe from
/// concurrent device threads on Kokkos 3.4.1, see tensor/view.hpp).
///
/// Each work item of a kernel is a block of `kernel_block` elements: the constants are copied into
/// locals once per block (not re-read through the kernel object after every store), and the block
/// runs the lane loop as a plain loop would, so the kernel is as fast as the loop it replaced.
///
/// Why not leave it to the auto-vectoriser: `std::sqrt` sets `errno`, which keeps GCC and Clang from
/// vectorising any loop that calls it unless the user builds with `-fno-math-errno`, and GCC 12's
/// `-O2` vectorises only loops whose trip count is a multiple of the vector width. Every lane
/// operation here (+ - * / and `sqrtps`) is the correctly rounded IEEE operation the scalar code
/// performs, so a body gives bitwise the same numbers on `float` and on `simd_float` (the compiler
/// contracts a*b+c into an FMA, where the flags allow it, in both forms alike).
/// @code
/// struct twice_sqrt {   // y = 2 sqrt(x)
///   float* y; const float* x;
///   template <class K> KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
///     detail::store_at(y, i, detail::sqrt_of(detail::load_as(x, i, k[0])) * k[0]);
///   }
/// };
/// detail::for_lanes<Space>(n, std::array<float, 1>{2.0f}, twice_sqrt{y, x});
/// @endcode

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>


// Not in nvcc's device pass (`__CUDA_ARCH__`): a GPU thread runs the scalar form of the bodies.
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__SSE2__) || defined(__AVX__)) && !defined(__CUDA_ARCH__)
#include <immintrin.h>
#define MESHLIB_NN_SIMD 1
#else
#define MESHLIB_NN_SIMD 0
#endif

namespace meshlib::nn::detail {

#if MESHLIB_NN_SIMD
#if defined(__AVX__)
/// Lanes of `simd_float`: the widest float vector the target has (AVX 8, SSE2 4).
inline constexpr std::size_t simd_lanes = 8;
#else
inline constexpr std::size_t simd_lanes = 4;
#endif
/// `simd_lanes` floats (GCC/Clang vector extension: + - * / work lane by lane).
using simd_float = float __attribute__((vector_size(simd_lanes * sizeof(float))));

/// Loads `simd_lanes` floats from `p` (no alignment needed).
inline simd_float load(const float* p) noexcept {
  simd_float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
/// Stores `v` to `p` (no alignment needed).
inline void store(float* p, simd_float v) noexcept { std::memcpy(p, &v, sizeof v); }
/// Loads element(s) `i` of `p` as the optimizer's lanes (`load_as`'s form for `simd_float`, which
/// is narrower than `simd_of<float>` on AVX-512 and exists in CUDA translation units too).
inline simd_float load_as(const float* p, std::size_t i, simd_float) noexcept { return load(p + i); }
/// Stores the optimizer's lanes `v` at element(s) `i` of `p`.
inline void store_at(float* p, std::size_t i, simd_float v) noexcept { store(p + i, v); }
/// Every lane `s`.
inline simd_float splat(float s) noexcept {
  simd_float v;
  for (std::size_t i = 0; i < simd_lanes; ++i) v[i] = s;
  return v;
}
/// Lane-wise correctly rounded square root (`sqrtps`, as `std::sqrt` per lane).
inline simd_float sqrt_of(simd_float v) noexcept {
#if defined(__AVX__)
  return reinterpret_cast<simd_float>(_mm256_sqrt_ps(reinterpret_cast<__m256>(v)));
#else
  return reinterpret_cast<simd_float>(_mm_sqrt_ps(reinterpret_cast<__m128>(v)));
#endif
}
#else
inline constexpr std::size_t simd_lanes = 1;
#endif

/// `std::sqrt(v)` (the scalar form of `sqrt_of`).
KOKKOS_INLINE_FUNCTION float sqrt_of(float v) noexcept { return std::sqrt(v); }

/// Elements per work item of the kernels below (see the file comment): a multiple of every lane
/// count, small enough that a few million elements give every core many items.
inline constexpr std::size_t kernel_block = 1024;

/// Calls `f(i, c)` for the elements `[i0, i1)`: over the bulk, for lanes `[i, i + simd_lanes)` with
/// `c` the constants `k` each splat to a `simd_float`; over the rest, for element `i` with `c == k`.
/// The constants are splat once, outside the loop, into a local the stores cannot alias (a member
/// read through `this` in the loop would be reloaded and re-splat after every store).
template <std::size_t K, class F>
KOKKOS_INLINE_FUNCTION void lanes_of_block(std::size_t i0, std::size_t i1, const std::array<float, K>& k, const F& f) {
  std::size_t i = i0;
#if MESHLIB_NN_SIMD
  std::array<simd_float, K> kv;
  for (std::size_t j = 0; j < K; ++j) kv[j] = splat(k[j]);
  for (; i + simd_lanes <= i1; i += simd_lanes) f(i, kv);
#endif
  const std::array<float, K> ks = k;
  for (; i < i1; ++i) f(i, ks);
}

/// The work item of `for_lanes`: block `b` of `kernel_block` elements. A class rather than a lambda:
/// nvcc refuses an extended device lambda in a function templated on another function's local type.
template <std::size_t K, class F>
struct lanes_kernel {
  std::size_t n;
  std::array<float, K> k;
  F f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    const std::size_t i0 = b * kernel_block, i1 = i0 + kernel_block < n ? i0 + kernel_block : n;
    lanes_of_block(i0, i1, k, f);
  }
};

/// Calls `f(i, c)` for the elements `[0, n)` (as `lanes_of_block`), as a Kokkos kernel on memory
/// `Space` on the running device's instance, one work item per block of `kernel_block` elements.
/// `f` reads with `load_as(p, i, c[0])` and writes with `store_at`; it is a class with a
/// `KOKKOS_INLINE_FUNCTION` call operator templated on the lane type (`float` or `simd_float`): nvcc
/// refuses a generic extended lambda.
template <class Space, std::size_t K, class F>
void for_lanes(std::size_t n, const std::array<float, K>& k, const F& f) {
  meshlib::launch<Space>((n + kernel_block - 1) / kernel_block, lanes_kernel<K, F>{n, k, f});
}


// ---- Lanes of a row: the layers' kernels over runs of channels ----
//
// The layers' row loops (a pixel's channels, a column block's sums over rows) read and write
// through several pointers, so GCC 12 at -O2 keeps them scalar: it vectorises only loops whose trip
// count is a multiple of the vector width and needs no check that the pointers do not overlap.
// Measured in the ResNet flagship (perf, 2026-12-07): im2col's copies, col2im's sums, batch norm and
// max pooling were scalar loops, about 47% of a step. `for_each_lane` runs such a loop's body on native
// vectors of the element type over the bulk of the run and on single elements over the rest; a body
// applies the same IEEE operations in the same order to every element in both forms, so the results
// are bitwise those of the scalar loop (sums over rows stay in row order: lanes run across columns).
// Where the target has FMA (`-march=haswell` and later) and contraction is on (GCC's default), the
// compiler decides per expression whether `a * b + c` becomes one rounding: there a body and the loop
// it replaced may differ in the last bit (measured: average pooling's backward with 3x3 windows).

// The row lanes' vectors (and conv2d's, nn/detail/conv2d_kernels.hpp) are host-compiler code only:
// in a CUDA or HIP translation unit nvcc's (and hipcc's) front end would parse the bodies' vector
// comparisons and selects in its host pass too, so there (where the work runs on the GPU anyway)
// the host loops stay scalar. They need no intrinsics: GCC/Clang vector extensions on x86 or Arm.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && !defined(__HIPCC__) && \
    (defined(__SSE2__) || defined(__ARM_NEON))
#define MESHLIB_NN_ROW_LANES 1
#if defined(__AVX512F__)
/// Bytes of `simd_of<T>`: the widest vector registers the target has (AVX-512 64, AVX 32, SSE2 and NEON 16).
inline constexpr std::size_t simd_bytes = 64;
#elif defined(__AVX__)
inline constexpr std::size_t simd_bytes = 32;
#else
inline constexpr std::size_t simd_bytes = 16;
#endif
#else
#define MESHLIB_NN_ROW_LANES 0
#endif

#if MESHLIB_NN_ROW_LANES
/// A native vector of `T` (`float`, `double`, `std::uint32_t`, ...), `simd_bytes` long: a class
/// member typedef, as GCC drops a vector attribute on a dependent alias template.
template <class T>
struct simd_of {
  typedef T type __attribute__((vector_size(simd_bytes)));
};
/// Loads `simd_of<T>` lanes from element `i` of `p` (no alignment needed).
template <class T>
inline typename simd_of<T>::type load_as(const T* p, std::size_t i, typename simd_of<T>::type) noexcept {
  typename simd_of<T>::type v;
  std::memcpy(&v, p + i, sizeof v);
  return v;
}
/// Stores the lanes `v` at element `i` of `p`.
template <class T>
inline void store_at(T* p, std::size_t i, typename simd_of<T>::type v) noexcept {
  std::memcpy(p + i, &v, sizeof v);
}
#endif
/// Element `i` of `p` (the scalar form of the vector `load_as`, for any element type).
template <class T>
KOKKOS_INLINE_FUNCTION T load_as(const T* p, std::size_t i, T) noexcept {
  return p[i];
}
/// Stores `v` at element `i` of `p`.
template <class T>
KOKKOS_INLINE_FUNCTION void store_at(T* p, std::size_t i, T v) noexcept {
  p[i] = v;
}
/// `s` as the lane type `L` of a body (`L` itself, or every lane of a vector `L`).
template <class L, class S>
KOKKOS_INLINE_FUNCTION L splat_as(S s) noexcept {
  if constexpr (std::is_arithmetic_v<L>) {
    return static_cast<L>(s);
  } else {
    using E = std::remove_cvref_t<decltype(L{}[0])>;
    L v{};  // lane by lane, not `L{} + s`: 0 + (-0) is +0, and a splat keeps the sign of a zero
    for (std::size_t k = 0; k < sizeof(L) / sizeof(E); ++k) v[k] = static_cast<E>(s);
    return v;
  }
}

/// The lane type of 32-bit indices beside float lanes `L`: `std::uint32_t` for a `float`, a vector
/// of as many `std::uint32_t` lanes for a float vector.
template <class L>
struct lane_index {
  using type = std::uint32_t;
};
#if MESHLIB_NN_ROW_LANES
template <>
struct lane_index<simd_of<float>::type> {
  using type = simd_of<std::uint32_t>::type;
};
#endif
/// See `lane_index`.
template <class L>
using lane_index_t = typename lane_index<L>::type;

/// Calls `f(j, lane)` for every `j` in `[j0, j1)`: where the host has native vectors (and `Vectorize`),
/// for `j` a step of `simd_of<T>`'s lanes apart with `lane` a `simd_of<T>::type` over the bulk, then
/// one element at a time with `lane` a `T`. `f` reads with `load_as(p, j, lane)`, writes with
/// `store_at(p, j, v)`, and writes constants as `splat_as<L>(c)`; it is a generic lambda written inside
/// the kernel (a plain lambda there, which nvcc accepts, unlike a generic extended lambda).
template <class T, bool Vectorize = true, class F>
KOKKOS_INLINE_FUNCTION void for_each_lane(std::size_t j0, std::size_t j1, const F& f) {
  std::size_t j = j0;
#if MESHLIB_NN_ROW_LANES
  if constexpr (Vectorize) {
    using V = typename simd_of<T>::type;
    constexpr std::size_t lanes = sizeof(V) / sizeof(T);
    for (; j + lanes <= j1; j += lanes) f(j, V{});
  }
#endif
  for (; j < j1; ++j) f(j, T{});
}

/// Sum of `double(x[i])^2` over `[i0, i1)`, in four interleaved partial sums (one running sum is a
/// chain of dependent additions, four times slower).
KOKKOS_INLINE_FUNCTION double squares_of_block(const float* x, std::size_t i0, std::size_t i1) noexcept {
  double s[4] = {0, 0, 0, 0};
  std::size_t i = i0;
  for (; i + 4 <= i1; i += 4)
    for (std::size_t k = 0; k < 4; ++k) s[k] += static_cast<double>(x[i + k]) * x[i + k];
  for (; i < i1; ++i) s[0] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// A run of a multi-tensor kernel: `n` floats at `x`, in the memory of the kernel's space.
struct float_run {
  const float* x;  ///< the first element
  std::size_t n;   ///< the number of elements
};

/// The words one run takes in a run table (`run_table`): its address, its length, its first block.
inline constexpr std::size_t run_words = 3;

/// Writes the run table of `runs` into `words` (`run_words` per run that is not empty, in order:
/// address, length, index of its first block of `kernel_block` elements over all the runs) and
/// returns the number of blocks over all the runs. A multi-tensor kernel reads the table from the
/// kernel's memory (`run_table_buffers`), so one launch covers every run of a device.
inline std::size_t run_table(const std::vector<float_run>& runs, std::vector<std::size_t>& words) {
  words.clear();
  std::size_t blocks = 0;
  for (const float_run& r : runs) {
    if (r.n == 0) continue;
    words.push_back(reinterpret_cast<std::uintptr_t>(r.x));
    words.push_back(r.n);
    words.push_back(blocks);
    blocks += (r.n + kernel_block - 1) / kernel_block;
  }
  return blocks;
}

/// The run that block `b` of a run table of `runs` runs lies in (a binary search: the last run whose
/// first block is at most `b`; no run of the table is empty). `stride` words per run, the first
/// block at word `at` of each (`run_table`'s layout by default; the optimizer's table is wider).
KOKKOS_INLINE_FUNCTION std::size_t run_of_block(const std::size_t* table, std::size_t runs, std::size_t b,
                                                std::size_t stride = run_words, std::size_t at = 2) noexcept {
  std::size_t lo = 0, hi = runs;  // the run is in [lo, hi)
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (table[mid * stride + at] <= b) lo = mid;
    else hi = mid;
  }
  return lo;
}

/// Sum of `double(x[i])^2` over every element of the runs of `table` (memory `Space`; `runs` runs,
/// `blocks` blocks, as `run_table` made it), one multi-tensor reduction for all of a device's runs:
/// a Kokkos kernel on the running device's instance writes one partial sum per block of
/// `kernel_block` elements of a run into `scratch` (memory `Space`, `blocks + 1` elements), one work
/// item adds them into its last element, and the host reads that one number back (a copy only for
/// device memory). Two launches and one read-back per device instead of as many per run (issue 38:
/// few kernels per step).
/// A `parallel_for` and not a `parallel_reduce`, which Kokkos 3.4.1 Serial cannot run from several
/// device threads at once (tensor/view.hpp). The blocks are fixed (they start at each run's first
/// element) and the finishing item adds them in a fixed order, the blocks of a run into the run's
/// sum (from 0), then the runs' sums into the total (from 0), in run order: the sum is bitwise
/// reproducible on every backend and thread count, and the same bits as summing each run with its
/// own reduction and adding the results in run order on the host. That order differs from one
/// running sum only in the last bits of a double, which the float clip scale does not see.
template <class Space>
double sum_of_squares(const std::size_t* table, std::size_t runs, std::size_t blocks, double* scratch) {
  if (blocks == 0) return 0.0;
  double* part = scratch;
  meshlib::launch<Space>(blocks, KOKKOS_LAMBDA(std::size_t b) {
    const std::size_t* r = table + run_of_block(table, runs, b) * run_words;
    const auto* x = reinterpret_cast<const float*>(r[0]);
    const std::size_t n = r[1], i0 = (b - r[2]) * kernel_block, i1 = i0 + kernel_block < n ? i0 + kernel_block : n;
    part[b] = squares_of_block(x, i0, i1);
  });
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    double total = 0;
    for (std::size_t k = 0; k < runs; ++k) {
      const std::size_t* r = table + k * run_words;
      const std::size_t b0 = r[2], b1 = b0 + (r[1] + kernel_block - 1) / kernel_block;
      double s = 0;
      for (std::size_t b = b0; b < b1; ++b) s += part[b];
      total += s;
    }
    part[blocks] = total;
  });
  return meshlib::read_back<Space>(part + blocks);
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/simd.hpp

namespace meshlib::nn::detail {

/// `y += bias` (`add`) or `y = bias` on every row of `y` (`rows x out`), one work item per row.
template <class Space, class T>
void add_bias(T* y, const T* bias, std::size_t rows, std::size_t out, bool add) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    T* yi = y + i * out;
    const T* bj = bias;
    if (add)
      for_each_lane<T>(0, out, [&](std::size_t j, auto lane) { store_at(yi, j, load_as(yi, j, lane) + load_as(bj, j, lane)); });
    else
      for_each_lane<T>(0, out, [&](std::size_t j, auto lane) { store_at(yi, j, load_as(bj, j, lane)); });
  });
}

/// `gb (+)= the column sums of d` (`rows x out`; `fresh`: write instead of add), each column's rows
/// added in row order.
template <class Space, class T>
void bias_grad(T* gb, const T* d, std::size_t rows, std::size_t out, bool fresh) {
  for_column_blocks<Space>(out, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* s = gb;  // locals: the stores below cannot be taken to change them
    const T* dr = d;
    if (fresh) for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(s, j, decltype(lane){}); });
    for (std::size_t i = 0; i < rows; ++i, dr += out)
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(s, j, load_as(s, j, lane) + load_as(dr, j, lane)); });
  });
}

/// Whether activation `Fn`'s `f` (and `vjp`) also take native vectors lane by lane (`static constexpr
/// bool on_lanes = true`): then its kernels run on `for_each_lane`'s vectors, else one element at a time.
template <class Fn>
inline constexpr bool has_lanes_v = requires { requires Fn::on_lanes; };

/// `y[i] = Fn::f(x[i])` for `[0, n)`: an activation's forward.
template <class Space, class Fn, class T>
void activation_forward(T* y, const T* x, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T, has_lanes_v<Fn>>(i0, i1, [&](std::size_t i, auto lane) { store_at(y, i, Fn::f(load_as(x, i, lane))); });
  });
}

/// The cotangent an elementwise activation `Fn` hands back for `dy` at its input `x`: `Fn::vjp(dy,
/// x)` where the activation has its own (branch-free) one, else `dy * Fn::df(x)`. One expression for
/// `activation_backward` and `activation_bias_backward`, so the two kernels cannot drift apart.
template <class Fn, class T>
KOKKOS_INLINE_FUNCTION T activation_cotangent(T dy, T x) {
  if constexpr (requires { Fn::vjp(T{}, T{}); }) return Fn::vjp(dy, x);
  else return dy * Fn::df(x);
}

/// An activation's backward at inputs `x`: `dx = Fn::vjp(d, x)` where the activation has its own
/// (branch-free) cotangent, else `dx = d * Fn::df(x)`.
template <class Space, class Fn, class T>
void activation_backward(T* dx, const T* d, const T* x, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T, has_lanes_v<Fn>>(i0, i1, [&](std::size_t i, auto lane) {
      store_at(dx, i, activation_cotangent<Fn>(load_as(d, i, lane), load_as(x, i, lane)));
    });
  });
}

/// An activation's backward fused with the bias gradient of the dense layer below it, in one launch
/// where `activation_backward` then `bias_grad` were two: `d = activation_cotangent<Fn>(dy, x)` over
/// `rows x out`, and `gb (+)= the column sums of d` (`fresh`: write instead of add). Bitwise the two
/// kernels: every element of `d` is the same expression, and every column's sum the same chain of
/// additions in row order (a work item owns a block of columns, as in `bias_grad`). `d` is stored
/// before it is added, so the sum adds the rounded value `bias_grad` read back.
template <class Space, class Fn, class T>
void activation_bias_backward(T* d, T* gb, const T* dy, const T* x, std::size_t rows, std::size_t out, bool fresh) {
  for_column_blocks<Space>(out, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* s = gb;  // locals: the stores below cannot be taken to change them
    T* dr = d;
    const T* dyr = dy;
    const T* xr = x;
    if (fresh) for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(s, j, decltype(lane){}); });
    for (std::size_t i = 0; i < rows; ++i, dr += out, dyr += out, xr += out)
      for_each_lane<T, has_lanes_v<Fn>>(j0, j1, [&](std::size_t j, auto lane) {
        const auto dj = activation_cotangent<Fn>(load_as(dyr, j, lane), load_as(xr, j, lane));
        store_at(dr, j, dj);
        store_at(s, j, load_as(s, j, lane) + dj);
      });
  });
}

/// Dropout's forward on a `rows x cols` block whose first element is `(r0, c0)` of a `gcols`-wide
/// global array: `mask = keep` where the element's counter-based uniform draw is at least `rate`,
/// else 0, and `y = x * mask`. One work item per row (its global index computed once).
template <class Space, class T>
void dropout_forward(T* y, T* mask, const T* xp, std::size_t rows, std::size_t cols, std::size_t r0, std::size_t c0,
                     std::size_t gcols, rng_key key, float rate, T keep) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const std::uint64_t row = static_cast<std::uint64_t>((r0 + i) * gcols + c0);
    for (std::size_t j = 0; j < cols; ++j) {
      mask[i * cols + j] = uniform(key, row + j) >= rate ? keep : T{0};
      y[i * cols + j] = xp[i * cols + j] * mask[i * cols + j];
    }
  });
}

/// `out[i] = a[i] * b[i]` for `[0, n)` (dropout's backward: the cotangent times the mask).
template <class Space, class T>
void multiply_values(T* out, const T* a, const T* b, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T>(i0, i1, [&](std::size_t i, auto lane) { store_at(out, i, load_as(a, i, lane) * load_as(b, i, lane)); });
  });
}

/// `out[i] = a[i] + b[i]` for `[0, n)` (a residual connection and its cotangent).
template <class Space, class T>
void sum_values(T* out, const T* a, const T* b, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T>(i0, i1, [&](std::size_t i, auto lane) { store_at(out, i, load_as(a, i, lane) + load_as(b, i, lane)); });
  });
}

/// `y = x + w[position]` over `rows` tokens of `d` features, token `i` at position `i % seq`.
template <class Space, class T>
void add_positions(T* y, const T* xp, const T* w, std::size_t rows, std::size_t d, std::size_t seq) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* wr = w + (i % seq) * d;
    for (std::size_t j = 0; j < d; ++j) y[i * d + j] = xp[i * d + j] + wr[j];
  });
}

/// `g[position] += dy` for every token (the positional table's gradient), tokens in order.
template <class Space, class T>
void position_grad(T* g, const T* dyp, std::size_t rows, std::size_t d, std::size_t seq) {
  for_column_blocks<Space>(d, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* gs = g;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = j0; j < j1; ++j) gs[(i % seq) * d + j] += dyp[i * d + j];
  });
}

/// Row `i` of `y` = row `id[i] - v0` of this device's table rows `w` (`vl x d`, vocabulary range
/// `[v0, v0 + vl)`), zeros where the id is another device's.
template <class Space, class T>
void lookup_rows(T* y, const T* w, const std::int32_t* id, std::size_t rows, std::size_t d, std::size_t v0,
                 std::size_t vl) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const std::size_t v = static_cast<std::size_t>(id[i]);
    T* yi = y + i * d;
    if (v >= v0 && v < v0 + vl) {
      const T* wr = w + (v - v0) * d;
      for (std::size_t j = 0; j < d; ++j) yi[j] = wr[j];
    } else {
      for (std::size_t j = 0; j < d; ++j) yi[j] = T{0};
    }
  });
}

/// `g[id[i] - v0] += dy[i]` for the tokens whose id is in this device's range, tokens in order.
template <class Space, class T>
void scatter_add_rows(T* g, const T* dyp, const std::int32_t* id, std::size_t n, std::size_t d, std::size_t v0,
                      std::size_t vl) {
  for_column_blocks<Space>(d, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* gs = g;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t v = static_cast<std::size_t>(id[i]);
      if (v < v0 || v >= v0 + vl) continue;  // another device's row
      for (std::size_t j = j0; j < j1; ++j) gs[(v - v0) * d + j] += dyp[i * d + j];
    }
  });
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/layer_kernels.hpp
// begin meshlib/nn/layers/shape_checks.hpp
/// @file
/// @brief What the layers and `sequential` check about the shapes and shardings they receive, and
/// the words their errors use, written once so every layer's message reads alike.
///
/// Why: a layer that takes its input width from the data and never compares it with its weight
/// reads past the weight (a segfault) or, when the sizes happen to fit, trains on garbage. Every
/// layer with parameters compares the widths it receives with its parameters' (forward and
/// backward), and `sequential` compares consecutive layers once, at construction; the shardings of a
/// composition are checked at compile time, in one `static_assert` naming both layers.
///
/// The layer protocol `sequential` reads (each part optional, so a user's layer needs none of it):
/// - `in_features()`, `out_features()`: the global widths the layer takes and returns;
/// - `keeps_features` (a `static constexpr bool`): the layer returns the width it receives
///   (activations, dropout), so the widths before and after it must agree;
/// - `name()`, `to_string()`: how messages name the layer (`fc1`, `fc1 (column_dense 8 -> 16, ...)`);
/// - `accepts_input<X>` (a `static constexpr bool` template), `diagnostic_name` and
///   `input_requirement` (types): whether `forward(X)` is legal, and how a compile-time error names
///   the layer and what it needs;
/// - `backward_names_input` (a `static constexpr bool`): its backward is `backward<X>(dy, need_dx)`
///   with `X` the forward's input type (`sequential`, `remat`), which `sequential` supplies.

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>


namespace meshlib::diagnostic {
/// Layer `Index` of a `sequential`, of kind `Kind` (an `op` naming it, or the layer's type).
template <std::size_t Index, class Kind>
struct layer {};
/// What the first layer of a `sequential` receives: the network's input.
struct network_input {};
/// A layer's need: the feature dimension (the last) sharded over exactly `Axes` (none: complete
/// on every device), and not a pending sum.
template <class Axes>
struct features_sharded_over {};
/// A layer's need: the rows (the batch, dimension 0) sharded over exactly `Axes` (`batch_norm`'s data axis).
template <class Axes>
struct rows_sharded_over {};
/// A layer's need: values that are not a pending sum (an elementwise map of a sum is not the sum
/// of the maps).
struct complete_values {};
/// A layer's need: values that do not vary over `Axes` (the same on every device of them):
/// `transformer_block` adds its input to the attention's output, which a psum over them completes.
template <class Axes>
struct replicated_over {};
/// A layer's need: a block of rank `R` (`dropout`: rank 2, rows and features).
template <std::size_t R>
struct rank {};
}  // namespace meshlib::diagnostic

namespace meshlib::nn::detail {

/// `"16 features (8 per device over 2 devices of 'model')"`, or `"10 features"` when `axes` is empty
/// (`unit`: "features", "rows").
template <mesh_type Mesh>
std::string width_text(std::size_t local, axis_mask axes, const Mesh& mesh, const char* unit = "features") {
  const std::size_t n = mesh.axes_size(axes);
  if (axes == 0 || n == 1) return std::to_string(local) + " " + unit;
  std::string names;
  for (std::size_t i = 0; i < Mesh::ndim; ++i)
    if (axes & (axis_mask{1} << i)) names += (names.empty() ? "'" : " x '") + std::string(Mesh::axis_names[i]) + "'";
  return std::to_string(local * n) + " " + unit + " (" + std::to_string(local) + " per device over " +
         std::to_string(n) + " devices of " + names + ")";
}

/// `" sharded over 'model'"` for an axis set (empty: `""`).
template <mesh_type Mesh>
std::string sharded_over_text(axis_mask axes) {
  std::string names;
  for (std::size_t i = 0; i < Mesh::ndim; ++i)
    if (axes & (axis_mask{1} << i)) names += (names.empty() ? "'" : " x '") + std::string(Mesh::axis_names[i]) + "'";
  return names.empty() ? "" : " sharded over " + names;
}

/// The check of a layer's backward: `dy` (`rows x cols` on device `dev`) must be shaped as the last
/// forward's output there (`fwd_rows x fwd_cols`; `ran`: a forward ran there), whether the layer
/// keeps its input's shape (`relu`, norms) or not (`conv2d`, pools, `embedding`, `tied_head`).
/// `who`: `"relu"`, `"ln1 (...)"`.
inline void check_output_cotangent(const std::string& who, std::size_t dev, std::size_t rows, std::size_t cols,
                                   bool ran, std::size_t fwd_rows, std::size_t fwd_cols) {
  const std::string head = "meshlib::nn: " + who + ".backward";
  if (!ran)
    throw sharding_error(head + " ran on device " + std::to_string(dev) +
                         " before any forward there; run forward first (backward uses what it saved)");
  if (rows != fwd_rows || cols != fwd_cols)
    throw sharding_error(head + " received a cotangent of (" + std::to_string(rows) + ", " + std::to_string(cols) +
                         ") on device " + std::to_string(dev) + ", but the forward output there was (" +
                         std::to_string(fwd_rows) + ", " + std::to_string(fwd_cols) +
                         "); pass the cotangent of the last forward's output");
}

/// The check every layer that reads the sequence layout makes: a device's rows are whole sequences.
inline void check_whole_sequences(const std::string& who, std::size_t rows, std::size_t seq, std::size_t dev) {
  if (seq == 0 || rows % seq != 0)
    throw sharding_error("meshlib::nn: " + who + " received " + std::to_string(rows) + " tokens on device " +
                         std::to_string(dev) + ", not a whole number of sequences of " + std::to_string(seq) +
                         "; feed each device batch * " + std::to_string(seq) +
                         " tokens (rows are sequence-major) or set the layer's sequence length to the data's");
}

// ---- the protocol, read with defaults -----------------------------------------------------------

template <class L, class X>
consteval bool layer_accepts() {
  if constexpr (requires { L::template accepts_input<X>; }) return L::template accepts_input<X>;
  else return true;
}

template <class L>
struct layer_diagnostic_name {
  using type = L;
};
template <class L>
  requires requires { typename L::diagnostic_name; }
struct layer_diagnostic_name<L> {
  using type = typename L::diagnostic_name;
};

template <class L>
struct layer_input_requirement {
  using type = diagnostic::complete_values;
};
template <class L>
  requires requires { typename L::input_requirement; }
struct layer_input_requirement<L> {
  using type = typename L::input_requirement;
};

template <class L>
concept has_widths = requires(const L& l) {
  { l.in_features() } -> std::convertible_to<std::size_t>;
  { l.out_features() } -> std::convertible_to<std::size_t>;
};

template <class L>
consteval bool keeps_features() {
  if constexpr (requires { L::keeps_features; }) return L::keeps_features;
  else return false;
}

/// `l.backward(dy, need_dx)`, or `l.backward<X>(dy, need_dx)` for a layer that says its backward
/// names its forward's input type `X` (`backward_names_input`: `sequential`, `remat`), so
/// compositions nest.
template <class X, class L, class DY>
auto layer_backward(L& l, const DY& dy, bool need_dx) {
  if constexpr (requires { L::backward_names_input; }) return l.template backward<X>(dy, need_dx);
  else return l.backward(dy, need_dx);
}

/// `"layer 2, fc2 (row_dense 32 -> 4, input sharded over 'model'),"` for a message.
template <class L>
std::string layer_text(std::size_t index, const L& l) {
  std::string s = "layer " + std::to_string(index);
  if constexpr (requires { l.to_string(); }) s += ", " + l.to_string() + ",";
  else if constexpr (requires { l.name(); }) s += ", " + std::string(l.name()) + ",";
  return s;
}

/// The layer's name for "declare NAME with ...", else "layer I".
template <class L>
std::string layer_name(std::size_t index, const L& l) {
  if constexpr (requires { l.name(); }) return std::string(l.name());
  else return "layer " + std::to_string(index);
}

// ---- the compile-time errors a layer's forward shares ----------------------------------------------

/// The one error of a layer's `forward` given values of another element type than its parameters'
/// and buffers' (`Takes`, the layer's `T`): `Layer` is its `diagnostic_name`. Layers check it
/// before their layout, so the user reads the two types rather than a layout that looks right.
template <class Layer, class Takes, class Receives>
consteval bool layer_input_element_type_differs() {
  static_assert(meshlib::diagnostic::always_false<Layer, Takes, Receives>,
                "meshlib::nn: the layer computes in another element type than its input's: the condition spells out "
                "layer_input_element_type_differs<the layer, the element type it was declared with (its T), the "
                "input's element type>; declare the layer with the input's element type, or give it values of its own");
  return false;
}

/// The one error of a layer's `forward` given an input it cannot take, for the layers whose fix is
/// said by what they need (`Needs`, their `input_requirement`) and no error of their own: `Layer`
/// is its `diagnostic_name`, `Receives` the input's layout (`diagnostic::value_t`).
template <class Layer, class Receives, class Needs>
consteval bool layer_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: the layer cannot take this input: the condition spells out layer_input_does_not_fit<"
                "the layer, the input's layout (one dims<...> entry per dimension), what it needs>. "
                "features_sharded_over<axes<>>: a rank-2 block (tokens, features) of the layer's mesh whose features "
                "are complete and unsharded and not a pending sum (all_gather or psum them first; a batch of "
                "sequences is batch * sequence rows, sequence-major); replicated_over<axes<...>>: values that do not vary "
                "over those axes (the layout's vary<...> names none of them; do not pvary the input over them); "
                "rank<2>: a rank-2 block (rows, features)");
  return false;
}

/// What a diagnostic that compares two tensor types shows of `A` beside `B`: their layouts where
/// those differ, else the whole types (`sequential`'s cotangent check, `residual`'s branches).
template <class A, class B>
struct diagnostic_of {
  using type = A;
};
template <local_tensor_type A, local_tensor_type B>
  requires(!std::is_same_v<meshlib::diagnostic::value_t<A>, meshlib::diagnostic::value_t<B>>)
struct diagnostic_of<A, B> {
  using type = meshlib::diagnostic::value_t<A>;
};

// ---- the one compile-time error of sequential ------------------------------------------------------

template <class Layer, class Receives, class From, class Needs>
consteval bool sequential_layers_do_not_chain() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, From, Needs>,
                "meshlib::nn: sequential: a layer cannot take what the layer before it returns: their shardings do "
                "not chain. The condition spells out sequential_layers_do_not_chain<the layer (index, kind), the "
                "layout it receives, the layer it receives it from (or the network input), what it needs>. A "
                "row_dense needs its features sharded over its model axis (put a column_dense before it); a dense, "
                "column_dense or layer_norm needs complete, unsharded features (put a row_dense before it, or "
                "all_gather the features); reorder the layers or reshard between them");
  return false;
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/layers/shape_checks.hpp

namespace meshlib::nn {

/// @brief How a dense layer's weight is split (see the file comment).
enum class dense_kind { replicated, column, row };

namespace detail {
// Conditionals, not specialisations on <dense_kind::column, Model>: nvcc's front end matches no
// partial specialisation that deduces a fixed_string (collectives/axis_group.hpp), and would give
// every kind the unsharded specs.
template <dense_kind K, fixed_string Model>
struct dense_specs {
  using w = std::conditional_t<K == dense_kind::column, P<none, dim_spec(Model.chars)>,
                               std::conditional_t<K == dense_kind::row, P<dim_spec(Model.chars), none>, P<none, none>>>;
  using b = std::conditional_t<K == dense_kind::column, P<dim_spec(Model.chars)>, P<none>>;
};

/// The local type of `W^T` for a weight block of type `W` (dims swapped; nothing runs).
template <class W>
using transposed_t = with_dims_t<W, dim_masks<W::dims_type::at(1), W::dims_type::at(0)>>;

template <dense_kind K>
struct dense_kind_name {
  static constexpr fixed_string value = "dense";
};
template <>
struct dense_kind_name<dense_kind::column> {
  static constexpr fixed_string value = "column_dense";
};
template <>
struct dense_kind_name<dense_kind::row> {
  static constexpr fixed_string value = "row_dense";
};

/// See `basic_dense::accepts_input`.
template <class X, class Mesh, class T, axis_mask WRows, axis_mask WCols>
consteval bool dense_accepts() {
  if constexpr (!std::is_same_v<typename X::mesh_type, Mesh> ||
                !std::is_same_v<typename X::value_type, T>) {
    return false;
  } else if constexpr (X::rank != 2) {
    return false;
  } else {
    return X::partial == 0 && X::dims_type::at(1) == WRows && (X::dims_type::at(0) & WCols) == 0;
  }
}

template <class Layer, class Receives, class Needs>
consteval bool dense_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: a dense layer cannot take this input: the condition spells out "
                "dense_input_does_not_fit<the layer's kind, the input's layout, what it needs>. A row_dense needs its "
                "features sharded over its model axis (the output of a column_dense); a dense or column_dense needs "
                "complete, unsharded features (the output of a dense or row_dense, or all_gather them); no dense "
                "layer takes a pending sum (psum it first)");
  return false;
}
}  // namespace detail

/// @brief A dense layer; see `dense`, `column_dense`, `row_dense`.
template <class T, mesh_type Mesh, dense_kind Kind, fixed_string Model = "model">
class basic_dense {
 public:
  /// The sharding of the weight: replicated (`dense`), split over `Model` by output columns
  /// (`column_dense`) or by input rows (`row_dense`).
  using w_sharding = named_sharding<Mesh, typename detail::dense_specs<Kind, Model>::w>;
  /// The sharding of the bias: split over `Model` with the output columns (`column_dense`), else replicated.
  using b_sharding = named_sharding<Mesh, typename detail::dense_specs<Kind, Model>::b>;
  /// The weight, `in x out`.
  using weight_type = parameter<T, 2, w_sharding>;
  /// The bias, `out`.
  using bias_type = parameter<T, 1, b_sharding>;
  /// A device's block of the weight.
  using w_local = typename weight_type::local_type;

  /// The weight `W` (`y = x W + b`); its name is `name + ".w"`.
  weight_type w;
  /// The bias `b`; its name is `name + ".b"`.
  bias_type b;

  /// `in -> out` features; W ~ Glorot uniform from `key` (mesh-invariant), b = 0. Parameters are
  /// named `name + ".w"` / `".b"`. `local_devices`: this process's devices (empty: all).
  basic_dense(const Mesh& mesh, const std::string& name, std::size_t in, std::size_t out, rng_key key,
              std::span<const std::size_t> local_devices = {})
      : w(name + ".w", w_sharding{mesh}, {checked_split(mesh, name, in, out), out}, key,
          init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(in + out)))), true, local_devices),
        b(name + ".b", b_sharding{mesh}, {out}, key, init::zeros(), false, local_devices),
        name_(name),
        saved_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// The layer's name: its parameters are `name() + ".w"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The global number of input features (rows of W).
  [[nodiscard]] std::size_t in_features() const noexcept { return w.value.global_shape()[0]; }
  /// The global number of output features (columns of W).
  [[nodiscard]] std::size_t out_features() const noexcept { return w.value.global_shape()[1]; }
  /// `"fc2 (row_dense 32 -> 4, input sharded over 'model')"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    std::string s = name_ + " (" + std::string(kind_name.view()) + " " + std::to_string(in_features()) + " -> " +
                    std::to_string(out_features());
    if constexpr (w_sharding::dim_mask(0) != 0) s += ", input" + detail::sharded_over_text<Mesh>(w_sharding::dim_mask(0));
    if constexpr (w_sharding::dim_mask(1) != 0) s += ", output" + detail::sharded_over_text<Mesh>(w_sharding::dim_mask(1));
    return s + ")";
  }

  /// The kind, as messages spell it: `dense`, `column_dense` or `row_dense`.
  static constexpr fixed_string kind_name = detail::dense_kind_name<Kind>::value;
  /// Whether `forward(X)` is legal: the rules of `matmul(x, W)` (the input's features sharded as W's
  /// rows, no axis on both the rows and W's columns), for a complete (not pending-sum) input of
  /// this mesh and element type.
  template <class X>
  static constexpr bool accepts_input = detail::dense_accepts<X, Mesh, T, w_sharding::dim_mask(0), w_sharding::dim_mask(1)>();
  /// For compile-time messages: the kind, and what the input's features must be sharded over.
  using diagnostic_name = meshlib::diagnostic::op_t<kind_name>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<meshlib::diagnostic::axes_t<Mesh, w_sharding::dim_mask(0)>>;

  /// `y = x W + b` (`row`: `psum<Model>(x W) + b`). Saves `x` for the backward pass.
  /// @throws sharding_error when `x`'s width is not the weight's input width.
  template <local_tensor_type X>
  auto forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"dense.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::dense_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = x.device();
      const w_local wl = w.local(dev);
      using Z = decltype(meshlib::matmul(x, wl));  // the GSPMD rules check the shardings here
      using Y = typename detail::psum_if<Kind == dense_kind::row, Z, Model>::type;
      const std::size_t rows = x.extent(0), in = x.extent(1), out = wl.extent(1);
      if (in != wl.extent(0)) throw sharding_error(input_width_error(in, wl.extent(0), x.mesh()));
      saved_[dev] = {x.data(), rows, in};
      T* y = out_.get(dev, rows * out);
      const T* bias = b.value.local(dev).data();
      const cview xv(x.data(), rows, in), wv(wl.data(), in, out);
      if constexpr (Kind == dense_kind::row) {
        matmul_into(view(y, rows, out), xv, wv);
        // Donated: z wraps the layer's own buffer (an unmanaged view), so the sum lands in it.
        static_cast<void>(meshlib::psum<Model>(detail::wrap2<Z>(y, rows, out, x.mesh(), dev)));
        detail::add_bias<default_memory_space>(y, bias, rows, out, true);
      } else {
        detail::add_bias<default_memory_space>(y, bias, rows, out, false);  // y = b, then y += x W
        matmul_into(view(y, rows, out), xv, wv, {.beta = 1});
      }
      return detail::wrap2<Y>(y, rows, out, x.mesh(), dev);
    }
  }

  /// Accumulates `dW += x^T dy`, `db += sum_rows dy` (overwrites them when `grad_beta` says so) and returns `dx` (when `need_dx`; otherwise a
  /// tensor of the right type and shape whose contents are unspecified).
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output, or no
  /// forward ran on this device.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"dense.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved s = checked_saved(dy);
    // db (+)= the column sums of dy, each column's rows added in row order (bitwise the same on every mesh).
    detail::bias_grad<default_memory_space>(b.grad.local(dev).data(), dy.data(), s.rows, s.out, b.grad_beta(dev) == T{0});
    return backward_products(dy, s, need_dx);
  }

  /// `backward` fused with the backward of the elementwise activation `Fn` that ran on this layer's
  /// output (`sequential` calls it for a dense layer followed by `relu` or `gelu`): `dy` is the
  /// cotangent of the activation's output, `act_x` the activation's saved input (this layer's
  /// output) and `d` where the activation's cotangent goes (the activation's buffer). The
  /// activation's cotangent and this layer's bias gradient are one kernel
  /// (`detail::activation_bias_backward`) where they were two; the results are bitwise those of
  /// the activation's `backward` followed by this `backward`.
  /// @throws sharding_error as `backward` does.
  template <class Fn, local_tensor_type DY>
  auto backward_through(const DY& dy, const T* act_x, T* d, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"dense.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved s = checked_saved(dy);
    detail::activation_bias_backward<default_memory_space, Fn>(d, b.grad.local(dev).data(), dy.data(), act_x, s.rows,
                                                               s.out, b.grad_beta(dev) == T{0});
    return backward_products(DY(typename DY::view_type(d, s.rows, s.out), dy.mesh(), dev), s, need_dx);
  }

  /// Whether `sequential` may fuse the backward of an elementwise activation after this layer into
  /// this layer's (`backward_through`).
  static constexpr bool fuses_activation_backward = true;

  /// Appends the parameters' untyped views (optimizers, synchronisation, checkpoints).
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(w.ref(true));  // backward writes them with grad_beta
    out.push_back(b.ref(true));
  }

 private:
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0, in = 0, out = 0;
  };

  /// This device's saved forward, after checking `dy` against it (`out`: the weight block's width).
  template <class DY>
  saved checked_saved(const DY& dy) const {
    saved s = saved_[dy.device()];
    s.out = w.local(dy.device()).extent(1);
    check_cotangent(dy, s.x, s.rows, s.out);
    return s;
  }

  /// The products of the backward pass, after the bias gradient: `dW (+)= x^T dy`, and `dx = dy W^T`
  /// when `need_dx` (completed by a `psum` over `Model` for `column_dense`).
  template <class DY>
  auto backward_products(const DY& dy, const saved& s, bool need_dx) {
    const std::size_t dev = dy.device();
    // The cotangent of psum's input is pvary of the cotangent (no data moves).
    using DYV = typename detail::pvary_if<Kind == dense_kind::row, DY, Model>::type;
    using DXP = decltype(meshlib::matmul(std::declval<const DYV&>(), std::declval<const detail::transposed_t<w_local>&>()));
    // dy W^T is a pending sum over the axes that shard W's output dimension (column_dense): the
    // transpose of the implicit pvary of the replicated input is the psum that completes it.
    constexpr axis_mask pending = DXP::partial & w_sharding::dim_mask(1);
    using DX = typename detail::psum_if<pending != 0, DXP, Model>::type;
    const w_local wl = w.local(dev);
    const std::size_t rows = s.rows, in = s.in, out = s.out;
    T* gw = w.grad.local(dev).data();
    const cview dyv(dy.data(), rows, out);
    matmul_into(view(gw, in, out), cview(s.x, rows, in), dyv, {.transpose_a = true, .beta = static_cast<double>(w.grad_beta(dev))});
    T* dx = dx_.get(dev, rows * in);
    if (need_dx) {
      matmul_into(view(dx, rows, in), dyv, cview(wl.data(), in, out), {.transpose_b = true});
      if constexpr (pending != 0) {
        return meshlib::psum<Model>(detail::wrap2<DXP>(dx, rows, in, dy.mesh(), dev));  // donated: in place
      } else {
        return detail::wrap2<DX>(dx, rows, in, dy.mesh(), dev);
      }
    }
    return detail::wrap2<DX>(dx, rows, in, dy.mesh(), dev);
  }
  // Unmanaged views of the layer's buffers and the tensors' blocks (no reference count touched).
  using cview = meshlib::unmanaged_block_view<const T, 2, default_memory_space>;
  using view = meshlib::unmanaged_block_view<T, 2, default_memory_space>;
  /// `in`, after checking that the width the layer splits over `Model` divides evenly (the output of
  /// a `column_dense`, such as a language model's vocabulary, the input of a `row_dense`): the
  /// message names the layer, the width and the fix, where the sharding's own would name only a
  /// dimension of the weight.
  static std::size_t checked_split(const Mesh& mesh, const std::string& name, std::size_t in, std::size_t out) {
    if constexpr (Kind != dense_kind::replicated) {
      constexpr bool column = Kind == dense_kind::column;
      const std::size_t n = mesh.axes_size(Mesh::template mask_of<Model>()), width = column ? out : in;
      if (width % n != 0)
        throw sharding_error("meshlib::nn: " + name + " (" + std::string(kind_name.view()) + " " + std::to_string(in) +
                             " -> " + std::to_string(out) + "): its " + std::to_string(width) +
                             (column ? " outputs" : " inputs") + " are not divisible by the " + std::to_string(n) +
                             " devices of the model axis '" + std::string(Model.view()) +
                             "' it splits them over; use a width divisible by " + std::to_string(n) +
                             (column ? " (pad a vocabulary to " + std::to_string((width + n - 1) / n * n) +
                                           " with ids that never occur)"
                                     : std::string()) +
                             " or a model axis whose size divides " + std::to_string(width));
    }
    return in;
  }

  std::string input_width_error(std::size_t got, std::size_t want, const Mesh& mesh) const {
    constexpr axis_mask axes = w_sharding::dim_mask(0);
    const std::size_t n = mesh.axes_size(axes);
    std::string fix = "; it takes " + std::to_string(in_features());
    if (axes != 0 && n != 1) fix += " (" + std::to_string(want) + " per device)";
    return "meshlib::nn: " + to_string() + " received " + detail::width_text(got, axes, mesh) + fix + ": feed it " +
           std::to_string(in_features()) + " features or declare " + name_ + " with " + std::to_string(got * n) +
           " inputs";
  }

  template <class DY>
  void check_cotangent(const DY& dy, const T* x, std::size_t rows, std::size_t out) const {
    const std::string head = "meshlib::nn: " + to_string() + ".backward";
    if (x == nullptr)
      throw sharding_error(head + " ran on device " + std::to_string(dy.device()) +
                           " before any forward there; run forward first (backward uses its saved input)");
    constexpr axis_mask axes = w_sharding::dim_mask(1);
    if (dy.extent(1) != out) {
      const std::size_t n = dy.mesh().axes_size(axes);
      std::string outputs = std::to_string(out_features());
      if (axes != 0 && n != 1) outputs += " (" + std::to_string(out) + " per device)";
      throw sharding_error(head + " received a cotangent of " + detail::width_text(dy.extent(1), axes, dy.mesh()) +
                           ", but the layer outputs " + outputs + "; pass the cotangent of this layer's output");
    }
    if (dy.extent(0) != rows)
      throw sharding_error(head + " received a cotangent of " + std::to_string(dy.extent(0)) + " rows on device " +
                           std::to_string(dy.device()) + ", but the forward input there had " + std::to_string(rows) +
                           "; pass the cotangent of the last forward's output");
  }

  std::string name_;
  std::vector<saved> saved_;
  detail::device_buffers<T> out_, dx_;
};

/// @brief A dense layer with replicated parameters.
template <class T, mesh_type Mesh>
using dense = basic_dense<T, Mesh, dense_kind::replicated>;
/// @brief Megatron's column-parallel dense: W `P<none, Model>`, output columns sharded over `Model`.
template <class T, mesh_type Mesh, fixed_string Model = "model">
using column_dense = basic_dense<T, Mesh, dense_kind::column, Model>;
/// @brief Megatron's row-parallel dense: W `P<Model, none>`, input columns sharded, output replicated.
template <class T, mesh_type Mesh, fixed_string Model = "model">
using row_dense = basic_dense<T, Mesh, dense_kind::row, Model>;

}  // namespace meshlib::nn
// end meshlib/nn/layers/dense.hpp
// begin meshlib/nn/layers/activation.hpp
/// @file
/// @brief Elementwise activations with forward and backward: `relu` and `gelu` (tanh form, as
/// `jax.nn.gelu(approximate=True)`). Elementwise maps keep the sharding, so the cotangent has the
/// input's type and no communication happens in either direction. Both directions are Kokkos
/// kernels on the running device's instance (a plain element body). relu's body is branch-free
/// (see `relu_fn`): its input's signs are a coin flip after batch norm, and a branch mispredicts on
/// half of them.
/// @code
/// meshlib::nn::relu<float> act(mesh.size());
/// // inside spmd: auto h = act.forward(x); ... auto dx = act.backward(dh);
/// @endcode

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives>
consteval bool activation_of_pending_sum() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives>,
                "meshlib::nn: an activation of a pending sum is not the sum of activations: psum the input first "
                "(the condition spells out the activation and the input's layout, whose partial<...> names the axes "
                "of the pending sum)");
  return false;
}

/// The shared body of elementwise activations: `Fn::f(x)` forward, `Fn::df(x)` its derivative.
template <class T, class Fn>
class elementwise_activation {
 public:
  explicit elementwise_activation(std::size_t devices) : saved_(devices), out_(devices), dx_(devices) {}
  template <class Mesh>
  explicit elementwise_activation(const Mesh& mesh) : elementwise_activation(mesh.size()) {}

  /// The width out is the width in (sequential compares the layers around it).
  static constexpr bool keeps_features = true;
  /// Any complete (not pending-sum) input.
  template <class X>
  static constexpr bool accepts_input = X::partial == 0;
  /// For compile-time messages: the activation's name.
  using diagnostic_name = meshlib::diagnostic::op_t<Fn::name>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::complete_values;

  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"activation.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(activation_of_pending_sum<diagnostic_name, meshlib::diagnostic::value_t<X>>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.size();
      saved_[dev] = {x.data(), x.extent(0), x.extent(1)};
      T* y = out_.get(dev, n);
      const T* xp = x.data();
      detail::activation_forward<default_memory_space, Fn>(y, xp, n);
      return X(typename X::view_type(y, x.extent(0), x.extent(1)), x.mesh(), dev);
    }
  }

  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"activation.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device(), n = dy.size();
      const auto [x, rows, cols] = saved_[dev];
      check_output_cotangent(std::string(Fn::name.view()), dev, dy.extent(0), dy.extent(1), x != nullptr, rows, cols);
      T* dx = dx_.get(dev, n);
      const T* d = dy.data();
      const T* xs = x;  // a copy: Clang before 16 cannot capture a structured binding
      detail::activation_backward<default_memory_space, Fn>(dx, d, xs, n);
      return DY(typename DY::view_type(dx, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
    }
  }

  /// The elementwise function (`relu_fn`, `gelu_fn`): what a dense layer's fused backward
  /// (`basic_dense::backward_through`) evaluates in its kernel.
  using activation_function = Fn;

  /// Where a fused backward (`basic_dense::backward_through`, called by `sequential`) finds this
  /// activation's saved input and puts its cotangent.
  struct fused_operands {
    const T* x;  ///< the last forward's input on the device
    T* dx;       ///< this activation's cotangent buffer on the device, sized for `dy`
  };
  /// The operands of a fused backward for `dy`, after the checks `backward` makes (the same errors).
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  fused_operands fused_backward_operands(const DY& dy) {
    static_cast<void>(require_kernel_can_read<"activation.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved s = saved_[dev];
    check_output_cotangent(std::string(Fn::name.view()), dev, dy.extent(0), dy.extent(1), s.x != nullptr, s.rows, s.cols);
    return {s.x, dx_.get(dev, dy.size())};
  }

  /// Appends nothing: an activation has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0, cols = 0;
  };
  std::vector<saved> saved_;
  device_buffers<T> out_, dx_;
};

/// relu, written so that GCC and Clang at -O2 emit no branch: after batch norm half the inputs are
/// negative in no pattern, and `x > 0 ? x : 0` compiled (GCC 12, -O2) to a compare and a jump that
/// mispredicts on half of them, 15 times slower than the mask below on normal random data (and
/// 15% of a small ResNet's training step). The values are the same: `x` when `x > 0`, else +0
/// (NaN and -0 included).
/// `exp(x)` on the host and in device kernels: `Kokkos::exp` (Kokkos 4), `std::exp` on Kokkos 3,
/// whose builds meshlib runs on the host only.
template <class T>
KOKKOS_INLINE_FUNCTION T exp_of(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::exp(x);
#else
  return std::exp(x);
#endif
}

struct relu_fn {  // (KOKKOS_INLINE_FUNCTION: device kernels call these, nn/detail/layer_kernels.hpp)
  static constexpr fixed_string name = "relu";
  /// `f` and `vjp` take native vectors too (a lane-wise select: `x > 0 ? x : 0` keeps the bits the
  /// scalar mask keeps, +0 for every x <= 0 and NaN).
  static constexpr bool on_lanes = true;
  template <class T>
  KOKKOS_INLINE_FUNCTION static T f(T x) {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      using bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
      const bits keep = bits{0} - static_cast<bits>(x > T{0});  // all ones or all zeros
      return std::bit_cast<T>(static_cast<bits>(std::bit_cast<bits>(x) & keep));
    } else {
      return x > T{0} ? x : T{0};
    }
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION static T df(T x) { return x > T{0} ? T{1} : T{0}; }
  /// The cotangent `dy` where `x > 0`, else 0 (PyTorch's `threshold_backward`): a select, which
  /// compiles to a compare and a mask, where `dy * df(x)` kept a branch.
  template <class T>
  KOKKOS_INLINE_FUNCTION static T vjp(T dy, T x) { return x > T{0} ? dy : T{0}; }
};

struct gelu_fn {
  static constexpr fixed_string name = "gelu";
  static constexpr double c = 0.7978845608028654;  // sqrt(2 / pi)
  // 0.5 (1 + tanh(u)) is the logistic function of 2u: one exp instead of tanh, which glibc
  // computes through expm1 at several times exp's cost (a third of a GPT step's time was tanhf
  // and expm1f). Stable at both ends: exp(-2u) overflows to inf (s = 0) or underflows to 0 (s = 1).
  template <class T>
  KOKKOS_INLINE_FUNCTION static T f(T x) {
    const T u = static_cast<T>(c) * (x + T(0.044715) * x * x * x);
    return x / (T{1} + exp_of(T(-2) * u));
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION static T df(T x) {
    const T u = static_cast<T>(c) * (x + T(0.044715) * x * x * x);
    const T s = T{1} / (T{1} + exp_of(T(-2) * u));  // 0.5 (1 + tanh(u))
    const T du = static_cast<T>(c) * (T{1} + T(3 * 0.044715) * x * x);
    // d/dx [x s(2u)] = s + x * 2 s (1 - s) du, since 1 - tanh^2 = 4 s (1 - s).
    return s + T(2) * x * s * (T{1} - s) * du;
  }
};
}  // namespace detail

/// @brief `max(x, 0)`.
template <class T>
using relu = detail::elementwise_activation<T, detail::relu_fn>;
/// @brief `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
template <class T>
using gelu = detail::elementwise_activation<T, detail::gelu_fn>;

}  // namespace meshlib::nn
// end meshlib/nn/layers/activation.hpp
// begin meshlib/nn/layers/layer_norm.hpp
/// @file
/// @brief `layer_norm`: normalises each row over its features, `y = (x - mean) / sqrt(var + eps) * g + b`
/// (`flax.linen.LayerNorm`), with forward and backward. The features must not be sharded (a
/// compile error says so): the row statistics are then local, and the cotangent has the input's type.
/// Forward and backward are Kokkos kernels on the running device's instance: one work item per row
/// for the row statistics, and per block of columns for the parameter gradients (sums over rows,
/// added in row order: the same bits on every mesh).
/// @code
/// meshlib::nn::layer_norm<float, mesh_t> ln(m, "ln1", 1024);
/// // inside spmd: auto y = ln.forward(x);  ...  auto dx = ln.backward(dy);
/// @endcode

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/nn/detail/norm_kernels.hpp
/// @file
/// @brief The kernels of layer norm, RMSNorm and batch norm: per-row statistics and normalisation
/// (one work item per row), per-channel statistics (one work item per channel), and the parameters'
/// gradients as sums over rows (`for_column_blocks`, rows added in row order: the same bits on every
/// mesh and backend). Free functions over pointers, templated on the element type and the memory
/// space only, for the reason nn/detail/layer_kernels.hpp gives (nvcc and kernels in mesh-templated code).

#include <cmath>
#include <cstddef>


namespace meshlib::nn::detail {

/// Layer norm's forward over `rows x n`: `rstd[i]` = 1 / std of row `i`, `xh` the normalised rows,
/// `y = xh * g + b`.
template <class Space, class T>
void layer_norm_forward(T* y, T* xh, T* rstd, const T* xp, const T* gv, const T* bv, std::size_t rows, std::size_t n,
                        T eps) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* xi = xp + i * n;
    T mean = 0, var = 0;
    for (std::size_t j = 0; j < n; ++j) mean += xi[j];
    mean /= static_cast<T>(n);
    for (std::size_t j = 0; j < n; ++j) var += (xi[j] - mean) * (xi[j] - mean);
    var /= static_cast<T>(n);
    const T r = T{1} / std::sqrt(var + eps);
    rstd[i] = r;
    T* xhi = xh + i * n;
    T* yi = y + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      const L h = (load_as(xi, j, lane) - splat_as<L>(mean)) * splat_as<L>(r);
      store_at(xhi, j, h);
      store_at(yi, j, h * load_as(gv, j, lane) + load_as(bv, j, lane));
    });
  });
}

/// Layer norm's backward: `dx` from `dy`, and `gg += sum_rows dy * xhat`, `gb += sum_rows dy`.
template <class Space, class T>
void layer_norm_backward(T* dx, T* gg, T* gb, const T* dyp, const T* xh, const T* rstd, const T* gv, std::size_t rows,
                         std::size_t n) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* d = dyp + i * n;
    T s1 = 0, s2 = 0;  // mean of dxhat and of dxhat * xhat
    for (std::size_t j = 0; j < n; ++j) {
      const T dxh = d[j] * gv[j];
      s1 += dxh;
      s2 += dxh * xh[i * n + j];
    }
    s1 /= static_cast<T>(n);
    s2 /= static_cast<T>(n);
    const T r = rstd[i];
    const T* xhi = xh + i * n;
    T* dxi = dx + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      store_at(dxi, j,
               splat_as<L>(r) * (load_as(d, j, lane) * load_as(gv, j, lane) - splat_as<L>(s1) -
                                 load_as(xhi, j, lane) * splat_as<L>(s2)));
    });
  });
  // dg += sum_rows dy * xhat, db += sum_rows dy: each column's rows in row order, as the loop added them.
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sg = gg;  // locals: the stores below cannot be taken to change them
    T* sb = gb;
    for (std::size_t i = 0; i < rows; ++i) {
      const T* di = dyp + i * n;
      const T* hi = xh + i * n;
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
        const auto dv = load_as(di, j, lane);
        store_at(sg, j, load_as(sg, j, lane) + dv * load_as(hi, j, lane));
        store_at(sb, j, load_as(sb, j, lane) + dv);
      });
    }
  });
}

/// RMSNorm's forward over `rows x n`: `rinv[i]` = 1 / rms of row `i`, `xh = x / rms`, `y = xh * g`.
template <class Space, class T>
void rms_norm_forward(T* y, T* xh, T* rinv, const T* xp, const T* gv, std::size_t rows, std::size_t n, T eps) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* xi = xp + i * n;
    T ms = 0;
    for (std::size_t j = 0; j < n; ++j) ms += xi[j] * xi[j];
    ms /= static_cast<T>(n);
    const T r = T{1} / std::sqrt(ms + eps);
    rinv[i] = r;
    T* xhi = xh + i * n;
    T* yi = y + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      const L h = load_as(xi, j, lane) * splat_as<L>(r);
      store_at(xhi, j, h);
      store_at(yi, j, h * load_as(gv, j, lane));
    });
  });
}

/// RMSNorm's backward: `dx` from `dy`, and `gg += sum_rows dy * xhat`.
template <class Space, class T>
void rms_norm_backward(T* dx, T* gg, const T* dyp, const T* xh, const T* rinv, const T* gv, std::size_t rows,
                       std::size_t n) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* d = dyp + i * n;
    T s = 0;  // mean of dxhat * xhat
    for (std::size_t j = 0; j < n; ++j) s += d[j] * gv[j] * xh[i * n + j];
    s /= static_cast<T>(n);
    const T r = rinv[i];
    const T* xhi = xh + i * n;
    T* dxi = dx + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      store_at(dxi, j,
               splat_as<L>(r) * (load_as(d, j, lane) * load_as(gv, j, lane) - load_as(xhi, j, lane) * splat_as<L>(s)));
    });
  });
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sg = gg;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < rows; ++i) {
      const T* di = dyp + i * n;
      const T* hi = xh + i * n;
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
        store_at(sg, j, load_as(sg, j, lane) + load_as(di, j, lane) * load_as(hi, j, lane));
      });
    }
  });
}

/// `s[j] = sum_i x[i, j]` (`centre` null) or `sum_i (x[i, j] - centre[j] / count)^2` over `rows x c`,
/// rows in order (batch norm's statistics, before their psum over the data axis).
template <class Space, class T>
void channel_sums(T* s, const T* x, const T* centre, std::size_t rows, std::size_t c, T count) {
  for_column_blocks<Space>(c, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sj = s;
    for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(sj, j, decltype(lane){}); });
    if (centre == nullptr) {
      for (std::size_t i = 0; i < rows; ++i) {
        const T* xi = x + i * c;
        for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
          store_at(sj, j, load_as(sj, j, lane) + load_as(xi, j, lane));
        });
      }
    } else {
      for (std::size_t i = 0; i < rows; ++i) {
        const T* xi = x + i * c;
        for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
          using L = decltype(lane);
          const L dv = load_as(xi, j, lane) - load_as(centre, j, lane) / splat_as<L>(count);
          store_at(sj, j, load_as(sj, j, lane) + dv * dv);
        });
      }
    }
  });
}

/// Batch norm in training: from the global sums `s` and squared deviations `q` of `count` rows, the
/// channels' `mean` and `rstd`, and the running statistics moved by `mom` (the variance unbiased).
template <class Space, class T>
void batch_statistics(T* mean, T* rstd, T* run_mean, T* run_var, const T* s, const T* q, std::size_t c, T count,
                      T eps, T mom, T unbias) {
  meshlib::launch<Space>(c, KOKKOS_LAMBDA(std::size_t j) {
    mean[j] = s[j] / count;
    const T var = q[j] / count;
    rstd[j] = T{1} / std::sqrt(var + eps);
    run_mean[j] = (T{1} - mom) * run_mean[j] + mom * mean[j];
    run_var[j] = (T{1} - mom) * run_var[j] + mom * var * unbias;
  });
}

/// Batch norm in evaluation: the channels' `mean` and `rstd` from the running statistics.
template <class Space, class T>
void running_statistics(T* mean, T* rstd, const T* run_mean, const T* run_var, std::size_t c, T eps) {
  meshlib::launch<Space>(c, KOKKOS_LAMBDA(std::size_t j) {
    mean[j] = run_mean[j];
    rstd[j] = T{1} / std::sqrt(run_var[j] + eps);
  });
}

/// Batch norm's normalisation of `np x c`: `xh = (x - mean) * rstd`, `y = xh * g + b`.
template <class Space, class T>
void batch_normalize(T* y, T* xh, const T* xp, const T* mean, const T* rstd, const T* gv, const T* bv, std::size_t np,
                     std::size_t c) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    const T* xi = xp + i * c;
    T* xhi = xh + i * c;
    T* yi = y + i * c;
    for_each_lane<T>(0, c, [&](std::size_t j, auto lane) {
      const auto h = (load_as(xi, j, lane) - load_as(mean, j, lane)) * load_as(rstd, j, lane);
      store_at(xhi, j, h);
      store_at(yi, j, h * load_as(gv, j, lane) + load_as(bv, j, lane));
    });
  });
}

/// Per channel, rows in order: `sums[j] = sum dy`, `sums[c + j] = sum dy * xhat`.
template <class Space, class T>
void batch_grad_sums(T* sums, const T* d, const T* xh, std::size_t np, std::size_t c) {
  for_column_blocks<Space>(c, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sa = sums;
    T* sb = sums + c;
    for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
      store_at(sa, j, decltype(lane){});
      store_at(sb, j, decltype(lane){});
    });
    for (std::size_t i = 0; i < np; ++i) {
      const T* di = d + i * c;
      const T* hi = xh + i * c;
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
        const auto dv = load_as(di, j, lane);
        store_at(sa, j, load_as(sa, j, lane) + dv);
        store_at(sb, j, load_as(sb, j, lane) + dv * load_as(hi, j, lane));
      });
    }
  });
}

/// `gg = beta_g gg + sum dy * xhat`, `gb = beta_b gb + sum dy` (batch norm's parameter gradients).
template <class Space, class T>
void batch_param_grads(T* gg, T* gb, const T* sums, std::size_t c, T beta_g, T beta_b) {
  meshlib::launch<Space>(c, KOKKOS_LAMBDA(std::size_t j) {
    gg[j] = beta_g * gg[j] + sums[c + j];
    gb[j] = beta_b * gb[j] + sums[j];
  });
}

/// Batch norm's input cotangent in training, from the global sums (`inv` = 1 / rows of the batch):
/// `dx = g / std * (dy - mean(dy) - xhat * mean(dy * xhat))`.
template <class Space, class T>
void batch_norm_dx(T* dx, const T* d, const T* xh, const T* sums, const T* gv, const T* rstd, std::size_t np,
                   std::size_t c, T inv) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    const T* di = d + i * c;
    const T* hi = xh + i * c;
    const T* sdy = sums;
    const T* sdyh = sums + c;
    T* dxi = dx + i * c;
    for_each_lane<T>(0, c, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      const L iv = splat_as<L>(inv);
      store_at(dxi, j,
               load_as(gv, j, lane) * load_as(rstd, j, lane) *
                   (load_as(di, j, lane) - load_as(sdy, j, lane) * iv - load_as(hi, j, lane) * load_as(sdyh, j, lane) * iv));
    });
  });
}

/// Batch norm's input cotangent in evaluation (constant statistics): `dx = g * rstd * dy`.
template <class Space, class T>
void batch_norm_dx_affine(T* dx, const T* d, const T* gv, const T* rstd, std::size_t np, std::size_t c) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    const T* di = d + i * c;
    T* dxi = dx + i * c;
    for_each_lane<T>(0, c, [&](std::size_t j, auto lane) {
      store_at(dxi, j, load_as(gv, j, lane) * load_as(rstd, j, lane) * load_as(di, j, lane));
    });
  });
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/norm_kernels.hpp
// begin meshlib/nn/layers/row_norm.hpp
/// @file
/// @brief `row_norm`: what `layer_norm` and `rms_norm` share, written once. Both normalise each row
/// of a device's block over its complete features with a replicated scale `g`; they differ only in
/// the row statistic (mean and variance, or the mean square), the shift `b` that `layer_norm` adds,
/// and their kernels (nn/detail/norm_kernels.hpp). This base holds the scale, the per-device
/// buffers, the shape checks and the names messages use; each layer's `forward` / `backward` takes
/// its buffers from `begin_forward` / `begin_backward` and launches its own kernel.

#include <cstddef>
#include <span>
#include <string>
#include <vector>


namespace meshlib::nn {

/// @brief The common part of the row normalisations `layer_norm` and `rms_norm` (named `Kind` in
/// messages): a replicated scale `g` (init 1) over `features` complete, unsharded features.
template <class T, mesh_type Mesh, fixed_string Kind>
class row_norm {
 public:
  /// The parameters are replicated on every device.
  using sharding = named_sharding<Mesh, P<none>>;
  /// The scale `g` (named `name + ".g"`, initially 1), `features` values.
  parameter<T, 1, sharding> g;

  /// The layer's name: its parameters are `name() + ".g"` (and `layer_norm`'s `name() + ".b"`).
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The number of features it normalises over: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return g.value.global_shape()[0]; }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// `"ln1 (layer_norm over 16 features)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (" + std::string(Kind.view()) + " over " + std::to_string(in_features()) + " features)";
  }
  /// Complete, unsharded features: the row statistics are then local and the cotangent has the
  /// input's type.
  template <class X>
  static constexpr bool accepts_input = X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0;
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<Kind>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

 protected:
  /// `features` values per row, `eps` in the statistic's square root; `local_devices`: this
  /// process's devices (empty: all).
  row_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps,
           std::span<const std::size_t> local_devices)
      : g(name + ".g", sharding{mesh}, {features}, rng_key{}, init::constant(1.0f), false, local_devices),
        eps_(eps),
        name_(name),
        shape_(mesh.size()),
        xhat_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}

  /// One device's pointers for a forward kernel: `y` the output, `xhat` the normalised input and
  /// then one statistic per row (`stat`), both kept for the backward pass.
  struct forward_block {
    std::size_t dev;   ///< the device
    std::size_t rows;  ///< rows of its block
    std::size_t n;     ///< features per row
    const T* x;        ///< the input block
    const T* g;        ///< the scale
    T* y;              ///< the output block
    T* xhat;           ///< the normalised input (kept for backward)
    T* stat;           ///< one statistic per row (kept for backward)
  };
  /// One device's pointers for a backward kernel: `dx` the cotangent of the input, `dg` the scale's
  /// gradient, and what the forward pass kept.
  struct backward_block {
    std::size_t dev;   ///< the device
    std::size_t rows;  ///< rows of its block
    std::size_t n;     ///< features per row
    const T* dy;       ///< the cotangent of the output
    const T* g;        ///< the scale
    const T* xhat;     ///< the forward pass's normalised input
    const T* stat;     ///< the forward pass's per-row statistic
    T* dx;             ///< the cotangent of the input
    T* dg;             ///< the scale's gradient
  };

  /// Checks `x`'s width, records its shape for the backward pass and hands out the buffers.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <class X>
  forward_block begin_forward(const X& x) {
    const std::size_t dev = x.device(), rows = x.extent(0), n = x.extent(1);
    if (n != in_features())
      throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(n) + " features; feed it " +
                           std::to_string(in_features()) + " features or declare " + name_ + " with " + std::to_string(n) +
                           " features");
    shape_[dev] = {rows, n, true};
    T* xh = xhat_.get(dev, rows * n + rows);
    return {dev, rows, n, x.data(), g.value.local(dev).data(), out_.get(dev, rows * n), xh, xh + rows * n};
  }

  /// Checks that `dy` is shaped as this device's last forward input and hands out the buffers.
  /// @throws sharding_error naming the layer otherwise.
  template <class DY>
  backward_block begin_backward(const DY& dy) {
    const std::size_t dev = dy.device(), rows = dy.extent(0), n = dy.extent(1);
    detail::check_output_cotangent(to_string(), dev, rows, n, shape_[dev].ran, shape_[dev].rows, shape_[dev].cols);
    const T* xh = xhat_.get(dev, rows * n + rows);
    return {dev, rows, n, dy.data(), g.value.local(dev).data(), xh, xh + rows * n, dx_.get(dev, rows * n),
            g.grad.local(dev).data()};
  }

  T eps_;  ///< keeps the division finite

 private:
  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::string name_;
  std::vector<shape> shape_;  // per device: the last forward's input shape
  detail::device_buffers<T> xhat_, out_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/row_norm.hpp

namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool layer_norm_input_sharded() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: layer_norm normalises over complete, unsharded features: all_gather (or psum) the "
                "feature dimension first (the condition spells out the layer, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief Layer normalisation over the last dimension, scale `g` (init 1) and shift `b` (init 0), replicated.
template <class T, mesh_type Mesh>
class layer_norm : public row_norm<T, Mesh, "layer_norm"> {
  using base = row_norm<T, Mesh, "layer_norm">;

 public:
  /// The shift `b` (named `name + ".b"`, initially 0), `features` values.
  parameter<T, 1, typename base::sharding> b;

  /// Normalises `features` values per row; `eps` keeps the division finite. `local_devices`: this process's devices (empty: all).
  layer_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : base(mesh, name, features, eps, local_devices),
        b(name + ".b", typename base::sharding{mesh}, {features}, rng_key{}, init::zeros(), false, local_devices) {}

  /// `(x - mean) / sqrt(var + eps) * g + b` per row of this device's block.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"layer_norm.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!base::template accepts_input<X>) {
      static_cast<void>(detail::layer_norm_input_sharded<typename base::diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                         typename base::input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto f = this->begin_forward(x);  // stat: 1/std per row
      detail::layer_norm_forward<default_memory_space>(f.y, f.xhat, f.stat, f.x, f.g, b.value.local(f.dev).data(),
                                                       f.rows, f.n, this->eps_);
      return X(typename X::view_type(f.y, f.rows, f.n), x.mesh(), f.dev);
    }
  }

  /// The cotangent of the input; accumulates the gradients of `g` and `b`. The second argument (need_dx) is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"layer_norm.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto k = this->begin_backward(dy);
      detail::layer_norm_backward<default_memory_space>(k.dx, k.dg, b.grad.local(k.dev).data(), k.dy, k.xhat, k.stat,
                                                        k.g, k.rows, k.n);
      return DY(typename DY::view_type(k.dx, k.rows, k.n), dy.mesh(), k.dev);
    }
  }

  /// Appends `g` and `b` to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(this->g.ref());
    out.push_back(b.ref());
  }
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/layer_norm.hpp
// begin meshlib/nn/layers/rms_norm.hpp
/// @file
/// @brief `rms_norm`: scales each row by the reciprocal of its root mean square,
/// `y = x / sqrt(mean(x^2) + eps) * g` (`flax.linen.RMSNorm`, `torch.nn.RMSNorm`; no mean is
/// subtracted and there is no shift, which is what Transformers of the Llama family use in place of
/// `layer_norm`), with forward and backward. As for `layer_norm`, the features must not be sharded
/// (a compile error says so): the row statistic is then local, and the cotangent has the input's type.
/// Forward and backward are Kokkos kernels on the running device's instance: one work item per row
/// for the row statistic, and per block of columns for the scale's gradient (a sum over rows, added
/// in row order: the same bits on every mesh).
/// @code
/// meshlib::nn::rms_norm<float, mesh_t> norm(m, "norm1", 128);   // eps = 1e-6, flax's default
/// // inside spmd: auto y = norm.forward(x);  ...  auto dx = norm.backward(dy);
/// @endcode

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool rms_norm_input_sharded() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: rms_norm normalises over complete, unsharded features: all_gather (or psum) the "
                "feature dimension first (the condition spells out the layer, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief RMS normalisation over the last dimension with a scale `g` (init 1), replicated.
template <class T, mesh_type Mesh>
class rms_norm : public row_norm<T, Mesh, "rms_norm"> {
  using base = row_norm<T, Mesh, "rms_norm">;

 public:
  /// Normalises `features` values per row; `eps` keeps the division finite (flax's default, 1e-6).
  /// `local_devices`: this process's devices (empty: all).
  rms_norm(const Mesh& mesh, const std::string& name, std::size_t features, T eps = T(1e-6),
           std::span<const std::size_t> local_devices = {})
      : base(mesh, name, features, eps, local_devices) {}

  /// `x / sqrt(mean(x^2) + eps) * g` per row of this device's block.
  /// @throws sharding_error when `x` does not have the layer's number of features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"rms_norm.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!base::template accepts_input<X>) {
      static_cast<void>(detail::rms_norm_input_sharded<typename base::diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                       typename base::input_requirement>());
      return x;
    } else {
      const auto f = this->begin_forward(x);  // xhat = x / rms, stat: 1/rms per row
      detail::rms_norm_forward<default_memory_space>(f.y, f.xhat, f.stat, f.x, f.g, f.rows, f.n, this->eps_);
      return X(typename X::view_type(f.y, f.rows, f.n), x.mesh(), f.dev);
    }
  }

  /// The cotangent of the input, `r (dy g - xhat mean(dy g xhat))` per row (`r = 1/rms`); adds
  /// `sum_rows dy xhat` to the scale's gradient (each column's rows in row order). The second
  /// argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"rms_norm.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<typename base::diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto k = this->begin_backward(dy);
      detail::rms_norm_backward<default_memory_space>(k.dx, k.dg, k.dy, k.xhat, k.stat, k.g, k.rows, k.n);
      return DY(typename DY::view_type(k.dx, k.rows, k.n), dy.mesh(), k.dev);
    }
  }

  /// Appends `g` to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) { out.push_back(this->g.ref()); }
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/rms_norm.hpp
// begin meshlib/nn/layers/embedding.hpp
/// @file
/// @brief `embedding`: a token embedding whose table is sharded over the vocabulary along a model
/// axis (Megatron's `VocabParallelEmbedding`; `flax.linen.Embed` / `torch.nn.Embedding` when the
/// model axis has one device), with forward and backward.
///
/// Why sharded over the vocabulary: the table is the largest parameter of a small language model
/// (vocabulary x width), and an output layer tied to it has the same shape; split by rows, each
/// device of a model group holds `vocab / n` rows and the lookup costs one `psum` of the output.
///
/// Forward: each device looks up the ids that fall in its vocabulary range `[v0, v0 + vocab / n)` and
/// writes zeros for the others: the rows of the result are a pending sum over the model axis, which
/// one `psum` completes (every id lies in exactly one range, so the sum is the looked-up row).
/// Backward: the cotangent of that `psum` is its `pvary` (no data moves); each device adds the
/// cotangent rows of its own ids into its own rows of the table's gradient, and no other.
///
/// The ids are an `std::int32_t` tensor of rank 1 (one id per token: for a batch of sequences, the
/// rows `batch * sequence`, sequence-major as the other Transformer layers take them), sharded like
/// the rows of the activations (over the data axis) and replicated over the model axis. The output
/// is `(tokens, features)`, its rows sharded as the ids, its features complete. The ids have no
/// cotangent: `backward` returns the ids it looked up, so that `sequential`'s type check (every
/// layer hands back its input's type) holds for a network that starts at the ids.
/// Kernels: one work item per token for the lookup; for the gradient, one per block of columns
/// adding the tokens in token order (deterministic, no atomics: the same bits on every mesh).
/// @code
/// meshlib::nn::embedding<float, mesh_t> tok(m, "tok", 256, 128, meshlib::nn::rng_key{0});   // vocab 256, width 128
/// // inside spmd: auto h = tok.forward(ids);   // ids: (tokens) int32, h: (tokens, 128)
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/nn/detail/loss_kernels.hpp
/// @file
/// @brief The kernels of the losses and of embedding's id check, each one RangePolicy `parallel_for`
/// on the running device's instance over memory `Space` (`meshlib::launch`), and the read-back
/// of the one or two numbers the host needs from them (a copy only for device memory).
///
/// Why free functions over pointers, templated on the element type and the memory space only: nvcc
/// names an extended device lambda's kernel after its enclosing function, and its generated host stub
/// spells a class-type template argument (the mesh's `axis<"data">`, a `fixed_string`) in a form g++
/// cannot parse (`fixed_string<5>{char [5]{...}}`), so a kernel written inside code templated on a mesh
/// does not compile for CUDA. These functions are instantiated for CUDA in tests/cuda/nn_headers.cpp.
///
/// Sums over rows are added in row order by one work item: the same chain of additions on every
/// backend (a `parallel_reduce` is unsafe from several device threads on Kokkos 3.4.1, and its order
/// would depend on the backend).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

// begin meshlib/nn/loss_function.hpp
/// @file
/// @brief `loss_function`: what `train_step` needs of a loss. `train_step` does not differentiate
/// the loss it is given (automatic differentiation, `nn::value_and_grad` in nn/autodiff/ and
/// docs/autodiff.md, is for programs written with meshlib's ops and for `function_layer`s), so a
/// loss is its value *and* its gradient with respect to the model output, as `jax.value_and_grad(loss_fn)`
/// would give them: an object `loss` with a nested `target_type` (the element type of the targets:
/// `std::int32_t` for class labels, `float` for regression targets) that `train_step` calls on
/// every device, once per micro-batch:
/// @code
/// loss_part r = loss(output, targets, global_batch, grad);   // or: double value = loss(...)
/// @endcode
/// - `output` (`const Z&`): this device's block of the model output, its rows this device's rows
///   of the micro-batch, its columns possibly a block of the features sharded over a model axis
///   (`Z::dims_type::at(1)`, `output.global_extent(1)` the global width);
/// - `targets` (`std::span<const target_type>`): this device's rows' targets, every row complete
///   (all global columns: targets are replicated over the model axis, as the input batch is);
/// - `global_batch`: the rows of the whole global batch, the mean's denominator;
/// - `grad` (`Z&`, the output's type and shape, a buffer `train_step` owns): to be filled with
///   the gradient of the *global mean* loss with respect to this device's block of `output`.
/// It returns this device's rows' share of the global mean: `train_step` adds the shares over the
/// data axis (a `psum`), so the share must already be complete over the axes that shard the
/// columns (a loss of column-sharded outputs `psum`s its partial sums over them, as the built-in
/// losses do). Returning a `loss_part` also reports `correct` (rows predicted right, for accuracy).
///
/// The built-in losses model it: `softmax_cross_entropy` (labels) and `mean_squared_error`
/// (regression targets). A user-written loss is any struct with that call operator:
/// @code
/// struct my_mse {   // mean over batch and features of (z - t)^2, for a replicated output
///   using target_type = float;
///   template <meshlib::local_tensor_type Z>
///   double operator()(const Z& z, std::span<const float> t, std::size_t global_batch, Z& grad) const {
///     const std::size_t rows = z.extent(0), cols = z.extent(1);
///     const double n = static_cast<double>(global_batch * cols);
///     double sum = 0;
///     for (std::size_t i = 0; i < rows; ++i)
///       for (std::size_t j = 0; j < cols; ++j) {
///         const double d = z(i, j) - t[i * cols + j];
///         sum += d * d;
///         grad(i, j) = static_cast<float>(2 * d / n);
///       }
///     return sum / n;
///   }
/// };
/// auto m = meshlib::nn::train_step(state, x, targets, rows, 0, rows, my_mse{});
/// @endcode
/// A loss of the wrong shape is one compile error from `train_step` naming this concept
/// (`loss_does_not_satisfy_loss_function<...>`).

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>


namespace meshlib::nn {

/// @brief What one device's rows contribute to the loss of a batch (see the file comment).
struct loss_part {
  double loss = 0;            ///< sum over this device's rows of the per-row loss, / global batch
  std::size_t correct = 0;    ///< rows whose prediction is right (classification; 0 for regression)
};

/// @brief What a loss may return: a `loss_part`, or the value alone (a number).
template <class R>
concept loss_result = std::same_as<std::remove_cvref_t<R>, loss_part> || std::convertible_to<R, double>;

/// @brief A loss declares the element type of its targets (`target_type`).
template <class L>
concept has_target_type = requires { typename std::remove_cvref_t<L>::target_type; };

/// @brief The targets' element type of loss `L`.
template <has_target_type L>
using loss_target_t = typename std::remove_cvref_t<L>::target_type;

/// @brief `L` is a loss for model outputs `Z`: `loss(output, targets, global_batch, grad)` gives
/// this device's share of the mean loss and writes the output's gradient (see the file comment).
template <class L, class Z>
concept loss_function =
    local_tensor_type<Z> && has_target_type<L> &&
    requires(L& loss, const Z& output, std::span<const loss_target_t<L>> targets, std::size_t global_batch, Z& grad) {
      { loss(output, targets, global_batch, grad) } -> loss_result;
    };

namespace detail {
/// The one diagnostic of `train_step` for a loss that is not a `loss_function` of the model's
/// output (instantiated once; the step's body is then not compiled, so nothing else is reported).
template <bool Ok, class Loss, class Output>
struct loss_does_not_satisfy_loss_function {
  static_assert(Ok,
                "meshlib::nn: train_step: the loss does not satisfy meshlib::nn::loss_function<Loss, Output> (the "
                "types in loss_does_not_satisfy_loss_function<ok, Loss, Output>): it needs a nested target_type and "
                "a call loss(const Output& output, std::span<const target_type> targets, std::size_t global_batch, "
                "Output& grad) returning a loss_part or a double (see meshlib/nn/loss_function.hpp)");
  static constexpr bool value = Ok;
};

/// The one diagnostic of `train_step` for targets whose element type is not the loss's.
template <bool Ok, class Loss, class Given, class Expected>
struct targets_type_differs_from_loss_target_type {
  static_assert(Ok,
                "meshlib::nn: train_step: the targets' element type is not the loss's target_type (the types in "
                "targets_type_differs_from_loss_target_type<ok, Loss, given, expected>): class labels "
                "(std::int32_t) go to softmax_cross_entropy, float regression targets (one per output column) to "
                "mean_squared_error; convert the targets or pass the loss that takes them");
  static constexpr bool value = Ok;
};

/// `r` as a `loss_part` (a loss that returns only the value reports no correct rows).
template <class R>
loss_part as_loss_part(R&& r) {
  if constexpr (std::same_as<std::remove_cvref_t<R>, loss_part>) return r;
  else return loss_part{static_cast<double>(r), 0};
}
}  // namespace detail

}  // namespace meshlib::nn
// end meshlib/nn/loss_function.hpp

namespace meshlib::nn::detail {

/// `mx[i]` = the largest of row `i`'s `cols` logits at `z` (row-major).
template <class Space, class T>
void row_max(const T* z, std::size_t rows, std::size_t cols, T* mx) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j < cols; ++j) m = m < z[i * cols + j] ? z[i * cols + j] : m;
    mx[i] = m;
  });
}

/// Softmax cross-entropy, second pass: `g = exp(z - mx)`, `sum[i]` its row sums, `tgt[i]` the label's
/// logit where this block of columns (`[col0, col0 + cols)` of the classes) holds it, else 0.
template <class Space, class T>
void exp_and_target(const T* z, std::size_t rows, std::size_t cols, std::size_t col0, const std::int32_t* lab,
                    const T* mx, T* g, T* sum, T* tgt) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    T s = 0;
    for (std::size_t j = 0; j < cols; ++j) s += (g[i * cols + j] = std::exp(z[i * cols + j] - mx[i]));
    sum[i] = s;
    const std::size_t l = static_cast<std::size_t>(lab[i]);
    tgt[i] = l >= col0 && l < col0 + cols ? z[i * cols + (l - col0)] : T{0};
  });
}

/// Softmax cross-entropy's totals: one work item adds the rows' terms `term[i]` and counts the rows
/// whose target logit is the maximum, in row order, into `term[rows]` and `term[rows + 1]`, which the
/// host reads back. Returns {loss, correct} of these rows.
template <class Space, class T>
loss_part cross_entropy_totals(std::size_t rows, const T* mx, const T* tgt, double* term) {
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    double loss = 0, correct = 0;
    for (std::size_t i = 0; i < rows; ++i) {
      loss += term[i];
      correct += tgt[i] >= mx[i] ? 1 : 0;
    }
    term[rows] = loss;
    term[rows + 1] = correct;
  });
  double totals[2];
  meshlib::copy_to_host<Space>(totals, term + rows, 2);
  return loss_part{totals[0], static_cast<std::size_t>(totals[1])};
}

/// Softmax cross-entropy, last pass, with complete row maxima, normalisers and target logits:
/// `term[i]` = row `i`'s loss / `global_batch`, `g` = the gradient of the mean loss; then one work item
/// adds the terms and counts the rows whose target logit is the maximum, in row order, into
/// `term[rows]` and `term[rows + 1]`. Returns {loss, correct} of these rows.
template <class Space, class T>
loss_part cross_entropy_terms(std::size_t rows, std::size_t cols, std::size_t col0, const std::int32_t* lab,
                              const T* mx, const T* sum, const T* tgt, std::size_t global_batch, T* g, double* term) {
  const T inv_b = T{1} / static_cast<T>(global_batch);
  const double gb = static_cast<double>(global_batch);
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    term[i] = (static_cast<double>(std::log(sum[i])) + mx[i] - tgt[i]) / gb;
    const std::size_t l = static_cast<std::size_t>(lab[i]);
    const T inv = T{1} / sum[i];
    for (std::size_t j = 0; j < cols; ++j) g[i * cols + j] *= inv * inv_b;
    if (l >= col0 && l < col0 + cols) g[i * cols + (l - col0)] -= inv_b;
  });
  return cross_entropy_totals<Space>(rows, mx, tgt, term);
}

/// Softmax cross-entropy of rows whose classes are all on this device (no class axis), the three
/// passes of `row_max`, `exp_and_target` and `cross_entropy_terms` in one kernel: a row needs no
/// other device's maximum or normaliser, so its work item runs them one after the other, each with
/// the same expressions in the same order (the loss and gradient are bitwise those of the three
/// kernels; issue 38: fewer kernels per step). Then `cross_entropy_totals`. Returns {loss, correct}.
template <class Space, class T>
loss_part softmax_cross_entropy_rows(const T* z, std::size_t rows, std::size_t cols, const std::int32_t* lab,
                                     std::size_t global_batch, T* g, T* mx, T* sum, T* tgt, double* term) {
  const T inv_b = T{1} / static_cast<T>(global_batch);
  const double gb = static_cast<double>(global_batch);
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* zi = z + i * cols;
    T* gi = g + i * cols;
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j < cols; ++j) m = m < zi[j] ? zi[j] : m;
    T s = 0;
    for (std::size_t j = 0; j < cols; ++j) s += (gi[j] = std::exp(zi[j] - m));
    const std::size_t l = static_cast<std::size_t>(lab[i]);
    const T t = zi[l];  // the labels were checked against the classes, all of them here
    mx[i] = m;
    sum[i] = s;
    tgt[i] = t;
    term[i] = (static_cast<double>(std::log(s)) + m - t) / gb;
    const T inv = T{1} / s;
    for (std::size_t j = 0; j < cols; ++j) gi[j] *= inv * inv_b;
    gi[l] -= inv_b;
  });
  return cross_entropy_totals<Space>(rows, mx, tgt, term);
}

/// Mean squared error: `g = two_scale (z - t)` over a `rows x cols` block whose targets are rows of
/// `width` values at `t` (the block's columns first), and `*sum` = `scale` times the sum of the
/// squared differences (in double, row-major; not read back: it may still be completed by a psum).
template <class Space, class T>
void squared_error(const T* z, const T* t, std::size_t rows, std::size_t cols, std::size_t width, T two_scale,
                   double scale, T* g, double* sum) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t j = 0; j < cols; ++j) g[i * cols + j] = two_scale * (z[i * cols + j] - t[i * width + j]);
  });
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    double s = 0;
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) {
        const double d = static_cast<double>(z[i * cols + j]) - static_cast<double>(t[i * width + j]);
        s += d * d;
      }
    *sum = s * scale;
  });
}

/// The index of the first of `rows` ids at `id` outside `[0, vocab)`, or `rows` when all are inside:
/// one work item writes it to `*res` (memory `Space`), read back here.
template <class Space>
std::size_t first_id_outside(const std::int32_t* id, std::size_t rows, std::int32_t vocab, std::size_t* res) {
  meshlib::launch<Space>(1, KOKKOS_LAMBDA(std::size_t) {
    std::size_t first = rows;
    for (std::size_t i = 0; i < rows; ++i)
      if (id[i] < 0 || id[i] >= vocab) {
        first = i;
        break;
      }
    *res = first;
  });
  return meshlib::read_back<Space>(res);
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/loss_kernels.hpp

namespace meshlib::nn {

namespace detail {
/// The one error of `embedding::forward` given ids it cannot take: not a rank-1 tensor of
/// `std::int32_t`, or not complete and replicated over the model axis.
template <class Layer, class ModelAxis, class Ids, class Id>
consteval bool embedding_ids_do_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, ModelAxis, Ids, Id>,
                "meshlib::nn: embedding: the ids must be complete and replicated over the model axis, one "
                "std::int32_t per token in a rank-1 tensor (every device of a model group looks up the same tokens "
                "in its own vocabulary range; the condition spells out the layer, its model axis, the ids' layout "
                "(one dims<...> entry per dimension) and their element type): shard the ids over the data axis "
                "only, flatten (batch, sequence) ids to batch * sequence (sequence-major) and convert them to "
                "std::int32_t");
  return false;
}
}  // namespace detail

/// @brief A token embedding sharded over the vocabulary along `Model` (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model">
class embedding {
 public:
  /// The table is split by rows (the vocabulary) over `Model`.
  /// (The spec of a `row_dense` weight: spelled through `dense_specs`, as GCC 12 fails on
  /// `P<dim_spec(Model.chars), none>` written in a class template of several parameters.)
  using sharding = named_sharding<Mesh, typename detail::dense_specs<dense_kind::row, Model>::w>;
  /// The table's block on a device: `vocab / n` rows.
  using table_type = parameter<T, 2, sharding>;
  /// The mesh axes of `Model`.
  static constexpr axis_mask model_mask = Mesh::template mask_of<Model>();

 private:
  std::string name_;  // first: its initialiser checks the sizes before the table is made

 public:
  /// The table, `vocab x features`, named `name + ".embedding"` (flax's name), initialised normal
  /// with standard deviation `stddev` (0.02: GPT-2's and Megatron's default).
  table_type table;

  /// `vocab` ids to `features` values each. `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `vocab` is not divisible by the size of `Model`, naming the layer,
  /// both sizes and the fix.
  embedding(const Mesh& mesh, const std::string& name, std::size_t vocab, std::size_t features, rng_key key,
            float stddev = 0.02f, std::span<const std::size_t> local_devices = {})
      : name_(checked_name(mesh, name, vocab, features)),
        table(name + ".embedding", sharding{mesh}, {vocab, features}, key, init::normal(stddev), true, local_devices),
        saved_(mesh.size()),
        out_(mesh.size()),
        bad_(mesh.size()) {}

  /// The layer's name: its parameter is `name() + ".embedding"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The number of ids (the table's rows, over all devices).
  [[nodiscard]] std::size_t vocab_size() const noexcept { return table.value.global_shape()[0]; }
  /// The width of an embedding: what it outputs.
  [[nodiscard]] std::size_t out_features() const noexcept { return table.value.global_shape()[1]; }
  /// `"tok (embedding 256 x 128, vocabulary sharded over 'model')"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (embedding " + std::to_string(vocab_size()) + " x " + std::to_string(out_features()) +
           ", vocabulary" + detail::sharded_over_text<Mesh>(model_mask) + ")";
  }
  /// Ids: complete `std::int32_t` values of rank 1, replicated over `Model`.
  template <class Ids>
  static constexpr bool accepts_input = std::is_same_v<typename Ids::value_type, std::int32_t> && Ids::rank == 1 &&
                                        Ids::partial == 0 && (Ids::vary & model_mask) == 0;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"embedding">;

  /// The output type for ids of type `Ids`: a row per id, rows sharded as the ids, features complete.
  template <class Ids>
  using output_t = rebind_local_t<Ids, T, 2, Ids::vary, 0, dim_masks<Ids::dims_type::at(0), axis_mask{0}>>;

  /// `table[ids[i]]` for every token `i` of this device (one `psum` over `Model`).
  /// @throws std::out_of_range naming the layer, the token and the id when an id is not in `[0, vocab)`.
  template <local_tensor_type Ids>
  output_t<Ids> forward(const Ids& ids) {
    static_cast<void>(require_kernel_can_read<"embedding.forward", "ids", Ids>());
    if constexpr (!accepts_input<Ids>) {
      static_cast<void>(detail::embedding_ids_do_not_fit<diagnostic_name, meshlib::diagnostic::axis_t<Model>,
                                                         meshlib::diagnostic::value_t<Ids>, typename Ids::value_type>());
      return {};  // the one diagnostic above has fired; nothing else may
    } else {
      using Z = with_partial_t<output_t<Ids>, model_mask>;  // this device's share: zeros outside its range
      const std::size_t dev = ids.device(), rows = ids.extent(0);
      const auto tl = table.local(dev);
      const std::size_t vl = tl.extent(0), d = tl.extent(1);
      const std::size_t v0 = ids.mesh().group_rank(dev, model_mask) * vl;
      check_ids(ids.data(), rows, dev);
      saved_[dev] = {ids.data(), rows};
      T* y = out_.get(dev, rows * d);
      const T* w = tl.data();
      const std::int32_t* id = ids.data();
      detail::lookup_rows<default_memory_space>(y, w, id, rows, d, v0, vl);
      if constexpr (model_mask != 0)
        static_cast<void>(meshlib::psum<Model>(detail::wrap2<Z>(y, rows, d, ids.mesh(), dev)));  // donated: in place
      return detail::wrap2<output_t<Ids>>(y, rows, d, ids.mesh(), dev);
    }
  }

  /// Adds the cotangent rows of this device's ids into its rows of the table's gradient. Returns
  /// the ids of the last forward (ids have no cotangent; see the file comment).
  /// @throws sharding_error when `dy` is not shaped as the last forward's output on this device.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"embedding.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      using Ids = rebind_local_t<DY, std::int32_t, 1, DY::vary, 0, dim_masks<DY::dims_type::at(0)>>;
      const std::size_t dev = dy.device();
      const auto [ids, rows] = saved_[dev];
      const auto tl = table.local(dev);
      const std::size_t vl = tl.extent(0), d = tl.extent(1);
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ids != nullptr, rows, d);
      const std::size_t v0 = dy.mesh().group_rank(dev, model_mask) * vl;
      T* g = table.grad.local(dev).data();
      const T* dyp = dy.data();
      const std::int32_t* id = ids;  // copies: Clang before 16 cannot capture a structured binding
      const std::size_t n = rows;
      detail::scatter_add_rows<default_memory_space>(g, dyp, id, n, d, v0, vl);
      return Ids(typename Ids::view_type(const_cast<std::int32_t*>(ids), rows), dy.mesh(), dev);
    }
  }

  /// Appends the table to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) { out.push_back(table.ref()); }

 private:
  static std::string checked_name(const Mesh& mesh, const std::string& name, std::size_t vocab, std::size_t features) {
    const std::size_t n = mesh.axes_size(model_mask);
    if (vocab % n != 0) {
      const std::size_t up = (vocab + n - 1) / n * n;
      throw sharding_error("meshlib::nn: " + name + " (embedding " + std::to_string(vocab) + " x " +
                           std::to_string(features) + "): the vocabulary of " + std::to_string(vocab) +
                           " is not divisible by the " + std::to_string(n) + " devices of the model axis '" +
                           std::string(Model.view()) + "' it is sharded over; pad the vocabulary to " +
                           std::to_string(up) + " (ids that never occur) or use a model axis whose size divides " +
                           std::to_string(vocab));
    }
    return name;
  }

  /// Throws `std::out_of_range` naming the first of the `rows` ids (this device's) that is outside the
  /// vocabulary; called by `forward`.
  void check_ids(const std::int32_t* id, std::size_t rows, std::size_t dev) {
    // The first bad token, found by one work item on the device's instance (nn/detail/loss_kernels.hpp);
    // the host reads back its index, and its id to name it.
    const std::size_t bad = detail::first_id_outside<default_memory_space>(
        id, rows, static_cast<std::int32_t>(vocab_size()), bad_.get(dev, 1));
    if (bad != rows)
      throw std::out_of_range("meshlib::nn: " + to_string() + ": token " + std::to_string(bad) + " on device " +
                              std::to_string(dev) + " has id " +
                              std::to_string(meshlib::read_back<default_memory_space>(id + bad)) +
                              ", not in [0, " + std::to_string(vocab_size()) +
                              "); map the text to ids below the vocabulary size");
  }

  struct saved {
    const std::int32_t* ids = nullptr;
    std::size_t rows = 0;
  };
  std::vector<saved> saved_;
  detail::device_buffers<T> out_;
  detail::device_buffers<std::size_t> bad_;  // check_ids' result, one per device
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/embedding.hpp
// begin meshlib/nn/layers/positional_embedding.hpp
/// @file
/// @brief `positional_embedding`: a learned position table added to the token embeddings, as GPT-2's
/// `wpe` (`flax`: a `nn.Embed` over `jnp.arange(seq)` added to the tokens), with forward and backward.
///
/// Layout: the rows are tokens, `batch * sequence` of them, sequence-major (row `i` of a device's
/// block is position `i % sequence_length()` of sequence `i / sequence_length()`), the layout every
/// Transformer layer here takes; a device's rows must be whole sequences (a sharding of the rows over
/// the data axis that splits a sequence is an error naming the sizes). The table is replicated, so
/// the layer needs no communication; its gradient is, as a weight's, a pending sum over the data axis.
/// The sequence length is set at construction or later (`set_sequence_length`, for generation with a
/// shorter context); a sequence longer than the table is refused naming both sizes.
/// Kernels: one work item per token forward; per block of columns for the table's gradient, the
/// tokens added in token order (deterministic: the same bits on every mesh).
/// @code
/// meshlib::nn::positional_embedding<float, mesh_t> pos(m, "pos", 64, 128, 64, key);   // table 64 x 128, sequences of 64
/// // inside spmd: auto h = pos.forward(tok.forward(ids));
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool positional_embedding_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: positional_embedding adds its replicated table to complete, unsharded features (rows "
                "of tokens): all_gather (or psum) the feature dimension first (the condition spells out the layer, "
                "the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief A learned positional embedding added to its input (see the file comment).
template <class T, mesh_type Mesh>
class positional_embedding {
 public:
  /// The table is replicated on every device.
  using sharding = named_sharding<Mesh, P<none, none>>;
  /// The table, `max_length x features`, named `name + ".embedding"`, normal with standard deviation `stddev`.
  parameter<T, 2, sharding> table;

  /// Positions 0 to `max_length - 1` of `features` values; sequences of `sequence_length` tokens
  /// (0: `max_length`). `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `sequence_length > max_length` (see `set_sequence_length`).
  positional_embedding(const Mesh& mesh, const std::string& name, std::size_t max_length, std::size_t features,
                       std::size_t sequence_length, rng_key key, float stddev = 0.02f,
                       std::span<const std::size_t> local_devices = {})
      : table(name + ".embedding", sharding{mesh}, {max_length, features}, key, init::normal(stddev), true, local_devices),
        name_(name),
        shape_(mesh.size()),
        out_(mesh.size()) {
    set_sequence_length(sequence_length == 0 ? max_length : sequence_length);
  }

  /// The layer's name: its parameter is `name() + ".embedding"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width it adds to: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return table.value.global_shape()[1]; }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// The longest sequence the table covers.
  [[nodiscard]] std::size_t max_length() const noexcept { return table.value.global_shape()[0]; }
  /// The tokens per sequence of the inputs.
  [[nodiscard]] std::size_t sequence_length() const noexcept { return seq_; }
  /// `"pos (positional_embedding of 64 positions x 128, sequences of 64)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (positional_embedding of " + std::to_string(max_length()) + " positions x " +
           std::to_string(in_features()) + ", sequences of " + std::to_string(seq_) + ")";
  }

  /// Sets the tokens per sequence of the next inputs.
  /// @throws sharding_error naming the layer, both sizes and the fix when `s` exceeds the table (or is 0).
  void set_sequence_length(std::size_t s) {
    if (s == 0)
      throw sharding_error("meshlib::nn: " + name_ + " (positional_embedding of " + std::to_string(max_length()) +
                           " positions): a sequence length of 0; use sequences of 1 to " +
                           std::to_string(max_length()) + " tokens");
    if (s > max_length())
      throw sharding_error("meshlib::nn: " + name_ + " (positional_embedding of " + std::to_string(max_length()) +
                           " positions): a sequence of " + std::to_string(s) + " tokens does not fit its table of " +
                           std::to_string(max_length()) + " positions; use sequences of at most " +
                           std::to_string(max_length()) + " tokens or declare " + name_ + " with max_length " +
                           std::to_string(s));
    seq_ = s;
  }

  /// Complete, unsharded features.
  template <class X>
  static constexpr bool accepts_input = X::rank == 2 && X::dims_type::at(1) == 0 && X::partial == 0;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"positional_embedding">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `x[i] + table[i % sequence_length()]` for every token `i` of this device.
  /// @throws sharding_error when `x` is not whole sequences of this width.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"positional_embedding.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::positional_embedding_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                                        input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0), d = x.extent(1), seq = seq_;
      if (d != in_features())
        throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(d) + " features; feed it " +
                             std::to_string(in_features()) + " features or declare " + name_ + " with " +
                             std::to_string(d) + " features");
      detail::check_whole_sequences(to_string(), rows, seq, dev);
      shape_[dev] = {rows, d, seq, true};
      T* y = out_.get(dev, rows * d);
      const T* xp = x.data();
      const T* w = table.local(dev).data();
      detail::add_positions<default_memory_space>(y, xp, w, rows, d, seq);
      return X(typename X::view_type(y, rows, d), x.mesh(), dev);
    }
  }

  /// Adds the cotangent of every token to its position's row of the table's gradient; returns `dy`
  /// (the cotangent of an addition passes through unchanged). The second argument is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"positional_embedding.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device(), rows = dy.extent(0), d = dy.extent(1), seq = shape_[dev].seq;
      detail::check_output_cotangent(to_string(), dev, rows, d, shape_[dev].ran, shape_[dev].rows, shape_[dev].cols);
      T* g = table.grad.local(dev).data();
      const T* dyp = dy.data();
      detail::position_grad<default_memory_space>(g, dyp, rows, d, seq);
      return dy;
    }
  }

  /// Appends the table to `out` (for the optimizer and gradient sync).
  void collect(std::vector<param_ref<T>>& out) { out.push_back(table.ref()); }

 private:
  struct shape {
    std::size_t rows = 0, cols = 0, seq = 0;  // the last forward's (the sequence length may change since)
    bool ran = false;
  };
  std::string name_;
  std::size_t seq_ = 0;
  std::vector<shape> shape_;
  detail::device_buffers<T> out_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/positional_embedding.hpp
// begin meshlib/nn/layers/tied_head.hpp
/// @file
/// @brief `tied_head`: a language model's output layer that shares its weight with the token
/// `embedding` (weight tying, as GPT-2; flax's `Embed.attend`, PyTorch's `lm_head.weight =
/// wte.weight`): `logits = x E^T`, with forward and backward.
///
/// The table `E` (`vocab x features`) is sharded over the vocabulary along the model axis, so each
/// device's block of logits is `x E_b^T`: the logits come out sharded over the vocabulary, as a
/// `column_dense` head's do, with no communication, and go to `softmax_cross_entropy` without being
/// gathered. Backward is the transpose: `dE_b += dy^T x` (into the embedding's own gradient, which
/// therefore sums the lookup's and the head's contributions, the gradient of a tied weight), and
/// `dx = dy E_b`, a pending sum over the model axis that one `psum` completes (the transpose of the
/// replicated input's implicit `pvary`, as in `column_dense`).
///
/// The head holds a copy of the embedding's `parameter`: copies share the value and gradient blocks
/// (tensors are handles), so the two layers read and update one array, and `collect` lists it once
/// (from the embedding). Both add into the gradient: `train_step` zeroes it before a step.
/// @code
/// meshlib::nn::embedding<float, mesh_t> tok(m, "tok", 256, 128, key);
/// meshlib::nn::tied_head<float, mesh_t> head(tok);   // logits over the same 256 ids
/// meshlib::nn::sequential gpt(tok, /* ... blocks, final norm ... */ head);
/// @endcode

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

namespace detail {
template <class Layer, class ModelAxis, class Receives, class Needs>
consteval bool tied_head_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, ModelAxis, Receives, Needs>,
                "meshlib::nn: tied_head takes complete, unsharded features of its mesh (the output of a norm or a "
                "row_dense) and returns logits sharded over its model axis: all_gather (or psum) the features first "
                "(the condition spells out the layer, its model axis, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief The output layer tied to an `embedding` (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model">
class tied_head {
 public:
  /// The embedding it is tied to.
  using embedding_type = embedding<T, Mesh, Model>;
  /// The mesh axes of `Model`.
  static constexpr axis_mask model_mask = embedding_type::model_mask;

  /// Ties the head to `tok`'s table (shared, not copied: see the file comment).
  explicit tied_head(const embedding_type& tok)
      : table_(tok.table), name_(tok.name() + ".attend"), saved_(tok.table.value.num_devices()),
        out_(tok.table.value.num_devices()), dx_(tok.table.value.num_devices()) {}

  /// `"tok.attend"`: the embedding's name and flax's method name.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width it takes.
  [[nodiscard]] std::size_t in_features() const noexcept { return table_.value.global_shape()[1]; }
  /// The vocabulary: the logits' width (over all devices).
  [[nodiscard]] std::size_t out_features() const noexcept { return table_.value.global_shape()[0]; }
  /// `"tok.attend (tied_head 128 -> 256, vocabulary sharded over 'model')"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (tied_head " + std::to_string(in_features()) + " -> " + std::to_string(out_features()) +
           ", vocabulary" + detail::sharded_over_text<Mesh>(model_mask) + ")";
  }

  /// The input of a `column_dense`: complete, unsharded features.
  template <class X>
  static constexpr bool accepts_input = column_dense<T, Mesh, Model>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"tied_head">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `x E_b^T`: this device's block of the logits, sharded over the vocabulary.
  /// @throws sharding_error when `x`'s width is not the embedding's.
  template <local_tensor_type X>
  auto forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"tied_head.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::tied_head_input_does_not_fit<diagnostic_name, meshlib::diagnostic::axis_t<Model>,
                                                             meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      // The logits' type: a column_dense head's for this input (the matmul's sharding rules).
      using W = typename parameter<T, 2, named_sharding<Mesh, typename detail::dense_specs<dense_kind::column, Model>::w>>::local_type;
      using Y = decltype(meshlib::matmul(x, std::declval<const W&>()));
      const std::size_t dev = x.device(), rows = x.extent(0), d = x.extent(1);
      const auto tl = table_.local(dev);
      const std::size_t vl = tl.extent(0);
      if (d != tl.extent(1))
        throw sharding_error("meshlib::nn: " + to_string() + " received " + std::to_string(d) + " features; feed it " +
                             std::to_string(tl.extent(1)) + " features (the width of the embedding it is tied to)");
      saved_[dev] = {x.data(), rows};
      T* y = out_.get(dev, rows * vl);
      matmul_into(view(y, rows, vl), cview(x.data(), rows, d), cview(tl.data(), vl, d), {.transpose_b = true});
      return detail::wrap2<Y>(y, rows, vl, x.mesh(), dev);
    }
  }

  /// Adds `dy^T x` to the embedding's gradient and returns `dx = psum<Model>(dy E_b)` (when `need_dx`).
  /// @throws sharding_error when no forward ran on this device or `dy` is not the logits' shape.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"tied_head.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      using DX = rebind_local_t<DY, T, 2, DY::vary & ~model_mask, 0, dim_masks<DY::dims_type::at(0), axis_mask{0}>>;
      using DXP = with_partial_t<DX, model_mask>;
      const std::size_t dev = dy.device();
      const auto [x, rows] = saved_[dev];
      const auto tl = table_.local(dev);
      const std::size_t vl = tl.extent(0), d = tl.extent(1);
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), x != nullptr, rows, vl);
      const cview dyv(dy.data(), rows, vl);
      matmul_into(view(table_.grad.local(dev).data(), vl, d), dyv, cview(x, rows, d), {.transpose_a = true, .beta = 1});
      T* dx = dx_.get(dev, rows * d);
      if (!need_dx) return detail::wrap2<DX>(dx, rows, d, dy.mesh(), dev);
      matmul_into(view(dx, rows, d), dyv, cview(tl.data(), vl, d));
      if constexpr (model_mask != 0)
        return meshlib::psum<Model>(detail::wrap2<DXP>(dx, rows, d, dy.mesh(), dev));  // donated: in place
      else
        return detail::wrap2<DX>(dx, rows, d, dy.mesh(), dev);
    }
  }

  /// Nothing: the table is the embedding's, which lists it.
  void collect(std::vector<param_ref<T>>&) {}
  /// The embedding's table, which it reads and adds gradients to without listing it: a pipeline
  /// stage that holds this head but not the embedding mirrors the table (nn/parallel/pipeline.hpp).
  void collect_tied(std::vector<param_ref<T>>& out) { out.push_back(table_.ref()); }

 private:
  using cview = meshlib::unmanaged_block_view<const T, 2, default_memory_space>;
  using view = meshlib::unmanaged_block_view<T, 2, default_memory_space>;
  struct saved {
    const T* x = nullptr;
    std::size_t rows = 0;
  };
  typename embedding_type::table_type table_;  // shares the embedding's blocks
  std::string name_;
  std::vector<saved> saved_;
  detail::device_buffers<T> out_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/tied_head.hpp
// begin meshlib/nn/layers/attention.hpp
/// @file
/// @brief `causal_self_attention`: multi-head causal self-attention with its heads sharded over a
/// model axis (Megatron's `ParallelAttention`; `flax.linen.MultiHeadDotProductAttention` with a
/// causal mask, `torch.nn.MultiheadAttention(..., is_causal=True)` when the axis has one device),
/// with forward and backward.
///
/// Layout: the rows are tokens, `batch * sequence` of them, sequence-major (row `i` of a device's
/// block is position `i % sequence_length()` of sequence `i / sequence_length()`), the features
/// complete; the rows may be sharded over the data axis as long as each device holds whole sequences.
/// The output has the input's type and shape.
///
/// Tensor parallelism, as Megatron splits it (one `psum` forward, one backward):
/// - the fused Q, K, V projection is a `column_dense` (`features -> 3 features`, no communication),
///   its columns ordered head by head (`[head][q, k, v][head_dim]`), so a device's block of columns
///   is exactly its `heads / n` heads' queries, keys and values;
/// - each device attends with its own heads: `softmax(mask(Q K^T / sqrt(head_dim))) V` per sequence
///   and head, no communication;
/// - the heads' outputs, concatenated (sharded over the model axis), go through a `row_dense`
///   (`features -> features`) whose `psum` completes the output. Backward is the transpose: a `pvary`
///   into the output projection, the `psum` of the input's cotangent in the QKV projection.
///
/// The softmax runs in the layer's element type (float for a float model) with each row's maximum
/// subtracted, over the positions `j <= i` only (the causal mask: those above are exactly 0).
/// Products are `matmul_into` calls on each (sequence, head) block; the rearrangements between the
/// fused projection's layout and per-head contiguous blocks, the softmax and its backward are
/// Kokkos kernels on the running device's instance.
///
/// Parameters: `name + ".qkv.w"`, `".qkv.b"` (the fused projection) and `".out.w"`, `".out.b"`.
/// The number of heads must be divisible by the size of the model axis (a `sharding_error` at
/// construction names the layer, the heads, the axis size and the fix), and the width by the heads.
/// @code
/// meshlib::nn::causal_self_attention<float, mesh_t> attn(m, "attn", 128, 4, 64, key);  // width 128, 4 heads, sequences of 64
/// // inside spmd: auto y = attn.forward(x);   // x: (batch * 64, 128), rows sharded over data
/// @endcode

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/nn/detail/attention_kernels.hpp
/// @file
/// @brief The kernels of causal self-attention besides its products: the heads' layouts (split and
/// merge, and their inverses) and the causal softmax with its backward, one work item per token or
/// per row of scores. Free functions over pointers, templated on the element type and the memory
/// space only, for the reason nn/detail/layer_kernels.hpp gives (nvcc and kernels in mesh-templated code).

#include <cmath>
#include <cstddef>
#include <limits>


namespace meshlib::nn::detail {

/// The fused projection's output `(token, [head][q|k|v][head_dim])` as `[q|k|v][head][token][head_dim]`
/// (each sequence and head contiguous for the products), and back (`unsplit_heads`).
template <class Space, class T>
void split_heads(T* qh, const T* y, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t t = 0; t < 3; ++t)
        for (std::size_t e = 0; e < hd; ++e) qh[((t * hl + h) * rows + i) * hd + e] = y[i * 3 * hl * hd + (h * 3 + t) * hd + e];
  });
}

/// The inverse of `split_heads`.
template <class Space, class T>
void unsplit_heads(T* y, const T* qh, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t t = 0; t < 3; ++t)
        for (std::size_t e = 0; e < hd; ++e) y[i * 3 * hl * hd + (h * 3 + t) * hd + e] = qh[((t * hl + h) * rows + i) * hd + e];
  });
}

/// The heads' outputs `[head][token][head_dim]` as the output projection's rows `(token, [head][head_dim])`,
/// and back (`unmerge_heads`).
template <class Space, class T>
void merge_heads(T* o, const T* oh, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t e = 0; e < hd; ++e) o[i * hl * hd + h * hd + e] = oh[(h * rows + i) * hd + e];
  });
}

/// The inverse of `merge_heads`.
template <class Space, class T>
void unmerge_heads(T* oh, const T* o, std::size_t rows, std::size_t hl, std::size_t hd) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t h = 0; h < hl; ++h)
      for (std::size_t e = 0; e < hd; ++e) oh[(h * rows + i) * hd + e] = o[i * hl * hd + h * hd + e];
  });
}

/// In place over `n` rows of `seq` scores: row `r` is query position `i = r % seq`; `softmax` over
/// `j <= i` with the maximum subtracted, 0 above.
template <class Space, class T>
void causal_softmax(T* s, std::size_t n, std::size_t seq) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t r) {
    T* row = s + r * seq;
    const std::size_t last = r % seq;
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j <= last; ++j) m = row[j] > m ? row[j] : m;
    T sum = 0;
    for (std::size_t j = 0; j <= last; ++j) sum += (row[j] = std::exp(row[j] - m));
    const T inv = T{1} / sum;
    for (std::size_t j = 0; j <= last; ++j) row[j] *= inv;
    for (std::size_t j = last + 1; j < seq; ++j) row[j] = T{0};
  });
}

/// `dS = scale * P (dP - rowsum(P dP))` in place of `dp` (the softmax's backward, with the scale of
/// the scores folded in); 0 above the diagonal.
template <class Space, class T>
void causal_softmax_backward(const T* p, T* dp, std::size_t n, std::size_t seq, T scale) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t r) {
    const T* pr = p + r * seq;
    T* d = dp + r * seq;
    const std::size_t last = r % seq;
    T dot = 0;
    for (std::size_t j = 0; j <= last; ++j) dot += pr[j] * d[j];
    for (std::size_t j = 0; j <= last; ++j) d[j] = scale * pr[j] * (d[j] - dot);
    for (std::size_t j = last + 1; j < seq; ++j) d[j] = T{0};
  });
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/attention_kernels.hpp

namespace meshlib::nn {

/// @brief Multi-head causal self-attention, heads sharded over `Model` (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model">
class causal_self_attention {
 public:
  /// The mesh axes of `Model`.
  static constexpr axis_mask model_mask = Mesh::template mask_of<Model>();

 private:
  std::string name_;  // first: its initialiser checks the sizes before the projections are made

 public:
  /// The fused Q, K, V projection, `features -> 3 features`, columns `[head][q, k, v][head_dim]`.
  column_dense<T, Mesh, Model> qkv;
  /// The output projection, `features -> features`, rows `[head][head_dim]`.
  row_dense<T, Mesh, Model> proj;

  /// `features` values per token, split into `heads` heads of `features / heads`; sequences of
  /// `sequence_length` tokens. `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `heads` is not divisible by the size of `Model`, or `features` by `heads`.
  causal_self_attention(const Mesh& mesh, const std::string& name, std::size_t features, std::size_t heads,
                        std::size_t sequence_length, rng_key key, std::span<const std::size_t> local_devices = {})
      : name_(checked_name(mesh, name, features, heads)),
        qkv(mesh, name + ".qkv", features, 3 * features, key, local_devices),
        proj(mesh, name + ".out", features, features, key, local_devices),
        heads_(heads),
        saved_(mesh.size()),
        qkvh_(mesh.size()),
        probs_(mesh.size()),
        oh_(mesh.size()),
        ocat_(mesh.size()),
        doh_(mesh.size()),
        dqkvh_(mesh.size()),
        dprobs_(mesh.size()),
        dqkv_(mesh.size()) {
    set_sequence_length(sequence_length);
  }

  /// The layer's name: its parameters are `name() + ".qkv.w"`, `".qkv.b"`, `".out.w"`, `".out.b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width of a token: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return proj.out_features(); }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// The number of heads (over all devices of the model axis).
  [[nodiscard]] std::size_t heads() const noexcept { return heads_; }
  /// The tokens per sequence of the inputs.
  [[nodiscard]] std::size_t sequence_length() const noexcept { return seq_; }
  /// Sets the tokens per sequence of the next inputs (a shorter context for generation).
  /// @throws sharding_error when `s` is 0.
  void set_sequence_length(std::size_t s) {
    if (s == 0)
      throw sharding_error("meshlib::nn: " + to_string() + ": a sequence length of 0; give it the tokens per sequence");
    seq_ = s;
  }
  /// `"attn (causal_self_attention 128 features, 4 heads sharded over 'model', sequences of 64)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (causal_self_attention " + std::to_string(in_features()) + " features, " + std::to_string(heads_) +
           " heads" + detail::sharded_over_text<Mesh>(model_mask) + ", sequences of " + std::to_string(seq_) + ")";
  }

  /// The input of a `column_dense`: complete, unsharded features.
  template <class X>
  static constexpr bool accepts_input = column_dense<T, Mesh, Model>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"causal_self_attention">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The attention of every token of this device to the tokens before it in its sequence.
  /// @throws sharding_error when `x` is not whole sequences of the layer's width.
  template <local_tensor_type X>
  auto forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"causal_self_attention.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(
          detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0), seq = seq_;
      detail::check_whole_sequences(to_string(), rows, seq, dev);
      auto y = qkv.forward(x);  // checks the width; (rows, 3 * local heads * head_dim)
      using H = decltype(y);    // features sharded over Model: the layout of the heads' outputs too
      const std::size_t hl = heads_ / x.mesh().axes_size(model_mask), hd = in_features() / heads_, nb = rows / seq;
      saved_[dev] = {rows, seq, true};
      // [q, k, v][local head][token][head_dim]: each (sequence, head) block contiguous, for the products.
      T* qh = qkvh_.get(dev, 3 * hl * rows * hd);
      const T* yp = y.data();
      detail::split_heads<default_memory_space>(qh, yp, rows, hl, hd);
      T* p = probs_.get(dev, hl * nb * seq * seq);  // [head][sequence][i][j]
      T* oh = oh_.get(dev, hl * rows * hd);         // [head][token][head_dim]
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      // One batch of hl * nb products each (a strided-batched cuBLAS call on a GPU): S = scale Q K^T, O = P V.
      const std::size_t g = hl * nb;
      matmul_into(view3(p, g, seq, seq), cview3(part(qh, 0, hl, rows, hd), g, seq, hd), cview3(part(qh, 1, hl, rows, hd), g, seq, hd),
                  {.transpose_b = true, .alpha = scale});
      detail::causal_softmax<default_memory_space>(p, hl * nb * seq, seq);
      matmul_into(view3(oh, g, seq, hd), cview3(p, g, seq, seq), cview3(part(qh, 2, hl, rows, hd), g, seq, hd));
      T* oc = ocat_.get(dev, rows * hl * hd);  // (token, [head][head_dim]): the output projection's input
      const T* ohp = oh;
      detail::merge_heads<default_memory_space>(oc, ohp, rows, hl, hd);
      return proj.forward(detail::wrap2<H>(oc, rows, hl * hd, x.mesh(), dev));
    }
  }

  /// The cotangent of the input (when `need_dx`); accumulates the projections' gradients.
  /// @throws sharding_error when no forward ran on this device or `dy` is not its output's shape.
  template <local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"causal_self_attention.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      if (!saved_[dev].ran)
        throw sharding_error("meshlib::nn: " + to_string() + ".backward ran on device " + std::to_string(dev) +
                             " before any forward there; run forward first (backward uses what it saved)");
      const std::size_t rows = saved_[dev].rows, seq = saved_[dev].seq;  // the forward's, whatever was set since
      auto dout = proj.backward(dy, true);  // checks dy; (rows, local heads * head_dim)
      using H = decltype(dout);
      const std::size_t hl = heads_ / dy.mesh().axes_size(model_mask), hd = in_features() / heads_, nb = rows / seq;
      const T* qh = qkvh_.get(dev, 3 * hl * rows * hd);
      const T* p = probs_.get(dev, hl * nb * seq * seq);
      T* doh = doh_.get(dev, hl * rows * hd);
      const T* dop = dout.data();
      detail::unmerge_heads<default_memory_space>(doh, dop, rows, hl, hd);
      T* dqh = dqkvh_.get(dev, 3 * hl * rows * hd);  // [dq, dk, dv][head][token][head_dim]
      T* dp = dprobs_.get(dev, hl * nb * seq * seq);
      const std::size_t g = hl * nb;
      const auto pb = cview3(p, g, seq, seq);
      const auto dob = cview3(doh, g, seq, hd);
      // dV = P^T dO; dP = dO V^T (each a batch over heads and sequences)
      matmul_into(view3(part(dqh, 2, hl, rows, hd), g, seq, hd), pb, dob, {.transpose_a = true});
      matmul_into(view3(dp, g, seq, seq), dob, cview3(part(qh, 2, hl, rows, hd), g, seq, hd), {.transpose_b = true});
      detail::causal_softmax_backward<default_memory_space>(p, dp, hl * nb * seq, seq, static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd))));
      const auto dsb = cview3(dp, g, seq, seq);
      // dQ = dS K; dK = dS^T Q (dS already holds the scale)
      matmul_into(view3(part(dqh, 0, hl, rows, hd), g, seq, hd), dsb, cview3(part(qh, 1, hl, rows, hd), g, seq, hd));
      matmul_into(view3(part(dqh, 1, hl, rows, hd), g, seq, hd), dsb, cview3(part(qh, 0, hl, rows, hd), g, seq, hd),
                  {.transpose_a = true});
      T* dq = dqkv_.get(dev, rows * 3 * hl * hd);  // back to the fused projection's column order
      const T* dqhp = dqh;
      detail::unsplit_heads<default_memory_space>(dq, dqhp, rows, hl, hd);
      return qkv.backward(detail::wrap2<H>(dq, rows, 3 * hl * hd, dy.mesh(), dev), need_dx);
    }
  }

  /// Appends the projections' parameters to `out`: `.qkv.w`, `.qkv.b`, `.out.w`, `.out.b`.
  void collect(std::vector<param_ref<T>>& out) {
    qkv.collect(out);
    proj.collect(out);
  }

 private:
  using cview3 = meshlib::unmanaged_block_view<const T, 3, default_memory_space>;
  using view3 = meshlib::unmanaged_block_view<T, 3, default_memory_space>;

  /// Part `t` (q, k, v) of a `[part][head][token][head_dim]` buffer: `hl * rows / seq` blocks of
  /// `seq x head_dim`, one per (head, sequence), each contiguous and `seq * head_dim` apart, the
  /// batch the products run over (the probabilities' `[head][sequence][i][j]` blocks likewise).
  static T* part(T* base, std::size_t t, std::size_t hl, std::size_t rows, std::size_t hd) {
    return base + t * hl * rows * hd;
  }
  static const T* part(const T* base, std::size_t t, std::size_t hl, std::size_t rows, std::size_t hd) {
    return base + t * hl * rows * hd;
  }


 private:
  static std::string checked_name(const Mesh& mesh, const std::string& name, std::size_t features, std::size_t heads) {
    const std::size_t n = mesh.axes_size(model_mask);
    const std::string who = "meshlib::nn: " + name + " (causal_self_attention " + std::to_string(features) +
                            " features, " + std::to_string(heads) + " heads)";
    if (heads == 0 || heads % n != 0)
      throw sharding_error(who + ": " + std::to_string(heads) + " heads are not divisible by the " + std::to_string(n) +
                           " devices of the model axis '" + std::string(Model.view()) +
                           "' the heads are sharded over; use a number of heads divisible by " + std::to_string(n) +
                           " or a model axis whose size divides " + std::to_string(heads));
    if (features % heads != 0)
      throw sharding_error(who + ": " + std::to_string(features) + " features do not split into " +
                           std::to_string(heads) + " heads; use a width divisible by the number of heads");
    return name;
  }

  struct saved {
    std::size_t rows = 0, seq = 0;
    bool ran = false;
  };
  std::size_t heads_, seq_ = 0;
  std::vector<saved> saved_;
  detail::device_buffers<T> qkvh_, probs_, oh_, ocat_, doh_, dqkvh_, dprobs_, dqkv_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/attention.hpp
// begin meshlib/nn/layers/transformer_block.hpp
/// @file
/// @brief `transformer_block`: the pre-norm decoder block of GPT-2 and its successors,
/// `h = x + attn(norm1(x))`, `y = h + mlp(norm2(h))` with `mlp = row_dense(gelu(column_dense(.)))`,
/// with forward and backward, a layer of `sequential` like any other.
///
/// Tensor parallelism is Megatron's: the attention's heads and the MLP's hidden units are sharded
/// over the model axis, each half a column-parallel then a row-parallel product, so a block costs two
/// `psum`s forward (one per half) and two backward; the norms and the residual additions are
/// replicated over the model axis and need none. The residual branches' cotangents are added (the
/// cotangent of `x + f(x)` is `dy + f'(x)^T dy`) by a Kokkos kernel on the running device's instance.
///
/// `Norm` is `layer_norm` (GPT-2, the default) or `rms_norm` (Llama); GELU is the tanh form
/// (`jax.nn.gelu`'s default). Layout: as `causal_self_attention` (rows `batch * sequence` tokens,
/// sequence-major, whole sequences per device). Parameters: `name + ".ln1"`, `".attn"`, `".ln2"`,
/// `".mlp.fc1"`, `".mlp.fc2"` and their own suffixes.
/// @code
/// meshlib::nn::transformer_block<float, mesh_t> blk(m, "h0", 128, 4, 512, 64, key);  // width 128, 4 heads, MLP 512, sequences of 64
/// // inside spmd: auto y = blk.forward(x);
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

/// @brief A pre-norm Transformer decoder block (see the file comment).
template <class T, mesh_type Mesh, fixed_string Model = "model", class Norm = layer_norm<T, Mesh>>
class transformer_block {
 public:
  Norm ln1;                                   ///< before the attention
  causal_self_attention<T, Mesh, Model> attn;  ///< heads sharded over `Model`
  Norm ln2;                                   ///< before the MLP
  column_dense<T, Mesh, Model> fc1;           ///< `features -> mlp_features`, hidden units sharded
  gelu<T> act;                                ///< tanh GELU
  row_dense<T, Mesh, Model> fc2;              ///< `mlp_features -> features`, one psum

  /// `features` values per token, `heads` heads, an MLP of `mlp_features` hidden units (4 x
  /// features in GPT-2), sequences of `sequence_length` tokens.
  /// @throws sharding_error when the heads or the MLP's hidden units do not divide over `Model`.
  transformer_block(const Mesh& mesh, const std::string& name, std::size_t features, std::size_t heads,
                    std::size_t mlp_features, std::size_t sequence_length, rng_key key,
                    std::span<const std::size_t> local_devices = {})
      : ln1(mesh, name + ".ln1", features, T(1e-5), local_devices),
        attn(mesh, name + ".attn", features, heads, sequence_length, key, local_devices),
        ln2(mesh, name + ".ln2", features, T(1e-5), local_devices),
        fc1(mesh, name + ".mlp.fc1", features, mlp_features, key, local_devices),
        act(mesh),
        fc2(mesh, name + ".mlp.fc2", mlp_features, features, key, local_devices),
        name_(name),
        h_(mesh.size()),
        y_(mesh.size()),
        dh_(mesh.size()),
        dx_(mesh.size()) {}

  /// The block's name: the prefix of its parameters.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The width of a token: what it takes and returns.
  [[nodiscard]] std::size_t in_features() const noexcept { return attn.in_features(); }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_features(); }
  /// `"h0 (transformer_block 128 features, 4 heads, MLP 512)"`: how messages name the block.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (transformer_block " + std::to_string(in_features()) + " features, " +
           std::to_string(attn.heads()) + " heads, MLP " + std::to_string(fc1.out_features()) + ")";
  }
  /// Sets the tokens per sequence of the next inputs (the attention's).
  void set_sequence_length(std::size_t s) { attn.set_sequence_length(s); }

  /// Complete, unsharded features (the attention's input).
  template <class X>
  static constexpr bool accepts_input = causal_self_attention<T, Mesh, Model>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"transformer_block">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// `h = x + attn(ln1(x))`, then `h + fc2(gelu(fc1(ln2(h))))`.
  template <local_tensor_type X>
  X forward(const X& x) {
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(
          detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else if constexpr ((X::vary & causal_self_attention<T, Mesh, Model>::model_mask) != 0) {
      // The attention's output is the same on every device of the model axis, the input is not: no sum.
      using needs = diagnostic::replicated_over<
          meshlib::diagnostic::axes_t<Mesh, causal_self_attention<T, Mesh, Model>::model_mask>>;
      static_cast<void>(detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, needs>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.size();
      auto a = attn.forward(ln1.forward(x));
      // Holds once the checks above pass (an internal invariant, not a user error).
      static_assert(std::is_same_v<decltype(a), X>, "meshlib::nn: transformer_block: the attention returns its input's type");
      T* h = h_.get(dev, n);
      detail::sum_values<default_memory_space>(h, x.data(), a.data(), n);
      const X hx(typename X::view_type(h, x.extent(0), x.extent(1)), x.mesh(), dev);
      auto m = fc2.forward(act.forward(fc1.forward(ln2.forward(hx))));
      T* y = y_.get(dev, n);
      detail::sum_values<default_memory_space>(y, h, m.data(), n);
      return X(typename X::view_type(y, x.extent(0), x.extent(1)), x.mesh(), dev);
    }
  }

  /// The cotangent of the input (`need_dx` is passed to the first product, whose input is `ln1`'s
  /// output, so the cotangent is always computed: the residual needs it).
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device(), n = dy.size();
      auto dm = ln2.backward(fc1.backward(act.backward(fc2.backward(dy, true)), true));
      T* dh = dh_.get(dev, n);
      detail::sum_values<default_memory_space>(dh, dy.data(), dm.data(), n);
      const DY dhx(typename DY::view_type(dh, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
      auto da = ln1.backward(attn.backward(dhx, true));
      T* dx = dx_.get(dev, n);
      detail::sum_values<default_memory_space>(dx, dh, da.data(), n);
      return DY(typename DY::view_type(dx, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
    }
  }

  /// Appends the parameters in order: `ln1`, `attn`, `ln2`, `fc1`, `fc2`.
  void collect(std::vector<param_ref<T>>& out) {
    ln1.collect(out);
    attn.collect(out);
    ln2.collect(out);
    fc1.collect(out);
    fc2.collect(out);
  }

 private:

  std::string name_;
  detail::device_buffers<T> h_, y_, dh_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/transformer_block.hpp
// begin meshlib/nn/layers/dropout.hpp
/// @file
/// @brief `dropout` with a mesh-invariant mask: element `(r, c)` of the *global* activation is kept
/// iff `uniform(key.fold_in(step).fold_in(id), r * cols + c) >= rate`, computed by whichever device
/// holds it, so a sharded activation drops exactly the elements the single-device run drops
/// (`flax.linen.Dropout`, but with JAX's values independent of the sharding). Identity in evaluation.
/// Mask, forward and backward are Kokkos kernels on the running device's instance.
/// @code
/// meshlib::nn::dropout<float> drop(m, "drop1", 0.1f);
/// // train_step calls begin_step(key, true) on the model; then inside spmd: auto y = drop.forward(x);
/// @endcode

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/nn/number_text.hpp
/// @file
/// @brief `number_text`: a number in a message as a user would write it (`1e-4`, `0.9`, `0.01`),
/// not as `std::to_string` prints it (`0.000100`, `0.900000`): the shortest text that reads back as
/// the same value (`std::to_chars`), with the exponent's leading zeros and `+` dropped. Locale
/// independent, as every message is.

#include <charconv>
#include <string>

namespace meshlib::nn::detail {

/// `v` as the shortest decimal text that reads back as `v` (fixed or scientific, whichever is
/// shorter): `number_text(1e-4f) == "1e-4"`, `number_text(0.01f) == "0.01"`, `number_text(3.0f) == "3"`,
/// `number_text(2.5e10) == "2.5e10"`. With `significant` > 0, rounded to that many significant digits
/// first (`number_text(0.30000000004, 6) == "0.3"`): for values that carry noise, such as a finite
/// difference, where the digits past the sixth say nothing to a reader.
template <class T>
std::string number_text(T v, int significant = 0) {
  char buf[64];
  const auto r = significant > 0 ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, significant)
                                 : std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  const auto e = s.find('e');
  if (e == std::string::npos) return s;
  std::string exp = s.substr(e + 1);
  const bool negative = !exp.empty() && exp.front() == '-';
  if (!exp.empty() && (exp.front() == '-' || exp.front() == '+')) exp.erase(0, 1);
  while (exp.size() > 1 && exp.front() == '0') exp.erase(0, 1);
  return s.substr(0, e + 1) + (negative ? "-" : "") + exp;
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/number_text.hpp

namespace meshlib::nn {

/// @brief Inverted dropout: kept elements are scaled by `1 / (1 - rate)`.
template <class T>
class dropout {
 public:
  /// Drops each value with probability `rate` in training; `name` seeds its own random stream.
  template <mesh_type Mesh>
  dropout(const Mesh& mesh, const std::string& name, float rate)
      : name_(name), id_(detail::name_id(name)), rate_(rate), shape_(mesh.size()), mask_(mesh.size()), out_(mesh.size()),
        dx_(mesh.size()) {}

  /// The width out is the width in (sequential compares the layers around it).
  static constexpr bool keeps_features = true;
  /// The name that seeds its random stream.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// `"drop1 (dropout 0.1)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (dropout " + detail::number_text(rate_) + ")";
  }

  /// A rank-2 block (rows, features), of any layout: the mask is a function of the global element.
  template <class X>
  static constexpr bool accepts_input = X::rank == 2;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"dropout">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::rank<2>;

  /// The step's key and mode (called by `sequential::begin_step` before the devices run).
  void begin_step(rng_key key, bool train) {
    key_ = key.fold_in(id_);
    train_ = train;
  }

  /// Zeroes each value with probability `rate` and scales the rest by `1 / (1 - rate)`; the identity outside training.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"dropout.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(
          detail::layer_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0), cols = x.extent(1);
      if (!train_ || rate_ <= 0.0f) return x;
      shape_[dev] = {rows, cols, true};
      const std::size_t r0 = detail::global_offset(x, 0), c0 = detail::global_offset(x, 1);
      const std::size_t gcols = x.global_extent(1);
      T* mask = mask_.get(dev, rows * cols);
      T* y = out_.get(dev, rows * cols);
      const T keep = T{1} / static_cast<T>(1.0f - rate_);
      const T* xp = x.data();
      const rng_key key = key_;
      const float rate = rate_;
      // One work item per row (the row's global index is computed once, as in the loop).
      detail::dropout_forward<default_memory_space>(y, mask, xp, rows, cols, r0, c0, gcols, key, rate, keep);
      return X(typename X::view_type(y, rows, cols), x.mesh(), dev);
    }
  }

  /// Applies the forward step's mask to the cotangent `dy`; the second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input (in training).
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"dropout.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      if (!train_ || rate_ <= 0.0f) return dy;
      const std::size_t dev = dy.device(), n = dy.size();
      const auto [rows, cols, ran] = shape_[dev];
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, rows, cols);
      const T* mask = mask_.get(dev, n);
      T* dx = dx_.get(dev, n);
      const T* d = dy.data();
      detail::multiply_values<default_memory_space>(dx, d, mask, n);
      return DY(typename DY::view_type(dx, dy.extent(0), dy.extent(1)), dy.mesh(), dev);
    }
  }

  /// Adds nothing: dropout has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::string name_;
  std::uint64_t id_;
  float rate_;
  rng_key key_{};
  bool train_ = false;
  std::vector<shape> shape_;  // per device: the last training forward's input shape (backward's mask)
  detail::device_buffers<T> mask_, out_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/dropout.hpp
// begin meshlib/nn/layers/image_shape.hpp
/// @file
/// @brief `image_shape`: the height, width and channels of one image, as the convolutional layers
/// (conv2d, pooling, batch_norm, basic_block) read their rank-2 input.
///
/// Why rank 2 and channels-last (NHWC, flattened): every layer of `nn` takes a rank-2 block of rows
/// (the batch, sharded over the data axis) by features, and `train_step` feeds exactly that; an
/// image row is its pixels in NHWC order, `features = height * width * channels`, so a convolutional
/// stack composes with `dense` and `sequential` (their width checks included) with no reshape, and
/// Fashion-MNIST's 784 features are a 28x28x1 image as they come. Channels-last is also what makes
/// the convolution a plain GEMM (see conv2d.hpp), as in TensorFlow's and JAX's default layout.
/// @code
/// meshlib::nn::image_shape in{28, 28, 1};   // in.size() == 784 features per row
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>


namespace meshlib::nn {

/// @brief One image's shape, NHWC without the N: `height x width x channels`.
struct image_shape {
  std::size_t height = 0;    ///< rows of pixels
  std::size_t width = 0;     ///< columns of pixels
  std::size_t channels = 0;  ///< values per pixel, contiguous (channels-last)

  /// The features of one row: `height * width * channels`.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return height * width * channels; }
  /// The pixels of one image: `height * width`.
  [[nodiscard]] constexpr std::size_t pixels() const noexcept { return height * width; }
  /// `"28x28x1"`, as messages print it.
  [[nodiscard]] std::string to_string() const {
    return std::to_string(height) + "x" + std::to_string(width) + "x" + std::to_string(channels);
  }
  /// Equal when height, width and channels are.
  friend constexpr bool operator==(const image_shape&, const image_shape&) = default;
};

namespace detail {
/// The message of a layer that received `got` features per row but takes images of shape `want`
/// (`who`: `"conv1 (conv2d ...)"`, `name`: `"conv1"`): when `got` is a whole number of `want`'s
/// pixels it names the channel count it found, the usual mistake (a layer declared with the wrong
/// `C_in`).
inline std::string image_width_error(const std::string& who, const std::string& name, std::size_t got,
                                     const image_shape& want) {
  std::string s = "meshlib::nn: " + who + " received " + std::to_string(got) + " features per row, but it takes " +
                  want.to_string() + " images (height x width x channels, NHWC) = " + std::to_string(want.size()) +
                  " features";
  if (want.pixels() != 0 && got % want.pixels() == 0 && got != 0) {
    const std::size_t c = got / want.pixels();
    return s + ": that is " + std::to_string(c) + " channels where " + name + " takes " +
           std::to_string(want.channels) + "; declare " + name + " with " + std::to_string(c) +
           " input channels, or feed it " + std::to_string(want.channels) + "-channel images";
  }
  return s + "; declare " + name + " with the image shape of the layer before it (its output_shape())";
}

/// Refuses a `window` x `window` kernel or pooling window (`what`: `"kernel"`, `"window"`) larger
/// than the image `in` padded by `padding` on every side (`pads`: whether the layer can pad, so
/// that the message offers padding as a fix). `head` names the layer: `"meshlib::nn: c (conv2d
/// 5x5 on 2x3x1 images)"`. The one check conv2d and the pooling layers share.
/// @throws sharding_error naming the sizes and the fixes.
inline void check_window_fits(const std::string& head, const image_shape& in, std::size_t window, std::size_t padding,
                              bool pads, const std::string& what) {
  const std::size_t h = in.height + 2 * padding, w = in.width + 2 * padding;
  if (h >= window && w >= window) return;
  const std::string square = std::to_string(window) + "x" + std::to_string(window);
  std::string input = std::to_string(in.height) + "x" + std::to_string(in.width);
  std::string fixes = "use a " + what + " of at most " + std::to_string(std::min(h, w));
  if (pads) {
    input += " with padding " + std::to_string(padding) + " (" + std::to_string(h) + "x" + std::to_string(w) + ")";
    fixes += ", pad by at least " + std::to_string((window - std::min(in.height, in.width) + 1) / 2) + ",";
  }
  throw sharding_error(head + ": the input, " + input + ", is smaller than the " + square + " " + what + "; " + fixes +
                       " or remove a pooling layer before it");
}
}  // namespace detail

}  // namespace meshlib::nn
// end meshlib/nn/layers/image_shape.hpp
// begin meshlib/nn/layers/conv2d.hpp
/// @file
/// @brief `conv2d`: a 2-D convolution (`flax.linen.Conv` / `torch.nn.Conv2d`, dilation 1, one
/// group) with stride and zero padding, forward and backward, on channels-last images (NHWC).
///
/// Why NHWC and im2col: with the channels of a pixel contiguous, the `kernel x kernel` window of
/// one output pixel is `kernel` runs of `kernel * C_in` contiguous values, so im2col writes each
/// patch row with straight copies, and the convolution is one plain GEMM
/// `Y (N*Ho*Wo x C_out) = patches (N*Ho*Wo x kernel*kernel*C_in) x W (kernel*kernel*C_in x C_out)`
/// whose output is already NHWC (no transpose on either side), TensorFlow's and JAX's default layout.
/// The weight is `W[(i * kernel + j) * C_in + c][o]`: HWIO (flax's layout) flattened to rank 2.
/// - forward: one of three algorithms (`conv2d_algorithm`, chosen by a fixed rule, see
///   `algorithm()`): im2col (a Kokkos kernel) in cache-sized blocks of output pixels, each block
///   multiplied at once, `Y = b; Y += patches W` (`matmul_into`); a 1x1 kernel's patches are the
///   input rows (stride 1) or a row gather; a small patch (the stem, `C_in` 1 or 3) is computed
///   directly from the input, without patches (nn/detail/conv2d_kernels.hpp);
/// - backward: `dW (+)= patches^T dY` (the patches made again block by block; the direct kernel's
///   sum per output image row, then the rows in order), `db (+)= column sums of dY`, `dpatches = dY W^T`,
///   then col2im as a gather: one work item per input pixel adds the patch entries that read it, in
///   a fixed order (no atomics: the same bits on every run and mesh); a 1x1 kernel at stride 1 needs
///   no col2im (`dX = dY W^T`).
///
/// Data parallel: the input on each device is its block of rows (images) of the batch, as for
/// `dense`; the weight is replicated, so its gradient is a pending sum over the data axis that the
/// gradient synchronisation of `train_step` completes. No communication in forward or backward.
/// (Output channels sharded over a model axis do not fit rank-2 rows: in a flattened NHWC row a
/// device's channels are not one contiguous block of the features, so such an output could not be
/// typed as a feature-sharded block. A ResNet is trained data-parallel, which this layer is.)
///
/// Sizes are checked: a kernel larger than the padded input is refused at construction, an input
/// whose width is not `height * width * C_in` (say, another channel count) in forward; each
/// `sharding_error` names the layer, the sizes and the fix.
/// @code
/// meshlib::nn::conv2d<float, mesh_t> c1(m, "c1", {28, 28, 1}, 16, 3, meshlib::nn::rng_key{0}, {.padding = 1});
/// // c1.output_shape() == {28, 28, 16}; inside spmd: auto y = c1.forward(x);  ...  c1.backward(dy);
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/nn/detail/conv2d_kernels.hpp
/// @file
/// @brief The Kokkos kernels of `conv2d` (NHWC images, HWIO weight flattened to
/// `kernel*kernel*C_in x C_out`): im2col over a range of output pixels (and the 1x1 row gather), the
/// direct convolution and its weight gradient, and col2im as a gather.
///
/// Why: the convolution is the product `patches (M x K) x W (K x C_out)` with `M = N*Ho*Wo`,
/// `K = kernel*kernel*C_in`. im2col into one `M x K` buffer writes (and the product reads back) K
/// values per output pixel through memory; for `K = 144` that buffer is larger than the product's
/// output. `conv2d` therefore runs im2col on blocks of output pixels whose patches fit in the cache
/// and multiplies each block at once; and where the product is thin (`K` of 9 or 27: the first layer
/// of an image network) or narrow (at most 16 output channels), `direct_conv` computes each output
/// pixel from the input, 16 output channels at a time in vector registers, with no patch at all.
/// (`conv2d::algorithm()` has the rule and what was measured.)
///
/// Every kernel is one RangePolicy `parallel_for` on the running device's instance
/// (`meshlib::launch`, see tensor/view.hpp), over raw pointers, one work item per output
/// image row (or input pixel, or block of values) that writes only its own part: no atomics, the
/// same bits on every run. The host's vector forms (`MESHLIB_NN_ROW_LANES`) are compiled out for
/// device code, which runs the plain loops.
/// @code
/// detail::conv_geometry g{h, w, cin, ho, wo, cout, k, s, p};
/// detail::im2col<Space>(cols, x, g, r0, r1);   // rows r0..r1 of the patch matrix, cols holds (r1 - r0) x K
/// @endcode

#include <cstddef>
#include <cstring>


namespace meshlib::nn::detail {

/// The sizes of one convolution: input `h x w x cin`, output `ho x wo x cout`, a `k x k` kernel,
/// stride `s`, zero padding `p` (a plain aggregate: it is copied into the kernels).
struct conv_geometry {
  std::size_t h, w, cin, ho, wo, cout, k, s, p;

  /// `K`: values in one patch (a row of the patch matrix, a row of the weight).
  KOKKOS_INLINE_FUNCTION std::size_t patch() const { return k * k * cin; }
  /// The kernel offsets `[lo, hi)` along one axis whose input coordinate `o * s + i - p` lies in
  /// `[0, extent)` for output coordinate `o` (empty when the window lies in the padding).
  KOKKOS_INLINE_FUNCTION void window(std::size_t o, std::size_t extent, std::size_t& lo, std::size_t& hi) const {
    const std::size_t start = o * s;  // the window's first row, in padded coordinates
    lo = start < p ? p - start : 0;
    hi = extent + p > start ? (extent + p - start < k ? extent + p - start : k) : 0;
    if (lo > hi) lo = hi;
  }
};

/// `dst[e] = src[e]` (or `T{0}` when `src` is null) for `e < n`, in native vectors (`for_each_lane`):
/// GCC turns a plain copy loop of unknown length into a `memcpy` / `memset` call, which costs more
/// than the copy for the short runs of a patch (16 values in a 1x1 convolution: measured a third of
/// that layer's forward), and at -O2 keeps a loop of constant chunks scalar (the pointers might overlap).
template <class T>
KOKKOS_INLINE_FUNCTION void copy_run(T* dst, const T* src, std::size_t n) {
  if (src != nullptr)
    for_each_lane<T>(0, n, [&](std::size_t e, auto lane) { store_at(dst, e, load_as(src, e, lane)); });
  else
    for_each_lane<T>(0, n, [&](std::size_t e, auto lane) { store_at(dst, e, decltype(lane){}); });
}

/// `dst[e] += src[e]` for `e < n`, in native vectors (`for_each_lane`).
template <class T>
KOKKOS_INLINE_FUNCTION void add_run(T* dst, const T* src, std::size_t n) {
  for_each_lane<T>(0, n, [&](std::size_t e, auto lane) { store_at(dst, e, load_as(dst, e, lane) + load_as(src, e, lane)); });
}

/// Rows `[r0, r1)` of `y` (`cout` wide) set to `bias`.
template <class Space, class T>
void bias_rows(T* y, const T* bias, std::size_t cout, std::size_t r0, std::size_t r1) {
  meshlib::launch<Space>(r1 - r0, KOKKOS_LAMBDA(std::size_t q) { copy_run(y + (r0 + q) * cout, bias, cout); });
}

/// Rows `[r0, r1)` of the patch matrix into `cols` (`(r1 - r0) x K`, row-major): the `k x k` window
/// of each output pixel, zeros where it hangs over the padding. The window's `k` rows are runs of
/// `k * cin` contiguous input values (NHWC), copied straight. Also sets rows `[r0, r1)` of `y`
/// (`M x cout`) to `bias` when `bias` is not null, so the product can add to them while they are
/// still in the cache. One work item per output image row (the part of it in `[r0, r1)`): the
/// pixel's coordinates come from one division per row, not three per pixel (64-bit divisions
/// cost more than a small patch's copy).
template <class Space, class T>
void im2col(T* cols, const T* x, const conv_geometry g, std::size_t r0, std::size_t r1, T* y = nullptr,
            const T* bias = nullptr) {
  if (r1 <= r0) return;
  const std::size_t t0 = r0 / g.wo, t1 = (r1 - 1) / g.wo + 1;  // output image rows (img * ho + oh)
  meshlib::launch<Space>(t1 - t0, KOKKOS_LAMBDA(std::size_t q) {
    const std::size_t t = t0 + q, img = t / g.ho, oh = t % g.ho, run = g.k * g.cin, kk = g.patch();
    const std::size_t ow0 = t * g.wo < r0 ? r0 - t * g.wo : 0, ow1 = (t + 1) * g.wo > r1 ? r1 - t * g.wo : g.wo;
    if (g.k == 1 && g.p == 0) {  // a 1x1 window: a gather of every s-th pixel's channels
      const T* src = x + ((img * g.h + oh * g.s) * g.w + ow0 * g.s) * g.cin;
      for (std::size_t ow = ow0; ow < ow1; ++ow, src += g.s * g.cin) {
        const std::size_t r = t * g.wo + ow;
        copy_run(cols + (r - r0) * g.cin, src, g.cin);
        if (bias != nullptr) copy_run(y + r * g.cout, bias, g.cout);
      }
      return;
    }
    std::size_t i0, i1;
    g.window(oh, g.h, i0, i1);
    for (std::size_t ow = ow0; ow < ow1; ++ow) {
      std::size_t j0, j1;
      g.window(ow, g.w, j0, j1);
      const std::size_t r = t * g.wo + ow;
      T* dst = cols + (r - r0) * kk;
      for (std::size_t i = 0; i < g.k; ++i, dst += run) {
        if (i < i0 || i >= i1 || j0 == j1) {
          copy_run(dst, static_cast<const T*>(nullptr), run);
          continue;
        }
        const T* src = x + ((img * g.h + (oh * g.s + i - g.p)) * g.w + (ow * g.s + j0 - g.p)) * g.cin;
        const std::size_t a = j0 * g.cin, b = j1 * g.cin;
        copy_run(dst, static_cast<const T*>(nullptr), a);
        copy_run(dst + a, src, b - a);
        copy_run(dst + b, static_cast<const T*>(nullptr), run - b);
      }
      if (bias != nullptr) copy_run(y + r * g.cout, bias, g.cout);
    }
  });
}

/// Output channels one pass of `direct_conv` keeps in registers per pixel.
inline constexpr std::size_t direct_lanes = 16;

// The direct kernel's lanes as the host's native vectors (`simd_of<T>`, nn/detail/simd.hpp): left
// to the auto-vectoriser, GCC vectorises a tile of pixels across the pixels (4-wide, with shuffles)
// instead of across the output channels, and at -O2 keeps the accumulators in memory; measured 4-8x
// slower than these explicit vectors (docs/benchmarks.md). Device compilers take the plain loop.
#if MESHLIB_NN_ROW_LANES
#if defined(__clang__)
#define MESHLIB_CONV_UNROLL _Pragma("unroll")
#else
#define MESHLIB_CONV_UNROLL _Pragma("GCC unroll 16")
#endif
/// Native vectors per `direct_lanes` values of `T`.
template <class T>
inline constexpr std::size_t direct_vectors = direct_lanes * sizeof(T) / simd_bytes;
/// Pixels per tile: accumulators in about 12 vector registers (16 on SSE and AVX, 32 on AVX-512),
/// the rest for the weight row; at most 8.
template <class T>
inline constexpr std::size_t direct_pixels =
    direct_vectors<T> >= 12 ? 1 : (12 / direct_vectors<T> > 8 ? 8 : 12 / direct_vectors<T>);
#else
template <class T>
inline constexpr std::size_t direct_pixels = 1;
#endif

/// `out[o] = (bias ? bias[o0 + o] : 0) + sum over the window of x * W` for the `n` (at most
/// `direct_lanes`) output channels from `o0` of one output pixel whose window is `[i0, i1) x
/// [j0, j1)` from input value `src` (its first in-image window row), in the window's order (kernel
/// row, column, input channel): the accumulation order of the patch product. The portable form.
template <class T>
KOKKOS_INLINE_FUNCTION void direct_scalar(T* out, const T* src, const T* wt, const T* bias, const conv_geometry& g,
                                          std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1,
                                          std::size_t o0, std::size_t n) {
  T acc[direct_lanes];
  for (std::size_t o = 0; o < n; ++o) acc[o] = bias != nullptr ? bias[o0 + o] : T{0};
  for (std::size_t i = i0; i < i1; ++i, src += g.w * g.cin) {
    const T* wrow = wt + ((i * g.k + j0) * g.cin) * g.cout + o0;
    for (std::size_t e = 0, end = (j1 - j0) * g.cin; e < end; ++e, wrow += g.cout) {
      const T v = src[e];
      for (std::size_t o = 0; o < n; ++o) acc[o] += v * wrow[o];
    }
  }
  for (std::size_t o = 0; o < n; ++o) out[o] = acc[o];
}

#if MESHLIB_NN_ROW_LANES
/// `direct_scalar` for `direct_lanes` channels of `Pixels` consecutive output pixels with the same
/// window (pixel `q` reads from `src + q * s * cin`, writes `out + q * cout`), in native vectors:
/// independent accumulators, so the FMAs of the pixels overlap instead of waiting on one pixel's
/// chain of dependent additions, and each weight row is loaded once for all of them. The same
/// operations in the same order per value as `direct_scalar` (the compiler contracts `a * b + c`
/// into an FMA in both forms alike).
template <std::size_t Pixels, class T>
inline void direct_vector_tile(T* out, const T* src, const T* wt, const T* bias, const conv_geometry& g,
                               std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1, std::size_t o0) {
  using vec = typename simd_of<T>::type;
  constexpr std::size_t nv = direct_vectors<T>, per = simd_bytes / sizeof(T);
  const std::size_t step = g.s * g.cin;
  vec acc[Pixels][nv];
  vec init[nv];
  MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
    init[v] = vec{};
    if (bias != nullptr) std::memcpy(&init[v], bias + o0 + v * per, sizeof(vec));
  }
  MESHLIB_CONV_UNROLL for (std::size_t q = 0; q < Pixels; ++q) MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v)
    acc[q][v] = init[v];
  for (std::size_t i = i0; i < i1; ++i, src += g.w * g.cin) {
    const T* wrow = wt + ((i * g.k + j0) * g.cin) * g.cout + o0;
    for (std::size_t e = 0, end = (j1 - j0) * g.cin; e < end; ++e, wrow += g.cout) {
      vec wv[nv];
      MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) std::memcpy(&wv[v], wrow + v * per, sizeof(vec));
      MESHLIB_CONV_UNROLL for (std::size_t q = 0; q < Pixels; ++q) {
        const T a = src[q * step + e];
        MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) acc[q][v] += a * wv[v];
      }
    }
  }
  MESHLIB_CONV_UNROLL for (std::size_t q = 0; q < Pixels; ++q) MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v)
    std::memcpy(out + q * g.cout + v * per, &acc[q][v], sizeof(vec));
}
#endif

/// `Pixels` consecutive output pixels from `ow` of output image row `t` (with the same window),
/// every output channel: `direct_lanes` at a time, the rest of them (fewer) in the portable form.
template <std::size_t Pixels, class T>
KOKKOS_INLINE_FUNCTION void direct_pixels_of(T* y, const T* x, const T* wt, const T* bias, const conv_geometry& g,
                                             std::size_t t, std::size_t ow, std::size_t i0, std::size_t i1,
                                             std::size_t j0, std::size_t j1) {
  const std::size_t img = t / g.ho, oh = t % g.ho;
  const bool empty = j0 == j1 || i0 == i1;  // a window in the padding: the bias only
  if (empty) i1 = i0;
  const T* src = empty ? x : x + ((img * g.h + (oh * g.s + i0 - g.p)) * g.w + (ow * g.s + j0 - g.p)) * g.cin;
  T* out = y + (t * g.wo + ow) * g.cout;
  std::size_t o0 = 0;
#if MESHLIB_NN_ROW_LANES
  for (; o0 + direct_lanes <= g.cout; o0 += direct_lanes)
    direct_vector_tile<Pixels>(out + o0, src, wt, bias, g, i0, i1, j0, j1, o0);
#endif
  for (std::size_t q = 0; q < Pixels; ++q)
    for (std::size_t c = o0; c < g.cout; c += direct_lanes)
      direct_scalar(out + q * g.cout + c, src + q * g.s * g.cin, wt, bias, g, i0, i1, j0, j1, c,
                    g.cout - c < direct_lanes ? g.cout - c : direct_lanes);
}

/// The direct convolution: `y (M x cout) = patches x wt (+ bias)` without forming the patches, one
/// work item per output image row (one division per row, as `im2col`): the pixels whose window
/// lies inside the image `direct_pixels<T>` at a time, the others (at the padding) one by one.
template <class Space, class T>
void direct_conv(T* y, const T* x, const T* wt, const T* bias, const conv_geometry g, std::size_t images) {
  // Output columns whose window lies inside the image: ow * s >= p and ow * s + k <= w + p.
  const std::size_t lo = (g.p + g.s - 1) / g.s, hi_end = g.w + g.p >= g.k ? (g.w + g.p - g.k) / g.s + 1 : 0;
  const std::size_t hi = hi_end < g.wo ? hi_end : g.wo;
  meshlib::launch<Space>(images * g.ho, KOKKOS_LAMBDA(std::size_t t) {
    constexpr std::size_t tile = direct_pixels<T>;
    std::size_t i0, i1, j0, j1;
    g.window(t % g.ho, g.h, i0, i1);
    std::size_t ow = 0;
    for (; ow < lo && ow < g.wo; ++ow) {  // the left edge (and all of a row narrower than a tile)
      g.window(ow, g.w, j0, j1);
      direct_pixels_of<1>(y, x, wt, bias, g, t, ow, i0, i1, j0, j1);
    }
    for (; ow + tile <= hi; ow += tile) direct_pixels_of<tile>(y, x, wt, bias, g, t, ow, i0, i1, 0, g.k);
    for (; ow < g.wo; ++ow) {
      g.window(ow, g.w, j0, j1);
      direct_pixels_of<1>(y, x, wt, bias, g, t, ow, i0, i1, j0, j1);
    }
  });
}

/// `out[o] = sum over q < count of a[q * stride] * d[q * n + o]` for `o < n`: one tap's row of the
/// weight gradient over a run of output pixels. On the host, `direct_lanes` columns at a time in
/// native vectors with two accumulators (even and odd pixels, added at the end: a fixed order), so
/// the sum stays in registers instead of a load and store per pixel.
template <class T>
KOKKOS_INLINE_FUNCTION void tap_gradient(T* out, const T* a, std::size_t stride, const T* d, std::size_t n,
                                         std::size_t count) {
  std::size_t o = 0;
#if MESHLIB_NN_ROW_LANES
  using vec = typename simd_of<T>::type;
  constexpr std::size_t nv = direct_vectors<T>, per = simd_bytes / sizeof(T);
  for (; o + direct_lanes <= n; o += direct_lanes) {
    vec even[nv], odd[nv];
    MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) even[v] = odd[v] = vec{};
    std::size_t q = 0;
    for (; q + 2 <= count; q += 2) {
      const T a0 = a[q * stride], a1 = a[(q + 1) * stride];
      MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
        vec d0, d1;
        std::memcpy(&d0, d + q * n + o + v * per, sizeof(vec));
        std::memcpy(&d1, d + (q + 1) * n + o + v * per, sizeof(vec));
        even[v] += a0 * d0;
        odd[v] += a1 * d1;
      }
    }
    if (q < count) {
      const T a0 = a[q * stride];
      MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
        vec d0;
        std::memcpy(&d0, d + q * n + o + v * per, sizeof(vec));
        even[v] += a0 * d0;
      }
    }
    MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
      const vec sum = even[v] + odd[v];
      std::memcpy(out + o + v * per, &sum, sizeof(vec));
    }
  }
#endif
  for (; o < n; ++o) {
    T sum{0};
    for (std::size_t q = 0; q < count; ++q) sum += a[q * stride] * d[q * n + o];
    out[o] = sum;
  }
}

/// The weight gradient of the direct convolution without patches, first half: `part[t]` (`K x
/// cout`, row-major) `= sum over the output pixels of image row t of patch^T dy`, one work item per
/// output image row (it owns its block of `part`, so no atomics): for each tap `(i, j, c)` of the
/// window, the output pixels whose window reads the image there. `direct_grad_w_sum` adds the blocks.
template <class Space, class T>
void direct_grad_w_rows(T* part, const T* x, const T* dy, const conv_geometry g, std::size_t images) {
  meshlib::launch<Space>(images * g.ho, KOKKOS_LAMBDA(std::size_t t) {
    const std::size_t img = t / g.ho, oh = t % g.ho, kc = g.patch() * g.cout;
    T* acc = part + t * kc;
    copy_run(acc, static_cast<const T*>(nullptr), kc);
    std::size_t i0, i1;
    g.window(oh, g.h, i0, i1);
    for (std::size_t i = i0; i < i1; ++i) {
      const T* xrow = x + (img * g.h + (oh * g.s + i - g.p)) * g.w * g.cin;  // the input row tap i reads
      for (std::size_t j = 0; j < g.k; ++j) {
        // Output columns whose tap j lies in the image: 0 <= ow * s + j - p < w.
        const std::size_t lo = j < g.p ? (g.p - j + g.s - 1) / g.s : 0;
        std::size_t hi = g.w + g.p > j ? (g.w + g.p - j - 1) / g.s + 1 : 0;
        if (hi > g.wo) hi = g.wo;
        if (lo >= hi) continue;
        const T* a = xrow + (lo * g.s + j - g.p) * g.cin;
        for (std::size_t c = 0; c < g.cin; ++c)
          tap_gradient(acc + ((i * g.k + j) * g.cin + c) * g.cout, a + c, g.s * g.cin, dy + (t * g.wo + lo) * g.cout,
                       g.cout, hi - lo);
      }
    }
  });
}

/// Second half: `gw = (overwrite ? 0 : gw) + sum over rows t of part[t]`, the rows in order (the same
/// bits on every run), one work item per block of `gw`'s values.
template <class Space, class T>
void direct_grad_w_sum(T* gw, const T* part, std::size_t values, std::size_t rows, bool overwrite) {
  constexpr std::size_t block = 64;
  meshlib::launch<Space>((values + block - 1) / block, KOKKOS_LAMBDA(std::size_t b) {
    const std::size_t c0 = b * block, c1 = c0 + block < values ? c0 + block : values;
    if (overwrite) copy_run(gw + c0, static_cast<const T*>(nullptr), c1 - c0);
    for (std::size_t t = 0; t < rows; ++t) add_run(gw + c0, part + t * values + c0, c1 - c0);
  });
}

/// col2im as a gather: `dx` (`images x h x w x cin`) from the patch cotangents `dcols` (`M x K`).
/// Input pixel `(img, ih, iw)` adds, for every kernel offset `(i, j)` whose output pixel exists, that
/// patch entry, in kernel order (no atomics: the same bits on every run and mesh).
template <class Space, class T>
void col2im(T* dx, const T* dcols, const conv_geometry g, std::size_t images) {
  meshlib::launch<Space>(images * g.h * g.w, KOKKOS_LAMBDA(std::size_t q) {
    const std::size_t img = q / (g.h * g.w), ih = q / g.w % g.h, iw = q % g.w, kk = g.patch();
    T* dst = dx + q * g.cin;
    copy_run(dst, static_cast<const T*>(nullptr), g.cin);
    for (std::size_t i = 0; i < g.k; ++i) {
      const std::size_t th = ih + g.p;  // = oh * s + i
      if (th < i || (th - i) % g.s != 0 || (th - i) / g.s >= g.ho) continue;
      const std::size_t oh = (th - i) / g.s;
      for (std::size_t j = 0; j < g.k; ++j) {
        const std::size_t tw = iw + g.p;
        if (tw < j || (tw - j) % g.s != 0 || (tw - j) / g.s >= g.wo) continue;
        const std::size_t ow = (tw - j) / g.s;
        const T* src = dcols + ((img * g.ho + oh) * g.wo + ow) * kk + (i * g.k + j) * g.cin;
        add_run(dst, src, g.cin);
      }
    }
  });
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/conv2d_kernels.hpp

namespace meshlib::diagnostic {
/// An image shape known at compile time, `height x width x channels`, in a compile-time error.
template <std::size_t Height, std::size_t Width, std::size_t Channels>
struct image {};
/// A convolution's kernel size (`kernel<3>`: 3 x 3), in a compile-time error.
template <std::size_t Size>
struct kernel {};
/// The zeros a convolution adds on every side of its input, in a compile-time error.
template <std::size_t Size>
struct padding {};
}  // namespace meshlib::diagnostic

namespace meshlib::nn {

/// @brief How `conv2d` computes its forward (and the patches its weight gradient needs); every
/// algorithm gives the same convolution up to float rounding, and the same bits on every run.
enum class conv2d_algorithm {
  automatic,  ///< the rule of `conv2d::algorithm()`: pointwise, else direct for small patches, else im2col
  im2col,     ///< im2col in cache-sized blocks of output pixels, each multiplied at once (`matmul_into`)
  direct,     ///< each output pixel straight from the input, 16 output channels at a time (no patches)
  pointwise,  ///< a 1x1 kernel without padding: the input pixels (every `stride`-th) are the patches
};

namespace detail {
template <class Image, class Kernel, class Padding>
consteval bool conv2d_kernel_larger_than_input() {
  static_assert(meshlib::diagnostic::always_false<Image, Kernel, Padding>,
                "meshlib::nn: conv2d: the input image (In, with O.padding on every side) is smaller than the Kernel x "
                "Kernel kernel (the condition spells out the image, the kernel and the padding); use a smaller "
                "kernel, pad by more, or remove a pooling layer before it");
  return false;
}
}  // namespace detail

/// @brief The options of `conv2d` (flax's names): stride and zero padding on both spatial
/// dimensions, whether the layer adds a bias (off before a `batch_norm`, which cancels it), and
/// the algorithm (leave it `automatic` unless you measured otherwise; tests force each one).
struct conv2d_options {
  std::size_t stride = 1;   ///< step between output pixels, in input pixels
  std::size_t padding = 0;  ///< zeros added on every side of the image
  bool use_bias = true;     ///< add a learned bias per output channel
  conv2d_algorithm algorithm = conv2d_algorithm::automatic;  ///< how the forward is computed
};

/// @brief The shape of the images `conv2d` makes from images of shape `In`, computed at compile
/// time for sizes that are compile-time constants: a kernel larger than the padded input, or a zero
/// size, is then one compile error (the instantiation names the sizes) instead of the
/// `sharding_error` the constructor throws at run time. The same arithmetic as `output_shape()`.
/// @code
/// namespace nn = meshlib::nn;
/// constexpr auto s1 = nn::conv2d_output_shape<nn::image_shape{28, 28, 1}, 16, 3, nn::conv2d_options{.padding = 1}>();
/// static_assert(s1 == nn::image_shape{28, 28, 16});
/// @endcode
template <image_shape In, std::size_t OutChannels, std::size_t Kernel, conv2d_options O = conv2d_options{}>
consteval image_shape conv2d_output_shape() {
  constexpr bool sizes = Kernel >= 1 && O.stride >= 1 && OutChannels >= 1 && In.size() >= 1;
  static_assert(sizes,
                "meshlib::nn: conv2d: kernel, stride, output channels and the image's height, width and channels "
                "must be at least 1");
  if constexpr (sizes && In.height + 2 * O.padding >= Kernel && In.width + 2 * O.padding >= Kernel) {
    return {(In.height + 2 * O.padding - Kernel) / O.stride + 1, (In.width + 2 * O.padding - Kernel) / O.stride + 1,
            OutChannels};
  } else {
    if constexpr (sizes)  // one error: the sizes' own above, else this one
      static_cast<void>(detail::conv2d_kernel_larger_than_input<meshlib::diagnostic::image<In.height, In.width, In.channels>,
                                                                meshlib::diagnostic::kernel<Kernel>,
                                                                meshlib::diagnostic::padding<O.padding>>());
    return {};
  }
}

namespace detail {
/// Whether a layer of images (conv2d, pooling, batch_norm) takes `X`: a complete rank-2 block of
/// rows with unsharded features, of this mesh and element type.
template <class X, class Mesh, class T>
consteval bool image_layer_accepts() {
  if constexpr (!std::is_same_v<typename X::mesh_type, Mesh> || !std::is_same_v<typename X::value_type, T>) return false;
  else if constexpr (X::rank != 2) return false;
  else return X::partial == 0 && X::dims_type::at(1) == 0;
}

template <class Layer, class Receives, class Needs>
consteval bool conv2d_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: conv2d takes a complete rank-2 block of rows (images, NHWC, flattened) of its mesh and "
                "element type, with unsharded features: shard the batch over the data axis, not the pixels (the "
                "condition spells out the layer, the input's layout and what it needs)");
  return false;
}

}  // namespace detail

/// @brief A 2-D convolution on NHWC images (see the file comment); weight and bias replicated.
template <class T, mesh_type Mesh>
class conv2d {
 public:
  /// Weight and bias are replicated on every device (data parallel).
  using w_sharding = named_sharding<Mesh, P<none, none>>;
  /// @copydoc w_sharding
  using b_sharding = named_sharding<Mesh, P<none>>;

  /// The weight, `kernel*kernel*C_in x C_out` (HWIO flattened); named `name + ".w"`.
  parameter<T, 2, w_sharding> w;
  /// The bias, `C_out` (zero, and not trained, without `use_bias`); named `name + ".b"`.
  parameter<T, 1, b_sharding> b;

  /// Images of shape `in` to `out_channels` channels with a `kernel x kernel` window. W ~ He
  /// (Kaiming) uniform, limit `sqrt(6 / (kernel*kernel*C_in))`, from `key` (mesh-invariant); b = 0.
  /// @throws sharding_error when the kernel is larger than the padded input, or a size is zero.
  conv2d(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels, std::size_t kernel,
         rng_key key, conv2d_options o = {}, std::span<const std::size_t> local_devices = {})
      : w(name + ".w", w_sharding{mesh}, {checked(name, in, out_channels, kernel, o) * in.channels, out_channels}, key,
          init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(kernel * kernel * in.channels)))), true,
          local_devices),
        b(name + ".b", b_sharding{mesh}, {out_channels}, key, init::zeros(), false, local_devices),
        name_(name),
        in_(in),
        out_{(in.height + 2 * o.padding - kernel) / o.stride + 1, (in.width + 2 * o.padding - kernel) / o.stride + 1,
             out_channels},
        kernel_(kernel),
        opt_(o),
        algo_(choose(name, in, out_channels, kernel, o)),
        saved_(mesh.size()),
        cols_(mesh.size()),
        out_buf_(mesh.size()),
        dcols_(mesh.size()),
        dx_(mesh.size()) {}

  /// The layer's name: its parameters are `name() + ".w"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// The shape of the images it returns: `((H + 2p - k) / s + 1) x ((W + 2p - k) / s + 1) x C_out`.
  [[nodiscard]] image_shape output_shape() const noexcept { return out_; }
  /// Features per input row: `H * W * C_in`.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// Features per output row: `Ho * Wo * C_out`.
  [[nodiscard]] std::size_t out_features() const noexcept { return out_.size(); }
  /// `"c1 (conv2d 3x3, 28x28x1 -> 28x28x16, stride 1, padding 1)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (conv2d " + std::to_string(kernel_) + "x" + std::to_string(kernel_) + ", " + in_.to_string() +
           " -> " + out_.to_string() + ", stride " + std::to_string(opt_.stride) + ", padding " +
           std::to_string(opt_.padding) + ")";
  }

  /// A complete rank-2 block of rows with unsharded features (shard the batch, not the pixels).
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>();
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<"conv2d">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The algorithm the forward runs (the options' choice, or the rule for `automatic`, fixed at
  /// construction so every step and every device computes alike):
  /// - `pointwise` for a 1x1 kernel without padding: at stride 1 the input rows are the patches (no
  ///   copy at all), at a larger stride a row gather (im2col of a 1x1 window) in cache-sized blocks;
  /// - `direct` when a patch has at most `direct_max_patch` values (`kernel*kernel*C_in`: the 3x3 stem
  ///   of a grey or colour image), or when `C_out` is at most `direct_lanes` (16: one pass of the
  ///   kernel's vector lanes per pixel): measured (GCC 12, OpenBLAS 0.3.21, one thread; at -O3 with
  ///   AVX-512, with AVX2, and at -O2 with SSE2 alone) faster than blocked im2col + sgemm in every
  ///   build for those shapes (the stem 1.9-6x, C_in = 3 1.1-3.4x, 14x14x16 -> 16 1.1-1.7x), and
  ///   1.7-2x slower from C_out = 32 up (AVX-512; docs/benchmarks.md, "ResNet"). Its weight gradient is summed
  ///   straight from the input for patches of at most `direct_max_patch` values, and through blocked
  ///   im2col and `matmul_into` above (where that was measured faster);
  /// - `im2col` otherwise: im2col in blocks of output pixels whose patches fill `im2col_block_bytes`,
  ///   each block multiplied by the weight right away (`matmul_into`), so the patches stay in the
  ///   cache (measured faster, forward and backward, than keeping a whole patch matrix for `dW`).
  [[nodiscard]] conv2d_algorithm algorithm() const noexcept { return algo_; }
  /// The largest patch (`kernel*kernel*C_in` values) for which `automatic` picks `direct` whatever
  /// `C_out`, and for which `direct`'s weight gradient skips im2col.
  static constexpr std::size_t direct_max_patch = 27;
  /// The most output channels for which `automatic` picks `direct` whatever the patch size.
  static constexpr std::size_t direct_max_out_channels = detail::direct_lanes;
  /// The patch bytes of one im2col block (about half of a 1 MiB L2 cache, so the block and the
  /// product's working set stay there); at least `im2col_min_rows` rows, so each product is not tiny.
  static constexpr std::size_t im2col_block_bytes = std::size_t{256} * 1024;
  /// @copydoc im2col_block_bytes
  static constexpr std::size_t im2col_min_rows = 64;

  /// The convolution of this device's images (rows of `x`, NHWC), plus the bias.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"conv2d.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::conv2d_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = x.device(), n = x.extent(0);
      if (x.extent(1) != in_.size())
        throw sharding_error(detail::image_width_error(to_string(), name_, x.extent(1), in_));
      const detail::conv_geometry g = geometry();
      const std::size_t m = n * g.ho * g.wo, kk = g.patch(), cout = g.cout;
      saved_[dev] = {n, true, x.data()};
      T* y = out_buf_.get(dev, m * cout);
      const T* xp = x.data();
      const T* wp = w.value.local(dev).data();
      const T* bias = opt_.use_bias ? b.value.local(dev).data() : nullptr;
      if (algo_ == conv2d_algorithm::direct) {
        detail::direct_conv<default_memory_space>(y, xp, wp, bias, g, n);
      } else {
        // Blocks of output pixels: their patches (im2col into a block buffer, or the input rows
        // themselves), then at once `Y[r0:r1] = bias; Y[r0:r1] += patches W`, while both are in the cache.
        T* cols = unpacked() ? nullptr : cols_.get(dev, std::min(m, block_rows(m)) * kk);
        for (std::size_t r0 = 0, rows = block_rows(m); r0 < m; r0 += rows) {
          const std::size_t r1 = std::min(m, r0 + rows);
          const T* patches = xp + r0 * kk;
          if (unpacked()) {
            if (bias != nullptr) detail::bias_rows<default_memory_space>(y, bias, cout, r0, r1);
          } else {
            detail::im2col<default_memory_space>(cols, xp, g, r0, r1, y, bias);
            patches = cols;
          }
          matmul_into(view(y + r0 * cout, r1 - r0, cout), cview(patches, r1 - r0, kk), cview(wp, kk, cout),
                      {.beta = bias != nullptr ? 1.0 : 0.0});
        }
      }
      return X(typename X::view_type(y, n, g.ho * g.wo * cout), x.mesh(), dev);
    }
  }

  /// Accumulates `dW += patches^T dy` and `db += column sums of dy` (overwrites them when
  /// `grad_beta` says so) and returns `dx` (when `need_dx`; otherwise its contents are unspecified).
  /// The forward keeps no patch matrix: `dW` makes the patches again from the forward's input, block
  /// by block as the forward did (the input rows themselves for `pointwise` at stride 1), adding the
  /// blocks' products in order; `direct` with patches of at most `direct_max_patch` values sums
  /// `patch^T dy` per output image row from the input, then the rows in order (the same bits on every
  /// run either way).
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"conv2d.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const auto [n, ran, xp] = saved_[dev];
    detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, n, out_.size());
    const detail::conv_geometry g = geometry();
    const std::size_t m = n * g.ho * g.wo, kk = g.patch(), cout = g.cout;
    const T* d = dy.data();
    const T* wp = w.value.local(dev).data();
    T* gw = w.grad.local(dev).data();
    const double beta = static_cast<double>(w.grad_beta(dev));
    if (algo_ == conv2d_algorithm::direct && kk <= direct_max_patch) {  // per output image row, then the rows in order
      T* part = dcols_.get(dev, n * g.ho * kk * cout);
      detail::direct_grad_w_rows<default_memory_space>(part, xp, d, g, n);
      detail::direct_grad_w_sum<default_memory_space>(gw, part, kk * cout, n * g.ho, beta == 0.0);
    } else if (unpacked()) {  // the patches are the input rows: one product
      matmul_into(view(gw, kk, cout), cview(xp, m, kk), cview(d, m, cout), {.transpose_a = true, .beta = beta});
    } else {  // the patches again, block by block as the forward made them, each block's product added
      T* cols = cols_.get(dev, std::min(m, block_rows(m)) * kk);
      for (std::size_t r0 = 0, rows = block_rows(m); r0 < m; r0 += rows) {
        const std::size_t r1 = std::min(m, r0 + rows);
        detail::im2col<default_memory_space>(cols, xp, g, r0, r1);
        matmul_into(view(gw, kk, cout), cview(cols, r1 - r0, kk), cview(d + r0 * cout, r1 - r0, cout),
                    {.transpose_a = true, .beta = r0 == 0 ? beta : 1.0});
      }
    }
    if (opt_.use_bias) {
      T* gb = b.grad.local(dev).data();
      const bool fresh = b.grad_beta(dev) == T{0};
      // Column sums of dy seen as (N*Ho*Wo) x C_out, rows in order (the same bits on every mesh).
      detail::bias_grad<default_memory_space>(gb, d, m, cout, fresh);  // as dense: column sums, rows in order
    }
    T* dx = dx_.get(dev, n * in_.size());
    if (need_dx) {
      if (unpacked()) {  // the patches are the input rows: dx = dy W^T directly
        matmul_into(view(dx, m, kk), cview(d, m, cout), cview(wp, kk, cout), {.transpose_b = true});
      } else {
        T* dc = dcols_.get(dev, m * kk);
        matmul_into(view(dc, m, kk), cview(d, m, cout), cview(wp, kk, cout), {.transpose_b = true});
        detail::col2im<default_memory_space>(dx, dc, g, n);
      }
    }
    return DY(typename DY::view_type(dx, n, in_.size()), dy.mesh(), dev);
  }

  /// Appends the weight, and the bias when the layer uses one.
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(w.ref(true));  // backward writes them with grad_beta
    if (opt_.use_bias) out.push_back(b.ref(true));
  }

 private:
  using cview = meshlib::unmanaged_block_view<const T, 2, default_memory_space>;
  using view = meshlib::unmanaged_block_view<T, 2, default_memory_space>;

  /// The constructor's checks; returns `kernel * kernel` (the weight's rows per input channel).
  static std::size_t checked(const std::string& name, const image_shape& in, std::size_t out_channels,
                             std::size_t kernel, const conv2d_options& o) {
    const std::string head = "meshlib::nn: " + name + " (conv2d " + std::to_string(kernel) + "x" +
                             std::to_string(kernel) + " on " + in.to_string() + " images)";
    if (kernel == 0 || o.stride == 0 || out_channels == 0 || in.size() == 0)
      throw sharding_error(head + ": kernel, stride, output channels and the image's height, width and channels must "
                                  "be at least 1 (kernel " + std::to_string(kernel) + ", stride " +
                           std::to_string(o.stride) + ", " + std::to_string(out_channels) + " output channels)");
    detail::check_window_fits(head, in, kernel, o.padding, true, "kernel");
    return kernel * kernel;
  }

  /// The sizes the kernels take.
  [[nodiscard]] detail::conv_geometry geometry() const noexcept {
    return {in_.height, in_.width, in_.channels, out_.height, out_.width, out_.channels, kernel_, opt_.stride,
            opt_.padding};
  }
  /// Whether the patches are the input rows themselves (pointwise at stride 1: no im2col).
  [[nodiscard]] bool unpacked() const noexcept { return algo_ == conv2d_algorithm::pointwise && opt_.stride == 1; }
  /// Output pixels per im2col block (see `im2col_block_bytes`): all `m` of them in a memory space the
  /// host cannot read (a GPU wants one large product, not a cache-sized one).
  [[nodiscard]] std::size_t block_rows(std::size_t m) const noexcept {
    if constexpr (!meshlib::host_accessible_v<default_memory_space>) return m;
    const std::size_t rows = im2col_block_bytes / (kernel_ * kernel_ * in_.channels * sizeof(T));
    return std::max<std::size_t>(rows, im2col_min_rows);
  }
  /// The algorithm of `algorithm()` for these sizes and options.
  /// @throws sharding_error when `pointwise` is asked for a kernel other than 1x1 or with padding.
  static conv2d_algorithm choose(const std::string& name, const image_shape& in, std::size_t out_channels,
                                 std::size_t kernel, const conv2d_options& o) {
    const bool one_by_one = kernel == 1 && o.padding == 0;
    switch (o.algorithm) {
      case conv2d_algorithm::automatic:
        if (one_by_one) return conv2d_algorithm::pointwise;
        return kernel * kernel * in.channels <= direct_max_patch || out_channels <= direct_max_out_channels
                   ? conv2d_algorithm::direct
                   : conv2d_algorithm::im2col;
      case conv2d_algorithm::pointwise:
        if (!one_by_one)
          throw sharding_error("meshlib::nn: " + name + " (conv2d " + std::to_string(kernel) + "x" +
                               std::to_string(kernel) + ", padding " + std::to_string(o.padding) +
                               "): the pointwise algorithm needs a 1x1 kernel without padding; use "
                               "conv2d_algorithm::im2col, direct or automatic");
        return o.algorithm;
      default:
        return o.algorithm;
    }
  }

  struct saved {
    std::size_t rows = 0;
    bool ran = false;
    const T* x = nullptr;  // the forward's input: backward makes the patches again from it
  };
  std::string name_;
  image_shape in_, out_;
  std::size_t kernel_;
  conv2d_options opt_;
  conv2d_algorithm algo_;
  std::vector<saved> saved_;  // per device: the last forward's number of images and input
  detail::device_buffers<T> cols_, out_buf_, dcols_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/conv2d.hpp
// begin meshlib/nn/layers/pooling.hpp
/// @file
/// @brief Pooling on NHWC images (see image_shape.hpp): `max_pool2d` and `avg_pool2d` over
/// `window x window` windows with a stride (`flax.linen.max_pool` / `avg_pool` with padding
/// "VALID", `torch.nn.MaxPool2d` / `AvgPool2d`), and `global_avg_pool`, the mean over all pixels of
/// each channel (`N x HWC -> N x C`, the head of a ResNet before its dense classifier).
///
/// Pooling works on each image alone: a data-parallel block of rows pools locally, no communication.
/// Forward and backward are Kokkos kernels on the running device's instance. The backward passes
/// are gathers, one work item per input pixel adding the output cotangents of the windows that
/// contain it (max pooling: only those whose maximum it was, the first in window order on ties,
/// as PyTorch), in a fixed order: no atomics, the same bits on every run.
/// @code
/// meshlib::nn::max_pool2d<float, mesh_t> pool(m, "pool1", {28, 28, 16}, 2);   // -> 14x14x16
/// meshlib::nn::global_avg_pool<float, mesh_t> gap(m, "gap", {7, 7, 64});      // -> 64 features
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/nn/detail/pool_kernels.hpp
/// @file
/// @brief The kernels of max, average and global average pooling over NHWC images (rows of
/// `height * width * channels` values): one work item per output pixel forward, one per input pixel
/// backward (each gathers from the windows that contain it: no atomics, the same bits on every
/// backend). Free functions over pointers, templated on the element type and the memory space only,
/// for the reason nn/detail/layer_kernels.hpp gives (nvcc and kernels in mesh-templated code).

#include <cstddef>
#include <cstdint>
#include <type_traits>


namespace meshlib::nn::detail {

/// Max (`Max`, with the winning pixel in `arg`) or average pooling of `n` images `h x wd x c` with
/// `k x k` windows at stride `s` into `ho x wo` outputs (`inv` = 1 / (k * k)).
template <class Space, bool Max, class T>
void pool_forward(T* y, std::uint32_t* arg, const T* xp, std::size_t n, std::size_t h, std::size_t wd, std::size_t c,
                  std::size_t ho, std::size_t wo, std::size_t k, std::size_t s, T inv) {
  meshlib::launch<Space>(n * ho * wo, KOKKOS_LAMBDA(std::size_t r) {
    // Plain `if` on Max below, not `if constexpr`: nvcc refuses a device lambda whose first use
    // of a captured variable is inside an `if constexpr`. Max is a constant: the same code results.
    const std::size_t img = r / (ho * wo), oh = r / wo % ho, ow = r % wo;
    const T* x0 = xp + img * h * wd * c;  // the image's first value
    // Channels in lanes (`for_each_lane`), each lane comparing (or adding) over the window in the
    // window's order as one channel's loop did: the same maximum, the same first winner on ties.
    // Winners are 32-bit pixel indices: lanes of them match float lanes only.
    for_each_lane<T, std::is_same_v<T, float>>(0, c, [&](std::size_t ch, auto lane) {
      using L = decltype(lane);
      using U = lane_index_t<L>;
      const std::size_t first = (oh * s) * wd + ow * s;
      L acc = Max ? load_as(x0 + first * c, ch, lane) : L{};
      U best = splat_as<U>(static_cast<std::uint32_t>(first));
      for (std::size_t i = 0; i < k; ++i)
        for (std::size_t j = 0; j < k; ++j) {
          const std::size_t pix = (oh * s + i) * wd + ow * s + j;
          const L v = load_as(x0 + pix * c, ch, lane);
          if (Max) {
            const auto wins = v > acc;
            acc = wins ? v : acc;
            best = wins ? splat_as<U>(static_cast<std::uint32_t>(pix)) : best;
          } else {
            acc += v;
          }
        }
      if (Max) {
        store_at(y + r * c, ch, acc);
        store_at(arg + r * c, ch, best);
      } else {
        store_at(y + r * c, ch, acc * splat_as<L>(inv));
      }
    });
  });
}

/// The input cotangent of `pool_forward` from the output cotangent `d`.
template <class Space, bool Max, class T>
void pool_backward(T* dx, const std::uint32_t* arg, const T* d, std::size_t n, std::size_t h, std::size_t wd,
                   std::size_t c, std::size_t ho, std::size_t wo, std::size_t k, std::size_t s, T inv) {
  meshlib::launch<Space>(n * h * wd, KOKKOS_LAMBDA(std::size_t q) {
    const std::size_t img = q / (h * wd), ih = q / wd % h, iw = q % wd, pix = ih * wd + iw;
    T* dst = dx + q * c;
    // The windows containing (ih, iw): oh * s <= ih < oh * s + k.
    const std::size_t oh0 = ih + 1 > k ? (ih + 1 - k + s - 1) / s : 0, ow0 = iw + 1 > k ? (iw + 1 - k + s - 1) / s : 0;
    // Channels in lanes, each adding its windows' terms in the windows' order as one channel's loop
    // did; a max-pooling lane adds only where this pixel won (a select: no branch to mispredict).
    for_each_lane<T, std::is_same_v<T, float>>(0, c, [&](std::size_t ch, auto lane) {
      using L = decltype(lane);
      using U = lane_index_t<L>;
      L acc{};
      for (std::size_t oh = oh0; oh < ho && oh * s <= ih; ++oh)
        for (std::size_t ow = ow0; ow < wo && ow * s <= iw; ++ow) {
          const std::size_t r = (img * ho + oh) * wo + ow;
          const L dv = load_as(d + r * c, ch, lane);
          if (Max) {
            const auto won = load_as(arg + r * c, ch, U{}) == splat_as<U>(static_cast<std::uint32_t>(pix));
            acc = won ? acc + dv : acc;
          } else {
            acc += dv * splat_as<L>(inv);
          }
        }
      store_at(dst, ch, acc);
    });
  });
}

/// Global average pooling of `n` images of `hw` pixels and `c` channels (`inv` = 1 / hw).
template <class Space, class T>
void global_pool_forward(T* y, const T* xp, std::size_t n, std::size_t hw, std::size_t c, T inv) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t img) {
    T* yi = y + img * c;
    const T* xi = xp + img * hw * c;
    for (std::size_t ch = 0; ch < c; ++ch) yi[ch] = T{0};
    for (std::size_t q = 0; q < hw; ++q)  // pixels in order, each a contiguous run of channels
      for (std::size_t ch = 0; ch < c; ++ch) yi[ch] += xi[q * c + ch];
    for (std::size_t ch = 0; ch < c; ++ch) yi[ch] *= inv;
  });
}

/// `dx = dy / (H * W)` on every pixel.
template <class Space, class T>
void global_pool_backward(T* dx, const T* d, std::size_t n, std::size_t hw, std::size_t c, T inv) {
  meshlib::launch<Space>(n * hw, KOKKOS_LAMBDA(std::size_t q) {
    const T* di = d + q / hw * c;
    for (std::size_t ch = 0; ch < c; ++ch) dx[q * c + ch] = di[ch] * inv;
  });
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/detail/pool_kernels.hpp

namespace meshlib::nn {

/// @brief How a `pool2d` reduces its windows.
enum class pool_kind { max, average };

namespace detail {
template <class Layer, class Receives, class Needs>
consteval bool pool_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: max_pool2d, avg_pool2d and global_avg_pool take a complete rank-2 block of rows "
                "(images, NHWC, flattened) of their mesh, with unsharded features: shard the batch over the data "
                "axis, not the pixels (the condition spells out the layer, the input's layout and what it needs)");
  return false;
}
}  // namespace detail

/// @brief Max or average pooling over `window x window` windows (see the file comment).
template <class T, mesh_type Mesh, pool_kind Kind>
class pool2d {
 public:
  /// Pools images of shape `in` over `window x window` windows every `stride` pixels (0: `window`,
  /// non-overlapping windows, PyTorch's default). No padding: the last window must fit.
  /// @throws sharding_error when the window is larger than the image or a size is zero.
  pool2d(const Mesh& mesh, const std::string& name, image_shape in, std::size_t window, std::size_t stride = 0)
      : name_(name), in_(in), window_(window), stride_(stride == 0 ? window : stride),
        out_{checked(in, window) ? (in.height - window) / stride_ + 1 : 0, (in.width - window) / stride_ + 1, in.channels},
        saved_(mesh.size()), arg_(mesh.size()), out_buf_(mesh.size()), dx_(mesh.size()) {}

  /// The name messages use.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// `((H - window) / stride + 1) x ((W - window) / stride + 1) x C`.
  [[nodiscard]] image_shape output_shape() const noexcept { return out_; }
  /// Features per input row.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// Features per output row.
  [[nodiscard]] std::size_t out_features() const noexcept { return out_.size(); }
  /// `"pool1 (max_pool2d 2x2, stride 2, 28x28x16 -> 14x14x16)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (" + kind_text() + " " + std::to_string(window_) + "x" + std::to_string(window_) + ", stride " +
           std::to_string(stride_) + ", " + in_.to_string() + " -> " + out_.to_string() + ")";
  }
  /// A complete rank-2 block of rows with unsharded features.
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>();
  /// The kind, as messages spell it: `max_pool2d` or `avg_pool2d`.
  static constexpr fixed_string kind_name = Kind == pool_kind::max ? fixed_string("max_pool2d") : fixed_string("avg_pool2d");
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<kind_name>;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The maximum (or mean) of every window of every channel.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"pool2d.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::pool_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.extent(0);
      if (x.extent(1) != in_.size()) throw sharding_error(detail::image_width_error(to_string(), name_, x.extent(1), in_));
      saved_[dev] = {n, true};
      const std::size_t ho = out_.height, wo = out_.width, c = in_.channels, wd = in_.width, h = in_.height;
      const std::size_t k = window_, s = stride_;
      T* y = out_buf_.get(dev, n * out_.size());
      std::uint32_t* arg = Kind == pool_kind::max ? arg_.get(dev, n * out_.size()) : nullptr;
      const T* xp = x.data();
      const T inv = T{1} / static_cast<T>(k * k);
      detail::pool_forward<default_memory_space, Kind == pool_kind::max>(y, arg, xp, n, h, wd, c, ho, wo, k, s, inv);
      return X(typename X::view_type(y, n, out_.size()), x.mesh(), dev);
    }
  }

  /// The cotangent of the input; the second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"pool2d.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      const auto [n, ran] = saved_[dev];
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, n, out_.size());
      const std::size_t ho = out_.height, wo = out_.width, c = in_.channels, wd = in_.width, h = in_.height;
      const std::size_t k = window_, s = stride_;
      const std::uint32_t* arg = Kind == pool_kind::max ? arg_.get(dev, n * out_.size()) : nullptr;
      const T* d = dy.data();
      T* dx = dx_.get(dev, n * in_.size());
      const T inv = T{1} / static_cast<T>(k * k);
      detail::pool_backward<default_memory_space, Kind == pool_kind::max>(dx, arg, d, n, h, wd, c, ho, wo, k, s, inv);
      return DY(typename DY::view_type(dx, n, in_.size()), dy.mesh(), dev);
    }
  }

  /// Adds nothing: pooling has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  static std::string kind_text() { return std::string(kind_name.view()); }
  bool checked(const image_shape& in, std::size_t window) const {
    const std::string head = "meshlib::nn: " + name_ + " (" + kind_text() + " " + std::to_string(window) + "x" +
                             std::to_string(window) + " on " + in.to_string() + " images)";
    if (window == 0 || in.size() == 0)
      throw sharding_error(head + ": the window and the image's height, width and channels must be at least 1");
    detail::check_window_fits(head, in, window, 0, false, "window");
    return true;
  }

  struct saved {
    std::size_t rows = 0;
    bool ran = false;
  };
  std::string name_;
  image_shape in_;
  std::size_t window_, stride_;
  image_shape out_;
  std::vector<saved> saved_;
  detail::device_buffers<std::uint32_t> arg_;  // max: per output value, the input pixel it came from
  detail::device_buffers<T> out_buf_, dx_;
};

/// @brief Max pooling (`torch.nn.MaxPool2d`, padding 0).
template <class T, mesh_type Mesh>
using max_pool2d = pool2d<T, Mesh, pool_kind::max>;
/// @brief Average pooling (`torch.nn.AvgPool2d`, padding 0).
template <class T, mesh_type Mesh>
using avg_pool2d = pool2d<T, Mesh, pool_kind::average>;

/// @brief The mean of each channel over all pixels: `N x (H*W*C) -> N x C`.
template <class T, mesh_type Mesh>
class global_avg_pool {
 public:
  /// Averages images of shape `in` to one value per channel.
  global_avg_pool(const Mesh& mesh, const std::string& name, image_shape in)
      : name_(name), in_(in), saved_(mesh.size()), out_buf_(mesh.size()), dx_(mesh.size()) {
    if (in.size() == 0)
      throw sharding_error("meshlib::nn: " + name + " (global_avg_pool on " + in.to_string() +
                           " images): the image's height, width and channels must be at least 1");
  }

  /// The name messages use.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// `1 x 1 x C`.
  [[nodiscard]] image_shape output_shape() const noexcept { return {1, 1, in_.channels}; }
  /// Features per input row.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// The channels.
  [[nodiscard]] std::size_t out_features() const noexcept { return in_.channels; }
  /// `"gap (global_avg_pool 7x7x64 -> 64)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (global_avg_pool " + in_.to_string() + " -> " + std::to_string(in_.channels) + ")";
  }
  /// A complete rank-2 block of rows with unsharded features.
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>();
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"global_avg_pool">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The mean of every channel of every image.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"global_avg_pool.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::pool_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;
    } else {
      const std::size_t dev = x.device(), n = x.extent(0);
      if (x.extent(1) != in_.size()) throw sharding_error(detail::image_width_error(to_string(), name_, x.extent(1), in_));
      saved_[dev] = {n, true};
      const std::size_t c = in_.channels, hw = in_.pixels();
      T* y = out_buf_.get(dev, n * c);
      const T* xp = x.data();
      const T inv = T{1} / static_cast<T>(hw);
      detail::global_pool_forward<default_memory_space>(y, xp, n, hw, c, inv);
      return X(typename X::view_type(y, n, c), x.mesh(), dev);
    }
  }

  /// `dx = dy / (H * W)` on every pixel; the second argument (need_dx) is ignored.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    static_cast<void>(require_kernel_can_read<"global_avg_pool.backward", "dy", DY>());
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      const auto [n, ran] = saved_[dev];
      const std::size_t c = in_.channels, hw = in_.pixels();
      detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, n, c);
      const T* d = dy.data();
      T* dx = dx_.get(dev, n * in_.size());
      const T inv = T{1} / static_cast<T>(hw);
      detail::global_pool_backward<default_memory_space>(dx, d, n, hw, c, inv);
      return DY(typename DY::view_type(dx, n, in_.size()), dy.mesh(), dev);
    }
  }

  /// Adds nothing: pooling has no parameters.
  void collect(std::vector<param_ref<T>>&) {}

 private:
  struct saved {
    std::size_t rows = 0;
    bool ran = false;
  };
  std::string name_;
  image_shape in_;
  std::vector<saved> saved_;
  detail::device_buffers<T> out_buf_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/pooling.hpp
// begin meshlib/nn/layers/batch_norm.hpp
/// @file
/// @brief `batch_norm` with batch statistics synchronised over the data axis (PyTorch's
/// `SyncBatchNorm`, `flax.linen.BatchNorm(axis_name="data")`): per channel,
/// `y = (x - mean) / sqrt(var + eps) * g + b`, the mean and (biased) variance taken over every
/// pixel of every image of the *global* batch, so a data-parallel run normalises exactly as one
/// device does over the whole batch, and the per-step losses do not depend on the mesh.
///
/// How: each device sums its block's rows per channel, one `psum` over the data axis gives the
/// global sums (the mean), a second pass and `psum` the global sum of squared deviations (two
/// passes, not `E[x^2] - mean^2`, whose cancellation in float would differ between meshes beyond
/// rounding). The backward pass needs two global sums per channel, `sum dy` and `sum dy * xhat`:
/// one `psum` of both. The gradients of `g` and `b` are the local sums, a pending sum over the data
/// axis that the gradient synchronisation completes, as for every replicated weight.
///
/// Input: a rank-2 block of rows whose rows are the batch sharded over `Data` (what `train_step`
/// feeds), each row an NHWC image of shape `in` (channels-last, see image_shape.hpp); a plain
/// `N x C` activation is the image shape `1 x 1 x C`. The element count the statistics divide by
/// is the global batch times the pixels.
///
/// Evaluation (`begin_step(key, false)`, as `evaluate` calls it): the running mean and variance,
/// updated in training as PyTorch does (`running = (1 - momentum) running + momentum batch`, the
/// unbiased variance), replace the batch statistics; every device updates its copy with the same
/// global statistics, so the copies stay equal. They are not trained parameters (optimizers and the
/// gradient synchronisation do not see them) but buffers, as PyTorch calls them (flax: the
/// `batch_stats` collection): `running_mean()` and `running_var()` read them, and `collect_buffers`
/// shows them, as `name + ".running_mean"` and `name + ".running_var"`, to `save_checkpoint`, which
/// saves and restores them with the parameters (on any mesh: they are replicated).
/// @code
/// meshlib::nn::batch_norm<float, mesh_t> bn(m, "bn1", {28, 28, 16});   // over the 16 channels
/// // inside spmd: auto y = bn.forward(x);  ...  auto dx = bn.backward(dy);
/// @endcode

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class NeedsRows, class NeedsFeatures>
consteval bool batch_norm_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, NeedsRows, NeedsFeatures>,
                "meshlib::nn: batch_norm takes a complete rank-2 block of rows of its mesh and element type whose "
                "rows (the batch) are sharded over exactly its data axis and whose features are not sharded (the "
                "condition spells out the layer, the input's layout and what its rows and features need)");
  return false;
}
}  // namespace detail

/// @brief Batch normalisation over the channels of NHWC images, statistics synchronised over the
/// data axis `Data` (see the file comment). Scale `g` (init 1) and shift `b` (init 0) are replicated.
template <class T, mesh_type Mesh, fixed_string Data = "data">
class batch_norm {
 public:
  /// Scale, shift and running statistics are replicated on every device.
  using sharding = named_sharding<Mesh, P<none>>;
  /// The scale `g` (named `name + ".g"`, initially 1), one per channel.
  parameter<T, 1, sharding> g;
  /// The shift `b` (named `name + ".b"`, initially 0), one per channel.
  parameter<T, 1, sharding> b;

  /// Normalises images of shape `in` per channel. `momentum`: PyTorch's (the weight of the new
  /// batch in the running statistics); `eps` keeps the division finite. `local_devices`: this
  /// process's devices (empty: all).
  batch_norm(const Mesh& mesh, const std::string& name, image_shape in, T momentum = T(0.1), T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : g(name + ".g", sharding{mesh}, {checked(name, in)}, rng_key{}, init::constant(1.0f), false, local_devices),
        b(name + ".b", sharding{mesh}, {in.channels}, rng_key{}, init::zeros(), false, local_devices),
        name_(name),
        in_(in),
        momentum_(momentum),
        eps_(eps),
        running_mean_(full<T>(sharding{mesh}, std::array<std::size_t, 1>{in.channels}, T{0}, local_devices)),
        running_var_(full<T>(sharding{mesh}, std::array<std::size_t, 1>{in.channels}, T{1}, local_devices)),
        saved_(mesh.size()),
        stats_(mesh.size()),
        st_back_(mesh.size()),
        xhat_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}
  /// Normalises `features` values per row (images of shape `1 x 1 x features`), as `BatchNorm1d`.
  batch_norm(const Mesh& mesh, const std::string& name, std::size_t features, T momentum = T(0.1), T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : batch_norm(mesh, name, image_shape{1, 1, features}, momentum, eps, local_devices) {}

  /// The layer's name: its parameters are `name() + ".g"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes and returns.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// @copydoc input_shape
  [[nodiscard]] image_shape output_shape() const noexcept { return in_; }
  /// Features per row, in and out.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_.size(); }
  /// The channels it normalises.
  [[nodiscard]] std::size_t channels() const noexcept { return in_.channels; }
  /// `"bn1 (batch_norm over 16 channels of 28x28x16, synchronised over 'data')"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (batch_norm over " + std::to_string(in_.channels) + " channels of " + in_.to_string() +
           ", synchronised over '" + std::string(Data.view()) + "')";
  }
  /// Whether the layer normalises with the batch's statistics (training, the default) or the running ones.
  [[nodiscard]] bool training() const noexcept { return train_; }
  /// The running mean per channel (PyTorch's `running_mean`), replicated; initially 0.
  [[nodiscard]] const sharded_tensor<T, 1, sharding>& running_mean() const noexcept { return running_mean_; }
  /// The running (unbiased) variance per channel (PyTorch's `running_var`), replicated; initially 1.
  [[nodiscard]] const sharded_tensor<T, 1, sharding>& running_var() const noexcept { return running_var_; }

  /// The data axis's mask: the rows must be sharded over exactly it.
  static constexpr axis_mask data_mask = Mesh::template mask_of<Data>();
  /// A complete rank-2 block of rows sharded over `Data`, with unsharded features.
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>() && X::dims_type::at(0) == data_mask;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"batch_norm">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// Training or evaluation (called by `sequential::begin_step`: `train_step` passes true, `evaluate` false).
  void begin_step(rng_key, bool train) noexcept { train_ = train; }

  /// Normalises every channel with the global batch's statistics (training) or the running ones.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"batch_norm.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      using rows_need = meshlib::diagnostic::rows_sharded_over<meshlib::diagnostic::axes_t<Mesh, data_mask>>;
      static_cast<void>(detail::batch_norm_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                              rows_need, input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0);
      if (x.extent(1) != in_.size()) throw sharding_error(width_error(x.extent(1)));
      const std::size_t c = in_.channels, np = rows * in_.pixels();
      const T count = static_cast<T>(x.global_extent(0) * in_.pixels());
      saved_[dev] = {rows, true, train_, count};
      T* st = stats_.get(dev, 4 * c);  // sums, squared deviations, mean, 1 / std
      T* mean = st + 2 * c;
      T* rstd = st + 3 * c;
      const T* xp = x.data();
      const T eps = eps_;
      T* run_mean = running_mean_.local(dev).data();
      T* run_var = running_var_.local(dev).data();
      if (train_) {
        T* s = st;
        T* q = st + c;
        detail::channel_sums<default_memory_space>(s, xp, static_cast<const T*>(nullptr), np, c, T{1});
        (void)meshlib::psum<Data>(detail::wrap1<sums_t>(s, c, x.mesh(), dev));  // donated: summed in place
        detail::channel_sums<default_memory_space>(q, xp, s, np, c, count);
        (void)meshlib::psum<Data>(detail::wrap1<sums_t>(q, c, x.mesh(), dev));
        const T mom = momentum_;
        const T unbias = count > T{1} ? count / (count - T{1}) : T{1};
        detail::batch_statistics<default_memory_space>(mean, rstd, run_mean, run_var, s, q, c, count, eps, mom, unbias);
      } else {
        detail::running_statistics<default_memory_space>(mean, rstd, run_mean, run_var, c, eps);
      }
      T* xh = xhat_.get(dev, np * c);
      T* y = out_.get(dev, np * c);
      const T* gv = g.value.local(dev).data();
      const T* bv = b.value.local(dev).data();
      detail::batch_normalize<default_memory_space>(y, xh, xp, mean, rstd, gv, bv, np, c);
      return X(typename X::view_type(y, rows, in_.size()), x.mesh(), dev);
    }
  }

  /// The cotangent of the input (when `need_dx`; otherwise its contents are unspecified); accumulates
  /// (or, as `grad_beta` says, writes) the gradients of `g` and `b`.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"batch_norm.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved sv = saved_[dev];
    detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), sv.ran, sv.rows, in_.size());
    const std::size_t c = in_.channels, np = sv.rows * in_.pixels();
    const T* st = stats_.get(dev, 4 * c);
    const T* rstd = st + 3 * c;
    const T* xh = xhat_.get(dev, np * c);
    T* sums = st_back_.get(dev, 2 * c);  // sum dy, sum dy * xhat
    const T* d = dy.data();
    // Per channel, rows in order (the same bits on every run).
    detail::batch_grad_sums<default_memory_space>(sums, d, xh, np, c);
    T* gg = g.grad.local(dev).data();
    T* gb = b.grad.local(dev).data();
    const T beta_g = g.grad_beta(dev), beta_b = b.grad_beta(dev);
    detail::batch_param_grads<default_memory_space>(gg, gb, sums, c, beta_g, beta_b);
    T* dx = dx_.get(dev, np * c);
    if (!need_dx) return DY(typename DY::view_type(dx, sv.rows, in_.size()), dy.mesh(), dev);
    const T* gv = g.value.local(dev).data();
    if (sv.train) {
      // dx = g / std * (dy - mean(dy) - xhat * mean(dy * xhat)), the means over the global batch.
      (void)meshlib::psum<Data>(detail::wrap1<sums_t>(sums, 2 * c, dy.mesh(), dev));
      const T inv = T{1} / sv.count;
      detail::batch_norm_dx<default_memory_space>(dx, d, xh, sums, gv, rstd, np, c, inv);
    } else {  // the statistics are constants: an affine map per channel
      detail::batch_norm_dx_affine<default_memory_space>(dx, d, gv, rstd, np, c);
    }
    return DY(typename DY::view_type(dx, sv.rows, in_.size()), dy.mesh(), dev);
  }

  /// Appends `g` and `b` (the running statistics are not trained).
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(g.ref(true));  // backward writes them with grad_beta
    out.push_back(b.ref(true));
  }
  /// Appends the running statistics, `name() + ".running_mean"` and `name() + ".running_var"`
  /// (`channels()` values each): what checkpoints save beside the parameters.
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    out.push_back(detail::tensor_ref(name_ + ".running_mean", running_mean_));
    out.push_back(detail::tensor_ref(name_ + ".running_var", running_var_));
  }

 private:
  /// A device's per-channel sums, varying over the data axis until the `psum`.
  using sums_t = local_tensor<T, 1, Mesh, data_mask, 0, replicated_dims<1>, default_memory_space>;

  static std::size_t checked(const std::string& name, const image_shape& in) {
    if (in.size() == 0)
      throw sharding_error("meshlib::nn: " + name + " (batch_norm on " + in.to_string() +
                           " images): the image's height, width and channels must be at least 1");
    return in.channels;
  }

  std::string width_error(std::size_t got) const {
    if (in_.pixels() == 1)
      return "meshlib::nn: " + to_string() + " received " + std::to_string(got) + " features per row, but it normalises " +
             std::to_string(in_.channels) + "; declare " + name_ + " with " + std::to_string(got) +
             " features (or the image shape of the layer before it), or feed it " + std::to_string(in_.channels);
    return detail::image_width_error(to_string(), name_, got, in_);
  }

  struct saved {
    std::size_t rows = 0;
    bool ran = false, train = true;
    T count = T{1};  // elements per channel in the global batch
  };
  std::string name_;
  image_shape in_;
  T momentum_, eps_;
  bool train_ = true;
  sharded_tensor<T, 1, sharding> running_mean_, running_var_;
  std::vector<saved> saved_;
  detail::device_buffers<T> stats_, st_back_, xhat_, out_, dx_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/batch_norm.hpp
// begin meshlib/nn/layers/residual.hpp
/// @file
/// @brief `residual`: a skip connection, `y = main(x) + shortcut(x)` (ResNet's identity or
/// projection shortcut, a Transformer's residual stream), and `identity`, the default shortcut.
///
/// The branches are any layers of the `sequential` protocol (a `sequential` included); both must
/// return the input's type and width, so the sum is elementwise and the cotangent of the input is
/// the sum of the two branches' cotangents of `dy` (the backward of a fan-out is a sum). Both sums
/// are Kokkos kernels on the running device's instance, into the residual's own buffers; no
/// communication beyond the branches' own.
/// @code
/// auto block = meshlib::nn::make_residual<float>(m, meshlib::nn::sequential(conv_a, bn_a, relu_a, conv_b, bn_b));
/// // inside spmd: auto y = block.forward(x);   // conv_b(...(x)) + x
/// @endcode

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::diagnostic {
/// A `residual`'s main branch, of kind `Kind` (an `op` naming it, or the layer's type).
template <class Kind>
struct main_branch {};
/// A `residual`'s shortcut branch, of kind `Kind`.
template <class Kind>
struct shortcut_branch {};
}  // namespace meshlib::diagnostic

namespace meshlib::nn {

/// @brief The identity layer: returns its input, and the cotangent unchanged.
template <class T>
struct identity {
  /// The width out is the width in.
  static constexpr bool keeps_features = true;
  /// `x` itself (no copy).
  template <local_tensor_type X>
  X forward(const X& x) {
    return x;
  }
  /// `dy` itself; the second argument (need_dx) is ignored.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool = true) {
    return dy;
  }
  /// Adds nothing: no parameters.
  void collect(std::vector<param_ref<T>>&) {}
};

namespace detail {
template <class Residual, class Branch, class Input, class Returns>
consteval bool residual_branch_returns_another_type() {
  static_assert(meshlib::diagnostic::always_false<Residual, Branch, Input, Returns>,
                "meshlib::nn: residual: both branches must return their input's type (same sharding, vary and "
                "partial; in backward, the input's cotangent) so their sum is elementwise: the condition spells out "
                "residual_branch_returns_another_type<residual, the branch (main_branch or shortcut_branch, its kind), "
                "the input's layout, what the branch returns> (the whole types where the layouts agree). End the "
                "branch with a layer that returns its input's sharding (a row_dense after a column_dense), or psum "
                "or reshard inside the branch");
  return false;
}

/// True when a residual's branch `Branch` (`main_branch<kind>` / `shortcut_branch<kind>`) given `In`
/// returned `Out`, its input's type; otherwise fires the one diagnostic naming the branch and both layouts.
template <class Branch, class In, class Out>
consteval bool check_branch_type() {
  if constexpr (std::is_same_v<In, Out>)
    return true;
  else
    return residual_branch_returns_another_type<meshlib::diagnostic::op_t<"residual">, Branch,
                                                typename diagnostic_of<In, Out>::type,
                                                typename diagnostic_of<Out, In>::type>();
}

/// `l.backward(dy, need_dx)`, telling a `sequential` (whose backward names its input type) that its
/// input had `dy`'s type: a residual's branches take and return the same type.
template <class L, class DY>
auto branch_backward(L& l, const DY& dy, bool need_dx) {
  if constexpr (requires { l.template backward<DY>(dy, need_dx); }) return l.template backward<DY>(dy, need_dx);
  else return l.backward(dy, need_dx);
}
template <class L>
void branch_begin_step(L& l, rng_key key, bool train) {
  if constexpr (requires { l.begin_step(key, train); }) l.begin_step(key, train);
}
}  // namespace detail

/// @brief `y = main(x) + shortcut(x)` (see the file comment).
template <class T, class Main, class Shortcut = identity<T>>
class residual {
 public:
  /// The residual branch (for ResNet: conv-BN-ReLU-conv-BN).
  Main main;
  /// The shortcut branch (the identity, or a projection where the shape changes).
  Shortcut shortcut;

  /// Sums `main` and `shortcut` applied to the same input.
  /// @throws sharding_error when both branches expose widths (`in_features()`, `out_features()`;
  /// the identity keeps its input's) and they disagree.
  template <mesh_type Mesh>
  residual(const Mesh& mesh, Main main_, Shortcut shortcut_ = Shortcut{})
      : main(std::move(main_)), shortcut(std::move(shortcut_)), rows_(mesh.size()), out_(mesh.size()), dx_(mesh.size()) {
    if constexpr (detail::has_widths<Main> && (detail::has_widths<Shortcut> || detail::keeps_features<Shortcut>())) {
      const std::size_t in = main.in_features(), out = main.out_features();
      std::size_t s_in = in, s_out = in;
      std::string with = "the identity shortcut, which returns its " + std::to_string(in) + " input features";
      if constexpr (detail::has_widths<Shortcut>) {
        s_in = shortcut.in_features();
        s_out = shortcut.out_features();
        with = "its shortcut, which maps " + std::to_string(s_in) + " to " + std::to_string(s_out) + " features";
      }
      if (s_in != in || s_out != out)
        throw sharding_error("meshlib::nn: residual: its main branch maps " + std::to_string(in) + " to " +
                             std::to_string(out) + " features, which cannot be added to " + with +
                             "; give the main branch the input's width (same image shape, stride 1) or use a "
                             "projection shortcut that maps the input to the main branch's output");
    }
  }

  /// The main branch's input width.
  [[nodiscard]] std::size_t in_features() const
    requires detail::has_widths<Main>
  {
    return main.in_features();
  }
  /// The main branch's output width.
  [[nodiscard]] std::size_t out_features() const
    requires detail::has_widths<Main>
  {
    return main.out_features();
  }
  /// `"residual"`, as messages name it.
  [[nodiscard]] std::string name() const { return "residual"; }
  /// What both branches accept.
  template <class X>
  static constexpr bool accepts_input = detail::layer_accepts<Main, X>() && detail::layer_accepts<Shortcut, X>();
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"residual">;
  /// What the main branch needs (`sequential`'s message when a residual cannot take its input).
  using input_requirement = typename detail::layer_input_requirement<Main>::type;

  /// Passes the step's key and mode to both branches (batch norm and dropout read them).
  void begin_step(rng_key key, bool train) {
    detail::branch_begin_step(main, key, train);
    detail::branch_begin_step(shortcut, key, train);
  }

  /// `main(x) + shortcut(x)`.
  /// @throws sharding_error when the branches return blocks of different shapes.
  template <local_tensor_type X>
  X forward(const X& x) {
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const auto h = main.forward(x);
      const auto s = shortcut.forward(x);
      using H = std::remove_cvref_t<decltype(h)>;
      using S = std::remove_cvref_t<decltype(s)>;
      if constexpr (!detail::check_branch_type<main_branch_t, X, H>() ||
                    !detail::check_branch_type<shortcut_branch_t, X, S>())
        return x;  // the one diagnostic has fired; nothing else may
      else
        return sum(h, s);
    }
  }

  /// The sum of both branches' input cotangents (when `need_dx`; otherwise unspecified contents).
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    if constexpr (!std::is_same_v<typename DY::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename DY::value_type>());
      return dy;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = dy.device();
      detail::check_output_cotangent("residual", dev, dy.extent(0), dy.extent(1), rows_[dev].ran, rows_[dev].rows,
                                     rows_[dev].cols);
      const auto dm = detail::branch_backward(main, dy, need_dx);
      const auto ds = detail::branch_backward(shortcut, dy, need_dx);
      using DM = std::remove_cvref_t<decltype(dm)>;
      using DS = std::remove_cvref_t<decltype(ds)>;
      if constexpr (!detail::check_branch_type<main_branch_t, DY, DM>() ||
                    !detail::check_branch_type<shortcut_branch_t, DY, DS>()) {
        return dy;  // the one diagnostic has fired; nothing else may
      } else {
        const std::size_t n = dm.size();
        T* dx = dx_.get(dev, n);
        if (need_dx) {
          const T* a = dm.data();
          const T* b = ds.data();
          detail::sum_values<default_memory_space>(dx, a, b, n);
        }
        return DY(typename DY::view_type(dx, dm.extent(0), dm.extent(1)), dy.mesh(), dev);
      }
    }
  }

  /// Appends the main branch's parameters, then the shortcut's.
  void collect(std::vector<param_ref<T>>& out) {
    main.collect(out);
    shortcut.collect(out);
  }
  /// Appends the main branch's buffers (batch norms' running statistics), then the shortcut's.
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    detail::collect_buffers_of(main, out);
    detail::collect_buffers_of(shortcut, out);
  }

 private:
  using main_branch_t = meshlib::diagnostic::main_branch<typename detail::layer_diagnostic_name<Main>::type>;
  using shortcut_branch_t = meshlib::diagnostic::shortcut_branch<typename detail::layer_diagnostic_name<Shortcut>::type>;

  /// `h + s` into the residual's buffer, after checking that the branches' blocks have one shape.
  template <class X>
  X sum(const X& h, const X& s) {
    const std::size_t dev = h.device();
    if (h.extent(0) != s.extent(0) || h.extent(1) != s.extent(1))
      throw sharding_error("meshlib::nn: residual: on device " + std::to_string(dev) + " the main branch returned (" +
                           std::to_string(h.extent(0)) + ", " + std::to_string(h.extent(1)) + ") and the shortcut (" +
                           std::to_string(s.extent(0)) + ", " + std::to_string(s.extent(1)) +
                           "); the branches must return the same shape");
    const std::size_t n = h.size();
    rows_[dev] = {h.extent(0), h.extent(1), true};
    T* y = out_.get(dev, n);
    const T* hp = h.data();
    const T* sp = s.data();
    detail::sum_values<default_memory_space>(y, hp, sp, n);
    return X(typename X::view_type(y, h.extent(0), h.extent(1)), h.mesh(), dev);
  }

  struct shape {
    std::size_t rows = 0, cols = 0;
    bool ran = false;
  };
  std::vector<shape> rows_;  // per device: the last forward's output shape
  detail::device_buffers<T> out_, dx_;
};

/// @brief `residual<T, Main, Shortcut>` with the branch types deduced: `make_residual<float>(mesh, main)`.
template <class T, mesh_type Mesh, class Main, class Shortcut = identity<T>>
residual<T, Main, Shortcut> make_residual(const Mesh& mesh, Main main, Shortcut shortcut = Shortcut{}) {
  return residual<T, Main, Shortcut>(mesh, std::move(main), std::move(shortcut));
}

}  // namespace meshlib::nn
// end meshlib/nn/layers/residual.hpp
// begin meshlib/nn/layers/basic_block.hpp
/// @file
/// @brief `basic_block`: ResNet's basic block (He et al. 2016; torchvision's `BasicBlock`):
/// `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`, 3x3 convolutions without bias (batch norm
/// follows each), the first with the block's stride. The shortcut is the identity when the block
/// keeps the image shape, else a projection (a 1x1 convolution with the stride, then batch norm),
/// option B of the paper. Batch norms are synchronised over the data axis (batch_norm.hpp), so a
/// data-parallel ResNet trains as on one device.
///
/// It is a layer of the `sequential` protocol (widths, `begin_step`, `collect`), built from
/// `conv2d`, `batch_norm`, `relu` and `residual`, so it composes with `sequential`, pooling and `dense`.
/// @code
/// meshlib::nn::sequential net(
///     meshlib::nn::conv2d<float, mesh_t>(m, "stem", {28, 28, 1}, 16, 3, key, {.padding = 1, .use_bias = false}),
///     meshlib::nn::batch_norm<float, mesh_t>(m, "stem_bn", {28, 28, 16}), meshlib::nn::relu<float>(m),
///     meshlib::nn::basic_block<float, mesh_t>(m, "b1", {28, 28, 16}, 32, 2, key),   // -> 14x14x32
///     meshlib::nn::global_avg_pool<float, mesh_t>(m, "gap", {14, 14, 32}),
///     meshlib::nn::dense<float, mesh_t>(m, "fc", 32, 10, key));
/// @endcode

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

// begin meshlib/nn/sequential.hpp
/// @file
/// @brief `sequential`: layers run forward in order and backward in reverse, as `flax.linen.Sequential`
/// / `torch.nn.Sequential`, so a user writes no gradient for them. A layer is any type with
/// `forward(x)`, `backward(dy, need_dx)` and `collect(params)` (and, optionally,
/// `begin_step(key, train)`, which dropout uses): a user-written struct of layers works the same way.
///
/// `backward<X>(dy)` checks at compile time that every layer hands back a cotangent of exactly the
/// type (vary, partial and per-dimension sharding) its forward input had, so a backward pass whose
/// communication does not mirror the forward's does not compile.
///
/// Compositions are checked before anything runs (nn/layers/shape_checks.hpp has the protocol):
/// - at compile time, `forward<X>` / `backward<X>` first walk the layers with the types they would
///   receive; the first layer that cannot take its input (a `row_dense` after a layer whose features
///   are complete, a `column_dense` after one whose features are sharded) is one `static_assert`
///   naming it and the layer before it (index and kind), the layout it receives and what it needs;
/// - at construction, consecutive layers that expose their widths (`in_features()`,
///   `out_features()`; activations and dropout pass the width through) must agree, else
///   `sharding_error` names both layers (index, name, kind), both widths and the fix.
/// @code
/// meshlib::nn::sequential net(meshlib::nn::column_dense<float, mesh_t>(m, "fc1", 784, 1024, key),
///                             meshlib::nn::relu<float>(m),
///                             meshlib::nn::row_dense<float, mesh_t>(m, "fc2", 1024, 10, key));
/// // inside spmd: auto logits = net.forward(x); ... net.backward<decltype(x)>(dlogits);
/// @endcode

#include <concepts>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

namespace detail {
/// What a `sequential` calls around each layer when `hooks` is set: FSDP (nn/parallel/fsdp.hpp) gathers a
/// layer's parameters just before it runs and reduce-scatters its gradients just after its backward.
/// `layer` is the layer's index, `dev` the running device.
struct layer_hooks {
  virtual ~layer_hooks() = default;
  virtual void before_forward(std::size_t layer, std::size_t dev) = 0;
  virtual void before_backward(std::size_t layer, std::size_t dev) = 0;
  virtual void after_backward(std::size_t layer, std::size_t dev) = 0;
};

template <class Layer, class Input, class Cotangent>
consteval bool backward_cotangent_type_differs_from_input() {
  static_assert(meshlib::diagnostic::always_false<Layer, Input, Cotangent>,
                "meshlib::nn: sequential: the backward of a layer returns a cotangent whose type (vary, partial, "
                "dims) differs from its forward input's: its backward pass does not transpose its forward "
                "collectives. The condition spells out backward_cotangent_type_differs_from_input<the layer (index, "
                "kind), its input's layout, the cotangent's layout> (the whole types where the layouts agree)");
  return false;
}

/// True when the backward of layer `I` (of type `L`) returned `DX`, its input's type `In`; otherwise
/// fires the one diagnostic, naming the layer and both layouts.
template <std::size_t I, class L, class In, class DX>
consteval bool check_cotangent_type() {
  if constexpr (std::is_same_v<In, DX>)
    return true;
  else
    return backward_cotangent_type_differs_from_input<meshlib::diagnostic::layer<I, typename layer_diagnostic_name<L>::type>,
                                                      typename diagnostic_of<In, DX>::type,
                                                      typename diagnostic_of<DX, In>::type>();
}

/// Whether `sequential` fuses the backward of `Above`, an elementwise activation, with that of
/// `Below`, the dense layer whose output it takes (`basic_dense::backward_through`).
template <class Below, class Above>
inline constexpr bool fuses_backward = requires {
  requires Below::fuses_activation_backward;
  typename Above::activation_function;
};
}  // namespace detail

/// @brief Layers in order (see the file comment).
template <class... Layers>
class sequential {
 public:
  /// The number of layers.
  static constexpr std::size_t size = sizeof...(Layers);
  /// The layers, in the order the input goes through them.
  std::tuple<Layers...> layers;
  /// Mixed precision: when set (a `train_state` computing in bfloat16 or float16 sets it), every
  /// layer's output and every cotangent is rounded to the compute type in place.
  void (*round_activations)(float*, std::size_t) noexcept = nullptr;
  /// When set (a `train_state` with FSDP sets it), called around every layer's forward and
  /// backward; not owned.
  detail::layer_hooks* hooks = nullptr;

  /// Chains `ls` in order: each layer receives the previous layer's output.
  /// @throws sharding_error when a layer's `in_features()` is not the `out_features()` of the last
  /// layer before it that has widths (with only width-keeping layers between them).
  explicit sequential(Layers... ls) : layers(std::move(ls)...) { check_widths(std::make_index_sequence<size>{}); }

  /// The global number of input features, when the first layer has widths.
  [[nodiscard]] std::size_t in_features() const
    requires(size > 0 && detail::has_widths<std::tuple_element_t<0, std::tuple<Layers...>>>)
  {
    return std::get<0>(layers).in_features();
  }

  /// The type layer `I` receives when the network receives `X`.
  template <class X, std::size_t I>
  struct input_of {
    /// What layer `I - 1` receives.
    using prev = typename input_of<X, I - 1>::type;
    /// What layer `I - 1` returns, so what layer `I` receives.
    using type = std::remove_cvref_t<decltype(std::declval<std::tuple_element_t<I - 1, std::tuple<Layers...>>&>().forward(
        std::declval<const prev&>()))>;
  };
  /// Layer 0 receives the network's own input `X`.
  template <class X>
  struct input_of<X, 0> {
    using type = X;  ///< `X` itself
  };

  /// Forward through every layer, first to last; returns the last layer's output.
  template <local_tensor_type X>
  auto forward(const X& x) {
    if constexpr (!diagnose_chain<X, 0>()) return x;  // the one diagnostic has fired; nothing else may
    else return forward_from<0>(x);
  }

  /// Its backward names its input type (`backward<X>(dy)`), so a sequential nests in a sequential.
  static constexpr bool backward_names_input = true;

  /// Backward through every layer, last first; returns the cotangent of the input `X` when
  /// `need_dx` (else its contents are unspecified: the first layer skips that product).
  template <local_tensor_type X, local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = false) {
    if constexpr (!diagnose_chain<X, 0>()) return;  // the same diagnostic as forward's, fired once
    else return backward_from<X, size - 1>(dy, need_dx);
  }

  /// Tells layers that draw random numbers (dropout) the step's key and whether this is training.
  void begin_step(rng_key key, bool train) {
    std::apply([&](auto&... l) { (begin_one(l, key, train), ...); }, layers);
  }

  /// Appends every layer's parameters to `out`, in layer order.
  template <class T>
  void collect(std::vector<param_ref<T>>& out) {
    std::apply([&](auto&... l) { (l.collect(out), ...); }, layers);
  }
  /// Appends every layer's buffers (running statistics: what checkpoints keep beside the
  /// parameters, see `detail::tensor_ref`) to `out`, in layer order.
  template <class T>
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    std::apply([&](const auto&... l) { (detail::collect_buffers_of(l, out), ...); }, layers);
  }

  /// How many parameters each layer appends in `collect`, in layer order (FSDP's units).
  template <class T>
  [[nodiscard]] std::vector<std::size_t> params_per_layer() {
    std::vector<std::size_t> counts;
    std::apply([&](auto&... l) { (counts.push_back(count_params<T>(l)), ...); }, layers);
    return counts;
  }

 private:
  template <std::size_t I>
  using layer_t = std::tuple_element_t<I, std::tuple<Layers...>>;

  /// Walks the layers with the types they receive from `X`; fires one diagnostic at the first
  /// layer that cannot take its input (one instantiation per `X`: forward and backward share it).
  template <class X, std::size_t I>
  static consteval bool diagnose_chain() {
    if constexpr (I == size) {
      return true;
    } else {
      using in_t = typename input_of<X, I>::type;
      using L = layer_t<I>;
      if constexpr (!detail::layer_accepts<L, in_t>()) {
        using from_t = typename std::conditional_t<I == 0, std::type_identity<diagnostic::network_input>,
                                                   prev_layer_diagnostic<I>>::type;
        return detail::sequential_layers_do_not_chain<
            diagnostic::layer<I, typename detail::layer_diagnostic_name<L>::type>, meshlib::diagnostic::value_t<in_t>,
            from_t, typename detail::layer_input_requirement<L>::type>();
      } else {
        return diagnose_chain<X, I + 1>();
      }
    }
  }
  template <std::size_t I>
  struct prev_layer_diagnostic {
    using type = diagnostic::layer<I - 1, typename detail::layer_diagnostic_name<layer_t<I - 1>>::type>;
  };

  /// The run-time width check of the constructor (see the file comment): the last layer with
  /// widths whose output reaches the next layer, and how messages name it.
  struct width_source {
    bool known = false;
    std::size_t width = 0;
    std::string text, name;
  };
  template <std::size_t... I>
  void check_widths(std::index_sequence<I...>) const {
    width_source from;
    (check_width<I>(from), ...);
  }
  template <std::size_t I>
  void check_width(width_source& from) const {
    const auto& l = std::get<I>(layers);
    if constexpr (detail::has_widths<layer_t<I>>) {
      if (from.known && from.width != l.in_features())
        throw sharding_error("meshlib::nn: sequential: " + detail::layer_text(I, l) + " takes " +
                             std::to_string(l.in_features()) + " features, but " + from.text + " before it outputs " +
                             std::to_string(from.width) + "; declare " + detail::layer_name(I, l) + " with " +
                             std::to_string(from.width) + " inputs or " + from.name + " with " +
                             std::to_string(l.in_features()) + " outputs");
      from = {true, l.out_features(), detail::layer_text(I, l), detail::layer_name(I, l)};
    } else if constexpr (!detail::keeps_features<layer_t<I>>()) {
      from.known = false;  // a layer of unknown width: nothing to compare across it
    }
  }

  template <std::size_t I, class X>
  auto forward_from(const X& x) {
    if constexpr (I == size) {
      return x;
    } else {
      if (hooks != nullptr) hooks->before_forward(I, x.device());
      auto y = std::get<I>(layers).forward(x);
      round(y);
      return forward_from<I + 1>(y);
    }
  }

  template <class X, std::size_t I, class DY>
  auto backward_from(const DY& dy, bool need_dx) {
    // A dense layer and the activation after it: one kernel for the activation's cotangent and the
    // bias gradient. Not with hooks (FSDP gathers and scatters around each layer on its own) nor
    // with rounding (the unfused path rounds the activation's cotangent before the bias sums it).
    if constexpr (I > 0) {
      if constexpr (detail::fuses_backward<layer_t<I - 1>, layer_t<I>>)
        if (hooks == nullptr && round_activations == nullptr) return backward_fused<X, I>(dy, need_dx);
    }
    using in_t = typename input_of<X, I>::type;
    if (hooks != nullptr) hooks->before_backward(I, dy.device());
    auto dx = detail::layer_backward<in_t>(std::get<I>(layers), dy, I > 0 || need_dx);
    if (hooks != nullptr) hooks->after_backward(I, dy.device());
    if (I > 0 || need_dx) round(dx);
    constexpr bool transposed = detail::check_cotangent_type<I, layer_t<I>, in_t, decltype(dx)>();  // one error, its own
    if constexpr (I == 0 || !transposed) return dx;  // (not into the layers below: no second error)
    else return backward_from<X, I - 1>(dx, need_dx);
  }

  /// Layers `I - 1` (dense) and `I` (its activation) backward in one step (`backward_from`).
  template <class X, std::size_t I, class DY>
  auto backward_fused(const DY& dy, bool need_dx) {
    using in_t = typename input_of<X, I - 1>::type;
    using Fn = typename layer_t<I>::activation_function;
    const auto act = std::get<I>(layers).fused_backward_operands(dy);
    auto dx = std::get<I - 1>(layers).template backward_through<Fn>(dy, act.x, act.dx, I > 1 || need_dx);
    constexpr bool transposed = detail::check_cotangent_type<I - 1, layer_t<I - 1>, in_t, decltype(dx)>();
    if constexpr (I == 1 || !transposed) return dx;
    else return backward_from<X, I - 2>(dx, need_dx);
  }

  template <class Y>
  void round(Y& y) const noexcept {
    if constexpr (requires { { y.data() } -> std::same_as<float*>; y.size(); })
      if (round_activations != nullptr) round_activations(y.data(), y.size());
  }

  template <class T, class L>
  static std::size_t count_params(L& l) {
    std::vector<param_ref<T>> v;
    l.collect(v);
    return v.size();
  }

  template <class L>
  static void begin_one(L& l, rng_key key, bool train) {
    if constexpr (requires { l.begin_step(key, train); }) l.begin_step(key, train);
  }
};

}  // namespace meshlib::nn
// end meshlib/nn/sequential.hpp

namespace meshlib::nn {

namespace detail {
/// The shortcut of a basic block: the identity, or a 1x1 convolution with the block's stride and a
/// batch norm (chosen at construction: whether the shape changes is known only then).
template <class T, mesh_type Mesh, fixed_string Data>
class block_shortcut {
 public:
  using projection_type = sequential<conv2d<T, Mesh>, batch_norm<T, Mesh, Data>>;
  block_shortcut(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels, std::size_t stride,
                 rng_key key, std::span<const std::size_t> local_devices)
      : in_(in) {
    if (stride != 1 || out_channels != in.channels) {
      conv2d<T, Mesh> c(mesh, name + ".proj", in, out_channels, 1, key, {.stride = stride, .use_bias = false}, local_devices);
      const image_shape out = c.output_shape();
      proj_.emplace(std::move(c), batch_norm<T, Mesh, Data>(mesh, name + ".proj_bn", out, T(0.1), T(1e-5), local_devices));
    }
  }
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  [[nodiscard]] std::size_t out_features() const noexcept {
    return proj_ ? std::get<0>(proj_->layers).out_features() : in_.size();
  }
  [[nodiscard]] bool projects() const noexcept { return proj_.has_value(); }
  template <local_tensor_type X>
  X forward(const X& x) {
    return proj_ ? proj_->forward(x) : x;
  }
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    return proj_ ? proj_->template backward<DY>(dy, need_dx) : dy;
  }
  void begin_step(rng_key key, bool train) {
    if (proj_) proj_->begin_step(key, train);
  }
  void collect(std::vector<param_ref<T>>& out) {
    if (proj_) proj_->collect(out);
  }
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    if (proj_) proj_->collect_buffers(out);
  }

 private:
  image_shape in_;
  std::optional<projection_type> proj_;
};
}  // namespace detail

/// @brief ResNet's basic block (see the file comment).
template <class T, mesh_type Mesh, fixed_string Data = "data">
class basic_block {
 public:
  /// conv1 (3x3, stride), bn1, relu, conv2 (3x3), bn2.
  using main_type = sequential<conv2d<T, Mesh>, batch_norm<T, Mesh, Data>, relu<T>, conv2d<T, Mesh>, batch_norm<T, Mesh, Data>>;
  /// The main branch plus the shortcut.
  residual<T, main_type, detail::block_shortcut<T, Mesh, Data>> body;

  /// A block from images of shape `in` to `out_channels` channels, the first convolution (and the
  /// projection, when the shape changes) with `stride`. Parameters are named `name + ".conv1.w"`,
  /// `".bn1.g"`, ..., `".proj.w"`, `".proj_bn.g"`; weights He-uniform from `key`.
  /// @throws sharding_error as `conv2d` does (a kernel larger than the padded input, zero sizes).
  basic_block(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels, std::size_t stride,
              rng_key key, std::span<const std::size_t> local_devices = {})
      : body(mesh, make_main(mesh, name, in, out_channels, stride, key, local_devices),
             detail::block_shortcut<T, Mesh, Data>(mesh, name, in, out_channels, stride, key, local_devices)),
        act_(mesh),
        name_(name),
        in_(in),
        out_(std::get<0>(body.main.layers).output_shape()) {}

  /// The block's name, the prefix of its parameters' names.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// `ceil(H / stride) x ceil(W / stride) x out_channels`.
  [[nodiscard]] image_shape output_shape() const noexcept { return out_; }
  /// Features per input row.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// Features per output row.
  [[nodiscard]] std::size_t out_features() const noexcept { return out_.size(); }
  /// `"b1 (basic_block 28x28x16 -> 14x14x32, projection shortcut)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (basic_block " + in_.to_string() + " -> " + out_.to_string() + ", " +
           (body.shortcut.projects() ? "projection" : "identity") + " shortcut)";
  }
  /// What its first convolution accepts.
  template <class X>
  static constexpr bool accepts_input = conv2d<T, Mesh>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"basic_block">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// Training or evaluation, for its batch norms.
  void begin_step(rng_key key, bool train) { body.begin_step(key, train); }

  /// `relu(main(x) + shortcut(x))`.
  template <local_tensor_type X>
  X forward(const X& x) {
    return act_.forward(body.forward(x));
  }
  /// The cotangent of the input (when `need_dx`); accumulates every parameter's gradient.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    return body.backward(act_.backward(dy), need_dx);
  }
  /// Appends the main branch's parameters (conv1, bn1, conv2, bn2), then the projection's.
  void collect(std::vector<param_ref<T>>& out) { body.collect(out); }
  /// Appends its batch norms' running statistics (bn1, bn2, then the projection's), for checkpoints.
  void collect_buffers(std::vector<param_ref<T>>& out) const { body.collect_buffers(out); }

 private:
  static main_type make_main(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels,
                             std::size_t stride, rng_key key, std::span<const std::size_t> local_devices) {
    conv2d<T, Mesh> c1(mesh, name + ".conv1", in, out_channels, 3, key, {.stride = stride, .padding = 1, .use_bias = false},
                       local_devices);
    const image_shape mid = c1.output_shape();
    conv2d<T, Mesh> c2(mesh, name + ".conv2", mid, out_channels, 3, key, {.stride = 1, .padding = 1, .use_bias = false},
                       local_devices);
    return main_type(std::move(c1), batch_norm<T, Mesh, Data>(mesh, name + ".bn1", mid, T(0.1), T(1e-5), local_devices),
                     relu<T>(mesh), std::move(c2),
                     batch_norm<T, Mesh, Data>(mesh, name + ".bn2", mid, T(0.1), T(1e-5), local_devices));
  }

  relu<T> act_;
  std::string name_;
  image_shape in_, out_;
};

}  // namespace meshlib::nn
// end meshlib/nn/layers/basic_block.hpp
// begin meshlib/nn/loss.hpp
/// @file
/// @brief `softmax_cross_entropy`: the mean over the *global* batch of `-log softmax(logits)[label]`,
/// with its gradient, for logits whose rows (the batch) are sharded over the data axis and whose
/// columns (the classes) may be sharded over a model axis. Sharded classes are never gathered: the
/// row maximum is a `pmax`, the normaliser and the target logit are `psum`s of one number per row
/// over the axes that shard the classes (read from the logits' type), as Megatron's vocab-parallel
/// cross-entropy does.
///
/// Each device's `loss` is its rows' share of the mean (a pending sum over the data axis); the
/// gradient `(softmax - onehot) / global_batch` has the logits' type. The row passes are Kokkos
/// kernels on the running device's instance, one work item per row (each row's sums in column
/// order, and the loss added over the rows in row order, as a plain loop: the same bits on every mesh).
/// @code
/// meshlib::nn::softmax_cross_entropy<float> ce(mesh.size());
/// // inside spmd, logits (B/4, 10) varying over data:
/// auto r = ce.forward(logits, my_labels, 256);   // r.loss: this device's share; r.correct: argmax hits
/// auto dlogits = ce.backward(logits);
/// // or as a loss_function (what train_step calls): the gradient into a buffer of the caller's
/// loss_part r2 = ce(logits, my_labels, 256, dlogits_buffer);
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

// begin meshlib/nn/axis_mask_group.hpp
/// @file
/// @brief The public typed collectives over a compile-time *mask* of mesh axes. The training layer
/// reads its axes from types as masks (`State::data_axes`, the axes that shard a dimension of the
/// logits, every axis of the mesh), while `psum<Names...>` and friends take names: `group_of_t`
/// turns a mask into the `axis_group` of its names in mesh order, and `psum_over<Mask>(x)` /
/// `pmax_over<Mask>(x)` call the public collective with those names, so nn goes through the same
/// path as a user's `shard_map` (the donated forms: a value over nn's own buffer is reduced in it).

#include <cstddef>
#include <type_traits>
#include <utility>


namespace meshlib::nn::detail {

template <axis_mask Mask, std::size_t I, class Acc, class... Axes>
struct select_axes {
  using type = Acc;
};
// Over the group's `append`, not a specialisation on axis_group<Names...>, which nvcc does not match.
template <axis_mask Mask, std::size_t I, class Acc, class A, class... Rest>
struct select_axes<Mask, I, Acc, A, Rest...>
    : select_axes<Mask, I + 1, std::conditional_t<((Mask >> I) & 1) != 0, typename Acc::template append<A::name>, Acc>,
                  Rest...> {};

template <class Mesh, axis_mask Mask>
struct group_of;
template <mesh_axis... Axes, axis_mask Mask>
struct group_of<mesh<Axes...>, Mask> {
  static_assert(Mask != 0, "meshlib::nn: a collective over no axis (the caller skips it)");
  // An empty axis_group<> cannot be named, so the first selected axis seeds the list.
  template <std::size_t I, class... Rest>
  struct first;
  template <std::size_t I, class A, class... Rest>
  struct first<I, A, Rest...> {
    using type = std::conditional_t<((Mask >> I) & 1) != 0,
                                    typename select_axes<Mask, I + 1, axis_group<A::name>, Rest...>::type,
                                    typename first<I + 1, Rest...>::type>;
  };
  template <std::size_t I>
  struct first<I> {
    using type = void;
  };
  using type = typename first<0, Axes...>::type;
};

/// The `axis_group` of the axes of `Mask` of `Mesh`, in mesh order.
template <class Mesh, axis_mask Mask>
using group_of_t = typename group_of<Mesh, Mask>::type;

/// The reductions over the axes `Names...` (and the group's communicator made ahead), reached through `axis_group::apply` (nvcc deduces no
/// `axis_group<Names...>` function argument: collectives/axis_group.hpp).
template <fixed_string... Names>
struct reductions_over_names {
  template <class L>
  static auto sum(L&& x) {
    return meshlib::psum<Names...>(std::forward<L>(x));
  }
  template <class L>
  static auto sum_start(L&& x) {
    return meshlib::psum_start<Names...>(std::forward<L>(x));
  }
  template <class L>
  static auto max(L&& x) {
    return meshlib::pmax<Names...>(std::forward<L>(x));
  }
  static void prepare() { meshlib::prepare_group<Names...>(); }
};

/// The reductions over the axes of `Mask` of the mesh of `L`.
template <axis_mask Mask, class L>
using reductions_over_t =
    typename group_of_t<typename std::remove_cvref_t<L>::mesh_type, Mask>::template apply<reductions_over_names>;

/// `prepare_group<names of Mask...>()`: makes the group's communicator now.
template <mesh_type Mesh, axis_mask Mask>
void prepare_group_over() {
  group_of_t<Mesh, Mask>::template apply<reductions_over_names>::prepare();
}
/// `psum<names of Mask...>(x)` (an rvalue `x` is donated).
template <axis_mask Mask, local_tensor_type L>
auto psum_over(L&& x) {
  return reductions_over_t<Mask, L>::sum(std::forward<L>(x));
}
/// `psum_start<names of Mask...>(x)` (an rvalue `x` is donated): the asynchronous `psum_over`.
template <axis_mask Mask, local_tensor_type L>
auto psum_start_over(L&& x) {
  return reductions_over_t<Mask, L>::sum_start(std::forward<L>(x));
}
/// `pmax<names of Mask...>(x)` (an rvalue `x` is donated).
template <axis_mask Mask, local_tensor_type L>
auto pmax_over(L&& x) {
  return reductions_over_t<Mask, L>::max(std::forward<L>(x));
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/axis_mask_group.hpp

namespace meshlib::nn {

/// @brief Softmax cross-entropy on (possibly class-sharded) logits (see the file comment).
template <class T>
class softmax_cross_entropy {
 public:
  /// Targets are class labels, one per row (a `loss_function`).
  using target_type = std::int32_t;

  /// Holds per-device scratch for `devices` devices.
  explicit softmax_cross_entropy(std::size_t devices)
      : grad_(devices), terms_(devices), labels_(devices), rows_(devices) {}
  /// Holds per-device scratch for every device of `mesh`.
  template <mesh_type Mesh>
  explicit softmax_cross_entropy(const Mesh& mesh) : softmax_cross_entropy(mesh.size()) {}

  /// Loss of this device's rows; `labels[i]` is the class of local row `i`; `global_batch` the
  /// number of rows over all data devices (the mean's denominator). Keeps the gradient for `backward`.
  /// @throws std::out_of_range when a label is not a class index.
  template <local_tensor_type Z>
  loss_part forward(const Z& logits, std::span<const std::int32_t> labels, std::size_t global_batch) {
    static_cast<void>(require_kernel_can_read<"softmax_cross_entropy.forward", "logits", Z>());
    T* buf = grad_.get(logits.device(), logits.size() + 3 * logits.extent(0));
    const loss_part out = compute(logits, labels, global_batch, buf, buf + logits.size());
    rows_[logits.device()] = logits.extent(0);
    return out;
  }

  /// The `loss_function` call `train_step` makes: `forward`'s loss, with the gradient of the mean
  /// loss written into `grad` (the logits' shape) instead of this object's buffer.
  /// @throws std::out_of_range when a label is not a class index; sharding_error when `grad`'s
  /// shape is not the logits'.
  template <local_tensor_type Z>
  loss_part operator()(const Z& logits, std::span<const std::int32_t> labels, std::size_t global_batch, Z& grad) {
    static_cast<void>(require_kernel_can_read<"softmax_cross_entropy", "logits", Z>());
    if (grad.extent(0) != logits.extent(0) || grad.extent(1) != logits.extent(1))
      throw sharding_error("meshlib::nn: softmax_cross_entropy: the gradient buffer's block is (" +
                           std::to_string(grad.extent(0)) + ", " + std::to_string(grad.extent(1)) +
                           ") but the logits' is (" + std::to_string(logits.extent(0)) + ", " +
                           std::to_string(logits.extent(1)) + "); pass a buffer of the logits' shape");
    return compute(logits, labels, global_batch, grad.data(), grad_.get(logits.device(), 3 * logits.extent(0)));
  }

  /// The gradient of the mean loss with respect to `logits` (the tensor given to `forward`).
  template <local_tensor_type Z>
  Z backward(const Z& logits) {
    const std::size_t dev = logits.device();
    T* g = grad_.get(dev, logits.size() + 3 * logits.extent(0));
    return Z(typename Z::view_type(g, logits.extent(0), logits.extent(1)), logits.mesh(), dev);
  }

  /// The loss of `forward`, the gradient written to `g` (the logits' size), with `3 * rows`
  /// elements of scratch at `scratch`. Public only because nvcc refuses an extended device lambda
  /// in a private member function; call `forward` or `forward_backward`.
  template <local_tensor_type Z>
  loss_part compute(const Z& logits, std::span<const std::int32_t> labels, std::size_t global_batch, T* g,
                    T* scratch) {
    static_assert(Z::rank == 2 && Z::partial == 0,
                  "meshlib::nn: softmax_cross_entropy needs complete rank-2 logits (psum a pending sum first)");
    constexpr axis_mask class_axes = Z::dims_type::at(1);
    const std::size_t dev = logits.device(), rows = logits.extent(0), cols = logits.extent(1);
    if (labels.size() != rows)
      throw sharding_error("meshlib::nn: softmax_cross_entropy: " + std::to_string(labels.size()) + " labels for " +
                           std::to_string(rows) + " rows of logits on device " + std::to_string(dev));
    const std::size_t col0 = detail::global_offset(logits, 1);
    const std::size_t classes = cols * logits.mesh().axes_size(class_axes);
    T* mx = scratch;  // per row: max, then normaliser, then target logit
    T* sum = mx + rows;
    T* tgt = sum + rows;
    const T* z = logits.data();
    // The labels are the caller's host data: checked here, before any kernel reads them.
    for (std::size_t i = 0; i < rows; ++i)
      if (labels[i] < 0 || static_cast<std::size_t>(labels[i]) >= classes)
        throw std::out_of_range("meshlib::nn: softmax_cross_entropy: label " + std::to_string(labels[i]) + " of row " +
                                std::to_string(i) + " on device " + std::to_string(dev) + " is not in [0, " +
                                std::to_string(classes) + ")");
    const std::int32_t* lab = labels_.readable(dev, labels.data(), rows);  // copied across for device memory
    // Every class here: one kernel per row does the three passes (no maximum or normaliser to share).
    if constexpr (class_axes == 0)
      return detail::softmax_cross_entropy_rows<space>(z, rows, cols, lab, global_batch, g, mx, sum, tgt,
                                                       terms_.get(dev, rows + 2));
    detail::row_max<space>(z, rows, cols, mx);
    if constexpr (class_axes != 0)
      (void)detail::pmax_over<class_axes>(detail::wrap1<row_values<Z>>(mx, rows, logits.mesh(), dev));
    detail::exp_and_target<space>(z, rows, cols, col0, lab, mx, g, sum, tgt);
    if constexpr (class_axes != 0)  // normaliser and target
      (void)detail::psum_over<class_axes>(detail::wrap1<row_values<Z>>(sum, 2 * rows, logits.mesh(), dev));
    // per row: its loss / global batch; then the two totals the host reads back
    return detail::cross_entropy_terms<space>(rows, cols, col0, lab, mx, sum, tgt, global_batch, g,
                                              terms_.get(dev, rows + 2));
  }

 private:
  /// One number per row (or two rows' worth) as the collectives see it: it differs over the axes
  /// the logits vary over; the donated `pmax` / `psum` reduce it in the loss's own buffer.
  template <class Z>
  using row_values = local_tensor<T, 1, typename Z::mesh_type, Z::vary, 0, replicated_dims<1>, typename Z::memory_space>;
  // The kernels' memory: the loss's scratch buffers (the labels copied across, the totals read back).
  using space = default_memory_space;
  detail::device_buffers<T> grad_;
  detail::device_buffers<double> terms_;
  detail::device_buffers<std::int32_t> labels_;  // the labels in device memory (unused on the host)
  std::vector<std::size_t> rows_;
};

}  // namespace meshlib::nn
// end meshlib/nn/loss.hpp
// begin meshlib/nn/mean_squared_error.hpp
/// @file
/// @brief `mean_squared_error`: the regression loss, a `loss_function` for `train_step`.
/// For a model output `z` of global shape `(B, F)` (B rows of the global batch, F features) and
/// targets `t` of the same shape:
///
///     loss = 1/(B F) * sum_{i < B, j < F} (z_ij - t_ij)^2        dloss/dz_ij = 2 (z_ij - t_ij) / (B F)
///
/// the mean over batch *and* features, without a factor 1/2: `jnp.mean(optax.squared_error(z, t))`
/// and PyTorch's `F.mse_loss(z, t)` (reduction "mean"); `optax.l2_loss` is half of it.
///
/// Sharding: the rows are this device's rows of the batch (sharded over the data axis), and the
/// columns may be a block of the features sharded over a model axis (read from the output's type);
/// the targets are every row's complete `F` values (replicated over the model axis, as the input
/// batch is), and each device reads its block's columns. The gradient needs no communication; the
/// loss's partial sum over a device's columns is completed with one `psum` of one number over the
/// axes that shard the columns, so every device returns its rows' share of the global mean, which
/// `train_step` adds over the data axis.
///
/// The gradient pass is a Kokkos kernel on the running device's instance, one work item per row;
/// the squared differences are added (in double) by one work item in row-major order, as the
/// cross-entropy adds its rows: the same chain of additions on every backend.
/// @code
/// // targets: rows x 4 floats, row-major, for a model whose last layer has 4 outputs
/// auto m = meshlib::nn::train_step(state, x, std::span<const float>(targets), rows, 0, rows,
///                                  meshlib::nn::mean_squared_error{});
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>


namespace meshlib::nn {

/// @brief Mean squared error over batch and features (see the file comment). Stateless.
template <class T = float>
struct mean_squared_error {
  /// Targets are one value per output column, row-major.
  using target_type = T;

  /// This device's rows' share of the mean (complete over the axes that shard the columns), and
  /// `grad = dloss/doutput` of this device's block. `targets`: this device's rows, `F` values each.
  /// @throws sharding_error when the targets are not `F` values per row (naming both shapes), or
  /// `grad` is not of the output's shape.
  template <local_tensor_type Z>
  loss_part operator()(const Z& output, std::span<const T> targets, std::size_t global_batch, Z& grad) const {
    static_assert(Z::rank == 2 && Z::partial == 0,
                  "meshlib::nn: mean_squared_error needs a complete rank-2 model output (psum a pending sum first)");
    static_assert(std::is_same_v<typename Z::value_type, T>,
                  "meshlib::nn: mean_squared_error<T>: T must be the model output's element type");
    constexpr axis_mask col_axes = Z::dims_type::at(1);
    const std::size_t rows = output.extent(0), cols = output.extent(1), width = output.global_extent(1);
    if (targets.size() != rows * width) throw sharding_error(shape_message(targets.size(), rows, width, global_batch));
    if (grad.extent(0) != rows || grad.extent(1) != cols)
      throw sharding_error("meshlib::nn: mean_squared_error: the gradient buffer's block is (" +
                           std::to_string(grad.extent(0)) + ", " + std::to_string(grad.extent(1)) +
                           ") but the output's is (" + std::to_string(rows) + ", " + std::to_string(cols) +
                           "); pass a buffer of the output's shape");
    const std::size_t col0 = detail::global_offset(output, 1);
    const double scale = 1.0 / (static_cast<double>(global_batch) * static_cast<double>(width));
    const T two_scale = static_cast<T>(2.0 * scale);
    const T* z = output.data();
    // Kernels read the targets and write the sum in the kernels' memory: the caller's host targets
    // and a local on the host; on a device, a copy of the targets and one element after them (an
    // allocation per call: this stateless loss keeps no per-device buffers).
    double local_sum = 0;
    const T* t = targets.data() + col0;  // row i's block of columns starts at t[i * width]
    double* res = &local_sum;
    [[maybe_unused]] meshlib::block_view<T, 1, space> staged;
    [[maybe_unused]] meshlib::block_view<double, 1, space> staged_sum;
    if constexpr (!meshlib::host_accessible_v<space>) {
      staged = meshlib::allocate<T, 1, space>({targets.size()}, "meshlib::nn::mean_squared_error", false);
      staged_sum = meshlib::allocate<double, 1, space>({1}, "meshlib::nn::mean_squared_error", false);
      meshlib::copy_from_host<space>(staged.data(), targets.data(), targets.size());
      t = staged.data() + col0;
      res = staged_sum.data();
    }
    detail::squared_error<space>(z, t, rows, cols, width, two_scale, scale, grad.data(), res);
    if constexpr (col_axes != 0) {  // the other column blocks' sums: one number over the axes that shard them
      using share_t = local_tensor<double, 1, typename Z::mesh_type, Z::vary, 0, replicated_dims<1>, space>;
      (void)detail::psum_over<col_axes>(detail::wrap1<share_t>(res, 1, output.mesh(), output.device()));
    }
    return loss_part{meshlib::read_back<space>(res), 0};
  }

 private:
  using space = default_memory_space;

  static std::string shape_message(std::size_t values, std::size_t rows, std::size_t width, std::size_t batch) {
    const std::string b = std::to_string(batch), w = std::to_string(width);
    const std::string given = rows != 0 && values % rows == 0
                                  ? "the targets have shape (" + b + ", " + std::to_string(values / rows) + ")"
                                  : "the targets hold " + std::to_string(values) + " values for " +
                                        std::to_string(rows) + " rows";
    return "meshlib::nn: mean_squared_error: " + given + " but the model output has shape (" + b + ", " + w +
           "); give one target per output column (" + b + " x " + w +
           " values, row-major) or a model with as many outputs as target columns; class labels need "
           "softmax_cross_entropy";
  }
};

}  // namespace meshlib::nn
// end meshlib/nn/mean_squared_error.hpp
// begin meshlib/nn/check_gradients.hpp
/// @file
/// @brief `check_gradients`: a hand-written backward pass checked against central finite
/// differences of the loss (`torch.autograd.gradcheck`, `jax.test_util.check_grads`), for a user's
/// own layer, loss or model, on one device or on a sharded mesh.
///
/// The loss is a function the checker runs on every device inside `spmd`: `loss(device, backward)`
/// returns the whole scalar loss (the same number on every device: psum the devices' shares), and
/// when `backward` is true it also runs the backward pass, which adds the gradients into the
/// parameters' gradient blocks (the checker zeroes them first). Every element `g` of every
/// parameter is then moved by `+eps` and `-eps` on every device that holds it, and
/// `(loss(+) - loss(-)) / (2 eps)` is compared with the gradient that *each* device holds for `g`
/// (block by block, so one wrong replica or one wrong shard is found), as `torch.allclose` does:
/// `|analytic - numeric| <= atol + rtol * |numeric|`.
///
/// A gradient that the backward leaves as a pending sum over an axis (each device of the data axis
/// holds its rows' share until the data-parallel synchronisation adds them) is compared after that
/// sum: name such axes in `reduce_axes` (JAX's old `grad(..., reduce_axes=)` meant the same).
///
/// Costs two loss evaluations per parameter element: meant for small layers and small shapes, in
/// double (float works with looser defaults; central differences in float lose about half its digits).
/// @code
/// // `layer`: a struct of one's own with forward, backward(dy, need_dx) and collect, in double;
/// // `x`: a sharded_tensor whose rows are split over "data"
/// auto r = meshlib::nn::check_gradients(m, layer, [&](std::size_t dev, bool backward) {
///   auto y = layer.forward(x.local_value(dev));
///   double part = 0;                                    // this device's rows' share of sum(y^2) / 2
///   for (double v : meshlib::to_host(y)) part += v * v / 2;
///   if (backward) layer.backward(y, false);             // the cotangent of sum(y^2) / 2 is y
///   meshlib::local_tensor<double, 0, mesh_t, mesh_t::mask_of<"data">()> share(std::array<std::size_t, 0>{}, m, dev);
///   share() = part;
///   return meshlib::psum<"data">(share)();              // the whole loss, on every device
/// }, {.reduce_axes = {"data"}});                         // weight gradients: shares over "data"
/// // throws nn::gradient_check_error naming the parameter, the element and both values when one is wrong
/// @endcode

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief A gradient that does not match central differences (`check_gradients` with
/// `raise_exception`): `what()` names the parameter, the element, the device, both values and the
/// tolerance.
class gradient_check_error : public error {
 public:
  using error::error;
};

/// @brief How `check_gradients` differentiates and compares; the defaults depend on the parameters'
/// element type `T` (`torch.autograd.gradcheck`'s for double; looser for float, whose central
/// differences keep about half its digits).
template <class T = double>
struct gradient_check_options {
  /// The central-difference step, added to and subtracted from one element at a time (> 0).
  double eps = std::is_same_v<T, float> ? 1e-3 : 1e-6;
  /// Absolute tolerance (>= 0): an element passes when `|analytic - numeric| <= atol + rtol * |numeric|`.
  double atol = std::is_same_v<T, float> ? 1e-3 : 1e-5;
  /// Relative tolerance (>= 0), see `atol`.
  double rtol = std::is_same_v<T, float> ? 1e-2 : 1e-3;
  /// Mesh axes over which the backward leaves each device a share of a gradient (a pending sum:
  /// the data axis, whose sum the data-parallel synchronisation of `train_step` does). Gradients are
  /// summed over these axes (where a parameter is not sharded over them) before the comparison.
  std::vector<std::string> reduce_axes = {};
  /// Throw `gradient_check_error` for the worst element out of tolerance (true, as torch's
  /// `raise_exception`); false: only report it in the result.
  bool raise_exception = true;
};

/// @brief What `check_gradients` found. The worst element is the one furthest outside its
/// tolerance (`|a - n| / (atol + rtol |n|)` largest), or, when all pass, closest to it.
struct gradient_check_result {
  /// Every element of every parameter within tolerance.
  bool passed = true;
  /// Largest `|analytic - numeric|` over every element and device.
  double max_abs_error = 0;
  /// Largest `|analytic - numeric| / max(|analytic|, |numeric|)` (0 where both are 0).
  double max_rel_error = 0;
  /// Elements out of tolerance (counted once per device that holds a wrong gradient).
  std::size_t failures = 0;
  /// Global elements checked, over every parameter.
  std::size_t elements = 0;
  /// The worst element's parameter name.
  std::string worst_parameter;
  /// The worst element's index in the global array, per dimension.
  std::vector<std::size_t> worst_index;
  /// The device whose gradient block held the worst element.
  std::size_t worst_device = 0;
  /// The worst element's gradient from the backward pass (summed over `reduce_axes`).
  double worst_analytic = 0;
  /// The worst element's central difference.
  double worst_numeric = 0;
};

namespace detail {

/// The element type of the parameters `model.collect` appends: double where it takes
/// `param_ref<double>`, else float.
template <class Model>
using collected_type_t =
    std::conditional_t<requires(Model& m, std::vector<param_ref<double>>& v) { m.collect(v); }, double, float>;

/// The options checked, and `reduce_axes` as a mask of `mesh`'s axes.
template <class T, mesh_type Mesh>
axis_mask checked_reduce_axes(const Mesh& mesh, const gradient_check_options<T>& o) {
  const std::string defaults = std::string(" (the defaults for ") + (std::is_same_v<T, float> ? "float" : "double") +
                               ": eps " + number_text(gradient_check_options<T>{}.eps) + ", atol " +
                               number_text(gradient_check_options<T>{}.atol) + ", rtol " +
                               number_text(gradient_check_options<T>{}.rtol) + ")";
  if (!(o.eps > 0) || !std::isfinite(o.eps))
    throw std::invalid_argument("meshlib::nn: check_gradients: eps is " + number_text(o.eps) +
                                "; the central-difference step must be positive and finite" + defaults);
  // A lambda called per tolerance, not a loop over a braced list of pairs: nvcc's front end (13.0)
  // does not parse `for (auto [n, v] : {std::pair<...>{...}, {...}})`.
  const auto check_tolerance = [&](const char* name, double v) {
    if (!(v >= 0) || !std::isfinite(v))
      throw std::invalid_argument("meshlib::nn: check_gradients: " + std::string(name) + " is " + number_text(v) +
                                  "; tolerances must be non-negative and finite" + defaults);
  };
  check_tolerance("atol", static_cast<double>(o.atol));
  check_tolerance("rtol", static_cast<double>(o.rtol));
  axis_mask mask = 0;
  for (const std::string& name : o.reduce_axes) {
    const std::size_t at = Mesh::find_axis(name);
    if (at == Mesh::ndim) {
      std::ostringstream os;
      os << mesh;
      throw std::invalid_argument("meshlib::nn: check_gradients: reduce_axes names '" + name + "', which " + os.str() +
                                  " does not have; name axes of the mesh (the data axis, whose gradient shares "
                                  "the data-parallel synchronisation adds)");
    }
    mask |= axis_mask{1} << at;
  }
  return mask;
}

/// The loss on every device, checked to be one number (what the finite difference differentiates).
template <mesh_type Mesh, class Loss>
double loss_on_every_device(const Mesh& mesh, Loss& loss, bool backward) {
  const auto values = meshlib::spmd(mesh, [&](std::size_t dev) {
    return std::optional<double>(static_cast<double>(loss(dev, backward)));
  });
  std::optional<std::size_t> first;
  for (std::size_t dev = 0; dev < values.size(); ++dev) {
    if (!values[dev]) continue;  // another process's device
    if (!first) {
      first = dev;
    } else if (!(*values[dev] == *values[*first]) && !(std::isnan(*values[dev]) && std::isnan(*values[*first]))) {
      throw std::invalid_argument("meshlib::nn: check_gradients: the loss is " + number_text(*values[*first]) +
                                  " on device " + std::to_string(*first) + " but " + number_text(*values[dev]) +
                                  " on device " + std::to_string(dev) +
                                  "; the loss function must return the whole loss on every device (psum the "
                                  "devices' shares over every axis they differ on)");
    }
  }
  return first ? *values[*first] : 0.0;
}

/// `[i, j]`: a global index as the messages print it.
inline std::string index_text(const std::vector<std::size_t>& index) {
  std::string s = "[";
  for (std::size_t d = 0; d < index.size(); ++d) s += (d ? ", " : "") + std::to_string(index[d]);
  return s + "]";
}

/// The global multi-index of row-major flat index `flat` in `shape`.
inline std::vector<std::size_t> unflatten(std::size_t flat, const std::vector<std::size_t>& shape) {
  std::vector<std::size_t> index(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

}  // namespace detail

/// @brief Checks the gradients that `loss`'s backward pass leaves in `params` against central
/// differences of `loss` (see the file comment).
/// @param mesh the mesh `loss` runs on (inside `spmd`, one call per device).
/// @param params the parameters to check (`layer.collect(params)`; an input whose gradient is to
/// be checked can be an `nn::parameter` too, its cotangent added into its `grad` by the loss).
/// @param loss `loss(device, backward) -> double` (or `T`): the whole loss, the same on every
/// device; when `backward`, also adds d loss / d parameter into the gradient blocks.
/// @param options step, tolerances, reduced axes, whether to throw (see `gradient_check_options`).
/// @returns the largest errors and the worst element (see `gradient_check_result`).
/// @throws gradient_check_error when an element is out of tolerance and `options.raise_exception`.
/// @throws std::invalid_argument for bad options, no parameters, a parameter without a gradient,
/// a loss that is not the same number on every device or not finite at `params`.
template <class T, mesh_type Mesh, class Loss>
  requires std::floating_point<T> && std::invocable<Loss&, std::size_t, bool>
gradient_check_result check_gradients(const Mesh& mesh, const std::vector<param_ref<T>>& params, Loss&& loss,
                                      const gradient_check_options<T>& options = {}) {
  const axis_mask reduce = detail::checked_reduce_axes(mesh, options);
  if (params.empty())
    throw std::invalid_argument("meshlib::nn: check_gradients: no parameters to check; pass the parameters the "
                                "loss depends on (layer.collect(params))");
  for (const auto& p : params)
    for (std::size_t dev = 0; dev < mesh.size(); ++dev)
      if (p.count[dev] > 0 && (p.grad.size() <= dev || p.grad[dev] == nullptr))
        throw std::invalid_argument("meshlib::nn: check_gradients: '" + p.name +
                                    "' has no gradient (a buffer, not a trained parameter); leave it out of the "
                                    "parameters to check");

  // The analytic gradients: zeroed, one backward, read back per device (host copies: the blocks
  // may be device memory). The loss evaluations below leave them alone.
  using space = default_memory_space;
  const auto block_of = [](const detail::device_blocks<T>& b, std::size_t dev, std::size_t n) {
    std::vector<T> host(n);
    meshlib::copy_to_host<space>(host.data(), b[dev], n);
    return host;
  };
  for (const auto& p : params)
    for (std::size_t dev = 0; dev < mesh.size(); ++dev)
      if (p.count[dev] > 0) {
        const std::vector<T> zero(p.count[dev], T{0});
        meshlib::copy_from_host<space>(p.grad[dev], zero.data(), zero.size());
      }
  const double at = detail::loss_on_every_device(mesh, loss, true);
  if (!std::isfinite(at))
    throw std::invalid_argument("meshlib::nn: check_gradients: the loss is " + detail::number_text(at) +
                                " at the given parameters; check gradients where the loss is finite");

  gradient_check_result result;
  double worst_ratio = -1;
  for (const auto& p : params) {
    // Per device, the gradient after the sum over the reduced axes that do not split `p` (devices
    // of such a group hold the same block).
    const axis_mask summed = reduce & ~p.sharded_axes;
    std::vector<std::vector<T>> grads(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev)
      if (p.count[dev] > 0) grads[dev] = block_of(p.grad, dev, p.count[dev]);
    std::vector<std::vector<double>> analytic(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev) {
      if (p.count[dev] == 0) continue;
      analytic[dev].assign(p.count[dev], 0.0);
      for (std::size_t peer : mesh.group(dev, summed)) {
        if (grads[peer].size() != p.count[dev])
          throw std::invalid_argument("meshlib::nn: check_gradients: '" + p.name + "' is summed over reduce_axes, "
                                      "but device " + std::to_string(peer) + " of device " + std::to_string(dev) +
                                      "'s group is in another process; psum the gradient in the loss function and "
                                      "leave its axes out of reduce_axes");
        for (std::size_t i = 0; i < p.count[dev]; ++i) analytic[dev][i] += static_cast<double>(grads[peer][i]);
      }
    }
    // Where each global element lies: (device, index in its block) for every local device holding it.
    std::size_t total = 1;
    for (std::size_t e : p.shape) total *= e;
    std::vector<std::vector<std::pair<std::size_t, std::size_t>>> holders(total);
    std::vector<std::vector<T>> values(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev) {
      if (p.count[dev] == 0) continue;
      values[dev] = block_of(p.value, dev, p.count[dev]);
      for (std::size_t i = 0; i < p.count[dev]; ++i) holders[detail::global_index(p, dev, i)].emplace_back(dev, i);
    }
    const auto set_everywhere = [&](std::size_t g, T v) {
      for (auto [dev, i] : holders[g]) meshlib::copy_from_host<space>(p.value[dev] + i, &v, 1);
    };
    for (std::size_t g = 0; g < total; ++g) {
      ++result.elements;
      if (holders[g].empty()) {
        // Held by another process only: its evaluations are still made here, since every process
        // must make the same sequence of collective calls (the loss's psum) or they would hang.
        static_cast<void>(detail::loss_on_every_device(mesh, loss, false));
        static_cast<void>(detail::loss_on_every_device(mesh, loss, false));
        continue;
      }
      const auto [dev0, i0] = holders[g].front();
      const T original = values[dev0][i0];
      // The step actually taken: x + eps and x - eps rounded to T (in float, not 2 eps).
      const T up = static_cast<T>(static_cast<double>(original) + options.eps);
      const T down = static_cast<T>(static_cast<double>(original) - options.eps);
      if (!(up > down))
        throw std::invalid_argument("meshlib::nn: check_gradients: eps " + detail::number_text(options.eps) +
                                    " does not move '" + p.name + "' at " +
                                    detail::index_text(detail::unflatten(g, p.shape)) + " (" +
                                    detail::number_text(original) + " in " +
                                    (std::is_same_v<T, float> ? "float" : "double") + "); take a larger eps");
      set_everywhere(g, up);
      const double loss_up = detail::loss_on_every_device(mesh, loss, false);
      set_everywhere(g, down);
      const double loss_down = detail::loss_on_every_device(mesh, loss, false);
      // Each copy back to its own value, exactly: no drift from adding and subtracting steps.
      for (auto [dev, i] : holders[g]) meshlib::copy_from_host<space>(p.value[dev] + i, &values[dev][i], 1);
      const double numeric = (loss_up - loss_down) / (static_cast<double>(up) - static_cast<double>(down));
      for (auto [dev, i] : holders[g]) {
        const double a = analytic[dev][i];
        const double err = std::abs(a - numeric), tol = options.atol + options.rtol * std::abs(numeric);
        const bool ok = err <= tol;  // false for NaN
        const double scale = std::max(std::abs(a), std::abs(numeric));
        // How far outside (or inside) its tolerance; a NaN or an error over a zero tolerance is infinitely far.
        double ratio = tol > 0 ? err / tol : 0.0;
        if (!ok && !(tol > 0 && std::isfinite(err))) ratio = std::numeric_limits<double>::infinity();
        if (!ok) {
          result.passed = false;
          ++result.failures;
        }
        // NaN, once met, stays: a NaN gradient must not read as a small error.
        if (std::isnan(err) || err > result.max_abs_error) result.max_abs_error = err;
        const double rel = scale > 0 ? err / scale : 0.0;
        if (std::isnan(rel) || rel > result.max_rel_error) result.max_rel_error = rel;
        if (ratio > worst_ratio) {
          worst_ratio = ratio;
          result.worst_parameter = p.name;
          result.worst_index = detail::unflatten(g, p.shape);
          result.worst_device = dev;
          result.worst_analytic = a;
          result.worst_numeric = numeric;
        }
      }
    }
  }
  if (!result.passed && options.raise_exception) {
    const auto worst = std::find_if(params.begin(), params.end(), [&](const auto& p) { return p.name == result.worst_parameter; });
    // A replicated parameter whose axis is not summed: the likely cause on a mesh is a data axis
    // missing from reduce_axes, not the backward.
    std::string hint;
    for (std::size_t i = 0; i < Mesh::ndim; ++i) {
      const axis_mask bit = axis_mask{1} << i;
      if (mesh.axis_size(i) > 1 && !(worst->sharded_axes & bit) && !(reduce & bit))
        hint += std::string(hint.empty() ? "" : ", ") + "'" + std::string(Mesh::axis_names[i]) + "'";
    }
    if (!hint.empty())
      hint = " (or, if each device of " + hint + " holds a share of the gradient, name it in reduce_axes)";
    using detail::number_text;
    throw gradient_check_error(
        "meshlib::nn: check_gradients: the gradient of '" + result.worst_parameter + "' at " +
        detail::index_text(result.worst_index) + " on device " + std::to_string(result.worst_device) + " is " +
        number_text(result.worst_analytic, 6) + " by the backward pass but " + number_text(result.worst_numeric, 6) +
        " by central differences (eps " + number_text(options.eps) + "): |difference| " +
        number_text(std::abs(result.worst_analytic - result.worst_numeric), 6) + " > atol " +
        number_text(options.atol) + " + rtol " + number_text(options.rtol) + " * |numeric|; " +
        std::to_string(result.failures) + " of " + std::to_string(result.elements) +
        " elements are out of tolerance; check the backward pass that writes '" + result.worst_parameter + "'" + hint);
  }
  return result;
}

/// @brief `check_gradients` of every parameter of `model` (a layer, `sequential`, or any type with
/// `collect(std::vector<param_ref<T>>&)`).
/// @returns / @throws as the overload taking the parameters.
template <mesh_type Mesh, class Model, class Loss, class T = detail::collected_type_t<Model>>
  requires requires(Model& m, std::vector<param_ref<T>>& v) { m.collect(v); } &&
           std::invocable<Loss&, std::size_t, bool>
gradient_check_result check_gradients(const Mesh& mesh, Model& model, Loss&& loss,
                                      const gradient_check_options<T>& options = {}) {
  std::vector<param_ref<T>> params;
  model.collect(params);
  return check_gradients(mesh, params, loss, options);
}

}  // namespace meshlib::nn
// end meshlib/nn/check_gradients.hpp
// begin meshlib/nn/remat.hpp
/// @file
/// @brief `remat`: activation recomputation (`jax.checkpoint` / `jax.remat`,
/// `torch.utils.checkpoint`). `remat(mesh, block)` is a layer that runs `block` forward and then
/// frees every buffer the block used except the one holding its output, so between forward and
/// backward it holds only its output (its input is the previous layer's output, which that layer
/// keeps anyway); its backward reruns the block's forward from the saved input to rebuild the
/// activations, runs the block's backward, and frees them again, keeping only the buffer that holds
/// the input's cotangent (until its next forward).
///
/// The result is the same bits as without remat: the rerun forward is the same kernels on the same
/// input, dropout draws the same mask (its key is set once per step by `begin_step`, and the mask
/// is a function of the key and the element's global index), and the running statistics of the
/// block's batch norms, which a training forward updates, are saved before the rerun and put back
/// after it, so they move once per step as without remat (torch.utils.checkpoint updates them twice).
///
/// What it costs: one more forward of the block per step, including the block's own collectives
/// (a tensor-parallel block's psums run again in backward, on every device alike). What it saves:
/// the block's internal buffers between forward and backward; `step_metrics::peak_activation_bytes`
/// measures it (the bytes of layer buffers live on a device during a step, nn/buffers.hpp).
///
/// A block is anything `sequential` takes (a layer, a `transformer_block`, a `basic_block`, a
/// `residual`, a nested `sequential`, another `remat`); something without `forward(x)` and
/// `backward(dy, need_dx)` is one compile error naming its type. The mesh is taken, as every layer
/// takes it, to size the per-device state at construction (device threads never resize it).
/// Elementwise rounding of mixed precision is applied by the enclosing `sequential` to the block's
/// output only, as for any layer.
/// @code
/// auto net = nn::sequential(tok, pos, nn::remat(m, nn::transformer_block<float, mesh_t>(m, "h0", 128, 4, 512, 64, key)),
///                           nn::remat(m, nn::transformer_block<float, mesh_t>(m, "h1", 128, 4, 512, 64, key)),
///                           nn::layer_norm<float, mesh_t>(m, "ln_f", 128), nn::tied_head<float, mesh_t>(tok));
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

namespace detail {
/// The one compile error of `remat`: the wrapped type is named in the condition.
template <bool Ok, class Wrapped, class Input>
struct remat_wraps_a_type_without_forward_and_backward {
  static_assert(Ok,
                "meshlib::nn: remat: the wrapped type has no forward(x) taking this input and backward(dy, need_dx) "
                "returning its cotangent; the condition spells out remat_wraps_a_type_without_forward_and_backward<"
                "ok, the wrapped type, the input>. Wrap a layer, a block (transformer_block, basic_block, residual) "
                "or a sequential: anything sequential accepts");
  static constexpr bool value = Ok;
};

/// Whether `L` runs forward on `X` and backward on its output's cotangent.
template <class L, class X>
consteval bool remat_can_wrap() {
  if constexpr (!std::is_class_v<L>) {
    return false;
  } else if constexpr (!requires(L& l, const X& x) { l.forward(x); }) {
    return false;
  } else {
    using Y = std::remove_cvref_t<decltype(std::declval<L&>().forward(std::declval<const X&>()))>;
    return requires(L& l, const Y& dy) { l.template backward<X>(dy, true); } ||
           requires(L& l, const Y& dy) { l.backward(dy, true); };
  }
}

/// A tensor of type `L` over `data` with the extents `e` (an unmanaged view of a layer's buffer).
template <local_tensor_type L, std::size_t... I>
L rewrap(const void* data, const std::array<std::size_t, 8>& e, const typename L::mesh_type& mesh,
         std::size_t dev, std::index_sequence<I...>) {
  using V = typename L::value_type;
  return L(typename L::view_type(const_cast<V*>(static_cast<const V*>(data)), e[I]...), mesh, dev);
}
}  // namespace detail

/// @brief Recomputes `Layer`'s activations in backward instead of keeping them (see the file comment).
template <class Layer>
class remat {
 public:
  /// The wrapped layer or block.
  Layer layer;

  /// Wraps `l`; `mesh` sizes the per-device state.
  template <mesh_type Mesh>
  remat(const Mesh& mesh, Layer l)
      : layer(std::move(l)), saved_(mesh.size()), scopes_(mesh.size()), stash_(mesh.size()) {}

  /// `"remat(h0 (transformer_block ...))"`: how messages name it.
  [[nodiscard]] std::string to_string() const {
    if constexpr (requires { layer.to_string(); }) return "remat(" + std::string(layer.to_string()) + ")";
    else if constexpr (requires { layer.name(); }) return "remat(" + std::string(layer.name()) + ")";
    else return "remat";
  }
  /// The wrapped layer's name, when it has one.
  [[nodiscard]] std::string name() const
    requires requires(const Layer& l) { l.name(); }
  {
    return std::string(layer.name());
  }
  /// The wrapped layer's input width.
  [[nodiscard]] std::size_t in_features() const
    requires detail::has_widths<Layer>
  {
    return layer.in_features();
  }
  /// The wrapped layer's output width.
  [[nodiscard]] std::size_t out_features() const
    requires detail::has_widths<Layer>
  {
    return layer.out_features();
  }
  /// As the wrapped layer.
  static constexpr bool keeps_features = detail::keeps_features<Layer>();
  /// What the wrapped layer accepts.
  template <class X>
  static constexpr bool accepts_input = detail::layer_accepts<Layer, X>();
  /// For compile-time messages: the wrapped layer's.
  using diagnostic_name = typename detail::layer_diagnostic_name<Layer>::type;
  /// @copydoc diagnostic_name
  using input_requirement = typename detail::layer_input_requirement<Layer>::type;

  /// Passes the step's key and mode on (dropout keeps the key, so the rerun draws the same mask).
  void begin_step(rng_key key, bool train) {
    if constexpr (requires { layer.begin_step(key, train); }) layer.begin_step(key, train);
  }

  /// The wrapped layer's forward; afterwards only the buffer holding the output is kept.
  template <local_tensor_type X>
  auto forward(const X& x) {
    constexpr bool ok = detail::remat_can_wrap<Layer, X>();
    static_assert(sizeof(detail::remat_wraps_a_type_without_forward_and_backward<ok, Layer, X>) > 0);  // one error, its own
    if constexpr (!ok) {
      return x;  // the one diagnostic above has fired
    } else {
      const std::size_t dev = x.device();
      auto& s = saved_[dev];
      s.input = x.data();
      for (std::size_t d = 0; d < X::rank; ++d) s.extents[d] = x.extent(d);
      s.ran = true;
      detail::release_scope& scope = scopes_[dev];
      scope.enter();
      auto y = layer.forward(x);
      scope.leave();
      scope.release_except(y.data());
      return y;
    }
  }

  /// Tells `sequential` to name the forward's input type: `backward<X>(dy, need_dx)`.
  static constexpr bool backward_names_input = true;

  /// Reruns the forward from the saved input, then the wrapped layer's backward; afterwards only the
  /// buffer holding the input's cotangent is kept. `X` is the forward's input type (a `sequential`
  /// names it; left out, it is `DY`'s, right for a block that returns its input's type).
  /// @throws sharding_error when no forward ran on this device.
  template <class X = void, local_tensor_type DY>
  auto backward(const DY& dy, bool need_dx = true) {
    using In = std::conditional_t<std::is_void_v<X>, DY, X>;
    if constexpr (!detail::remat_can_wrap<Layer, In>()) {
      return dy;  // forward's diagnostic has fired (or fires now)
    } else {
      return backward_impl<In>(dy, need_dx);
    }
  }

  /// The wrapped layer's parameters.
  template <class T>
  void collect(std::vector<param_ref<T>>& out) {
    if constexpr (requires { layer.collect(out); }) layer.collect(out);
  }
  /// The wrapped layer's buffers (running statistics).
  template <class T>
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    detail::collect_buffers_of(layer, out);
  }

 private:
  template <class In, class DY>
  auto backward_impl(const DY& dy, bool need_dx) {
    const std::size_t dev = dy.device();
    const auto& s = saved_[dev];
    if (!s.ran)
      throw sharding_error("meshlib::nn: " + to_string() + ": backward on device " + std::to_string(dev) +
                           " before any forward there; run forward first (backward reruns it from its saved input)");
    const In x = detail::rewrap<In>(s.input, s.extents, dy.mesh(), dev, std::make_index_sequence<In::rank>{});
    // The rerun must not move running statistics (batch norm) a second time: keep them and put them back.
    std::vector<param_ref<float>> buffers;
    detail::collect_buffers_of(layer, buffers);
    std::size_t total = 0;
    for (const auto& b : buffers) total += b.count[dev];
    float* stash = total > 0 ? stash_.get(dev, total) : nullptr;
    for (std::size_t i = 0, off = 0; i < buffers.size(); off += buffers[i].count[dev], ++i)
      detail::convert_copy<default_memory_space>(stash + off, buffers[i].value[dev], buffers[i].count[dev]);
    detail::release_scope& scope = scopes_[dev];
    scope.enter();
    (void)layer.forward(x);
    for (std::size_t i = 0, off = 0; i < buffers.size(); off += buffers[i].count[dev], ++i)
      detail::convert_copy<default_memory_space>(buffers[i].value[dev], stash + off, buffers[i].count[dev]);
    auto dx = detail::layer_backward<In>(layer, dy, need_dx);
    scope.leave();
    scope.release_except(dx.data());
    return dx;
  }

  struct saved {
    const void* input = nullptr;
    std::array<std::size_t, 8> extents{};
    bool ran = false;
  };
  std::vector<saved> saved_;                  // per device: the last forward's input
  std::vector<detail::release_scope> scopes_;  // per device: the buffers the wrapped layer used
  detail::device_buffers<float> stash_;        // per device: running statistics across the rerun
};

/// `remat(mesh, block)` deduces the block's type.
template <mesh_type Mesh, class Layer>
remat(const Mesh&, Layer) -> remat<Layer>;

}  // namespace meshlib::nn
// end meshlib/nn/remat.hpp
// begin meshlib/nn/collective_transpose.hpp
/// @file
/// @brief The backward (transpose) of every collective, written on the typed local tensors so the
/// compiler checks the backward pass's shardings as it checks the forward's. A cotangent has its
/// primal's type (JAX's `check_vma` convention: the cotangent of an invariant value is invariant),
/// except where noted.
///
/// | forward | backward of the cotangent `ct` |
/// | --- | --- |
/// | `psum<a>(x)` (varying -> invariant) | `pvary<a>(ct)`: no data moves |
/// | `pvary<a>(x)` (invariant -> varying) | `psum<a>(ct)` |
/// | `all_gather<a, d>(x)` | `psum_scatter<a, d>(ct)` when `ct` is a pending sum over `a` (each device's contribution); the device's own chunk of `ct` when `ct` is invariant over `a` |
/// | `psum_scatter<a, d>(x)` | `all_gather<a, d>(ct)` |
/// | `all_to_all<a, split, concat>(x)` | `all_to_all<a, concat, split>(ct)` |
/// | `ppermute<a>(x, perm)` | `ppermute<a>(ct, inverse(perm))` |
///
/// The laws `<f(x), y> = <x, f^T(y)>` are tested for each pair in tests/unit/nn/test_collective_transpose.cpp.
/// @code
/// auto y = meshlib::psum<"model">(x);                    // forward
/// auto dx = meshlib::nn::psum_transpose<"model">(dy);    // backward: pvary, the type of x
/// @endcode

#include <cstddef>
#include <utility>
#include <vector>


namespace meshlib::nn {

namespace detail {
/// `to[o * run + k] = from[o * stride + at + k]` for `o < outer`, `k < run`, on `Space`: one work
/// item per run. A named function: nvcc refuses an extended device lambda inside a function whose
/// return type is deduced.
template <class Space, class V>
void copy_runs(V* to, const V* from, std::size_t outer, std::size_t run, std::size_t stride, std::size_t at) {
  meshlib::launch<Space>(outer, KOKKOS_LAMBDA(std::size_t o) {
    for (std::size_t k = 0; k < run; ++k) to[o * run + k] = from[o * stride + at + k];
  });
}
}  // namespace detail

/// @brief Backward of `psum<Names...>`: `pvary<Names...>(ct)`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto psum_transpose(const L& ct) {
  return meshlib::pvary<Names...>(ct);
}

/// @brief Backward of `pvary<Names...>`: `psum<Names...>(ct)`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pvary_transpose(const L& ct) {
  return meshlib::psum<Names...>(ct);
}

/// @brief Backward of `all_gather<Axis, Dim>` (see the file comment for the two cotangent forms).
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto all_gather_transpose(const L& ct) {
  constexpr axis_mask bit = L::mesh_type::template mask_of<Axis>();
  if constexpr ((L::partial & bit) != 0) {
    return meshlib::psum_scatter<Axis, Dim>(ct);
  } else {
    // Invariant cotangent: the gathered value's derivative with respect to this device's chunk is
    // the chunk of ct at this device's position; the result varies over Axis, sharded on Dim.
    using R = decltype(meshlib::psum_scatter<Axis, Dim>(meshlib::pvary<Axis>(ct)));
    const std::size_t n = meshlib::axis_size<Axis>(), i = meshlib::axis_index<Axis>();
    auto shape = ct.shape();
    const std::size_t outer = [&] {
      std::size_t o = 1;
      for (std::size_t d = 0; d < Dim; ++d) o *= shape[d];
      return o;
    }();
    const std::size_t inner = ct.size() / (outer * shape[Dim]);
    const std::size_t chunk = shape[Dim] / n;
    shape[Dim] = chunk;
    auto out = meshlib::allocate<typename L::value_type, L::rank, typename L::memory_space>(shape, "meshlib::nn", false);
    // One work item per outer index: a contiguous run of chunk * inner elements.
    using V = typename L::value_type;
    V* to = out.data();
    const V* from = ct.data();
    const std::size_t run = chunk * inner, stride = shape[Dim] * n * inner, at = i * chunk * inner;
    detail::copy_runs<typename L::memory_space>(to, from, outer, run, stride, at);
    return R(out, ct.mesh(), ct.device());
  }
}

/// @brief Backward of `psum_scatter<Axis, Dim>`: `all_gather<Axis, Dim>(ct)`.
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter_transpose(const L& ct) {
  return meshlib::all_gather<Axis, Dim>(ct);
}

/// @brief Backward of `all_to_all<Axis, Split, Concat>`: the reverse all-to-all.
template <fixed_string Axis, std::size_t Split, std::size_t Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all_transpose(const L& ct) {
  return meshlib::all_to_all<Axis, Concat, Split>(ct);
}

/// @brief The inverse of a permutation given as (source, destination) pairs.
[[nodiscard]] inline std::vector<std::pair<std::size_t, std::size_t>> inverse_permutation(
    const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  std::vector<std::pair<std::size_t, std::size_t>> inv;
  inv.reserve(perm.size());
  for (const auto& [src, dst] : perm) inv.emplace_back(dst, src);
  return inv;
}

/// @brief Backward of `ppermute<Axis>(x, perm)`: `ppermute<Axis>(ct, inverse(perm))`.
template <fixed_string Axis, local_tensor_type L>
[[nodiscard]] auto ppermute_transpose(const L& ct, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  return meshlib::ppermute<Axis>(ct, inverse_permutation(perm));
}

}  // namespace meshlib::nn
// end meshlib/nn/collective_transpose.hpp
// begin meshlib/nn/autodiff.hpp
/// @file
/// @brief Reverse-mode automatic differentiation of programs on local values: `value_and_grad`,
/// `grad`, `traced`, and the differentiable operations. See docs/autodiff.md.

// begin meshlib/nn/autodiff/traced.hpp
/// @file
/// @brief `traced<L>`: a `local_tensor` being differentiated by `value_and_grad`, and the per-device
/// tape (define-by-run) that records, for every operation on traced values, how its cotangent flows
/// back to its operands.
///
/// Why a tape per call and a pointer in each traced value: every device runs the loss function on
/// its own thread, so the tape is a local of that call (no thread-local state, no locking), and two
/// traced operands always name the tape they were recorded on.
///
/// Cotangents. A traced value's type is its primal's type, so a misuse fails to compile exactly as
/// it does untraced. The cotangent of a value of type `L` has type `cotangent_t<L>`: `L` with no
/// pending-sum axes. The cotangent of a part of a pending sum (`partial` over `a`) is the cotangent
/// of the completed sum, the same on every device of `a` (each part moves the sum one for one), so
/// it is invariant over `a`; for every other value the cotangent has the value's own type (JAX's
/// `check_vma` rule: the cotangent of an invariant value is invariant).

#include <any>
#include <cstddef>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief The type of the cotangent of a local value of type `L`: `L` without pending-sum axes
/// (see the file comment).
template <local_tensor_type L>
using cotangent_t = with_vary_partial_t<L, L::vary, 0>;

namespace detail {

/// The tape of one `value_and_grad` call on one device: per node, its cotangent (once one has
/// arrived) and the closure that sends it back to the node's operands.
class tape {
 public:
  /// A node with no backward (an input being differentiated); returns its id.
  std::size_t leaf() {
    cts_.emplace_back();
    backward_.emplace_back();
    return cts_.size() - 1;
  }

  /// A node whose cotangent has type `C`; `back(t, ct)` sends `ct` to the operands. Returns its id.
  template <class C, class F>
  std::size_t node(F back) {
    const std::size_t id = cts_.size();
    cts_.emplace_back();
    backward_.emplace_back([back = std::move(back), id](tape& t) {
      const C ct = std::any_cast<const C&>(t.cts_[id]);
      back(t, ct);
    });
    return id;
  }

  /// Adds `ct` into node `id`'s cotangent (the sum over every use of the node).
  template <class C>
  void accumulate(std::size_t id, const C& ct) {
    std::any& slot = cts_[id];
    if (!slot.has_value()) slot = ct;
    else slot = C(std::any_cast<const C&>(slot) + ct);
  }

  /// Node `id`'s cotangent, or nothing when none reached it.
  template <class C>
  [[nodiscard]] const C* cotangent(std::size_t id) const {
    return std::any_cast<C>(&cts_[id]);
  }

  /// Runs the backward of every node that has a cotangent, the last recorded first. Every device
  /// records the same program, so all of them issue the backward collectives in the same order.
  void run_backward() {
    for (std::size_t i = cts_.size(); i-- > 0;)
      if (backward_[i] && cts_[i].has_value()) backward_[i](*this);
  }

 private:
  std::vector<std::any> cts_;
  std::vector<std::function<void(tape&)>> backward_;
};

/// `x`'s block as a value of type `To` (same element type, rank and memory space): the
/// cotangent rules move axes between invariant and varying where the data are already right.
template <local_tensor_type To, local_tensor_type From>
To retype(const From& x) {
  static_assert(std::is_same_v<typename To::view_type, typename From::view_type>,
                "meshlib::nn: autodiff: a cotangent retyped to another element type, rank or memory space");
  return To(x.view(), x.mesh(), x.device());
}

}  // namespace detail

/// @brief A `local_tensor` of type `L` being differentiated inside `value_and_grad`: its value (the
/// primal) and its node on the device's tape. Operations on traced values (`+`, `*`, `matmul`,
/// `sum`, `psum`, `all_gather`, ...; see docs/autodiff.md) compute the primal with meshlib's own
/// operation, so they have its sharding rules and diagnostics, and record the backward.
template <local_tensor_type L>
class traced {
 public:
  /// Tag that opts the type into the `traced_type` concept.
  using is_traced = void;
  /// The type of the value (and of every operation's result on it, untraced).
  using primal_type = L;
  /// The element type.
  using value_type = typename L::value_type;
  /// The mesh type.
  using mesh_type = typename L::mesh_type;
  /// The number of dimensions.
  static constexpr std::size_t rank = L::rank;
  /// The mesh axes the value varies over (the primal's).
  static constexpr axis_mask vary = L::vary;
  /// The mesh axes the value is a pending sum over (the primal's).
  static constexpr axis_mask partial = L::partial;

  /// The value `primal` recorded as node `id` of tape `t`.
  traced(L primal, detail::tape* t, std::size_t id) : primal_(std::move(primal)), tape_(t), id_(id) {}

  /// The value (a `local_tensor`; reading it records nothing).
  [[nodiscard]] const L& primal() const noexcept { return primal_; }
  /// The tape the value was recorded on.
  [[nodiscard]] detail::tape* tape() const noexcept { return tape_; }
  /// The value's node on its tape.
  [[nodiscard]] std::size_t id() const noexcept { return id_; }
  /// The block's shape.
  [[nodiscard]] auto shape() const { return primal_.shape(); }
  /// The block's extent in dimension `d`.
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return primal_.extent(d); }
  /// The number of elements of the block.
  [[nodiscard]] std::size_t size() const noexcept { return primal_.size(); }
  /// The mesh the block belongs to.
  [[nodiscard]] const mesh_type& mesh() const noexcept { return primal_.mesh(); }
  /// The device whose block this is.
  [[nodiscard]] std::size_t device() const noexcept { return primal_.device(); }

 private:
  L primal_;
  detail::tape* tape_;
  std::size_t id_;
};

/// @brief A `traced<...>` value.
template <class T>
concept traced_type = requires { typename std::remove_cvref_t<T>::is_traced; };

/// @brief An operand of a differentiable operation: a traced value or a plain `local_tensor` (a constant).
template <class T>
concept ad_operand = traced_type<T> || local_tensor_type<T>;

namespace detail {

/// The value of an operand: the primal of a traced one, a plain local tensor itself.
template <ad_operand X>
const auto& primal_of(const X& x) {
  if constexpr (traced_type<X>) return x.primal();
  else return x;
}

/// Two operands of which at least one is traced (the other a constant `local_tensor`).
template <class A, class B>
concept ad_binary = ad_operand<A> && ad_operand<B> && (traced_type<A> || traced_type<B>);

/// The tape of the first traced operand.
template <class A, class B>
tape* tape_of(const A& a, const B& b) {
  if constexpr (traced_type<A>) return a.tape();
  else return b.tape();
}

/// Records `value` as a node of `t` whose backward is `back(t, ct)`; returns the traced result.
template <local_tensor_type L, class F>
traced<L> record(tape* t, L value, F back) {
  const std::size_t id = t->template node<cotangent_t<L>>(std::move(back));
  return traced<L>(std::move(value), t, id);
}

/// Sends `ct` to operand `x` when it is traced (a constant takes no cotangent).
template <ad_operand X, local_tensor_type C>
void send(tape& t, const X& x, const C& ct) {
  if constexpr (traced_type<X>) {
    using to_t = cotangent_t<typename X::primal_type>;
    t.accumulate<to_t>(x.id(), retype<to_t>(ct));
  }
}

}  // namespace detail

/// @brief `jax.lax.stop_gradient`: `x`'s value as a traced value whose cotangent goes nowhere (a
/// new leaf of `x`'s tape), so no gradient flows back through it; a plain `local_tensor` (already
/// a constant) is returned as it is. The shift of a numerically safe softmax:
/// @code
/// auto z = x - meshlib::nn::broadcast_in_dim<1>(meshlib::nn::stop_gradient(meshlib::nn::max<1>(x)), x);
/// @endcode
template <ad_operand X>
auto stop_gradient(const X& x) {
  if constexpr (traced_type<X>) return X(x.primal(), x.tape(), x.tape()->leaf());
  else return x;
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/traced.hpp
// begin meshlib/nn/autodiff/elementwise.hpp
/// @file
/// @brief Differentiable elementwise operations on traced values: `+`, `-`, `*`, `/` between two
/// operands (traced, or a plain `local_tensor` as a constant) and with a scalar, negation, and the
/// maps `tanh`, `exp`, `log`, `square`, `sqrt`, `rsqrt`, `maximum(x, s)` (`maximum(x, 0)` is
/// relu). The primal is
/// meshlib's own operation, so the layout rules (same layout on both sides, only linear
/// operations on pending sums) are the untraced ones.
/// @code
/// auto h = meshlib::nn::tanh(x * 2.0 + 1.0);   // x traced: records three nodes
/// auto r = meshlib::nn::maximum(h - b, 0.0);   // relu; b a plain local_tensor (a constant)
/// @endcode

#include <cmath>
#include <type_traits>


namespace meshlib::nn {

namespace detail {

template <class T>
KOKKOS_INLINE_FUNCTION T ad_tanh(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::tanh(x);
#else
  return std::tanh(x);
#endif
}
template <class T>
KOKKOS_INLINE_FUNCTION T ad_exp(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::exp(x);
#else
  return std::exp(x);
#endif
}
template <class T>
KOKKOS_INLINE_FUNCTION T ad_log(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::log(x);
#else
  return std::log(x);
#endif
}

template <class T>
KOKKOS_INLINE_FUNCTION T ad_sqrt(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// Forward and backward element bodies: function objects, which nvcc compiles for the device where
// a lambda in a deduced-return function would not be.
struct tanh_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_tanh(x); }
};
struct tanh_back_fn {  // (ct, y = tanh x) -> ct (1 - y^2)
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T y) const { return g * (T(1) - y * y); }
};
struct exp_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_exp(x); }
};
struct log_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_log(x); }
};
struct square_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return x * x; }
};
struct square_back_fn {  // (ct, x) -> 2 x ct
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T x) const { return T(2) * x * g; }
};
struct quotient_rhs_fn {  // (ct y, b) -> -ct y / b: the cotangent of b in y = a / b
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T gy, T b) const { return -gy / b; }
};
struct sqrt_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_sqrt(x); }
};
struct sqrt_back_fn {  // (ct, y = sqrt x) -> ct / (2 y)
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T y) const { return g / (T(2) * y); }
};
struct rsqrt_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return T(1) / ad_sqrt(x); }
};
struct rsqrt_back_fn {  // (ct, y = x^(-1/2)) -> -ct y^3 / 2
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T y) const { return -g * y * y * y / T(2); }
};
template <class S>
struct maximum_fn {
  S s;
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return x > static_cast<T>(s) ? x : static_cast<T>(s); }
};
template <class S>
struct maximum_back_fn {  // (ct, x) -> ct where x > s, else 0 (the subgradient 0 at the kink, as jax.nn.relu)
  S s;
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T x) const { return x > static_cast<T>(s) ? g : T(0); }
};

template <class X, class S>
concept ad_scalar_for = traced_type<X> && std::is_arithmetic_v<S>;

}  // namespace detail

/// @brief `a + b` (either operand may be a constant `local_tensor`); backward: `ct` to both.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator+(const A& a, const B& b) {
  auto y = detail::primal_of(a) + detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    detail::send(t, a, ct);
    detail::send(t, b, ct);
  });
}

/// @brief `a - b`; backward: `ct` to `a`, `-ct` to `b`.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator-(const A& a, const B& b) {
  auto y = detail::primal_of(a) - detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    detail::send(t, a, ct);
    if constexpr (traced_type<B>) detail::send(t, b, -ct);
  });
}

/// @brief `a * b` elementwise; backward: `ct * b` to `a`, `ct * a` to `b`.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator*(const A& a, const B& b) {
  auto y = detail::primal_of(a) * detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    if constexpr (traced_type<A>) detail::send(t, a, ct * detail::primal_of(b));
    if constexpr (traced_type<B>) detail::send(t, b, ct * detail::primal_of(a));
  });
}

/// @brief `a / b` elementwise; backward: `ct / b` to `a`, `-ct a / b^2` to `b`.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator/(const A& a, const B& b) {
  auto y = detail::primal_of(a) / detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b, y](detail::tape& t, const auto& ct) {
    if constexpr (traced_type<A>) detail::send(t, a, ct / detail::primal_of(b));
    if constexpr (traced_type<B>) detail::send(t, b, meshlib::zip(detail::quotient_rhs_fn{}, ct * y, detail::primal_of(b)));
  });
}

/// @brief `-x`; backward: `-ct`.
template <traced_type X>
auto operator-(const X& x) {
  auto y = -x.primal();
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, -ct); });
}

/// @brief `x * s` (linear: allowed on pending sums); backward: `ct * s`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator*(const X& x, S s) {
  auto y = x.primal() * s;
  return detail::record(x.tape(), y, [x, s](detail::tape& t, const auto& ct) { detail::send(t, x, ct * s); });
}
/// @brief `s * x`; backward: `ct * s`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator*(S s, const X& x) {
  return x * s;
}
/// @brief `x / s`; backward: `ct / s`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator/(const X& x, S s) {
  auto y = x.primal() / s;
  return detail::record(x.tape(), y, [x, s](detail::tape& t, const auto& ct) { detail::send(t, x, ct / s); });
}
/// @brief `x + s` (not on pending sums, as untraced); backward: `ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator+(const X& x, S s) {
  auto y = x.primal() + s;
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}
/// @brief `s + x`; backward: `ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator+(S s, const X& x) {
  return x + s;
}
/// @brief `x - s`; backward: `ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator-(const X& x, S s) {
  auto y = x.primal() - s;
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}
/// @brief `s - x`; backward: `-ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator-(S s, const X& x) {
  auto y = s - x.primal();
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, -ct); });
}

/// @brief `tanh(x)` elementwise; backward: `ct (1 - tanh(x)^2)`.
template <traced_type X>
auto tanh(const X& x) {
  auto y = meshlib::map(detail::tanh_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::tanh_back_fn{}, ct, y));
  });
}

/// @brief `exp(x)` elementwise; backward: `ct exp(x)`.
template <traced_type X>
auto exp(const X& x) {
  auto y = meshlib::map(detail::exp_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) { detail::send(t, x, ct * y); });
}

/// @brief `log(x)` elementwise; backward: `ct / x`.
template <traced_type X>
auto log(const X& x) {
  auto y = meshlib::map(detail::log_fn{}, x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct / x.primal()); });
}

/// @brief `x * x` elementwise; backward: `2 x ct`.
template <traced_type X>
auto square(const X& x) {
  auto y = meshlib::map(detail::square_fn{}, x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::square_back_fn{}, ct, x.primal()));
  });
}

/// @brief `sqrt(x)` elementwise (`jnp.sqrt`); backward: `ct / (2 sqrt(x))` (infinite at 0, as JAX's).
template <traced_type X>
auto sqrt(const X& x) {
  auto y = meshlib::map(detail::sqrt_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::sqrt_back_fn{}, ct, y));
  });
}

/// @brief `1 / sqrt(x)` elementwise (`jax.lax.rsqrt`: a norm's scale `rsqrt(mean(x^2) + eps)`);
/// backward: `-ct x^(-3/2) / 2`.
template <traced_type X>
auto rsqrt(const X& x) {
  auto y = meshlib::map(detail::rsqrt_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::rsqrt_back_fn{}, ct, y));
  });
}

/// @brief `max(x, s)` elementwise (`maximum(x, 0)`: relu); backward: `ct` where `x > s`, else 0.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto maximum(const X& x, S s) {
  auto y = meshlib::map(detail::maximum_fn<S>{s}, x.primal());
  return detail::record(x.tape(), y, [x, s](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::maximum_back_fn<S>{s}, ct, x.primal()));
  });
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/elementwise.hpp
// begin meshlib/nn/autodiff/linalg.hpp
/// @file
/// @brief Differentiable reductions and products on traced values: `sum<D>`, `mean<D>`, `max<D>`,
/// `matmul`, `transpose` (rank 2). The primal is meshlib's own operation with its sharding rules.
///
/// Backward rules, with the layouts they imply:
/// - `sum<D>` / `mean<D>`: `ct` broadcast along `D` (divided by `D`'s global extent for `mean`).
///   Reducing a dimension sharded over `a` leaves a pending sum over `a`, whose cotangent is
///   invariant over `a` (autodiff/traced.hpp); broadcast, it is the cotangent of every block.
/// - `max<D>`: `ct` to the elements equal to the max along `D`, split equally between ties (JAX's
///   rule for `jnp.max`); 0 elsewhere. Over a dimension sharded on `a` the result is this block's
///   max (still varying over `a`, as untraced), and so is the rule.
/// - `matmul(a, b)`: `ct b^T` to `a`, `a^T ct` to `b` (one `matmul_into` each, the transposes read
///   in place). Where the product varies over an axis (or contracts a pending sum over it) that an
///   operand does not vary over, the operand was used by every device of that axis (JAX inserts a
///   `pvary` there), so its cotangent is `psum`med over the axis: data parallelism's gradient sum
///   and Megatron's `f` / `g` pair come out of this one rule.
/// @code
/// auto loss = meshlib::nn::mean<0>(meshlib::nn::sum<1>(meshlib::nn::square(matmul(x, w) - y)));
/// @endcode

#include <cstddef>


namespace meshlib::nn {

namespace detail {

/// `out[o, k, j] = in[o, j] * scale` for `o < outer`, `k < n`, `j < inner`, on `Space`. A named
/// function: nvcc refuses an extended device lambda inside a function whose return type is deduced.
template <class Space, class T>
void broadcast_along(T* out, const T* in, std::size_t outer, std::size_t n, std::size_t inner, T scale) {
  meshlib::launch<Space>(outer * n * inner, KOKKOS_LAMBDA(std::size_t i) {
    const std::size_t j = i % inner, o = i / (n * inner);
    out[i] = in[o * inner + j] * scale;
  });
}

/// One iteration per output element `(o, j)` of a max along a dimension of extent `n`: `out[o, k,
/// j] = ct[o, j] / c` where `x[o, k, j]` equals the max `y[o, j]` (`c` such `k`), else 0.
template <class T>
struct max_back_functor {
  const T* x;
  const T* y;
  const T* ct;
  T* out;
  std::size_t n, inner;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t idx) const {
    const std::size_t base = (idx / inner) * n * inner + idx % inner;
    std::size_t c = 0;
    for (std::size_t k = 0; k < n; ++k) c += x[base + k * inner] == y[idx] ? 1 : 0;
    const T share = c == 0 ? T(0) : ct[idx] / static_cast<T>(c);
    for (std::size_t k = 0; k < n; ++k) out[base + k * inner] = x[base + k * inner] == y[idx] ? share : T(0);
  }
};

/// The cotangent of `x` for `y = max<D>(x)` with cotangent `ct` of `y`.
template <std::size_t D, local_tensor_type X, local_tensor_type Y, local_tensor_type C>
cotangent_t<X> max_backward(const X& x, const Y& y, const C& ct) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d != D; ++d) outer *= x.extent(d);
  for (std::size_t d = D + 1; d < X::rank; ++d) inner *= x.extent(d);
  auto out = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  meshlib::launch<space>(outer * inner, max_back_functor<T>{x.data(), y.data(), ct.data(), out.data(), x.extent(D), inner});
  return cotangent_t<X>(out, x.mesh(), x.device());
}

/// The cotangent of `x` (of type `X`) for `sum<D>`/`mean<D>` with cotangent `ct` of the result.
template <std::size_t D, local_tensor_type X, local_tensor_type C>
cotangent_t<X> reduce_backward(const X& x, const C& ct, typename X::value_type scale) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d != D; ++d) outer *= x.extent(d);  // (d < D warns under nvcc for D = 0)
  for (std::size_t d = D + 1; d < X::rank; ++d) inner *= x.extent(d);
  auto out = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  broadcast_along<space, T>(out.data(), ct.data(), outer, x.extent(D), inner, scale);
  return cotangent_t<X>(out, x.mesh(), x.device());
}

/// The cotangent of the operand `X` of a product whose other operand is `O` and whose cotangent is
/// `C`, from its local contribution `view` (see the file comment for the sum).
template <local_tensor_type X, local_tensor_type O, local_tensor_type C, class V>
auto product_cotangent(const V& view, const X& x) {
  using ct_t = cotangent_t<X>;
  constexpr axis_mask extra = (O::vary | O::partial | C::vary) & ~X::vary & ~X::partial;
  if constexpr (extra == 0) {
    return ct_t(view, x.mesh(), x.device());
  } else {
    using local_t = with_vary_t<ct_t, ct_t::vary | extra>;
    return retype<ct_t>(psum_over<extra>(local_t(view, x.mesh(), x.device())));  // nn/axis_mask_group.hpp
  }
}

}  // namespace detail

/// @brief Sum over dimension `D` (the layout of `meshlib::sum<D>`); backward: `ct` broadcast along `D`.
template <std::size_t D, traced_type X>
auto sum(const X& x) {
  auto y = meshlib::sum<D>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    t.accumulate<cotangent_t<typename X::primal_type>>(
        x.id(), detail::reduce_backward<D>(x.primal(), ct, typename X::value_type(1)));
  });
}

/// @brief Mean over dimension `D` (the layout of `meshlib::mean<D>`); backward: `ct / n` broadcast
/// along `D`, `n` its global extent.
template <std::size_t D, traced_type X>
auto mean(const X& x) {
  auto y = meshlib::mean<D>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    using T = typename X::value_type;
    const T scale = T(1) / static_cast<T>(x.primal().global_extent(D));
    t.accumulate<cotangent_t<typename X::primal_type>>(x.id(), detail::reduce_backward<D>(x.primal(), ct, scale));
  });
}

/// @brief Max over dimension `D` (the layout of `meshlib::max<D>`: over a sharded dimension, this
/// block's max); backward: `ct` to the maximal elements along `D`, split equally between ties
/// (JAX's rule), 0 elsewhere. A numerically safe softmax shifts by it through `stop_gradient`:
/// `exp(x - broadcast_in_dim<1>(stop_gradient(max<1>(x)), x))`.
template <std::size_t D, traced_type X>
auto max(const X& x) {
  auto y = meshlib::max<D>(x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    t.accumulate<cotangent_t<typename X::primal_type>>(x.id(), detail::max_backward<D>(x.primal(), y, ct));
  });
}

/// @brief The product of two rank-2 operands (either may be a constant `local_tensor`), with
/// `meshlib::matmul`'s layout; backward: `ct b^T` to `a`, `a^T ct` to `b`, each `psum`med over the
/// axes the product used it across (see the file comment).
template <class A, class B>
  requires detail::ad_binary<A, B>
auto matmul(const A& a, const B& b) {
  auto y = meshlib::matmul(detail::primal_of(a), detail::primal_of(b));
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    using C = std::remove_cvref_t<decltype(ct)>;
    const auto& pa = detail::primal_of(a);
    const auto& pb = detail::primal_of(b);
    using PA = std::remove_cvref_t<decltype(pa)>;
    using PB = std::remove_cvref_t<decltype(pb)>;
    if constexpr (traced_type<A>) {
      auto da = meshlib::allocate<typename PA::value_type, 2, typename PA::memory_space>(pa.shape(), "meshlib::nn::autodiff", false);
      meshlib::matmul_into(da, ct.view(), pb.view(), {.transpose_b = true});
      t.accumulate<cotangent_t<PA>>(a.id(), detail::product_cotangent<PA, PB, C>(da, pa));
    }
    if constexpr (traced_type<B>) {
      auto db = meshlib::allocate<typename PB::value_type, 2, typename PB::memory_space>(pb.shape(), "meshlib::nn::autodiff", false);
      meshlib::matmul_into(db, pa.view(), ct.view(), {.transpose_a = true});
      t.accumulate<cotangent_t<PB>>(b.id(), detail::product_cotangent<PB, PA, C>(db, pb));
    }
  });
}

/// @brief The transpose of a rank-2 traced value; backward: the transpose of `ct`.
template <traced_type X>
auto transpose(const X& x) {
  auto y = meshlib::transpose(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::transpose(ct));
  });
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/linalg.hpp
// begin meshlib/nn/autodiff/shape.hpp
/// @file
/// @brief Differentiable shape operations on traced values: `reshape`, `forget_dims`, `slice<D>`,
/// `pad<D>`, `concatenate<D>` and `broadcast_in_dim<D>`. The primal is the tensor layer's operation (tensor/reshape.hpp,
/// tensor/slice.hpp), with its sharding rules and diagnostics; each backward is the transpose of a
/// linear map, so it moves the cotangent and communicates nothing:
/// - `reshape(x, s)`: `reshape(ct, x.shape())`; `forget_dims<a>(x)`: `ct`;
/// - `slice<D>(x, start, stop)`: `pad<D>(ct, start, n - stop)` (zeros where `x` was cut off);
/// - `pad<D>(x, before, after)`: `slice<D>(ct, before, before + n)`;
/// - `concatenate<D>(xs...)`: each operand its own slice of `ct`;
/// - `broadcast_in_dim<D>(x, n)`: `sum<D>(ct)` (the new dimension is not sharded: no pending sum).
/// @code
/// auto q = meshlib::nn::slice<1>(qkv, 0, c);                                   // qkv traced
/// auto heads = meshlib::nn::reshape(q, std::array<std::size_t, 3>{t, h, c / h});
/// @endcode

#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>


namespace meshlib::nn {

namespace detail {

/// The tape of `x` when it is traced, else `t`.
template <ad_operand X>
tape* tape_or(const X& x, tape* t) {
  if constexpr (traced_type<X>) return t != nullptr ? t : x.tape();
  else return t;
}

/// Sends operand `x` of a `concatenate<D>` its slice of `ct`, from `at` along `D`; advances `at`.
template <std::size_t D, ad_operand X, local_tensor_type C>
void send_slice(tape& t, const X& x, const C& ct, std::size_t& at) {
  const std::size_t n = primal_of(x).extent(D);
  if constexpr (traced_type<X>) send(t, x, meshlib::slice<D>(ct, at, at + n));
  at += n;
}

}  // namespace detail

/// @brief `meshlib::reshape(x, shape)` on a traced value; backward: `ct` reshaped back to `x`'s shape.
template <traced_type X, std::size_t R>
auto reshape(const X& x, const std::array<std::size_t, R>& shape) {
  auto y = meshlib::reshape(x.primal(), shape);
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::reshape(ct, x.primal().shape()));
  });
}

/// @brief `meshlib::broadcast_in_dim<D>(x, n)` on a traced value (a bias row over a batch: `y =
/// matmul(x, w) + broadcast_in_dim<0>(b, x.extent(0))`); backward: `sum<D>(ct)`.
template <std::size_t D, traced_type X>
auto broadcast_in_dim(const X& x, std::size_t n) {
  auto y = meshlib::broadcast_in_dim<D>(x.primal(), n);
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, meshlib::sum<D>(ct)); });
}

/// @brief `meshlib::broadcast_in_dim<D>(x, like)` with `x` traced (`like`, traced or not, gives the
/// new dimension's extent and sharding record; it takes no cotangent); backward: `sum<D>(ct)` over
/// this device's block. Where that dimension is a block of axes (which `x` varies over), each
/// device's `x` filled only its own rows, so the local sum, a pending sum by its type, is `x`'s
/// cotangent as it stands.
template <std::size_t D, traced_type X, ad_operand Like>
auto broadcast_in_dim(const X& x, const Like& like) {
  auto y = meshlib::broadcast_in_dim<D>(x.primal(), detail::primal_of(like));
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, detail::retype<cotangent_t<typename X::primal_type>>(meshlib::sum<D>(ct)));
  });
}

/// @brief `meshlib::forget_dims<Names...>(x)` on a traced value (to combine a reshaped value with
/// one that still records its sharded dimensions); backward: `ct` itself, retyped.
template <fixed_string... Names, traced_type X>
auto forget_dims(const X& x) {
  auto y = meshlib::forget_dims<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}

/// @brief `meshlib::slice<D>(x, start, stop)` on a traced value; backward: `ct` padded with zeros
/// back to `x`'s extent along `D`.
template <std::size_t D, traced_type X>
auto slice(const X& x, std::size_t start, std::size_t stop) {
  auto y = meshlib::slice<D>(x.primal(), start, stop);
  return detail::record(x.tape(), y, [x, start, stop](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::pad<D>(ct, start, x.primal().extent(D) - stop));
  });
}

/// @brief `meshlib::pad<D>(x, before, after)` on a traced value; backward: the slice of `ct` that
/// `x` occupies.
template <std::size_t D, traced_type X>
auto pad(const X& x, std::size_t before, std::size_t after) {
  auto y = meshlib::pad<D>(x.primal(), before, after);
  return detail::record(x.tape(), y, [x, before](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::slice<D>(ct, before, before + x.primal().extent(D)));
  });
}

/// @brief `meshlib::concatenate<D>(xs...)` over operands of which at least one is traced (the
/// others plain `local_tensor`s, constants); backward: each traced operand gets its slice of `ct`.
template <std::size_t D, ad_operand... Xs>
  requires(traced_type<Xs> || ...)
auto concatenate(const Xs&... xs) {
  auto y = meshlib::concatenate<D>(detail::primal_of(xs)...);
  detail::tape* tp = nullptr;
  ((tp = detail::tape_or(xs, tp)), ...);
  return detail::record(tp, y, [ops = std::make_tuple(xs...)](detail::tape& t, const auto& ct) {
    std::size_t at = 0;
    std::apply([&](const auto&... x) { (detail::send_slice<D>(t, x, ct, at), ...); }, ops);
  });
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/shape.hpp
// begin meshlib/nn/autodiff/collectives.hpp
/// @file
/// @brief Differentiable collectives on traced values, each with meshlib's typed result and, as
/// backward, its transpose (nn/collective_transpose.hpp); the varying / pending-sum state in the
/// types decides which, as JAX's `vma` does at trace time:
/// | forward | backward of `ct` |
/// | --- | --- |
/// | `psum<a>` (varying or pending sum -> invariant) | `ct` itself, now typed as the operand's cotangent (no data moves) |
/// | `pmean<a>` | `ct / n`, `n` the size of the group |
/// | `pvary<a>` (invariant -> varying) | `psum<a>(ct)` |
/// | `all_gather<a, d>` (the result invariant over `a`) | this device's chunk of `ct` (no data moves) |
/// | `psum_scatter<a, d>` | `all_gather<a, d>(ct)` |
/// | `all_to_all<a, s, c>` | `all_to_all<a, c, s>(ct)` |
/// | `ppermute<a>(x, perm)` | `ppermute<a>(ct, inverse(perm))` |
/// | `pmax<a>`, `pmin<a>` (varying -> invariant) | `ct * (x == y) / psum<a>(x == y)`: `ct` to the devices holding the extremum, split equally between ties |
/// Every device records the same collectives, so the backward ones run in the same order on all.
/// @code
/// auto s = meshlib::nn::psum<"data">(meshlib::nn::sum<0>(x));     // x traced, sharded on dim 0
/// auto g = meshlib::nn::all_gather<"model", 1>(h);
/// @endcode

#include <cstddef>
#include <utility>
#include <vector>


namespace meshlib::nn {

namespace detail {
/// A dimension number as the collectives take it (negative: from the end) made non-negative.
template <int Dim, std::size_t Rank>
inline constexpr std::size_t dim_index_v = Dim < 0 ? static_cast<std::size_t>(Dim + static_cast<int>(Rank))
                                                   : static_cast<std::size_t>(Dim);

/// `e[i] = 1` where `x[i]` equals the reduced value `y[i]` (this device holds the extremum), else
/// 0. A function object, which nvcc compiles for the device where a lambda in a deduced-return
/// function would not be.
template <class T>
struct extremum_indicator_functor {
  const T* x;
  const T* y;
  T* e;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { e[i] = x[i] == y[i] ? T(1) : T(0); }
};

/// `out[i] = ct[i] / c[i]` where `e[i]` is 1 (`c[i] >= 1` devices hold the extremum), else 0.
template <class T>
struct extremum_share_functor {
  const T* e;
  const T* ct;
  const T* c;
  T* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = e[i] != T(0) ? ct[i] / c[i] : T(0); }
};

/// The cotangent of `x` for `y = pmax<Names...>(x)` (or `pmin`) with cotangent `ct` of `y`: JAX's
/// tie rule for a max, across the devices of the group. The count of ties is the one collective:
/// a `psum` of the indicator, which every device of the group issues in the same backward step.
template <fixed_string... Names, local_tensor_type X, local_tensor_type Y, local_tensor_type C>
cotangent_t<X> extremum_backward(const X& x, const Y& y, const C& ct) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  auto e = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  meshlib::launch<space>(x.size(), extremum_indicator_functor<T>{x.data(), y.data(), e.data()});
  const auto count = meshlib::psum<Names...>(X(e, x.mesh(), x.device()));  // x varies over Names, partial over none
  auto out = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  meshlib::launch<space>(x.size(), extremum_share_functor<T>{e.data(), ct.data(), count.data(), out.data()});
  return cotangent_t<X>(out, x.mesh(), x.device());
}

}  // namespace detail

/// @brief `meshlib::psum<Names...>` of a traced value; backward: `ct`, retyped (no communication).
template <fixed_string... Names, traced_type X>
auto psum(const X& x) {
  auto y = meshlib::psum<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}

/// @brief `meshlib::pmean<Names...>` of a traced value; backward: `ct / n`, `n` the group's size.
template <fixed_string... Names, traced_type X>
auto pmean(const X& x) {
  auto y = meshlib::pmean<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    using T = typename X::value_type;
    const T n = static_cast<T>((meshlib::axis_size<Names>() * ... * std::size_t{1}));
    detail::send(t, x, ct / n);
  });
}

/// @brief `meshlib::pmax<Names...>` of a traced value (JAX's `lax.pmax` under `grad`); backward:
/// `ct` to the devices whose `x` equals the max, split equally between ties across the group
/// (`ct * (x == y) / psum<Names...>(x == y)`), 0 elsewhere. The shift of a softmax over classes
/// sharded on `a`, its gradient stopped:
/// @code
/// auto shift = meshlib::nn::stop_gradient(meshlib::nn::pmax<"a">(meshlib::nn::max<1>(x)));  // invariant over a
/// @endcode
template <fixed_string... Names, traced_type X>
auto pmax(const X& x) {
  auto y = meshlib::pmax<Names...>(x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, detail::extremum_backward<Names...>(x.primal(), y, ct));
  });
}

/// @brief `meshlib::pmin<Names...>` of a traced value (JAX's `lax.pmin` under `grad`); backward:
/// `ct` to the devices whose `x` equals the min, split equally between ties across the group.
template <fixed_string... Names, traced_type X>
auto pmin(const X& x) {
  auto y = meshlib::pmin<Names...>(x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, detail::extremum_backward<Names...>(x.primal(), y, ct));
  });
}

/// @brief `meshlib::pvary<Names...>` of a traced value; backward: `psum<Names...>(ct)`.
template <fixed_string... Names, traced_type X>
auto pvary(const X& x) {
  auto y = meshlib::pvary<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, pvary_transpose<Names...>(ct));
  });
}

/// @brief `meshlib::all_gather<Axis, Dim>` (tiled) of a traced value; backward: this device's chunk
/// of the (invariant) cotangent.
template <fixed_string Axis, int Dim, traced_type X>
auto all_gather(const X& x) {
  auto y = meshlib::all_gather<Axis, Dim>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, all_gather_transpose<Axis, detail::dim_index_v<Dim, X::rank>>(ct));
  });
}

/// @brief `meshlib::psum_scatter<Axis, Dim>` (tiled) of a traced value; backward: `all_gather<Axis, Dim>(ct)`.
template <fixed_string Axis, int Dim, traced_type X>
auto psum_scatter(const X& x) {
  auto y = meshlib::psum_scatter<Axis, Dim>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, psum_scatter_transpose<Axis, detail::dim_index_v<Dim, X::rank>>(ct));
  });
}

/// @brief `meshlib::all_to_all<Axis, Split, Concat>` (tiled) of a traced value; backward: the reverse all-to-all.
template <fixed_string Axis, int Split, int Concat, traced_type X>
auto all_to_all(const X& x) {
  auto y = meshlib::all_to_all<Axis, Split, Concat>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x,
                 all_to_all_transpose<Axis, detail::dim_index_v<Split, X::rank>, detail::dim_index_v<Concat, X::rank>>(ct));
  });
}

/// @brief `meshlib::ppermute<Axis>(x, perm)` of a traced value; backward: the inverse permutation of `ct`.
template <fixed_string Axis, traced_type X>
auto ppermute(const X& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  auto y = meshlib::ppermute<Axis>(x.primal(), perm);
  return detail::record(x.tape(), y, [x, perm](detail::tape& t, const auto& ct) {
    detail::send(t, x, ppermute_transpose<Axis>(ct, perm));
  });
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/collectives.hpp
// begin meshlib/nn/autodiff/layer.hpp
/// @file
/// @brief `apply_layer(layer, x)`: an `nn` layer (anything with `forward(x)` and
/// `backward(dy, need_dx)`: `dense`, `column_dense`, `row_dense`, activations, norms, ...) used
/// inside `value_and_grad` as one primitive whose backward is the layer's own hand-written one.
///
/// The layer's parameter gradients go where its backward always puts them, the layer's
/// `parameter::grad` blocks (added, as in `train_step`; nothing is summed over the data axis: that
/// is the data-parallel policy's work); the input's cotangent flows on through the tape. A layer
/// keeps one forward's state per device, so apply it once per loss evaluation.
///
/// An input of integers (`embedding`'s token ids, traced so that the embedding is recorded on a
/// tape) has no cotangent: its gradient comes back as zeros, as JAX's `grad(..., allow_int=True)`
/// gives integer inputs a zero (`float0`) gradient; the layer's backward still runs for its
/// parameter gradients. (What `embedding::backward` returns, the ids it looked up so that
/// `sequential`'s type check holds, is no gradient and goes nowhere.)
/// @code
/// nn::dense<float, mesh_t> fc(mesh, "fc", 16, 4, nn::rng_key{0});
/// auto [loss, dx] = nn::value_and_grad([&](const auto& x) {
///   return nn::pmean<"data">(nn::mean<0>(nn::mean<1>(nn::square(nn::apply_layer(fc, x)))));
/// })(x);                                     // fc.w.grad / fc.b.grad hold this device's dW, db
/// @endcode

#include <type_traits>


namespace meshlib::nn {

namespace detail {
struct copy_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return x; }
};
}  // namespace detail

/// @brief `layer.forward(x)` recorded as one node; backward: `layer.backward(ct, true)` (the
/// parameter gradients into the layer, `dx` copied out of the layer's reused buffer onto the tape;
/// an integer input takes none: see the file comment).
/// @code
/// auto h = meshlib::nn::apply_layer(tok, ids);   // ids: traced int32 token ids; tok.table.grad gets dE
/// @endcode
template <class Layer, traced_type X>
auto apply_layer(Layer& layer, const X& x) {
  auto y = layer.forward(x.primal());
  Layer* l = &layer;
  return detail::record(x.tape(), y, [l, x](detail::tape& t, const auto& ct) {
    if constexpr (std::is_integral_v<typename X::value_type>)
      static_cast<void>(l->backward(ct, true));  // the parameter gradients only
    else
      detail::send(t, x, meshlib::map(detail::copy_fn{}, l->backward(ct, true)));
  });
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/layer.hpp
// begin meshlib/nn/autodiff/value_and_grad.hpp
/// @file
/// @brief `value_and_grad` and `grad`, reverse mode, define by run, as `jax.value_and_grad` /
/// `jax.grad` inside `shard_map` / `spmd`: each device calls the returned function on its
/// `local_tensor`s; the arguments named by `Argnums` (default: the first) enter the loss function
/// as `traced` values, every meshlib::nn operation on them is recorded on the device's tape, and
/// the tape is walked back from the loss.
///
/// The loss must be one value every device agrees on: a traced value invariant over every mesh
/// axis (no `vary`, no pending sum; a compile-time error otherwise) with one element (a run-time
/// `autodiff_error` otherwise). Its value is then the loss of the whole program, and each gradient
/// is this device's block of the gradient of that loss with respect to the global argument: it has
/// the argument's type (the argument's sharding), as JAX's `shard_map` gradients do. An argument
/// that is itself a pending sum gets the gradient of the completed sum (invariant over those axes).
/// @code
/// auto loss_fn = [](const auto& w, const auto& x) {          // w: (in, out), x: (batch / 4, in)
///   namespace nn = meshlib::nn;
///   auto y = nn::matmul(x, w);                               // varies over "data"
///   return nn::psum<"data">(nn::sum<0>(nn::sum<1>(nn::square(y)))) / 2.0;
/// };
/// meshlib::spmd(mesh, [&](std::size_t dev) {
///   auto [loss, dw] = meshlib::nn::value_and_grad(loss_fn)(w_local, x_local);   // dw: w's type
/// });
/// @endcode
///
/// With `nn::has_aux` (JAX's `has_aux=True`) the function returns a pair `(loss, aux)`: `aux` is
/// carried out untouched and not differentiated (traced values in it come back as their primal
/// `local_tensor`s), and the result's `value` is the pair `(loss, aux)`:
/// @code
/// auto [out, dw] = meshlib::nn::value_and_grad(loss_with_logits, meshlib::nn::has_aux)(w, x);
/// auto& [loss, logits] = out;
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>


namespace meshlib::nn {

/// @brief A loss function that `value_and_grad` cannot differentiate as called (a loss with more
/// than one element): `what()` says what was returned and how to reduce it.
class autodiff_error : public error {
 public:
  using error::error;
};

/// @brief What the function `value_and_grad` returns gives back: the loss and the gradients
/// (one argument differentiated: its gradient; several: a `std::tuple` of them, in `Argnums` order).
template <class V, class G>
struct value_and_grad_result {
  V value;  ///< the loss, a one-element `local_tensor` invariant over every axis (`to_host(value)[0]`)
  G grad;   ///< the gradient(s), each of its argument's type
};

/// @brief The type of `has_aux`.
struct has_aux_t {
  explicit has_aux_t() = default;
};

/// @brief Passed to `value_and_grad` / `grad` (JAX's `has_aux=True`): the function returns a pair
/// `(loss, aux)` (a `std::pair` or two-element `std::tuple`); `aux` is returned beside the loss,
/// not differentiated (see the file comment).
inline constexpr has_aux_t has_aux{};

namespace detail {

struct one_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T) const { return T(1); }
};

template <std::size_t I, std::size_t... Argnums>
inline constexpr bool differentiated_v = ((I == Argnums) || ...);

template <class Shape>
std::string loss_shape_text(const Shape& shape) {
  std::string s = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

/// The argument `x` as the loss function sees it: traced when differentiated, as given otherwise.
template <std::size_t I, std::size_t... Argnums, class X>
auto enter(const X& x, tape& t) {
  if constexpr (differentiated_v<I, Argnums...>) {
    static_assert(local_tensor_type<X>,
                  "meshlib::nn: value_and_grad: an argument named by Argnums is not a local_tensor; differentiate "
                  "with respect to local_tensor arguments only (pass parameters as local_tensors)");
    return traced<X>(x, &t, t.leaf());
  } else {
    return std::cref(x);
  }
}

template <class... T>
inline constexpr bool always_false_v = false;

template <class Returned>
consteval bool loss_is_not_traced() {
  static_assert(always_false_v<Returned>,
                "meshlib::nn: value_and_grad: the loss function must return a traced value computed from the "
                "differentiated arguments with meshlib::nn operations (nn::sum, nn::psum, nn::matmul, ...); the type "
                "it returned is spelled out in the condition");
  return false;
}

template <class LossLayout>
consteval bool loss_is_not_invariant() {
  static_assert(always_false_v<LossLayout>,
                "meshlib::nn: value_and_grad: the loss varies over, or is a pending sum over, the mesh axes spelled "
                "out in the condition; the loss must be one value every device agrees on: reduce it with nn::psum "
                "or nn::pmean over those axes before returning it");
  return false;
}

/// True when `R` is a loss `value_and_grad` can start from; otherwise fires the one diagnostic that says why.
template <class R>
consteval bool check_loss_type() {
  if constexpr (!traced_type<R>) return loss_is_not_traced<R>();
  else if constexpr (R::vary != 0 || R::partial != 0)
    return loss_is_not_invariant<meshlib::diagnostic::value_t<typename R::primal_type>>();
  else return true;
}

template <class T>
inline constexpr bool is_pair_like_v = false;
template <class A, class B>
inline constexpr bool is_pair_like_v<std::pair<A, B>> = true;
template <class A, class B>
inline constexpr bool is_pair_like_v<std::tuple<A, B>> = true;

template <class Op, class Returned>
consteval bool aux_loss_is_not_a_pair() {
  static_assert(always_false_v<Op, Returned>,
                "meshlib::nn: value_and_grad with nn::has_aux: the loss function must return a pair (loss, aux), "
                "a std::pair or a two-element std::tuple (the condition spells out the call and the type it "
                "returned); return std::pair(loss, aux), or drop nn::has_aux");
  return false;
}

/// The auxiliary output as it leaves `value_and_grad`: traced values (whose tape ends with the
/// call) become their primal `local_tensor`s, pairs and tuples element by element, anything else
/// a copy, untouched (JAX's `aux` comes back as arrays).
template <class A>
auto aux_out(const A& a);
template <class A, class B>
auto aux_out(const std::pair<A, B>& a);
template <class... Ts>
auto aux_out(const std::tuple<Ts...>& a);

template <class A>
auto aux_out(const A& a) {
  if constexpr (traced_type<A>) return a.primal();
  else return a;
}
template <class A, class B>
auto aux_out(const std::pair<A, B>& a) {
  return std::pair<decltype(aux_out(a.first)), decltype(aux_out(a.second))>(aux_out(a.first), aux_out(a.second));
}
template <class... Ts>
auto aux_out(const std::tuple<Ts...>& a) {
  return std::apply([](const auto&... e) { return std::tuple<decltype(aux_out(e))...>(aux_out(e)...); }, a);
}

/// The gradient of argument `x` (node `id`): its cotangent, or zeros when the loss does not use it.
template <local_tensor_type X>
cotangent_t<X> gradient_of(const tape& t, std::size_t id, const X& x) {
  if (const auto* c = t.template cotangent<cotangent_t<X>>(id)) return *c;
  auto zeros = meshlib::allocate<typename X::value_type, X::rank, typename X::memory_space>(x.shape(),
                                                                                            "meshlib::nn::grad");
  return cotangent_t<X>(zeros, x.mesh(), x.device());
}

/// The function `value_and_grad(f)` (`Aux`: `value_and_grad(f, has_aux)`) returns.
template <class F, bool Aux, std::size_t... Argnums>
class value_and_grad_fn {
 public:
  explicit value_and_grad_fn(F f) : f_(std::move(f)) {}

  template <class... Args>
  auto operator()(const Args&... args) const {
    static_assert(((Argnums < sizeof...(Args)) && ...),
                  "meshlib::nn: value_and_grad: an index in Argnums is past the last argument");
    return call(std::index_sequence_for<Args...>{}, args...);
  }

 private:
  template <std::size_t... I, class... Args>
  auto call(std::index_sequence<I...>, const Args&... args) const {
    tape t;
    // Braced: the arguments enter the tape in order.
    std::tuple<decltype(enter<I, Argnums...>(args, t))...> in{enter<I, Argnums...>(args, t)...};
    auto returned = std::apply([this](const auto&... a) { return f_(unwrap(a)...); }, in);
    using Returned = decltype(returned);
    if constexpr (!Aux) {
      auto r = differentiate(t, in, returned, args...);
      if constexpr (std::is_same_v<decltype(r), bool>) return;  // the loss diagnostic has fired
      else return r;
    } else if constexpr (!is_pair_like_v<Returned>) {
      // the one diagnostic fires
      static_cast<void>(aux_loss_is_not_a_pair<meshlib::diagnostic::op_t<"value_and_grad">, Returned>());
    } else {
      // The aux leaves before the tape is walked: it holds the forward values, untouched.
      auto aux = aux_out(std::get<1>(returned));
      auto r = differentiate(t, in, std::get<0>(returned), args...);
      if constexpr (std::is_same_v<decltype(r), bool>) {
        return;  // the loss diagnostic has fired
      } else {
        using L = decltype(r.value);
        return value_and_grad_result<std::pair<L, decltype(aux)>, decltype(r.grad)>{{std::move(r.value), std::move(aux)},
                                                                                    std::move(r.grad)};
      }
    }
  }

  /// Walks the tape back from `out`; returns `{loss, grads}` (`false` when `out` is no loss: the
  /// one diagnostic has fired).
  template <class In, class R, class... Args>
  static auto differentiate(tape& t, const In& in, const R& out, const Args&... args) {
    if constexpr (!check_loss_type<R>()) {
      return false;
    } else {
      if (out.size() != 1)
        throw autodiff_error("meshlib::nn: value_and_grad: the loss must be a scalar (one element), but the function "
                             "returned a block of shape " + loss_shape_text(out.shape()) + " on device " +
                             std::to_string(out.device()) + "; reduce it with nn::sum / nn::mean first");
      using L = typename R::primal_type;
      t.accumulate<cotangent_t<L>>(out.id(), meshlib::map(one_fn{}, out.primal()));
      t.run_backward();
      auto grads = std::make_tuple(gradient_of(t, std::get<Argnums>(in).id(), std::get<Argnums>(std::tie(args...)))...);
      if constexpr (sizeof...(Argnums) == 1) {
        using G = std::tuple_element_t<0, decltype(grads)>;
        return value_and_grad_result<L, G>{out.primal(), std::get<0>(grads)};
      } else {
        return value_and_grad_result<L, decltype(grads)>{out.primal(), std::move(grads)};
      }
    }
  }

  template <class A>
  static const auto& unwrap(const A& a) {
    if constexpr (traced_type<A>) return a;
    else return a.get();
  }

  F f_;
};

}  // namespace detail

/// @brief `jax.value_and_grad(f, argnums=Argnums)`: a function that, called on a device's values,
/// returns `{value, grad}` (see the file comment). `Argnums` defaults to the first argument; one
/// index gives one gradient, several a `std::tuple` in that order.
template <std::size_t... Argnums, class F>
[[nodiscard]] auto value_and_grad(F f) {
  if constexpr (sizeof...(Argnums) == 0) return detail::value_and_grad_fn<F, false, 0>(std::move(f));
  else return detail::value_and_grad_fn<F, false, Argnums...>(std::move(f));
}

/// @brief `jax.value_and_grad(f, argnums=Argnums, has_aux=True)`: `f` returns a pair `(loss, aux)`;
/// the function returned gives back `{value, grad}` with `value` the `std::pair` `(loss, aux)`
/// (JAX's `((value, aux), grads)`); `aux` is not differentiated (see the file comment).
template <std::size_t... Argnums, class F>
[[nodiscard]] auto value_and_grad(F f, has_aux_t) {
  if constexpr (sizeof...(Argnums) == 0) return detail::value_and_grad_fn<F, true, 0>(std::move(f));
  else return detail::value_and_grad_fn<F, true, Argnums...>(std::move(f));
}

/// @brief `jax.grad(f, argnums=Argnums)`: `value_and_grad` without the value.
template <std::size_t... Argnums, class F>
[[nodiscard]] auto grad(F f) {
  return [vg = value_and_grad<Argnums...>(std::move(f))](const auto&... args) { return vg(args...).grad; };
}

/// @brief `jax.grad(f, argnums=Argnums, has_aux=True)`: `f` returns `(loss, aux)`; the function
/// returned gives back the `std::pair` `(grad, aux)`, as JAX's `(grads, aux)`.
template <std::size_t... Argnums, class F>
[[nodiscard]] auto grad(F f, has_aux_t) {
  return [vg = value_and_grad<Argnums...>(std::move(f), has_aux)](const auto&... args) {
    auto r = vg(args...);
    return std::pair<decltype(r.grad), decltype(r.value.second)>(std::move(r.grad), std::move(r.value.second));
  };
}

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/value_and_grad.hpp
// begin meshlib/nn/autodiff/function_layer.hpp
/// @file
/// @brief `function_layer`: a layer written as plain forward code, as a flax `nn.Module`'s
/// `__call__` or a haiku function: a forward function over traced values and the `parameter`s it
/// owns; its backward is derived by the tape (nn/autodiff), so it goes into `nn::sequential`,
/// `train_state` and `train_step` like any built-in layer, with no backward written by hand.
///
/// `forward(x)` records `f(x, p...)` on a tape of the running device (each parameter entering as
/// its block on that device); `backward<X>(dy)` walks that tape back from `dy`, writes (or adds,
/// as `parameter::grad_beta` says) every parameter's gradient into its `grad` block and returns the
/// input's cotangent. One forward's tape is kept per device until its backward.
///
/// Gradients follow the built-in layers' convention, not `value_and_grad`'s: the parameters enter
/// varying over the axes that shard the batch (the input's first dimension), so each device's
/// gradient is its share of the batch's gradient, a pending sum that the data-parallel policy
/// (or FSDP, ZeRO) completes, exactly as for `dense`. Axes that shard a parameter or that the
/// forward function reduces over itself (`nn::psum<"model">`) are handled by the tape as in
/// `value_and_grad`.
/// @code
/// using w_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, meshlib::none>>;
/// using b_s = meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none>>;
/// auto fc1 = meshlib::nn::function_layer(m, "fc1",
///     [](const auto& x, const auto& w, const auto& b) {          // relu(x w + b), written forward only
///       namespace nn = meshlib::nn;
///       return nn::maximum(nn::matmul(x, w) + nn::broadcast_in_dim<0>(b, x.extent(0)), 0.0f);
///     },
///     meshlib::nn::parameter<float, 2, w_s>("fc1.w", w_s{m}, {784, 256}, key, meshlib::nn::init::uniform(0.08f)),
///     meshlib::nn::parameter<float, 1, b_s>("fc1.b", b_s{m}, {256}, key, meshlib::nn::init::zeros(), false));
/// meshlib::nn::sequential net(std::move(fc1), meshlib::nn::dense<float, mesh_t>(m, "fc2", 256, 10, key));
/// @endcode

#include <any>
#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

namespace detail {

/// `g[i] = c[i]` (`add` false: the first write of a step) or `g[i] += c[i]`.
template <class T>
struct grad_write_functor {
  T* g;
  const T* c;
  bool add;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { g[i] = add ? g[i] + c[i] : c[i]; }
};

/// How parameter `P`'s block enters the tape when the batch is sharded over `Batch`: varying over
/// those axes too (see the file comment).
template <class P, axis_mask Batch>
using entered_param_t = with_vary_t<typename P::local_type, P::local_type::vary | (Batch & ~P::local_type::partial)>;

template <class Returned, class Forward>
consteval bool function_layer_returned_untraced() {
  static_assert(always_false_v<Returned, Forward>,
                "meshlib::nn: function_layer: the forward function returned a value the tape never saw (the forward "
                "function and the type it returned are spelled out in the condition), so no backward can be derived; "
                "compute the output from the traced arguments with meshlib::nn operations (nn::matmul(x, w), "
                "nn::tanh(h), ...), not with meshlib:: operations on .primal() or on local_tensors of your own");
  return false;
}

/// The output type of a forward that returned `R` for an input of type `X`: its primal type, or
/// `X` when `R` is not traced (`forward` then fires the one diagnostic, and the layers after it
/// are not checked against a type that does not exist).
template <class R, class X>
struct function_layer_output {
  using type = X;
};
template <traced_type R, class X>
struct function_layer_output<R, X> {
  using type = typename R::primal_type;
};

}  // namespace detail

/// @brief A layer whose forward is `f(x, params...)` over traced values and whose backward the
/// tape derives (see the file comment).
/// @tparam Mesh   the mesh type
/// @tparam F      the forward function: called with the traced input and one traced block per parameter
/// @tparam Params `parameter<T, Rank, Sharding>` types, owned by the layer
template <mesh_type Mesh, class F, class... Params>
class function_layer {
 public:
  /// The parameters, in the order `f` receives them.
  std::tuple<Params...> params;

  /// A layer named `name` on `mesh` computing `f(x, params...)`.
  function_layer(const Mesh& mesh, std::string name, F f, Params... ps)
      : params(std::move(ps)...), f_(std::move(f)), name_(std::move(name)), state_(mesh.size()) {}

  /// The layer's name (for messages).
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// `"fc1 (function_layer, 2 parameters)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (function_layer, " + std::to_string(sizeof...(Params)) + " parameters)";
  }

  /// The layer's output type for an input of type `X` (a `local_tensor`).
  template <local_tensor_type X>
  using output_t = typename detail::function_layer_output<
      std::remove_cvref_t<decltype(std::declval<const F&>()(
          std::declval<const traced<X>&>(),
          std::declval<const traced<detail::entered_param_t<Params, X::dims_type::at(0)>>&>()...))>,
      X>::type;

  /// `f(x, params...)`, recorded on this device's tape for the backward.
  template <local_tensor_type X>
  auto forward(const X& x) {
    const std::size_t dev = x.device();
    auto st = std::make_shared<device_state>();
    detail::tape& t = st->tape;
    const traced<X> tx(x, &t, t.leaf());
    constexpr axis_mask batch = X::dims_type::at(0);
    // Braced: the parameters enter the tape in order.
    std::tuple<traced<detail::entered_param_t<Params, batch>>...> tp = std::apply(
        [&](const auto&... p) {
          return std::tuple<traced<detail::entered_param_t<Params, batch>>...>{
              enter<detail::entered_param_t<Params, batch>>(p, dev, t)...};
        },
        params);
    auto y = std::apply([&](const auto&... p) { return f_(tx, p...); }, tp);
    using R = decltype(y);
    if constexpr (!traced_type<R>) {
      static_cast<void>(detail::function_layer_returned_untraced<R, F>());
      return x;  // the diagnostic above has fired
    } else {
      st->x = x;
      st->x_id = tx.id();
      st->out_id = y.id();
      std::apply([&](const auto&... p) { st->param_ids = {p.id()...}; }, tp);
      // The output is a tensor of the tape's, not a buffer of the layer's: the state holds it until
      // the backward, as a built-in layer's buffer lives until its next forward. The next layer
      // keeps only an unmanaged view of its input (nn/buffers.hpp); without this reference the
      // memory was freed when the caller's copy died and that layer's backward read whatever
      // reused it (a NaN gradient in a few runs of docs/autodiff.md's example).
      auto out = y.primal();
      st->y = out;
      state_[dev] = std::move(st);
      return out;
    }
  }

  /// Its backward names its input type (`backward<X>(dy)`), as `sequential` does.
  static constexpr bool backward_names_input = true;

  /// Walks the last forward's tape on `dy`'s device back from `dy`: writes (or adds, per
  /// `parameter::grad_beta`) each parameter's gradient into its `grad` block and returns the
  /// input's cotangent (zeros where the output does not depend on it; `need_dx` is not needed to
  /// skip work: the tape computes only what reaches the input).
  /// @throws sharding_error when no forward ran on the device since the last backward.
  template <local_tensor_type X, local_tensor_type DY>
  cotangent_t<X> backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(need_dx);
    const std::size_t dev = dy.device();
    std::shared_ptr<device_state> st = std::move(state_[dev]);
    if (!st)
      throw sharding_error("meshlib::nn: " + to_string() + ".backward ran on device " + std::to_string(dev) +
                           " without a forward there since the last backward; run forward first");
    using Y = output_t<X>;
    detail::tape& t = st->tape;
    t.accumulate<cotangent_t<Y>>(st->out_id, detail::retype<cotangent_t<Y>>(dy));
    t.run_backward();
    constexpr axis_mask batch = X::dims_type::at(0);
    write_grads<batch>(t, *st, dev, std::index_sequence_for<Params...>{});
    return detail::gradient_of(t, st->x_id, std::any_cast<const X&>(st->x));
  }

  /// Appends the parameters' untyped views (optimizers, synchronisation, checkpoints); the
  /// gradients are written with `grad_beta`.
  template <class T>
  void collect(std::vector<param_ref<T>>& out) {
    std::apply([&](auto&... p) { (out.push_back(p.ref(true)), ...); }, params);
  }

 private:
  struct device_state {
    detail::tape tape;
    std::any x;  // the input (its shape gives a zero cotangent where none arrives)
    std::any y;  // the output the next layer reads (and keeps an unmanaged view of) until the backward
    std::size_t x_id = 0, out_id = 0;
    std::array<std::size_t, sizeof...(Params)> param_ids{};
  };

  template <class E, class P>
  static traced<E> enter(const P& p, std::size_t dev, detail::tape& t) {
    return traced<E>(detail::retype<E>(p.local(dev)), &t, t.leaf());
  }

  template <axis_mask Batch, std::size_t... I>
  void write_grads(const detail::tape& t, const device_state& st, std::size_t dev, std::index_sequence<I...>) {
    (write_grad<Batch>(std::get<I>(params), t, st.param_ids[I], dev), ...);
  }

  template <axis_mask Batch, class P>
  static void write_grad(P& p, const detail::tape& t, std::size_t id, std::size_t dev) {
    using E = detail::entered_param_t<P, Batch>;
    using T = typename E::value_type;
    const E block = detail::retype<E>(p.local(dev));
    const auto g = detail::gradient_of(t, id, block);
    const bool add = p.grad_beta(dev) != T{0};
    meshlib::launch<typename E::memory_space>(g.size(), detail::grad_write_functor<T>{p.grad.local(dev).data(), g.data(), add});
  }

  F f_;
  std::string name_;
  std::vector<std::shared_ptr<device_state>> state_;  // per device: the last forward's tape
};

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/function_layer.hpp
// begin meshlib/nn/autodiff/function_loss.hpp
/// @file
/// @brief `function_loss(f)`: a regression loss written as plain forward code, as a JAX user writes
/// `loss_fn` and takes `jax.value_and_grad` of it: `f(z, t, global_batch)` over a device's block of
/// the model output `z` (traced) and its targets `t` (a constant tensor of `z`'s type: one float
/// target per output column) returns the mean loss over the *global* batch, one value every device
/// agrees on (reduced over the data axes with `nn::psum`, as `value_and_grad` requires). The
/// result is a `loss_function` (nn/loss_function.hpp) that `train_step` takes like the built-in
/// losses: its gradient with respect to `z` comes from the tape (nn/autodiff/value_and_grad.hpp).
/// @code
/// auto mse = meshlib::nn::function_loss([](const auto& z, const auto& t, std::size_t batch) {
///   auto d = z - t;                                           // (rows, F), rows sharded over 'data'
///   return meshlib::nn::psum<"data">(meshlib::nn::sum<0>(meshlib::nn::sum<1>(meshlib::nn::square(d)))) *
///          (1.0f / static_cast<float>(batch * F));             // mean over the global batch and F
/// });
/// auto m = meshlib::nn::train_step(state, x, targets, rows, 0, rows, mse);
/// @endcode
/// The output's columns must be complete (not sharded over a model axis: the last layer of a
/// tensor-parallel model is a `row_dense` or replicated); a step's loss is the value `f` returns,
/// added over the micro-batches of an accumulated step.

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief A loss of float targets written as forward code `F` (see the file comment).
template <class F>
struct function_loss {
  /// One float target per output column, row-major (as `mean_squared_error`).
  using target_type = float;
  /// `f(z, t, global_batch)`: the mean loss over the global batch (see the file comment).
  F f;

  /// The loss computed by `fn`.
  explicit function_loss(F fn) : f(std::move(fn)) {}

  /// This device's rows' share of the value `f` returns, and `grad = d value / d output` of this
  /// device's block (from the tape).
  /// @throws sharding_error when the targets are not one per output element of this device's rows.
  template <local_tensor_type Z>
  double operator()(const Z& z, std::span<const float> targets, std::size_t global_batch, Z& grad) const {
    static_assert(Z::dims_type::at(1) == 0 && Z::partial == 0,
                  "meshlib::nn: function_loss takes complete output rows: the model's last layer leaves its "
                  "columns sharded over a model axis (or a pending sum); end the model with a row_dense or a "
                  "replicated layer");
    using T = typename Z::value_type;
    using Space = typename Z::memory_space;
    const std::size_t rows = z.extent(0), cols = z.extent(1);
    if (targets.size() != rows * cols)
      throw sharding_error("meshlib::nn: function_loss: device " + std::to_string(z.device()) + " received " +
                           std::to_string(targets.size()) + " targets for its " + std::to_string(rows) + " rows of " +
                           std::to_string(cols) + " outputs; pass one float target per output column of every row");
    Z t(std::array<std::size_t, 2>{rows, cols}, z.mesh(), z.device());
    if constexpr (std::is_same_v<T, float>) {
      meshlib::copy_from_host<Space>(t.data(), targets.data(), targets.size());
    } else {
      std::vector<T> converted(targets.begin(), targets.end());
      meshlib::copy_from_host<Space>(t.data(), converted.data(), converted.size());
    }
    const auto vg = value_and_grad([&](const auto& zs) { return f(zs, t, global_batch); })(z);
    // (A kernel of nn's, not a lambda here: nvcc refuses an extended lambda in a function whose
    // template arguments include a type local to a function, as the user's `F` often is.)
    detail::convert_copy<Space>(grad.data(), vg.grad.data(), grad.size());
    // The value is the whole (micro-)batch's; train_step adds the devices' shares over the data
    // axes, so each device reports its rows' fraction of it.
    const double whole = static_cast<double>(to_host(vg.value)[0]);
    return whole * static_cast<double>(rows) / static_cast<double>(z.global_extent(0));
  }
};

}  // namespace meshlib::nn
// end meshlib/nn/autodiff/function_loss.hpp
// end meshlib/nn/autodiff.hpp
// begin meshlib/nn/schedule.hpp
/// @file
/// @brief Learning-rate schedules (optax's `constant_schedule`, `linear_schedule` warm-up and
/// `warmup_cosine_decay_schedule`): a pure function of the step, so every device computes the same.
/// @code
/// auto lr = meshlib::nn::warmup_cosine(1e-3f, 100, 1000);   // 0 -> 1e-3 over 100 steps, cosine to 0 at 1000
/// float now = lr(250);
/// @endcode

#include <cmath>
#include <cstddef>

namespace meshlib::nn {

/// @brief `lr(step)`: `peak` after a linear warm-up of `warmup` steps, then constant (`total == 0`)
/// or a cosine decay to `peak * final_fraction` at step `total`. A plain number converts to the
/// constant schedule, as optax takes a float wherever it takes a schedule: `adam(1e-3f)` is
/// `adam(constant(1e-3f))`.
struct schedule {
  /// The default: a constant 1e-3.
  constexpr schedule() noexcept = default;
  /// The constant rate `lr` (implicit: a number is a schedule).
  constexpr schedule(float lr) noexcept : peak(lr), final_fraction(1.0f) {}  // NOLINT(google-explicit-constructor)
  /// Every field, in declaration order.
  constexpr schedule(float peak_, std::size_t warmup_, std::size_t total_, float final_fraction_) noexcept
      : peak(peak_), warmup(warmup_), total(total_), final_fraction(final_fraction_) {}

  /// The learning rate after warm-up.
  float peak = 1e-3f;
  /// Steps of linear warm-up from `peak / warmup` to `peak`.
  std::size_t warmup = 0;
  /// The step where the cosine decay ends (0: no decay).
  std::size_t total = 0;
  /// The final rate as a fraction of `peak`.
  float final_fraction = 0.0f;

  /// The learning rate at `step` (counted from 0).
  [[nodiscard]] float operator()(std::size_t step) const noexcept {
    if (step < warmup) return peak * static_cast<float>(step + 1) / static_cast<float>(warmup);
    if (total == 0) return peak;
    if (step >= total) return peak * final_fraction;
    const double t = static_cast<double>(step - warmup) / static_cast<double>(total > warmup ? total - warmup : 1);
    const double c = 0.5 * (1.0 + std::cos(3.141592653589793 * t));
    return static_cast<float>(peak * (final_fraction + (1.0 - final_fraction) * c));
  }
};

/// @brief A constant rate (`optax.constant_schedule`).
inline schedule constant(float lr) { return schedule{lr, 0, 0, 1.0f}; }
/// @brief A linear warm-up to `lr` over `warmup` steps, then constant.
inline schedule linear_warmup(float lr, std::size_t warmup) { return schedule{lr, warmup, 0, 1.0f}; }
/// @brief Linear warm-up, then cosine decay to 0 at `total` (`optax.warmup_cosine_decay_schedule`).
inline schedule warmup_cosine(float lr, std::size_t warmup, std::size_t total, float final_fraction = 0.0f) {
  return schedule{lr, warmup, total, final_fraction};
}

}  // namespace meshlib::nn
// end meshlib/nn/schedule.hpp
// begin meshlib/nn/optimizer.hpp
/// @file
/// @brief `optimizer`: any gradient transform (nn/optim/transform.hpp), held by value with its type
/// erased, as the train state keeps it; and the named chains `sgd`, `adam`, `adamw` and `lion`
/// and `adafactor` (optax's). Every transform updates one element from that element's gradient and state only
/// (clipping aside, which reads one norm over the mesh; Adafactor aside, which reads whole
/// parameters, summing its statistics over the pieces of a tensor-parallel, FSDP or ZeRO-1
/// parameter), which is what lets the same chain run on a replicated state or on a ZeRO-1 / FSDP
/// shard of it with identical numbers (Adafactor's: up to the order of those sums).
/// @code
/// namespace nn = meshlib::nn;
/// nn::optimizer opt = nn::adamw(nn::warmup_cosine(1e-3f, 100, 2000), 1e-4f);
/// nn::optimizer simple = nn::adam(1e-3f);   // a number is a constant schedule
/// nn::optimizer mine = nn::chain(nn::clip_by_global_norm(1.0f), nn::scale_by_adam(),
///                                nn::add_decayed_weights(1e-4f), nn::scale_by_learning_rate(1e-3f));
/// @endcode

#include <array>
#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

// begin meshlib/nn/optim/adam.hpp
/// @file
/// @brief `scale_by_adam(b1, b2, eps)` (optax's): Adam's bias-corrected moment ratio
/// `m_hat / (sqrt(v_hat) + eps)`, two state slots per element (first and second moments).
/// `nn::adam` is `chain(scale_by_adam(...), scale_by_learning_rate(lr))`.

#include <array>
#include <cmath>
#include <cstddef>
#include <string>

// begin meshlib/nn/optim/detail/fusion.hpp
/// @file
/// @brief How built-in transforms share one kernel: a transform with a `step_type` (an elementwise
/// step of optim/detail/kernels.hpp) and its `constants(run)` is `fusable`; a chain of fusable
/// transforms runs their steps as one kernel (optim/chain.hpp), and its last stage adds the result
/// to the parameter in that same pass (`update_and_apply`). A transform without them (a user's)
/// runs on its own, and the parameter is updated by a pass of its own.
///
/// The train state hands the last stage every run of a device at once (`update_batch`): a chain of
/// fusable transforms updates and applies them all in one multi-tensor kernel (a run table, as the
/// gradient norm's), other transforms run by run (`update_and_apply_all_of`).

#include <array>
#include <cstddef>
#include <span>
#include <vector>

// begin meshlib/nn/optim/detail/kernels.hpp
/// @file
/// @brief The elementwise steps of the built-in gradient transforms, and `fused_body`, which runs a
/// sequence of them as one kernel (`for_lanes`, nn/detail/simd.hpp, on `float` and `simd_float`
/// alike): a chain of built-in transforms reads and writes each element once, as the fused
/// optimizer kernels before transforms composed did. Each step keeps the exact expression of those
/// kernels (`(m * c1) / (sqrt(v * c2) + eps)`, ...), so `adam`, `adamw` and `sgd` give their numbers
/// bit for bit (tests/unit/nn/test_optim.cpp): `p - lr * x == p + (-lr) * x` exactly in IEEE
/// arithmetic. Classes, not generic lambdas, which nvcc refuses in device code.
///
/// A step is a class with `constants` (floats per step it reads, `k[0..]`), `slots` (state floats
/// per element) and `apply(i, x, k, s, p)`: the new update of element `i` from the update `x`, its
/// constants `k`, its state slots `s` and the parameter `p`.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>


namespace meshlib::nn::detail {

/// `x * k[0]`: clip, scale, schedule, learning rate.
struct scale_step {
  static constexpr std::size_t constants = 1, slots = 0;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t, L x, const K* k, float* const*, const float*) {
    return x * k[0];
  }
};

/// `x + wd p` (`k = {wd}`): decoupled weight decay.
struct decay_step {
  static constexpr std::size_t constants = 1, slots = 0;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L x, const K* k, float* const*, const float* p) {
    return x + k[0] * load_as(p, i, k[0]);
  }
};

/// Momentum: `m = decay m + x`, the update `m` (`k = {decay}`).
struct trace_step {
  static constexpr std::size_t constants = 1, slots = 1;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L x, const K* k, float* const* s, const float*) {
    const L mi = k[0] * load_as(s[0], i, k[0]) + x;
    store_at(s[0], i, mi);
    return mi;
  }
};

/// Adam's scaling (`k = {b1, 1 - b1, b2, 1 - b2, c1, c2, eps}`; c1, c2: the bias corrections).
struct adam_step {
  static constexpr std::size_t constants = 7, slots = 2;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L gi, const K* k, float* const* s, const float*) {
    const L mi = k[0] * load_as(s[0], i, k[0]) + k[1] * gi;
    const L vi = k[2] * load_as(s[1], i, k[0]) + k[3] * gi * gi;
    store_at(s[0], i, mi);
    store_at(s[1], i, vi);
    return (mi * k[4]) / (sqrt_of(vi * k[5]) + k[6]);
  }
};

/// -1, 0 or 1 as `x` is negative, zero or positive (NaN: 0).
KOKKOS_INLINE_FUNCTION float sign_of(float x) noexcept { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
#if MESHLIB_NN_SIMD
inline simd_float sign_of(simd_float x) noexcept {
  simd_float r;
  for (std::size_t j = 0; j < simd_lanes; ++j) r[j] = sign_of(static_cast<float>(x[j]));
  return r;
}
#endif

/// Lion's scaling: the update `sign(b1 m + (1 - b1) x)`, then `m = b2 m + (1 - b2) x`
/// (`k = {b1, 1 - b1, b2, 1 - b2}`).
struct lion_step {
  static constexpr std::size_t constants = 4, slots = 1;
  template <class L, class K>
  KOKKOS_INLINE_FUNCTION static L apply(std::size_t i, L gi, const K* k, float* const* s, const float*) {
    const L mi = load_as(s[0], i, k[0]);
    store_at(s[0], i, k[2] * mi + k[3] * gi);
    return sign_of(k[1] * gi + k[0] * mi);
  }
};

/// Total constants and slots of `Steps`.
template <class... Steps>
inline constexpr std::size_t constants_of = (std::size_t{0} + ... + Steps::constants);
template <class... Steps>
inline constexpr std::size_t slots_of = (std::size_t{0} + ... + Steps::slots);

/// The steps `Steps` one after the other on each element: the constants `k` are `{0}` (which only
/// gives the lane type) then each step's, the slots each step's in order. Stores the update to `u`,
/// or with `Apply` adds it to the parameter instead (optax's `apply_updates` in the same pass).
template <bool Apply, class... Steps>
struct fused_body {
  float* u;        ///< the updates
  const float* p;  ///< the parameter, read
  float* out;      ///< with `Apply`: the parameter, written (`p`)
  std::array<float*, slots_of<Steps...> + 1> s;  // + 1: no zero-length array when no step has state

  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    auto x = load_as(u, i, k[0]);
    if constexpr (sizeof...(Steps) > 0) run<1, 0, Steps...>(i, x, k);
    if constexpr (Apply) store_at(out, i, load_as(p, i, k[0]) + x);
    else store_at(u, i, x);
  }

 private:
  template <std::size_t C, std::size_t O, class Step, class... Rest, class L, class K>
  KOKKOS_INLINE_FUNCTION void run(std::size_t i, L& x, const K& k) const {
    x = Step::apply(i, x, k.data() + C, s.data() + O, p);
    if constexpr (sizeof...(Rest) > 0) run<C + Step::constants, O + Step::slots, Rest...>(i, x, k);
  }
};

/// Runs `Steps` over `n` elements (see `fused_body`): `k` their constants after the leading 0,
/// `state` their slots, `out` the parameter to add the updates to (`Apply`; else they stay in `u`).
template <bool Apply, class... Steps, std::size_t N>
void run_steps(float* u, const float* p, float* out, float* const* state, std::size_t n,
               const std::array<float, N>& k) {
  static_assert(N == 1 + constants_of<Steps...>, "meshlib::nn: the steps' constants, after a leading 0");
  fused_body<Apply, Steps...> body{u, p, out, {}};
  if constexpr (slots_of<Steps...> > 0)  // (nvcc warns of `j < 0` otherwise)
    for (std::size_t j = 0; j < slots_of<Steps...>; ++j) body.s[j] = state[j];
  for_lanes<default_memory_space>(n, k, body);
}

/// Words per run of a multi-tensor optimizer table (`fused_runs_kernel`): the updates, the parameter
/// read, the parameter written (with `Apply`), the run's first block over all the runs, its length,
/// then its `slots_of<Steps...>` state slots and its `constants_of<Steps...>` constants (each float's
/// bits in a word of its own).
template <class... Steps>
inline constexpr std::size_t fused_run_words = 5 + slots_of<Steps...> + constants_of<Steps...>;

/// Block `b` of a multi-tensor optimizer update: the `fused_body` of its run over the block, with
/// the run's own constants (a decay mask gives runs different ones; the bias corrections are the
/// same). The blocks start at each run's first element and `lanes_of_block` runs each as
/// `for_lanes` runs it, so every element goes through the same operations as in `run_steps` on
/// its run alone: the numbers are bitwise those of one kernel per run (issue 38: one launch per
/// device instead of one per parameter).
template <bool Apply, class... Steps>
struct fused_runs_kernel {
  const std::size_t* table;  ///< `runs` runs of `fused_run_words<Steps...>` words, in the kernel's memory
  std::size_t runs;          ///< runs in the table (none empty)

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    constexpr std::size_t words = fused_run_words<Steps...>, slots = slots_of<Steps...>;
    constexpr std::size_t constants = constants_of<Steps...>;
    const std::size_t* w = table + run_of_block(table, runs, b, words, 3) * words;
    fused_body<Apply, Steps...> body{reinterpret_cast<float*>(w[0]), reinterpret_cast<const float*>(w[1]),
                                     reinterpret_cast<float*>(w[2]), {}};
    if constexpr (slots > 0)
      for (std::size_t j = 0; j < slots; ++j) body.s[j] = reinterpret_cast<float*>(w[5 + j]);
    std::array<float, 1 + constants> k{};
    if constexpr (constants > 0)
      for (std::size_t j = 0; j < constants; ++j) k[1 + j] = float_of_word(w[5 + slots + j]);
    const std::size_t n = w[4], i0 = (b - w[3]) * kernel_block, i1 = i0 + kernel_block < n ? i0 + kernel_block : n;
    lanes_of_block(i0, i1, k, body);
  }

  /// The float whose bits word `x` holds (`word_of_float`).
  KOKKOS_INLINE_FUNCTION static float float_of_word(std::size_t x) noexcept {
    const auto bits = static_cast<std::uint32_t>(x);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

/// `f`'s bits in a table word (`fused_runs_kernel::float_of_word` reads them back).
inline std::size_t word_of_float(float f) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

/// Runs `Steps` over every run of `table` (`runs` runs, `blocks` blocks of `kernel_block` elements
/// in all; see `fused_runs_kernel`) as one Kokkos kernel on memory `Space`.
template <class Space, bool Apply, class... Steps>
void run_steps_over_runs(const std::size_t* table, std::size_t runs, std::size_t blocks) {
  if (blocks == 0) return;
  meshlib::launch<Space>(blocks, fused_runs_kernel<Apply, Steps...>{table, runs});
}

/// `p += u` over `n` elements (optax's `apply_updates`; `u` is only read).
inline void apply_updates(float* p, float* u, std::size_t n) {
  run_steps<true>(u, p, p, nullptr, n, std::array<float, 1>{0.0f});
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/optim/detail/kernels.hpp
// begin meshlib/nn/optim/transform.hpp
/// @file
/// @brief `gradient_transform`: what an optax-style gradient transformation is here (optax's
/// `GradientTransformation(init, update)`), and `update_run`, the elements one call updates.
///
/// A transform's state is `slots()` floats per element of every parameter, zero at the start
/// (optax's `init` for elementwise state: `adam`'s moments, `trace`'s momentum). The train state
/// stores them in its optimizer state, replicated or ZeRO-1 / FSDP sharded exactly like the
/// parameter, so every transform runs unchanged on any sharding. `update` turns the updates of a
/// run of elements (on entry to the chain, the gradient) into new updates, in place, reading and
/// writing its state slots for those elements; after the whole chain the train state applies
/// `param += update` (optax's `apply_updates`).
///
/// A run is a piece of one parameter's local block: the whole block (replicated state, FSDP's
/// shards) or the part of it in this device's ZeRO-1 slice. An elementwise transform does not care
/// which. A transform that needs the norm of every update over the whole mesh (clipping) says so
/// with `reads_global_norm`: the train state then ends a stage there, sums the squares of the
/// updates over every device, and passes the norm in `update_run::global_norm`.
///
/// A transform whose state is not per element (Adafactor's factored second moment: a row and a
/// column vector per matrix, O(rows + cols) instead of O(rows x cols)) says so with
/// `param_state_size(param)`: the floats it keeps per parameter, zero at the start. The train state
/// holds them whole on every device that holds a block of the parameter (alike on all of them: such
/// a transform makes them so, summing its statistics over the parameter's pieces through
/// `update_run::blocks`: tensor-parallel blocks, FSDP shards, ZeRO-1 runs), checkpoints save them
/// once, and `update_run::param_state` points at them.
/// @code
/// struct scale_by_sign {   // a user-written transform: update = sign(update), no state
///   std::size_t slots() const { return 0; }
///   void update(const meshlib::nn::update_run& r) const {
///     for (std::size_t i = 0; i < r.size; ++i) r.updates[i] = float(r.updates[i] > 0) - float(r.updates[i] < 0);
///   }
/// };
/// auto opt = meshlib::nn::chain(scale_by_sign{}, meshlib::nn::scale_by_learning_rate(1e-3f));
/// @endcode

#include <concepts>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace meshlib::nn {

/// @brief The parameter a run belongs to, as masks and label functions see it.
struct param_info {
  std::string_view name;               ///< the parameter's name, such as `"fc1.w"`
  std::span<const std::size_t> shape;  ///< its global shape
  bool decay = true;                   ///< the layer's own say: weights `true`, biases and norms `false`
};

/// @brief Where a device's block of a parameter lies, for a transform whose statistics are over
/// the whole parameter (`param_state_size`): the block's offset and extent per dimension (the run
/// is elements `[offset, offset + size)` of it, `update_run`), and a sum over the devices that hold
/// the parameter's other pieces (its tensor-parallel and fsdp axes; under ZeRO-1 also the data
/// axes, whose devices each hold a run of the same block), after which every one of them holds the
/// same numbers (the collectives' sums are deterministic).
class param_blocks {
 public:
  /// (Polymorphic: the train state implements it over its mesh.)
  virtual ~param_blocks() = default;
  /// Where the block starts in the parameter, per dimension.
  [[nodiscard]] virtual std::span<const std::size_t> offset() const = 0;
  /// The block's extent per dimension (row-major, as its elements lie in the run).
  [[nodiscard]] virtual std::span<const std::size_t> extent() const = 0;
  /// Whether the parameter is split over several devices (false: the block is all of it, and so is
  /// the run).
  [[nodiscard]] virtual bool split() const = 0;
  /// Sums `x` elementwise, in place, over the devices that hold the parameter's pieces (each calls
  /// it, in the same order; under ZeRO-1 also one whose slice holds none of it, with an empty run).
  /// `x` is in the running device's memory.
  virtual void sum(std::span<float> x) const = 0;
  /// As above, in double (Adafactor's factored sums, the block RMS's sum of squares).
  virtual void sum(std::span<double> x) const = 0;
};

/// @brief The elements one `update` call transforms: `size` consecutive elements of a parameter's
/// local block, in the memory of the running device (`default_memory_space`).
struct update_run {
  float* updates = nullptr;        ///< the updates, transformed in place (on entry to the chain: the gradient)
  const float* params = nullptr;   ///< the parameter's values there (float master weights)
  std::span<float* const> state;   ///< this transform's `slots()` state slots, each `size` floats for these elements
  std::size_t size = 0;            ///< elements in the run
  std::size_t offset = 0;          ///< index of the first element in the parameter's local block
  std::size_t step = 0;            ///< the optimizer step being taken, counted from 0
  std::size_t stage = 0;           ///< which of the transform's `stages()` runs
  double global_norm = 0;          ///< stages that `reads_global_norm`: the updates' norm over every device
  param_info param;                ///< the parameter
  float* param_state = nullptr;    ///< this transform's `param_state_size(param)` floats for the parameter (null: none)
  const param_blocks* blocks = nullptr;  ///< where the run's block lies in the parameter (null: the run is all of it)
};

/// @brief A gradient transformation (see the file comment). Required: `slots()`, the state floats
/// per element, and `update(const update_run&)`, both const. Optional: `name()` (for logs; a
/// string), `kind()` (what checkpoints record; no spaces), `stages()` (default 1),
/// `reads_global_norm(stage)` (default false), `param_state_size(const param_info&)` (default 0:
/// floats of per-parameter state, see the file comment), `whole_parameters()` (default false: true
/// for a transform whose statistics are over every element of a parameter, as Adafactor's: it gets
/// `update_run::blocks`, and under ZeRO-1 a run of every parameter, empty where a device holds none,
/// so that its sums over the pieces match on every device) and `update_and_apply(run, float*
/// params)`, the update and then `params += updates` in one pass (default: `update`, then a pass
/// that adds them).
/// (The members are tested first: a type without them is rejected before its copy constructor is
/// asked for, which for `optimizer`'s converting constructor would ask itself.)
template <class T>
concept gradient_transform = requires(const T& t, const update_run& r) {
  { t.slots() } -> std::convertible_to<std::size_t>;
  { t.update(r) } -> std::same_as<void>;
} && std::copy_constructible<T>;

namespace detail {

/// The diagnostics for a type that is not a `gradient_transform`, one per missing member; the
/// type's name is in theirs (`transform_has_no_update<false, my_transform>`), since the message
/// cannot spell it.
template <bool Ok, class Transform>
struct transform_has_no_slots {
  static_assert(Ok, "meshlib::nn: the type is not a meshlib::nn::gradient_transform (the type in "
                    "transform_has_no_slots<ok, Transform>): it has no const member slots() returning the number of "
                    "state floats per element; add std::size_t slots() const { return 0; } for none");
  static constexpr bool value = Ok;
};
template <bool Ok, class Transform>
struct transform_has_no_update {
  static_assert(Ok, "meshlib::nn: the type is not a meshlib::nn::gradient_transform (the type in "
                    "transform_has_no_update<ok, Transform>): it has no const member "
                    "void update(const meshlib::nn::update_run&) that transforms the run's updates in place");
  static constexpr bool value = Ok;
};
template <bool Ok, class Transform>
struct transform_is_not_copyable {
  static_assert(Ok, "meshlib::nn: the type is not a meshlib::nn::gradient_transform (the type in "
                    "transform_is_not_copyable<ok, Transform>): it is not copy-constructible (an optimizer copies "
                    "its transforms); keep state in the update_run's slots, not in the object");
  static constexpr bool value = Ok;
};

/// The one diagnostic for a type that is not a `gradient_transform` (STYLE.md: one static_assert,
/// on the first unmet requirement, naming the concept and the member that is missing). True for a
/// transform. Called outside a constant expression (Clang then reports no second error).
template <class T>
bool diagnose_gradient_transform() {
  if constexpr (!requires(const T& t) {
                  { t.slots() } -> std::convertible_to<std::size_t>;
                })
    return transform_has_no_slots<false, T>::value;
  else if constexpr (!requires(const T& t, const update_run& r) {
                       { t.update(r) } -> std::same_as<void>;
                     })
    return transform_has_no_update<false, T>::value;
  else if constexpr (!std::copy_constructible<T>)
    return transform_is_not_copyable<false, T>::value;
  else
    return true;
}

/// What a factory returns after `diagnose_gradient_transform` fired: a transform, so that the
/// caller's code gives no second error.
struct not_a_transform {
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  void update(const update_run&) const {}
};

/// `t.stages()`, or 1.
template <class T>
std::size_t stages_of(const T& t) {
  if constexpr (requires { t.stages(); }) return t.stages();
  else return 1;
}
/// `t.reads_global_norm(stage)`, or false.
template <class T>
bool reads_global_norm_of(const T& t, std::size_t stage) {
  if constexpr (requires { t.reads_global_norm(stage); }) return t.reads_global_norm(stage);
  else return false;
}
/// `t.whole_parameters()` (the transform's statistics are over every element of a parameter), or false.
template <class T>
bool whole_parameters_of(const T& t) {
  if constexpr (requires { t.whole_parameters(); }) return t.whole_parameters();
  else return false;
}
/// `t.param_state_size(p)` (floats of per-parameter state), or 0.
template <class T>
std::size_t param_state_size_of(const T& t, const param_info& p) {
  if constexpr (requires { t.param_state_size(p); }) return t.param_state_size(p);
  else return 0;
}
/// `t.name()`, or "custom".
template <class T>
std::string name_of(const T& t) {
  if constexpr (requires { std::string(t.name()); }) return std::string(t.name());
  else return "custom";
}
/// `t.kind()`, or "custom".
template <class T>
std::string kind_of(const T& t) {
  if constexpr (requires { std::string(t.kind()); }) return std::string(t.kind());
  else return "custom";
}

}  // namespace detail

/// @brief Which parameters a transform applies to (optax's `mask`): a callable over the
/// parameter's name (`bool(std::string_view)`) or over its `param_info` (`bool(const param_info&)`).
class param_mask {
 public:
  /// Every parameter.
  param_mask() : f_([](const param_info&) { return true; }) {}
  /// The parameters for which `f` is true.
  template <class F>
    requires(!std::same_as<std::remove_cvref_t<F>, param_mask> &&
             (std::is_invocable_r_v<bool, const F&, const param_info&> ||
              std::is_invocable_r_v<bool, const F&, std::string_view>))
  param_mask(F f) {  // NOLINT(google-explicit-constructor): a lambda is a mask
    if constexpr (std::is_invocable_r_v<bool, const F&, const param_info&>)
      f_ = std::move(f);
    else
      f_ = [g = std::move(f)](const param_info& p) { return static_cast<bool>(g(p.name)); };
  }
  /// Whether the transform applies to `p`.
  [[nodiscard]] bool operator()(const param_info& p) const { return f_(p); }

 private:
  std::function<bool(const param_info&)> f_;
};

/// @brief The mask of the parameters whose layer marks them for weight decay (`param_ref::decay`:
/// weights yes, biases and normalisation scales no): `adamw`'s default.
inline param_mask decay_mask() {
  return param_mask([](const param_info& p) { return p.decay; });
}

}  // namespace meshlib::nn
// end meshlib/nn/optim/transform.hpp

namespace meshlib::nn::detail {

/// A transform whose update is one elementwise step.
template <class T>
concept fusable = requires(const T& t, const update_run& r) {
  typename T::step_type;
  { t.constants(r) } -> std::same_as<std::array<float, T::step_type::constants>>;
};

/// `t`'s step alone over the run.
template <fusable T>
void run_step(const T& t, const update_run& r) {
  using step = typename T::step_type;
  std::array<float, 1 + step::constants> k{};
  const auto kt = t.constants(r);
  for (std::size_t j = 0; j < step::constants; ++j) k[1 + j] = kt[j];
  run_steps<false, step>(r.updates, r.params, nullptr, r.state.data(), r.size, k);
}

/// `t.update(r)`, then `params += updates`: in one pass where `t` can (`update_and_apply`).
template <class T>
void update_and_apply_of(const T& t, const update_run& r, float* params) {
  if constexpr (requires { t.update_and_apply(r, params); }) {
    t.update_and_apply(r, params);
  } else {
    t.update(r);
    apply_updates(params, r.updates, r.size);
  }
}

/// Every run of one device in the last stage of a step, updated and applied together: `runs[i]`'s
/// updates are added to `params[i]`. `tables` and `words` (device `dev`'s) hold the run table a
/// multi-tensor kernel reads (`run_table_buffers`: copied to the device only when it changed).
struct update_batch {
  std::span<const update_run> runs;    ///< the runs, none overlapping another
  std::span<float* const> params;      ///< per run: where its updates are added
  run_table_buffers* tables = nullptr;  ///< the device's table in the kernels' memory
  std::vector<std::size_t>* words = nullptr;  ///< the device's table on the host (scratch)
  std::size_t dev = 0;                 ///< the device
};

/// `t.update_and_apply_all(b)` where `t` has it (a chain of fusable transforms: one kernel), else
/// `update_and_apply_of` run by run.
template <class T>
void update_and_apply_all_of(const T& t, const update_batch& b) {
  if constexpr (requires { t.update_and_apply_all(b); }) {
    t.update_and_apply_all(b);
  } else {
    for (std::size_t i = 0; i < b.runs.size(); ++i) update_and_apply_of(t, b.runs[i], b.params[i]);
  }
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/optim/detail/fusion.hpp

namespace meshlib::nn {

/// @brief See the file comment.
struct scale_by_adam {
  float b1 = 0.9f;    ///< decay rate of the first moment (the gradient's running mean)
  float b2 = 0.999f;  ///< decay rate of the second moment (the squared gradient's running mean)
  float eps = 1e-8f;  ///< added to the denominator's square root so the update stays finite

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 2; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_adam"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_adam"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::adam_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 7> constants(const update_run& r) const {
    // The bias corrections 1 / (1 - b^t), in double as the fused kernel before them did.
    const double t = static_cast<double>(r.step + 1);
    const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), t)));
    const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
    return {b1, 1.0f - b1, b2, 1.0f - b2, c1, c2, eps};
  }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
// end meshlib/nn/optim/adam.hpp
// begin meshlib/nn/optim/block_rms.hpp
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

// begin meshlib/nn/optim/detail/block_kernels.hpp
/// @file
/// @brief The kernels of the transforms that read a whole parameter (nn/optim/factored_rms.hpp,
/// nn/optim/block_rms.hpp): a deterministic sum of squares, and the row and column statistics of
/// Adafactor's factored second moment, of a whole parameter or of a run of a device's block of it
/// (a tensor-parallel block, an FSDP shard, a piece in a ZeRO-1 slice). Classes, not lambdas: nvcc refuses extended lambdas in
/// functions whose return type is deduced, and these are called from such code.
///
/// A parameter is a row-major array; its factored statistics are the arrays optax keeps, laid out
/// row-major too: `v_row` is the parameter's shape without dimension `d0`, `v_col` without `d1`.
/// `drop_dim` and `insert_dim` move between an element's index and the index of its statistic, so
/// any pair of dimensions of any rank goes through one code path.

#include <cmath>
#include <cstddef>
#include <vector>


namespace meshlib::nn::detail {

/// The index in the array without one dimension (stride `s`, extent `n`) of element `i`.
KOKKOS_INLINE_FUNCTION std::size_t drop_dim(std::size_t i, std::size_t s, std::size_t n) noexcept {
  return (i / (s * n)) * s + i % s;
}
/// The inverse of `drop_dim`: the element whose coordinate along the dropped dimension is `c`.
KOKKOS_INLINE_FUNCTION std::size_t insert_dim(std::size_t j, std::size_t s, std::size_t n, std::size_t c) noexcept {
  return (j / s) * (s * n) + c * s + j % s;
}

/// `sqrt(x)` on the host and in device kernels: `Kokkos::sqrt` (Kokkos 4), `std::sqrt` on Kokkos 3,
/// which has no `Kokkos::sqrt` (its builds run meshlib on the host only).
KOKKOS_INLINE_FUNCTION float sqrt_in_kernel(float x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

/// `out[c]` = the sum of squares of chunk `c` of `x`, in double (fixed chunks: the same bits on
/// every run and any number of threads).
struct chunk_squares {
  const float* x;
  double* out;
  std::size_t n, chunks;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t c) const {
    const std::size_t b = c * n / chunks, e = (c + 1) * n / chunks;
    double s = 0;
    for (std::size_t i = b; i < e; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    out[c] = s;
  }
};

/// The sum of the squares of the `n` floats at `x` (in the running device's memory).
inline double block_sum_of_squares(const float* x, std::size_t n) {
  if (n == 0) return 0;
  const std::size_t chunks = n < 256 ? n : 256;
  auto part = ::meshlib::allocate<double, 1>({chunks}, "meshlib::nn::block_sum_of_squares");
  ::meshlib::launch<default_memory_space>(chunks, chunk_squares{x, part.data(), n, chunks});
  std::vector<double> host(chunks);
  ::meshlib::copy_to_host<default_memory_space>(host.data(), part.data(), chunks);
  double s = 0;
  for (double v : host) s += v;
  return s;
}

/// A statistic of the factored second moment: `v[j] = beta v[j] + (1 - beta) mean_c (g^2 + eps)`,
/// the mean over the `n` elements along the dimension of stride `s` that statistic `j` sums.
struct factored_moment {
  const float* g;
  float* v;
  std::size_t s, n;
  float beta, eps;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const {
    double acc = 0;
    for (std::size_t c = 0; c < n; ++c) {
      const float x = g[insert_dim(j, s, n, c)];
      acc += static_cast<double>(x * x + eps);
    }
    v[j] = beta * v[j] + (1.0f - beta) * static_cast<float>(acc / static_cast<double>(n));
  }
};

/// `mean[o]`: the mean of `v_row` over dimension `d1` (stride `s` in `v_row`, extent `n`).
struct row_mean {
  const float* v_row;
  float* mean;
  std::size_t s, n;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t o) const {
    double acc = 0;
    for (std::size_t c = 0; c < n; ++c) acc += static_cast<double>(v_row[insert_dim(o, s, n, c)]);
    mean[o] = static_cast<float>(acc / static_cast<double>(n));
  }
};

/// The factored update: `u = g / sqrt(v_row / mean(v_row)) / sqrt(v_col)` (`u` may be `g`).
struct factored_scale {
  float* u;
  const float* v_row;
  const float* v_col;
  const float* mean;
  std::size_t s0, n0;  ///< stride and extent of `d0` (the largest dimension) in the parameter
  std::size_t s1, n1;  ///< of `d1` in the parameter
  std::size_t s1_row;  ///< of `d1` in `v_row`
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const std::size_t r = drop_dim(i, s0, n0);
    const float row = 1.0f / sqrt_in_kernel(v_row[r] / mean[drop_dim(r, s1_row, n1)]);
    const float col = 1.0f / sqrt_in_kernel(v_col[drop_dim(i, s1, n1)]);
    u[i] = u[i] * row * col;
  }
};

/// The unfactored update: `v = beta v + (1 - beta) (g^2 + eps)`, `u = g / sqrt(v)`.
struct unfactored_scale {
  float* u;
  float* v;
  float beta, eps;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const float g = u[i];
    const float vi = beta * v[i] + (1.0f - beta) * (g * g + eps);
    v[i] = vi;
    u[i] = g / sqrt_in_kernel(vi);
  }
};

/// Where the elements of a device's block of a parameter lie in the parameter: block element `i`
/// (row-major over the block's extents) to its row-major index in the whole parameter. Up to
/// `max_rank` dimensions (a fixed array: a kernel functor copies it by value).
struct block_map {
  static constexpr std::size_t max_rank = 8;  ///< the most dimensions a mapped parameter has
  std::size_t rank = 0;
  std::size_t extent[max_rank] = {};   ///< the block's extents
  std::size_t offset[max_rank] = {};   ///< where it starts in the parameter
  std::size_t stride[max_rank] = {};   ///< the parameter's row-major strides
  KOKKOS_INLINE_FUNCTION std::size_t global(std::size_t i) const noexcept {
    std::size_t g = 0;
    for (std::size_t d = rank; d-- > 0;) {
      g += (i % extent[d] + offset[d]) * stride[d];
      i /= extent[d];
    }
    return g;
  }
};

/// The partial sums of a factored statistic over a run of a block: for each of the block's lines
/// along the dimension of block stride `s` and extent `n` (line `j`: the block without that
/// dimension), `sums[statistic of the line] = sum (g^2 + eps)` over the line's elements in the run
/// (block elements `[lo, hi)`, at `g[0, hi - lo)`), the statistic's index in the whole parameter's
/// statistic (global stride `gs`, extent `gn` of that dimension), in double as `factored_moment`
/// sums a whole line (so the statistics of a parameter in pieces round to the same floats as its
/// unsharded ones but where the order of the double sums moves a rounding). `sums` starts at zero;
/// a line is one statistic, so no two lines write one entry. A whole block (`lo` 0, `hi` its size)
/// sums every line whole, in the same order; a ZeRO-1 run may hold a line in part or not at all
/// (then 0).
struct factored_partial_sums {
  const float* g;
  double* sums;
  block_map map;
  std::size_t s, n, gs, gn;
  float eps;
  std::size_t lo, hi;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const {
    const std::size_t first = insert_dim(j, s, n, 0);
    // The line's elements `first + c s` in `[lo, hi)`: `c` in `[c0, c1)`.
    const std::size_t c0 = first >= lo ? 0 : (lo - first + s - 1) / s;
    const std::size_t above = first >= hi ? 0 : (hi - first + s - 1) / s;
    const std::size_t c1 = above < n ? above : n;
    double acc = 0;
    for (std::size_t c = c0; c < c1; ++c) {
      const float x = g[first + c * s - lo];
      acc += static_cast<double>(x * x + eps);
    }
    sums[drop_dim(map.global(first), gs, gn)] = acc;
  }
};

/// `v[j] = beta v[j] + (1 - beta) sums[j] / n`: a statistic from the summed lines of every piece,
/// rounded as `factored_moment` rounds it.
struct moment_from_sums {
  float* v;
  const double* sums;
  std::size_t n;
  float beta;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const {
    v[j] = beta * v[j] + (1.0f - beta) * static_cast<float>(sums[j] / static_cast<double>(n));
  }
};

/// `factored_scale` of a run of a block (`u[i]` is block element `first + i`): each element reads
/// the statistics of its place in the parameter.
struct factored_scale_block {
  float* u;
  const float* v_row;
  const float* v_col;
  const float* mean;
  block_map map;
  std::size_t s0, n0;  ///< stride and extent of `d0` in the whole parameter
  std::size_t s1, n1;  ///< of `d1` in the whole parameter
  std::size_t s1_row;  ///< of `d1` in `v_row`
  std::size_t first;   ///< the run's first element in the block
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const std::size_t gi = map.global(first + i);
    const std::size_t r = drop_dim(gi, s0, n0);
    const float row = 1.0f / sqrt_in_kernel(v_row[r] / mean[drop_dim(r, s1_row, n1)]);
    const float col = 1.0f / sqrt_in_kernel(v_col[drop_dim(gi, s1, n1)]);
    u[i] = u[i] * row * col;
  }
};

/// The unfactored second moment of a run of a block (`g[i]` is block element `first + i`):
/// `sums[global(first + i)] = g^2 + eps` (the rest stay zero).
struct squares_to_global {
  const float* g;
  float* sums;
  block_map map;
  float eps;
  std::size_t first;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { sums[map.global(first + i)] = g[i] * g[i] + eps; }
};

/// `v = beta v + (1 - beta) sums` over the whole parameter (the summed squares of every block).
struct unfactored_moment {
  float* v;
  const float* sums;
  float beta;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const { v[j] = beta * v[j] + (1.0f - beta) * sums[j]; }
};

/// `u[i] = u[i] / sqrt(v[global(first + i)])`: the unfactored update of a run of a block.
struct unfactored_scale_block {
  float* u;
  const float* v;
  block_map map;
  std::size_t first;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    u[i] = u[i] / sqrt_in_kernel(v[map.global(first + i)]);
  }
};

/// `u[i] *= f`.
struct scale_by_factor {
  float* u;
  float f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { u[i] = u[i] * f; }
};

}  // namespace meshlib::nn::detail
// end meshlib/nn/optim/detail/block_kernels.hpp
// begin meshlib/nn/optim/factored_rms.hpp
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
// end meshlib/nn/optim/factored_rms.hpp

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
// end meshlib/nn/optim/block_rms.hpp
// begin meshlib/nn/optim/chain.hpp
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
// end meshlib/nn/optim/chain.hpp
// begin meshlib/nn/optim/clip.hpp
/// @file
/// @brief `clip_by_global_norm(max_norm)` (optax's, PyTorch's `clip_grad_norm_`): scales every
/// update by `max_norm / norm` when the norm of all of them together exceeds `max_norm`. The norm
/// is over every parameter and every device, each element counted once (the train state sums the
/// squares over the mesh, `update_run::global_norm`), so it is the same on any sharding.
/// @code
/// auto opt = meshlib::nn::chain(meshlib::nn::clip_by_global_norm(1.0f), meshlib::nn::adamw(3e-4f, 0.1f));
/// @endcode

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>


namespace meshlib::nn {

/// @brief See the file comment.
class clip_by_global_norm {
 public:
  /// Clips to `max_norm` (> 0).
  /// @throws std::invalid_argument when `max_norm` is not positive.
  explicit clip_by_global_norm(float max_norm) : max_norm_(max_norm) {
    if (!(max_norm > 0.0f))
      throw std::invalid_argument("meshlib::nn: clip_by_global_norm: max_norm is " + detail::number_text(max_norm) +
                                  "; it must be positive (leave the transform out to not clip)");
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// True: the stage reads `update_run::global_norm`, the updates' norm over every device.
  [[nodiscard]] bool reads_global_norm(std::size_t) const noexcept { return true; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "clip_by_global_norm(" + detail::number_text(max_norm_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "clip_by_global_norm"; }
  /// The factor for updates of norm `norm`: `max_norm / norm` when larger, else 1.
  [[nodiscard]] float factor(double norm) const noexcept {
    return norm > max_norm_ ? static_cast<float>(max_norm_ / norm) : 1.0f;
  }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::scale_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {factor(r.global_norm)}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if (factor(r.global_norm) != 1.0f) detail::run_step(*this, r);
  }

 private:
  float max_norm_;
};

}  // namespace meshlib::nn
// end meshlib/nn/optim/clip.hpp
// begin meshlib/nn/optim/lion.hpp
/// @file
/// @brief `scale_by_lion(b1, b2)` (optax's; Chen et al. 2023, "Symbolic Discovery of Optimization
/// Algorithms"): `update = sign(b1 m + (1 - b1) g)`, then `m = b2 m + (1 - b2) g`; one state slot.
/// `nn::lion` is `chain(scale_by_lion(...), add_decayed_weights(wd), scale_by_learning_rate(lr))`.

#include <array>
#include <cstddef>
#include <string>


namespace meshlib::nn {

/// @brief See the file comment.
struct scale_by_lion {
  float b1 = 0.9f;   ///< the interpolation of the sign's argument
  float b2 = 0.99f;  ///< decay rate of the momentum

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 1; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_lion"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_lion"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::lion_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 4> constants(const update_run&) const { return {b1, 1.0f - b1, b2, 1.0f - b2}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
// end meshlib/nn/optim/lion.hpp
// begin meshlib/nn/optim/masked.hpp
/// @file
/// @brief `masked(inner, mask)` (optax's `masked`): `inner` on the parameters of `mask`, the others'
/// updates passed through unchanged. Its state is `inner`'s, held for every parameter (the train
/// state's slots are per element of all of them) and left at zero where the mask is false.
/// @code
/// namespace nn = meshlib::nn;
/// auto embeddings = [](std::string_view name) { return name.starts_with("embed"); };
/// auto tx = nn::chain(nn::masked(nn::scale(0.1f), embeddings), nn::scale_by_learning_rate(1e-3f));
/// @endcode

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>


namespace meshlib::nn {

/// @brief The transform `masked` returns (see the file comment).
template <gradient_transform T>
class masked_transform {
 public:
  /// `inner` where `mask` holds.
  /// @throws std::invalid_argument when `inner` reads the global norm (a clip): that norm is over
  /// every parameter, which a mask cannot restrict.
  masked_transform(T inner, param_mask mask) : inner_(std::move(inner)), mask_(std::move(mask)) {
    for (std::size_t s = 0; s < detail::stages_of(inner_); ++s)
      if (detail::reads_global_norm_of(inner_, s))
        throw std::invalid_argument("meshlib::nn: masked: " + detail::name_of(inner_) +
                                    " reads the global norm of every parameter's updates, which a mask cannot "
                                    "restrict; put it outside masked, in the chain");
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const { return inner_.slots(); }
  /// Floats of per-parameter state for `p`: `inner`'s (kept for every parameter, as its slots).
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const {
    return detail::param_state_size_of(inner_, p);
  }
  /// How many stages `update` runs in (the train state runs each over every run before the next).
  [[nodiscard]] std::size_t stages() const { return detail::stages_of(inner_); }
  /// Whether `inner` reads statistics of whole parameters (`adafactor`).
  [[nodiscard]] bool whole_parameters() const { return detail::whole_parameters_of(inner_); }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "masked(" + detail::name_of(inner_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "masked(" + detail::kind_of(inner_) + ")"; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if (mask_(r.param)) inner_.update(r);
  }

 private:
  T inner_;
  param_mask mask_;
};

/// @brief `inner` on the parameters of `mask` only (see the file comment).
template <class T>
auto masked(T inner, param_mask mask) {
  if constexpr (gradient_transform<T>) {
    return masked_transform<T>(std::move(inner), std::move(mask));
  } else {
    (void)detail::diagnose_gradient_transform<T>();
    return detail::not_a_transform{};
  }
}

}  // namespace meshlib::nn
// end meshlib/nn/optim/masked.hpp
// begin meshlib/nn/optim/scale.hpp
/// @file
/// @brief Scaling transforms: `scale(c)`, `scale_by_schedule(f)` with any callable `f(step) ->
/// float` (optax's `scale_by_schedule`) and `scale_by_learning_rate(lr)`, which multiplies by
/// `-lr(step)` so that the train state's `param += update` descends (optax's convention).
/// @code
/// auto lr = meshlib::nn::scale_by_learning_rate([](std::size_t step) { return 1e-3f / std::sqrt(step + 1.0f); });
/// auto tx = meshlib::nn::chain(meshlib::nn::scale_by_adam(), lr);
/// @endcode

#include <array>
#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>


namespace meshlib::nn {

/// @brief A function of the step (0-based) to a float: a number, `nn::schedule` or any callable.
using step_function = std::function<float(std::size_t)>;

/// @brief `update *= factor(step)`, no state (optax's `scale_by_schedule`; `scale` for a number).
class scale_by_schedule {
 public:
  /// Multiplies by `f(step)`; a number is a constant.
  template <class F>
    requires std::is_invocable_r_v<float, const F&, std::size_t>
  explicit scale_by_schedule(F f, std::string name = "scale_by_schedule") : f_(std::move(f)), name_(std::move(name)) {}
  /// Multiplies by `c` at every step.
  explicit scale_by_schedule(float c) : f_(schedule(c)), name_("scale(" + detail::number_text(c) + ")") {}

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return name_; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_schedule"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::scale_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {f_(r.step)}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }

 private:
  step_function f_;
  std::string name_;
};

/// @brief `update *= c` (optax's `scale`).
inline scale_by_schedule scale(float c) { return scale_by_schedule(c); }

/// @brief `update *= -lr(step)` (optax's `scale_by_learning_rate`): `lr` a number, an
/// `nn::schedule` (`warmup_cosine`, ...) or any callable `float(std::size_t step)`.
class scale_by_learning_rate {
 public:
  /// The rate `lr` (a number, a schedule or any callable of the step).
  template <class F>
    requires std::is_invocable_r_v<float, const F&, std::size_t>
  explicit scale_by_learning_rate(F lr) : lr_(std::move(lr)) {}
  /// A constant rate.
  explicit scale_by_learning_rate(float lr) : lr_(schedule(lr)) {}

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "scale_by_learning_rate"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "scale_by_learning_rate"; }
  /// The rate at `step`.
  [[nodiscard]] float rate(std::size_t step) const { return lr_(step); }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::scale_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {-lr_(r.step)}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }

 private:
  step_function lr_;
};

}  // namespace meshlib::nn
// end meshlib/nn/optim/scale.hpp
// begin meshlib/nn/optim/trace.hpp
/// @file
/// @brief `trace(decay)` (optax's): heavy-ball momentum, `m = decay m + update; update = m`; one
/// state slot. `nn::sgd` is `chain(trace(momentum), scale_by_learning_rate(lr))`.

#include <array>
#include <cstddef>
#include <string>


namespace meshlib::nn {

/// @brief See the file comment.
struct trace {
  float decay = 0.9f;  ///< the momentum

  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 1; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "trace(" + detail::number_text(decay) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "trace"; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::trace_step;
  /// The step's scalars, computed once per run on the host for `step_type`.
  [[nodiscard]] std::array<float, 1> constants(const update_run&) const { return {decay}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const { detail::run_step(*this, r); }
};

}  // namespace meshlib::nn
// end meshlib/nn/optim/trace.hpp
// begin meshlib/nn/optim/weight_decay.hpp
/// @file
/// @brief `add_decayed_weights(wd, mask)` (optax's): `update += wd * param` on the parameters of
/// `mask` (default: those whose layer marks them for decay, `decay_mask()`). Before the learning
/// rate in a chain, this is AdamW's decoupled weight decay.
/// @code
/// auto no_norms = [](std::string_view name) { return !name.ends_with(".scale"); };
/// auto tx = meshlib::nn::add_decayed_weights(1e-4f, no_norms);
/// @endcode

#include <array>
#include <cstddef>
#include <string>
#include <utility>


namespace meshlib::nn {

/// @brief See the file comment.
class add_decayed_weights {
 public:
  /// Decay `weight_decay` on the parameters of `mask`.
  explicit add_decayed_weights(float weight_decay, param_mask mask = decay_mask())
      : wd_(weight_decay), mask_(std::move(mask)) {}
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return "add_decayed_weights(" + detail::number_text(wd_) + ")"; }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return "add_decayed_weights"; }
  /// The decay rate.
  [[nodiscard]] float weight_decay() const noexcept { return wd_; }
  /// The elementwise step the fused chain runs for this transform (one kernel for the chain).
  using step_type = detail::decay_step;
  /// Fused into a chain's kernel, a parameter outside the mask decays by 0 (`update + 0 * param`,
  /// which is `update` for any finite parameter; the fused AdamW kernel did the same).
  [[nodiscard]] std::array<float, 1> constants(const update_run& r) const { return {mask_(r.param) ? wd_ : 0.0f}; }
  /// The `gradient_transform` requirement: transforms the run's updates in place.
  void update(const update_run& r) const {
    if (mask_(r.param)) detail::run_step(*this, r);
  }

 private:
  float wd_;
  param_mask mask_;
};

}  // namespace meshlib::nn
// end meshlib/nn/optim/weight_decay.hpp

namespace meshlib::nn {

namespace detail {
/// A transform behind a virtual interface: `optimizer`'s erased holder (one virtual call per run
/// of elements, each of which launches kernels: the call is nothing beside them).
struct erased_transform {
  virtual ~erased_transform() = default;
  [[nodiscard]] virtual std::size_t slots() const = 0;
  [[nodiscard]] virtual std::size_t stages() const = 0;
  [[nodiscard]] virtual bool reads_global_norm(std::size_t stage) const = 0;
  [[nodiscard]] virtual bool whole_parameters() const = 0;
  [[nodiscard]] virtual std::size_t param_state_size(const param_info& p) const = 0;
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual std::string kind() const = 0;
  virtual void update(const update_run& r) const = 0;
  virtual void update_and_apply(const update_run& r, float* params) const = 0;
  virtual void update_and_apply_all(const update_batch& b) const = 0;
};
template <class T>
struct erased_model final : erased_transform {
  explicit erased_model(T x) : t(std::move(x)) {}
  [[nodiscard]] std::size_t slots() const override { return t.slots(); }
  [[nodiscard]] std::size_t stages() const override { return stages_of(t); }
  [[nodiscard]] bool reads_global_norm(std::size_t stage) const override { return reads_global_norm_of(t, stage); }
  [[nodiscard]] bool whole_parameters() const override { return whole_parameters_of(t); }
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const override { return param_state_size_of(t, p); }
  [[nodiscard]] std::string name() const override { return name_of(t); }
  [[nodiscard]] std::string kind() const override { return kind_of(t); }
  void update(const update_run& r) const override { t.update(r); }
  void update_and_apply(const update_run& r, float* params) const override { update_and_apply_of(t, r, params); }
  void update_and_apply_all(const update_batch& b) const override { update_and_apply_all_of(t, b); }
  T t;
};

}  // namespace detail

/// @brief A gradient transform with its type erased (see the file comment); itself a
/// `gradient_transform`, so optimizers chain: `chain(clip_by_global_norm(1.0f), adamw(3e-4f))`.
class optimizer {
 public:
  /// `adam(1e-3f)`.
  optimizer();
  /// Holds `t` (a `chain`, or any `gradient_transform`), named and recorded in checkpoints by its
  /// own `name()` and `kind()`.
  template <class T>
    requires(!std::same_as<std::remove_cvref_t<T>, optimizer> && gradient_transform<std::remove_cvref_t<T>>)
  optimizer(T t)  // NOLINT(google-explicit-constructor): a chain is an optimizer
      : impl_(std::make_shared<const detail::erased_model<T>>(std::move(t))),
        name_(impl_->name()),
        kind_(impl_->kind()) {}
  /// Holds `t` under the name `name` (logs) and the kind `kind` (checkpoints; no spaces): how
  /// `adamw(...)` names its chain.
  template <class T>  // the first test keeps the copy constructor's own check from asking itself
    requires(!std::same_as<std::remove_cvref_t<T>, optimizer> && gradient_transform<T>)
  optimizer(T t, std::string name, std::string kind)
      : impl_(std::make_shared<const detail::erased_model<T>>(std::move(t))),
        name_(std::move(name)),
        kind_(std::move(kind)) {}

  /// State slots per element (0 for a stateless chain).
  [[nodiscard]] std::size_t slots() const { return impl_->slots(); }
  /// The stages the train state runs one after the other over every run (see nn/optim/chain.hpp).
  [[nodiscard]] std::size_t stages() const { return impl_->stages(); }
  /// Whether stage `k` reads the global norm of the updates entering it.
  [[nodiscard]] bool reads_global_norm(std::size_t k) const { return impl_->reads_global_norm(k); }
  /// Whether a transform in it reads statistics of whole parameters (`adafactor`): the train state
  /// then passes where each run lies and the sum over the parameter's other pieces
  /// (`update_run::blocks`: tensor-parallel blocks, FSDP shards, ZeRO-1 runs), and under ZeRO-1 a
  /// run of every parameter on every device, empty where its slice holds none.
  [[nodiscard]] bool whole_parameters() const { return impl_->whole_parameters(); }
  /// Floats of per-parameter state the transforms keep for `p` (`adafactor`'s factored second
  /// moment), beside the `slots()` per element.
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const { return impl_->param_state_size(p); }
  /// The optimizer for logs, its numbers as a user writes them: `sgd(momentum 0.9)`, `adam`,
  /// `adamw(weight decay 1e-4)`, `chain(clip_by_global_norm(1), adamw(weight decay 1e-4))`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// What a checkpoint records and a restore compares: the transforms without their numbers
  /// (`adamw`, `chain(clip_by_global_norm,adamw)`), so a run may resume with another rate.
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }
  /// Transforms the run's updates in place (see `gradient_transform`).
  void update(const update_run& r) const { impl_->update(r); }
  /// `update(r)`, then `params += updates` (optax's `apply_updates`): one pass for a chain of
  /// built-in transforms. What the train state calls for the last stage.
  void update_and_apply(const update_run& r, float* params) const { impl_->update_and_apply(r, params); }
  /// `update_and_apply` over every run of a device's last stage: one multi-tensor kernel for a
  /// chain of built-in transforms (`adam`, `adamw`, `sgd`); run by run for others. What the train
  /// state calls.
  void update_and_apply_all(const detail::update_batch& b) const { impl_->update_and_apply_all(b); }

 private:
  std::shared_ptr<const detail::erased_transform> impl_;
  std::string name_, kind_;
};

/// @brief SGD with (heavy-ball) momentum (`optax.sgd(lr, momentum)`): `chain(trace(momentum),
/// scale_by_learning_rate(lr))`.
inline optimizer sgd(schedule lr, float momentum = 0.9f) {
  return {chain(trace{momentum}, scale_by_learning_rate(lr)), "sgd(momentum " + detail::number_text(momentum) + ")",
          "sgd"};
}
/// @brief Adam (`optax.adam`): `chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))`.
inline optimizer adam(schedule lr, float b1 = 0.9f, float b2 = 0.999f, float eps = 1e-8f) {
  return {chain(scale_by_adam{b1, b2, eps}, scale_by_learning_rate(lr)), "adam", "adam"};
}
/// @brief AdamW, decoupled weight decay (`optax.adamw`): `chain(scale_by_adam(b1, b2, eps),
/// add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))`; the mask defaults to the
/// parameters their layer marks for decay (weights, not biases or norms).
inline optimizer adamw(schedule lr, float weight_decay = 1e-4f, float b1 = 0.9f, float b2 = 0.999f, float eps = 1e-8f,
                       param_mask mask = decay_mask()) {
  return {chain(scale_by_adam{b1, b2, eps}, add_decayed_weights(weight_decay, std::move(mask)),
                scale_by_learning_rate(lr)),
          "adamw(weight decay " + detail::number_text(weight_decay) + ")", "adamw"};
}
/// @brief Lion (`optax.lion`): `chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay,
/// mask), scale_by_learning_rate(lr))`. Its updates are signs (norm sqrt(n)): it wants a learning
/// rate 3-10x smaller than AdamW's and a weight decay as much larger.
inline optimizer lion(schedule lr, float b1 = 0.9f, float b2 = 0.99f, float weight_decay = 1e-3f,
                      param_mask mask = decay_mask()) {
  return {chain(scale_by_lion{b1, b2}, add_decayed_weights(weight_decay, std::move(mask)), scale_by_learning_rate(lr)),
          "lion(weight decay " + detail::number_text(weight_decay) + ")", "lion"};
}

/// @brief `adafactor`'s options other than the learning rate: optax's arguments and defaults
/// (`optax.adafactor`), for designated initialisers: `adafactor(1e-2f, {.momentum = 0.9f})`.
struct adafactor_options {
  std::size_t min_dim_size_to_factor = 128;  ///< a parameter is factored when its two largest dimensions are at least this
  float decay_rate = 0.8f;                   ///< the second moment's decay: `beta_t = 1 - (t + 1)^-decay_rate`
  std::size_t decay_offset = 0;              ///< steps subtracted from `t` (for fine-tuning)
  bool multiply_by_parameter_scale = true;   ///< scale each update by its parameter's RMS (at least 1e-3)
  std::optional<float> clipping_threshold = 1.0f;  ///< clip each parameter's update to this RMS; none: no clip
  std::optional<float> momentum = std::nullopt;    ///< an exponential moving average of the updates (no debias); none: none
  std::optional<float> weight_decay_rate = std::nullopt;  ///< `update += rate * param` after the learning rate
  float eps = 1e-30f;     ///< added to the squared gradient
  bool factored = true;   ///< false: an unfactored (per-element) second moment for every parameter
  param_mask weight_decay_mask = decay_mask();  ///< the parameters weight decay applies to
};

/// @brief Adafactor (`optax.adafactor`): `chain(scale_by_factored_rms(factored, decay_rate,
/// decay_offset, min_dim_size_to_factor, eps), clip_by_block_rms(clipping_threshold),
/// scale_by_schedule(lr), scale_by_param_block_rms(), momentum as chain(scale(1 - momentum),
/// trace(momentum)), add_decayed_weights(weight_decay_rate, mask), scale(-1))`, each optional piece
/// present as `o` asks. As in optax the weight decay comes after the learning rate (it is not
/// scaled by it). Its second moment is per parameter (rows + cols floats for a factored
/// matrix). Runs replicated, data-parallel (with ZeRO-1 or not), on FSDP shards and on
/// tensor-parallel parameters (see nn/optim/factored_rms.hpp).
inline optimizer adafactor(schedule lr, adafactor_options o = {}) {
  optimizer tx = scale_by_factored_rms(o.factored, o.decay_rate, o.decay_offset, o.min_dim_size_to_factor, o.eps);
  if (o.clipping_threshold) tx = chain(std::move(tx), clip_by_block_rms(*o.clipping_threshold));
  tx = chain(std::move(tx), scale_by_schedule(lr, "scale_by_learning_rate"));
  if (o.multiply_by_parameter_scale) tx = chain(std::move(tx), scale_by_param_block_rms());
  // optax's ema(momentum, debias=False): m = (1 - momentum) u + momentum m, the update m.
  if (o.momentum) tx = chain(std::move(tx), scale(1.0f - *o.momentum), trace{*o.momentum});
  if (o.weight_decay_rate)
    tx = chain(std::move(tx), add_decayed_weights(*o.weight_decay_rate, std::move(o.weight_decay_mask)));
  std::string options;
  const auto add = [&](const std::string& part) { options += (options.empty() ? "" : ", ") + part; };
  if (!o.factored) add("unfactored");
  if (o.momentum) add("momentum " + detail::number_text(*o.momentum));
  if (o.weight_decay_rate) add("weight decay " + detail::number_text(*o.weight_decay_rate));
  return {chain(std::move(tx), scale(-1.0f)), options.empty() ? "adafactor" : "adafactor(" + options + ")", "adafactor"};
}

inline optimizer::optimizer() : optimizer(adam(constant(1e-3f))) {}

}  // namespace meshlib::nn
// end meshlib/nn/optimizer.hpp
// begin meshlib/nn/optim/multi_transform.hpp
/// @file
/// @brief `multi_transform(transforms, label)` (optax's `multi_transform`): parameter groups, each
/// with its own transform; `label(param)` names the group of a parameter. Its state is as many
/// slots as the largest group's transform has (every parameter holds them; a group uses the first
/// ones).
/// @code
/// namespace nn = meshlib::nn;
/// auto label = [](std::string_view name) { return name.starts_with("embed") ? "embed" : "rest"; };
/// nn::optimizer opt = nn::multi_transform({{"embed", nn::sgd(1e-2f)}, {"rest", nn::adamw(1e-3f)}}, label);
/// @endcode

#include <algorithm>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief A parameter's group name: a callable over its name or its `param_info`, returning a
/// string (or anything a `std::string` is made from).
class param_label {
 public:
  /// The label `f` gives.
  template <class F>
    requires(!std::same_as<std::remove_cvref_t<F>, param_label> &&
             (std::is_invocable_r_v<std::string, const F&, const param_info&> ||
              std::is_invocable_r_v<std::string, const F&, std::string_view>))
  param_label(F f) {  // NOLINT(google-explicit-constructor): a lambda is a label function
    if constexpr (std::is_invocable_r_v<std::string, const F&, const param_info&>)
      f_ = std::move(f);
    else
      f_ = [g = std::move(f)](const param_info& p) { return std::string(g(p.name)); };
  }
  /// The group of `p`.
  [[nodiscard]] std::string operator()(const param_info& p) const { return f_(p); }

 private:
  std::function<std::string(const param_info&)> f_;
};

/// @brief The transform `multi_transform` returns (see the file comment).
class multi_transform_t {
 public:
  /// @throws std::invalid_argument for no groups, a group named twice, or a group transform that
  /// reads the global norm (that norm is over every parameter: clip in a chain around this).
  multi_transform_t(std::vector<std::pair<std::string, optimizer>> groups, param_label label)
      : groups_(std::move(groups)), label_(std::move(label)) {
    if (groups_.empty())
      throw std::invalid_argument("meshlib::nn: multi_transform: no groups; give at least one {label, transform}");
    for (std::size_t i = 0; i < groups_.size(); ++i) {
      const auto& [name, t] = groups_[i];
      for (std::size_t j = 0; j < i; ++j)
        if (groups_[j].first == name)
          throw std::invalid_argument("meshlib::nn: multi_transform: the label '" + name +
                                      "' is given twice; give each group one transform (chain them)");
      for (std::size_t s = 0; s < t.stages(); ++s)
        if (t.reads_global_norm(s))
          throw std::invalid_argument("meshlib::nn: multi_transform: the transform of group '" + name + "' (" +
                                      t.name() + ") reads the global norm of every parameter's updates, which a "
                                      "group cannot restrict; clip in a chain around multi_transform");
      slots_ = std::max(slots_, t.slots());
      stages_ = std::max(stages_, t.stages());
    }
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return slots_; }
  /// Floats of per-parameter state for `p`: its group's transform's (none for a label of no group;
  /// `update` names that mistake).
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const {
    const std::string label = label_(p);
    for (const auto& [name, t] : groups_)
      if (name == label) return t.param_state_size(p);
    return 0;
  }
  /// How many stages `update` runs in (the train state runs each over every run before the next).
  [[nodiscard]] std::size_t stages() const noexcept { return stages_; }
  /// Whether a group's transform reads statistics of whole parameters (`adafactor`).
  [[nodiscard]] bool whole_parameters() const {
    return std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g.second.whole_parameters(); });
  }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return joined(", ", [](const optimizer& o) { return o.name(); }); }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return joined(",", [](const optimizer& o) { return o.kind(); }); }
  /// @throws std::invalid_argument when the label of the run's parameter names no group.
  void update(const update_run& r) const {
    with_group(r, [](const optimizer& t, const update_run& sub) { t.update(sub); });
  }
  /// `update(r)`, then `params += updates`, in one pass where the group's transform can.
  void update_and_apply(const update_run& r, float* params) const {
    if (!with_group(r, [&](const optimizer& t, const update_run& sub) { t.update_and_apply(sub, params); }))
      detail::apply_updates(params, r.updates, r.size);
  }

 private:
  /// `f(the group's transform, r with its slots)` if `r.stage` is one of its stages; false if not.
  template <class F>
  bool with_group(const update_run& r, F&& f) const {
    const std::string label = label_(r.param);
    for (const auto& [name, t] : groups_)
      if (name == label) {
        if (r.stage >= t.stages()) return false;
        update_run sub = r;
        sub.state = r.state.first(t.slots());
        f(t, sub);
        return true;
      }
    std::string names;
    for (const auto& g : groups_) names += (names.empty() ? "'" : ", '") + g.first + "'";
    throw std::invalid_argument("meshlib::nn: multi_transform: parameter '" + std::string(r.param.name) +
                                "' has the label '" + label + "', which names no group (the groups are " + names +
                                "); give it a group or change the label function");
  }
  template <class F>
  std::string joined(const char* sep, F&& f) const {
    std::string out = "multi_transform(";
    for (std::size_t i = 0; i < groups_.size(); ++i)
      out += (i ? std::string(sep) : std::string()) + groups_[i].first + ":" + f(groups_[i].second);
    return out + ")";
  }

  std::vector<std::pair<std::string, optimizer>> groups_;
  param_label label_;
  std::size_t slots_ = 0, stages_ = 1;
};

/// @brief Parameter groups with their own transforms (see the file comment).
inline multi_transform_t multi_transform(std::vector<std::pair<std::string, optimizer>> groups, param_label label) {
  return multi_transform_t(std::move(groups), std::move(label));
}

}  // namespace meshlib::nn
// end meshlib/nn/optim/multi_transform.hpp
// begin meshlib/nn/precision.hpp
/// @file
/// @brief Compute precisions for mixed-precision training: `float` (default), `meshlib::bfloat16`
/// and, where the compiler has `_Float16` (GCC 12+ and Clang 15+ on x86-64 and AArch64;
/// `MESHLIB_HAS_FLOAT16` is then 1), `meshlib::float16`; the rounding that puts a float buffer on a
/// compute type's grid, and the compile-time rule on gradient-reduction types.
///
/// A `train_state<..., Compute>` with `Compute` a 16-bit type keeps float master weights in the
/// optimizer and rounds parameters, activations, cotangents and gradients to `Compute` (see
/// docs/training.md, "Mixed precision"). Values live in float buffers holding numbers of the
/// `Compute` grid: the numerics are those of 16-bit storage with float accumulation inside each
/// matrix product (what KokkosBlas::gemm on float gives; it has no bfloat16 gemm on the host), but
/// not its memory saving.
/// @code
/// meshlib::nn::train_state<mesh_t, decltype(net), "data", float, meshlib::bfloat16> state(m, std::move(net), opt);
/// @endcode

#include <cstddef>
#include <string_view>
#include <type_traits>


/// 1 where the compiler has `_Float16` (GCC 12+ and Clang 15+ on x86-64 and AArch64), and with it
/// `meshlib::float16`; 0 elsewhere (float16 training is then not offered). 0 under nvcc: it passes
/// the host compiler's `__FLT16_MAX__` on, but its device code generator stops on `_Float16`
/// ("Internal Compiler Error (codegen): unsupported float variant!", CUDA 13.0, found compiling the
/// flagship for sm_90).
#if defined(__FLT16_MAX__) && !defined(__CUDACC__)
#define MESHLIB_HAS_FLOAT16 1
#else
#define MESHLIB_HAS_FLOAT16 0
#endif

namespace meshlib {

#if MESHLIB_HAS_FLOAT16
/// @brief IEEE binary16 (5-bit exponent, 10-bit mantissa, largest finite 65504) over the compiler's
/// `_Float16`: a storage and rounding type; arithmetic goes through `float`. Only where
/// `MESHLIB_HAS_FLOAT16` is 1. Not a communicator element (no collective moves it).
struct float16 {
  _Float16 value = 0;
  constexpr float16() noexcept = default;
  /// Rounds to nearest even; beyond 65504 gives infinity (what dynamic loss scaling detects).
  constexpr float16(float f) noexcept : value(static_cast<_Float16>(f)) {}  // NOLINT: implicit, as a float type
  constexpr operator float() const noexcept { return static_cast<float>(value); }  // NOLINT
};
static_assert(sizeof(float16) == 2 && std::is_trivially_copyable_v<float16>);
#endif

namespace nn {

/// @brief The types a model can compute in: float, bfloat16 and (where available) float16.
template <class T>
concept compute_precision = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>
#if MESHLIB_HAS_FLOAT16
                            || std::is_same_v<T, float16>
#endif
    ;

/// @brief "float32", "bfloat16", "float16" or "float64".
template <class T>
constexpr std::string_view precision_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, double>) return "float64";
  else if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
#if MESHLIB_HAS_FLOAT16
  else if constexpr (std::is_same_v<T, float16>) return "float16";
#endif
  else return "?";
}

/// @brief Whether computing in `C` uses dynamic loss scaling by default (float16: its range ends
/// at 65504 and small gradients underflow; bfloat16 has float's range).
template <class C>
inline constexpr bool needs_loss_scaling =
#if MESHLIB_HAS_FLOAT16
    std::is_same_v<C, float16>;
#else
    false;
#endif

namespace detail {

/// Puts `n` floats of memory `Space` on the grid of `C` (a no-op for float): a Kokkos kernel on the
/// running device's instance (nn/detail/simd.hpp).
template <class C, class Space = default_memory_space>
inline void round_to(float* p, std::size_t n) noexcept {
  if constexpr (!std::is_same_v<C, float>)
    meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = static_cast<float>(C(p[i])); });
}

/// `to[i] = from[i]` put on the grid of `C` for `[0, n)` of memory `Space`: the float masters
/// rounded into the parameters' values in one pass (a copy, then `round_to` in place, read the
/// values twice), as a Kokkos kernel on the running device's instance.
template <class C, class Space = default_memory_space>
inline void round_copy(float* to, const float* from, std::size_t n) noexcept {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { to[i] = static_cast<float>(C(from[i])); });
}

/// Multiplies `n` floats of memory `Space` by `s` (loss scaling: the scaled cotangent, the
/// unscaled gradients): a Kokkos kernel on the running device's instance.
template <class Space = default_memory_space>
inline void scale_in_place(float* p, std::size_t n, float s) noexcept {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = p[i] * s; });
}

/// Whether the reduction type `W` may reduce gradients computed in `C`: float or double always;
/// a 16-bit type only when the compute type is float (an explicitly asked compressed wire, as
/// `grad_sync<float, bfloat16>`) or `C` itself. bfloat16 on float16 gradients would drop 3 mantissa
/// bits, float16 on bfloat16 gradients would overflow past 65504: both silently narrower.
template <class W, class C>
inline constexpr bool reduction_at_least_compute =
    std::is_same_v<W, float> || std::is_same_v<W, double> || std::is_same_v<C, float> || std::is_same_v<W, C>;

template <class Reduction, class Compute>
consteval bool gradient_reduction_type_narrower_than_compute_type() {
  static_assert(meshlib::diagnostic::always_false<Reduction, Compute>,
                "meshlib::nn: train_state: the gradient reduction type (first argument of "
                "gradient_reduction_type_narrower_than_compute_type<reduction, compute>) is narrower than the "
                "compute type (second argument); reduce 16-bit gradients in float or in their own type");
  return false;
}

/// True when gradients computed in `C` may be reduced in `W`; otherwise fires the one diagnostic,
/// naming both types.
template <class W, class C>
consteval bool check_reduction_type() {
  if constexpr (reduction_at_least_compute<W, C>) return true;
  else return gradient_reduction_type_narrower_than_compute_type<W, C>();
}

}  // namespace detail
}  // namespace nn
}  // namespace meshlib
// end meshlib/nn/precision.hpp
// begin meshlib/nn/parallel/policy.hpp
/// @file
/// @brief `parallel_policy`: what `data_parallel`, `fully_shard` and `pipeline` have in common. Each
/// names the mesh axis it applies to and says which parallelism it is (torchtitan's `apply_*`
/// functions, one per parallelism over a sub-mesh); a `train_state` takes any of them, each at most
/// once and each over an axis of its own, and checks that at compile time
/// (`detail::check_policies`, below). Tensor parallelism is not a policy: it is
/// in the layer types (`column_dense`, `row_dense`, ...), checked when the model is composed.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"data">{.zero = 1},
///                                meshlib::nn::pipeline<"pipe">{.microbatches = 8});
/// @endcode

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>


namespace meshlib::nn {

/// @brief Which parallelism a `parallel_policy` applies.
enum class parallelism : std::uint8_t {
  data,           ///< `data_parallel`: the batch split, gradients averaged (ZeRO-1 and overlap as options)
  fully_sharded,  ///< `fully_shard`: parameters, gradients and optimizer state sharded (FSDP, ZeRO-3)
  pipelined,      ///< `pipeline`: the model's layers cut into stages, micro-batches in a schedule
};

/// @brief A parallelism applied over one named mesh axis: a type with `static constexpr
/// parallelism kind` and `static constexpr fixed_string axis` (`data_parallel`, `fully_shard`,
/// `pipeline`).
template <class P>
concept parallel_policy = requires {
  { P::kind } -> std::convertible_to<parallelism>;
  P::axis.view();
};

namespace detail {
/// `value`: the axis of the policy of kind `K` among `Ps` (the first), else `Default`. Well-formed
/// for any types, policies or not (Clang forms a deduction guide's result before its constraints).
template <parallelism K, fixed_string Default, class... Ps>
struct policy_axis {
  static constexpr auto value = Default;
};
template <class P>
struct policy_axis_found {
  static constexpr auto value = P::axis;
};
template <parallelism K, fixed_string Default, class P, class... Ps>
  requires parallel_policy<P>
struct policy_axis<K, Default, P, Ps...>
    : std::conditional_t<P::kind == K, policy_axis_found<P>, policy_axis<K, Default, Ps...>> {};

/// Whether the policy `P` is a `data_parallel` over a second axis (`data_parallel<"data", "fsdp">`).
template <class P>
constexpr bool has_second_axis() {
  if constexpr (requires { P::second_axis.view(); }) return !P::second_axis.view().empty();
  else return false;
}
/// `value`: the second axis of the `data_parallel` among `Ps` that has one, else `Default` (the
/// train state's second batch axis when no `fully_shard` names it).
template <fixed_string Default, class... Ps>
struct second_data_axis {
  static constexpr auto value = Default;
};
template <class P>
struct second_data_axis_found {
  static constexpr auto value = P::second_axis;
};
template <fixed_string Default, class P, class... Ps>
  requires parallel_policy<P>
struct second_data_axis<Default, P, Ps...>
    : std::conditional_t<has_second_axis<P>(), second_data_axis_found<P>, second_data_axis<Default, Ps...>> {};

/// How many of the policies `Ps` are of kind `K`.
template <parallelism K, class... Ps>
inline constexpr std::size_t policy_count_v = (std::size_t{0} + ... + std::size_t{Ps::kind == K});

/// The second axis of the policy `P` ("" for a policy without one).
template <class P>
constexpr std::string_view second_axis_text() {
  if constexpr (has_second_axis<P>()) return P::second_axis.view();
  else return {};
}

/// Whether two of the policies `Ps` (a `data_parallel`'s two axes included) name the same mesh axis.
template <class... Ps>
constexpr bool policies_share_an_axis() {
  const std::string_view names[] = {std::string_view{}, Ps::axis.view()..., second_axis_text<Ps>()...};
  constexpr std::size_t n = 1 + 2 * sizeof...(Ps);
  for (std::size_t i = 1; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j)
      if (!names[i].empty() && names[i] == names[j]) return true;
  return false;
}

/// The text of a `fixed_string` template argument (an axis's name in `train_state`'s checks and messages).
template <std::size_t N>
constexpr std::string_view text_of(const fixed_string<N>& s) noexcept {
  return s.view();
}
/// The text of a template argument nvcc's front end has turned into a `const char*`.
constexpr std::string_view text_of(const char* s) noexcept { return s; }

/// The axis name of the policy `P`, with static storage (what a diagnostic's `axis` reads).
template <class P>
struct policy_axis_name {
  static constexpr std::string_view value = P::axis.view();
};

template <class Policy, class Axis, class MeshAxes>
consteval bool policy_axis_not_in_mesh() {
  static_assert(meshlib::diagnostic::always_false<Policy, Axis, MeshAxes>,
                "meshlib::nn: train_state: a parallel policy names an axis the mesh does not have (the policy, its "
                "axis and the mesh's axes are spelled out in the condition); add the axis to the mesh or give the "
                "policy one of the mesh's axes");
  return false;
}

/// The second axis name of the `data_parallel` `P`, with static storage (what a diagnostic's `axis` reads).
template <class P>
struct policy_second_axis_name {
  static constexpr std::string_view value = P::second_axis.view();
};

/// Whether the mesh `Mesh` has the second axis of the policy `P` (true for a policy without one).
template <class Mesh, class P>
constexpr bool second_axis_in_mesh() {
  if constexpr (has_second_axis<P>()) return Mesh::template has_axis<P::second_axis>;
  else return true;
}

/// Fires `policy_axis_not_in_mesh` for the first of the policies `P, Ps...` over an axis `Mesh` lacks.
template <class Mesh, class P, class... Ps>
consteval bool diagnose_policy_axes() {
  if constexpr (!Mesh::template has_axis<P::axis>)
    return policy_axis_not_in_mesh<P, meshlib::diagnostic::axis_named_t<policy_axis_name<P>>,
                                   meshlib::diagnostic::axes_t<Mesh, Mesh::all_axes>>();
  else if constexpr (!second_axis_in_mesh<Mesh, P>())
    return policy_axis_not_in_mesh<P, meshlib::diagnostic::axis_named_t<policy_second_axis_name<P>>,
                                   meshlib::diagnostic::axes_t<Mesh, Mesh::all_axes>>();
  else if constexpr (sizeof...(Ps) == 0)
    return true;
  else
    return diagnose_policy_axes<Mesh, Ps...>();
}

/// Whether `Model` is a `sequential` (what FSDP's hooks and the pipeline's stages need).
template <class Model>
concept sequential_model = requires(Model& net) {
  net.hooks;
  net.template params_per_layer<float>();
};

/// The compile-time checks of the policies `Ps` of a `train_state<Mesh, Model, Data, ..., Fsdp, Pipe>`
/// (`Fsdp`: the state's second batch axis, `fully_shard`'s or `data_parallel`'s second):
/// one `static_assert`, on the first unmet requirement.
template <class Mesh, class Model, fixed_string Data, fixed_string Fsdp, fixed_string Pipe, class... Ps>
constexpr void check_policies() {
  constexpr bool once = policy_count_v<parallelism::data, Ps...> <= 1 &&
                        policy_count_v<parallelism::fully_sharded, Ps...> <= 1 &&
                        policy_count_v<parallelism::pipelined, Ps...> <= 1;
  constexpr bool two_batch_axes =
      (std::size_t{0} + ... + std::size_t{has_second_axis<Ps>()}) == 0 ||
      policy_count_v<parallelism::fully_sharded, Ps...> == 0;
  constexpr bool own_axes = !policies_share_an_axis<Ps...>();
  constexpr bool in_mesh = ((Mesh::template has_axis<Ps::axis> && second_axis_in_mesh<Mesh, Ps>()) && ...);
  constexpr bool state_axes = ((Ps::axis.view() == (Ps::kind == parallelism::data            ? text_of(Data)
                                                    : Ps::kind == parallelism::fully_sharded ? text_of(Fsdp)
                                                                                             : text_of(Pipe)) &&
                                (!has_second_axis<Ps>() || second_axis_text<Ps>() == text_of(Fsdp))) &&
                               ...);
  constexpr bool layered = sequential_model<Model> || (policy_count_v<parallelism::fully_sharded, Ps...> +
                                                        policy_count_v<parallelism::pipelined, Ps...>) == 0;
  if constexpr (!once) {
    static_assert(once, "meshlib::nn: train_state: a parallel policy is given twice (two data_parallel, two "
                        "fully_shard or two pipeline); give each parallelism once, over its own mesh axis");
  } else if constexpr (!two_batch_axes) {
    static_assert(two_batch_axes, "meshlib::nn: train_state: data_parallel over two axes beside fully_shard: a "
                                  "train_state splits the batch over at most two axes, and fully_shard's axis is "
                                  "one of them (it splits the batch as it shards the parameters); give data_parallel "
                                  "one axis: data_parallel<\"data\">{} with fully_shard<\"fsdp\">{} is HSDP");
  } else if constexpr (!own_axes) {
    static_assert(own_axes, "meshlib::nn: train_state: two parallel policies (or data_parallel's two axes) name the "
                            "same mesh axis; "
                            "data_parallel, fully_shard and pipeline each need an axis of their own: name another "
                            "axis of the mesh (or add one: mesh<axis<\"data\">, axis<\"fsdp\">>)");
  } else if constexpr (!in_mesh) {
    static_cast<void>(diagnose_policy_axes<Mesh, Ps...>());  // one error, naming the policy and its axis
  } else if constexpr (!state_axes) {
    static_assert(state_axes, "meshlib::nn: train_state: a parallel policy's axis is not the train_state's "
                              "(its Data, Fsdp or Pipe template argument); let the constructor deduce the "
                              "state's type (train_state state(mesh, net, opt, policies...)) or spell the "
                              "same axis in both");
  } else if constexpr (!layered) {
    static_assert(layered, "meshlib::nn: train_state: fully_shard and pipeline need a sequential model (its "
                           "layers are FSDP's units and the pipeline's stages); wrap the layers in nn::sequential");
  }
}
}  // namespace detail

}  // namespace meshlib::nn
// end meshlib/nn/parallel/policy.hpp
// begin meshlib/nn/parallel/data_parallel.hpp
/// @file
/// @brief `data_parallel<"axis">`: data parallelism over one mesh axis (PyTorch's DDP, torchtitan's
/// `apply_ddp`): the batch split over the axis, the gradients averaged over it in buckets
/// (`grad_sync`, nn/parallel/grad_sync.hpp), with ZeRO-1 (the optimizer state and update sharded over
/// the axis) and overlap (each bucket started during backward, nn/parallel/grad_overlap.hpp) as its
/// options. With `fully_shard` on another axis the two compose (HSDP: shards over the fsdp axis,
/// replicas over this one).
///
/// `detail::data_parallel_impl` is the policy at work inside a `train_state`: it owns the gradient
/// buckets, the optimizer state's layout (replicated, or ZeRO-1's slices), the overlap's hooks and
/// the two gradient paths (all-reduce, then the update of whole blocks; or reduce-scatter, the
/// update of this device's slice, all-gather), composed over `fully_shard`'s engine when there is one.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"data">{.zero = 1});
/// meshlib::nn::train_state overlapped(mesh, std::move(net2), opt, meshlib::nn::data_parallel<"dp">{.overlap = true});
/// @endcode

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

// begin meshlib/nn/parallel/fsdp.hpp
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
// end meshlib/nn/parallel/fsdp.hpp
// begin meshlib/nn/parallel/grad_overlap.hpp
/// @file
/// @brief `detail::grad_overlap`: the layer hooks (`sequential`'s `layer_hooks`, the mechanism FSDP
/// uses) that start the data-parallel gradient buckets during backward
/// (`data_parallel{.overlap = true}`, PyTorch DDP's overlap). After each layer's backward, every
/// parameter of that layer and of the layers after it has its final gradient (backward runs last
/// layer first), so every bucket (nn/parallel/grad_sync.hpp) made only of such parameters is started with
/// `psum_start`; the optimizer step waits for all of them.
///
/// Why a decorator: FSDP's hooks, when on, are the inner ones and run first (their reduce-scatter
/// writes the shard gradients this then starts), so one hook pointer serves both.
/// Only the last micro-batch's backward starts buckets (`arm`): with accumulation, the gradients
/// are complete only then.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

// begin meshlib/nn/parallel/grad_sync.hpp
/// @file
/// @brief Data-parallel gradient synchronisation: every local gradient block (a pending sum over the
/// data axis: `x^T dy` contracts the data-sharded batch) is completed with few collectives, grouped
/// into *buckets* of at most `bucket_elements` elements (PyTorch DDP's gradient buckets: many small
/// gradients, few collectives). Either an all-reduce (`psum`, every replica gets the whole sum) or,
/// for ZeRO-1, a reduce-scatter (`psum_scatter`, each data replica gets the sum of its 1/n slice of
/// the flat gradient vector, the concatenation of the blocks, and only updates that slice).
///
/// All-reduce buckets: a gradient of at least half a bucket (the big weights: nearly all the bytes)
/// is reduced on its own, in place in the parameter's gradient block, in pieces of at most
/// `bucket_elements`: no byte is staged. The smaller ones are packed, in parameter order, into shared
/// buckets of at most `bucket_elements` and reduced there. Over a group of one device nothing moves.
///
/// The wire type `Wire` is a compile-time parameter: gradients are converted to `Wire` when packed
/// and reduced in `Wire` (every bucket is then packed); `grad_sync<float, bfloat16>` halves the
/// traffic, and a reduction cannot run in a narrower type than the one named in the program.
/// Every collective is a public typed one, as in a user's `shard_map`: a bucket is a rank-1
/// `local_tensor` over its piece of the flat buffer (a view of nn's own buffer, a pending sum over
/// the data axes), summed in place by the donated `psum`, or reduce-scattered by
/// `psum_scatter_into` into the slice buffer; nothing is staged beyond what the buckets need.
/// Buckets are filled in parameter order. Synchronously (`all_reduce`) they run one after the other
/// after the backward; overlapped (`begin_all_reduce` / `start_ready` / `finish_all_reduce`,
/// `data_parallel{.overlap = true}`), each is started with `psum_start` as soon as the backward
/// has completed its gradients (the last layers' first), so its reduction runs on the device's
/// communication worker while the backward of the earlier layers computes. Same buckets, same
/// per-element rank-order sums: the same bits either way.
/// @code
/// meshlib::nn::grad_sync<float> sync(mesh.size(), 1 << 20);   // 4 MiB buckets of floats
/// // inside spmd, after backward: const auto& g = sync.all_reduce<data_axes>(params, mesh, dev);
/// // g[i]: parameter i's summed gradient block
/// @endcode

#include <algorithm>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

/// @brief Bucketed gradient synchronisation (see the file comment).
/// @tparam T    the gradients' element type.
/// @tparam Wire the element type on the wire and of the reduction (`float` or `bfloat16` for `float`).
template <class T = float, comm_element Wire = T>
class grad_sync {
  static_assert(comm_element<Wire>, "meshlib::nn: grad_sync: the wire type must be a communicator element type");

 public:
  /// The element type gradients travel in (narrower than `T` to halve the traffic, e.g. bfloat16).
  using wire_type = Wire;
  grad_sync() = default;
  /// `devices`: the mesh size; `bucket_elements`: most elements per collective (0: no limit).
  grad_sync(std::size_t devices, std::size_t bucket_elements)
      : bucket_(bucket_elements),
        wire_(devices),
        flat_(devices),
        shard_(devices),
        collectives_(devices, 0),
        early_(devices, 0),
        summed_(devices),
        plans_(devices) {}

  /// Elements of the flat buffer on device `dev` (sum of its local gradient blocks).
  [[nodiscard]] static std::size_t flat_size(const std::vector<param_ref<T>>& params, std::size_t dev) {
    std::size_t n = 0;
    for (const auto& p : params) n += p.count[dev];
    return n;
  }

  /// A bucket as the collectives see it: a rank-1 block of `Wire` that is a pending sum over the
  /// axes `Axes` (and may differ over every other axis of the mesh).
  template <axis_mask Axes, mesh_type Mesh>
  using bucket_type = local_tensor<Wire, 1, Mesh, Mesh::all_axes & ~Axes, Axes>;

  /// All-reduces every gradient over the axes `Axes` of `mesh`, bucket by bucket (see the file
  /// comment), and returns, per parameter, where its summed gradient block lies: its own gradient
  /// block (reduced in place) or a piece of the packed buffer. The pointers stay valid until the
  /// next call on `dev`. Runs inside `spmd` / `shard_map` on device `dev`.
  template <axis_mask Axes, mesh_type Mesh>
  const std::vector<T*>& all_reduce(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    plan<Axes>(params, mesh, dev);
    plan_state& st = plans_.at(dev);
    for (std::size_t b = 0; b < st.buckets.size(); ++b) run_bucket<Axes, false>(params, mesh, dev, b);
    return complete(dev);
  }

  /// @name Overlapped all-reduce (`data_parallel{.overlap = true}`)
  /// The same buckets and the same sums as `all_reduce`, started as backward completes them:
  /// `begin_all_reduce` before the backward, `start_ready(first)` each time the gradients of
  /// parameters `first, first + 1, ...` are complete (backward runs last layer first), and
  /// `finish_all_reduce`, which starts the rest, waits for all and returns what `all_reduce` returns.
  /// Every device makes the same calls with the same arguments, so all start the same buckets in the
  /// same order; each element is summed in rank order whichever bucket carries it: the same bits.
  /// @{

  /// Plans this step's buckets (nothing starts yet).
  template <axis_mask Axes, mesh_type Mesh>
  void begin_all_reduce(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    plan<Axes>(params, mesh, dev);
  }
  /// Starts every bucket not yet started whose parameters all have index `first` or more.
  template <axis_mask Axes, mesh_type Mesh>
  void start_ready(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev, std::size_t first) {
    plan_state& st = plans_.at(dev);
    for (std::size_t b = st.buckets.size(); b-- > 0;)
      if (!st.started[b] && st.buckets[b].first >= first) {
        run_bucket<Axes, true>(params, mesh, dev, b);
        ++early_[dev];
      }
  }
  /// Starts the buckets not yet started, waits for every bucket, and returns each parameter's summed
  /// gradient block (what `all_reduce` returns).
  template <axis_mask Axes, mesh_type Mesh>
  const std::vector<T*>& finish_all_reduce(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    plan_state& st = plans_.at(dev);
    for (std::size_t b = st.buckets.size(); b-- > 0;)
      if (!st.started[b]) run_bucket<Axes, true>(params, mesh, dev, b);
    std::exception_ptr first_error;  // every request is waited for (its buffers are in use) before one throws
    for (auto& w : st.waits) {
      try {
        w();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    st.waits.clear();
    if (first_error) std::rethrow_exception(first_error);
    return complete(dev);
  }
  /// @}

  /// ZeRO-1: pads the flat gradient vector to a multiple of the group size and reduce-scatters it
  /// over the axes `Axes` of `mesh`: returns this device's slice `[begin, begin + size)` of the
  /// summed flat gradient, `size = ceil(n / group)`. Bucket `b` of each rank's part is one
  /// `psum_scatter_into` of equal pieces into the slice buffer; the gradients are packed straight
  /// into that order (one copy).
  template <axis_mask Axes, mesh_type Mesh>
  T* reduce_scatter(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev, std::size_t& begin,
                    std::size_t& size) {
    const std::size_t group = Axes == 0 ? 1 : mesh.axes_size(Axes), rank = Axes == 0 ? 0 : mesh.group_rank(dev, Axes);
    const std::size_t n = flat_size(params, dev);
    size = (n + group - 1) / group;
    begin = rank * size;
    const std::size_t step = bucket_ == 0 || group == 1 ? std::max<std::size_t>(size, 1)
                                                        : std::max<std::size_t>(1, bucket_ / group);
    Wire* send = wire_.get(dev, size * group);
    // Flat element j = r * size + o (rank r's part, offset o in it) goes to bucket o / step, where
    // the pieces of the ranks lie one after the other: segments in increasing flat order.
    flat_cursor cur{params, dev};
    for (std::size_t r = 0; r < group; ++r)
      for (std::size_t o = 0; o < size; o += step) {
        const std::size_t len = std::min(step, size - o);
        cur.copy(r * size + o, len, send + o * group + r * len);
      }
    Wire* out = send + rank * size;  // group == 1: the packed vector is the slice
    if constexpr (Axes != 0) {
      if (group > 1) {
        using B = bucket_type<Axes, Mesh>;
        out = shard_.get(dev, size);
        for (std::size_t o = 0; o < size; o += step) {
          const std::size_t len = std::min(step, size - o);
          (void)meshlib::psum_scatter_into<detail::group_of_t<Mesh, Axes>, 0>(
              detail::wrap1<B>(send + o * group, len * group, mesh, dev), detail::wrap1<B>(out + o, len, mesh, dev));
          ++collectives_[dev];
        }
      }
    }
    return unpack_wire(dev, out, size);
  }

  /// Collectives this device has issued (a test checks the bucketing).
  [[nodiscard]] std::size_t collectives(std::size_t dev) const { return collectives_.at(dev); }
  /// Buckets this device has started during backward (`start_ready`; a test checks the overlap).
  [[nodiscard]] std::size_t started_early(std::size_t dev) const { return early_.at(dev); }

 private:
  /// One collective's worth of the all-reduce: the gradient block of parameter `first` reduced in
  /// place (`packed` false), or the parameters `[first, last)` that the plan packed at `offset` of
  /// the wire buffer.
  struct bucket {
    std::size_t first = 0, last = 0;
    bool packed = false;
    std::size_t offset = 0, len = 0;
  };
  /// A device's plan of the all-reduce (the same on every device: it depends on the sizes only).
  struct plan_state {
    std::vector<bucket> buckets;          ///< in the order `all_reduce` issues them
    std::vector<bool> started;            ///< per bucket
    std::vector<std::size_t> wire_at;     ///< per parameter: its offset in the packed buffer, or npos
    std::vector<std::function<void()>> waits;  ///< the started requests' waits
    Wire* w = nullptr;                    ///< the packed buffer
    T* f = nullptr;                       ///< the packed sums converted back to T (Wire != T)
    bool moves = false;                   ///< whether the group has more than one device
  };
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  /// Plans the buckets of `params` on `dev` (see the file comment) and where each sum will lie.
  template <axis_mask Axes, mesh_type Mesh>
  void plan(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    constexpr bool same = std::is_same_v<Wire, T>;
    const std::size_t n = flat_size(params, dev);
    plan_state& st = plans_.at(dev);
    st.moves = Axes != 0 && mesh.axes_size(Axes) > 1;  // a group of one: nothing to add
    std::vector<T*>& out = summed_.at(dev);
    out.assign(params.size(), nullptr);
    st.buckets.clear();
    st.waits.clear();
    st.wire_at.assign(params.size(), npos);
    const std::size_t cap = bucket_ == 0 ? std::max<std::size_t>(n, 1) : bucket_, big = (cap + 1) / 2;
    st.w = same && !st.moves ? nullptr : wire_.get(dev, n);
    st.f = same ? nullptr : flat_.get(dev, n);
    std::size_t open = 0, used = 0;  // the open bucket: [open, used) of the packed buffer
    std::size_t first = npos, last = 0;  // its parameters
    auto flush = [&] {
      if (used == open) return;
      st.buckets.push_back({first, last, true, open, used - open});
      open = used;
      first = npos;
    };
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::size_t c = params[i].count[dev];
      if constexpr (same)
        if (!st.moves || c >= big) {  // in place, in the gradient block itself
          out[i] = params[i].grad[dev];
          if (st.moves) st.buckets.push_back({i, i + 1, false, 0, c});
          continue;
        }
      if (used - open + c > cap || c >= big) flush();  // (a big one is a bucket of its own)
      if (first == npos) first = i;
      last = i + 1;
      st.wire_at[i] = used;
      if constexpr (same) out[i] = st.w + used;
      else out[i] = st.f + used;
      used += c;
      if (c >= big) flush();
    }
    flush();
    st.started.assign(st.buckets.size(), false);
  }

  /// Packs bucket `b` and all-reduces it in pieces of at most the bucket size: each piece a donated
  /// `psum` (`Async`: `psum_start`) of a bucket over the buffer (summed where it lies).
  template <axis_mask Axes, bool Async, mesh_type Mesh>
  void run_bucket(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev, std::size_t b) {
    plan_state& st = plans_.at(dev);
    st.started[b] = true;
    const bucket& k = st.buckets[b];
    Wire* buf = nullptr;
    if (k.packed) {
      for (std::size_t i = k.first; i < k.last; ++i)
        if (st.wire_at[i] != npos) detail::convert_copy<space>(st.w + st.wire_at[i], params[i].grad[dev], params[i].count[dev]);
      buf = st.w + k.offset;
    } else {
      if constexpr (std::is_same_v<Wire, T>) buf = params[k.first].grad[dev];
    }
    if constexpr (Axes != 0) {
      if (!st.moves) return;
      using B = bucket_type<Axes, Mesh>;
      const std::size_t step = bucket_ == 0 ? std::max<std::size_t>(k.len, 1) : bucket_;
      for (std::size_t o = 0; o < k.len; o += step) {
        auto piece = detail::wrap1<B>(buf + o, std::min(step, k.len - o), mesh, dev);
        if constexpr (Async) {
          auto r = std::make_shared<decltype(detail::psum_start_over<Axes>(std::move(piece)))>(
              detail::psum_start_over<Axes>(std::move(piece)));
          st.waits.emplace_back([r] { (void)r->wait(); });
        } else {
          (void)detail::psum_over<Axes>(std::move(piece));
        }
        ++collectives_[dev];
      }
    }
  }

  /// The packed sums converted back to `T` (Wire != T); where each parameter's sum lies.
  const std::vector<T*>& complete(std::size_t dev) {
    plan_state& st = plans_.at(dev);
    if constexpr (!std::is_same_v<Wire, T>)
      for (const bucket& k : st.buckets) detail::convert_copy<space>(st.f + k.offset, st.w + k.offset, k.len);
    return summed_.at(dev);
  }

  /// Copies runs of the flat gradient vector (the blocks one after the other, zeros past the end),
  /// converted to `Wire`, for runs asked for in increasing order.
  struct flat_cursor {
    const std::vector<param_ref<T>>& params;
    std::size_t dev, i = 0, start = 0;  // parameter i's block starts at flat offset `start`
    void copy(std::size_t at, std::size_t len, Wire* to) {
      while (len > 0) {
        while (i < params.size() && start + params[i].count[dev] <= at) start += params[i++].count[dev];
        if (i == params.size()) {
          detail::fill_values<space>(to, len, Wire{});
          return;
        }
        const std::size_t k = std::min(len, start + params[i].count[dev] - at);
        const T* g = params[i].grad[dev] + (at - start);
        detail::convert_copy<space>(to, g, k);
        at += k;
        to += k;
        len -= k;
      }
    }
  };
  T* unpack_wire(std::size_t dev, Wire* w, std::size_t n) {
    if constexpr (std::is_same_v<Wire, T>) {
      return w;
    } else {
      T* f = flat_.get(dev, n);
      detail::convert_copy<space>(f, w, n);
      return f;
    }
  }

  /// The memory of the gradients and the packed buffers: the copies and conversions between them
  /// are Kokkos kernels on the running device's instance (nn/detail/kernels.hpp).
  using space = default_memory_space;
  std::size_t bucket_ = 0;
  detail::device_buffers<Wire> wire_;
  detail::device_buffers<T> flat_;
  detail::device_buffers<Wire> shard_;
  std::vector<std::size_t> collectives_;
  std::vector<std::size_t> early_;
  std::vector<std::vector<T*>> summed_;  ///< per device: where each parameter's summed gradient lies
  std::vector<plan_state> plans_;         ///< per device: the all-reduce's buckets
};

}  // namespace meshlib::nn
// end meshlib/nn/parallel/grad_sync.hpp

namespace meshlib::nn::detail {

/// The overlap hooks of a `train_state` (see the file comment): buckets of `grad_sync<T, Wire>`
/// all-reduced over the axes `DataAxes` of `Mesh`, or `ReplicaAxes` with FSDP (whose reduce-scatter
/// already summed over the fsdp axis).
template <class T, class Wire, mesh_type Mesh, axis_mask DataAxes, axis_mask ReplicaAxes>
class grad_overlap final : public layer_hooks {
 public:
  /// `per_layer`: parameters per layer, in the order the model collects them; `round`: rounds a
  /// gradient to the compute type (mixed precision; null otherwise); `inner`: FSDP's hooks or null
  /// (then the sums run over `ReplicaAxes`).
  grad_overlap(const Mesh& mesh, const std::vector<std::size_t>& per_layer, void (*round)(float*, std::size_t) noexcept,
               layer_hooks* inner)
      : mesh_(mesh),
        round_(round),
        inner_(inner),
        sync_(mesh.size(), nullptr),
        params_(mesh.size(), nullptr),
        armed_(mesh.size(), 0),
        next_(mesh.size(), 0),
        seconds_(mesh.size(), 0.0) {
    begin_.push_back(0);
    for (std::size_t c : per_layer) begin_.push_back(begin_.back() + c);
  }

  /// At the start of `dev`'s step, before its forward: makes the communicator the buckets will use.
  /// Its first use in a call splits it from the world, a rendezvous of every device; here the
  /// devices have just been started together, where inside the backward the rendezvous would
  /// stall each device's backward until the slowest reached its first started bucket (the split
  /// was most of the hooks' time: docs/benchmarks.md, "Overlapped gradient synchronisation").
  void prepare(std::size_t dev) {
    (void)dev;
    on_axes([&]<axis_mask Axes>() {
      if constexpr (Axes != 0)
        if (mesh_.axes_size(Axes) > 1) prepare_group_over<Mesh, Axes>();
    });
  }

  /// Before the last micro-batch's backward on `dev`: plans the buckets; the hooks then start them.
  void arm(grad_sync<T, Wire>& sync, const std::vector<param_ref<T>>& params, std::size_t dev) {
    if (begin_.back() != params.size()) return;  // layers that do not account for every parameter: after backward
    const auto t0 = std::chrono::steady_clock::now();
    sync_[dev] = &sync;
    params_[dev] = &params;
    on_axes([&]<axis_mask Axes>() { sync.template begin_all_reduce<Axes>(params, mesh_, dev); });
    next_[dev] = params.size();
    armed_[dev] = 1;
    seconds_[dev] += since(t0);
  }
  /// Whether `dev`'s buckets are being started by the hooks (between `arm` and `finish`).
  [[nodiscard]] bool armed(std::size_t dev) const { return armed_.at(dev) != 0; }
  /// The parameters `[0, unstarted(dev))` whose gradients no hook has finalised yet (all of them
  /// when not armed): `train_step` zeroes and rounds those itself.
  [[nodiscard]] std::size_t unstarted(std::size_t dev, std::size_t all) const { return armed(dev) ? next_[dev] : all; }
  /// Starts the buckets not started yet, waits for all, returns where each summed gradient lies
  /// (`grad_sync::all_reduce`'s result).
  const std::vector<T*>& finish(std::size_t dev) {
    const auto t0 = std::chrono::steady_clock::now();
    armed_[dev] = 0;
    const std::vector<T*>* g = nullptr;
    on_axes([&]<axis_mask Axes>() { g = &sync_[dev]->template finish_all_reduce<Axes>(*params_[dev], mesh_, dev); });
    seconds_[dev] += since(t0);
    return *g;
  }
  /// The time `dev`'s thread spent in the overlapped synchronisation since the last call (packing
  /// and starting buckets during backward, then waiting): its exposed synchronisation time.
  double take_seconds(std::size_t dev) { return std::exchange(seconds_.at(dev), 0.0); }

  void before_forward(std::size_t layer, std::size_t dev) override {
    // A forward is never part of the armed backward: an earlier micro-batch's backward (or that of
    // a step that failed before its update) must not start buckets.
    if (layer == 0) armed_[dev] = 0;
    if (inner_ != nullptr) inner_->before_forward(layer, dev);
  }
  void before_backward(std::size_t layer, std::size_t dev) override {
    if (inner_ != nullptr) inner_->before_backward(layer, dev);
  }
  void after_backward(std::size_t layer, std::size_t dev) override {
    if (inner_ != nullptr) inner_->after_backward(layer, dev);
    if (!armed_[dev]) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<param_ref<T>>& params = *params_[dev];
    const std::size_t first = begin_.at(layer), last = begin_.at(layer + 1);
    // What train_step does after the backward for every gradient, here for this layer's, before
    // its bucket can start: a gradient no backward wrote is zero; mixed precision rounds it.
    for (std::size_t i = first; i < last; ++i) {
      const param_ref<T>& p = params[i];
      if (p.overwrite && p.overwrite[dev]) {
        fill_values<default_memory_space>(p.grad[dev], p.count[dev], T{});
        p.overwrite[dev] = 0;
      }
      if (round_ != nullptr) round_(p.grad[dev], p.count[dev]);
    }
    next_[dev] = std::min(next_[dev], first);
    // The buckets' staging buffers are the synchronisation's, not activations: not on the step's
    // activation meter (nn/remat.hpp), as they are not when the sync runs after the backward.
    const meter_scope unmetered(nullptr);
    on_axes([&]<axis_mask Axes>() { sync_[dev]->template start_ready<Axes>(params, mesh_, dev, first); });
    seconds_[dev] += since(t0);
  }

 private:
  template <class F>
  void on_axes(F&& f) {
    if (inner_ != nullptr) f.template operator()<ReplicaAxes>();
    else f.template operator()<DataAxes>();
  }
  static double since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  Mesh mesh_;
  void (*round_)(float*, std::size_t) noexcept;
  layer_hooks* inner_;
  std::vector<std::size_t> begin_;  ///< layer l's parameters: [begin_[l], begin_[l + 1])
  // Per device, each written only by its own device's thread.
  std::vector<grad_sync<T, Wire>*> sync_;
  std::vector<const std::vector<param_ref<T>>*> params_;
  std::vector<std::uint8_t> armed_;
  std::vector<std::size_t> next_;
  std::vector<double> seconds_;
};

}  // namespace meshlib::nn::detail
// end meshlib/nn/parallel/grad_overlap.hpp
// begin meshlib/nn/train/optimizer_state.hpp
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
// end meshlib/nn/train/optimizer_state.hpp

namespace meshlib::nn {

/// @brief Data parallelism over the mesh axis `Axis`, and `Second` if given (see the file
/// comment); a `parallel_policy`.
/// @code
/// meshlib::nn::data_parallel<"data">{}            // the batch over 'data'
/// meshlib::nn::data_parallel<"data", "fsdp">{}    // over data x fsdp, the parameters replicated on both
/// @endcode
/// @tparam Axis the mesh axis the batch is split over and the gradients averaged over.
/// @tparam Second a second such axis ("": none), the batch split over `Axis` x `Second` as JAX's
/// `P(("data", "fsdp"))`: what a model whose parameters must not be sharded (a tied embedding)
/// runs on a mesh whose other configurations shard them over that axis with `fully_shard`. A
/// `train_state` splits the batch over at most two axes: `Second` and `fully_shard` do not go together.
template <fixed_string Axis = "data", fixed_string Second = "">
struct data_parallel {
  /// The parallelism this policy applies.
  static constexpr parallelism kind = parallelism::data;
  /// The mesh axis it applies over.
  static constexpr auto axis = Axis;
  /// The second mesh axis it applies over ("": none).
  static constexpr auto second_axis = Second;
  /// The ZeRO stage: 0 (optimizer state replicated) or 1 (the optimizer state and update sharded
  /// over the axis, the updated parameters all-gathered). Stage 3 is `fully_shard`.
  int zero = 0;
  /// Start each gradient bucket's all-reduce during backward, as soon as its gradients are complete
  /// (PyTorch DDP's overlap): the same buckets and sums, bitwise the same training. Needs a
  /// `sequential` model (its layer hooks start the buckets), no ZeRO-1 and no pipeline over more than
  /// one device: the `train_state` refuses the others with a `sharding_error` rather than ignore it.
  /// Off by default (docs/benchmarks.md, "Overlapped gradient synchronisation").
  bool overlap = false;
  /// The most gradient elements per collective (0: no limit).
  std::size_t bucket_elements = std::size_t{1} << 20;
};

namespace detail {

/// @brief `data_parallel`'s part of a `train_state` (see the file comment): the gradient buckets,
/// the optimizer state's layout, the overlap's hooks and the gradient path, over the data axes
/// `DataAxes` of `Mesh`. Composed with `fully_shard`'s engine (`compose`), the train state's
/// parameters are that engine's shards, whose gradients its reduce-scatters have already summed
/// over `FsdpAxes`: the buckets are then all-reduced over the replica axes only (HSDP).
///
/// The path is chosen once, at construction (ZeRO-1 or not); `apply_gradients` reads the train
/// state `S` (a friend's view: its parameters, norm helpers, optimizer chain and master weights)
/// and leaves the updated parameters in it.
template <class T, class Wire, class Mesh, axis_mask DataAxes, axis_mask FsdpAxes>
class data_parallel_impl {
 public:
  /// The data axes other than the fsdp axis: composed with FSDP, the shards' gradients are
  /// all-reduced over these.
  static constexpr axis_mask replica_axes = DataAxes & ~FsdpAxes;
  /// The optimizer state's layout (nn/train/optimizer_state.hpp): replicated or ZeRO-1.
  using layout_type = optimizer_state<Mesh, DataAxes>;
  /// `fully_shard`'s engine this composes with (nn/parallel/fsdp.hpp).
  using fsdp_type = fsdp_engine<Mesh, FsdpAxes>;
  /// The overlap's hooks (nn/parallel/grad_overlap.hpp).
  using overlap_type = grad_overlap<T, Wire, Mesh, DataAxes, replica_axes>;

  /// The policy `p` at work on `devices` devices: buckets of at most `p.bucket_elements`, ZeRO-1
  /// when `p.zero` is 1, the buckets started during backward when `p.overlap` (and the model is a
  /// `sequential`: `install_hooks`).
  /// @throws sharding_error when `p.zero` is not 0 or 1.
  // (A policy type, not a `fixed_string A` deduced from `data_parallel<A>`: nvcc 13's front end
  // deduces no class-type template argument from a specialisation.)
  template <class Policy>
    requires(Policy::kind == parallelism::data)
  data_parallel_impl(std::size_t devices, const Policy& p)
      : buckets_(devices, p.bucket_elements), gather_(devices), zero_(checked_zero(p.zero)), overlap_on_(p.overlap) {}

  /// Composes over `fully_shard`'s engine (null: none).
  void compose(std::shared_ptr<fsdp_type> fsdp) { fsdp_ = std::move(fsdp); }
  /// Sizes the optimizer state of `params` (`slots` per element, `per_param[i]` floats for
  /// parameter `i`) on this process's devices `local`.
  void size_state(const Mesh& mesh, std::span<const param_ref<T>> params, std::size_t slots,
                  std::span<const std::size_t> local, std::span<const std::size_t> per_param = {}) {
    state_ = layout_type(mesh, params, slots, zero_, local, per_param);
  }
  /// With overlap (and without ZeRO-1, whose reduce-scatter runs after the backward): installs the
  /// hooks that start the buckets during backward, around `fully_shard`'s when composed (the train
  /// state has refused overlap on a model without hooks and on a pipelined step). `round`
  /// rounds a gradient to the compute type (null in float).
  template <class Model>
  void install_hooks(const Mesh& mesh, Model& model, void (*round)(float*, std::size_t) noexcept) {
    if constexpr (sequential_model<Model>) {
      if (!overlap_on_ || zero_) return;
      overlap_ = std::make_shared<overlap_type>(mesh, model.template params_per_layer<T>(), round, fsdp_.get());
      model.hooks = overlap_.get();
    }
  }

  /// At the start of the step on `dev`: the overlap's communicator (no-op without overlap).
  void prepare(std::size_t dev) {
    if (overlap_) overlap_->prepare(dev);
  }
  /// Before the last micro-batch's backward on `dev`: arms the overlap's hooks (no-op without).
  void arm(const std::vector<param_ref<T>>& params, std::size_t dev) {
    if (overlap_) overlap_->arm(buckets_, params, dev);
  }
  /// The parameters `[0, n)` of `n` whose gradients the step still zeroes and rounds after the
  /// backward (the overlap's hooks did the others').
  [[nodiscard]] std::size_t unstarted(std::size_t dev, std::size_t n) const {
    return overlap_ ? overlap_->unstarted(dev, n) : n;
  }

  /// The gradient buckets (their traffic).
  [[nodiscard]] const grad_sync<T, Wire>& buckets() const noexcept { return buckets_; }
  /// The optimizer state's layout.
  [[nodiscard]] layout_type& state() noexcept { return state_; }
  /// The optimizer state's layout (read-only).
  [[nodiscard]] const layout_type& state() const noexcept { return state_; }

  /// One device's share of a step of `s` after its backward passes: synchronise, clip, update.
  /// Returns the global gradient norm; `sync_seconds` the time spent synchronising.
  template <class S>
  double apply_gradients(S& s, std::size_t dev, double& sync_seconds) {
    return zero_ ? apply_sharded(s, dev, sync_seconds) : apply_replicated(s, dev, sync_seconds);
  }

 private:
  // All-reduced gradients (over the replica axes when composed with FSDP, whose reduce-scatters
  // after each backward did the fsdp axis's share; overlapped: the buckets started during the
  // backward, nn/parallel/grad_overlap.hpp), then every device updates its whole blocks.
  template <class S>
  double apply_replicated(S& s, std::size_t dev, double& sync_seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto& params = s.params;
    const bool overlapped = overlap_ && overlap_->armed(dev);
    const std::vector<T*>& g = overlapped ? overlap_->finish(dev)
                               : fsdp_    ? buckets_.template all_reduce<replica_axes>(params, s.mesh, dev)
                                          : buckets_.template all_reduce<DataAxes>(params, s.mesh, dev);
    sync_seconds = overlapped ? overlap_->take_seconds(dev)
                              : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (fsdp_) sync_seconds += fsdp_->take_seconds(dev);
    std::vector<float_run>& runs = s.optimizer_step_.norm_runs(dev);
    for (std::size_t i = 0; i < params.size(); ++i) {
      s.unscale(g[i], params[i].count[dev]);
      runs.push_back(s.optimizer_step_.share_of(s.mesh, dev, params[i], g[i], params[i].count[dev], 0));
    }
    const double norm = s.optimizer_step_.global_norm(s.mesh, dev, runs);
    // The norm is summed over every device, so an inf or NaN anywhere makes it non-finite on all
    // of them: the skip verdict is the same on every device.
    if (s.loss_scaling() && !std::isfinite(norm)) return norm;
    std::vector<float*> slot(s.opt.slots());
    s.step_optimizer(dev, norm, 0, [&](auto&& f) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        for (std::size_t k = 0; k < slot.size(); ++k) slot[k] = state_.slot(i, k, dev);
        f(i, std::size_t{0}, g[i], params[i].count[dev], std::span<float* const>(slot));
      }
    });
    s.refresh_device(dev);
    return norm;
  }

  // ZeRO-1: the gradients reduce-scattered over the data axes, each device updating its slice of
  // the flat vector with its slice of the state, the updated slices all-gathered.
  template <class S>
  double apply_sharded(S& s, std::size_t dev, double& sync_seconds) {
    const auto& params = s.params;
    const std::size_t dp = s.mesh.axes_size(DataAxes);
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t begin = 0, size = 0;
    T* g = buckets_.template reduce_scatter<DataAxes>(params, s.mesh, dev, begin, size);
    sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.unscale(g, size);
    std::vector<float_run>& runs = s.optimizer_step_.norm_runs(dev);
    for_each_piece(params, dev, begin, size, [&](const param_ref<T>& p, std::size_t, std::size_t o, std::size_t len) {
      runs.push_back(s.optimizer_step_.share_of(s.mesh, dev, p, g + o, len, DataAxes));
    });
    const double norm = s.optimizer_step_.global_norm(s.mesh, dev, runs);
    if (s.loss_scaling() && !std::isfinite(norm)) return norm;  // same verdict everywhere (see above)
    float* m = state_.zero_state(dev).data();
    std::vector<float*> slot(s.opt.slots());
    s.step_optimizer(dev, norm, DataAxes, [&](auto&& f) {
      for_each_piece(params, dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t o,
                                                   std::size_t len) {
        for (std::size_t k = 0; k < slot.size(); ++k) slot[k] = m + k * size + o;
        f(static_cast<std::size_t>(&p - params.data()), in_param, g + o, len, std::span<float* const>(slot));
      });
    });
    // all_gather the updated slices: every replica gets the whole updated flat parameter vector.
    T* send = gather_.get(dev, size * (dp + 1));
    T* recv = send + size;
    fill_values<default_memory_space>(send, size, T{});
    for_each_piece(params, dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t o,
                                                 std::size_t len) {
      convert_copy<default_memory_space>(send + o, s.master(static_cast<std::size_t>(&p - params.data()), dev) + in_param,
                                         len);
    });
    const auto t1 = std::chrono::steady_clock::now();
    if (dp > 1) {
      // The slices vary over the data axes; gathered, every replica holds the whole vector.
      using slice_t = local_tensor<T, 1, Mesh, Mesh::all_axes>;
      (void)meshlib::all_gather_into<group_of_t<Mesh, DataAxes>, 0>(wrap1<slice_t>(send, size, s.mesh, dev),
                                                                   wrap1<slice_t>(recv, size * dp, s.mesh, dev));
    } else {
      convert_copy<default_memory_space>(recv, send, size);
    }
    sync_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::size_t off = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      convert_copy<default_memory_space>(s.master(i, dev), recv + off, params[i].count[dev]);
      off += params[i].count[dev];
    }
    s.refresh_device(dev);
    return norm;
  }

  // ZeRO's stage as data_parallel takes it: 1 shards the optimizer state, 0 does not; stage 3 is
  // fully_shard's, a policy of its own (on its own axis), not a number here.
  static bool checked_zero(int zero) {
    if (zero != 0 && zero != 1)
      throw sharding_error("meshlib::nn: data_parallel: zero = " + std::to_string(zero) +
                           "; data_parallel shards the optimizer state with zero = 1 (ZeRO-1) or not at all "
                           "(0); for ZeRO-3 use fully_shard<\"axis\"> on an axis of its own");
    return zero == 1;
  }

  // Calls `f(param, offset in param, offset in slice, length)` for the pieces of `params` that lie
  // in the flat slice `[begin, begin + size)` of device `dev`'s flat vector.
  template <class F>
  static void for_each_piece(const std::vector<param_ref<T>>& params, std::size_t dev, std::size_t begin,
                             std::size_t size, F&& f) {
    std::size_t off = 0;
    for (const auto& p : params) {
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) f(p, lo - off, lo - begin, hi - lo);
      off += p.count[dev];
    }
  }

  grad_sync<T, Wire> buckets_;
  layout_type state_;
  device_buffers<T> gather_;  // ZeRO-1's all-gather of the updated slices
  bool zero_ = false;
  bool overlap_on_ = false;
  // Shared by copies of the state, as the model's hooks pointing at them are.
  std::shared_ptr<fsdp_type> fsdp_;
  std::shared_ptr<overlap_type> overlap_;
};

}  // namespace detail

}  // namespace meshlib::nn
// end meshlib/nn/parallel/data_parallel.hpp
// begin meshlib/nn/data.hpp
/// @file
/// @brief The data pipeline of meshlib's nn layer: datasets, IDX and Fashion-MNIST readers, the
/// seeded epoch permutation and the sharded, prefetching data loader; plain text for byte-level
/// language models (corpus, next-token windows, n-gram baselines).

// begin meshlib/nn/data/errors.hpp
/// @file
/// @brief The exception type of meshlib's data pipeline: a data set file that is missing or
/// malformed, or loader options that cannot cut the data set into batches.


namespace meshlib {

/// @brief A data set that cannot be read or batched as asked: a missing file, a file that is not
/// IDX (bad magic), wrong dimensions, a truncated or over-long file, label and image counts that
/// disagree, a label outside the classes, or a global batch that does not split over the
/// processes. `what()` names the file (or the option) and says what was expected and what was
/// found.
class data_error : public error {
 public:
  using error::error;
};

}  // namespace meshlib
// end meshlib/nn/data/errors.hpp
// begin meshlib/nn/data/dataset.hpp
/// @file
/// @brief An in-memory classification data set: `count` examples of `features` floats each and one
/// integer label per example.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace meshlib::nn {

/// @brief A classification data set held in memory, row-major: example `i` is
/// `x[i * features, (i + 1) * features)` and its label is `y[i]`, in `[0, classes)`.
///
/// @code
/// meshlib::nn::dataset ds = meshlib::nn::read_idx("train-images-idx3-ubyte.gz",
///                                                 "train-labels-idx1-ubyte.gz");
/// std::span<const float> first = ds.row(0);   // 784 pixels scaled to [0, 1]
/// int label = ds.y[0];
/// @endcode
struct dataset {
  std::size_t count = 0;     ///< number of examples
  std::size_t features = 0;  ///< floats per example (28 * 28 = 784 for Fashion-MNIST)
  std::size_t classes = 0;   ///< labels are in [0, classes)
  std::vector<float> x{};         ///< count * features values, row-major; IDX pixels scaled to [0, 1]
  std::vector<std::int32_t> y{};  ///< count labels

  /// @brief The features of example `i`.
  [[nodiscard]] std::span<const float> row(std::size_t i) const noexcept {
    return {x.data() + i * features, features};
  }
};

}  // namespace meshlib::nn
// end meshlib/nn/data/dataset.hpp
// begin meshlib/nn/data/idx.hpp
/// @file
/// @brief Reads a classification data set from a pair of IDX files (the format of MNIST and
/// Fashion-MNIST: an image file of unsigned bytes with dimensions (count, rows, columns) and a
/// label file of unsigned bytes with dimension (count)), plain or gzip-compressed.
///
/// @code
/// auto train = meshlib::nn::read_idx("data/train-images-idx3-ubyte.gz",
///                                    "data/train-labels-idx1-ubyte.gz", 10);
/// // train.count == 60000, train.features == 784, train.classes == 10
/// @endcode
///
/// Every defect gives a meshlib::data_error that names the file and says what was expected and
/// what was found: a missing file, a bad magic number (not IDX, not unsigned bytes, or the wrong
/// number of dimensions), a file shorter or longer than its header promises, label and image
/// counts that disagree, a label outside [0, classes), a header whose dimensions multiply past
/// 2^64. Every size is checked against the file before anything is allocated by it.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

// begin meshlib/nn/data/detail/read_bytes.hpp
/// @file
/// @brief Reads a whole data file into memory, gunzipping it on the fly when it is gzip-compressed
/// (Debian's dataset-fashion-mnist ships `.gz` files) and meshlib was built with zlib.

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#if defined(MESHLIB_ENABLE_ZLIB)
#include <zlib.h>
#endif


namespace meshlib::nn::detail {

/// "meshlib: <what> '<path>'": the start of every message about one file.
inline std::string file_label(const char* what, const std::filesystem::path& path) {
  return std::string("meshlib: ") + what + " '" + path.string() + "'";
}

inline void check_readable(const char* what, const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    throw data_error(file_label(what, path) + " does not exist");
  }
  if (std::filesystem::is_directory(status)) {
    throw data_error(file_label(what, path) + " is a directory, expected a file");
  }
}

inline bool starts_with_gzip_magic(const std::vector<std::uint8_t>& bytes) {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

/// The bytes of `path`, decompressed when it is a gzip file. Throws data_error naming the file when
/// it is missing, unreadable, or a damaged gzip stream; `what` says what the file is for
/// ("IDX file").
inline std::vector<std::uint8_t> read_bytes(const char* what, const std::filesystem::path& path) {
  check_readable(what, path);
  std::vector<std::uint8_t> bytes;
#if defined(MESHLIB_ENABLE_ZLIB)
  // gzread reads a file that is not gzip-compressed as it is, so one path serves both.
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw data_error(file_label(what, path) + " cannot be opened: " + std::strerror(errno));
  }
  gzbuffer(file, 1u << 17);
  constexpr std::size_t chunk = std::size_t{1} << 22;
  for (;;) {
    const std::size_t old = bytes.size();
    bytes.resize(old + chunk);
    const int got = gzread(file, bytes.data() + old, static_cast<unsigned>(chunk));
    if (got < 0) {
      int code = 0;
      const std::string message = gzerror(file, &code);
      gzclose(file);
      throw data_error(file_label(what, path) + " is not a valid gzip file: " + message);
    }
    bytes.resize(old + static_cast<std::size_t>(got));
    if (static_cast<std::size_t>(got) < chunk) break;
  }
  int code = Z_OK;
  const std::string message = gzerror(file, &code);
  gzclose(file);
  // Z_BUF_ERROR at the end: the compressed stream stopped before its end marker.
  if (code == Z_BUF_ERROR) {
    throw data_error(file_label(what, path) +
                     " is a truncated gzip file (the compressed stream ends early after " +
                     std::to_string(bytes.size()) + " bytes)");
  }
  if (code != Z_OK) {
    throw data_error(file_label(what, path) + " is not a valid gzip file: " + message);
  }
#else
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw data_error(file_label(what, path) + " cannot be opened: " + std::strerror(errno));
  }
  bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (starts_with_gzip_magic(bytes)) {
    throw data_error(file_label(what, path) +
                     " is gzip-compressed, but this meshlib was built without zlib; decompress it "
                     "(gunzip) or rebuild with zlib (Debian: zlib1g-dev)");
  }
#endif
  return bytes;
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/data/detail/read_bytes.hpp

namespace meshlib::nn {
namespace detail {

inline std::string hex32(std::uint32_t v) {
  char text[11];
  std::snprintf(text, sizeof text, "0x%08X", static_cast<unsigned>(v));
  return text;
}

inline std::uint32_t big_endian32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

/// The dimensions of an IDX file of unsigned bytes with `rank` dimensions, after checking its magic
/// number and that its size is exactly header + product of dimensions. `layout` names the
/// dimensions for messages ("count, rows, columns").
inline std::vector<std::size_t> idx_dims(const std::filesystem::path& path,
                                         const std::vector<std::uint8_t>& bytes, std::uint8_t rank,
                                         const char* layout) {
  const std::size_t header = 4 + 4 * std::size_t{rank};
  const std::uint32_t expected_magic = 0x0800u | rank;  // 0x00 0x00, type 0x08 (ubyte), rank
  const std::string what = file_label("IDX file", path);
  if (bytes.size() < 4) {
    throw data_error(what + " is " + std::to_string(bytes.size()) +
                     " bytes long, too short for the 4-byte magic number " + hex32(expected_magic));
  }
  const std::uint32_t magic = big_endian32(bytes.data());
  if (magic != expected_magic) {
    throw data_error(what + " has magic number " + hex32(magic) + ", expected " +
                     hex32(expected_magic) + " (unsigned bytes, " + std::to_string(rank) +
                     " dimensions: " + layout + ")");
  }
  if (bytes.size() < header) {
    throw data_error(what + " is truncated: " + std::to_string(bytes.size()) +
                     " bytes, shorter than its " + std::to_string(header) + "-byte header");
  }
  std::vector<std::size_t> dims(rank);
  for (std::size_t d = 0; d < rank; ++d) dims[d] = big_endian32(bytes.data() + 4 + 4 * d);
  std::string shape;
  for (std::size_t d = 0; d < rank; ++d) shape += (d ? " x " : "") + std::to_string(dims[d]);
  // Three 32-bit dimensions can multiply past 2^64 and wrap to a small count that the size check
  // below would accept (2^22 x 2^21 x 2^21 wraps to 0: a 16-byte file "holding" 4.4e12-pixel
  // images), so the count is checked before anything is sized by it.
  std::size_t payload = 1;
  bool overflow = false;
  for (std::size_t d = 0; d < rank; ++d) overflow = overflow || __builtin_mul_overflow(payload, dims[d], &payload);
  std::size_t total = 0;
  overflow = overflow || __builtin_add_overflow(header, payload, &total);
  if (overflow) {
    throw data_error(what + " has a corrupted header: it promises " + shape + " bytes (" + layout +
                     "), a count that does not fit in 64 bits, but the file has " +
                     std::to_string(bytes.size()) + " bytes; it is not an IDX file or its header is damaged");
  }
  if (bytes.size() != total) {
    throw data_error(what + (bytes.size() < header + payload ? " is truncated" : " is too long") +
                     ": its header promises " + shape + " bytes (" + layout + "), so " +
                     std::to_string(header + payload) + " bytes in all, but it has " +
                     std::to_string(bytes.size()));
  }
  return dims;
}

}  // namespace detail

/// @brief Reads images and labels from two IDX files into a dataset with pixels scaled to [0, 1].
/// @param images an IDX file of unsigned bytes with dimensions (count, rows, columns), plain or
///        gzip-compressed (`.gz` needs meshlib built with zlib).
/// @param labels an IDX file of unsigned bytes with dimension (count).
/// @param classes the number of classes; a label outside [0, classes) is an error. When not given,
///        it is the largest label + 1.
/// @throws meshlib::data_error naming the file and what was expected and found.
[[nodiscard]] inline dataset read_idx(const std::filesystem::path& images,
                                      const std::filesystem::path& labels,
                                      std::optional<std::size_t> classes = std::nullopt) {
  if (classes && *classes == 0) {
    throw data_error("meshlib: read_idx: classes is 0, expected at least 1");
  }
  const std::vector<std::uint8_t> image_bytes = detail::read_bytes("IDX file", images);
  const std::vector<std::size_t> image_dims =
      detail::idx_dims(images, image_bytes, 3, "count, rows, columns");
  const std::vector<std::uint8_t> label_bytes = detail::read_bytes("IDX file", labels);
  const std::vector<std::size_t> label_dims = detail::idx_dims(labels, label_bytes, 1, "count");

  if (image_dims[0] != label_dims[0]) {
    throw data_error("meshlib: IDX files disagree: '" + images.string() + "' holds " +
                     std::to_string(image_dims[0]) + " images but '" + labels.string() +
                     "' holds " + std::to_string(label_dims[0]) + " labels");
  }
  if (image_dims[1] == 0 || image_dims[2] == 0) {
    throw data_error(detail::file_label("IDX file", images) + " has images of " +
                     std::to_string(image_dims[1]) + " x " + std::to_string(image_dims[2]) +
                     " pixels, expected at least 1 x 1");
  }

  dataset ds;
  ds.count = image_dims[0];
  ds.features = image_dims[1] * image_dims[2];
  ds.y.resize(ds.count);
  const std::uint8_t* label_data = label_bytes.data() + 8;
  std::size_t largest = 0;
  for (std::size_t i = 0; i < ds.count; ++i) {
    const std::size_t label = label_data[i];
    if (classes && label >= *classes) {
      throw data_error(detail::file_label("IDX file", labels) + ": label " +
                       std::to_string(label) + " at index " + std::to_string(i) +
                       " is out of range, expected 0.." + std::to_string(*classes - 1) + " (" +
                       std::to_string(*classes) + " classes)");
    }
    largest = label > largest ? label : largest;
    ds.y[i] = static_cast<std::int32_t>(label);
  }
  ds.classes = classes ? *classes : (ds.count ? largest + 1 : 0);

  const std::uint8_t* pixels = image_bytes.data() + 16;
  ds.x.resize(ds.count * ds.features);
  // Divided, not multiplied by 1/255: p / 255.0f is the correctly rounded value a user expects.
  for (std::size_t i = 0; i < ds.x.size(); ++i) ds.x[i] = static_cast<float>(pixels[i]) / 255.0f;
  return ds;
}

}  // namespace meshlib::nn
// end meshlib/nn/data/idx.hpp
// begin meshlib/nn/data/fashion_mnist.hpp
/// @file
/// @brief Fashion-MNIST (Zalando's 28x28 grey images of clothes, 10 classes; 60,000 for training and
/// 10,000 for test) from the IDX files Debian's `dataset-fashion-mnist` installs under
/// /usr/share/datasets/fashion-mnist, or from any directory that holds them.
///
/// @code
/// auto data = meshlib::nn::load_fashion_mnist();      // or load_fashion_mnist("/my/dir")
/// // data.train.count == 60000, data.test.count == 10000, features 784, classes 10
/// @endcode

#include <array>
#include <filesystem>
#include <string>


namespace meshlib::nn {

/// @brief The training and test splits of Fashion-MNIST.
struct fashion_mnist {
  dataset train;  ///< 60,000 examples
  dataset test;   ///< 10,000 examples
};

/// @brief Where Debian's package `dataset-fashion-mnist` installs the files.
[[nodiscard]] inline std::filesystem::path default_fashion_mnist_dir() {
  return "/usr/share/datasets/fashion-mnist";
}

namespace detail {

/// `dir/name`, or `dir/name.gz` when only the compressed file is there (Debian ships `.gz`; a user
/// may have gunzipped them). Neither: data_error saying which package or path provides them.
inline std::filesystem::path find_fashion_mnist_file(const std::filesystem::path& dir,
                                                     const std::string& name) {
  const std::filesystem::path plain = dir / name;
  std::filesystem::path gz = plain;
  gz += ".gz";
  std::error_code ec;
  if (std::filesystem::is_regular_file(plain, ec)) return plain;
  if (std::filesystem::is_regular_file(gz, ec)) return gz;
  throw data_error("meshlib: Fashion-MNIST: neither '" + plain.string() + "' nor '" + gz.string() +
                   "' exists; install Debian's package dataset-fashion-mnist (apt-get install "
                   "dataset-fashion-mnist, files under " + default_fashion_mnist_dir().string() +
                   ") or give the directory that holds the four IDX files");
}

}  // namespace detail

/// @brief Reads Fashion-MNIST's four IDX files (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
/// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each plain or `.gz`) from `dir`.
/// @throws meshlib::data_error when a file is missing (naming the package that provides it) or
///         malformed (see read_idx), or when the data is not 28x28 images in 10 classes.
[[nodiscard]] inline fashion_mnist load_fashion_mnist(
    const std::filesystem::path& dir = default_fashion_mnist_dir()) {
  auto split = [&](const char* prefix) {
    const auto images = detail::find_fashion_mnist_file(dir, std::string(prefix) + "-images-idx3-ubyte");
    const auto labels = detail::find_fashion_mnist_file(dir, std::string(prefix) + "-labels-idx1-ubyte");
    dataset ds = read_idx(images, labels, 10);
    if (ds.features != 28 * 28) {
      throw data_error(detail::file_label("IDX file", images) + " holds images of " +
                       std::to_string(ds.features) + " pixels, expected Fashion-MNIST's 28 x 28 = 784");
    }
    return ds;
  };
  fashion_mnist data;
  data.train = split("train");
  data.test = split("t10k");
  return data;
}

}  // namespace meshlib::nn
// end meshlib/nn/data/fashion_mnist.hpp
// begin meshlib/nn/data/permutation.hpp
/// @file
/// @brief The seeded shuffle of a data loader: a permutation of [0, count) that depends only on
/// (seed, epoch), computed the same way on every process and every platform, so processes that
/// each load their share of a global batch agree on which examples that batch holds.
///
/// @code
/// auto order = meshlib::nn::epoch_permutation(60000, /*seed=*/42, /*epoch=*/3);
/// // order[i]: the example at position i of epoch 3; a permutation of 0..59999
/// @endcode

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>


namespace meshlib::nn {
namespace detail {

/// SplitMix64 (Steele, Lea, Flood 2014), the mixer of nn/random.hpp: fully specified, so the
/// permutation does not depend on the standard library (std::shuffle and the std distributions
/// are implementation-defined and differ between libstdc++ and libc++).
inline std::uint64_t splitmix64(std::uint64_t x) noexcept { return mix64(x); }

/// A uniform integer in [0, range) from the stream keyed by `key`: draws below 2^64 mod range are
/// rejected so that every residue is equally likely (arc4random_uniform's method).
class key_stream {
 public:
  explicit key_stream(std::uint64_t key) noexcept : key_(key) {}
  std::uint64_t below(std::uint64_t range) noexcept {
    const std::uint64_t threshold = (0 - range) % range;
    std::uint64_t r = draw();
    while (r < threshold) r = draw();
    return r % range;
  }

 private:
  std::uint64_t draw() noexcept { return splitmix64(key_ + counter_++ * 0x9E3779B97F4A7C15ull); }
  std::uint64_t key_;
  std::uint64_t counter_ = 0;
};

}  // namespace detail

/// @brief The order of the examples in epoch `epoch`: a uniformly random permutation of
/// [0, count) (Fisher-Yates) drawn from a stream keyed by (seed, epoch) alone.
[[nodiscard]] inline std::vector<std::size_t> epoch_permutation(std::size_t count, std::uint64_t seed,
                                                                std::uint64_t epoch) {
  std::vector<std::size_t> order(count);
  std::iota(order.begin(), order.end(), std::size_t{0});
  detail::key_stream stream(detail::splitmix64(detail::splitmix64(seed) ^ epoch));
  for (std::size_t i = count; i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(stream.below(i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace meshlib::nn
// end meshlib/nn/data/permutation.hpp
// begin meshlib/nn/data/loader.hpp
/// @file
/// @brief The data loader: shuffles a dataset with a seeded permutation per epoch, cuts it into
/// global batches, hands each process only its rows of each global batch (as
/// `ds.shard(num_shards=process_count(), index=process_index())` does), and, where meshlib was
/// built with oneTBB, assembles the next batches on oneTBB worker threads while the caller trains.
///
/// @code
/// meshlib::nn::data_loader loader(data.train, {.global_batch = 256, .seed = 42,
///                                              .process_index = meshlib::distributed::process_index(),
///                                              .process_count = meshlib::distributed::process_count()});
/// for (std::size_t epoch = 0; epoch < 5; ++epoch) {
///   loader.start_epoch(epoch);
///   while (auto b = loader.next()) {
///     train_step(b->x, b->y, b->rows);  // this process's b->rows rows of global batch b->step
///   }
/// }
/// @endcode
///
/// Every process computes the same permutation (it depends only on seed and epoch), so the
/// processes' shares of a step are disjoint and together make the whole global batch. With
/// prefetching or without, the batches are the same, value for value.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#if defined(MESHLIB_ENABLE_TBB)
#include <tbb/task_group.h>
#endif


namespace meshlib::nn {

/// @brief How a data_loader cuts and distributes batches.
struct loader_options {
  std::size_t global_batch = 0;   ///< rows of one global batch, over all processes
  std::uint64_t seed = 0;         ///< the shuffle's seed; the same on every process
  bool shuffle = true;            ///< false: examples in file order
  bool drop_last = true;          ///< drop the last, incomplete global batch of an epoch
  std::size_t process_index = 0;  ///< this process's share: rows [i*B/n, (i+1)*B/n) of each batch
  std::size_t process_count = 1;  ///< must divide global_batch
  std::size_t prefetch = 2;       ///< batches assembled ahead (oneTBB builds); 0: on demand
};

/// @brief This process's rows of one global batch. It owns its data: it stays valid after the
/// loader moves on.
struct batch {
  std::vector<float> x{};         ///< rows * features values, row-major
  std::vector<std::int32_t> y{};  ///< rows labels
  std::size_t rows = 0;           ///< this process's rows
  /// values per row: `x` holds `rows * features` values
  std::size_t features = 0;
  std::size_t global_offset = 0;  ///< row of the global batch where this process's rows start
  std::size_t global_rows = 0;    ///< rows of the whole global batch (global_batch but for a last,
                                  ///< incomplete batch kept by drop_last = false)
  std::size_t step = 0;           ///< index of the global batch in its epoch
  /// the epoch this batch belongs to, from 0
  std::size_t epoch = 0;

  /// @brief The features of row `r` of this share.
  [[nodiscard]] std::span<const float> row(std::size_t r) const noexcept {
    return {x.data() + r * features, features};
  }
};

/// @brief Shuffles, batches and shards a dataset, one epoch at a time. A dataset passed as an
/// lvalue is read in place and must outlive the loader; one passed as an rvalue
/// (`data_loader(load_fashion_mnist().train, ...)`) is moved into the loader. Not thread-safe: one
/// thread calls start_epoch and next.
class data_loader {
 public:
  /// @brief A loader that reads `ds` in place (no copy); `ds` must outlive it.
  /// @throws meshlib::data_error when the options cannot batch the dataset: a global batch of 0,
  /// a process index outside [0, process_count), a global batch not divisible by the process
  /// count, no batch at all in an epoch, or a dataset whose vectors disagree with its counts.
  data_loader(const dataset& ds, loader_options options) : ds_(ds), options_(options) { check(); }

  /// @brief A loader that owns `ds` (a temporary would otherwise dangle).
  data_loader(dataset&& ds, loader_options options)
      : owned_(std::make_unique<const dataset>(std::move(ds))), ds_(*owned_), options_(options) {
    check();
  }

  data_loader(const data_loader&) = delete;
  data_loader& operator=(const data_loader&) = delete;

  /// Waits for batches still being assembled: they read the dataset and this loader.
  ~data_loader() { drain(); }

  /// @brief The dataset the loader reads.
  [[nodiscard]] const dataset& data() const noexcept { return ds_; }

  /// @brief Global batches per epoch: count / global_batch, rounded up when drop_last is false.
  [[nodiscard]] std::size_t steps_per_epoch() const noexcept { return steps_; }

  /// The options the loader was made with.
  [[nodiscard]] const loader_options& options() const noexcept { return options_; }

  /// @brief True when batches are assembled ahead on oneTBB threads (a oneTBB build and
  /// prefetch > 0); false when next() assembles each batch itself.
  [[nodiscard]] bool prefetching() const noexcept {
#if defined(MESHLIB_ENABLE_TBB)
    return slots_ != nullptr;
#else
    return false;
#endif
  }

  /// @brief Starts epoch `epoch` (any number, in any order: the order depends only on seed and
  /// epoch), dropping what remains of the current one, and starts prefetching its first batches.
  void start_epoch(std::size_t epoch) {
    drain();
    epoch_ = epoch;
    if (options_.shuffle) {
      order_ = epoch_permutation(ds_.count, options_.seed, epoch);
    } else if (order_.size() != ds_.count) {
      order_.resize(ds_.count);
      for (std::size_t i = 0; i < ds_.count; ++i) order_[i] = i;
    }
    next_step_ = 0;
    started_ = true;
#if defined(MESHLIB_ENABLE_TBB)
    if (slots_) {
      for (std::size_t s = 0; s < options_.prefetch && s < steps_; ++s) schedule(s);
    }
#endif
  }

  /// @brief This process's share of the next global batch of the epoch, or nullopt after the last.
  /// @throws meshlib::data_error before the first start_epoch.
  [[nodiscard]] std::optional<batch> next() {
    if (!started_) {
      throw data_error("meshlib: data_loader: next() called before start_epoch(epoch)");
    }
    if (next_step_ >= steps_) return std::nullopt;
    const std::size_t step = next_step_++;
#if defined(MESHLIB_ENABLE_TBB)
    if (slots_) {
      slot& s = slots_[step % options_.prefetch];
      s.group.wait();
      std::optional<batch> ready = std::move(s.ready);
      s.ready.reset();
      const std::exception_ptr failure = std::exchange(s.failure, nullptr);
      // The slot is free: start the batch `prefetch` steps ahead before handing this one out.
      if (step + options_.prefetch < steps_) schedule(step + options_.prefetch);
      if (failure) std::rethrow_exception(failure);
      return ready;
    }
#endif
    return assemble(step);
  }

 private:
  /// The options against the dataset, and the steps per epoch; see the constructor.
  void check() {
    const dataset& ds = ds_;
    const loader_options& options = options_;
    const std::string where = "meshlib: data_loader: ";
    if (ds.x.size() != ds.count * ds.features || ds.y.size() != ds.count) {
      throw data_error(where + "the dataset is inconsistent: count " + std::to_string(ds.count) +
                       " and features " + std::to_string(ds.features) + " need " +
                       std::to_string(ds.count * ds.features) + " values and " +
                       std::to_string(ds.count) + " labels, found " + std::to_string(ds.x.size()) +
                       " and " + std::to_string(ds.y.size()));
    }
    if (options.global_batch == 0) {
      throw data_error(where + "global_batch is 0, expected at least 1");
    }
    if (options.process_count == 0) {
      throw data_error(where + "process_count is 0, expected at least 1");
    }
    if (options.process_index >= options.process_count) {
      throw data_error(where + "process_index " + std::to_string(options.process_index) +
                       " is out of range for process_count " +
                       std::to_string(options.process_count));
    }
    if (options.global_batch % options.process_count != 0) {
      throw data_error(where + "global batch " + std::to_string(options.global_batch) +
                       " does not split evenly over " + std::to_string(options.process_count) +
                       " processes (remainder " +
                       std::to_string(options.global_batch % options.process_count) +
                       "); choose a global batch divisible by the process count");
    }
    steps_ = options.drop_last ? ds.count / options.global_batch
                               : (ds.count + options.global_batch - 1) / options.global_batch;
    if (steps_ == 0) {
      throw data_error(where + "an epoch has no batch: the dataset has " +
                       std::to_string(ds.count) + " examples, fewer than the global batch of " +
                       std::to_string(options.global_batch) +
                       (ds.count ? " (with drop_last; set drop_last = false to keep them)" : ""));
    }
#if defined(MESHLIB_ENABLE_TBB)
    if (options.prefetch > 0) slots_ = std::make_unique<slot[]>(options.prefetch);
#endif
  }

  /// Rows [p*g/n, (p+1)*g/n) of the global batch `step`, g its size: the share of process p of n.
  [[nodiscard]] batch assemble(std::size_t step) const {
    const std::size_t start = step * options_.global_batch;
    const std::size_t global_rows = std::min(options_.global_batch, ds_.count - start);
    const std::size_t p = options_.process_index;
    const std::size_t n = options_.process_count;
    const std::size_t begin = p * global_rows / n;
    const std::size_t end = (p + 1) * global_rows / n;
    batch b;
    b.rows = end - begin;
    b.features = ds_.features;
    b.global_offset = begin;
    b.global_rows = global_rows;
    b.step = step;
    b.epoch = epoch_;
    b.x.resize(b.rows * b.features);
    b.y.resize(b.rows);
    for (std::size_t r = 0; r < b.rows; ++r) {
      const std::size_t example = order_[start + begin + r];
      std::memcpy(b.x.data() + r * b.features, ds_.x.data() + example * ds_.features,
                  ds_.features * sizeof(float));
      b.y[r] = ds_.y[example];
    }
    return b;
  }

#if defined(MESHLIB_ENABLE_TBB)
  /// One batch in flight. A task_group per slot lets next() wait for exactly the batch it needs;
  /// waiting in a task_group also runs queued tasks, so the caller helps instead of idling.
  struct slot {
    tbb::task_group group;
    std::optional<batch> ready;
    std::exception_ptr failure;
  };

  void schedule(std::size_t step) {
    slot& s = slots_[step % options_.prefetch];
    s.group.run([this, &s, step] {
      try {
        s.ready = assemble(step);
      } catch (...) {
        s.failure = std::current_exception();
      }
    });
  }
#endif

  void drain() noexcept {
#if defined(MESHLIB_ENABLE_TBB)
    if (slots_) {
      for (std::size_t i = 0; i < options_.prefetch; ++i) {
        slots_[i].group.wait();  // never throws: the tasks catch everything
        slots_[i].ready.reset();
        slots_[i].failure = nullptr;
      }
    }
#endif
  }

  std::unique_ptr<const dataset> owned_;  // set when constructed from an rvalue
  const dataset& ds_;
  loader_options options_;
  std::size_t steps_ = 0;
  std::size_t epoch_ = 0;
  std::size_t next_step_ = 0;
  bool started_ = false;
  std::vector<std::size_t> order_;
#if defined(MESHLIB_ENABLE_TBB)
  std::unique_ptr<slot[]> slots_;
#endif
};

}  // namespace meshlib::nn
// end meshlib/nn/data/loader.hpp
// begin meshlib/nn/data/text.hpp
/// @file
/// @brief Plain text for byte-level language models: a file, or a directory's text files in name
/// order, read into one byte string (`load_text`), and the held-out tail that validation reads
/// (`split_text`), as nanoGPT's character models cut their corpus.
///
/// A byte-level vocabulary (256 values) needs no tokenizer and no vocabulary file, and reads any
/// text (UTF-8 included) without an unknown token; it is what a character model over a corpus with
/// non-ASCII bytes amounts to.
/// @code
/// auto corpus = meshlib::nn::load_text("/usr/share/games/fortunes");   // Debian's fortunes
/// auto [train, validation] = meshlib::nn::split_text(corpus, 0.1);     // the last 10% held out
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <system_error>
#include <vector>


namespace meshlib::nn {

/// @brief A text corpus in memory: the bytes of every file read, concatenated in `files` order.
struct text_corpus {
  std::vector<std::uint8_t> bytes{};            ///< the text, one byte per token
  std::vector<std::filesystem::path> files{};  ///< the files read, in order
};

/// @brief The training part and the held-out tail of a corpus (views into it).
struct text_split {
  std::span<const std::uint8_t> train;       ///< the first part
  std::span<const std::uint8_t> validation;  ///< the held-out tail
};

namespace detail {
/// Whether a directory entry is read as text: a regular file (or a link to one) whose name has no
/// extension. In Debian's fortunes directory that keeps the text files and skips their `.dat`
/// indexes and the `.u8` links to the same text (read once, not twice).
inline bool is_text_entry(const std::filesystem::directory_entry& e) {
  std::error_code ec;
  const auto name = e.path().filename().string();
  return e.is_regular_file(ec) && !name.empty() && name[0] != '.' && name.find('.') == std::string::npos;
}

inline void append_file(const std::filesystem::path& p, std::vector<std::uint8_t>& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw data_error("meshlib::nn::load_text: cannot open " + p.string() + " for reading");
  out.insert(out.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) throw data_error("meshlib::nn::load_text: reading " + p.string() + " failed");
}
}  // namespace detail

/// @brief Reads `path`: a file, or every file without an extension directly in a directory, in
/// name order (see `detail::is_text_entry`), concatenated.
/// @throws data_error naming the path when it does not exist, cannot be read, holds no such file,
/// or the text is empty; for a missing path the message says how to get Debian's `fortunes`.
inline text_corpus load_text(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  text_corpus c;
  if (!fs::exists(path, ec))
    throw data_error("meshlib::nn::load_text: " + path.string() +
                     " does not exist; give a text file or a directory of text files (Debian's fortunes: "
                     "apt-get install fortunes, text under /usr/share/games/fortunes; scripts/install_deps.sh installs it)");
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (detail::is_text_entry(e)) c.files.push_back(e.path());
    if (ec) throw data_error("meshlib::nn::load_text: cannot list " + path.string() + ": " + ec.message());
    std::sort(c.files.begin(), c.files.end());
    if (c.files.empty())
      throw data_error("meshlib::nn::load_text: " + path.string() +
                       " holds no text file (a regular file whose name has no extension); give a file or such a directory");
  } else {
    c.files.push_back(path);
  }
  for (const auto& f : c.files) detail::append_file(f, c.bytes);
  if (c.bytes.empty()) throw data_error("meshlib::nn::load_text: " + path.string() + " holds no text (0 bytes)");
  return c;
}

/// @brief Splits `c` into its first part and its last `holdout` fraction (rounded down to a byte).
/// @throws data_error when `holdout` is outside (0, 1) or either part is shorter than `min_bytes`
/// (what one window of a model's context needs: context + 1).
inline text_split split_text(const text_corpus& c, double holdout = 0.1, std::size_t min_bytes = 2) {
  if (!(holdout > 0.0 && holdout < 1.0))
    throw data_error("meshlib::nn::split_text: holdout " + std::to_string(holdout) +
                     " is not a fraction in (0, 1); 0.1 holds out the last 10%");
  const std::size_t n = c.bytes.size();
  const auto held = static_cast<std::size_t>(static_cast<double>(n) * holdout);
  if (held < min_bytes || n - held < min_bytes)
    throw data_error("meshlib::nn::split_text: " + std::to_string(n) + " bytes split " + std::to_string(n - held) +
                     " / " + std::to_string(held) + " leaves a part shorter than " + std::to_string(min_bytes) +
                     " bytes (one window: context + 1); give more text or a shorter context");
  const std::span<const std::uint8_t> all(c.bytes);
  return {all.first(n - held), all.last(held)};
}

}  // namespace meshlib::nn
// end meshlib/nn/data/text.hpp
// begin meshlib/nn/data/text_windows.hpp
/// @file
/// @brief Batches for next-token training on a byte string: `rows` windows of `context + 1` bytes,
/// inputs the first `context`, targets the same shifted by one (token `t + 1` is the label of
/// position `t`). Training windows start at random offsets drawn from a key (nanoGPT's `get_batch`,
/// made reproducible and independent of the mesh: window `r` of step `s` depends only on the key,
/// `s` and `r`); evaluation windows tile the text in order.
/// @code
/// auto b = meshlib::nn::sample_windows(split.train, 32, 64, key.fold_in(step));   // 32 x 64 tokens
/// b.inputs[r * 64 + t];   // byte t of window r; b.targets[r * 64 + t] is the byte after it
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>


namespace meshlib::nn {

/// @brief `rows` windows of `context` token ids and their next-token targets, row-major.
struct token_batch {
  std::size_t rows = 0;                 ///< windows
  std::size_t context = 0;              ///< tokens per window
  std::vector<std::int32_t> inputs{};   ///< rows * context ids (bytes: 0..255)
  std::vector<std::int32_t> targets{};  ///< rows * context ids: each input's next byte
};

namespace detail {
inline void require_windows(std::span<const std::uint8_t> text, std::size_t rows, std::size_t context,
                            const char* who) {
  if (rows == 0 || context == 0)
    throw data_error(std::string("meshlib::nn::") + who + ": rows and context must be positive (rows " +
                     std::to_string(rows) + ", context " + std::to_string(context) + ")");
  if (text.size() < context + 1)
    throw data_error(std::string("meshlib::nn::") + who + ": a window needs context + 1 = " +
                     std::to_string(context + 1) + " bytes, the text has " + std::to_string(text.size()) +
                     "; give more text or a shorter context");
}

inline void copy_window(std::span<const std::uint8_t> text, std::size_t start, std::size_t r, token_batch& b) {
  for (std::size_t t = 0; t < b.context; ++t) {
    b.inputs[r * b.context + t] = text[start + t];
    b.targets[r * b.context + t] = text[start + t + 1];
  }
}
}  // namespace detail

/// @brief `rows` windows at random starts in `[0, size - context - 1]`, window `r`'s start drawn from
/// `key` and `r` alone (pass `key.fold_in(step)` for a new batch each step).
/// @throws data_error when `rows` or `context` is 0, or the text is shorter than `context + 1`.
inline token_batch sample_windows(std::span<const std::uint8_t> text, std::size_t rows, std::size_t context,
                                  rng_key key) {
  detail::require_windows(text, rows, context, "sample_windows");
  token_batch b{rows, context, std::vector<std::int32_t>(rows * context), std::vector<std::int32_t>(rows * context)};
  const std::uint64_t starts = text.size() - context;  // start s reads s .. s + context
  for (std::size_t r = 0; r < rows; ++r) {
    // Two 24-bit draws give 48 bits, so every start of a text up to 2^48 bytes can come up; the
    // modulo bias is below 2^-24 for texts under 2^24 bytes and small beyond.
    const auto hi = static_cast<std::uint64_t>(uniform(key, 2 * r) * 16777216.0f);
    const auto lo = static_cast<std::uint64_t>(uniform(key, 2 * r + 1) * 16777216.0f);
    detail::copy_window(text, static_cast<std::size_t>(((hi << 24) | lo) % starts), r, b);
  }
  return b;
}

/// @brief Windows `first` to `first + rows - 1` of the text cut into consecutive windows of
/// `context` targets (window `w` reads bytes `w * context` to `(w + 1) * context`): evaluation over
/// the whole text in order. `count_windows` says how many there are.
/// @throws data_error when the text is shorter than `context + 1` or the windows run past its end.
inline token_batch tile_windows(std::span<const std::uint8_t> text, std::size_t context, std::size_t first,
                                std::size_t rows) {
  detail::require_windows(text, rows, context, "tile_windows");
  const std::size_t total = (text.size() - 1) / context;
  if (first + rows > total)
    throw data_error("meshlib::nn::tile_windows: windows " + std::to_string(first) + " .. " +
                     std::to_string(first + rows - 1) + " asked, the text has " + std::to_string(total) +
                     " windows of " + std::to_string(context) + " tokens");
  token_batch b{rows, context, std::vector<std::int32_t>(rows * context), std::vector<std::int32_t>(rows * context)};
  for (std::size_t r = 0; r < rows; ++r) detail::copy_window(text, (first + r) * context, r, b);
  return b;
}

/// The number of whole evaluation windows of `context` tokens in `text` (see `tile_windows`).
inline std::size_t count_windows(std::span<const std::uint8_t> text, std::size_t context) noexcept {
  return context == 0 || text.size() < 2 ? 0 : (text.size() - 1) / context;
}

}  // namespace meshlib::nn
// end meshlib/nn/data/text_windows.hpp
// begin meshlib/nn/data/byte_ngram.hpp
/// @file
/// @brief The count-based baselines a byte-level language model is judged against: unigram and
/// bigram models with add-one (Laplace) smoothing over the 256 byte values, fitted on the
/// training text and scored on held-out text as mean cross-entropy in nats per byte. A model that
/// does not beat the bigram has learnt little beyond which byte follows which.
/// @code
/// double uni = meshlib::nn::unigram_nats(split.train, split.validation);   // ~3.37 on fortunes
/// double bi  = meshlib::nn::bigram_nats(split.train, split.validation);    // ~2.62
/// @endcode

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>


namespace meshlib::nn {

/// @brief Mean -log p(byte) over `held_out`, p from the byte counts of `train` plus one each.
/// @throws data_error when `held_out` is empty.
inline double unigram_nats(std::span<const std::uint8_t> train, std::span<const std::uint8_t> held_out) {
  if (held_out.empty()) throw data_error("meshlib::nn::unigram_nats: the held-out text is empty");
  std::array<double, 256> count{};
  for (std::uint8_t b : train) count[b] += 1.0;
  const double total = static_cast<double>(train.size()) + 256.0;
  double nats = 0.0;
  for (std::uint8_t b : held_out) nats -= std::log((count[b] + 1.0) / total);
  return nats / static_cast<double>(held_out.size());
}

/// @brief Mean -log p(next | previous) over the `held_out.size() - 1` transitions of `held_out`, p from
/// the pair counts of `train` plus one for each of the 256 next bytes.
/// @throws data_error when `held_out` has fewer than 2 bytes.
inline double bigram_nats(std::span<const std::uint8_t> train, std::span<const std::uint8_t> held_out) {
  if (held_out.size() < 2) throw data_error("meshlib::nn::bigram_nats: the held-out text has fewer than 2 bytes");
  std::vector<double> pair(256 * 256, 0.0);
  std::array<double, 256> from{};
  for (std::size_t i = 0; i + 1 < train.size(); ++i) {
    pair[train[i] * 256u + train[i + 1]] += 1.0;
    from[train[i]] += 1.0;
  }
  double nats = 0.0;
  for (std::size_t i = 0; i + 1 < held_out.size(); ++i) {
    const std::uint8_t a = held_out[i], b = held_out[i + 1];
    nats -= std::log((pair[a * 256u + b] + 1.0) / (from[a] + 256.0));
  }
  return nats / static_cast<double>(held_out.size() - 1);
}

}  // namespace meshlib::nn
// end meshlib/nn/data/byte_ngram.hpp
// end meshlib/nn/data.hpp
// begin meshlib/nn/device_put.hpp
/// @file
/// @brief Putting a batch where the model's kernels run: `device_put` of a `batch` (JAX's
/// `jax.device_put(batch)`, PyTorch's `batch.to(device, non_blocking=True)`) and
/// `device_prefetcher`, which copies the next batch while the current step computes (flax's
/// `prefetch_to_device`, a DataLoader with `pin_memory=True`).
///
/// Why: the data loader assembles batches in host memory. On a host backend the model reads them
/// in place; on a GPU a kernel handed a host address fails at some later fence with an illegal
/// address, or reads garbage. `train_step` and `evaluate` therefore never hand a kernel a pointer it
/// cannot read: they ask where the input is (tensor/pointer_check.hpp) and stage host rows into each
/// device's buffer themselves, synchronously. A `device_batch` from `device_put` or a
/// `device_prefetcher` is already in device memory: the step reads it in place, and with the
/// prefetcher the copy of step k+1 ran on a copy stream of its own while step k computed.
///
/// How the copy is made: the rows are written into pinned (page-locked) host memory, then copied to
/// the device asynchronously on the prefetcher's own execution-space instance (its own CUDA stream),
/// which is fenced only when the batch is handed out. On a host backend there is nothing to copy:
/// `device_put` of an rvalue batch moves its rows in, and the prefetcher hands the loader's batches
/// through.
///
/// The labels stay in host memory as well (`device_batch::y`): the loss checks every label against
/// the class count on the host before a kernel reads it, and copies the 4 bytes a row itself.
/// @code
/// nn::data_loader loader(data.train, {.global_batch = 256, .seed = 0});
/// nn::device_prefetcher batches(loader);              // flax: prefetch_to_device(iterator, 2)
/// batches.start_epoch(epoch);
/// while (auto b = batches.next()) nn::train_step(state, *b, runner);
/// auto one = nn::device_put(*loader.next());           // jax.device_put(batch)
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>


namespace meshlib::nn {

/// @brief This process's rows of one global batch with its features in the memory the model's
/// kernels read (`default_memory_space`): a `batch` after `device_put`. The labels stay on the host.
/// Copies share the features (a Kokkos view's reference semantics).
struct device_batch {
  /// `rows * features` values, row-major, in `default_memory_space`
  Kokkos::View<float*, default_memory_space> x{};
  std::vector<std::int32_t> y{};  ///< `rows` labels, in host memory
  std::size_t rows = 0;           ///< this process's rows
  std::size_t features = 0;       ///< values per row
  std::size_t global_offset = 0;  ///< row of the global batch where this process's rows start
  std::size_t global_rows = 0;    ///< rows of the whole global batch
  std::size_t step = 0;           ///< index of the global batch in its epoch
  std::size_t epoch = 0;          ///< the epoch this batch belongs to
  /// On a host space, the rows `x` views (moved in from the batch, not copied); empty otherwise.
  std::shared_ptr<const std::vector<float>> host_rows{};
};

namespace detail {

/// The batch's fields but the features.
inline device_batch device_batch_header(const batch& b) {
  device_batch d;
  d.y = b.y;
  d.rows = b.rows;
  d.features = b.features;
  d.global_offset = b.global_offset;
  d.global_rows = b.global_rows;
  d.step = b.step;
  d.epoch = b.epoch;
  return d;
}

}  // namespace detail

/// @brief `jax.device_put(batch)`: the batch's features copied into `default_memory_space`, and
/// waited for (`device_prefetcher` overlaps the copy with the step instead). On a host space
/// nothing is copied: the rows move into the result (pass the batch as an rvalue; an lvalue is
/// copied first).
[[nodiscard]] inline device_batch device_put(batch b) {
  device_batch d = detail::device_batch_header(b);
  if constexpr (meshlib::host_accessible_v<default_memory_space>) {
    d.host_rows = std::make_shared<const std::vector<float>>(std::move(b.x));
    d.x = Kokkos::View<float*, default_memory_space>(const_cast<float*>(d.host_rows->data()), d.host_rows->size());
  } else {
    d.x = Kokkos::View<float*, default_memory_space>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshlib::nn::device_batch"), b.x.size());
    Kokkos::deep_copy(d.x, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
                               b.x.data(), b.x.size()));
  }
  return d;
}

/// @brief Copies the next batches of a `data_loader` into device memory while the current step
/// computes: flax's `prefetch_to_device(iterator, 2)` (see the file comment). On a device space one
/// batch is in flight ahead of the one handed out; on a host space, with no copy to overlap, each
/// batch is taken from the loader when asked for (its rows then still in the cache for the step).
/// Not thread-safe; the loader must outlive it, and only the prefetcher calls the loader's
/// `start_epoch` / `next` while it is in use.
class device_prefetcher {
 public:
  /// @brief A prefetcher over `loader` (read in place; it must outlive the prefetcher).
  explicit device_prefetcher(data_loader& loader) : loader_(loader) {}
  device_prefetcher(const device_prefetcher&) = delete;
  device_prefetcher& operator=(const device_prefetcher&) = delete;
  ~device_prefetcher() { wait(); }

  /// @brief Starts epoch `epoch` of the loader and the copy of its first batch.
  void start_epoch(std::size_t epoch) {
    wait();
    loader_.start_epoch(epoch);
    started_ = true;
    if constexpr (!meshlib::host_accessible_v<default_memory_space>) ahead_ = issue(loader_.next());
  }

  /// @brief The next batch of the epoch in device memory (nullopt after the last), and starts the
  /// copy of the one after it. @throws meshlib::data_error before the first `start_epoch`.
  [[nodiscard]] std::optional<device_batch> next() {
    if (!started_) throw data_error("meshlib: device_prefetcher: next() called before start_epoch(epoch)");
    if constexpr (meshlib::host_accessible_v<default_memory_space>) {
      // On a host space there is no copy to overlap, so nothing runs ahead: the batch is assembled
      // when asked for and its rows are still in the cache when the step's first layer reads them
      // (assembled a step ahead, the step in between may have evicted them), and one batch is
      // held, not two.
      return issue(loader_.next());
    }
    wait();
    std::optional<device_batch> out = std::move(ahead_);
    ahead_.reset();
    if (out) ahead_ = issue(loader_.next());
    return out;
  }

  /// @brief Whether batches are copied (a device memory space) or handed through (host).
  [[nodiscard]] static constexpr bool copies() noexcept {
    return !meshlib::host_accessible_v<default_memory_space>;
  }

  /// The loader it reads.
  [[nodiscard]] data_loader& loader() noexcept { return loader_; }

 private:
  using device_view = Kokkos::View<float*, default_memory_space>;

  /// The features of `b` into a device view: moved in on a host space; on a device space written
  /// into the pinned stage and copied asynchronously on the copy instance.
  std::optional<device_batch> issue(std::optional<batch> b) {
    started_ = true;
    if (!b) return std::nullopt;
    if constexpr (!copies()) {
      return device_put(std::move(*b));
    } else {
      device_batch d = detail::device_batch_header(*b);
      stage(*b, d);
      return d;
    }
  }

  /// The device path: one pinned stage (the last copy was waited for before this one is written),
  /// and a ring of device buffers reused when nobody else holds them.
  void stage(const batch& b, device_batch& d) {
#if KOKKOS_VERSION >= 40000
    const std::size_t n = b.x.size();
    if (pinned_.extent(0) < n)
      pinned_ = pinned_view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshlib::nn::pinned_batch"), n);
    std::memcpy(pinned_.data(), b.x.data(), n * sizeof(float));
    device_view& slot = ring_[next_slot_];
    next_slot_ = (next_slot_ + 1) % ring_.size();
    if (slot.extent(0) != n || slot.use_count() > 1)  // a batch the caller still holds is not overwritten
      slot = device_view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshlib::nn::device_batch"), n);
    if (!copy_) copy_.emplace(Kokkos::Experimental::partition_space(Kokkos::DefaultExecutionSpace(), 1)[0]);
    Kokkos::deep_copy(*copy_, slot, Kokkos::subview(pinned_, std::make_pair(std::size_t{0}, n)));
    in_flight_ = true;
    d.x = slot;
#else
    (void)b;
    (void)d;
    static_assert(!copies(), "meshlib: device_prefetcher: a device memory space needs Kokkos 4");
#endif
  }

  /// Waits for the copy in flight, if any.
  void wait() {
#if KOKKOS_VERSION >= 40000
    if (in_flight_ && copy_) copy_->fence("meshlib::nn::device_prefetcher");
#endif
    in_flight_ = false;
  }

#if KOKKOS_VERSION >= 40000
  using pinned_view = Kokkos::View<float*, Kokkos::SharedHostPinnedSpace>;
  pinned_view pinned_{};
  std::optional<Kokkos::DefaultExecutionSpace> copy_{};
#endif
  data_loader& loader_;
  std::optional<device_batch> ahead_{};
  std::array<device_view, 3> ring_{};
  std::size_t next_slot_ = 0;
  bool in_flight_ = false;
  bool started_ = false;
};

}  // namespace meshlib::nn
// end meshlib/nn/device_put.hpp
// begin meshlib/nn/train/loss_scaler.hpp
/// @file
/// @brief `loss_scaler`: dynamic loss scaling (PyTorch's `GradScaler`): the loss is multiplied by
/// the scale before backward and the summed gradients divided by it; a step whose gradients hold an
/// inf or NaN on any device is skipped on every device and halves the scale, and `growth_interval`
/// good steps in a row double it. A `train_state` holds one (`train_options::loss_scale`).
/// @code
/// meshlib::nn::loss_scaler s(0.0f, true);   // float16 compute: on, from 32768
/// const bool counts = s.update(skipped, 2000);  // after each step, with every device's verdict
/// @endcode

#include <algorithm>
#include <cstddef>


namespace meshlib::nn {

/// @brief Dynamic loss scaling's state and rules (see the file comment).
class loss_scaler {
 public:
  /// Off: a scale of 1.
  loss_scaler() = default;
  /// `initial > 0`: on, from that scale; 0: on from 32768 when `needed` (a float16 compute type),
  /// off otherwise.
  loss_scaler(float initial, bool needed) noexcept
      : scale_(initial > 0 ? initial : (needed ? 32768.0f : 1.0f)), on_(initial > 0 || needed) {}

  /// The current scale (1 when off).
  [[nodiscard]] float scale() const noexcept { return scale_; }
  /// Whether loss scaling is on.
  [[nodiscard]] bool enabled() const noexcept { return on_; }
  /// Consecutive good steps since the scale last changed.
  [[nodiscard]] std::size_t good_steps() const noexcept { return good_steps_; }

  /// After a step, with every device's verdict (equal on all of them): on a skipped step halves the
  /// scale (not below 2^-16) and returns false; otherwise counts the good step, doubles the scale
  /// after `growth_interval` of them, and returns true (the step counts). Off: always true.
  bool update(bool skipped, std::size_t growth_interval) noexcept {
    if (!on_) return true;
    if (skipped) {
      scale_ = std::max(scale_ * 0.5f, 1.0f / 65536.0f);
      good_steps_ = 0;
      return false;
    }
    if (++good_steps_ >= growth_interval) {
      scale_ *= 2.0f;
      good_steps_ = 0;
    }
    return true;
  }
  /// Divides the `n` gradients at `g` by the scale (nothing when off or at 1).
  void unscale(float* g, std::size_t n) const noexcept {
    if (on_ && scale_ != 1.0f) detail::scale_in_place(g, n, 1.0f / scale_);
  }

 private:
  float scale_ = 1.0f;
  bool on_ = false;
  std::size_t good_steps_ = 0;
};

}  // namespace meshlib::nn
// end meshlib/nn/train/loss_scaler.hpp
// begin meshlib/nn/train/train_state.hpp
/// @file
/// @brief `train_state` (model parameters, optimizer state, step, random key: flax's `TrainState`)
/// and `train_options` (accumulation micro-batches, loss scaling). The parallelism is the policies
/// the state is made with (nn/parallel/: `data_parallel` with ZeRO-1 and overlap, `fully_shard`,
/// `pipeline`); the state keeps them and builds each one's engine. The steps themselves are in
/// nn/train/train_step.hpp and nn/train/evaluate.hpp.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)));
/// @endcode

#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/nn/parallel/pipeline.hpp
/// @file
/// @brief Pipeline-parallel training over a mesh axis (issue 26): a `sequential`
/// model cut into stages (contiguous runs of layers), one stage per device of the axis, the batch
/// cut into micro-batches that flow through the stages under a GPipe or 1F1B order, activations
/// forward and gradients backward by the public typed `ppermute` between neighbouring stages
/// (torch.distributed.pipelining's `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B`, or the JAX
/// `shard_map` + `ppermute` pipeline loop).
///
/// A `train_state` given the policy `pipeline<"axis">` (any axis of its mesh) over an axis of
/// `p > 1` devices trains this way; the policy holds the micro-batches, schedule and stage split.
/// A mesh axis is pipelined only by the policy, whatever its name: a state whose pipeline axis
/// (`pipeline` by default) has more than one device and no policy is refused at construction.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"pipe">>;
/// meshlib::nn::train_state state(mesh_t{2, 2}, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)),
///     meshlib::nn::pipeline<"pipe">{.schedule = meshlib::nn::pipeline_kind::gpipe, .microbatches = 4});
/// auto m = meshlib::nn::train_step(state, batch);  // m.loss: computed on the last stage, reported to all
/// @endcode
///
/// Why lockstep rounds: `ppermute` is a collective of the whole axis (every stage calls it, as in
/// JAX), so the stages meet at each exchange. A step is a sequence of rounds; in a round every
/// stage runs at most one forward, then the activations move one stage on, then every stage runs
/// at most one backward, then the gradients move one stage back (`pipeline_plan`). A message
/// therefore takes one round per hop each way, and 1F1B warms up with `2 (p - 1 - s)` forwards on
/// stage `s` instead of the `p - 1 - s` of an asynchronous runtime (torch's send/recv): the same
/// bubble, (p - 1) / (m + p - 1), with up to `2 (p - s) - 1` micro-batches in flight instead of
/// GPipe's `m`.
///
/// Why recomputation: a layer keeps what its backward needs from its *last* forward, so a stage
/// keeps each in-flight micro-batch's *input* (the received activation) and, when the backward of a
/// micro-batch is not the one its layers last ran forward, runs the stage's forward on it again
/// first (stage-level activation checkpointing; the same numbers, dropout included: its mask is a
/// function of the step's key and the rows).
///
/// What it computes: what `train_options{.accumulation = m}` computes without a pipeline on the same
/// data mesh (the same rows per forward, the gradients summed over the micro-batches); so 16-bit
/// compute rounds as there (each layer's output and cotangent, the loss's scaled gradient, the
/// summed gradients), batch norm takes statistics per micro-batch and moves its running statistics
/// once per micro-batch in order (a recompute saves and restores them; after the step every stage
/// gets the others' by a sum over the axis), and `accumulation = k` runs `k` whole schedules before
/// the one synchronisation (`k m` micro-batches). Activation memory: a stage holds its layers'
/// buffers for one micro-batch plus the boundary buffers of `pipeline_plan::held`, metered as
/// `step_metrics::peak_activation_bytes`.
///
/// Parameters: a device holds, synchronises and updates only its stage's parameters (its
/// `params[i].count[dev]` is 0 for the others, so optimizer state, gradient synchronisation over the
/// data axes, clipping and checkpoints skip them); a parameter that a later stage's layer also reads
/// (a `tied_head`'s embedding table) is owned by the first stage and mirrored on the other: the
/// owner sends its value before each step, the mirror sends its gradient back after the backward.
///
/// Composition: the data axes split the batch and all-reduce (or, under ZeRO-1, reduce-scatter)
/// each stage's gradients as without a pipeline; a tensor axis runs inside the layers; under FSDP
/// the stages restrict the shards and the stage runner calls the FSDP hooks around each layer.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

// begin meshlib/nn/parallel/pipeline_schedule.hpp
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
// end meshlib/nn/parallel/pipeline_schedule.hpp

namespace meshlib::nn {

/// @brief Which order the micro-batches run in (torch's `ScheduleGPipe` / `Schedule1F1B`).
enum class pipeline_kind : std::uint8_t {
  gpipe,        ///< every forward, then every backward: m micro-batches' activations in flight
  one_f_one_b,  ///< after a warm-up, one forward and one backward in turn: fewer in flight
};

/// @brief Pipeline parallelism over the mesh axis `Axis` (see the file comment; torchtitan's
/// `pipeline_llama`); a `parallel_policy`. Its schedule runs the step's micro-batches
/// (nn/parallel/pipeline_run.hpp). Composes with `data_parallel` and `fully_shard` on other axes.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt,
///     meshlib::nn::pipeline<"pipe">{.schedule = meshlib::nn::pipeline_kind::gpipe, .microbatches = 8});
/// @endcode
/// @tparam Axis the mesh axis whose devices hold the stages.
template <fixed_string Axis = "pipeline">
struct pipeline {
  /// The parallelism this policy applies.
  static constexpr parallelism kind = parallelism::pipelined;
  /// The mesh axis it applies over.
  static constexpr auto axis = Axis;
  /// The order of forwards and backwards.
  pipeline_kind schedule = pipeline_kind::one_f_one_b;
  /// Micro-batches per step (0: as many as stages).
  std::size_t microbatches = 0;
  /// The index of the first layer of every stage after the first (torch's `split_spec`, as layer
  /// indices): `{2, 4}` on 3 stages runs layers [0, 2), [2, 4), [4, n). Empty: stages balanced by
  /// parameter count.
  std::vector<std::size_t> split_points = {};
};

/// @brief One stage's work in one round of a `pipeline_plan`: the micro-batch it runs forward and
/// the one it runs backward (`none` for neither).
struct pipeline_slot {
  static constexpr std::size_t none = static_cast<std::size_t>(-1);  ///< no micro-batch
  std::size_t forward = none;   ///< runs in the round's first half
  std::size_t backward = none;  ///< runs in the round's second half
};

/// @brief Where one device's compute time in its last pipelined step went (`nn::stage_times`):
/// thread CPU seconds where the platform has a per-thread clock (Linux, macOS: not inflated when
/// other work shares the cores), else wall seconds; with the number of each. What
/// `pipeline_plan::bubble_with_costs` takes, per stage, as the cost of one of each.
struct pipeline_stage_times {
  double forward = 0;         ///< in its forwards (the first run of each micro-batch, loss included)
  double backward = 0;        ///< in its backwards, less the forwards they first run again
  double recompute = 0;       ///< in the forwards run again before a backward
  std::size_t forwards = 0;   ///< forwards run
  std::size_t backwards = 0;  ///< backwards run
  std::size_t recomputes = 0; ///< forwards run again
};

/// @brief The lockstep rounds a pipelined step runs (see the file comment): per round, per stage,
/// what it runs. Built from the per-stage orders of `pipeline_schedule` (GPipe) or 1F1B with a
/// warm-up of `2 (p - 1 - s)` forwards, each stage running its next step as soon as its input has
/// arrived.
class pipeline_plan {
 public:
  /// The plan of `kind` for `stages` x `microbatches`.
  /// @throws sharding_error when either is 0.
  pipeline_plan(pipeline_kind kind, std::size_t stages, std::size_t microbatches)
      : kind_(kind), p_(stages), m_(microbatches) {
    if (stages == 0 || microbatches == 0)
      throw sharding_error("meshlib::nn::pipeline_plan: " + std::to_string(stages) + " stages x " +
                           std::to_string(microbatches) + " micro-batches; a pipeline needs at least one of each");
    build();
  }

  /// GPipe or 1F1B.
  [[nodiscard]] pipeline_kind kind() const noexcept { return kind_; }
  /// "GPipe" or "1F1B".
  [[nodiscard]] std::string name() const { return kind_ == pipeline_kind::gpipe ? "GPipe" : "1F1B"; }
  /// Stages.
  [[nodiscard]] std::size_t stages() const noexcept { return p_; }
  /// Micro-batches per step.
  [[nodiscard]] std::size_t microbatches() const noexcept { return m_; }
  /// The rounds: `rounds()[r][s]` is stage `s`'s work in round `r`.
  [[nodiscard]] const std::vector<std::vector<pipeline_slot>>& rounds() const noexcept { return rounds_; }

  /// The fraction of stage time idle when a forward takes `forward` and a backward `backward` (any
  /// units) on every stage and messages are free: a round lasts the forward if any stage runs one,
  /// plus the backward if any stage runs one. (p - 1) / (m + p - 1) for both kinds.
  [[nodiscard]] double bubble_fraction(double forward = 1.0, double backward = 2.0) const {
    double total = 0;
    for (const auto& r : rounds_) {
      bool f = false, b = false;
      for (const auto& x : r) {
        f = f || x.forward != pipeline_slot::none;
        b = b || x.backward != pipeline_slot::none;
      }
      total += (f ? forward : 0.0) + (b ? backward : 0.0);
    }
    return 1.0 - static_cast<double>(m_) * (forward + backward) / total;
  }

  /// Whether stage `stage`'s backward in round `round` first runs its forward again: its layers
  /// last ran another micro-batch's forward (see the file comment). The last stage under 1F1B never does.
  [[nodiscard]] bool recomputes(std::size_t round, std::size_t stage) const { return recompute_.at(round).at(stage) != 0; }

  /// `bubble_fraction` with the recomputed forwards counted as work: a backward that recomputes
  /// costs `forward + backward`. The stages then do unequal work (the last does less), and this is
  /// what a balanced model's measured bubble approaches.
  [[nodiscard]] double bubble_with_recompute(double forward = 1.0, double backward = 2.0) const {
    double total = 0, busy = 0;
    for (std::size_t r = 0; r < rounds_.size(); ++r) {
      double f = 0, b = 0;
      for (std::size_t s = 0; s < p_; ++s) {
        if (rounds_[r][s].forward != pipeline_slot::none) f = forward;
        if (rounds_[r][s].backward == pipeline_slot::none) continue;
        const double c = backward + (recompute_[r][s] ? forward : 0.0);
        b = std::max(b, c);
        busy += c;
      }
      total += f + b;
    }
    busy += static_cast<double>(p_ * m_) * forward;
    return 1.0 - busy / (static_cast<double>(p_) * total);
  }

  /// `bubble_with_recompute` with each stage's own costs: `forward[s]`, `backward[s]` and
  /// `recompute[s]` the seconds (any unit) of one forward, one backward and one recomputed forward
  /// on stage `s`. A round lasts its slowest forward plus its slowest backward (a recomputing one
  /// with its recompute); the bubble is the stages' idle share of that. With measured costs
  /// (`nn::stage_times`) it is what the schedule costs on that model when messages are free:
  /// stages whose work differs (a first stage skips its input's cotangent; recomputation falls on
  /// some stages only) idle even at the plan's best.
  /// @throws sharding_error when a vector does not have one cost per stage.
  [[nodiscard]] double bubble_with_costs(const std::vector<double>& forward, const std::vector<double>& backward,
                                         const std::vector<double>& recompute) const {
    if (forward.size() != p_ || backward.size() != p_ || recompute.size() != p_)
      throw sharding_error("meshlib::nn::pipeline_plan::bubble_with_costs: " + std::to_string(forward.size()) + ", " +
                           std::to_string(backward.size()) + " and " + std::to_string(recompute.size()) +
                           " costs for " + std::to_string(p_) + " stages; give one forward, backward and recompute "
                           "cost per stage");
    double total = 0, busy = 0;
    for (std::size_t r = 0; r < rounds_.size(); ++r) {
      double f = 0, b = 0;
      for (std::size_t s = 0; s < p_; ++s) {
        if (rounds_[r][s].forward != pipeline_slot::none) {
          f = std::max(f, forward[s]);
          busy += forward[s];
        }
        if (rounds_[r][s].backward == pipeline_slot::none) continue;
        const double c = backward[s] + (recompute_[r][s] ? recompute[s] : 0.0);
        b = std::max(b, c);
        busy += c;
      }
      total += f + b;
    }
    return total <= 0 ? 0.0 : 1.0 - busy / (static_cast<double>(p_) * total);
  }

  /// The most micro-batches stage `stage` holds the input of at once (forwarded, not yet backwarded).
  [[nodiscard]] std::size_t peak_in_flight(std::size_t stage) const {
    std::size_t held = 0, peak = 0;
    for (const auto& r : rounds_) {
      if (r.at(stage).forward != pipeline_slot::none) peak = std::max(peak, ++held);
      if (r[stage].backward != pipeline_slot::none) --held;
    }
    return peak;
  }

  /// @brief What stage `stage` holds between rounds (`slots`): for each micro-batch, the slot of the
  /// stage's buffers its received activation, its received cotangent and (last stage) its loss's
  /// gradient live in, and how many slots of each the stage needs. A received activation is held
  /// from the exchange that brings it until the stage's backward of that micro-batch (it is the
  /// layers' saved input, and what a recomputing backward starts from); a received cotangent until
  /// that backward; the loss's gradient from the last stage's forward (where the loss is taken)
  /// until its backward. A slot freed by a backward is reused by the next arrival (lowest first).
  struct holding {
    std::vector<std::size_t> input_slot;      ///< per micro-batch (`pipeline_slot::none` on stage 0)
    std::vector<std::size_t> cotangent_slot;  ///< per micro-batch (`none` on the last stage)
    std::vector<std::size_t> loss_grad_slot;  ///< per micro-batch (`none` but on the last stage)
    std::size_t inputs = 0;                   ///< slots of received activations
    std::size_t cotangents = 0;               ///< slots of received cotangents
    std::size_t loss_grads = 0;               ///< slots of the loss's gradients
  };
  /// The buffers stage `stage` holds over the rounds (see `holding`). Under GPipe the last stage
  /// holds all `m` activations and loss gradients; under 1F1B at most `2 (p - s)` activations.
  [[nodiscard]] holding held(std::size_t stage) const {
    constexpr std::size_t none = pipeline_slot::none;
    holding h;
    h.input_slot.assign(m_, none);
    h.cotangent_slot.assign(m_, none);
    h.loss_grad_slot.assign(m_, none);
    std::vector<char> in_use[3];
    const auto take = [&](int kind, std::vector<std::size_t>& slot, std::size_t& count, std::size_t j) {
      auto& u = in_use[kind];
      std::size_t i = 0;
      while (i < u.size() && u[i]) ++i;
      if (i == u.size()) u.push_back(0);
      u[i] = 1;
      slot[j] = i;
      count = std::max(count, u.size());
    };
    const auto give = [&](int kind, const std::vector<std::size_t>& slot, std::size_t j) {
      if (slot[j] != none) in_use[kind][slot[j]] = 0;
    };
    for (const auto& r : rounds_) {
      if (stage + 1 == p_ && r.at(stage).forward != none) take(2, h.loss_grad_slot, h.loss_grads, r[stage].forward);
      if (stage > 0 && r[stage - 1].forward != none) take(0, h.input_slot, h.inputs, r[stage - 1].forward);
      if (const std::size_t j = r[stage].backward; j != none) {
        give(0, h.input_slot, j);
        give(1, h.cotangent_slot, j);
        give(2, h.loss_grad_slot, j);
      }
      if (stage + 1 < p_ && r[stage + 1].backward != none) take(1, h.cotangent_slot, h.cotangents, r[stage + 1].backward);
    }
    return h;
  }

  /// One row per stage, one column per round half: `F3` / `B3` when micro-batch 3's forward /
  /// backward runs, `..` when idle.
  /// @code
  /// 1F1B, 2 stages x 3 micro-batches, 5 rounds
  /// stage 0 | F0 .. F1 .. F2 B0 .. B1 .. B2
  /// stage 1 | .. .. F0 B0 F1 B1 F2 B2 .. ..
  /// @endcode
  [[nodiscard]] std::string timeline() const {
    std::string out = name() + ", " + std::to_string(p_) + " stages x " + std::to_string(m_) + " micro-batches, " +
                      std::to_string(rounds_.size()) + " rounds\n";
    const std::size_t width = std::to_string(m_ - 1).size() + 1;
    const auto cell = [&](char c, std::size_t j) {
      std::string s = j == pipeline_slot::none ? std::string(width, '.') : c + std::to_string(j);
      s.resize(width, ' ');
      return s;
    };
    for (std::size_t s = 0; s < p_; ++s) {
      out += "stage " + std::to_string(s) + " |";
      for (const auto& r : rounds_) out += " " + cell('F', r[s].forward) + " " + cell('B', r[s].backward);
      out += "\n";
    }
    return out;
  }

 private:
  // Each stage's order, then a lockstep replay: a forward's output reaches the next stage for the
  // next round, a backward's for the next round too; the last stage may run a micro-batch's
  // backward in the round of its forward (the loss is computed in between).
  void build() {
    std::vector<std::vector<pipeline_step>> order(p_);
    if (kind_ == pipeline_kind::gpipe) {
      const auto g = pipeline_schedule::gpipe(p_, m_);
      for (std::size_t s = 0; s < p_; ++s) order[s] = g.steps(s);
    } else {
      for (std::size_t s = 0; s < p_; ++s) {
        const std::size_t warmup = std::min(2 * (p_ - 1 - s), m_);
        std::size_t f = 0, b = 0;
        for (; f < warmup; ++f) order[s].push_back({pipeline_pass::forward, f});
        for (; f < m_; ++f, ++b) {
          order[s].push_back({pipeline_pass::forward, f});
          order[s].push_back({pipeline_pass::backward, b});
        }
        for (; b < m_; ++b) order[s].push_back({pipeline_pass::backward, b});
      }
    }
    // has_in[s][j]: stage s can run forward j; has_dy[s][j]: it can run backward j.
    std::vector<std::vector<char>> has_in(p_, std::vector<char>(m_, 0)), has_dy = has_in;
    std::fill(has_in[0].begin(), has_in[0].end(), 1);
    std::vector<std::size_t> next(p_, 0), last_forward(p_, pipeline_slot::none);
    std::size_t left = p_ * 2 * m_;
    while (left > 0) {
      std::vector<pipeline_slot> r(p_);
      std::vector<std::pair<std::size_t, std::size_t>> arrive_in, arrive_dy;  // (stage, micro-batch)
      for (std::size_t s = 0; s < p_; ++s) {
        if (next[s] == order[s].size()) continue;
        const auto& x = order[s][next[s]];
        if (x.pass != pipeline_pass::forward || !has_in[s][x.microbatch]) continue;
        r[s].forward = x.microbatch;
        ++next[s];
        --left;
        if (s + 1 < p_) arrive_in.push_back({s + 1, x.microbatch});
        else has_dy[s][x.microbatch] = 1;  // the loss's gradient, at once
      }
      for (std::size_t s = 0; s < p_; ++s) {
        if (next[s] == order[s].size()) continue;
        const auto& x = order[s][next[s]];
        if (x.pass != pipeline_pass::backward || !has_dy[s][x.microbatch]) continue;
        r[s].backward = x.microbatch;
        ++next[s];
        --left;
        if (s > 0) arrive_dy.push_back({s - 1, x.microbatch});
      }
      std::vector<char> again(p_, 0);
      for (std::size_t s = 0; s < p_; ++s) {
        if (r[s].forward != pipeline_slot::none) last_forward[s] = r[s].forward;
        if (r[s].backward == pipeline_slot::none) continue;
        again[s] = last_forward[s] != r[s].backward;
        last_forward[s] = pipeline_slot::none;  // a backward leaves the layers' saved state spent
      }
      recompute_.push_back(std::move(again));
      for (auto [s, j] : arrive_in) has_in[s][j] = 1;
      for (auto [s, j] : arrive_dy) has_dy[s][j] = 1;
      rounds_.push_back(std::move(r));
      if (rounds_.size() > 4 * (p_ + m_) + 4)  // a bug, not an input: the orders above never deadlock
        throw sharding_error("meshlib::nn::pipeline_plan: the stage orders deadlock");
    }
  }

  pipeline_kind kind_;
  std::size_t p_, m_;
  std::vector<std::vector<pipeline_slot>> rounds_;
  std::vector<std::vector<char>> recompute_;  // [round][stage]
};

/// @brief The stages of a model of `layer_params.size()` layers (`layer_params[l]`: layer `l`'s
/// parameter elements) on `stages` devices: `[begin, end)` layer ranges. With `split_points` empty,
/// balanced: the contiguous split with at least one layer per stage whose largest stage has the
/// fewest parameters (ties: the earliest cuts).
/// @throws sharding_error when there are more stages than layers, or `split_points` is not
/// `stages - 1` strictly increasing indices in `[1, layers - 1]`.
inline std::vector<std::pair<std::size_t, std::size_t>> pipeline_stages(const std::vector<std::size_t>& layer_params,
                                                                        std::size_t stages,
                                                                        const std::vector<std::size_t>& split_points = {}) {
  const std::size_t n = layer_params.size();
  const auto list = [](const std::vector<std::size_t>& v) {
    std::string s = "{";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "}";
  };
  if (stages > n)
    throw sharding_error("meshlib::nn: pipeline: the mesh's 'pipeline' axis has " + std::to_string(stages) +
                         " devices (one stage each) but the model has " + std::to_string(n) +
                         " layers; a stage needs at least one layer: use a pipeline axis of at most " + std::to_string(n) +
                         " devices or a model with more layers");
  std::vector<std::size_t> cuts;
  if (!split_points.empty()) {
    if (split_points.size() + 1 != stages)
      throw sharding_error("meshlib::nn: pipeline: split_points " + list(split_points) + " make " +
                           std::to_string(split_points.size() + 1) + " stages but the mesh's 'pipeline' axis has " +
                           std::to_string(stages) + " devices (one stage each); give " + std::to_string(stages - 1) +
                           " split points, or none to balance the stages by parameter count");
    for (std::size_t i = 0; i < split_points.size(); ++i)
      if (split_points[i] == 0 || split_points[i] >= n || (i > 0 && split_points[i] <= split_points[i - 1]))
        throw sharding_error("meshlib::nn: pipeline: split_points " + list(split_points) +
                             " must be strictly increasing layer indices in [1, " + std::to_string(n - 1) +
                             "] (the first layer of each stage after the first, for a model of " + std::to_string(n) +
                             " layers); split point " + std::to_string(i) + " is " + std::to_string(split_points[i]));
    cuts = split_points;
  } else {
    // best[k][i]: the smallest largest-stage total of layers [0, i) in k stages; from[k][i] its last cut.
    constexpr std::size_t inf = std::numeric_limits<std::size_t>::max();
    std::vector<std::size_t> prefix(n + 1, 0);
    for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + layer_params[i];
    std::vector<std::vector<std::size_t>> best(stages + 1, std::vector<std::size_t>(n + 1, inf)), from = best;
    best[0][0] = 0;
    for (std::size_t k = 1; k <= stages; ++k)
      for (std::size_t i = k; i <= n; ++i)
        for (std::size_t j = k - 1; j < i; ++j) {
          if (best[k - 1][j] == inf) continue;
          const std::size_t v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
          if (v < best[k][i]) {
            best[k][i] = v;
            from[k][i] = j;
          }
        }
    cuts.resize(stages - 1);
    for (std::size_t k = stages, i = n; k > 1; --k) i = cuts[k - 2] = from[k][i];
  }
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t s = 0; s < stages; ++s) out.push_back({s == 0 ? 0 : cuts[s - 1], s + 1 == stages ? n : cuts[s]});
  return out;
}

namespace detail {

/// The layout of a parameter that only the devices of its stage hold: `inner`'s blocks there,
/// none elsewhere (`count` 0, and `zeros_like` makes blocks only there: optimizer state and master
/// weights follow).
class stage_param_layout final : public param_layout {
 public:
  stage_param_layout(std::shared_ptr<const param_layout> inner, std::vector<bool> holds)
      : inner_(std::move(inner)), holds_(std::move(holds)) {}
  std::span<const std::size_t> offset(std::size_t dev) const override { return inner_->offset(dev); }
  std::span<const std::size_t> extent(std::size_t dev) const override { return inner_->extent(dev); }
  std::size_t count(std::size_t dev) const override { return holds_.at(dev) ? inner_->count(dev) : 0; }
  std::size_t global_index(std::size_t dev, std::size_t i) const override { return inner_->global_index(dev, i); }
  void for_each_global_run(std::size_t dev, std::size_t first, std::size_t len,
                           const std::function<void(std::size_t, std::size_t, std::size_t)>& f) const override {
    inner_->for_each_global_run(dev, first, len, f);
  }
  held_tensor<float> zeros_like(std::span<const std::size_t> devices) const override {
    std::vector<std::size_t> mine;
    for (std::size_t dev : devices)
      if (holds_.at(dev)) mine.push_back(dev);
    return inner_->zeros_like(mine);
  }
  /// Elements of device `dev`'s block whether or not it holds it (a mirror's block).
  [[nodiscard]] std::size_t full_count(std::size_t dev) const { return inner_->count(dev); }

 private:
  std::shared_ptr<const param_layout> inner_;
  std::vector<bool> holds_;
};

/// A layer's parameters that it reads but another layer lists (`tied_head`'s table): what a layer
/// appends in `collect_tied`, if it has one.
template <class L, class T>
void collect_tied_of(L& l, std::vector<param_ref<T>>& out) {
  if constexpr (requires { l.collect_tied(out); }) l.collect_tied(out);
}

/// What a `train_state` keeps for a pipeline axis: the stages, which parameters each device holds,
/// the mirrors, and each device's buffers (see the file comment). Made on the calling thread; each
/// device thread touches only its own entries.
struct pipeline_engine {
  /// A parameter a later stage reads: owned by stage `owner`, mirrored on stage `mirror`.
  struct mirror_t {
    std::size_t param, owner, mirror;
  };
  std::size_t stages = 1;
  std::size_t microbatches = 0;                              ///< the policy's micro-batches per step (0: one per stage)
  pipeline_kind schedule = pipeline_kind::one_f_one_b;       ///< the policy's order of forwards and backwards
  std::vector<std::pair<std::size_t, std::size_t>> bounds;  ///< per stage, its layers [begin, end)
  std::vector<std::size_t> stage_of_param;                  ///< per parameter, its stage
  std::vector<std::size_t> full_count;                      ///< per parameter and device (param * devices + dev)
  std::vector<mirror_t> mirrors;
  std::size_t devices = 0;
  // Per device: the boundary activations' extents of the last probe (per layer index, as a flat
  // list of `rank` extents per boundary: [I * 8, I * 8 + rank)), the rows they were probed with,
  // and the buffers.
  std::vector<std::vector<std::size_t>> extents;
  std::vector<std::size_t> probed_rows;
  device_buffers<float> inputs, dys, dlogits, send, scratch, stash;
  /// The blocks of the parameters a device's stage holds (moved out of the layers' own storage,
  /// which goes), and one zero block that the other stages' parameters point to on that device.
  std::vector<meshlib::block_view<float, 1, default_memory_space>> owned;
  std::vector<double> busy;  ///< per device: seconds of the last step's rounds spent computing
  std::vector<double> span;  ///< per device: seconds of the last step's rounds, first to last
  std::vector<pipeline_stage_times> times;  ///< per device: the last step's compute, by kind

  /// `full_count` of parameter `i` on `dev`.
  [[nodiscard]] std::size_t block_elements(std::size_t i, std::size_t dev) const { return full_count[i * devices + dev]; }
};

/// The policy `opts` at work: cuts `model` into its stages on `mesh`'s pipeline axis (`PipeMask`)
/// and restricts every parameter in `params` to its stage's devices.
/// (`Policy` is `pipeline<A>`, a type rather than a deduced `fixed_string A`: nvcc 13's front end
/// deduces no class-type template argument from a specialisation.)
template <axis_mask PipeMask, class Mesh, class Model, class T, class Policy>
  requires(Policy::kind == parallelism::pipelined)
std::shared_ptr<pipeline_engine> make_pipeline_engine(const Mesh& mesh, Model& model, std::vector<param_ref<T>>& params,
                                                      const Policy& opts) {
  auto e = std::make_shared<pipeline_engine>();
  e->stages = mesh.axes_size(PipeMask);
  e->microbatches = opts.microbatches;
  e->schedule = opts.schedule;
  e->devices = mesh.size();
  const std::vector<std::size_t> counts = model.template params_per_layer<T>();
  std::vector<std::size_t> elements(counts.size(), 0);
  std::vector<std::size_t> layer_of;  // per parameter
  for (std::size_t l = 0, i = 0; l < counts.size(); ++l)
    for (std::size_t k = 0; k < counts[l]; ++k, ++i) {
      std::size_t n = 1;
      for (auto d : params.at(i).shape) n *= d;
      elements[l] += n;
      layer_of.push_back(l);
    }
  e->bounds = pipeline_stages(elements, e->stages, opts.split_points);
  const auto stage_of_layer = [&](std::size_t l) {
    std::size_t s = 0;
    while (l >= e->bounds[s].second) ++s;
    return s;
  };
  for (std::size_t i = 0; i < params.size(); ++i) e->stage_of_param.push_back(stage_of_layer(layer_of[i]));
  // Tied parameters: a layer that reads another stage's parameter mirrors it.
  std::size_t l = 0;
  std::apply(
      [&](auto&... layer) {
        (
            [&] {
              std::vector<param_ref<T>> tied;
              collect_tied_of(layer, tied);
              for (const auto& t : tied)
                for (std::size_t i = 0; i < params.size(); ++i)
                  if (params[i].name == t.name && e->stage_of_param[i] != stage_of_layer(l))
                    e->mirrors.push_back({i, e->stage_of_param[i], stage_of_layer(l)});
              ++l;
            }(),
            ...);
      },
      model.layers);
  e->full_count.resize(params.size() * e->devices);
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    std::vector<bool> holds(e->devices);
    for (std::size_t dev = 0; dev < e->devices; ++dev) {
      holds[dev] = mesh.group_rank(dev, PipeMask) == e->stage_of_param[i];
      e->full_count[i * e->devices + dev] = p.count[dev];
    }
    p.layout = std::make_shared<stage_param_layout>(p.layout, std::move(holds));
    p.count = {p.layout};
    p.offset = {p.layout, false};
    p.extent = {p.layout, true};
    p.sharded_axes |= PipeMask;  // a block lives on one stage: clipping and checkpoints count it once
  }
  e->extents.resize(e->devices);
  e->probed_rows.assign(e->devices, 0);
  e->busy.assign(e->devices, 0.0);
  e->span.assign(e->devices, 0.0);
  e->times.assign(e->devices, {});
  e->inputs = device_buffers<float>(e->devices);
  e->dys = device_buffers<float>(e->devices);
  e->dlogits = device_buffers<float>(e->devices);
  e->send = device_buffers<float>(e->devices);
  e->scratch = device_buffers<float>(e->devices);
  e->stash = device_buffers<float>(e->devices);
  return e;
}

}  // namespace detail
}  // namespace meshlib::nn

namespace meshlib::nn {

/// @brief The bubble of `state`'s last pipelined `train_step`, measured: the fraction of the
/// devices' time in the step's rounds (from the first round's start to the last round's end,
/// the longest device's) that they spent not computing (waiting for a neighbour, exchanging,
/// idle in a round). 0 without a pipeline. Compare with `pipeline_plan::bubble_fraction` and
/// (p - 1) / (m + p - 1) (docs/benchmarks.md has a table; devices must have a core each for the
/// times to mean anything).
template <class State>
double measured_bubble(const State& state) {
  const auto* e = state.pipeline();
  if (e == nullptr) return 0.0;
  double busy = 0, span = 0;
  for (std::size_t dev : state.local_devices()) {
    busy += e->busy[dev];
    span = std::max(span, e->span[dev]);
  }
  return span <= 0 ? 0.0 : 1.0 - busy / (span * static_cast<double>(state.local_devices().size()));
}

/// @brief Device `dev`'s compute in `state`'s last pipelined `train_step`, by kind (see
/// `pipeline_stage_times`); all zero without a pipeline. `pipeline_plan::bubble_with_costs` of the
/// per-stage means is the bubble the schedule costs on that model; `measured_bubble` minus it is
/// what the exchanges and the machine add.
template <class State>
pipeline_stage_times stage_times(const State& state, std::size_t dev) {
  const auto* e = state.pipeline();
  return e == nullptr ? pipeline_stage_times{} : e->times.at(dev);
}

}  // namespace meshlib::nn

namespace meshlib::nn::detail {

/// Releases the layers' storage of the parameters a device's stage does not hold: on every local
/// device, each parameter's value and gradient move to blocks of `e.owned` where its stage holds
/// it, and point to one shared zero block elsewhere (only the probe's forward, which looks at
/// shapes, reads them there; nothing writes them). `params[i].value[dev]` becomes nullptr where the
/// stage does not hold it. Mirrored parameters keep their storage: the mirror reads it, through the
/// tied layer's own handle. Not under FSDP, whose buffers already hold every layer's gathered blocks.
template <class T>
void release_other_stages(pipeline_engine& e, std::vector<param_ref<T>>& params, std::span<const std::size_t> local) {
  std::vector<char> keep(params.size(), 0);
  for (const auto& t : e.mirrors) keep[t.param] = 1;
  std::size_t most = 1;
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::size_t dev : local) most = std::max(most, e.block_elements(i, dev));
  e.owned.push_back(meshlib::allocate<float, 1, default_memory_space>({most}, "meshlib::nn::pipeline_released"));
  float* zero = e.owned.back().data();
  std::vector<float*> vs(e.devices, nullptr), gs(e.devices, nullptr);
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (keep[i] || !p.rebind) continue;
    for (std::size_t dev : local) {
      const std::size_t n = p.count[dev];
      if (n == 0) {
        vs[dev] = gs[dev] = zero;
        continue;
      }
      e.owned.push_back(meshlib::allocate<float, 1, default_memory_space>({2 * n}, "meshlib::nn::pipeline_stage"));
      vs[dev] = e.owned.back().data();
      gs[dev] = vs[dev] + n;
      convert_copy<default_memory_space>(vs[dev], p.value[dev], n);
    }
    Kokkos::fence();  // the copies are done before the layer's own storage goes
    p.rebind(vs, gs);
    for (std::size_t dev : local) {
      const std::size_t n = p.count[dev];
      p.value.set(dev, n == 0 ? nullptr : vs[dev], n);
      p.grad.set(dev, n == 0 ? nullptr : gs[dev], n);
    }
  }
}

/// The policy `p` at work in a `train_state` under construction (its `params` collected, nothing
/// sized yet): cuts the model (`make_pipeline_engine`), refusing a tied parameter under FSDP
/// (`sharded`: a `fully_shard` policy is given too). (The policy compiles only for a `sequential`
/// model: `check_policies`.)
/// @throws sharding_error naming the parameter and the fix.
template <axis_mask PipeMask, class State, class Policy>
  requires(Policy::kind == parallelism::pipelined)
std::shared_ptr<pipeline_engine> make_pipeline_state(State& s, const Policy& p, bool sharded) {
  if constexpr (!requires(typename State::model_type& net) {
                  net.layers;
                  net.template params_per_layer<float>();
                }) {
    return nullptr;  // not reached: check_policies refuses a pipeline of a model that is not a sequential
  } else {
    auto e = make_pipeline_engine<PipeMask>(s.mesh, s.model, s.params, p);
    if (!sharded) release_other_stages(*e, s.params, s.local_devices());
    if (sharded && !e->mirrors.empty())
      throw sharding_error("meshlib::nn: train_state: pipeline<\"" + std::string(text_of(Policy::axis)) + "\"> over " +
                           std::to_string(s.mesh.axes_size(PipeMask)) + " devices with fully_shard, and parameter '" +
                           s.params[e->mirrors.front().param].name + "' is read by a layer of stage " +
                           std::to_string(e->mirrors.front().mirror) +
                           " too (a tied head): FSDP does not shard a tied parameter; untie the head (a column_dense "
                           "head) or use the fsdp axis as a data axis (data_parallel<\"fsdp\"> instead of fully_shard)");
    return e;
  }
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/parallel/pipeline.hpp
// begin meshlib/nn/parallel/policy_set.hpp
/// @file
/// @brief `detail::policy_set`: the parallel policies a `train_state` runs (nn/train/train_state.hpp),
/// each parallelism at most once over the state's axes, and every check of them: at compile time
/// (`check_policies`, nn/parallel/policy.hpp), of their values when collected (`collect`: ZeRO-1
/// beside `fully_shard` or with overlap), and against the mesh when the state is made (`check_axes`:
/// an axis gets its role from a policy, never from its name; an overlap no layer hook would start).
/// Values, not types, so these last ones are run-time `sharding_error`s, each naming the policy
/// and the fix.

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>


namespace meshlib::nn::detail {

/// @brief The policies of a `train_state` over the data axis `Data`, the second batch axis `Fsdp`
/// (`fully_shard`'s, or `data_parallel`'s second) and the pipeline axis `Pipe` (see the file comment).
template <fixed_string Data, fixed_string Fsdp, fixed_string Pipe>
struct policy_set {
  data_parallel<Data> data;               ///< `data_parallel<Data>{}` when none was given
  bool data_over_fsdp = false;            ///< a `data_parallel<Data, Fsdp>` was given
  std::optional<fully_shard<Fsdp>> fsdp;  ///< empty without FSDP
  std::optional<nn::pipeline<Pipe>> pipe; ///< empty without a pipeline

  /// The policies `ps` of a state on a `Mesh` running a `Model`, after their compile-time checks
  /// and the checks of their values.
  /// @throws sharding_error for ZeRO-1 beside `fully_shard` or with overlap, and for a ZeRO stage
  /// other than 0 or 1 (data_parallel_impl).
  template <class Mesh, class Model, class... Ps>
  static policy_set collect(const Ps&... ps) {
    check_policies<Mesh, Model, Data, Fsdp, Pipe, Ps...>();
    policy_set set;
    (set.keep(ps), ...);
    (refuse_clashes<Ps...>(ps), ...);
    return set;
  }

  /// Checks the policies against `mesh`, whose axes `FsdpAxes` and `PipelineAxes` are the state's
  /// second batch axis and pipeline axis (0: none, or the pipeline axis is a data axis):
  /// @throws sharding_error for either axis of more than one device that no policy names (an axis
  /// is pipelined, fully sharded or split by the batch by a policy, never by its name: silently
  /// replicating the model or splitting the batch over it would both surprise), and for
  /// `.overlap = true` where no layer hook would start the buckets.
  template <class Model, axis_mask FsdpAxes, axis_mask PipelineAxes, class Mesh>
  void check_axes(const Mesh& mesh) const {
    if constexpr (PipelineAxes != 0) {
      const std::size_t n = mesh.axes_size(PipelineAxes);
      if (!pipe && n > 1) {
        const std::string name(text_of(Pipe));
        throw sharding_error("meshlib::nn: train_state: the mesh's '" + name + "' axis has " + std::to_string(n) +
                             " devices but no pipeline policy was given; an axis is pipelined only by a policy, "
                             "not by its name: pass meshlib::nn::pipeline<\"" + name +
                             "\">{} (with .microbatches and .schedule) to the train_state, or make the axis size 1");
      }
    }
    if constexpr (FsdpAxes != 0 && text_of(Fsdp) != text_of(Data)) {
      const std::size_t n = mesh.axes_size(FsdpAxes);
      if (!fsdp && !data_over_fsdp && n > 1) {
        const std::string name(text_of(Fsdp)), data_axis(text_of(Data));
        throw sharding_error("meshlib::nn: train_state: the mesh's '" + name + "' axis has " + std::to_string(n) +
                             " devices but no policy names it; an axis splits the batch or shards the parameters "
                             "only by a policy, not by its name: pass meshlib::nn::fully_shard<\"" + name +
                             "\">{} (parameters, gradients and optimizer state sharded over it, the batch split over "
                             "it) or meshlib::nn::data_parallel<\"" + data_axis + "\", \"" + name +
                             "\">{} (the batch only) to the train_state, or make the axis size 1");
      }
    }
    refuse_ignored_overlap<Model, PipelineAxes>(mesh);
  }

 private:
  // Each policy into its slot. (A policy over another axis than the state's has already fired
  // `check_policies`' one static_assert: it is not kept, so that no second error follows. One
  // function over the policy's type: nvcc 13's front end deduces no `fixed_string A` from
  // `data_parallel<A>`.)
  template <class P>
  void keep(const P& p) {
    if constexpr (std::is_same_v<P, data_parallel<Data>>) {
      data = p;
    } else if constexpr (std::is_same_v<P, data_parallel<Data, Fsdp>>) {
      data = data_parallel<Data>{.zero = p.zero, .overlap = p.overlap, .bucket_elements = p.bucket_elements};
      data_over_fsdp = true;
    } else if constexpr (std::is_same_v<P, fully_shard<Fsdp>>) {
      fsdp = p;
    } else if constexpr (std::is_same_v<P, nn::pipeline<Pipe>>) {
      pipe = p;
    }
  }

  // Throws when `p` asks for what another of the policies `Ps` already does (or undoes): ZeRO-1
  // beside `fully_shard` (which shards the optimizer state itself), overlap with ZeRO-1 (whose
  // reduce-scatter runs after the backward).
  template <class... Ps, class P>
  static void refuse_clashes(const P& p) {
    if constexpr (P::kind == parallelism::data) {
      const std::string dp = "data_parallel<\"" + std::string(P::axis.view()) +
                             (has_second_axis<P>() ? "\", \"" + std::string(second_axis_text<P>()) : std::string()) +
                             "\">";
      if constexpr (policy_count_v<parallelism::fully_sharded, Ps...> != 0)
        if (p.zero == 1)
          throw sharding_error("meshlib::nn: train_state: " + dp + "{.zero = 1} and fully_shard<\"" +
                               std::string(text_of(Fsdp)) + "\"> both shard the optimizer state; fully_shard "
                               "already shards it (over '" + std::string(text_of(Fsdp)) + "', the " + dp +
                               " axis holding replicas of the shards: HSDP): drop .zero");
      if (p.zero == 1 && p.overlap)
        throw sharding_error("meshlib::nn: train_state: " + dp + "{.zero = 1, .overlap = true}: ZeRO-1 reduce-scatters "
                             "the gradients after the backward, so there is nothing to overlap; drop .overlap (or .zero)");
    }
  }

  // data_parallel's overlap starts each gradient bucket from the layer hooks a `sequential` calls
  // during its backward (nn/parallel/grad_overlap.hpp). Where no hook would start them, a model that
  // is not a `sequential` or a pipelined step (which synchronises after the schedule's last
  // backward, nn/parallel/pipeline_run.hpp), `.overlap = true` would do nothing: refused, with the
  // fix, rather than ignored.
  template <class Model, axis_mask PipelineAxes, class Mesh>
  void refuse_ignored_overlap(const Mesh& mesh) const {
    if (!data.overlap) return;
    const std::string dp = "data_parallel<\"" + std::string(text_of(Data)) +
                           (data_over_fsdp ? "\", \"" + std::string(text_of(Fsdp)) : std::string()) +
                           "\">{.overlap = true}";
    if constexpr (!sequential_model<Model>) {
      throw sharding_error("meshlib::nn: train_state: " + dp + " on a model that is not an nn::sequential: the "
                           "overlap starts each gradient bucket from the hooks sequential calls after each layer's "
                           "backward, and this model has none; wrap the layers in nn::sequential or drop .overlap");
    } else if constexpr (PipelineAxes != 0) {
      const std::size_t n = mesh.axes_size(PipelineAxes);
      if (pipe && n > 1)
        throw sharding_error("meshlib::nn: train_state: " + dp + " with pipeline<\"" + std::string(text_of(Pipe)) +
                             "\"> over " + std::to_string(n) + " stages: a pipelined step synchronises the gradients "
                             "after its schedule's last backward, not from the layer hooks, so there is nothing to "
                             "overlap; drop .overlap (or the pipeline)");
    }
  }
};

}  // namespace meshlib::nn::detail
// end meshlib/nn/parallel/policy_set.hpp
// begin meshlib/nn/train/optimizer_step.hpp
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

// begin meshlib/nn/train/param_blocks.hpp
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
// end meshlib/nn/train/param_blocks.hpp
// begin meshlib/nn/train/step_metrics.hpp
/// @file
/// @brief `step_metrics`, what one `train_step` or `evaluate` reports (equal on every device), and
/// `detail::sum_over`, the host-value sums over mesh axes that make it equal: the step, the
/// evaluation, the pipelined schedule and the gradient clipping all sum through it.

#include <cstddef>


namespace meshlib::nn {

namespace detail {
/// Sums the `N` numbers `v` (the squared norm; `(loss, correct)`) over the axes `Axes` with the
/// public donated `psum`, in `v` itself (a host-memory value that differs over every axis); every
/// device of the group gets the totals. Runs on device `dev` inside `spmd`.
template <axis_mask Axes, mesh_type Mesh, std::size_t N>
void sum_over(const Mesh& mesh, std::size_t dev, double (&v)[N]) {
  if constexpr (Axes != 0) {
    if constexpr (meshlib::host_accessible_v<default_memory_space>) {
      using sums_t = local_tensor<double, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, Kokkos::HostSpace>;
      (void)psum_over<Axes>(wrap1<sums_t>(v, N, mesh, dev));
    } else {
      // A device communicator (NCCL, shared GPU) moves device memory only: the sums go through a
      // device block of the running device (reduced in place, then read back).
      using sums_t = local_tensor<double, 1, Mesh, Mesh::all_axes, 0, replicated_dims<1>, default_memory_space>;
      const sums_t d(typename sums_t::shape_type{N}, mesh, dev);
      meshlib::copy_from_host<default_memory_space>(d.data(), v, N);
      (void)psum_over<Axes>(wrap1<sums_t>(d.data(), N, mesh, dev));  // donated: in place
      meshlib::copy_to_host<default_memory_space>(v, d.data(), N);
    }
  }
}
}  // namespace detail

/// @brief What one `train_step` (or `evaluate`) reports; equal on every device.
struct step_metrics {
  double loss = 0;             ///< mean loss over the global batch
  std::size_t correct = 0;     ///< rows whose prediction was right
  std::size_t rows = 0;        ///< rows of the global batch
  double grad_norm = 0;        ///< global gradient norm before clipping (train_step)
  /// Time the first local device's thread spent in the gradient synchronisation: blocked in its
  /// collectives, or (overlapped) starting them during backward and waiting for them after it: the
  /// synchronisation the step exposes.
  double sync_seconds = 0;
  bool skipped = false;        ///< dynamic loss scaling: the gradients were not finite, no update
  double loss_scale = 1;       ///< the loss scale this step used (1 without loss scaling)
  // ---- activation memory (nn/remat.hpp), of the first local device ----
  /// Bytes of the model's layer buffers (activations, outputs, cotangents, workspaces) live when the
  /// last micro-batch's forward returned: what is held between forward and backward.
  std::size_t activation_bytes = 0;
  /// The most bytes of the model's layer buffers live at any time during the step's forward and
  /// backward passes (what `remat` lowers).
  std::size_t peak_activation_bytes = 0;
};

}  // namespace meshlib::nn
// end meshlib/nn/train/step_metrics.hpp

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
// end meshlib/nn/train/optimizer_step.hpp

namespace meshlib::nn {

/// @brief How `train_step` runs, apart from the parallelism (which the policies given to the
/// `train_state` say: `data_parallel`, `fully_shard`, `pipeline`).
struct train_options {
  std::size_t accumulation = 1;            ///< micro-batches per step; one synchronisation per step
  /// Dynamic loss scaling: the initial scale (> 0 turns it on; 0: on with 32768 for float16
  /// compute, off otherwise). The loss is multiplied by the scale before backward and the summed
  /// gradients divided by it; a step whose gradients hold an inf or NaN on any device is skipped on
  /// every device and halves the scale; `scale_growth_interval` good steps in a row double it.
  float loss_scale = 0.0f;
  std::size_t scale_growth_interval = 2000;  ///< good steps before the scale doubles
};

/// @brief Parameters (inside `model`), optimizer state, step and key (see the file comment).
/// Made with parallel policies (`data_parallel`, `fully_shard`, `pipeline`), the axes are theirs:
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"dp">{.zero = 1},
///                                meshlib::nn::pipeline<"pipe">{.microbatches = 8});
/// @endcode
/// @tparam Data the data-parallel axis; @tparam Fsdp the second batch axis: the fully-sharded
/// axis, or `data_parallel`'s second (`data_parallel<Data, Fsdp>`); a policy must name it when
/// it has more than one device; @tparam Pipe the pipeline axis (each used when the mesh has it); @tparam Wire the gradient reduction's element type;
/// @tparam Compute the type parameters, activations and gradients are rounded to (float, bfloat16,
/// float16): with a 16-bit type the optimizer keeps and updates float master weights and then
/// rounds them into the parameters (see nn/precision.hpp and docs/training.md).
template <mesh_type Mesh, class Model, fixed_string Data = "data", comm_element Wire = float,
          compute_precision Compute = float, fixed_string Fsdp = "fsdp", fixed_string Pipe = "pipeline">
class train_state {
  // The checker fires its one static_assert (naming both types) when they clash.
  static_assert(meshlib::diagnostic::diagnosed(detail::check_reduction_type<Wire, Compute>()));

  /// The policies a state runs and their checks (nn/parallel/policy_set.hpp).
  using policy_set = detail::policy_set<Data, Fsdp, Pipe>;

 public:
  /// The element type of parameters and optimizer state.
  using T = float;
  /// The type parameters, activations and gradients are rounded to.
  using compute_type = Compute;
  /// True when `Compute` is a 16-bit type and float master weights are kept.
  static constexpr bool mixed = !std::is_same_v<Compute, float>;
  /// The mesh the model runs on.
  using mesh_type = Mesh;
  /// The network's type.
  using model_type = Model;
  /// The mesh's second batch axis `Fsdp` (0 when it has none): FSDP shards parameters over it
  /// (`fully_shard<Fsdp>`), or `data_parallel<Data, Fsdp>` names it; either way it splits the batch
  /// as a data axis does.
  static constexpr axis_mask fsdp_axes = [] {
    if constexpr (Mesh::template has_axis<Fsdp>) return Mesh::template mask_of<Fsdp>();
    else return axis_mask{0};
  }();
  /// The mesh axes the batch is split over and gradients are averaged over: `Data` and `Fsdp` (a
  /// mesh with an fsdp axis need not have `Data`).
  static constexpr axis_mask data_axes = [] {
    if constexpr (fsdp_axes != 0 && !Mesh::template has_axis<Data>) return fsdp_axes;
    else return Mesh::template mask_of<Data>() | fsdp_axes;
  }();
  /// The data axes other than the fsdp axis: under FSDP, the shards' gradients are all-reduced over these.
  static constexpr axis_mask replica_axes = data_axes & ~fsdp_axes;
  /// The name of the pipeline axis (`Pipe`).
  static constexpr auto pipeline_axis = Pipe;
  /// The mesh's pipeline axis `Pipe` (0 when it has none, or when it is the data or fsdp axis, as
  /// with `data_parallel<"pipeline">`): stages of the model under a `pipeline` policy
  /// (nn/parallel/pipeline.hpp).
  static constexpr axis_mask pipeline_axes = [] {
    if constexpr (Mesh::template has_axis<Pipe>)
      return (Mesh::template mask_of<Pipe>() & data_axes) != 0 ? axis_mask{0} : Mesh::template mask_of<Pipe>();
    else return axis_mask{0};
  }();
  /// The type of a device's block of the input batch: rows sharded over the data axes.
  using input_type = local_tensor<T, 2, Mesh, data_axes, 0, dim_masks<data_axes, axis_mask{0}>, default_memory_space>;
  /// The type of a device's block of token ids (a language model's input: one `std::int32_t` per
  /// row, the rows `batch * sequence` tokens, sequence-major), rows sharded over the data axes.
  using ids_type = local_tensor<std::int32_t, 1, Mesh, data_axes, 0, dim_masks<data_axes>, default_memory_space>;
  /// The optimizer state's layout (nn/train/optimizer_state.hpp).
  using optimizer_state_type = nn::optimizer_state<Mesh, data_axes>;
  /// A device's ZeRO-1 optimizer state (see `optimizer_state::zero_state_type`).
  using zero_state_type = typename optimizer_state_type::zero_state_type;
  /// The axes parameters may be sharded over by their layers (tensor parallelism): every axis but
  /// the data, fsdp and pipeline axes.
  static constexpr axis_mask model_axes = Mesh::all_axes & ~data_axes & ~fsdp_axes & ~pipeline_axes;
  /// What an optimizer that reads whole parameters learns of a device's piece of one
  /// (nn/train/param_blocks.hpp): a block over the model axes and the fsdp axis, a run of it cut
  /// over the data axes (ZeRO-1).
  using blocks_type = detail::mesh_param_blocks<Mesh, model_axes | fsdp_axes, data_axes>;

  /// The mesh the model runs on.
  Mesh mesh;
  /// The network; its parameters live inside it.
  Model model;
  /// The update rule and hyperparameters.
  optimizer opt;
  /// Accumulation and loss scaling (the parallelism is the policies').
  train_options options;
  /// Optimizer steps taken so far.
  std::size_t step = 0;
  /// The key each step's randomness (dropout) is folded from.
  rng_key key;
  /// Views of every parameter of `model`, in layer order.
  std::vector<param_ref<T>> params;

  /// @brief Collects the parameters of `net` and sizes the optimizer state of each local device;
  /// plain data parallelism over the data axes (`data_parallel<Data>{}`), nothing else.
  /// `local_devices`: this process's devices (empty: all).
  /// @throws sharding_error when `opts.accumulation` is 0, for an optimizer that reads whole
  /// parameters (`adafactor`) with a parameter its layer shards over a data or pipeline axis, and
  /// for a mesh whose pipeline axis `Pipe` or second batch axis `Fsdp` has more than one device (an
  /// axis is pipelined, fully sharded or split by the batch by a policy, not by its name).
  train_state(const Mesh& m, Model net, optimizer o, train_options opts = {}, rng_key k = {},
              std::span<const std::size_t> local_devices = {})
      : train_state(m, std::move(net), o, opts, k, local_devices, policy_set{}) {}

  /// @brief As the constructor above, with the parallelism given as policies (`data_parallel`,
  /// `fully_shard`, `pipeline`) over the state's axes; the state keeps them (`data_parallel_policy`,
  /// `fully_shard_policy`, `pipeline_policy`) and builds each one's engine. A policy given twice,
  /// two policies over one axis, an axis the mesh lacks or that is not the state's, and
  /// `fully_shard` or `pipeline` of a model that is not a `sequential` do not compile.
  /// @throws sharding_error as the constructor above (a pipeline policy over the pipeline axis
  /// lifts the refusal there), when `data_parallel::zero` is not 0 or 1, for ZeRO-1 beside
  /// `fully_shard` or with overlap, for overlap where no layer hook would start the buckets (a model
  /// that is not a `sequential`, a pipeline over more than one device).
  template <parallel_policy P, parallel_policy... Ps>
  train_state(const Mesh& m, Model net, optimizer o, train_options opts, rng_key k,
              std::span<const std::size_t> local_devices, const P& p, const Ps&... ps)
      : train_state(m, std::move(net), o, opts, k, local_devices,
                    policy_set::template collect<Mesh, Model>(p, ps...)) {}
  /// @brief As the constructor above, with a default key, on every device.
  template <parallel_policy P, parallel_policy... Ps>
  train_state(const Mesh& m, Model net, optimizer o, train_options opts, const P& p, const Ps&... ps)
      : train_state(m, std::move(net), o, opts, rng_key{}, {}, p, ps...) {}
  /// @brief As the constructor above, from the default `train_options`.
  template <parallel_policy P, parallel_policy... Ps>
  train_state(const Mesh& m, Model net, optimizer o, const P& p, const Ps&... ps)
      : train_state(m, std::move(net), o, train_options{}, p, ps...) {}

  /// The data-parallel policy the state runs (`data_parallel<Data>{}` when none was given).
  [[nodiscard]] const data_parallel<Data>& data_parallel_policy() const noexcept { return policies_.data; }
  /// The `fully_shard` policy the state runs (empty without FSDP).
  [[nodiscard]] const std::optional<fully_shard<Fsdp>>& fully_shard_policy() const noexcept { return policies_.fsdp; }
  /// The `pipeline` policy given (empty without one; with one over an axis of one device, the
  /// step runs unpipelined: `pipeline()` is null).
  [[nodiscard]] const std::optional<nn::pipeline<Pipe>>& pipeline_policy() const noexcept { return policies_.pipe; }

  /// Parameter `i`'s float master block on device `dev`: the optimizer updates it; with a 16-bit
  /// `Compute` the parameter's value is its rounding (with float, the value itself).
  [[nodiscard]] float* master(std::size_t i, std::size_t dev) {
    if constexpr (mixed) return masters_.at(i).blocks[dev];
    else return params.at(i).value[dev];
  }
  /// Parameter `i`'s float master block on device `dev` (read-only).
  [[nodiscard]] const float* master(std::size_t i, std::size_t dev) const {
    if constexpr (mixed) return masters_.at(i).blocks[dev];
    else return params.at(i).value[dev];
  }
  /// Rounds the master weights into the parameters' values (after the masters were written, e.g.
  /// by restore_checkpoint). A no-op when computing in float.
  void refresh_compute_copies() {
    if constexpr (mixed)
      for (std::size_t dev : local_)
        for (std::size_t i = 0; i < params.size(); ++i)
          detail::round_copy<Compute>(params[i].value[dev], master(i, dev), params[i].count[dev]);
  }
  /// The current loss scale (1 without loss scaling).
  [[nodiscard]] float loss_scale() const noexcept { return scaler_.scale(); }
  /// Whether dynamic loss scaling is on.
  [[nodiscard]] bool loss_scaling() const noexcept { return scaler_.enabled(); }
  /// Consecutive good steps since the scale last changed.
  [[nodiscard]] std::size_t good_steps() const noexcept { return scaler_.good_steps(); }

  /// Device `dev`'s `n` input values at `x` as the model's kernels read them: `x` itself where they
  /// can (host memory on a host backend; device memory of the device's GPU, as from `device_put`),
  /// else staged into the device's buffer (host rows on a GPU); with a 16-bit `Compute`, a copy
  /// rounded to it (the caller's data is never modified).
  [[nodiscard]] float* input_block(std::size_t dev, const float* x, std::size_t n) {
    const float* src = input_.staged(dev, x, n);
    if constexpr (!mixed) {
      return const_cast<float*>(src);
    } else {
      float* b = input_.get(dev, n);
      if (src != b) detail::convert_copy<default_memory_space>(b, src, n);
      detail::round_to<Compute>(b, n);
      return b;
    }
  }
  /// Device `dev`'s `n` token ids at `x` as the model's kernels read them (see `input_block`).
  [[nodiscard]] std::int32_t* ids_block(std::size_t dev, const std::int32_t* x, std::size_t n) {
    return const_cast<std::int32_t*>(ids_.staged(dev, x, n));
  }
  /// Device `dev`'s buffer of `n` elements for the loss's gradient with respect to the model
  /// output (the `grad` argument of a `loss_function`); valid until the next step.
  [[nodiscard]] float* output_grad_block(std::size_t dev, std::size_t n) { return output_grad_.get(dev, n); }

  /// Called by train_step after the spmd region with every device's verdict (equal on all of
  /// them): advances the step, or, on a skipped step, halves the loss scale.
  void finish_step(bool skipped) {
    if (scaler_.update(skipped, options.scale_growth_interval)) ++step;
  }

  /// This process's devices.
  [[nodiscard]] const std::vector<std::size_t>& local_devices() const noexcept { return local_; }
  /// Elements of optimizer state held by device `dev` (the ZeRO saving shows here); 0 for a
  /// device of another process.
  [[nodiscard]] std::size_t optimizer_state_size(std::size_t dev) const {
    if (std::find(local_.begin(), local_.end(), dev) == local_.end()) return 0;
    return data_parallel_.state().size(params, dev);
  }
  /// @brief The bytes device `dev` holds for parameters, gradients and optimizer state (and, under
  /// FSDP, the buffers layers' parameters are gathered into); zero for a device of another process.
  [[nodiscard]] training_memory memory(std::size_t dev) const {
    training_memory m;
    if (std::find(local_.begin(), local_.end(), dev) == local_.end()) return m;
    const std::size_t n = grad_sync<T, Wire>::flat_size(params, dev);
    m.parameters = n * sizeof(T) * (mixed ? 2 : 1);
    m.gradients = n * sizeof(T);
    m.optimizer_state = optimizer_state_size(dev) * sizeof(float);
    if (fsdp_) m.unsharded = fsdp_->unsharded_elements(dev) * sizeof(T);
    return m;
  }
  /// A host copy of device `dev`'s optimizer state, slot after slot, each slot the device's flat
  /// vector (its parameters' blocks in order; under ZeRO-1, its slice of that vector), then each
  /// parameter's per-parameter state (`param_state`): for tests and logs. Empty for a device of
  /// another process. Checkpoints use `for_each_state_run` and `param_state`.
  [[nodiscard]] std::vector<float> optimizer_state(std::size_t dev) {
    std::vector<float> out;
    out.reserve(optimizer_state_size(dev));
    for (std::size_t s = 0; s < opt.slots() && out.capacity() > 0; ++s)
      for_each_state_run(dev, [&](std::size_t, std::size_t, std::size_t len, std::span<float* const> slot) {
        out.insert(out.end(), slot[s], slot[s] + len);
      });
    std::vector<float> stage;
    for (std::size_t i = 0; i < params.size() && out.capacity() > 0; ++i)
      if (const float* v = param_state(i, dev)) {
        const std::size_t n = data_parallel_.state().param_state_size(i);
        const float* h = meshlib::host_readable<default_memory_space>(v, n, stage);
        out.insert(out.end(), h, h + n);
      }
    return out;
  }
  /// Floats of parameter `i`'s per-parameter optimizer state (the optimizer's `param_state_size`; 0: none).
  [[nodiscard]] std::size_t param_state_size(std::size_t i) const { return data_parallel_.state().param_state_size(i); }
  /// Parameter `i`'s per-parameter optimizer state on device `dev` (the optimizer's
  /// `param_state_size` floats, in the device's memory; alike on every device holding a block of
  /// the parameter), or null: none, or the device holds no block of it.
  [[nodiscard]] float* param_state(std::size_t i, std::size_t dev) const {
    return data_parallel_.state().param_state(i, dev);
  }
  /// Device `dev`'s ZeRO-1 optimizer state (`zero` on; see `zero_state_type`).
  [[nodiscard]] const zero_state_type& zero_state(std::size_t dev) const {
    return data_parallel_.state().zero_state(dev);
  }
  /// Device `dev`'s count of the model's layer buffers (`step_metrics::peak_activation_bytes`);
  /// `train_step` and `evaluate` make it the device thread's meter while the model runs.
  [[nodiscard]] detail::buffer_meter* activation_meter(std::size_t dev) const { return &meters_->at(dev); }
  /// The gradient synchronisation (its buckets and traffic).
  [[nodiscard]] const grad_sync<T, Wire>& sync() const noexcept { return data_parallel_.buckets(); }
  /// The loss function the training steps use.
  [[nodiscard]] softmax_cross_entropy<T>& loss() noexcept { return loss_; }
  /// The pipeline's stages and buffers (null without a `pipeline` policy over an axis of more than one device).
  [[nodiscard]] detail::pipeline_engine* pipeline() const noexcept { return pipeline_.get(); }
  /// The layers `[begin, end)` of each pipeline stage (empty without a pipeline).
  [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> pipeline_stages() const {
    return pipeline_ ? pipeline_->bounds : std::vector<std::pair<std::size_t, std::size_t>>{};
  }

  /// Calls `f(param_index, offset_in_block, len, slot)` for each run of optimizer state device
  /// `dev` holds, in parameter order: elements `[offset, offset + len)` of the parameter's local
  /// block, whose slot `s` starts at `slot[s]` (a `std::span<float* const>` of `opt.slots()`
  /// pointers). Replicated: whole blocks; ZeRO-1: the pieces of this device's slice of the flat vector.
  template <class F>
  void for_each_state_run(std::size_t dev, F&& f) {
    data_parallel_.state().for_each_run(mesh, params, dev, std::forward<F>(f));
  }
  /// Whether device `dev` is the one that writes parameter `p`'s optimizer state to a checkpoint
  /// (one device of each group holding the same state).
  [[nodiscard]] bool owns_state(std::size_t dev, const param_ref<T>& p) const {
    return data_parallel_.state().owns(mesh, dev, p);
  }

  /// One device's share of a step after its backward passes: synchronise, clip, update (the
  /// data-parallel policy's gradient path, `detail::data_parallel_impl`). Returns the global
  /// gradient norm; `sync_seconds` the time spent synchronising.
  double apply_gradients(std::size_t dev, double& sync_seconds) {
    return data_parallel_.apply_gradients(*this, dev, sync_seconds);
  }

  /// Overlapped gradient sync: before the last micro-batch's backward on `dev`, arms the hooks that
  /// start the buckets (no-op without overlap).
  void begin_grad_overlap(std::size_t dev) {
    data_parallel_.arm(params, dev);
  }
  /// Overlapped gradient sync: at the start of the step on `dev`, makes the buckets' communicator
  /// (nn/parallel/grad_overlap.hpp, `prepare`; no-op without overlap).
  void prepare_grad_overlap(std::size_t dev) {
    data_parallel_.prepare(dev);
  }
  /// The parameters `[0, n)` whose gradients train_step still zeroes and rounds after the backward
  /// (the hooks did the others' before starting their buckets).
  [[nodiscard]] std::size_t grad_overlap_unstarted(std::size_t dev) const {
    return data_parallel_.unstarted(dev, params.size());
  }

 private:
  // The data-parallel policy's gradient path reads the global norm, the optimizer step and the masters.
  template <class, class, class, axis_mask, axis_mask>
  friend class detail::data_parallel_impl;

  // Every public constructor ends here: the policies checked and collected into `ps`, each one's
  // engine built from it.
  train_state(const Mesh& m, Model net, optimizer o, train_options opts, rng_key k,
              std::span<const std::size_t> local_devices, policy_set ps)
      : mesh(m),
        model(std::move(net)),
        opt(o),
        options(opts),
        key(k),
        policies_(std::move(ps)),
        data_parallel_(m.size(), policies_.data),
        loss_(m.size()),
        input_(m.size()),
        ids_(m.size()),
        output_grad_(m.size()),
        optimizer_step_(m.size()) {
    model.collect(params);
    scaler_ = loss_scaler(options.loss_scale, needs_loss_scaling<Compute>);
    if constexpr (mixed)
      if constexpr (requires { model.round_activations = &detail::round_to<Compute>; })
        model.round_activations = &detail::round_to<Compute>;
    if (options.accumulation == 0) throw sharding_error("meshlib::nn: train_options: accumulation must be at least 1");
    policies_.template check_axes<Model, fsdp_axes, pipeline_axes>(mesh);
    std::vector<std::size_t> all;
    if (local_devices.empty())
      for (std::size_t d = 0; d < m.size(); ++d) all.push_back(d);
    else
      all.assign(local_devices.begin(), local_devices.end());
    local_ = all;
    if (opt.whole_parameters()) refuse_parameter_shards();
    // fully_shard (nn/parallel/fsdp.hpp): `params` become the shards, its engine the model's hooks.
    // (The policy compiles only over a mesh axis, for a sequential model: `check_policies`.)
    if constexpr (fsdp_axes != 0 && detail::sequential_model<Model>)
      if (policies_.fsdp) fsdp_ = detail::fully_shard_model<fsdp_axes>(mesh, model, params, local_, *policies_.fsdp);
    data_parallel_.compose(fsdp_);
    // pipeline (nn/parallel/pipeline.hpp): each parameter (under FSDP, each shard) restricted to its
    // stage's devices, before the optimizer state is sized from the parameters' blocks. Over an
    // axis of one device there are no stages to cut: the step runs unpipelined.
    if constexpr (pipeline_axes != 0)
      if (policies_.pipe && m.axes_size(pipeline_axes) > 1)
        pipeline_ = detail::make_pipeline_state<pipeline_axes>(*this, *policies_.pipe, policies_.fsdp.has_value());
    // The overlapped gradient sync's hooks; a pipelined step synchronises each stage's gradients
    // after its rounds (nn/parallel/pipeline_run.hpp), not from the layer hooks.
    if (pipeline_ == nullptr) {
      void (*round)(float*, std::size_t) noexcept = nullptr;
      if constexpr (mixed) round = &detail::round_to<Compute>;
      data_parallel_.install_hooks(mesh, model, round);
    }
    // Every tensor is made here, on the calling thread: device threads only read and write blocks
    // through unmanaged views (tensor/view.hpp: no reference count is touched off this thread).
    std::vector<std::size_t> per_param;
    for (const auto& p : params) per_param.push_back(opt.param_state_size(param_info{p.name, p.shape, p.decay}));
    data_parallel_.size_state(mesh, params, opt.slots(), local_, per_param);
    if constexpr (mixed)
      for (const auto& p : params) {
        masters_.push_back(p.layout->zeros_like(local_));
        for (std::size_t dev : local_)
          detail::convert_copy<default_memory_space>(masters_.back().blocks[dev], p.value[dev], p.count[dev]);
      }
    refresh_compute_copies();
  }

  // An optimizer that reads whole parameters (`adafactor`) on a parameter its layer splits over an
  // axis that is not a model axis: refused here, before any step, with the fix. Tensor-parallel
  // blocks, FSDP's shards and ZeRO-1's runs are fine: the transforms sum their statistics over a
  // parameter's pieces (nn/train/param_blocks.hpp); a layer's block over a data axis, whose devices
  // also split the batch, is not one of those.
  void refuse_parameter_shards() const {
    const auto bad = [&](const std::string& why, const std::string& fix) {
      return sharding_error("meshlib::nn: train_state: the optimizer " + opt.name() +
                            " reads whole parameters (its statistics are per parameter, summed over the pieces of "
                            "a tensor-parallel, FSDP or ZeRO-1 parameter), but " + why + "; " + fix);
    };
    for (const auto& p : params)
      if ((p.sharded_axes & ~model_axes) != 0)
        throw bad("parameter '" + p.name + "' is sharded " + p.sharding + " over a data or pipeline axis",
                  "shard it over model (tensor-parallel) axes only, or replicate it");
  }
  void unscale(T* g, std::size_t n) const noexcept { scaler_.unscale(g, n); }
  void refresh_device(std::size_t dev) {
    if constexpr (mixed)
      for (std::size_t i = 0; i < params.size(); ++i)
        detail::round_copy<Compute>(params[i].value[dev], master(i, dev), params[i].count[dev]);
  }
  /// Runs the optimizer over device `dev`'s runs of updates and applies them
  /// (`detail::optimizer_step::run`, nn/train/optimizer_step.hpp).
  template <class ForRuns>
  void step_optimizer(std::size_t dev, double norm, axis_mask except, ForRuns&& for_runs) {
    optimizer_step_.run(
        mesh, opt, params, step, [&](std::size_t i) { return master(i, dev); },
        [&](std::size_t i) { return data_parallel_.state().param_state(i, dev); }, dev, norm, except,
        std::forward<ForRuns>(for_runs));
  }
  /// The policies given (the data-parallel one defaulted).
  policy_set policies_;
  /// The data-parallel policy at work: the gradient buckets and path, the optimizer state's layout
  /// (nn/train/optimizer_state.hpp: replicated or ZeRO-1) and the overlap's hooks.
  detail::data_parallel_impl<T, Wire, Mesh, data_axes, fsdp_axes> data_parallel_;
  softmax_cross_entropy<T> loss_;
  std::vector<std::size_t> local_;
  detail::device_buffers<T> input_;
  detail::device_buffers<std::int32_t> ids_;  // token ids staged for a device that cannot read the caller's
  detail::device_buffers<T> output_grad_;
  /// The global gradient norm and the optimizer's update, with their per-device buffers.
  detail::optimizer_step<Mesh, model_axes | fsdp_axes, data_axes> optimizer_step_;
  /// Per parameter (16-bit Compute only): its float master weights, a tensor with the
  /// parameter's shape and sharding.
  std::vector<detail::held_tensor<float>> masters_;
  /// FSDP's shards, buffers and layer hooks (null without FSDP); shared by copies of the state.
  std::shared_ptr<detail::fsdp_engine<Mesh, fsdp_axes>> fsdp_;
  /// Per device: the bytes of the model's layer buffers (shared by copies of the state, as the
  /// model's buffers are; the buffers point at it).
  std::shared_ptr<std::vector<detail::buffer_meter>> meters_ =
      std::make_shared<std::vector<detail::buffer_meter>>(mesh.size());
  /// The pipeline's stages and buffers (null without a `pipeline` policy over an axis of more than one device).
  std::shared_ptr<detail::pipeline_engine> pipeline_;
  /// Dynamic loss scaling (nn/train/loss_scaler.hpp).
  loss_scaler scaler_;
};

/// Made with parallel policies, a train state's axes are the policies' (the defaults for the
/// parallelisms not given; the second batch axis `fully_shard`'s, else `data_parallel`'s second),
/// its parameters and compute float.
template <mesh_type Mesh, class Model, parallel_policy P, parallel_policy... Ps>
train_state(const Mesh&, Model, optimizer, const P&, const Ps&...)
    -> train_state<Mesh, Model, detail::policy_axis<parallelism::data, "data", P, Ps...>::value, float, float,
                   detail::policy_axis<parallelism::fully_sharded, detail::second_data_axis<"fsdp", P, Ps...>::value,
                                       P, Ps...>::value,
                   detail::policy_axis<parallelism::pipelined, "pipeline", P, Ps...>::value>;
/// As above, with `train_options`, a key and this process's devices before the policies.
template <mesh_type Mesh, class Model, parallel_policy P, parallel_policy... Ps>
train_state(const Mesh&, Model, optimizer, train_options, rng_key, std::span<const std::size_t>, const P&, const Ps&...)
    -> train_state<Mesh, Model, detail::policy_axis<parallelism::data, "data", P, Ps...>::value, float, float,
                   detail::policy_axis<parallelism::fully_sharded, detail::second_data_axis<"fsdp", P, Ps...>::value,
                                       P, Ps...>::value,
                   detail::policy_axis<parallelism::pipelined, "pipeline", P, Ps...>::value>;
/// As above, with `train_options` before the policies.
template <mesh_type Mesh, class Model, parallel_policy P, parallel_policy... Ps>
train_state(const Mesh&, Model, optimizer, train_options, const P&, const Ps&...)
    -> train_state<Mesh, Model, detail::policy_axis<parallelism::data, "data", P, Ps...>::value, float, float,
                   detail::policy_axis<parallelism::fully_sharded, detail::second_data_axis<"fsdp", P, Ps...>::value,
                                       P, Ps...>::value,
                   detail::policy_axis<parallelism::pipelined, "pipeline", P, Ps...>::value>;

}  // namespace meshlib::nn
// end meshlib/nn/train/train_state.hpp
// begin meshlib/nn/train/train_step.hpp
/// @file
/// @brief `train_step(state, batch)`, which a user calls in a loop as optax users do: forward and
/// backward over `accumulation` micro-batches, one bucketed data-parallel synchronisation, global-norm
/// clipping over every shard, and the optimizer update (`train_state::apply_gradients`), all on
/// every device of the mesh at once. The forwards and backwards run in the state's schedule of
/// micro-batches: one after another, or, with a `pipeline` policy, its schedule over the stages
/// (nn/train/microbatches.hpp).
///
/// The batch is the global batch (or this process's share of it, as `data_loader` gives it): device
/// `i` of the data axis takes rows `[i B/n, (i+1) B/n)`, replicated over the model axis.
///
/// The loss is the state's `softmax_cross_entropy` for class labels, or any `loss_function` given
/// to `train_step` with its targets (`mean_squared_error` for regression, or a user-written loss:
/// nn/loss_function.hpp).
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)));
/// for (auto b = loader.next(); b; b = loader.next()) {
///   auto m = meshlib::nn::train_step(state, *b);   // m.loss: the mean loss over the global batch
/// }
/// // regression: rows x F float targets, mean squared error
/// auto r = meshlib::nn::train_step(state, x, targets, rows, 0, rows, meshlib::nn::mean_squared_error{});
/// @endcode

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/nn/train/microbatches.hpp
/// @file
/// @brief How the one `train_step` and the one `evaluate` run a step's micro-batches on a device:
/// one after another (`accumulated_microbatches`: `train_options::accumulation` forwards and
/// backwards, the gradients summed), or, on a mesh whose pipeline axis has more than one device,
/// the pipeline policy's schedule over its stages (`pipelined_microbatches`,
/// nn/parallel/pipeline_run.hpp). `with_microbatches` picks one; the step and the evaluation around
/// them (inputs, loss, synchronisation, update, metrics) are the same code for both.

#include <cstddef>
#include <utility>

// begin meshlib/nn/parallel/pipeline_run.hpp
/// @file
/// @brief How the pipeline policy runs a step's micro-batches and an evaluation's batches
/// (nn/parallel/pipeline.hpp has the design): each device runs its stage's layers of a `sequential`
/// over the rounds of a `pipeline_plan`, exchanging activations and gradients with its neighbours by
/// `ppermute` over the pipeline axis. `pipelined_microbatches` is what the one `train_step` and the
/// one `evaluate` run in place of running the micro-batches one after another
/// (nn/train/microbatches.hpp); the inputs, the loss, the synchronisation and the update are theirs.

#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <ctime>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/nn/train/step_inputs.hpp
/// @file
/// @brief The argument checks and input blocks every step and evaluation share (the plain
/// `train_step`, `evaluate` and the pipeline's schedule, nn/parallel/pipeline_run.hpp): the
/// batch splits over the data axes, the runner runs the state's devices, a device's rows as the
/// model's input block.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>


namespace meshlib::nn {

namespace detail {
/// Throws unless a global batch of `count` units (rows; or sequences of `seq` tokens, `seq > 0`)
/// splits evenly over the data axis and `groups` (accumulation steps, or 1).
template <class State>
void check_batch(const State& s, std::size_t count, std::size_t groups, const char* what, std::size_t seq = 0) {
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  if (count != 0 && count % (dp * groups) == 0) return;
  const std::string unit = seq == 0 ? " rows" : " sequences";
  throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(count) + unit +
                       (seq == 0 ? std::string() : " (of " + std::to_string(seq) + " tokens)") +
                       " does not split evenly over the " + std::to_string(dp) + " devices of the data axis" +
                       (groups > 1 ? " x " + std::to_string(groups) + " accumulation steps" : std::string()) +
                       "; choose a batch size that is a multiple of " + std::to_string(dp * groups) +
                       (seq == 0 ? std::string() : unit));
}

/// The tokens per sequence of a model that starts at token ids: the `sequence_length()` of the
/// first of its top-level layers that has one (a `positional_embedding`), else 0 (unknown).
template <class Model>
std::size_t sequence_length_of(const Model& model) {
  if constexpr (requires { model.sequence_length(); }) {
    return model.sequence_length();
  } else if constexpr (requires { std::tuple_size<std::remove_cvref_t<decltype(model.layers)>>::value; }) {
    std::size_t seq = 0;
    std::apply([&](const auto&... l) { ((seq = seq != 0 ? seq : sequence_length_of(l)), ...); }, model.layers);
    return seq;
  } else {
    return 0;
  }
}

/// The batch check of a model that starts at token ids, in sequences: `tokens` global tokens are
/// whole sequences of `seq` (0: the model's, when it has one) and the sequences split evenly over
/// the data axis and `groups`, so that every device gets whole sequences (checked before any
/// kernel, which would otherwise refuse a device's share in tokens).
template <class State>
void check_token_batch(const State& s, std::size_t tokens, std::size_t groups, const char* what, std::size_t seq = 0) {
  if (seq == 0) seq = sequence_length_of(s.model);
  if (seq == 0) return;  // no layer reads sequences: the batch is checked in rows
  if (tokens % seq != 0)
    throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(tokens) +
                         " tokens is not a whole number of sequences of " + std::to_string(seq) +
                         " tokens; give sequences x " + std::to_string(seq) + " tokens (rows are sequence-major)");
  check_batch(s, tokens / seq, groups, what, seq);
}

/// Throws unless `runner` runs exactly the devices whose state `s` holds in this process: a runner
/// that runs others would read blocks this process does not have, and one that runs fewer would
/// leave the state's other devices a step behind.
template <class State, class Runner>
void check_runner(const State& s, const Runner& runner, const char* what) {
  const std::vector<std::size_t> run = runner.local_devices(s.mesh.size());
  if (run == s.local_devices()) return;
  throw sharding_error("meshlib::nn: " + std::string(what) + ": the runner runs devices " +
                       meshlib::describe_devices(run) + " in this process, but the train state holds devices " +
                       meshlib::describe_devices(s.local_devices()) +
                       "; pass the runner the state was made for, or make the state with the runner's devices "
                       "(train_state(..., runner.local_devices(mesh.size())))");
}
}  // namespace detail

namespace detail {
/// The element types a model's input may have: float feature rows, or `std::int32_t` token ids
/// (one per row; a language model whose first layer is an `embedding`).
template <class In>
concept input_element = std::same_as<In, float> || std::same_as<In, std::int32_t>;

/// A device's block of the model input for elements `In`: `State::input_type` (float rows of
/// `features`) or `State::ids_type` (one token id per row).
template <class State, input_element In>
using input_block_t = std::conditional_t<std::is_same_v<In, std::int32_t>, typename State::ids_type,
                                         typename State::input_type>;

/// Device `dev`'s block of `rows` input rows at `x` (`features` each) as the model takes it: float
/// rows through `State::input_block` (rounded to the compute type), ids as they are (ids are not
/// rounded, and the embedding checks their range).
template <input_element In, class State>
input_block_t<State, In> make_input_block(State& s, std::size_t dev, const In* x, std::size_t rows, std::size_t features) {
  using X = input_block_t<State, In>;
  if constexpr (std::is_same_v<In, std::int32_t>)
    return X(typename X::view_type(s.ids_block(dev, x, rows), rows), s.mesh, dev);
  else
    return X(typename X::view_type(s.input_block(dev, x, rows * features), rows, features), s.mesh, dev);
}

/// Throws unless `n` token ids are one per row of `rows`.
template <class In>
void check_input_rows(std::size_t n, std::size_t rows, const char* what) {
  if constexpr (std::is_same_v<In, std::int32_t>)
    if (n != rows)
      throw sharding_error("meshlib::nn: " + std::string(what) + ": " + std::to_string(n) + " token ids for " +
                           std::to_string(rows) + " rows: a model that starts at an embedding takes one id per row "
                           "(rows = sequences x sequence length, sequence-major)");
}

/// The argument checks of every `train_step` (the plain step and the pipelined one): the global
/// batch splits over the data axes and `groups` (accumulation steps, or 1), `backend` runs the
/// state's devices, `n_in` inputs are one id per row when `In` is a token id, and the `n_targets`
/// targets give every one of the `rows` rows the same number.
template <class In, class State, class Backend>
void check_step_inputs(const State& s, const Backend& backend, std::size_t n_in, std::size_t n_targets,
                       std::size_t rows, std::size_t global_rows, std::size_t groups) {
  if constexpr (std::is_same_v<In, std::int32_t>) check_token_batch(s, global_rows, groups, "train_step");
  check_batch(s, global_rows, groups, "train_step");
  check_runner(s, backend, "train_step");
  check_input_rows<In>(n_in, rows, "train_step");
  if (rows != 0 && n_targets % rows != 0)
    throw sharding_error("meshlib::nn: train_step: " + std::to_string(n_targets) + " target values for " +
                         std::to_string(rows) +
                         " rows: give every row the same number of targets (one label per row for "
                         "softmax_cross_entropy, one value per output column for mean_squared_error)");
}
}  // namespace detail

}  // namespace meshlib::nn
// end meshlib/nn/train/step_inputs.hpp

namespace meshlib::nn::detail {

/// The calling thread's CPU seconds where the platform has a per-thread clock (not inflated by other
/// work sharing the cores), else wall seconds (`pipeline_stage_times`).
inline double thread_seconds() noexcept {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec t{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) == 0) return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
#endif
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The type of a device's model input on a pipeline mesh: as `input_block_t`, and varying over the
/// pipeline axis (every activation differs from stage to stage, which `ppermute` requires).
template <class State, class In>
using pipeline_input_t = with_vary_t<input_block_t<State, In>, State::data_axes | State::pipeline_axes>;

/// Sends `n` elements at `send` to the stages `pairs` names over the pipeline axis (the public
/// typed `ppermute`, every stage calling it); returns where this device's received elements lie
/// (the collective's workspace: valid until the next collective on this device).
template <fixed_string Axis, class Mesh>
const float* pipeline_exchange(const Mesh& mesh, std::size_t dev, float* send, std::size_t n,
                               const std::vector<std::pair<std::size_t, std::size_t>>& pairs) {
  using message_t = local_tensor<float, 1, Mesh, Mesh::all_axes>;
  return meshlib::ppermute<Axis>(message_t(typename message_t::view_type(send, n), mesh, dev), pairs).data();
}

/// Makes this device's communicator of every group of mesh axes, in one order on every device.
/// Why: a group's communicator is split from the whole mesh's on its first use, a collective of
/// every device; the stages run different layers at different times, so their first uses (a
/// layer's psum over 'model', the pipeline's ppermute) would otherwise come in different orders.
template <class Mesh, std::size_t... M>
void make_group_communicators(const Mesh& mesh, std::size_t dev, std::index_sequence<M...>) {
  double v[1] = {0};
  (sum_over<static_cast<axis_mask>(M + 1)>(mesh, dev, v), ...);  // every mask but the whole mesh's
}
template <class Mesh>
void make_group_communicators(const Mesh& mesh, std::size_t dev) {
  make_group_communicators(mesh, dev, std::make_index_sequence<static_cast<std::size_t>(Mesh::all_axes) - 1>{});
}

/// Sends each mirrored parameter's value from its owner stage to its mirror (restored or updated
/// since the mirror last got it); with `for_backward`, the mirror's gradient block starts at zero.
template <class State>
void refresh_mirrors(State& s, pipeline_engine& e, std::size_t dev, std::size_t stage, bool for_backward) {
  for (const auto& t : e.mirrors) {
    const auto& q = s.params[t.param];
    const std::size_t n = e.block_elements(t.param, dev);
    const float* r = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, q.value[dev], n, {{t.owner, t.mirror}});
    if (stage != t.mirror) continue;
    convert_copy<default_memory_space>(q.value[dev], r, n);
    if (!for_backward) continue;
    fill_values<default_memory_space>(q.grad[dev], n, 0.0f);
    if (q.overwrite) q.overwrite[dev] = 0;
  }
}

/// One device's stage of a pipelined model: forward and backward over its layers `[lo, hi)` with
/// run-time bounds (each layer index a compile-time branch, since activation types differ per layer).
template <class State, class X0>
struct stage_runner {
  using model_t = typename State::model_type;
  static constexpr std::size_t layers = model_t::size;
  template <std::size_t I>
  using input_t = typename model_t::template input_of<X0, I>::type;

  State& s;
  pipeline_engine& e;
  std::size_t dev, stage, lo, hi;

  /// The activation entering layer `I` for `rows` rows, over `data` (its extents from the probe).
  template <std::size_t I>
  input_t<I> typed(float* data, std::size_t rows) const {
    using A = input_t<I>;
    if constexpr (!std::is_same_v<typename A::value_type, float>) {
      throw sharding_error("meshlib::nn: pipeline: layer " + std::to_string(I) +
                           " takes a non-float input, so no stage may start at it; move the split point");
    } else {
      std::array<std::size_t, A::rank> x{};
      const std::size_t* ext = e.extents[dev].data() + I * 8;
      for (std::size_t d = 0; d < A::rank; ++d) x[d] = ext[d];
      x[0] = e.probed_rows[dev] == 0 ? rows : ext[0] * rows / e.probed_rows[dev];
      return std::apply([&](auto... n) { return A(typename A::view_type(data, n...), s.mesh, dev); }, x);
    }
  }

  /// Rounds a layer's output or cotangent to the compute type, as `sequential` does (mixed precision).
  template <class Y>
  void round(Y& y) const noexcept {
    if constexpr (requires { { y.data() } -> std::same_as<float*>; y.size(); })
      if (s.model.round_activations != nullptr) s.model.round_activations(y.data(), y.size());
  }

  /// Calls `f(layer index, buffer)` for every buffer (running statistics) of the model's layers.
  template <class F>
  void for_each_buffer(F&& f) const {
    std::size_t i = 0;
    std::apply(
        [&](const auto&... l) {
          (
              [&] {
                std::vector<param_ref<float>> out;
                collect_buffers_of(l, out);
                for (const auto& b : out) f(i, b);
                ++i;
              }(),
              ...);
        },
        s.model.layers);
  }
  /// The buffers of this stage's layers.
  [[nodiscard]] std::vector<param_ref<float>> stage_buffers() const {
    std::vector<param_ref<float>> out;
    for_each_buffer([&](std::size_t i, const param_ref<float>& b) {
      if (i >= lo && i < hi) out.push_back(b);
    });
    return out;
  }
  /// Copies the stage's buffers to `stash` (`to_stash`) or back: a forward run again (recompute,
  /// probe) must not move running statistics a second time (as `remat`).
  void stash_buffers(const std::vector<param_ref<float>>& buffers, float* stash, bool to_stash) const {
    for (std::size_t i = 0, off = 0; i < buffers.size(); off += buffers[i].count[dev], ++i) {
      float* v = buffers[i].value[dev];
      if (to_stash) convert_copy<default_memory_space>(stash + off, v, buffers[i].count[dev]);
      else convert_copy<default_memory_space>(v, stash + off, buffers[i].count[dev]);
    }
  }

  /// Records the extents of `y` (the input of layer `I`) and runs the stage's layers from `I` on,
  /// recording each; at the stage's end, the output's extents go to `out`.
  template <std::size_t I, class Y>
  void probe_from(const Y& y, double* out) {
    static_assert(Y::rank <= 8, "meshlib::nn: pipeline: an activation of rank above 8");
    for (std::size_t d = 0; d < Y::rank; ++d) e.extents[dev][I * 8 + d] = y.extent(d);
    if constexpr (I < layers) {
      if (I != hi) {
        if (s.model.hooks != nullptr) s.model.hooks->before_forward(I, dev);
        auto z = std::get<I>(s.model.layers).forward(y);
        round(z);
        return probe_from<I + 1>(z, out);
      }
    }
    for (std::size_t d = 0; d < Y::rank; ++d) out[d] = static_cast<double>(y.extent(d));
  }
  template <std::size_t I = 0, class MakeX0>
  void probe_stage(const MakeX0& x0, float* in, std::size_t rows, double* out) {
    if constexpr (I < layers) {
      if (I != lo) return probe_stage<I + 1>(x0, in, rows, out);
      if constexpr (I == 0) probe_from<0>(x0(), out);
      else probe_from<I>(typed<I>(in, rows), out);
    }
  }
  /// Learns the extents of every activation of this stage and of every stage boundary for `rows`
  /// rows: the stages run their layers in turn, each on zeros of the extents the one before found
  /// (sent to all by a sum over the pipeline axis), so a device runs (and allocates the buffers of)
  /// its own layers only. Running statistics are put back afterwards. A collective of the axis.
  template <class MakeX0>
  void probe(const MakeX0& x0, std::size_t rows) {
    e.extents[dev].assign((layers + 1) * 8, 0);
    e.probed_rows[dev] = 0;
    const auto buffers = stage_buffers();
    std::size_t total = 0;
    for (const auto& b : buffers) total += b.count[dev];
    for (std::size_t t = 0; t < e.stages; ++t) {
      double out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (t == stage) {
        float* in = nullptr;
        float* stash = nullptr;
        {
          const meter_scope unmetered(nullptr);  // the probe's own scratch is not the model's
          if (stage > 0) {
            std::size_t n = 1;
            for (std::size_t d = 0; d < 8 && e.extents[dev][lo * 8 + d] != 0; ++d) n *= e.extents[dev][lo * 8 + d];
            in = e.scratch.zeros(dev, n);
          }
          if (total > 0) stash = e.stash.get(dev, total);
        }
        stash_buffers(buffers, stash, true);
        probe_stage(x0, in, rows, out);
        stash_buffers(buffers, stash, false);
      }
      sum_over<State::pipeline_axes>(s.mesh, dev, out);
      const std::size_t at = e.bounds[t].second;
      for (std::size_t d = 0; d < 8; ++d) e.extents[dev][at * 8 + d] = static_cast<std::size_t>(out[d] + 0.5);
    }
    e.probed_rows[dev] = rows;
  }

  /// Layers `I .. hi - 1` forward on `y`; then `sink(integral_constant<I>, output)`.
  template <std::size_t I, class Y, class Sink>
  void forward_from(const Y& y, Sink& sink) {
    if constexpr (I == layers) {
      sink(std::integral_constant<std::size_t, I>{}, y);
    } else {
      if (I == hi) return sink(std::integral_constant<std::size_t, I>{}, y);
      if (s.model.hooks != nullptr) s.model.hooks->before_forward(I, dev);  // FSDP: gather the layer
      auto z = std::get<I>(s.model.layers).forward(y);
      round(z);  // mixed precision: on the compute type's grid, as sequential's forward
      forward_from<I + 1>(z, sink);
    }
  }
  /// The stage's forward on `x0()` (stage 0: the micro-batch's input block, made only there) or
  /// the received activation at `in`.
  template <std::size_t I = 0, class MakeX0, class Sink>
  void forward(const MakeX0& x0, float* in, std::size_t rows, Sink& sink) {
    if constexpr (I < layers) {
      if (I != lo) return forward<I + 1>(x0, in, rows, sink);
      if constexpr (I == 0) forward_from<0>(x0(), sink);
      else forward_from<I>(typed<I>(in, rows), sink);
    }
  }

  /// Layers `I` down to `lo` backward from `dy` (the cotangent of layer `I`'s output); then
  /// `sink(dx)` with the cotangent of the stage input (not on stage 0, which needs none).
  template <std::size_t I, class DY, class Sink>
  void backward_from(const DY& dy, Sink& sink) {
    const bool first = I == lo;
    const bool need_dx = !first || stage > 0;
    if (s.model.hooks != nullptr) s.model.hooks->before_backward(I, dev);
    auto dx = layer_backward<input_t<I>>(std::get<I>(s.model.layers), dy, need_dx);
    if (s.model.hooks != nullptr) s.model.hooks->after_backward(I, dev);  // FSDP: reduce-scatter its gradients
    if (need_dx) round(dx);  // mixed precision, as sequential's backward
    if (first) {
      if (stage > 0) sink(dx);
      return;
    }
    if constexpr (I > 0) backward_from<I - 1>(dx, sink);
  }
  /// The stage's backward from the cotangent of its output at `dy`.
  template <std::size_t I = 1, class Sink>
  void backward(float* dy, std::size_t rows, Sink& sink) {
    if constexpr (I <= layers) {
      if (I != hi) return backward<I + 1>(dy, rows, sink);
      backward_from<I - 1>(typed<I>(dy, rows), sink);
    }
  }

  /// Elements per row of the activation entering layer `I` (from the probe).
  [[nodiscard]] std::size_t per_row(std::size_t i) const {
    if (e.probed_rows[dev] == 0) return 0;
    std::size_t n = 1;
    for (std::size_t d = 0; d < 8 && e.extents[dev][i * 8 + d] != 0; ++d) n *= e.extents[dev][i * 8 + d];
    return n / e.probed_rows[dev];
  }
  /// The message size per row: the widest activation crossing a stage boundary.
  [[nodiscard]] std::size_t message_per_row() const {
    std::size_t w = 0;
    for (std::size_t t = 1; t < e.stages; ++t) w = std::max(w, per_row(e.bounds[t].first));
    return w;
  }
};

/// The pairs of one round's exchange: forward (stage -> stage + 1, for each stage that ran a
/// forward) or backward (stage -> stage - 1, for each that ran a backward and is not first).
inline std::vector<std::pair<std::size_t, std::size_t>> round_pairs(const std::vector<pipeline_slot>& r, bool forward) {
  std::vector<std::pair<std::size_t, std::size_t>> pairs;
  for (std::size_t t = 0; t < r.size(); ++t) {
    if (forward && t + 1 < r.size() && r[t].forward != pipeline_slot::none) pairs.push_back({t, t + 1});
    if (!forward && t > 0 && r[t].backward != pipeline_slot::none) pairs.push_back({t, t - 1});
  }
  return pairs;
}

/// Gives every stage the running statistics (layer buffers) its stage's devices updated in the
/// step: one sum over the pipeline axis of all the model's buffers, each stage contributing its own
/// layers' and zeros for the others' (x + 0 is x: the values arrive unchanged). Afterwards every
/// device holds the model's current buffers, so a checkpoint (written by the first device of each
/// group) and `running_mean()` read on any device see them. No-op for a model without buffers.
template <class Runner>
void sync_buffers(Runner& run) {
  std::size_t total = 0;
  run.for_each_buffer([&](std::size_t, const param_ref<float>& b) { total += b.count[run.dev]; });
  if (total == 0) return;
  using State = std::remove_cvref_t<decltype(run.s)>;
  using buffers_t = local_tensor<float, 1, typename State::mesh_type, State::mesh_type::all_axes, 0, replicated_dims<1>,
                                 default_memory_space>;
  float* v = run.e.scratch.get(run.dev, total);
  std::size_t off = 0;
  run.for_each_buffer([&](std::size_t i, const param_ref<float>& b) {
    const std::size_t n = b.count[run.dev];
    if (i >= run.lo && i < run.hi) convert_copy<default_memory_space>(v + off, b.value[run.dev], n);
    else fill_values<default_memory_space>(v + off, n, 0.0f);
    off += n;
  });
  (void)psum_over<State::pipeline_axes>(wrap1<buffers_t>(v, total, run.s.mesh, run.dev));
  off = 0;
  run.for_each_buffer([&](std::size_t i, const param_ref<float>& b) {
    const std::size_t n = b.count[run.dev];
    if (i < run.lo || i >= run.hi) convert_copy<default_memory_space>(b.value[run.dev], v + off, n);
    off += n;
  });
}

/// The pipeline policy's schedule of a step's micro-batches (see the file comment): what the one
/// step (nn/train/train_step.hpp) and the one evaluation (nn/train/evaluate.hpp) run on a mesh
/// whose pipeline axis has more than one device, in place of `accumulated_microbatches`
/// (nn/train/microbatches.hpp), with the same members. Each device runs its stage's layers over
/// the rounds of a `pipeline_plan`; the step's `accumulation = k` runs `k` whole schedules of `m`
/// micro-batches before the one synchronisation.
template <class State, class In>
struct pipelined_microbatches {
  /// The axes the step's loss sums run over: the last stage computes the loss, every stage reports it.
  static constexpr axis_mask metric_axes = State::data_axes | State::pipeline_axes;
  using X0 = pipeline_input_t<State, In>;

  State& s;
  pipeline_engine& e;

  /// Micro-batches per accumulation step: the policy's `microbatches` (0: one per stage).
  [[nodiscard]] std::size_t per_group() const { return e.microbatches == 0 ? e.stages : e.microbatches; }
  /// The accumulation steps the common batch check divides by (the pipeline checks its own split).
  [[nodiscard]] static std::size_t checked_groups(std::size_t) { return 1; }
  /// Throws unless the `k` accumulation steps of `per_group()` micro-batches divide each data
  /// device's `local_rows` rows of a global batch of `global_rows` over `dp` devices.
  void check_split(std::size_t local_rows, std::size_t global_rows, std::size_t dp, std::size_t k) const {
    const std::size_t m = per_group();
    if (local_rows % (k * m) == 0) return;
    const std::string what = k == 1 ? "the pipeline's " + std::to_string(m) + " micro-batches"
                                    : "the pipeline's " + std::to_string(m) + " micro-batches x " + std::to_string(k) +
                                          " accumulation steps";
    const std::string fix = k == 1 ? "pipeline.microbatches" : "pipeline.microbatches x accumulation";
    throw sharding_error("meshlib::nn: train_step: " + what + " do not divide the " + std::to_string(local_rows) +
                         " rows each device of the data axes gets (a global batch of " + std::to_string(global_rows) +
                         " rows over " + std::to_string(dp) + " devices); choose " + fix + " dividing " +
                         std::to_string(local_rows) + ", or a batch of a multiple of " + std::to_string(dp * k * m) +
                         " rows");
  }

  [[nodiscard]] std::size_t stage_of(std::size_t dev) const { return s.mesh.group_rank(dev, State::pipeline_axes); }
  [[nodiscard]] stage_runner<State, X0> runner(std::size_t dev) const {
    const std::size_t stage = stage_of(dev);
    return {s, e, dev, stage, e.bounds[stage].first, e.bounds[stage].second};
  }

  /// Before device `dev`'s step: the group communicators in one order, this stage's gradients as
  /// the step's (overwritten by the first backward, or zeroed), a mirror's from zero.
  void begin_step(std::size_t dev) const {
    make_group_communicators(s.mesh, dev);
    for (const auto& q : s.params)
      if (q.count[dev] == 0) continue;
      else if (q.overwrite) q.overwrite[dev] = 1;
      else fill_values<default_memory_space>(q.grad[dev], q.count[dev], 0.0f);
    refresh_mirrors(s, e, dev, stage_of(dev), true);
  }

  /// Device `dev`'s forwards and backwards of the step's `k * per_group()` micro-batches of `micro`
  /// rows each in the plan's rounds: `input(j)` makes micro-batch `j`'s input block (on the first
  /// stage), `loss_on(j, z, dz)` computes its loss on the last stage, its gradient into `dz`.
  template <class Input, class LossOn>
  void run(std::size_t dev, std::size_t k, std::size_t micro, const Input& input, LossOn& loss_on,
           step_metrics& metrics) const {
    using clock = std::chrono::steady_clock;
    const std::size_t p = e.stages, m = per_group(), stage = stage_of(dev);
    const pipeline_plan plan(e.schedule, p, m);
    stage_runner<State, X0> run = runner(dev);
    std::size_t g = 0;  // the accumulation group running: micro-batch j is the step's g m + j
    const auto x0_of = [&](std::size_t j) {
      return [&, j] { return meshlib::pvary<State::pipeline_axis>(input(g * m + j)); };
    };
    // Activation memory (step_metrics): the stage's layer buffers and the boundary buffers it
    // holds across the rounds, counted by the device's meter (nn/remat.hpp).
    buffer_meter* meter = s.activation_meter(dev);
    if (e.probed_rows[dev] == 0) {
      const meter_scope metered(meter);
      run.probe(x0_of(0), micro);
    }
    const std::size_t msg = micro * run.message_per_row();
    const std::size_t zn = micro * run.per_row(State::model_type::size);  // logits per micro-batch
    const pipeline_plan::holding held = plan.held(stage);
    float *inputs = nullptr, *dys = nullptr, *dlogits = nullptr, *send = nullptr;
    {
      const meter_scope metered(meter);
      inputs = e.inputs.get(dev, held.inputs * msg);
      dys = e.dys.get(dev, held.cotangents * msg);
      dlogits = e.dlogits.get(dev, held.loss_grads * zn);
      send = e.send.get(dev, msg);
    }
    const auto input_of = [&](std::size_t j) { return stage == 0 ? nullptr : inputs + held.input_slot[j] * msg; };
    const auto buffers = run.stage_buffers();
    std::size_t buffer_elements = 0;
    for (const auto& b : buffers) buffer_elements += b.count[dev];
    float* stash = nullptr;
    if (buffer_elements > 0) stash = e.stash.get(dev, buffer_elements);
    double busy = 0;
    pipeline_stage_times times;
    bool with_loss = true;  // false while recomputing: the loss's gradient is kept from the forward
    std::size_t j = 0;      // the micro-batch running
    auto forward_sink = [&](auto at, const auto& out) {
      if constexpr (decltype(at)::value == State::model_type::size) {
        if (!with_loss) return;
        using Z = std::remove_cvref_t<decltype(out)>;
        Z dz(typename Z::view_type(dlogits + held.loss_grad_slot[j] * zn, out.extent(0), out.extent(1)), s.mesh, dev);
        loss_on(g * m + j, out, dz);
      } else {
        if (with_loss) convert_copy<default_memory_space>(send, out.data(), out.size());
      }
    };
    auto backward_sink = [&](const auto& dx) { convert_copy<default_memory_space>(send, dx.data(), dx.size()); };
    const auto& rounds = plan.rounds();
    const auto start = clock::now();
    for (g = 0; g < k; ++g)
      for (std::size_t ri = 0; ri < rounds.size(); ++ri) {
        const auto& r = rounds[ri];
        if (r[stage].forward != pipeline_slot::none) {
          const auto t0 = clock::now();
          const double c0 = thread_seconds();
          j = r[stage].forward;
          with_loss = true;
          {
            const meter_scope metered(meter);
            run.forward(x0_of(j), input_of(j), micro, forward_sink);
          }
          times.forward += thread_seconds() - c0;
          ++times.forwards;
          if (g + 1 == k && j + 1 == m) metrics.activation_bytes = meter->live;
          busy += std::chrono::duration<double>(clock::now() - t0).count();
        }
        if (const auto pairs = round_pairs(r, true); !pairs.empty()) {
          const float* got = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, send, msg, pairs);
          if (stage > 0 && r[stage - 1].forward != pipeline_slot::none)
            convert_copy<default_memory_space>(input_of(r[stage - 1].forward), got, msg);
        }
        if (r[stage].backward != pipeline_slot::none) {
          const auto t0 = clock::now();
          j = r[stage].backward;
          const meter_scope metered(meter);
          double c0 = thread_seconds();
          if (plan.recomputes(ri, stage)) {  // the layers hold another micro-batch's forward: run this one's again
            with_loss = false;
            run.stash_buffers(buffers, stash, true);  // running statistics move once per micro-batch
            run.forward(x0_of(j), input_of(j), micro, forward_sink);
            run.stash_buffers(buffers, stash, false);
            const double c1 = thread_seconds();
            times.recompute += c1 - c0;
            ++times.recomputes;
            c0 = c1;
          }
          run.backward(stage + 1 == p ? dlogits + held.loss_grad_slot[j] * zn : dys + held.cotangent_slot[j] * msg,
                       micro, backward_sink);
          times.backward += thread_seconds() - c0;
          ++times.backwards;
          busy += std::chrono::duration<double>(clock::now() - t0).count();
        }
        if (const auto pairs = round_pairs(r, false); !pairs.empty()) {
          const float* got = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, send, msg, pairs);
          if (stage + 1 < p && r[stage + 1].backward != pipeline_slot::none)
            convert_copy<default_memory_space>(dys + held.cotangent_slot[r[stage + 1].backward] * msg, got, msg);
        }
      }
    e.busy[dev] = busy;
    e.span[dev] = std::chrono::duration<double>(clock::now() - start).count();
    e.times[dev] = times;
  }

  /// After device `dev`'s backwards: an unwritten gradient zeroed, a mirror's gradient added to its
  /// owner's (the tied weight's sum), the sums on the compute type's grid, every stage's running
  /// statistics on every stage.
  void end_step(std::size_t dev) const {
    const std::size_t stage = stage_of(dev);
    for (const auto& q : s.params)
      if (q.count[dev] != 0 && q.overwrite && q.overwrite[dev]) {  // no backward wrote it: zero
        fill_values<default_memory_space>(q.grad[dev], q.count[dev], 0.0f);
        q.overwrite[dev] = 0;
      }
    for (const auto& t : e.mirrors) {
      const auto& q = s.params[t.param];
      const std::size_t n = e.block_elements(t.param, dev);
      const float* r = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, q.grad[dev], n, {{t.mirror, t.owner}});
      if (stage == t.owner) add_values<default_memory_space>(q.grad[dev], r, n);
    }
    if constexpr (State::mixed)  // the summed gradients on the compute type's grid (as without a pipeline)
      for (const auto& q : s.params)
        if (q.count[dev] != 0) round_to<typename State::compute_type>(q.grad[dev], q.count[dev]);
    stage_runner<State, X0> run = runner(dev);
    sync_buffers(run);
  }

  /// Before device `dev`'s evaluation: the group communicators, the mirrors' values.
  void begin_evaluate(std::size_t dev) const {
    make_group_communicators(s.mesh, dev);
    refresh_mirrors(s, e, dev, stage_of(dev), false);
  }
  /// Device `dev`'s forward of one evaluation batch of `rows` rows (`input()` its block on the
  /// first stage) through the stages in turn (no overlap between batches); `on_output(z)` with the
  /// model's output on the last stage.
  template <class Input, class OnOutput>
  void evaluate(std::size_t dev, const Input& input, std::size_t rows, OnOutput& on_output) const {
    const std::size_t p = e.stages, stage = stage_of(dev);
    stage_runner<State, X0> run = runner(dev);
    const auto x0 = [&] { return meshlib::pvary<State::pipeline_axis>(input()); };
    const meter_scope metered(s.activation_meter(dev));  // the stage's buffers are the model's
    if (e.probed_rows[dev] == 0 && rows > 0) run.probe(x0, rows);
    const std::size_t msg = rows * run.message_per_row();
    float* in = e.inputs.get(dev, msg);
    float* send = e.send.get(dev, msg);
    auto sink = [&](auto at, const auto& z) {
      if constexpr (decltype(at)::value == State::model_type::size) {
        const meter_scope unmetered(nullptr);
        on_output(z);
      } else {
        convert_copy<default_memory_space>(send, z.data(), z.size());
      }
    };
    for (std::size_t t = 0; t < p; ++t) {
      if (stage == t) run.forward(x0, in, rows, sink);
      if (t + 1 < p) {
        const float* got = pipeline_exchange<State::pipeline_axis>(s.mesh, dev, send, msg, {{t, t + 1}});
        if (stage == t + 1) convert_copy<default_memory_space>(in, got, msg);
      }
    }
  }
};

}  // namespace meshlib::nn::detail
// end meshlib/nn/parallel/pipeline_run.hpp

namespace meshlib::nn::detail {

/// A step's micro-batches one after another on every device (no pipeline): `k` forwards and
/// backwards of the whole model, each on its own rows, the gradients summed in the parameters'
/// gradient blocks; with `data_parallel{.overlap = true}`, the last backward starts the gradient
/// buckets (nn/parallel/grad_overlap.hpp). The members are `pipelined_microbatches`'s.
template <class State, class In>
struct accumulated_microbatches {
  /// The axes the step's loss sums run over.
  static constexpr axis_mask metric_axes = State::data_axes;

  State& s;

  /// Micro-batches per accumulation step.
  [[nodiscard]] static std::size_t per_group() { return 1; }
  /// The accumulation steps the common batch check divides by.
  [[nodiscard]] static std::size_t checked_groups(std::size_t k) { return k; }
  /// Nothing beyond the common batch check.
  static void check_split(std::size_t, std::size_t, std::size_t, std::size_t) {}

  /// Before device `dev`'s step: last step's gradients stay where a layer's first backward can
  /// overwrite them (no zeroing pass over the model), the others are zeroed; the overlap's communicator.
  void begin_step(std::size_t dev) const {
    for (const auto& p : s.params)
      if (p.overwrite) p.overwrite[dev] = 1;
      else fill_values<default_memory_space>(p.grad[dev], p.count[dev], 0.0f);
    s.prepare_grad_overlap(dev);
  }

  /// Device `dev`'s `k` forwards and backwards of `micro` rows: `input(j)` makes micro-batch `j`'s
  /// input block, `loss_on(j, z, dz)` its loss and the loss's gradient into `dz`.
  template <class Input, class LossOn>
  void run(std::size_t dev, std::size_t k, std::size_t, const Input& input, LossOn& loss_on,
           step_metrics& metrics) const {
    buffer_meter* meter = s.activation_meter(dev);
    for (std::size_t j = 0; j < k; ++j) {
      const auto xb = input(j);
      auto logits = [&] {
        const meter_scope metered(meter);  // counts the model's buffers only
        return s.model.forward(xb);
      }();
      metrics.activation_bytes = meter->live;
      using Z = decltype(logits);
      Z dlogits(typename Z::view_type(s.output_grad_block(dev, logits.size()), logits.extent(0), logits.extent(1)),
                s.mesh, dev);
      loss_on(j, std::as_const(logits), dlogits);
      if (j + 1 == k) s.begin_grad_overlap(dev);  // the last backward completes the gradients
      const meter_scope metered(meter);
      s.model.template backward<std::remove_cvref_t<decltype(xb)>>(dlogits);
    }
  }

  /// After device `dev`'s backwards: a gradient no backward wrote (its layer did not run) zeroed,
  /// the sums on the compute type's grid (overlapped: the hooks did both for the gradients whose
  /// buckets they started).
  void end_step(std::size_t dev) const {
    const std::span<const param_ref<float>> unstarted(s.params.data(), s.grad_overlap_unstarted(dev));
    for (const auto& p : unstarted)
      if (p.overwrite && p.overwrite[dev]) {
        fill_values<default_memory_space>(p.grad[dev], p.count[dev], 0.0f);
        p.overwrite[dev] = 0;
      }
    if constexpr (State::mixed)
      for (const auto& p : unstarted) round_to<typename State::compute_type>(p.grad[dev], p.count[dev]);
  }

  /// Before device `dev`'s evaluation: nothing.
  static void begin_evaluate(std::size_t) {}
  /// Device `dev`'s forward of one evaluation batch (`input()` its block); `on_output(z)` with the
  /// model's output.
  template <class Input, class OnOutput>
  void evaluate(std::size_t dev, const Input& input, std::size_t, OnOutput& on_output) const {
    auto logits = [&] {
      const meter_scope metered(s.activation_meter(dev));  // new buffers are the model's too
      return s.model.forward(input());
    }();
    on_output(logits);
  }
};

/// `f(schedule)` with the state's schedule of micro-batches for inputs of elements `In`: the
/// pipeline policy's on a mesh whose pipeline axis has more than one device, else one after another.
template <class In, class State, class F>
decltype(auto) with_microbatches(State& s, F&& f) {
  if constexpr (State::pipeline_axes != 0)
    if (s.pipeline() != nullptr) return f(pipelined_microbatches<State, In>{s, *s.pipeline()});
  return f(accumulated_microbatches<State, In>{s});
}

}  // namespace meshlib::nn::detail
// end meshlib/nn/train/microbatches.hpp

namespace meshlib::nn {

namespace detail {

/// The step of every `train_step` overload, with the loss `loss` (a `loss_function` of the model's
/// output, checked by the caller), `x` this process's `rows` rows of input (float features, or one
/// token id per row) and `y` holding `rows` rows of targets of equal width. The state's schedule of
/// micro-batches (nn/train/microbatches.hpp: one after another, or the pipeline policy's) runs the
/// forwards and backwards; the rest is the same for every parallelism.
template <class State, input_element In, class Target, class Loss, class Backend>
step_metrics run_train_step(State& s, std::span<const In> x, std::span<const Target> y, std::size_t rows,
                            std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend) {
  return with_microbatches<In>(s, [&](const auto& schedule) {
    using Schedule = std::remove_cvref_t<decltype(schedule)>;
    const std::size_t k = s.options.accumulation, m = schedule.per_group();
    check_step_inputs<In>(s, backend, x.size(), y.size(), rows, global_rows, schedule.checked_groups(k));
    const std::size_t dp = s.mesh.axes_size(State::data_axes);
    const std::size_t local_rows = global_rows / dp;
    schedule.check_split(local_rows, global_rows, dp, k);
    const std::size_t features = rows == 0 ? 0 : x.size() / rows;
    const std::size_t width = rows == 0 ? 0 : y.size() / rows;  // targets per row
    const std::size_t micro = local_rows / (k * m);             // rows per micro-batch
    s.model.begin_step(s.key.fold_in(s.step), true);
    std::vector<step_metrics> out(s.mesh.size());
    meshlib::spmd(
        s.mesh,
        [&](std::size_t dev) {
          const std::size_t first = s.mesh.group_rank(dev, State::data_axes) * local_rows;
          if (first < global_offset || first + local_rows > global_offset + rows)
            throw sharding_error("meshlib::nn: train_step: device " + std::to_string(dev) + " needs rows [" +
                                 std::to_string(first) + ", " + std::to_string(first + local_rows) +
                                 ") of the global batch, but this process holds rows [" +
                                 std::to_string(global_offset) + ", " + std::to_string(global_offset + rows) + ")");
          schedule.begin_step(dev);
          step_metrics& mt = out[dev];
          buffer_meter* meter = s.activation_meter(dev);
          meter->reset_peak();
          double sums[2] = {0, 0};  // loss, correct
          // Micro-batch j: rows [first + j micro, first + (j + 1) micro) of the global batch.
          const auto row0 = [&](std::size_t j) { return first + j * micro - global_offset; };
          const auto input = [&](std::size_t j) {
            return make_input_block<In>(s, dev, x.data() + row0(j) * features, micro, features);
          };
          const auto loss_on = [&](std::size_t j, const auto& z, auto& dz) {
            const meter_scope unmetered(nullptr);  // the loss's scratch is not the model's
            const loss_part part = as_loss_part(loss(z, y.subspan(row0(j) * width, micro * width), global_rows, dz));
            if (s.loss_scaling() || State::mixed) {
              // The scaled loss's cotangent, on the compute type's grid (float16 overflows here first).
              scale_in_place(dz.data(), dz.size(), s.loss_scale());
              round_to<typename State::compute_type>(dz.data(), dz.size());
            }
            sums[0] += part.loss;
            sums[1] += static_cast<double>(part.correct);
          };
          schedule.run(dev, k, micro, input, loss_on, mt);
          schedule.end_step(dev);
          mt.peak_activation_bytes = meter->peak;
          mt.loss_scale = s.loss_scale();
          mt.grad_norm = s.apply_gradients(dev, mt.sync_seconds);
          mt.skipped = s.loss_scaling() && !std::isfinite(mt.grad_norm);
          sum_over<Schedule::metric_axes>(s.mesh, dev, sums);
          mt.loss = sums[0];
          mt.correct = static_cast<std::size_t>(sums[1] + 0.5);
          mt.rows = global_rows;
        },
        backend);
    const step_metrics& r = out[s.local_devices().front()];
    for (std::size_t dev : s.local_devices())
      if (out[dev].skipped != r.skipped)  // cannot happen: the verdict comes from an all-reduced norm
        throw sharding_error("meshlib::nn: train_step: devices disagree on skipping the step (device " +
                             std::to_string(dev) + ")");
    s.finish_step(r.skipped);
    return r;
  });
}

/// The model's output type for a train state's input of elements `In` (what a loss receives).
template <class State, class In = float>
using output_of_t = std::remove_cvref_t<decltype(std::declval<typename State::model_type&>().forward(
    std::declval<const input_block_t<State, In>&>()))>;

/// The `train_step` with a user's loss, for inputs of elements `In` (see the public overloads).
template <input_element In, class State, std::ranges::contiguous_range Targets, class Loss, class Backend>
step_metrics train_step_with_loss(State& s, std::span<const In> x, const Targets& targets, std::size_t rows,
                                  std::size_t global_offset, std::size_t global_rows, Loss& loss, const Backend& backend) {
  using L = std::remove_reference_t<Loss>;
  using Z = output_of_t<State, In>;
  constexpr bool is_loss = loss_function<L, Z>;
  static_assert(sizeof(loss_does_not_satisfy_loss_function<is_loss, std::remove_cvref_t<Loss>, Z>) > 0);
  if constexpr (is_loss) {
    using given = std::remove_cv_t<std::ranges::range_value_t<Targets>>;
    constexpr bool same = std::is_same_v<given, loss_target_t<L>>;
    static_assert(sizeof(targets_type_differs_from_loss_target_type<same, std::remove_cvref_t<Loss>, given,
                                                                    loss_target_t<L>>) > 0);
    if constexpr (same)
      return run_train_step(s, x, std::span<const given>(std::ranges::data(targets), std::ranges::size(targets)), rows,
                            global_offset, global_rows, loss, backend);
    else
      return {};
  } else {
    return {};
  }
}
}  // namespace detail

/// @brief One training step on a global batch: `x` holds this process's `rows` rows (row-major,
/// `features` each) starting at row `global_offset` of a global batch of `global_rows` rows, and
/// `y` their class labels; the loss is the state's `softmax_cross_entropy` (`state.loss()`).
/// The parameters' gradient blocks start the step holding the last step's gradients: the first
/// backward overwrites them (or, for a layer that only adds, they are zeroed first); they serve as
/// the synchronisation's buffers (the big ones are all-reduced in place): after the step they are scratch.
/// Runs on `backend` (default: `default_runner`, as `spmd`: this process's device threads, or, after
/// `mpi::initialize` started several processes, those processes), which must run the devices the
/// state holds in this process.
/// @throws sharding_error when the batch does not split over the data axis and the accumulation
/// steps, when a device's rows are not in this process's share, when `y` is not one label per row,
/// or when `backend` runs other devices than the state holds here.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, std::span<const float> x, std::span<const std::int32_t> y, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, const Backend& backend = {}) {
  return detail::run_train_step(s, x, y, rows, global_offset, global_rows, s.loss(), backend);
}

/// @brief One training step with the loss `loss` (a `loss_function` of the model's output:
/// `mean_squared_error`, `softmax_cross_entropy`, or a user-written loss) on targets `targets`:
/// a contiguous range of the loss's `target_type`, this process's `rows` rows of targets of equal
/// width, row-major (for `mean_squared_error`, one value per output column). Otherwise as the
/// `train_step` above: `m.loss` is the mean loss over the global batch.
/// @code
/// auto m = nn::train_step(state, x, std::span<const float>(t), rows, 0, rows, nn::mean_squared_error{});
/// @endcode
/// A loss that is not a `loss_function`, or targets of another element type than its
/// `target_type`, is one compile error naming the requirement.
/// @throws sharding_error as the `train_step` above, when the targets are not the same number per
/// row, and (as the cause of a `device_error`) what the loss throws: `mean_squared_error` on
/// targets whose width is not the model output's.
template <class State, std::ranges::contiguous_range Targets, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, std::span<const float> x, const Targets& targets, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, Loss&& loss, const Backend& backend = {}) {
  return detail::train_step_with_loss<float>(s, x, targets, rows, global_offset, global_rows, loss, backend);
}

/// @brief One training step of a model that starts at token ids (a language model whose first
/// layer is an `embedding`): `ids` holds this process's `rows` tokens (one id per row; the rows
/// are sequences of the model's sequence length, sequence-major, whole sequences on every device
/// of the data axis), starting at row `global_offset` of a global batch of `global_rows` tokens,
/// and `y` each token's target (the next token); the loss is the state's `softmax_cross_entropy`,
/// which takes logits sharded over the vocabulary (a `tied_head` or `column_dense` head) without
/// gathering them. `m.loss` is the mean loss per token over the global batch.
/// @code
/// auto b = nn::sample_windows(train_text, 32, 64, key.fold_in(state.step));   // 32 windows of 64 bytes
/// auto m = nn::train_step(state, b);   // or: train_step(state, ids, next_ids, rows, 0, rows)
/// @endcode
/// @throws sharding_error as the float `train_step`, when `ids` is not one id per row, and, before
/// any kernel runs, when the global batch is not whole sequences of the model's sequence length (its
/// `positional_embedding`'s) or its sequences do not split evenly over the data axis (and the
/// accumulation steps): the message counts sequences as the float path counts rows; (as the cause
/// of a `device_error`) `std::out_of_range` from the embedding for an id outside its vocabulary,
/// naming the layer and the vocabulary size, and `sharding_error` from a layer whose own sequence
/// length does not fit a device's rows.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, std::span<const std::int32_t> ids, std::span<const std::int32_t> y, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, const Backend& backend = {}) {
  return detail::run_train_step(s, ids, y, rows, global_offset, global_rows, s.loss(), backend);
}

/// @brief One training step of a model that starts at token ids, with the loss `loss` (a
/// `loss_function`) on `targets`; otherwise as the `train_step` on ids above.
template <class State, std::ranges::contiguous_range Targets, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, std::span<const std::int32_t> ids, const Targets& targets, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, Loss&& loss, const Backend& backend = {}) {
  return detail::train_step_with_loss<std::int32_t>(s, ids, targets, rows, global_offset, global_rows, loss, backend);
}

/// @brief `train_step` on windows of text (`sample_windows`): every window a sequence, the whole
/// batch global (`b.rows * b.context` tokens, every process holding all of them).
/// @throws sharding_error, before any kernel runs, when the `b.rows` windows do not split evenly
/// over the data axis (and the accumulation steps), in sequences: "the global batch of 3 sequences
/// (of 8 tokens) does not split evenly over the 2 devices of the data axis; choose a batch size that
/// is a multiple of 2 sequences"; otherwise as the `train_step` on ids.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, const token_batch& b, const Backend& backend = {}) {
  const std::size_t tokens = b.rows * b.context;
  // In windows, before anything runs (the model's own sequence length may differ: the layers name it).
  detail::check_batch(s, b.rows, s.options.accumulation, "train_step", b.context);
  return train_step(s, std::span<const std::int32_t>(b.inputs), std::span<const std::int32_t>(b.targets), tokens, 0,
                    tokens, backend);
}

/// @brief `train_step` on a batch from `data_loader`.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, const batch& b, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x), std::span<const std::int32_t>(b.y), b.rows, b.global_offset,
                    b.global_rows, backend);
}

/// @brief `train_step` on a batch from `data_loader` with the loss `loss` (a `loss_function`
/// taking the batch's class labels, `std::int32_t`).
template <class State, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, const batch& b, Loss&& loss, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x), b.y, b.rows, b.global_offset, b.global_rows,
                    std::forward<Loss>(loss), backend);
}

/// @brief `train_step` on a batch already in device memory (`device_put`, `device_prefetcher`):
/// the model reads its rows in place; the labels are the batch's host copy.
template <class State, class Backend = default_runner>
  requires runner<Backend>
step_metrics train_step(State& s, const device_batch& b, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x.data(), b.x.size()), std::span<const std::int32_t>(b.y), b.rows,
                    b.global_offset, b.global_rows, backend);
}

/// @brief `train_step` on a batch in device memory with the loss `loss` (see the `batch` overload).
template <class State, class Loss, class Backend = default_runner>
  requires(!runner<std::remove_cvref_t<Loss>> && runner<Backend>)
step_metrics train_step(State& s, const device_batch& b, Loss&& loss, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x.data(), b.x.size()), b.y, b.rows, b.global_offset, b.global_rows,
                    std::forward<Loss>(loss), backend);
}
}  // namespace meshlib::nn
// end meshlib/nn/train/train_step.hpp
// begin meshlib/nn/train/evaluate.hpp
/// @file
/// @brief `evaluate(state, data)`: loss and accuracy of the model, forward only, in batches split
/// over the data axes; with a `pipeline` policy, each batch through the stages in turn
/// (nn/train/microbatches.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>


namespace meshlib::nn {

namespace detail {
/// `evaluate` on `count` rows at `x` (`features` floats, or one id, each) with labels `y`, in batches
/// of `batch_rows` rows; each batch is split over the data axis in whole groups of `group` rows (a
/// sequence for a language model; 1 for feature rows), so a last, smaller batch is split unevenly
/// and a device may get none (it still runs the forward, on no rows, so that every device makes the
/// same collective calls).
template <class State, input_element In, class Backend>
step_metrics run_evaluate(State& s, std::span<const In> x, std::size_t features, std::span<const std::int32_t> y,
                          std::size_t count, std::size_t group, std::size_t batch_rows, const Backend& backend) {
  return with_microbatches<In>(s, [&](const auto& schedule) {
    using Schedule = std::remove_cvref_t<decltype(schedule)>;
    check_runner(s, backend, "evaluate");
    const std::size_t dp = s.mesh.axes_size(State::data_axes);
    s.model.begin_step(s.key, false);
    std::vector<step_metrics> out(s.mesh.size());
    meshlib::spmd(
        s.mesh,
        [&](std::size_t dev) {
          const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
          schedule.begin_evaluate(dev);
          double sums[2] = {0, 0};
          for (std::size_t start = 0; start < count; start += batch_rows) {
            const std::size_t units = std::min(batch_rows, count - start) / group;
            const std::size_t lo = start + units * di / dp * group, hi = start + units * (di + 1) / dp * group;
            const auto input = [&] { return make_input_block<In>(s, dev, x.data() + lo * features, hi - lo, features); };
            auto on_output = [&](const auto& z) {
              const loss_part part = s.loss().forward(z, y.subspan(lo, hi - lo), count);
              sums[0] += part.loss;
              sums[1] += static_cast<double>(part.correct);
            };
            schedule.evaluate(dev, input, hi - lo, on_output);
          }
          sum_over<Schedule::metric_axes>(s.mesh, dev, sums);
          out[dev].loss = sums[0];
          out[dev].correct = static_cast<std::size_t>(sums[1] + 0.5);
          out[dev].rows = count;
        },
        backend);
    return out[s.local_devices().front()];
  });
}
}  // namespace detail

/// @brief Loss and accuracy of the model on a whole data set (every process holds it), forward only,
/// in batches of `batch_rows` split over the data axis (a last, smaller batch is split unevenly).
/// Runs on `backend` as `train_step` does.
/// @throws sharding_error when `backend` runs other devices than the state holds here.
template <class State, class Backend = default_runner>
step_metrics evaluate(State& s, const dataset& ds, std::size_t batch_rows = 1000, const Backend& backend = {}) {
  return detail::run_evaluate(s, std::span<const float>(ds.x), ds.features, std::span<const std::int32_t>(ds.y), ds.count,
                              1, batch_rows, backend);
}

/// @brief The mean loss per token (and the tokens predicted right) of a model that starts at token
/// ids on the windows `w` (`tile_windows`: every window a sequence of the model's length), forward
/// only, `batch_windows` windows at a time split over the data axis in whole windows.
/// @code
/// auto v = nn::evaluate(state, nn::tile_windows(split.validation, 64, 0, nn::count_windows(split.validation, 64)));
/// // v.loss: nats per token; v.correct / v.rows: next-token accuracy
/// @endcode
/// @throws sharding_error when `backend` runs other devices than the state holds here, or
/// `batch_windows` is 0; (as the cause of a `device_error`) what the layers throw (an id outside the
/// vocabulary).
template <class State, class Backend = default_runner>
step_metrics evaluate(State& s, const token_batch& w, std::size_t batch_windows = 64, const Backend& backend = {}) {
  if (batch_windows == 0) throw sharding_error("meshlib::nn: evaluate: batch_windows is 0; evaluate at least one window at a time");
  const std::size_t tokens = w.rows * w.context;
  if (w.inputs.size() != tokens || w.targets.size() != tokens)
    throw sharding_error("meshlib::nn: evaluate: the token batch holds " + std::to_string(w.inputs.size()) + " ids and " +
                         std::to_string(w.targets.size()) + " targets for " + std::to_string(w.rows) + " windows of " +
                         std::to_string(w.context) + " tokens");
  return detail::run_evaluate(s, std::span<const std::int32_t>(w.inputs), 1, std::span<const std::int32_t>(w.targets),
                              tokens, w.context, batch_windows * w.context, backend);
}

}  // namespace meshlib::nn
// end meshlib/nn/train/evaluate.hpp
// begin meshlib/nn/advise_mesh.hpp
/// @file
/// @brief `advise_mesh`: which mesh shape, threads per device and gradient-sync overlap train a model
/// fastest on this many devices, measured.
///
/// Choosing the mesh shape matters more than most knobs ((4, 2) against (8, 1) can be 1.8x), and
/// the right one depends on the model, the batch and the machine, so the advisor measures instead
/// of modelling: it enumerates every factorisation of the device count over the mesh type's axes
/// (`mesh_shapes`), builds the model on each (a shape the model refuses, heads or vocabulary or
/// width not divisible by an axis, is kept as a row "not possible: <the library's message>"),
/// runs a few `train_step`s after a warm-up, and ranks the shapes by step time. Each shape is tried
/// with every threads-per-device count of `advise_options::threads_per_device` (by default 1 and,
/// where larger, the cores this process may run on divided by the devices: a device's products on
/// that many BLAS threads) and, where it has a "data" axis larger than 1 (and no "pipeline" axis
/// larger than 1, for a `sequential` model), with the gradient
/// synchronisation overlapped with the backward pass and not (`data_parallel::overlap`;
/// `advise_options::overlap`): one row per combination (a shape the library refuses: one row).
/// Each row also has samples per second, the share of the step spent in the gradient synchronisation
/// (`step_metrics::sync_seconds`; the psums inside tensor-parallel layers count as compute), and
/// the bytes per device: parameters, gradients and optimizer state (`train_state::memory`, the
/// largest over the devices) plus the step's peak of activation buffers
/// (`step_metrics::peak_activation_bytes`).
///
/// Axes: every axis of `Mesh` takes part, each shape trained with the policies its axes call for:
/// `advise_options::data_policy` over "data", `fsdp_policy` (`fully_shard<"fsdp">`) where the
/// "fsdp" axis is larger than 1, `pipeline_policy` (`pipeline<"pipeline">`, by default one
/// micro-batch per stage) where the "pipeline" axis is larger than 1, with the measured bubble in
/// its own column; the batch is split over "data" and "fsdp", and the layers' tensor parallelism
/// runs over the axis they name ("model" by default). A shape the pipeline
/// refuses (micro-batches that do not divide a device's rows, more stages than layers) is listed as
/// not possible with its reason.
/// @code
/// auto a = nn::advise_mesh<mesh_t>(8, [&](const mesh_t& m) { return make_gpt(m); }, batch);
/// std::cout << a.markdown();          // the ranked table
/// const mesh_t best = nn::make_mesh<mesh_t>(a.best);
/// @endcode

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief The size of every axis of a mesh type, in mesh order (one candidate of the advisor).
struct mesh_shape {
  std::vector<std::string> axes;   ///< the mesh's axis names, in order
  std::vector<std::size_t> sizes;  ///< their sizes
  /// The size of axis `name` (1 when the mesh has no such axis).
  [[nodiscard]] std::size_t size(std::string_view name) const {
    for (std::size_t i = 0; i < axes.size(); ++i)
      if (axes[i] == name) return sizes[i];
    return 1;
  }
  /// The number of devices.
  [[nodiscard]] std::size_t devices() const {
    std::size_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
  }
  /// `"(2, 4)"`: the sizes in mesh order.
  [[nodiscard]] std::string to_string() const {
    std::string s = "(";
    for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
    return s + ")";
  }
  /// `"2x4"`: the flagships' `--mesh` spelling.
  [[nodiscard]] std::string flag() const {
    std::string s;
    for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? "x" : "") + std::to_string(sizes[i]);
    return s;
  }
  /// Equal when the axes and their sizes are.
  friend bool operator==(const mesh_shape&, const mesh_shape&) = default;
};

/// @brief One shape's measurement (or why it cannot run).
struct advice_row {
  mesh_shape shape;  ///< the mesh shape measured
  std::size_t threads_per_device = 1;  ///< the BLAS threads of each device's products (`set_blas_threads_per_device`)
  bool overlap = false;                ///< `data_parallel::overlap` of the row
  /// Empty when the shape ran; else `"not possible: <reason>"` (the library's own message).
  std::string refused;
  double step_seconds = 0;        ///< median wall time of a timed step
  double samples_per_second = 0;  ///< rows (or windows) of the global batch per second
  double sync_share = 0;          ///< share of the timed steps in the gradient synchronisation
  double bubble = 0;              ///< the pipeline's measured idle share of the last step (0 without one)
  std::size_t state_bytes = 0;    ///< parameters + gradients + optimizer state (+ FSDP buffers), the largest device
  std::size_t activation_bytes = 0;  ///< the step's peak of activation buffers (first device)
  /// Whether the shape ran.
  [[nodiscard]] bool possible() const noexcept { return refused.empty(); }
  /// The estimate of a device's memory: state plus activations.
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return state_bytes + activation_bytes; }
};

/// @brief The advisor's answer: every shape, ranked (fastest first, equal step times in enumeration
/// order; shapes not possible last, in enumeration order), and the best one.
struct advice {
  std::vector<advice_row> rows;  ///< every shape, ranked
  mesh_shape best;               ///< the fastest shape that ran
  std::size_t best_threads_per_device = 1;  ///< its threads per device
  bool best_overlap = false;                ///< and whether its gradient sync overlapped the backward
  std::size_t devices = 0;       ///< the device count the shapes factorise
  std::size_t batch = 0;  ///< samples (rows or windows) of the global batch

  /// The ranked table in Markdown; a shape that is not possible has a short cell ("not possible,
  /// see below (1)") and its reason in a numbered list under the table (a reason is a sentence or
  /// two, too long for a cell).
  [[nodiscard]] std::string markdown() const {
    std::string axes;
    if (!rows.empty())
      for (std::size_t i = 0; i < rows.front().shape.axes.size(); ++i) axes += (i ? ", " : "") + rows.front().shape.axes[i];
    std::string s = "| rank | mesh (" + axes + ") | threads/device | overlap | step time | samples/s | sync share | bubble | memory per device |\n"
                    "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n";
    char buf[256];
    std::size_t rank = 0;
    std::string notes;
    std::size_t note = 0;
    for (const auto& r : rows) {
      if (r.possible()) {
        std::snprintf(buf, sizeof buf, "| %zu | %s | %zu | %s | %.2f ms | %.1f | %.0f%% | %.0f%% | %.2f MiB (%.2f state + %.2f activations) |\n",
                      ++rank, r.shape.to_string().c_str(), r.threads_per_device, r.overlap ? "on" : "off",
                      1e3 * r.step_seconds, r.samples_per_second,
                      100.0 * r.sync_share, 100.0 * r.bubble, static_cast<double>(r.memory_bytes()) / 1048576.0,
                      static_cast<double>(r.state_bytes) / 1048576.0, static_cast<double>(r.activation_bytes) / 1048576.0);
        s += buf;
      } else {
        const std::string n = std::to_string(++note);
        constexpr std::string_view prefix = "not possible: ";
        const std::string_view why = std::string_view(r.refused).starts_with(prefix)
                                         ? std::string_view(r.refused).substr(prefix.size())
                                         : std::string_view(r.refused);
        s += "| - | " + r.shape.to_string() + " | " + std::to_string(r.threads_per_device) + " | " +
             (r.overlap ? "on" : "off") + " | not possible, see below (" + n + ") | | | | |\n";
        notes += n + ". " + r.shape.to_string() + " is not possible: " + std::string(why) + "\n";
      }
    }
    if (!notes.empty()) s += "\nNot possible:\n\n" + notes;
    return s;
  }
};

/// @brief How `advise_mesh` measures (and, through `step_time`, what times it ranks by).
struct advise_options {
  std::size_t warmup_steps = 2;  ///< untimed steps first (allocation, caches)
  std::size_t timed_steps = 5;   ///< timed steps; the median is the step time
  optimizer opt = adam(constant(1e-3f));  ///< the optimizer of the timed steps
  train_options train = {};      ///< accumulation and loss scaling of every shape
  /// The data parallelism over "data" (its `overlap` set per row, see `overlap`).
  data_parallel<"data"> data_policy = {};
  fully_shard<"fsdp"> fsdp_policy = {};           ///< applied on a shape whose "fsdp" axis is larger than 1
  nn::pipeline<"pipeline"> pipeline_policy = {};  ///< applied on a shape whose "pipeline" axis is larger than 1
  std::vector<mesh_shape> only;  ///< measure only these shapes (empty: every factorisation)
  /// The threads per device to try on every shape; empty (the default): 1 and, where larger,
  /// `available_cores()` / the shape's devices.
  std::vector<std::size_t> threads_per_device;
  /// The `data_parallel::overlap` settings to try on a shape whose "data" axis is larger than 1
  /// and whose "pipeline" axis is not, for a `sequential` model (other shapes and models, and
  /// ZeRO-1, take `data_policy.overlap`); empty (the default): off and on.
  std::vector<bool> overlap;
  /// @brief The time the advisor records for one timed step; empty (the default): the step's measured
  /// wall time.
  ///
  /// Called after each timed step with the candidate (its `shape`, `threads_per_device` and `overlap`
  /// set; the measurements not yet), the step's index among the timed steps (0 to
  /// `timed_steps - 1`) and its measured wall time in seconds; returns the seconds to record. The
  /// ranking, `advice_row::step_seconds` and `samples_per_second` use what it returns; `sync_share`
  /// stays the measured synchronisation over the measured step times. A seam for callers who time
  /// otherwise (a device's own clock, a cost model) and for tests: the ranking is then a function
  /// of the times given, not of the machine's load.
  /// @code
  /// o.step_time = [](const nn::advice_row& c, std::size_t, double) { return c.shape.size("model") == 4 ? 0.01 : 0.02; };
  /// @endcode
  std::function<double(const advice_row& candidate, std::size_t step, double measured_seconds)> step_time;
};

/// @brief Every factorisation of `devices` over the axes of `Mesh`, in lexicographic order of the
/// sizes from the last axis to the first ((8, 1), (4, 2), (2, 4), (1, 8) for (data, model)).
/// A mesh type with static axis sizes keeps them.
template <mesh_type Mesh>
std::vector<mesh_shape> mesh_shapes(std::size_t devices) {
  constexpr std::size_t n = Mesh::ndim;
  std::vector<mesh_shape> out;
  std::array<std::size_t, n> sizes{};
  std::function<void(std::size_t, std::size_t)> place = [&](std::size_t axis, std::size_t left) {
    if (axis == 0) {
      sizes[0] = left;
      if (Mesh::static_sizes[0] != dynamic_extent && Mesh::static_sizes[0] != left) return;
      mesh_shape s;
      for (std::size_t i = 0; i < n; ++i) {
        s.axes.emplace_back(Mesh::axis_names[i]);
        s.sizes.push_back(sizes[i]);
      }
      out.push_back(std::move(s));
      return;
    }
    for (std::size_t k = 1; k <= left; ++k)
      if (left % k == 0 && (Mesh::static_sizes[axis] == dynamic_extent || Mesh::static_sizes[axis] == k)) {
        sizes[axis] = k;
        place(axis - 1, left / k);
      }
  };
  if (devices > 0) place(n - 1, devices);
  return out;
}

/// @brief The mesh of type `Mesh` with the sizes of `s`.
/// @throws mesh_error when `s` is not a shape of this mesh type (other axes, a static size differs).
template <mesh_type Mesh>
Mesh make_mesh(const mesh_shape& s) {
  typename Mesh::coord_type sizes{};
  if (s.sizes.size() != Mesh::ndim)
    throw mesh_error("meshlib::nn: make_mesh: the shape " + s.to_string() + " has " + std::to_string(s.sizes.size()) +
                     " axes, the mesh type " + std::to_string(Mesh::ndim));
  for (std::size_t i = 0; i < Mesh::ndim; ++i) sizes[i] = s.sizes[i];
  return Mesh(sizes);
}

namespace detail {
/// The train state of `make_model`'s `net` on a shape `shape` of `mesh`, with the policies its axes
/// call for (see `advise_mesh`), added one `Stage` at a time (data, fsdp, pipeline): the policies'
/// set is a compile-time list, the shape's sizes are known at run time.
/// @throws sharding_error for an fsdp or pipeline axis larger than 1 and a model that is not a
/// `sequential` (the policies' units are its layers), as the train state's constructor otherwise.
template <int Stage, class Mesh, class Model, class... Ps>
train_state<Mesh, Model> advised_state(const Mesh& mesh, Model& net, const advise_options& o, const mesh_shape& shape,
                                       bool overlap, const Ps&... ps) {
  // Whether the shape's `axis` calls for `policy` (larger than 1), which needs a sequential model.
  const auto wanted = [&](std::string_view axis, std::string_view policy) {
    if (shape.size(axis) <= 1) return false;
    if constexpr (!sequential_model<Model>)
      throw sharding_error("meshlib::nn: advise_mesh: the shape's '" + std::string(axis) + "' axis is larger than 1 "
                           "and " + std::string(policy) + " needs a sequential model (its layers); wrap the layers "
                           "in nn::sequential or keep the axis at size 1 (advise_options::only)");
    return true;
  };
  if constexpr (Stage == 0) {
    if constexpr (Mesh::template has_axis<"data">) {
      data_parallel<"data"> dp = o.data_policy;
      dp.overlap = overlap;
      return advised_state<1>(mesh, net, o, shape, overlap, dp);
    } else {
      return advised_state<1>(mesh, net, o, shape, overlap);
    }
  } else if constexpr (Stage == 1) {
    if constexpr (Mesh::template has_axis<"fsdp">)
      if (wanted("fsdp", "fully_shard"))
        if constexpr (sequential_model<Model>) return advised_state<2>(mesh, net, o, shape, overlap, ps..., o.fsdp_policy);
    return advised_state<2>(mesh, net, o, shape, overlap, ps...);
  } else if constexpr (Stage == 2) {
    if constexpr (Mesh::template has_axis<"pipeline">)
      if (wanted("pipeline", "pipeline"))
        if constexpr (sequential_model<Model>)
          return advised_state<3>(mesh, net, o, shape, overlap, ps..., o.pipeline_policy);
    return advised_state<3>(mesh, net, o, shape, overlap, ps...);
  } else if constexpr (sizeof...(Ps) == 0) {
    return train_state<Mesh, Model>(mesh, std::move(net), o.opt, o.train);
  } else {
    return train_state<Mesh, Model>(mesh, std::move(net), o.opt, o.train, ps...);
  }
}

/// Samples of a global batch: rows of a `batch`, windows of a `token_batch`.
inline std::size_t samples_of(const batch& b) { return b.global_rows; }
inline std::size_t samples_of(const token_batch& b) { return b.rows; }

/// A library message without its `meshlib::nn: ` / `meshlib: ` prefix (the table says who refused).
inline std::string without_prefix(std::string_view m) {
  for (std::string_view p : {std::string_view("meshlib::nn: "), std::string_view("meshlib: ")})
    if (m.substr(0, p.size()) == p) return std::string(m.substr(p.size()));
  return std::string(m);
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
}  // namespace detail

/// @brief Measures `train_step` of `make_model(mesh)` on `batch` (a global `batch` or a
/// `token_batch`) for every shape of `devices` devices over `Mesh`'s axes (or `o.only`) and
/// ranks them (see the file comment). Runs on this process's thread devices.
/// @throws sharding_error when `devices` is 0 or no shape is possible (the message lists every
/// shape's reason); what the model or a step throws otherwise (a library `meshlib::error` is a
/// refusal of that shape, anything else a bug that propagates).
template <mesh_type Mesh, class Factory, class Batch>
advice advise_mesh(std::size_t devices, Factory&& make_model, const Batch& batch, const advise_options& o = {}) {
  using model_type = std::remove_cvref_t<std::invoke_result_t<Factory&, const Mesh&>>;
  if (devices == 0) throw sharding_error("meshlib::nn: advise_mesh: 0 devices; give the number of devices to split over");
  advice a;
  a.devices = devices;
  a.batch = detail::samples_of(batch);
  const std::vector<mesh_shape> shapes = o.only.empty() ? mesh_shapes<Mesh>(devices) : o.only;
  std::vector<advice_row> candidates;
  for (const auto& shape : shapes) {
    std::vector<std::size_t> threads = o.threads_per_device;
    if (threads.empty()) {
      threads.push_back(1);
      if (const std::size_t t = available_cores() / std::max<std::size_t>(shape.devices(), 1); t > 1) threads.push_back(t);
    }
    // Overlap only changes a step with a data axis to synchronise over, and not under ZeRO-1 (whose
    // sync is its reduce-scatter after the backward), nor a pipelined step or a model that is not a
    // `sequential` (no layer hooks start the buckets: the train state refuses overlap there).
    const bool overlap_matters = shape.size("data") > 1 && o.data_policy.zero == 0 &&
                                 shape.size("pipeline") <= 1 && detail::sequential_model<model_type>;
    std::vector<bool> overlap = overlap_matters ? o.overlap : std::vector<bool>{o.data_policy.overlap};
    if (overlap.empty()) overlap = {false, true};
    for (std::size_t t : threads)
      for (bool ov : overlap) {
        if (t == 0)
          throw std::invalid_argument("meshlib::nn: advise_mesh: advise_options::threads_per_device holds 0; give "
                                      "counts of 1 or more");
        advice_row c;
        c.shape = shape;
        c.threads_per_device = t;
        c.overlap = ov;
        candidates.push_back(std::move(c));
      }
  }
  // The caller's BLAS threads come back however the loop ends.
  struct restore_blas_threads {
    int threads = blas_threads_per_device();
    ~restore_blas_threads() { set_blas_threads_per_device(threads); }
  } restore;
  std::vector<mesh_shape> refused;  // a shape refused once is listed once (its reason does not depend on
                                    // the threads or the overlap)
  for (auto& row : candidates) {
    const mesh_shape& shape = row.shape;
    if (std::find(refused.begin(), refused.end(), shape) != refused.end()) continue;
    set_blas_threads_per_device(static_cast<int>(row.threads_per_device));
    try {
      const Mesh mesh = make_mesh<Mesh>(shape);
      auto net = make_model(mesh);
      auto state = detail::advised_state<0>(mesh, net, o, shape, row.overlap);
      for (std::size_t i = 0; i < o.warmup_steps; ++i) (void)train_step(state, batch);
      std::vector<double> times;
      double total = 0, sync = 0;  // measured: the synchronisation's share of the measured steps
      step_metrics last;
      for (std::size_t i = 0; i < std::max<std::size_t>(o.timed_steps, 1); ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        last = train_step(state, batch);
        const double measured = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        times.push_back(o.step_time ? o.step_time(row, i, measured) : measured);
        total += measured;
        sync += last.sync_seconds;
      }
      row.step_seconds = detail::median(times);
      row.samples_per_second = static_cast<double>(a.batch) / row.step_seconds;
      row.sync_share = total > 0 ? sync / total : 0;
      for (std::size_t dev : state.local_devices()) row.state_bytes = std::max(row.state_bytes, state.memory(dev).total());
      row.activation_bytes = last.peak_activation_bytes;
      row.bubble = measured_bubble(state);
    } catch (const meshlib::error& e) {
      row.refused = "not possible: " + detail::without_prefix(e.what());
    }
    if (!row.possible()) refused.push_back(shape);
    a.rows.push_back(std::move(row));
  }
  std::stable_sort(a.rows.begin(), a.rows.end(), [](const advice_row& x, const advice_row& y) {
    if (x.possible() != y.possible()) return x.possible();
    return x.possible() && x.step_seconds < y.step_seconds;
  });
  if (a.rows.empty() || !a.rows.front().possible()) {
    std::string why;
    for (const auto& r : a.rows) why += "; " + r.shape.to_string() + ": " + r.refused;
    throw sharding_error("meshlib::nn: advise_mesh: no mesh shape of " + std::to_string(devices) +
                         " devices can train this model on this batch" + why);
  }
  a.best = a.rows.front().shape;
  a.best_threads_per_device = a.rows.front().threads_per_device;
  a.best_overlap = a.rows.front().overlap;
  return a;
}

}  // namespace meshlib::nn
// end meshlib/nn/advise_mesh.hpp
// begin meshlib/nn/params.hpp
/// @file
/// @brief `params(state)`: the trained parameters read back, as flax's `state.params` and
/// `jax.device_get` give them: for each parameter of the model, in layer order, its name, global
/// shape and sharding, and its *global* values gathered from the devices' blocks into one
/// row-major host array. The values are the float master weights the optimizer updates (with a
/// 16-bit compute type the parameters' values are their rounding), what a checkpoint saves; so on
/// any mesh a parameter reads back the same array.
///
/// `state.params` (the `param_ref`s) are the per-device blocks themselves, for code that works
/// block by block; `params(state)` is the whole array, for reading, printing or exporting.
/// @code
/// for (const meshlib::nn::param_array& p : meshlib::nn::params(state))
///   std::printf("%s %s: first %g\n", p.name.c_str(), p.sharding.c_str(), p.values[0]);
/// const auto w = meshlib::nn::params(state)[0];   // e.g. "fc1.w", shape {784, 1024}
/// float w_ij = w.values[i * w.shape[1] + j];
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief One parameter read back to the host (see the file comment).
struct param_array {
  std::string name;                 ///< as the layer named it, e.g. "fc1.w"
  std::vector<std::size_t> shape;   ///< global shape
  std::string sharding;             ///< the printed named_sharding of its blocks
  std::vector<float> values;        ///< the global array, row-major (`product(shape)` values)
};

/// @brief Every parameter of `state`'s model, in layer order, gathered to the host (see the file
/// comment). Reads the blocks of this process's devices (copied to the host from device memory);
/// no communication.
/// @throws sharding_error when an element of a parameter is held only by devices of other
/// processes (a train state made with `local_devices` under several processes).
template <class State>
std::vector<param_array> params(const State& state) {
  std::vector<param_array> out;
  std::vector<float> stage;  // a block copied to the host (device memory only)
  out.reserve(state.params.size());
  for (std::size_t i = 0; i < state.params.size(); ++i) {
    const auto& p = state.params[i];
    param_array a{p.name, p.shape, p.sharding, {}};
    std::size_t total = 1;
    for (std::size_t e : p.shape) total *= e;
    a.values.assign(total, 0.0f);
    std::vector<bool> seen(total, false);
    std::size_t filled = 0;
    for (std::size_t dev : state.local_devices()) {
      const float* v = meshlib::host_readable<default_memory_space>(state.master(i, dev), p.count[dev], stage);
      detail::for_each_global_run(p, dev, 0, p.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
        std::copy_n(v + k, n, a.values.begin() + static_cast<std::ptrdiff_t>(g));
        filled += static_cast<std::size_t>(std::count(seen.begin() + static_cast<std::ptrdiff_t>(g),
                                                      seen.begin() + static_cast<std::ptrdiff_t>(g + n), false));
        std::fill_n(seen.begin() + static_cast<std::ptrdiff_t>(g), n, true);
      });
    }
    if (filled != total)
      throw sharding_error("meshlib::nn: params: " + std::to_string(total - filled) + " of the " +
                           std::to_string(total) + " elements of parameter '" + p.name +
                           "' are held only by devices of other processes (this process holds devices " +
                           meshlib::describe_devices(state.local_devices()) +
                           "); read them where every block is (a train state of every device), or save_checkpoint "
                           "and read its global files");
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace meshlib::nn
// end meshlib/nn/params.hpp
// begin meshlib/nn/checkpoint.hpp
/// @file
/// @brief Checkpoints of a `train_state`: `save_checkpoint(dir, state)` and
/// `restore_checkpoint(dir, state)`, restorable on a *different* mesh and with or without ZeRO-1
/// (restore reshards). Layout (as Orbax / torch.distributed.checkpoint keep one file per array):
///
///     dir/meshlib-checkpoint    marks the directory as meshlib's (written first; only its name counts)
///     dir/index                 the current checkpoint, text: format, generation G, step, key,
///                               optimizer, one line per parameter (name, dtype, global shape, the
///                               FNV-1a checksums of its files, sharding), then (only for a
///                               model that has any) one line per buffer, then the checksum of
///                               every byte above it
///     dir/<name>.g<G>.bin       the parameter's (or buffer's) global array, row-major float32,
///                               filled from the blocks of the devices that own them (a
///                               replicated block once)
///     dir/<name>.g<G>.opt<s>.bin  optimizer state slot s (momentum / Adam moments), same shape
///     dir/<name>.g<G>.state.bin   the optimizer's per-parameter state (Adafactor's factored second
///                               moment: `param_state_size` floats, the same on every mesh), when
///                               it keeps any; the index line names its size and checksum
///     dir/pending               while a save runs: the files it creates (its own checksum)
///
/// Why a save is atomic: the index names its generation, and a save never touches the files of
/// the generation the current index names. It writes generation G + 1 beside it (journalled in
/// `pending` first, so what it created is known if it dies), syncs every file, writes `index.tmp`,
/// syncs it, and commits with ONE `rename(index.tmp, index)`, which POSIX makes atomic: a reader
/// sees the old index or the new one, never a mix, and each names a complete set of files. Only
/// then are the old generation's files and the journal removed (a failure there is harmless: the
/// next save removes them). So a save that fails (a write, a sync or the rename: EIO, ENOSPC) or a
/// process killed at any point leaves `dir` restoring the previous checkpoint, or the new one once
/// the rename happened; the next save clears what the dead one left.
///
/// What is never deleted: a save refuses (checkpoint_error, nothing written) a non-empty `dir` that
/// is not meshlib's (no `meshlib-checkpoint` marker and no meshlib `index`), and in its own
/// directory it removes only files it names itself: those of an index it wrote, and those of the
/// journal of a save that did not finish. Files you add to a checkpoint directory stay.
///
/// Buffers: the arrays a layer keeps but does not train, `batch_norm`'s running mean and variance
/// (PyTorch's buffers, flax's `batch_stats` collection), which evaluation uses. The model shows them
/// through `collect_buffers` (`detail::collect_buffers_of`); they are saved and restored as the
/// parameters are (resharded, checksummed), without optimizer state. An index written before buffers
/// were saved, or by a model without any, has no buffer lines: restoring it leaves the model's
/// buffers as they are (the parameters, step and key are restored). A checkpoint whose buffers differ
/// from the model's (names, count, shapes) is refused, naming the buffer and its layer.
///
/// Why every byte is verified: restore reads the index whole and checks its last line, the
/// FNV-1a checksum of everything before it, before believing any field (step, key, optimizer,
/// shapes); FNV-1a changes under any single-byte substitution, so an edited or damaged index is
/// refused rather than restored into a different state. Each data file is checked against its
/// checksum in the index. A missing, truncated or corrupted file, or a checkpoint of another model
/// or optimizer, throws `checkpoint_error` naming the file (and parameter); the state is not
/// modified then. Every failure of a save or restore is a `checkpoint_error` naming the path.
///
/// Several processes (a state that holds only this process's devices, as under `mpirun`): every
/// process writes the blocks its devices own straight into the global files, at their places (no
/// gather: the bytes of a block go to disk once, from the process that holds them); process 0
/// creates the files first and writes the index and commits last. `dir` must be on a file system
/// that every process sees. Restore reads the files on every process and takes its own blocks.
/// Each phase ends with an exchange of outcomes between the processes, so a failure on one of them
/// (a full disk, a missing file) throws `checkpoint_error` on all of them, naming the process,
/// instead of leaving the others waiting or with a different state.
/// @code
/// meshlib::nn::save_checkpoint("ckpt/step_1000", state);        // on a (4, 2) mesh
/// meshlib::nn::restore_checkpoint("ckpt/step_1000", other);     // on (2, 4): same numbers
/// meshlib::nn::save_checkpoint("ckpt/step_1000", part, ex);      // part of a multi-process state
/// @endcode

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib::nn {

/// @brief A checkpoint that cannot be written or read (the message names the file and parameter).
class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {

/// The file operations a save makes, the vocabulary of the fault-injection seam below.
enum class checkpoint_op { make_dir, create, open, write, sync, close, rename, remove };

/// Test seam, off (null) by default: when set, it is called before each file operation of a save
/// with the operation and its path, and a non-zero result is an errno that the operation then
/// fails with, as the operating system would report it (EIO, ENOSPC). It costs one test of a
/// pointer per operation (per file or buffered run, never per element). The tests fail, or kill
/// the process at, each operation of a save in turn (tests/unit/nn/test_checkpoint.cpp).
using checkpoint_fault_hook = int (*)(checkpoint_op, const std::filesystem::path&);
inline checkpoint_fault_hook checkpoint_fault = nullptr;

inline const char* verb_of(checkpoint_op op) noexcept {
  switch (op) {
    case checkpoint_op::make_dir: return "create the directory";
    case checkpoint_op::create: return "create";
    case checkpoint_op::open: return "open";
    case checkpoint_op::write: return "write";
    case checkpoint_op::sync: return "sync (fsync)";
    case checkpoint_op::close: return "close";
    case checkpoint_op::rename: return "rename";
    case checkpoint_op::remove: return "remove";
  }
  return "use";
}

/// The file operations of one save of `dir`: each goes through the seam, and a failure is a
/// `checkpoint_error` naming the file, the system's reason and what `dir` holds then.
class save_io {
 public:
  explicit save_io(std::filesystem::path dir) : dir_(std::move(dir)) {}
  [[nodiscard]] const std::filesystem::path& dir() const noexcept { return dir_; }

  /// Runs `real()` (which returns 0 or an errno) as operation `op` on `path`.
  template <class F>
  void run(checkpoint_op op, const std::filesystem::path& path, F&& real, const std::string& about = {}) const {
    int err = checkpoint_fault != nullptr ? checkpoint_fault(op, path) : 0;
    if (err == 0) err = real();
    if (err != 0) throw failure(op, path, err, about);
  }
  /// As `run`, returning the errno instead of throwing (the clean-up after the commit, where a
  /// failure only leaves a file that the next save removes).
  template <class F>
  int quietly(checkpoint_op op, const std::filesystem::path& path, F&& real) const noexcept {
    int err = checkpoint_fault != nullptr ? checkpoint_fault(op, path) : 0;
    if (err == 0) err = real();
    return err;
  }
  [[nodiscard]] checkpoint_error failure(checkpoint_op op, const std::filesystem::path& path, int err,
                                         const std::string& about = {}) const {
    return checkpoint_error("meshlib::nn: save_checkpoint: cannot " + std::string(verb_of(op)) + " '" + path.string() +
                            "'" + about + ": " + std::generic_category().message(err) +
                            "; nothing was committed: '" + dir_.string() +
                            "' restores what it held before this save (free space or fix the file system, then save "
                            "again)");
  }

  /// `rename(from, to)`: atomic, replacing `to`.
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) const {
    run(checkpoint_op::rename, from, [&] { return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno; },
        " to '" + to.string() + "'");
  }
  /// Syncs directory `d`, so the names created or renamed in it survive a power loss.
  void sync_dir(const std::filesystem::path& d) const {
    run(checkpoint_op::sync, d, [&] { return fsync_dir(d); });
  }
  /// `fsync` of directory `d`: 0 or an errno.
  static int fsync_dir(const std::filesystem::path& d) noexcept {
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    const int r = ::fsync(fd) == 0 ? 0 : errno;
    ::close(fd);
    return r;
  }
  /// Removes file `f`; true when it is gone (also when it was already).
  bool remove_quietly(const std::filesystem::path& f) const noexcept {
    return quietly(checkpoint_op::remove, f, [&] { return ::unlink(f.c_str()) == 0 || errno == ENOENT ? 0 : errno; }) == 0;
  }

 private:
  std::filesystem::path dir_;
};

/// A file of a save open for writing: contiguous writes are gathered into one `pwrite`, and
/// `finish` syncs and closes it, so its bytes are on disk before the index that names it is.
class out_file {
 public:
  /// Opens `path`; `create`: a new file of `size` bytes (zeros), else an existing one.
  out_file(const save_io& io, std::filesystem::path path, bool create, std::size_t size = 0)
      : io_(&io), path_(std::move(path)) {
    io.run(create ? checkpoint_op::create : checkpoint_op::open, path_, [&] {
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0), 0644);
      if (fd_ < 0) return errno;
      return create && ::ftruncate(fd_, static_cast<off_t>(size)) != 0 ? errno : 0;
    });
  }
  out_file(const out_file&) = delete;
  out_file& operator=(const out_file&) = delete;
  out_file(out_file&& o) noexcept
      : io_(o.io_), path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), at_(o.at_), buf_(std::move(o.buf_)) {}
  out_file& operator=(out_file&&) = delete;
  ~out_file() {
    if (fd_ >= 0) ::close(fd_);  // only after a failure: the file is not named by any index
  }

  /// Writes `n` bytes at byte `offset`.
  void write(std::size_t offset, const char* src, std::size_t n) {
    if (!buf_.empty() && (offset != at_ + buf_.size() || buf_.size() + n > (std::size_t{1} << 22))) flush();
    if (buf_.empty()) at_ = offset;
    buf_.insert(buf_.end(), src, src + n);
  }
  /// Writes what is gathered, syncs (unless `sync` is false: a file still to be filled) and closes.
  void finish(bool sync = true) {
    flush();
    if (sync) io_->run(checkpoint_op::sync, path_, [&] { return ::fsync(fd_) == 0 ? 0 : errno; });
    const int fd = std::exchange(fd_, -1);
    io_->run(checkpoint_op::close, path_, [&] { return ::close(fd) == 0 ? 0 : errno; });
  }

 private:
  void flush() {
    if (buf_.empty()) return;
    io_->run(checkpoint_op::write, path_, [&] {
      for (std::size_t done = 0; done < buf_.size();) {
        const ::ssize_t w = ::pwrite(fd_, buf_.data() + done, buf_.size() - done, static_cast<off_t>(at_ + done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return w < 0 ? errno : EIO;
        done += static_cast<std::size_t>(w);
      }
      return 0;
    });
    buf_.clear();
  }

  const save_io* io_;
  std::filesystem::path path_;
  int fd_ = -1;
  std::size_t at_ = 0;
  std::vector<char> buf_;
};

/// Writes a whole small file (the marker, the journal, the index), synced.
inline void write_whole(const save_io& io, const std::filesystem::path& path, std::string_view text) {
  out_file f(io, path, true);
  f.write(0, text.data(), text.size());
  f.finish();
}


/// The last line of a checksummed text file: `checksum <FNV-1a of body, 16 hex digits>`.
inline std::string checksum_line(std::string_view body) {
  char text[40];
  std::snprintf(text, sizeof text, "checksum %016llx\n",
                static_cast<unsigned long long>(meshlib::fnv1a_of(body)));
  return text;
}

/// The body of `text` when its last line is the checksum of everything before it, else nothing.
/// FNV-1a is a bijection of its state for each byte, so any one-byte substitution in the body
/// changes the sum, and one in the last line no longer matches it: every single edit is caught.
inline std::optional<std::string_view> verified_body(std::string_view text) {
  if (text.empty() || text.back() != '\n') return std::nullopt;
  const std::size_t nl = text.size() < 2 ? std::string_view::npos : text.rfind('\n', text.size() - 2);
  const std::size_t start = nl == std::string_view::npos ? 0 : nl + 1;
  const std::string_view body = text.substr(0, start);
  if (text.substr(start) != checksum_line(body)) return std::nullopt;
  return body;
}

/// The whole of a small file, or nothing when it cannot be read.
inline std::optional<std::string> read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return std::nullopt;
  return text;
}

inline constexpr std::string_view index_magic = "meshlib-checkpoint";
inline constexpr std::string_view journal_magic = "meshlib-checkpoint-pending 2\n";
inline constexpr const char* marker_name = "meshlib-checkpoint";

/// The data file of parameter `name` in generation `g`: `name.g<g>.bin`, or `.opt<slot>.bin`.
inline std::string data_file(const std::string& name, std::size_t g, std::size_t slot = std::size_t(-1)) {
  return name + ".g" + std::to_string(g) + (slot == std::size_t(-1) ? "" : ".opt" + std::to_string(slot)) + ".bin";
}

/// The file of parameter `name`'s per-parameter optimizer state in generation `g`.
inline std::string state_file(const std::string& name, std::size_t g) {
  return name + ".g" + std::to_string(g) + ".state.bin";
}

/// A parsed (and verified) index.
struct index_file {
  struct param {
    std::string name, dtype, shape, sharding;
    std::vector<std::uint64_t> sums;  ///< the value's, then each optimizer slot's
    std::size_t state_size = 0;       ///< floats of per-parameter optimizer state (0: none)
    std::uint64_t state_sum = 0;      ///< their file's checksum
  };
  std::size_t generation = 0, step = 0, slots = 0;
  std::uint64_t key = 0;
  std::string optimizer;
  std::vector<param> params;
  std::vector<param> buffers;  ///< no optimizer slots: `sums` holds the value's only

  /// Every data file it names.
  [[nodiscard]] std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& p : params) {
      out.push_back(data_file(p.name, generation));
      for (std::size_t s = 0; s < slots; ++s) out.push_back(data_file(p.name, generation, s));
      if (p.state_size != 0) out.push_back(state_file(p.name, generation));
    }
    for (const auto& b : buffers) out.push_back(data_file(b.name, generation));
    return out;
  }
};

/// Parses index `text` read from `path`; throws `checkpoint_error` (from `fn`) saying what is wrong.
inline index_file parse_index(const std::filesystem::path& path, std::string_view text, const char* fn) {
  auto bad = [&](const std::string& what) {
    return checkpoint_error(std::string("meshlib::nn: ") + fn + ": '" + path.string() + "': " + what);
  };
  const std::string_view first = text.substr(0, text.find('\n'));
  if (first.substr(0, index_magic.size() + 1) != std::string(index_magic) + " ")
    throw bad("not a meshlib checkpoint index (its first line is not 'meshlib-checkpoint <format>')");
  if (first != std::string(index_magic) + " 2")
    throw bad("format '" + std::string(first.substr(index_magic.size() + 1)) +
              "', but this meshlib reads format 2 (format 1, before every byte of the index was checksummed, is no "
              "longer read: restore it with the meshlib that wrote it and save it again)");
  const auto body = verified_body(text);
  if (!body)
    throw bad("the index does not match its checksum (its last line): it was edited, damaged or cut short, so "
              "none of its fields (step, key, shapes) can be trusted");
  std::istringstream in{std::string(*body)};
  index_file idx;
  std::string word, version, slots_word;
  std::size_t count = 0;
  // The checksum held, so these are the bytes save_checkpoint wrote; the checks are for its bugs.
  if (!(in >> word >> version) || !(in >> word >> idx.generation) || word != "generation" ||
      !(in >> word >> idx.step) || word != "step" || !(in >> word >> idx.key) || word != "key" ||
      !(in >> word >> idx.optimizer >> slots_word >> idx.slots) || word != "optimizer" || slots_word != "slots" ||
      !(in >> word >> count) || word != "parameters")
    throw bad("malformed header");
  for (std::size_t i = 0; i < count; ++i) {
    index_file::param p;
    if (!(in >> word >> p.name >> p.dtype >> p.shape) || word != "param")
      throw bad("malformed line for parameter " + std::to_string(i));
    p.sums.resize(1 + idx.slots);
    for (auto& s : p.sums)
      if (!(in >> s)) throw bad("missing checksum of parameter '" + p.name + "'");
    if (!(in >> word)) throw bad("malformed line for parameter '" + p.name + "'");
    if (word == "state" && !(in >> p.state_size >> p.state_sum >> word))
      throw bad("malformed optimizer state of parameter '" + p.name + "'");
    if (word != "sharding") throw bad("malformed line for parameter '" + p.name + "'");
    std::getline(in, p.sharding);
    idx.params.push_back(std::move(p));
  }
  // Buffers (running statistics): a section only a model that has some writes.
  if (in >> word) {
    if (word != "buffers" || !(in >> count)) throw bad("malformed line after the parameters");
    for (std::size_t i = 0; i < count; ++i) {
      index_file::param b;
      b.sums.resize(1);
      if (!(in >> word >> b.name >> b.dtype >> b.shape >> b.sums[0]) || word != "buffer")
        throw bad("malformed line for buffer " + std::to_string(i));
      if (!(in >> word) || word != "sharding") throw bad("malformed line for buffer '" + b.name + "'");
      std::getline(in, b.sharding);
      idx.buffers.push_back(std::move(b));
    }
  }
  return idx;
}

/// The index of `dir` when it is a verified one of this format.
inline std::optional<index_file> try_index(const std::filesystem::path& dir) {
  const auto text = read_text(dir / "index");
  if (!text) return std::nullopt;
  try {
    return parse_index(dir / "index", *text, "save_checkpoint");
  } catch (const checkpoint_error&) {
    return std::nullopt;
  }
}

/// The journal of a save: its generation, the files it creates (`fresh`) and the previous
/// generation's files it removes once committed (`stale`).
struct save_journal {
  std::size_t generation = 0;
  std::vector<std::string> fresh, stale;

  [[nodiscard]] std::string text() const {
    std::string t(journal_magic);
    t += "generation " + std::to_string(generation) + "\n";
    for (const auto& f : fresh) t += "new " + f + "\n";
    for (const auto& f : stale) t += "old " + f + "\n";
    return t + checksum_line(t);
  }
  static std::optional<save_journal> read(const std::filesystem::path& path) {
    const auto text = read_text(path);
    if (!text || text->compare(0, journal_magic.size(), journal_magic) != 0) return std::nullopt;
    const auto body = verified_body(*text);
    if (!body) return std::nullopt;  // cut short while written: it had created nothing yet
    std::istringstream in{std::string(body->substr(journal_magic.size()))};
    save_journal j;
    std::string word, name;
    if (!(in >> word >> j.generation) || word != "generation") return std::nullopt;
    while (in >> word >> name) (word == "new" ? j.fresh : j.stale).push_back(name);
    return j;
  }
};

/// The generation a damaged index names (its second line), so a save does not reuse its files.
inline std::size_t generation_named(const std::filesystem::path& index) {
  const auto text = read_text(index);
  if (!text) return 0;
  std::istringstream in(*text);
  std::string line, word;
  std::size_t g = 0;
  std::getline(in, line);
  return (in >> word >> g) && word == "generation" ? g : 0;
}

/// Whether `dir` is meshlib's to write into: new or empty, marked, or holding a meshlib index.
inline bool is_meshlib_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::is_empty(dir, ec) && !ec) return true;
  if (std::filesystem::is_regular_file(dir / marker_name, ec)) return true;
  const auto text = read_text(dir / "index");
  return text && text->compare(0, index_magic.size() + 1, std::string(index_magic) + " ") == 0;
}

inline std::string shape_text(const std::vector<std::size_t>& s) {
  std::string t;
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? "x" : "") + std::to_string(s[i]);
  return t.empty() ? "scalar" : t;
}

inline std::size_t product(const std::vector<std::size_t>& s) {
  std::size_t n = 1;
  for (auto e : s) n *= e;
  return n;
}

/// The FNV-1a checksum of a whole file (process 0 reads back what every process wrote).
inline std::uint64_t checksum_of(const std::filesystem::path& path, std::size_t count) {
  std::vector<char> data(count * sizeof(float));
  std::ifstream in(path, std::ios::binary);
  in.read(data.data(), static_cast<std::streamsize>(data.size()));
  if (!in) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot read back '" + path.string() + "'");
  return meshlib::fnv1a_of({data.data(), data.size()});
}

/// Runs `phase` on this process, then agrees with the others on the outcome: when any process
/// failed, every process throws (the failing one its own error, the others a `checkpoint_error`
/// naming the first failing process and its message), so no process goes on alone.
template <class F>
void agreed_phase(distributed::process_exchange& ex, const char* what, F&& phase) {
  std::exception_ptr mine;
  std::string text;
  try {
    phase();
  } catch (const std::exception& e) {
    mine = std::current_exception();
    text = e.what();
  } catch (...) {
    mine = std::current_exception();
  }
  if (mine && text.empty()) text = "unknown exception";
  if (ex.size() == 1) {
    if (mine) std::rethrow_exception(mine);
    return;
  }
  const auto all = ex.all_gather(text);
  if (mine) std::rethrow_exception(mine);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty())
      throw checkpoint_error(std::string("meshlib::nn: ") + what + ": process " + std::to_string(r) + " of " +
                             std::to_string(all.size()) + " failed: " + all[r]);
}

/// The exchange a state's checkpoint runs over: none for a state that holds every device; for a
/// partial one, `ex`, which must cover every device exactly once with its processes' devices.
template <class State>
distributed::process_exchange& exchange_for(const State& state, distributed::process_exchange* ex, const char* what) {
  static distributed::single_process_exchange single;
  const std::size_t n = state.mesh.size();
  if (state.local_devices().size() == n) return single;
  if (ex == nullptr || ex->size() == 1)
    throw checkpoint_error(std::string("meshlib::nn: ") + what + ": this train state holds " +
                           std::to_string(state.local_devices().size()) + " of the mesh's " + std::to_string(n) +
                           " devices, so the other processes take part: pass their process_exchange "
                           "(meshlib::mpi::exchange) or call distributed::initialize with one");
  std::string mine;
  for (std::size_t dev : state.local_devices()) mine += std::to_string(dev) + " ";
  std::vector<int> held(n, 0);
  for (const auto& devices : ex->all_gather(mine)) {
    std::istringstream in(devices);
    for (std::size_t d = 0; in >> d;)
      if (d < n) ++held[d];
  }
  for (std::size_t d = 0; d < n; ++d)
    if (held[d] != 1)
      throw checkpoint_error(std::string("meshlib::nn: ") + what + ": device " + std::to_string(d) + " is held by " +
                             std::to_string(held[d]) + " of the " + std::to_string(ex->size()) +
                             " processes; each device must belong to exactly one");
  return *ex;
}

/// Reads `path` (expected `count` floats with checksum `sum`) for parameter `param`.
inline std::vector<float> read_file(const std::filesystem::path& path, std::size_t count, std::uint64_t sum,
                                    const std::string& param, const char* kind = "parameter") {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec)
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (" + std::string(kind) + " '" + param +
                           "') is missing");
  if (size != count * sizeof(float))
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (" + std::string(kind) + " '" + param + "') has " +
                           std::to_string(size) + " bytes, expected " + std::to_string(count * sizeof(float)) +
                           " (" + std::to_string(count) + " float32): truncated or not this checkpoint's file");
  std::vector<float> data(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(size));
  if (!in) throw checkpoint_error("meshlib::nn: restore_checkpoint: cannot read '" + path.string() + "'");
  if (meshlib::fnv1a_of({reinterpret_cast<const char*>(data.data()), size}) != sum)
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (" + std::string(kind) + " '" + param +
                           "') does not match its checksum in the index: the file is corrupted");
  return data;
}

/// The buffers of `state`'s model (running statistics; none for most models), in layer order.
template <class State>
auto model_buffers(State& state) {
  std::remove_cvref_t<decltype(state.params)> out;
  collect_buffers_of(state.model, out);
  return out;
}

/// The layer a parameter or buffer belongs to: its name up to the last dot (`"b1.bn2"` for
/// `"b1.bn2.running_mean"`).
inline std::string layer_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

/// Throws unless the model's buffers (names, count, shapes) are the ones checkpoint `idx` holds;
/// `bad` makes the error (it prefixes the index's path).
template <class Ref, class Bad>
void check_buffers(const index_file& idx, const std::vector<Ref>& buffers, Bad&& bad) {
  const auto of = [](const std::string& n) { return "'" + n + "' (running statistics of layer '" + layer_of(n) + "')"; };
  const std::string other = ": a checkpoint of another model; restore into the model it was saved from";
  for (std::size_t i = 0; i < std::max(idx.buffers.size(), buffers.size()); ++i) {
    if (i >= buffers.size())
      throw bad("holds the buffer " + of(idx.buffers[i].name) + ", which the model does not have" + other);
    if (i >= idx.buffers.size())
      throw bad("holds " + std::to_string(idx.buffers.size()) + " buffers and not the model's buffer " +
                of(buffers[i].name) + other);
    const auto& saved = idx.buffers[i];
    const auto& b = buffers[i];
    if (saved.name != b.name)
      throw bad("buffer " + std::to_string(i) + " is " + of(saved.name) + ", the model's is " + of(b.name) + other);
    if (saved.dtype != "float32") throw bad("buffer '" + saved.name + "' has dtype " + saved.dtype + ", expected float32");
    if (saved.shape != shape_text(b.shape))
      throw bad("buffer " + of(saved.name) + " has shape " + saved.shape + " in the checkpoint, the model's is " +
                shape_text(b.shape) + ": declare layer '" + layer_of(b.name) + "' with the size it was saved with");
  }
}

/// Throws unless `name` can be a file name in the checkpoint (and a word of the index).
inline void check_param_name(const std::string& name) {
  const bool ok = !name.empty() && name != "." && name != ".." &&
                  name.find_first_of("/\\ \t\r\n") == std::string::npos;
  if (!ok)
    throw checkpoint_error("meshlib::nn: save_checkpoint: parameter name '" + name +
                           "' cannot name a checkpoint file: give the layer a name without spaces or slashes");
}

}  // namespace detail

/// @brief Writes `state` (parameters, optimizer state, step, key) to directory `dir` (see the file
/// comment: atomic, and never deleting a file meshlib did not write). A state that holds only this
/// process's devices needs every process to call this with the same `dir`; `ex` connects them
/// (ignored for a state that holds every device).
/// @throws checkpoint_error when `dir` is a non-empty directory that is not a meshlib checkpoint
/// (nothing is written), or when a file cannot be written, synced or renamed, on this or (for a
/// multi-process state) any other process; `dir` then restores what it held before the save.
template <class State>
void save_checkpoint(const std::filesystem::path& dir, State& state, distributed::process_exchange& ex_) {
  namespace fs = std::filesystem;
  auto& ex = detail::exchange_for(state, &ex_, "save_checkpoint");
  const bool first = ex.rank() == 0;
  const detail::save_io io(dir);
  const std::size_t slots = state.opt.slots();
  const auto buffers = detail::model_buffers(state);
  std::size_t generation = 0;
  detail::save_journal journal;
  const auto value_file = [&](const param_ref<float>& p) { return dir / detail::data_file(p.name, generation); };
  const auto opt_file = [&](const param_ref<float>& p, std::size_t s) {
    return dir / detail::data_file(p.name, generation, s);
  };
  const auto state_file = [&](const param_ref<float>& p) { return dir / detail::state_file(p.name, generation); };
  // 1. Process 0: claim the directory (refusing one that is not meshlib's), clear what a save that
  // did not finish left, journal this save, create its files at their final sizes.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    if (!first) return;
    for (const auto& p : state.params) detail::check_param_name(p.name);
    for (const auto& b : buffers) {
      detail::check_param_name(b.name);
      for (const auto& p : state.params)
        if (p.name == b.name)
          throw checkpoint_error("meshlib::nn: save_checkpoint: the buffer '" + b.name + "' of layer '" +
                                 detail::layer_of(b.name) + "' has the name of a parameter, so both would be one file; "
                                 "give the layers distinct names");
    }
    std::error_code ec;
    const auto status = fs::status(dir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory)
      throw checkpoint_error("meshlib::nn: save_checkpoint: cannot inspect '" + dir.string() + "': " + ec.message());
    if (!fs::exists(status)) {
      io.run(detail::checkpoint_op::make_dir, dir, [&] {
        std::error_code e;
        fs::create_directories(dir, e);
        return e.value();
      });
    } else if (!fs::is_directory(status)) {
      throw checkpoint_error("meshlib::nn: save_checkpoint: '" + dir.string() +
                             "' exists and is not a directory; pass the path of a new or empty directory, or of a "
                             "checkpoint");
    } else if (!detail::is_meshlib_dir(dir)) {
      throw checkpoint_error("meshlib::nn: save_checkpoint: '" + dir.string() +
                             "' is a non-empty directory that is not a meshlib checkpoint (it has neither a '" +
                             detail::marker_name + "' nor a meshlib 'index' file); nothing was written or deleted: "
                             "pass a new or empty directory, e.g. '" + (dir / "checkpoint").string() + "'");
    }
    if (!fs::exists(dir / detail::marker_name, ec))
      detail::write_whole(io, dir / detail::marker_name,
                          "This directory holds a meshlib checkpoint (see 'index'). meshlib removes only the files it "
                          "wrote here.\n");
    const auto previous = detail::try_index(dir);
    const bool has_index = fs::exists(dir / "index", ec);
    std::vector<std::string> current;
    if (previous) current = previous->files();
    const auto is_current = [&](const std::string& f) { return std::find(current.begin(), current.end(), f) != current.end(); };
    const auto unfinished = detail::save_journal::read(dir / "pending");
    std::vector<std::string> left;  // files of the unfinished save that could not be removed now
    if (unfinished && (previous || !has_index)) {
      // Committed (the index names its generation): its clean-up did not finish; else its files
      // were never named by an index. A damaged index leaves both alone: they may be its files.
      const bool committed = previous && unfinished->generation == previous->generation;
      for (const auto& f : committed ? unfinished->stale : unfinished->fresh)
        if (!is_current(f) && !io.remove_quietly(dir / f)) left.push_back(f);
    }
    generation = std::max({previous ? previous->generation : std::size_t{0},
                           unfinished ? unfinished->generation : std::size_t{0},
                           has_index && !previous ? detail::generation_named(dir / "index") : std::size_t{0}}) + 1;
    journal.generation = generation;
    for (const auto& p : state.params) {
      journal.fresh.push_back(detail::data_file(p.name, generation));
      for (std::size_t s = 0; s < slots; ++s) journal.fresh.push_back(detail::data_file(p.name, generation, s));
      if (state.param_state_size(static_cast<std::size_t>(&p - state.params.data())) != 0)
        journal.fresh.push_back(detail::state_file(p.name, generation));
    }
    for (const auto& b : buffers) journal.fresh.push_back(detail::data_file(b.name, generation));
    journal.stale = current;  // and what could not be removed yet: this journal keeps track of it
    journal.stale.insert(journal.stale.end(), left.begin(), left.end());
    detail::write_whole(io, dir / "pending", journal.text());
    io.sync_dir(dir);  // the journal is on disk before any file it lists exists
    for (const auto& p : state.params) {
      const std::size_t bytes = detail::product(p.shape) * sizeof(float);
      detail::out_file(io, value_file(p), true, bytes).finish(false);
      for (std::size_t s = 0; s < slots; ++s) detail::out_file(io, opt_file(p, s), true, bytes).finish(false);
      if (const std::size_t n = state.param_state_size(static_cast<std::size_t>(&p - state.params.data())))
        detail::out_file(io, state_file(p), true, n * sizeof(float)).finish(false);
    }
    for (const auto& b : buffers)
      detail::out_file(io, value_file(b), true, detail::product(b.shape) * sizeof(float)).finish(false);
  });
  if (ex.size() > 1) generation = std::stoull(ex.all_gather(first ? std::to_string(generation) : "")[0]);
  // 2. Every process: the blocks its devices own, at their places, synced. A block replicated over
  // a group of devices is written by the group's first device only, so every element is written once.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    const auto put = [](detail::out_file& f, std::size_t at, const float* src, std::size_t n) {
      f.write(at * sizeof(float), reinterpret_cast<const char*>(src), n * sizeof(float));
    };
    std::vector<float> stage;  // a block copied to the host (device memory only)
    using space = default_memory_space;
    for (std::size_t i = 0; i < state.params.size(); ++i) {
      const auto& p = state.params[i];
      detail::out_file out(io, value_file(p), false);
      for (std::size_t dev : state.local_devices())
        if (state.mesh.group_rank(dev, state.mesh.all_axes & ~p.sharded_axes) == 0) {
          const float* v = meshlib::host_readable<space>(state.master(i, dev), p.count[dev], stage);
          detail::for_each_global_run(p, dev, 0, p.count[dev],
                                      [&](std::size_t k, std::size_t g, std::size_t n) { put(out, g, v + k, n); });
        }
      out.finish();
    }
    for (const auto& b : buffers) {  // as the parameters' values
      detail::out_file out(io, value_file(b), false);
      for (std::size_t dev : state.local_devices())
        if (state.mesh.group_rank(dev, state.mesh.all_axes & ~b.sharded_axes) == 0) {
          const float* v = meshlib::host_readable<space>(b.value[dev], b.count[dev], stage);
          detail::for_each_global_run(b, dev, 0, b.count[dev],
                                      [&](std::size_t k, std::size_t g, std::size_t n) { put(out, g, v + k, n); });
        }
      out.finish();
    }
    std::vector<detail::out_file> opt;
    opt.reserve(state.params.size() * slots);
    for (const auto& p : state.params)
      for (std::size_t s = 0; s < slots; ++s) opt.emplace_back(io, opt_file(p, s), false);
    for (std::size_t dev : state.local_devices())
      state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, std::span<float* const> slot) {
        const auto& p = state.params[i];
        if (!state.owns_state(dev, p)) return;
        for (std::size_t s = 0; s < slots; ++s) {
          const float* v = meshlib::host_readable<space>(slot[s], len, stage);
          detail::for_each_global_run(p, dev, off, len, [&](std::size_t k, std::size_t g, std::size_t n) {
            put(opt[i * slots + s], g, v + (k - off), n);
          });
        }
      });
    for (auto& o : opt) o.finish();
    // Per-parameter state is alike on every device holding a block of the parameter: the device
    // of its first block writes it (every process that has one writes the same bytes).
    for (std::size_t i = 0; i < state.params.size(); ++i) {
      const auto& p = state.params[i];
      const std::size_t n = state.param_state_size(i);
      if (n == 0) continue;
      for (std::size_t dev : state.local_devices()) {
        const auto offset = p.layout->offset(dev);
        if (state.param_state(i, dev) == nullptr ||
            std::any_of(offset.begin(), offset.end(), [](std::size_t o) { return o != 0; }))
          continue;
        detail::out_file out(io, state_file(p), false);
        put(out, 0, meshlib::host_readable<space>(state.param_state(i, dev), n, stage), n);
        out.finish();
        break;
      }
    }
  });
  // 3. Process 0: the index (with the checksums of what every process wrote) as `index.tmp`, then
  // the commit, one atomic rename over `index`; then the previous generation's files go.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    if (!first) return;
    std::ostringstream index;
    index << detail::index_magic << " 2\ngeneration " << generation << "\nstep " << state.step << "\nkey "
          << state.key.value << "\noptimizer " << state.opt.kind() << " slots " << slots << "\nparameters "
          << state.params.size() << "\n";
    for (const auto& p : state.params) {
      const std::size_t count = detail::product(p.shape);
      index << "param " << p.name << " float32 " << detail::shape_text(p.shape) << " "
            << detail::checksum_of(value_file(p), count);
      for (std::size_t s = 0; s < slots; ++s) index << " " << detail::checksum_of(opt_file(p, s), count);
      if (const std::size_t n = state.param_state_size(static_cast<std::size_t>(&p - state.params.data())))
        index << " state " << n << " " << detail::checksum_of(state_file(p), n);
      index << " sharding " << p.sharding << "\n";
    }
    if (!buffers.empty()) index << "buffers " << buffers.size() << "\n";
    for (const auto& b : buffers)
      index << "buffer " << b.name << " float32 " << detail::shape_text(b.shape) << " "
            << detail::checksum_of(value_file(b), detail::product(b.shape)) << " sharding " << b.sharding << "\n";
    std::string text = index.str();
    text += detail::checksum_line(text);
    detail::write_whole(io, dir / "index.tmp", text);
    io.rename(dir / "index.tmp", dir / "index");  // the commit
    if (const int err = io.quietly(detail::checkpoint_op::sync, dir, [&] { return detail::save_io::fsync_dir(dir); }))
      throw checkpoint_error("meshlib::nn: save_checkpoint: cannot sync (fsync) the directory '" + dir.string() +
                             "' after committing: " + std::generic_category().message(err) +
                             "; the new checkpoint is in place and restores, but may not survive a power loss: check "
                             "the file system");
    // The journal goes last, and only when every stale file went: else the next save finishes this.
    bool all_removed = true;
    for (const auto& f : journal.stale)
      if (std::find(journal.fresh.begin(), journal.fresh.end(), f) == journal.fresh.end())
        all_removed = io.remove_quietly(dir / f) && all_removed;
    if (all_removed) io.remove_quietly(dir / "pending");
  });
}

/// @brief `save_checkpoint` over the transport given to `distributed::initialize` (none needed for
/// a state that holds every device).
template <class State>
void save_checkpoint(const std::filesystem::path& dir, State& state) {
  const auto ex = distributed::exchange();
  save_checkpoint(dir, state, *ex);
}

/// @brief Loads a checkpoint into `state`, whatever mesh, ZeRO setting or number of processes it
/// was saved with. A state that holds only this process's devices needs every process to call
/// this; `ex` connects them (ignored for a state that holds every device).
/// @throws checkpoint_error (the state is unchanged, on every process) for a missing, truncated,
/// edited or corrupted file (every byte of the index and of the data files is checksummed), or a
/// checkpoint of another model (parameter or buffer names or shapes) or optimizer. A checkpoint
/// without buffers (see the file comment) leaves the model's running statistics as they are.
template <class State>
void restore_checkpoint(const std::filesystem::path& dir, State& state, distributed::process_exchange& ex_) {
  auto& ex = detail::exchange_for(state, &ex_, "restore_checkpoint");
  const std::size_t count = state.params.size(), slots = state.opt.slots();
  std::vector<std::vector<float>> values(count), opt(count * slots), param_state(count);
  const auto buffers = detail::model_buffers(state);
  std::vector<std::vector<float>> buffer_values;  // empty: the checkpoint has none (left as they are)
  std::size_t step = 0;
  std::uint64_t key = 0;
  detail::agreed_phase(ex, "restore_checkpoint", [&] {
    const auto index_path = dir / "index";
    const auto text = detail::read_text(index_path);
    if (!text) {
      std::error_code ec;
      if (std::filesystem::exists(dir / detail::marker_name, ec))
        throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + dir.string() +
                               "' holds no complete checkpoint: '" + index_path.string() +
                               "' is missing (the first save into it did not finish)");
      throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "' is missing: not a checkpoint");
    }
    const auto idx = detail::parse_index(index_path, *text, "restore_checkpoint");
    auto bad = [&](const std::string& what) {
      return checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "': " + what);
    };
    if (idx.optimizer != state.opt.kind() || idx.slots != slots)
      throw bad("saved with optimizer " + idx.optimizer + " (" + std::to_string(idx.slots) +
                " state slots), but the train state's optimizer is " + state.opt.name() +
                ": restore into a train state made with the optimizer it was saved with");
    if (idx.params.size() != count)
      throw bad("holds " + std::to_string(idx.params.size()) + " parameters, the model has " + std::to_string(count) +
                ": a checkpoint of another model");
    for (std::size_t i = 0; i < count; ++i) {
      const auto& p = state.params[i];
      const auto& saved = idx.params[i];
      if (saved.name != p.name)
        throw bad("parameter " + std::to_string(i) + " is '" + saved.name + "', the model's is '" + p.name +
                  "': a checkpoint of another model");
      if (saved.dtype != "float32")
        throw bad("parameter '" + saved.name + "' has dtype " + saved.dtype + ", expected float32");
      if (saved.shape != detail::shape_text(p.shape))
        throw bad("parameter '" + saved.name + "' has shape " + saved.shape + " in the checkpoint, the model's is " +
                  detail::shape_text(p.shape) + ": a checkpoint of another model");
      const std::size_t n = detail::product(p.shape);
      values[i] = detail::read_file(dir / detail::data_file(p.name, idx.generation), n, saved.sums[0], p.name);
      for (std::size_t s = 0; s < slots; ++s)
        opt[i * slots + s] =
            detail::read_file(dir / detail::data_file(p.name, idx.generation, s), n, saved.sums[1 + s], p.name);
      const std::size_t kept = state.param_state_size(i);
      if (saved.state_size != kept)
        throw bad("parameter '" + saved.name + "' has " + std::to_string(saved.state_size) +
                  " floats of per-parameter optimizer state in the checkpoint, the train state's optimizer " +
                  state.opt.name() + " keeps " + std::to_string(kept) +
                  " (factored or not, min_dim_size_to_factor): restore with the optimizer options it was saved with");
      if (kept != 0)
        param_state[i] =
            detail::read_file(dir / detail::state_file(p.name, idx.generation), kept, saved.state_sum, p.name);
    }
    if (!idx.buffers.empty()) {
      detail::check_buffers(idx, buffers, bad);
      for (std::size_t i = 0; i < buffers.size(); ++i)
        buffer_values.push_back(detail::read_file(dir / detail::data_file(buffers[i].name, idx.generation),
                                                  detail::product(buffers[i].shape), idx.buffers[i].sums[0],
                                                  buffers[i].name, "buffer"));
    }
    step = idx.step;
    key = idx.key;
  });
  // Everything checked, on every process: scatter into this mesh's blocks (the reshard).
  // Blocks in device memory are edited in a host copy (`edit_on_host`), in host memory in place.
  using space = default_memory_space;
  std::vector<float> stage;
  for (std::size_t i = 0; i < count; ++i) {
    const auto& p = state.params[i];
    for (std::size_t dev : state.local_devices())
      meshlib::edit_on_host<space>(state.master(i, dev), p.count[dev], stage, [&](float* v) {
        detail::for_each_global_run(p, dev, 0, p.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
          std::copy_n(values[i].data() + g, n, v + k);
        });
      });
  }
  for (std::size_t i = 0; i < buffer_values.size(); ++i) {
    const auto& b = buffers[i];
    for (std::size_t dev : state.local_devices())
      meshlib::edit_on_host<space>(b.value[dev], b.count[dev], stage, [&](float* v) {
        detail::for_each_global_run(b, dev, 0, b.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
          std::copy_n(buffer_values[i].data() + g, n, v + k);
        });
      });
  }
  state.refresh_compute_copies();  // a mixed-precision state rounds its restored float masters
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, std::span<float* const> slot) {
      const auto& p = state.params[i];
      for (std::size_t s = 0; s < slots; ++s)
        meshlib::edit_on_host<space>(slot[s], len, stage, [&](float* v) {
          detail::for_each_global_run(p, dev, off, len, [&](std::size_t k, std::size_t g, std::size_t n) {
            std::copy_n(opt[i * slots + s].data() + g, n, v + (k - off));
          });
        });
    });
  for (std::size_t i = 0; i < count; ++i)
    if (!param_state[i].empty())
      for (std::size_t dev : state.local_devices())
        if (float* v = state.param_state(i, dev))
          meshlib::edit_on_host<space>(v, param_state[i].size(), stage,
                                       [&](float* h) { std::copy(param_state[i].begin(), param_state[i].end(), h); });
  state.step = step;
  state.key = rng_key{key};
}

/// @brief `restore_checkpoint` over the transport given to `distributed::initialize` (none needed
/// for a state that holds every device).
template <class State>
void restore_checkpoint(const std::filesystem::path& dir, State& state) {
  const auto ex = distributed::exchange();
  restore_checkpoint(dir, state, *ex);
}

}  // namespace meshlib::nn
// end meshlib/nn/checkpoint.hpp
// end meshlib/nn.hpp
#endif  // MESHLIB_SINGLE_INCLUDE_MESHLIB_NN_HPP
