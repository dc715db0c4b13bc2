// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `sharded_tensor`: one logical array of a global shape laid out over a mesh, each device
/// holding its block in a `Kokkos::View` (row-major), as a `jax.Array` with a `NamedSharding`.
///
/// Blocks are indexed by device id. A process holds the blocks of its *local* devices only: with
/// the thread communicator that is every device; with one process per rank (MPI) it is that rank's
/// devices, and the other entries stay empty. Operations that need another device's block
/// (`to_host`) throw `sharding_error` when it is not local.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">> s{mesh_t{2, 2}};
/// std::vector<float> host(8 * 6);                       // row-major 8 x 6
/// auto x = meshlib::from_host(s, std::array<std::size_t, 2>{8, 6}, std::span<const float>(host));
/// x.local(3);        // device 3's 4 x 3 block, a Kokkos::View
/// x.block_of(3);     // its offsets and extents: [4:8, 3:6]
/// auto back = x.to_host();                              // == host
/// @endcode

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <functional>
#include <numeric>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

/// Calls `f(local_index, global_index)` for every element of block `b`, row-major.
template <std::size_t Rank, class F>
void for_each_in_block(const block<Rank>& b, F&& f) {
  if (b.size() == 0) return;
  std::array<std::size_t, Rank> g = b.offset;
  const std::size_t n = b.size();
  for (std::size_t i = 0; i < n; ++i) {
    f(i, static_cast<const std::array<std::size_t, Rank>&>(g));
    for (std::size_t d = Rank; d-- > 0;) {
      if (++g[d] < b.offset[d] + b.extent[d]) break;
      g[d] = b.offset[d];
    }
  }
}

/// Row-major flat index of `g` in an array of `shape`.
template <std::size_t Rank>
constexpr std::size_t flat_index(const std::array<std::size_t, Rank>& shape, const std::array<std::size_t, Rank>& g) {
  std::size_t k = 0;
  for (std::size_t d = 0; d < Rank; ++d) k = k * shape[d] + g[d];
  return k;
}

template <std::size_t Rank>
std::size_t shape_size(const std::array<std::size_t, Rank>& s) {
  return experimental::checked_product(s, "the global shape");  // throws, never wraps (core/checked_size.hpp)
}

}  // namespace tensor::detail

/// @brief A global array of `T` of rank `Rank`, laid out by `Sharding` (a `named_sharding`), each
/// local device's block in a row-major `Kokkos::View` in `Space`.
/// A `sharded_tensor` is a handle: copies share the blocks (as `Kokkos::View` and `jax.Array`).
template <class T, std::size_t Rank, sharding_type Sharding, class Space = default_memory_space>
class sharded_tensor {
  static_assert(Sharding::template check_rank<Rank>());

 public:
  /// Tag that opts the type into the `sharded_tensor_type` concept.
  using is_sharded_tensor = void;
  /// The element type.
  using value_type = T;
  /// How the array is split over the mesh.
  using sharding_type = Sharding;
  /// The mesh of the sharding.
  using mesh_type = typename Sharding::mesh_type;
  /// The partition spec of the sharding.
  using spec_type = typename Sharding::spec_type;
  /// The Kokkos memory space the blocks live in.
  using memory_space = Space;
  /// A block's storage: a row-major `Kokkos::View` in `Space`.
  using view_type = tensor::detail::block_view_t<T, Rank, Space>;
  /// A shape: one extent per dimension.
  using shape_type = std::array<std::size_t, Rank>;
  /// Which block of the global array each device holds.
  using layout_type = shard_layout<Sharding, Rank>;
  /// The type of a block inside `shard_map`: varying over the spec's axes.
  using local_type = entry_local_t<T, Rank, Sharding, Space>;
  /// The number of dimensions.
  static constexpr std::size_t rank = Rank;

  /// Zero blocks for every device of the mesh (the thread-communicator case).
  /// @throws sharding_error when the shape does not fit the sharding (see `shard_layout`).
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape)
      : sharded_tensor(sharding, global_shape, all_devices(sharding)) {}

  /// Zero blocks for the devices in `local_devices` only (one process of a multi-process run).
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape, std::span<const std::size_t> local_devices)
      : layout_(sharding, global_shape), blocks_(sharding.mesh().size()), local_(sharding.mesh().size(), false) {
    experimental::checked_bytes<T>(size(), "the byte count of the global shape");
    for (std::size_t dev : local_devices) {
      if (dev >= blocks_.size())
        throw sharding_error("meshlib: sharded_tensor: local device " + std::to_string(dev) + " is not in mesh " +
                             sharding.mesh().to_string());
      blocks_[dev] = tensor::detail::allocate<T, Rank, Space>(layout_.local_shape(dev), "meshlib::sharded_tensor");
      local_[dev] = true;
    }
  }

  /// Wraps existing blocks: `blocks[dev]` is device `dev`'s block (or an empty view where not local).
  /// @throws sharding_error when a local block's shape is not the one the layout gives.
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape, std::vector<view_type> blocks,
                 std::vector<bool> local)
      : layout_(sharding, global_shape), blocks_(std::move(blocks)), local_(std::move(local)) {
    if (blocks_.size() != sharding.mesh().size() || local_.size() != blocks_.size())
      throw sharding_error("meshlib: sharded_tensor needs one block entry per device of " + sharding.mesh().to_string());
    for (std::size_t dev = 0; dev < blocks_.size(); ++dev)
      if (local_[dev] && tensor::detail::extents_of(blocks_[dev]) != layout_.local_shape(dev))
        throw sharding_error("meshlib: sharded_tensor: device " + std::to_string(dev) + "'s block has shape " +
                             experimental::describe_shape(tensor::detail::extents_of(blocks_[dev])) + " but " + sharding.to_string() +
                             " on global shape " + experimental::describe_shape(global_shape) + " gives it shape " +
                             experimental::describe_shape(layout_.local_shape(dev)));
  }

  /// How the array is split over the mesh.
  [[nodiscard]] const Sharding& sharding() const noexcept { return layout_.sharding(); }
  /// The mesh the blocks lie on.
  [[nodiscard]] const mesh_type& mesh() const noexcept { return layout_.sharding().mesh(); }
  /// Which block each device holds.
  [[nodiscard]] const layout_type& layout() const noexcept { return layout_; }
  /// The shape of the whole (global) array.
  [[nodiscard]] const shape_type& global_shape() const noexcept { return layout_.global_shape(); }
  /// The global extent of dimension `d`.
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return layout_.global_shape()[d]; }
  /// Number of elements of the global array.
  [[nodiscard]] std::size_t size() const noexcept { return tensor::detail::shape_size(global_shape()); }
  /// The number of devices of the mesh, local or not.
  [[nodiscard]] std::size_t num_devices() const noexcept { return blocks_.size(); }

  /// Whether this process holds device `dev`'s block.
  [[nodiscard]] bool is_local(std::size_t dev) const noexcept { return dev < local_.size() && local_[dev]; }
  /// The devices whose blocks this process holds, ascending.
  [[nodiscard]] std::vector<std::size_t> local_devices() const {
    std::vector<std::size_t> out;
    for (std::size_t d = 0; d < local_.size(); ++d)
      if (local_[d]) out.push_back(d);
    return out;
  }
  /// Whether this process holds every block.
  [[nodiscard]] bool fully_local() const noexcept { return std::all_of(local_.begin(), local_.end(), [](bool b) { return b; }); }

  /// Device `dev`'s block. @throws sharding_error when it is not local.
  [[nodiscard]] const view_type& local(std::size_t dev) const {
    check_local(dev, "local");
    return blocks_[dev];
  }
  /// Device `dev`'s block as the value `shard_map` hands the device (shares memory).
  [[nodiscard]] local_type local_value(std::size_t dev) const { return local_type(local(dev), mesh(), dev); }
  /// Offsets and extents of device `dev`'s block in the global array.
  [[nodiscard]] block<Rank> block_of(std::size_t dev) const noexcept { return layout_.block_of(dev); }
  /// Where device `dev`'s block starts in the global array.
  [[nodiscard]] shape_type offsets(std::size_t dev) const noexcept { return layout_.block_of(dev).offset; }
  /// The shape of device `dev`'s block.
  [[nodiscard]] shape_type local_shape(std::size_t dev) const noexcept { return layout_.local_shape(dev); }

  /// The global array, row-major, each element read from the first local device holding it.
  /// @throws sharding_error when some element has no local holder.
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size());
    const std::size_t n = num_devices();
    // Walk replica groups: the first local member of each group supplies the block.
    std::vector<bool> covered(n, false);
    for (std::size_t dev = 0; dev < n; ++dev) {
      if (covered[dev]) continue;
      const auto reps = layout_.replicas(dev);
      std::size_t src = n;
      for (auto r : reps) {
        covered[r] = true;
        if (src == n && local_[r]) src = r;
      }
      const block<Rank> b = layout_.block_of(dev);
      if (b.size() == 0) continue;
      if (src == n)
        throw sharding_error("meshlib: to_host: block " + block_string(b) + " is held by devices " +
                             experimental::describe_devices(reps) + ", none of them local to this process");
      copy_block_out(src, b, out.data());
    }
    return out;
  }

  /// Prints `sharded_tensor<(8, 6), named_sharding(mesh{'data': 2}, P<"data">)>`.
  friend std::ostream& operator<<(std::ostream& os, const sharded_tensor& t) {
    return os << "sharded_tensor<" << experimental::describe_shape(t.global_shape()) << ", " << t.sharding() << '>';
  }
  /// The array as `operator<<` prints it: global shape and sharding.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  static std::vector<std::size_t> all_devices(const Sharding& s) {
    std::vector<std::size_t> d(s.mesh().size());
    std::iota(d.begin(), d.end(), std::size_t{0});
    return d;
  }
  static std::string block_string(const block<Rank>& b) {
    std::ostringstream os;
    os << b;
    return os.str();
  }
  void check_local(std::size_t dev, const char* what) const {
    if (dev >= local_.size() || !local_[dev])
      throw sharding_error(std::string("meshlib: sharded_tensor::") + what + ": device " + std::to_string(dev) +
                           (dev >= local_.size() ? " is not in mesh " + mesh().to_string()
                                                 : std::string(" is not local to this process")));
  }

  void copy_block_out(std::size_t dev, const block<Rank>& b, T* out) const {
    auto host = Kokkos::create_mirror_view(blocks_[dev]);
    if constexpr (!tensor::detail::host_accessible_v<Space>) Kokkos::deep_copy(host, blocks_[dev]);
    const T* src = host.data();
    tensor::detail::for_each_in_block(b, [&](std::size_t i, const shape_type& g) { out[tensor::detail::flat_index(global_shape(), g)] = src[i]; });
  }

  layout_type layout_;
  std::vector<view_type> blocks_;
  std::vector<bool> local_;
};

/// @brief A type that is a `sharded_tensor<...>`.
template <class T>
concept sharded_tensor_type = requires { typename std::remove_cvref_t<T>::is_sharded_tensor; };
/// @brief True for `sharded_tensor` types (the `sharded_tensor_type` concept as a value).
template <class T>
inline constexpr bool is_sharded_tensor_v = sharded_tensor_type<T>;

namespace tensor::detail {

/// Builds a tensor whose local blocks `fill(dev, block, T* host_data)` writes, row-major.
template <class T, std::size_t Rank, sharding_type S, class Space, class F>
sharded_tensor<T, Rank, S, Space> fill_blocks(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                              std::span<const std::size_t> local_devices, F&& fill) {
  sharded_tensor<T, Rank, S, Space> t(sharding, shape, local_devices);
  for (std::size_t dev : local_devices) {
    const auto& v = t.local(dev);
    auto host = Kokkos::create_mirror_view(v);
    fill(dev, t.block_of(dev), host.data());
    if constexpr (!host_accessible_v<Space>) Kokkos::deep_copy(v, host);
  }
  return t;
}

template <class S>
std::vector<std::size_t> every_device(const S& s) {
  std::vector<std::size_t> d(s.mesh().size());
  std::iota(d.begin(), d.end(), std::size_t{0});
  return d;
}

}  // namespace tensor::detail

/// @brief Scatters a global row-major host array into blocks (`jax.device_put(x, sharding)`).
/// @throws sharding_error when `data.size()` is not the product of `shape`, or the shape does not fit.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
sharded_tensor<std::remove_const_t<T>, Rank, S, Space> from_host(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                                                 std::span<T> data,
                                                                 std::span<const std::size_t> local_devices = {}) {
  using U = std::remove_const_t<T>;
  if (data.size() != tensor::detail::shape_size(shape))
    throw sharding_error("meshlib: from_host: global shape " + experimental::describe_shape(shape) + " has " +
                         std::to_string(tensor::detail::shape_size(shape)) + " elements but the host array has " +
                         std::to_string(data.size()));
  const auto all = tensor::detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  return tensor::detail::fill_blocks<U, Rank, S, Space>(sharding, shape, local_devices,
                                                [&](std::size_t, const block<Rank>& b, U* out) {
                                                  tensor::detail::for_each_in_block(b, [&](std::size_t i, const auto& g) {
                                                    out[i] = data[tensor::detail::flat_index(shape, g)];
                                                  });
                                                });
}

/// @brief `from_host` for a `std::vector`.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> from_host(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                            const std::vector<T>& data, std::span<const std::size_t> local_devices = {}) {
  return from_host<Space>(sharding, shape, std::span<const T>(data), local_devices);
}

/// @brief Builds each local block by a callback, as `jax.make_array_from_callback(shape, sharding, cb)`.
/// `cb` is called either per block as `cb(device, block<Rank> b, Kokkos::View host_block)` (fill the
/// view: `b.offset` / `b.extent` say where it lies in the global array), or per element as
/// `cb(std::array<std::size_t, Rank> global_index) -> T`.
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S, class F>
sharded_tensor<T, Rank, S, Space> make_array_from_callback(const std::array<std::size_t, Rank>& shape, const S& sharding,
                                                           F&& cb, std::span<const std::size_t> local_devices = {}) {
  const auto all = tensor::detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  using view_t = tensor::detail::block_view_t<T, Rank, Space>;
  using host_t = typename view_t::HostMirror;
  if constexpr (std::invocable<F&, const std::array<std::size_t, Rank>&>) {
    return tensor::detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t, const block<Rank>& b, T* out) {
      tensor::detail::for_each_in_block(b, [&](std::size_t i, const auto& g) { out[i] = static_cast<T>(cb(g)); });
    });
  } else {
    static_assert(std::invocable<F&, std::size_t, const block<Rank>&, const host_t&>,
                  "meshlib: make_array_from_callback: the callback must be invocable as cb(global_index) -> T or as "
                  "cb(device, block, host_view)");
    return tensor::detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t dev, const block<Rank>& b, T* out) {
      host_t v = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return host_t(out, b.extent[I]...);
      }(std::make_index_sequence<Rank>{});
      cb(dev, b, static_cast<const host_t&>(v));
    });
  }
}

/// @brief A tensor whose every element is `value` (`jnp.full` with a sharding).
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> full(const S& sharding, const std::array<std::size_t, Rank>& shape, const T& value,
                                       std::span<const std::size_t> local_devices = {}) {
  const auto all = tensor::detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  return tensor::detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t, const block<Rank>& b, T* out) {
    std::fill(out, out + b.size(), value);
  });
}

/// @brief A tensor of zeros (`jnp.zeros` with a sharding).
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> zeros(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                        std::span<const std::size_t> local_devices = {}) {
  if (local_devices.empty()) return sharded_tensor<T, Rank, S, Space>(sharding, shape);
  return sharded_tensor<T, Rank, S, Space>(sharding, shape, local_devices);
}

/// @brief The global array as a row-major host vector (`jax.device_get` / `np.asarray`).
template <sharded_tensor_type X>
auto to_host(const X& x) {
  return x.to_host();
}

}  // namespace meshlib
