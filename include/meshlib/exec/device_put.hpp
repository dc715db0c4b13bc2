// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief JAX's names for placing an array in a sharding, for users translating JAX programs:
/// `device_put` (`jax.device_put(x, sharding)`) and `with_sharding_constraint`
/// (`jax.lax.with_sharding_constraint(x, sharding)` inside global-view code). They are thin
/// aliases: `device_put` of a host array is `from_host`, of a sharded tensor `reshard`;
/// `with_sharding_constraint` is `reshard`.
///
/// Why aliases and not new operations: JAX has two names because under `jit` a constraint is a hint
/// to the compiler and `device_put` a transfer. meshlib's global-view ops run eagerly, so both
/// mean "this array, laid out by that sharding", which `reshard` already does (a copy with the
/// same blocks when the layout already matches, as `reshard` always returns an owning result).
/// Inside `shard_map` / `spmd` a value is a per-device `local_tensor` and has no global sharding to
/// constrain; these functions take only `sharded_tensor`s and host arrays.
/// @code
/// const meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>> rows{m};
/// auto x = meshlib::device_put(host, std::array<std::size_t, 2>{8, 4}, rows);  // jax.device_put(x, rows)
/// auto y = meshlib::with_sharding_constraint<meshlib::P<meshlib::none, "data">>(meshlib::map(f, x));
/// @endcode

#include <array>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "meshlib/core/named_sharding.hpp"
#include "meshlib/exec/global_reshard.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

/// @brief `jax.device_put(x, sharding)` for a host array: the global row-major array `host` of
/// shape `shape`, scattered into the blocks of `sharding`. Same as `from_host(sharding, shape, host)`
/// (the shape comes second because a C++ span does not carry one).
/// @throws sharding_error as `from_host`: `host.size()` is not the product of `shape`, or the shape
/// does not fit the sharding.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
[[nodiscard]] auto device_put(std::span<T> host, const std::array<std::size_t, Rank>& shape, const S& sharding) {
  return from_host<Space>(sharding, shape, host);
}

/// @brief `device_put` of a `std::vector` (see the span overload).
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
[[nodiscard]] auto device_put(const std::vector<T>& host, const std::array<std::size_t, Rank>& shape,
                              const S& sharding) {
  return from_host<Space>(sharding, shape, std::span<const T>(host));
}

/// @brief `jax.device_put(x, sharding)` for an array that is already sharded: `reshard(x, sharding)`
/// (same mesh; the shard rule may differ), on `default_runner`.
/// @throws sharding_error as `reshard`.
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] auto device_put(const X& x, const To& sharding) {
  return reshard(x, sharding);
}

/// @brief `jax.lax.with_sharding_constraint(x, sharding)` in global-view code: `x` laid out by
/// `sharding` (`reshard(x, sharding)`), so the code that follows sees that layout in its type.
/// @throws sharding_error as `reshard`.
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] auto with_sharding_constraint(const X& x, const To& sharding) {
  return reshard(x, sharding);
}

/// @brief `with_sharding_constraint(x, P(...))` with the spec only: `reshard<ToSpec>(x)` (same mesh
/// and shard rule).
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] auto with_sharding_constraint(const X& x) {
  return reshard<ToSpec>(x);
}

}  // namespace meshlib
