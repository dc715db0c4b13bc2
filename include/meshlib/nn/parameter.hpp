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
#include <vector>

#include "meshlib/core/mesh.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/nn/random.hpp"
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
constexpr std::uint64_t name_id(std::string_view name) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}
}  // namespace detail

/// @brief The untyped view of one parameter (see the file comment). Per-device entries are indexed
/// by device id; `value[d] == nullptr` where device `d` is not local to this process.
template <class T = float>
struct param_ref {
  /// The parameter's name, such as `"layer1.w"`.
  std::string name;
  std::vector<std::size_t> shape;      ///< global shape
  std::string sharding;                ///< printed named_sharding
  std::vector<axis_mask> dims;         ///< per dimension, the axes it is sharded over
  axis_mask sharded_axes = 0;          ///< axes the parameter is split over (replicated over the rest)
  bool decay = true;                   ///< whether AdamW's weight decay applies (weights, not biases/norms)
  /// per device: the value and gradient blocks, or nullptr where the device is not local.
  std::vector<T*> value, grad;         ///< per device: the block, or nullptr
  std::vector<std::size_t> count;      ///< per device: elements in the block
  /// per device: where the block lies in the global array (offset) and its size (extent).
  std::vector<std::vector<std::size_t>> offset, extent;  ///< per device: where the block lies
  /// Per device, indexed by device id: set to 1 by `train_step` instead of zeroing the gradient
  /// block; the layer's next backward then writes the block (`beta = 0`) instead of adding to it
  /// (see `parameter::grad_beta`). nullptr for a parameter whose layer always adds: `train_step`
  /// zeroes those.
  std::uint8_t* overwrite = nullptr;
};

namespace detail {
/// Global row-major index of element `i` of device `dev`'s block of `p`.
template <class T>
std::size_t global_index(const param_ref<T>& p, std::size_t dev, std::size_t i) {
  std::size_t flat = 0, rem = i;
  const std::size_t rank = p.shape.size();
  std::vector<std::size_t> idx(rank);
  for (std::size_t d = rank; d-- > 0;) {
    idx[d] = rem % p.extent[dev][d] + p.offset[dev][d];
    rem /= p.extent[dev][d];
  }
  for (std::size_t d = 0; d < rank; ++d) flat = flat * p.shape[d] + idx[d];
  return flat;
}

/// Calls `f(k, g, n)` for the runs of elements `[first, first + len)` of device `dev`'s block of
/// `p` that are contiguous in the global row-major array: block elements `k .. k + n` are global
/// elements `g .. g + n` (a run never crosses a row of the block's last dimension).
template <class T, class F>
void for_each_global_run(const param_ref<T>& p, std::size_t dev, std::size_t first, std::size_t len, F&& f) {
  const std::size_t row = p.shape.empty() ? len : p.extent[dev].back();
  for (std::size_t k = first, end = first + len; k < end;) {
    const std::size_t n = std::min(row - k % row, end - k);
    f(k, global_index(p, dev, k), n);
    k += n;
  }
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

  /// The untyped view (see `param_ref`); `overwrites`: the layer writes the gradient with `grad_beta`.
  [[nodiscard]] param_ref<T> ref(bool overwrites = false) const {
    param_ref<T> r;
    r.name = name;
    r.shape.assign(value.global_shape().begin(), value.global_shape().end());
    r.sharding = value.sharding().to_string();
    for (std::size_t d = 0; d < Rank; ++d) r.dims.push_back(S::dim_mask(d));
    r.sharded_axes = S::sharded_axes;
    r.decay = decay;
    r.overwrite = overwrites ? overwrite_.get() : nullptr;
    const std::size_t n = value.num_devices();
    r.value.assign(n, nullptr);
    r.grad.assign(n, nullptr);
    r.count.assign(n, 0);
    r.offset.resize(n);
    r.extent.resize(n);
    for (std::size_t dev : value.local_devices()) {
      r.value[dev] = value.local(dev).data();
      r.grad[dev] = grad.local(dev).data();
      r.count[dev] = value.local(dev).size();
      const auto b = value.block_of(dev);
      r.offset[dev].assign(b.offset.begin(), b.offset.end());
      r.extent[dev].assign(b.extent.begin(), b.extent.end());
    }
    return r;
  }

 private:
  // Per device; shared by copies (a layer is moved into its model after the state took its refs).
  std::shared_ptr<std::uint8_t[]> overwrite_;
};

}  // namespace meshlib::nn
